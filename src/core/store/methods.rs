//! The inherent twins of [`LockBackend`](crate::LockBackend)'s methods that every public
//! backend has, so that an application calls `backend.lock(..)` without importing the
//! trait.

/// Expands, inside a backend's `impl` block, to `lock`, `lock_many`, `leader`, `job`, `inspect`,
/// `inspect_permits`, `list_held`, `force_release` and `force_release_permits`, in that order, each
/// calling the trait's method of the same name (which goes to the core through
/// `Sealed::store`). The docs of `inspect` and `force_release`, which say what the store
/// does, are the caller's.
macro_rules! lock_backend_methods {
    (
        $(#[$inspect:meta])*
        fn inspect;
        $(#[$force_release:meta])*
        fn force_release;
    ) => {
        /// Starts building an acquisition of `key` (see [`LockRequest`]).
        ///
        /// [`LockRequest`]: crate::LockRequest
        pub fn lock(&self, key: impl Into<String>) -> crate::LockRequest {
            crate::LockBackend::lock(self, key)
        }

        /// Starts building an acquisition of every key of `keys` at once, all or none (see
        /// [`ManyLockRequest`](crate::ManyLockRequest)).
        pub fn lock_many<I>(&self, keys: I) -> crate::ManyLockRequest
        where
            I: IntoIterator,
            I::Item: Into<String>,
        {
            crate::LockBackend::lock_many(self, keys)
        }

        /// A campaign for the leadership of `name` among every instance on this store (see
        /// [`LockBackend::leader`]).
        ///
        /// [`LockBackend::leader`]: crate::LockBackend::leader
        pub fn leader(&self, name: impl Into<String>) -> crate::LeaderRequest {
            crate::LockBackend::leader(self, name)
        }

        /// A job that runs at most once per period across every instance on this store (see
        /// [`IdempotencyBackend::job`]).
        ///
        /// [`IdempotencyBackend::job`]: crate::idempotency::IdempotencyBackend::job
        pub fn job(&self, name: impl Into<String>) -> crate::JobRequest {
            crate::idempotency::IdempotencyBackend::job(self, name)
        }

        $(#[$inspect])*
        pub fn inspect(
            &self,
            key: impl Into<String>,
        ) -> impl Future<Output = Result<crate::LockInfo, crate::LockError>> + Send + 'static {
            crate::LockBackend::inspect(self, key)
        }

        /// A snapshot of `key`'s semaphore (see [`LockBackend::inspect_permits`]).
        ///
        /// [`LockBackend::inspect_permits`]: crate::LockBackend::inspect_permits
        pub fn inspect_permits(
            &self,
            key: impl Into<String>,
        ) -> impl Future<Output = Result<crate::LockInfo, crate::LockError>> + Send + 'static {
            crate::LockBackend::inspect_permits(self, key)
        }

        /// Every lock and semaphore held now under `prefix`, sorted by key (see
        /// [`LockBackend::list_held`]).
        ///
        /// [`LockBackend::list_held`]: crate::LockBackend::list_held
        pub fn list_held(
            &self,
            prefix: impl Into<String>,
        ) -> impl Future<Output = Result<Vec<crate::LockInfo>, crate::LockError>> + Send + 'static
        {
            crate::LockBackend::list_held(self, prefix)
        }

        $(#[$force_release])*
        pub fn force_release(
            &self,
            key: impl Into<String>,
        ) -> impl Future<Output = Result<crate::LockInfo, crate::LockError>> + Send + 'static {
            crate::LockBackend::force_release(self, key)
        }

        /// Frees every permit of `key`'s semaphore (see
        /// [`LockBackend::force_release_permits`]).
        ///
        /// [`LockBackend::force_release_permits`]: crate::LockBackend::force_release_permits
        pub fn force_release_permits(
            &self,
            key: impl Into<String>,
        ) -> impl Future<Output = Result<crate::LockInfo, crate::LockError>> + Send + 'static {
            crate::LockBackend::force_release_permits(self, key)
        }
    };
}

pub(crate) use lock_backend_methods;

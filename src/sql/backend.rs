//! What the public SQL backends and their builders have alike, expanded into each by
//! [`sql_backend!`].

/// Expands, for the SQL backend `$backend` (a struct whose `inner` is an
/// `Arc<Core<SqlStore<_>>>`) configured by `$builder` on a `$pool`, to the backend's
/// inherent methods (`connect`, `builder`, `from_pool`, `schema_sql`, the lock methods of
/// [`lock_backend_methods!`], `stats`, `namespace`, `table`), its trait impls (`Debug`,
/// `LockBackend`, `IdempotencyBackend`) and the builder's setters both SQL stores take
/// (the SQL settings `migrate`, `table` and `fence_ttl`, in the builder's field `config`, a
/// [`Config`](crate::sql::Config), and those of `store_setters!`, in its field
/// `settings`), all documented once here. The store gives the function that writes
/// its schema and the words its docs differ in: the URL's form, what its schema's routines
/// are, the schema's file and the client that runs it, where the table lives, the default
/// `fence_ttl`, what one call is, the connection waiters are woken through, and what
/// `command_timeout` bounds besides.
///
/// [`lock_backend_methods!`]: crate::core::lock_backend_methods
macro_rules! sql_backend {
    (
        $backend:ident, $builder:ident, $pool:ty,
        url: $url:literal,
        schema: $schema_sql:path, $schema:literal, $client:literal,
        routines: $routines:literal,
        table_in: $table_in:literal,
        fence_ttl: $fence_ttl:literal,
        call: $call:literal,
        wake: $wake:literal,
        command: $command:literal $(,)?
    ) => {
        impl $backend {
            #[doc = concat!(
                "Connects with default settings (the schema must be there: see [`migrate`](",
                stringify!($builder),
                "::migrate))."
            )]
            pub async fn connect(url: &str) -> Result<Self, crate::BuildError> {
                Self::builder(url).build().await
            }

            #[doc = concat!(
                "Starts configuring a backend for the database at `url` (`", $url, "`)."
            )]
            pub fn builder(url: impl Into<String>) -> $builder {
                $builder::new(crate::sql::Target::Url(url.into()))
            }

            #[doc = concat!(
                "Starts configuring a backend on the application's own pool. Calls take its ",
                "connections one ", $call, " at a time; the ", $wake, " is opened apart with ",
                "the pool's connect options, so it does not take one of the pool's for good."
            )]
            pub fn from_pool(pool: $pool) -> $builder {
                $builder::new(crate::sql::Target::Pool(pool))
            }

            #[doc = concat!(
                "The SQL that creates (or upgrades) the lock table `table`, its other tables ",
                "and ", $routines, ", as ", $client, " runs it: what [`migrate`](",
                stringify!($builder), "::migrate) runs, to run by hand or put in a migration ",
                "tool instead. For the default table it is `", $schema, "`."
            )]
            pub fn schema_sql(table: &str) -> Result<String, crate::BuildError> {
                $schema_sql(table)
            }

            crate::core::lock_backend_methods! {
                #[doc = concat!(
                    "A snapshot of `key`'s lock: how it is held, for how long, and the fencing ",
                    "token reached (see [`LockBackend::inspect`](crate::LockBackend::inspect)). ",
                    "One ", $call, "; changes nothing."
                )]
                fn inspect;
                #[doc = concat!(
                    "Frees `key`'s lock whatever holds it, fenced; the holder sees `lost()` ",
                    "within a round trip or two through the namespace's admin channel, which ",
                    "every backend's ", $wake, " listens on, at the latest at its next renewal ",
                    "(see [`LockBackend::force_release`](crate::LockBackend::force_release)). ",
                    "Returns what was freed."
                )]
                fn force_release;
            }

            #[doc = concat!("A snapshot of the backend's ", $wake, " and bookkeeping.")]
            pub fn stats(&self) -> crate::BackendStats {
                self.inner.stats(self.inner.store.wake.wakeups())
            }

            /// The namespace that prefixes every lock name of this backend.
            pub fn namespace(&self) -> &str {
                &self.inner.store.namespace
            }

            /// The lock table's name.
            pub fn table(&self) -> &str {
                &self.inner.store.table
            }
        }

        impl std::fmt::Debug for $backend {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($backend))
                    .field("table", &self.inner.store.table)
                    .field("namespace", &self.inner.store.namespace)
                    .field("instance", &self.inner.owners.instance())
                    .finish_non_exhaustive()
            }
        }

        impl crate::lock::backend::Sealed for $backend {
            fn store(&self) -> std::sync::Arc<dyn crate::lock::backend::Backend> {
                self.inner.clone()
            }
        }

        impl crate::backend::LockBackend for $backend {}

        impl crate::idempotency::RecordsOf for $backend {
            fn records(&self) -> std::sync::Arc<dyn crate::idempotency::Records> {
                crate::sql::SqlRecords::new(
                    self.inner.store.clone(),
                    self.inner.settings.command_timeout,
                )
            }
        }

        impl crate::idempotency::IdempotencyBackend for $backend {}

        impl $builder {
            #[doc = concat!(
                "Creates the lock tables and their ", $routines, " at build if the database ",
                "lacks them, and upgrades them if they are older (idempotent, and serialized ",
                "across instances that build at once). Without it, `build` refuses a database ",
                "that lacks them and names the SQL file to run (`", $schema, "` in this crate, ",
                "or [`", stringify!($backend), "::schema_sql`]): for deployments where the ",
                "application's database user may not create tables or ", $routines, "."
            )]
            pub fn migrate(mut self) -> Self {
                self.config.migrate = true;
                self
            }

            #[doc = concat!(
                "The lock table's name (default `tower_lock`): its ", $routines, " and other ",
                "tables are named after it (`tower_lock_acquire`, `tower_lock_holders`, ...). ",
                "A lower-case identifier of at most 48 bytes, in ", $table_in, "."
            )]
            pub fn table(mut self, table: impl Into<String>) -> Self {
                self.config.table = table.into();
                self
            }

            #[doc = concat!(
                "How long a name's row, with its fencing counter, is kept once nobody holds or ",
                "waits for it (default ", $fence_ttl, ", at least 1 s); the janitor deletes it ",
                "within a quarter of that more. Tokens never fall below the server clock in ",
                "microseconds, so after that the clock alone keeps them increasing, provided it ",
                "never steps back by more than this."
            )]
            pub fn fence_ttl(mut self, ttl: std::time::Duration) -> Self {
                self.config.fence_ttl = ttl;
                self
            }

            $crate::core::kit::settings::store_setters! {
                settings;
                #[doc = concat!(
                    "Ignored by [`from_pool`](", stringify!($backend), "::from_pool). Each call ",
                    "takes one for a single ", $call, ": a held lock never keeps one. The ", $wake,
                    " is one more, of its own."
                )]
                fn pool_size = 8;
                /// On a SQL store it prefixes every lock name in the table.
                fn namespace;
                fn max_key_len;
                /// A connection from the pool is waited for as long: a pool that stays exhausted
                /// this long fails the call (503 from the layer).
                fn connect_timeout = "1 s";
                #[doc = $command]
                fn command_timeout = "1 s";
                fn max_local_handoffs;
                fn max_local_handoff_time;
            }
        }
    };
}

pub(crate) use sql_backend;

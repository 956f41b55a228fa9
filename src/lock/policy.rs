//! Hold policies: which kind of hold a [`LockLayer`](crate::LockLayer) takes for each
//! request. The layer's second type parameter, set by its builder methods:
//!
//! | builder | policy | hold |
//! |---|---|---|
//! | [`LockLayer::new`](crate::LockLayer::new) | [`Exclusive`] | the lock, one request at a time |
//! | [`.read_write()`](crate::LockLayer::read_write) | [`ReadWrite`] | shared for `GET`, `HEAD` and `OPTIONS`, exclusive otherwise |
//! | [`.shared_if(f)`](crate::LockLayer::shared_if) | [`SharedIf`] | shared where `f(&request)` is true, exclusive otherwise |
//! | [`.permits(n)`](crate::LockLayer::permits) | [`Permits`] | one of `n` permits |
//!
//! ```
//! use axum::{Router, extract::Request, routing::get};
//! use tower_lock::{LockLayer, MemoryBackend, PathParam};
//! use tower_lock::lock::policy::ReadWrite;
//!
//! let documents: LockLayer<PathParam, ReadWrite> =
//!     LockLayer::new(MemoryBackend::new(), PathParam::new("id").prefix("doc")).read_write();
//! let app: Router = Router::new()
//!     .route("/docs/{id}", get(|| async { "read" }).put(|| async { "written" }))
//!     .route_layer(documents);
//! ```

use std::fmt;

use http::{Method, Request};

use crate::lock::Kind;

/// Decides the kind of hold a [`LockLayer`](crate::LockLayer) takes for a request whose
/// body is `B`. Sealed: the policies are the types of this module.
pub trait HoldPolicy<B>: sealed::Sealed<B> + Clone + Send + Sync + 'static {}

impl<B, P: sealed::Sealed<B> + Clone + Send + Sync + 'static> HoldPolicy<B> for P {}

mod sealed {
    /// The decision itself, out of reach of other crates (its `Kind` is not public).
    pub trait Sealed<B> {
        fn kind(&self, request: &http::Request<B>) -> crate::lock::Kind;
    }
}

/// The default policy: every request takes the lock exclusively.
#[derive(Debug, Clone, Copy, Default)]
pub struct Exclusive;

impl<B> sealed::Sealed<B> for Exclusive {
    fn kind(&self, _: &Request<B>) -> Kind {
        Kind::Exclusive
    }
}

/// Read/write: `GET`, `HEAD` and `OPTIONS` requests take shared holds (any number at once),
/// every other method the exclusive one (see
/// [`LockRequest::shared`](crate::LockRequest::shared)). Set by
/// [`LockLayer::read_write`](crate::LockLayer::read_write).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadWrite;

impl<B> sealed::Sealed<B> for ReadWrite {
    fn kind(&self, request: &Request<B>) -> Kind {
        let method = request.method();
        if method == Method::GET || method == Method::HEAD || method == Method::OPTIONS {
            Kind::Shared
        } else {
            Kind::Exclusive
        }
    }
}

/// Shared holds for the requests a closure picks, the exclusive one for the others. Set by
/// [`LockLayer::shared_if`](crate::LockLayer::shared_if).
#[derive(Clone, Copy)]
pub struct SharedIf<F>(pub(crate) F);

impl<F> fmt::Debug for SharedIf<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedIf").finish_non_exhaustive()
    }
}

impl<B, F> sealed::Sealed<B> for SharedIf<F>
where
    F: Fn(&Request<B>) -> bool,
{
    fn kind(&self, request: &Request<B>) -> Kind {
        if (self.0)(request) {
            Kind::Shared
        } else {
            Kind::Exclusive
        }
    }
}

/// Every request takes one of a number of permits of its key's semaphore (see
/// [`LockRequest::permits`](crate::LockRequest::permits)). Set by
/// [`LockLayer::permits`](crate::LockLayer::permits).
#[derive(Debug, Clone, Copy)]
pub struct Permits(pub(crate) u32);

impl Permits {
    /// How many permits each key has.
    pub fn permits(&self) -> u32 {
        self.0
    }
}

impl<B> sealed::Sealed<B> for Permits {
    fn kind(&self, _: &Request<B>) -> Kind {
        Kind::Permit(self.0)
    }
}

//! Request-scoped distributed locks for [axum] and [tower] services, on Redis (one server,
//! Sentinel, Cluster or a RedLock quorum), PostgreSQL, MySQL/MariaDB, etcd, ZooKeeper or in
//! memory.
//!
//! Services that run as several instances need one lock per business key (an order, a
//! product's stock, an idempotency key) held for exactly as long as the request handler
//! runs. [`LockLayer`] pulls the key out of each request, takes a Redisson-style reentrant
//! lock, keeps it renewed while the handler runs, and releases it on every exit path
//! (return, panic, cancellation). Contention becomes HTTP: 409 when the route does not
//! wait, 503 with `Retry-After` when waiting ran out or the store is unreachable, 400 for
//! a bad key. Read/write locks (many readers or one writer), semaphores (at most `n`
//! holders, 429 when all permits are taken) and locks of several keys at once come with
//! the same guarantees.
//!
//! ```
//! use axum::{Router, routing::post};
//! use tower_lock::{HeldLock, LockLayer, MemoryBackend, PathParam};
//!
//! // `HeldLock` is an axum extractor: the lock this request holds.
//! async fn pay(lock: HeldLock) -> String {
//!     // Send the fencing token with every write the lock protects.
//!     format!("paid under token {}", lock.fencing_token())
//! }
//!
//! // `RedisBackend::connect("redis://...").await?` across instances; the in-process
//! // `MemoryBackend` has the same semantics, for tests and single instances.
//! let backend = MemoryBackend::new();
//! let app: Router = Router::new()
//!     .route("/orders/{id}/pay", post(pay))
//!     .route_layer(LockLayer::new(backend, PathParam::new("id").prefix("order")));
//! ```
//!
//! # The API
//!
//! What an application types is at the root:
//!
//! - [`LockLayer`]: the middleware and its settings (wait or fail fast, lease, what to do
//!   when a lock is lost ([`OnLockLost`]), holding until the body is sent, rejections),
//!   exclusive by default, read/write (`.read_write()`, `.shared_if(f)`) or a semaphore
//!   (`.permits(n)`).
//! - [`KeyExtractor`]: closures that return the key (or refuse with 400), and the
//!   ready-made [`PathParam`], [`PathParams`], [`Header`] and [`QueryParam`].
//! - The backend of each store (see [Stores](#stores)), with its builder: where locks live
//!   ([`LockBackend`], [`BackendStats`]).
//! - [`LockBackend::lock`] ([`LockRequest`], [`LockGuard`], [`LockOwner`]): locks without
//!   HTTP, for jobs and nested sections; [`LockBackend::lock_many`] ([`ManyLockRequest`])
//!   for several keys at once (a key closure returning a `Vec` does the same on the layer).
//! - [`LockBackend::inspect`] and [`LockBackend::force_release`]: for operators, a
//!   snapshot of a key ([`LockInfo`], [`LockMode`]: how it is held, for how long, the
//!   fencing token reached; never owner ids) and freeing it by force, fenced, its holder
//!   told.
//! - [`HeldLock`] (an axum extractor): the handler's view of its lock: key, fencing
//!   token, `lost()`; [`HeldLocks`] lists every lock of nested layers.
//! - [`LockBackend::leader`] ([`LeaderRequest`], [`Leadership`]): one leader per name among
//!   the instances, its work dropped as soon as the leadership is lost; `backend.job(name)`
//!   ([`JobRequest`], [`JobRun`]): work that runs at most once per period across them, on
//!   the store's clock.
//! - [`IdempotencyLayer`]: `Idempotency-Key` on top of the lock: the first request runs,
//!   retries get its stored response, 409 while it runs, 422 for a different request.
//! - The errors: [`LockError`] (with [`KeyError`] and [`BackendError`]), [`BuildError`]
//!   (with [`ConnectFailure`]) and [`IdempotencyError`].
//!
//! The plumbing is in a module per middleware or API, as in tower-http:
//!
//! - [`layer`]: the layer's service, response future and body, and its default wait;
//!   [`layer::response`]: the status codes and problem+json bodies of rejections;
//!   `layer::grpc` (feature `grpc`): rejections as gRPC statuses for tonic services
//!   ([`LockLayer::grpc`], `From<LockError> for tonic::Status`).
//! - [`lock`]: the defaults and bounds of acquisitions and of every backend's builder
//!   (lease, local waiters, keys, handoffs), the `HeldLock` extractor's rejection, and the
//!   layer's hold [`policy`](lock::policy).
//! - [`idempotency`]: the idempotency layer's service, future and bodies, its defaults,
//!   its default rejection and the trait of the backends that keep its records.
//! - [`key`]: the sealed traits naming what a key closure may return.
//! - [`redis`]: [`FencedStore`](redis::FencedStore), a store in the lock's Redis that
//!   refuses writes with stale tokens, and the Redis builder's defaults.
//!
//! # Stores
//!
//! The list of stores. Each is a backend type with its builder, behind a cargo feature of
//! the store's name, off by default (Redis and memory are always built). Every backend
//! implements [`LockBackend`]: the layer, the lock API, the guarantees and the status
//! codes are the same on all of them, and only the line that builds the backend changes.
//!
//! | store | feature | backend |
//! |---|---|---|
//! | Redis: one server, [Sentinel](RedisBackend::sentinel), [Cluster](RedisBackend::cluster) or a [RedLock quorum](RedisBackend::quorum) of independent masters; scripts, waiters woken by pub/sub | (always) | [`RedisBackend`] |
//! | PostgreSQL: a table, through sqlx, waiters woken by `LISTEN`/`NOTIFY` | `postgres` | `PostgresBackend` |
//! | MySQL 8 or MariaDB: InnoDB tables, through sqlx, waiters woken by a parked connection that a release interrupts | `mysql` | `MySqlBackend` |
//! | etcd: every hold under the backend's lease, tokens from etcd's revisions, through etcd-client (whose build needs `protoc`) | `etcd` | `EtcdBackend` |
//! | ZooKeeper: Curator's recipes, every hold an ephemeral sequential node of the backend's session, tokens from the nodes' zxids, through zookeeper-client | `zookeeper` | `ZooKeeperBackend` |
//! | In memory, one process (tests, single instances) | (always) | [`MemoryBackend`] |
//!
//! # Guides
//!
//! - [Semantics](guide::semantics): what a lock guarantees, the operator calls, and every
//!   status code.
//! - [Recipes](guide::recipes): keys per route, rejections, timeouts, streaming, jobs,
//!   several keys, readers and writers, an admin route, testing, services without axum.
//! - [Choosing settings](guide::settings): lease, wait, bounds, timeouts and failover
//!   settings for a given handler and failover budget; what each failure looks like.
//! - [Deployments and failover](guide::deployments): what `build()` checks, TLS, ACL
//!   users, Sentinel, Cluster, restarts and data loss.
#![cfg_attr(
    feature = "postgres",
    doc = "- [PostgreSQL](guide::postgres): the PostgreSQL store, its schema, rights and failures."
)]
#![cfg_attr(
    feature = "mysql",
    doc = "- [MySQL and MariaDB](guide::mysql): the MySQL store, its schema, how waiters are \
           woken without polling, users and `KILL`, MySQL 8 and MariaDB, failures."
)]
#![cfg_attr(
    feature = "etcd",
    doc = "- [etcd](guide::etcd): the etcd store, its lease as the watchdog, revisions as \
           tokens, leader failover."
)]
#![cfg_attr(
    feature = "zookeeper",
    doc = "- [zookeeper](guide::zookeeper): the ZooKeeper store, Curator's recipes, its \
           session as the watchdog, zxids as tokens."
)]
//! - [Fencing](guide::fencing): fencing tokens, [`FencedStore`](redis::FencedStore), a guarded `UPDATE` in
//!   PostgreSQL, tokens and the clock.
//! - [Idempotency keys](guide::idempotency): [`IdempotencyLayer`], a payments route, what
//!   is stored and for how long, crashes.
//! - [Metrics](guide::metrics): the `metrics` feature, its metrics and labels.
//! - [Reliability](guide::reliability): the fault tests and the Jepsen test.
//! - [Performance](guide::performance): the benchmark and how to read it.
//!
//! # Features
//!
//! The layer is a plain tower layer over `http` requests and any response body. The
//! default-on `axum` feature adds what needs axum: [`PathParam`], the [`HeldLock`] and
//! [`HeldLocks`] extractors, `IntoResponse` for [`LockError`], and letting a request
//! axum's router sent to its 404 fallback through unlocked. Without it, read the lock
//! from the request extensions and answer rejections with
//! [`default_rejection`](layer::response::default_rejection).
//!
//! The default-on `tls` feature lets [`RedisBackend`] speak `rediss://` through rustls,
//! verified against the system roots or
//! [`tls_root_cert`](RedisBackendBuilder::tls_root_cert); the crate installs ring as the
//! process's rustls crypto provider when none is installed.
//!
//! Each store but Redis and memory is a feature of its own, off by default (see
//! [Stores](#stores)).
//!
//! The `metrics` feature (off by default) records acquisitions by outcome, wait and hold
//! times, held locks, waiters, subscriptions, reconnects and failed renewals through the
//! [`metrics`](https://docs.rs/metrics) facade, labelled by namespace, route and kind of
//! hold, never by key; the application installs the exporter (see
//! [the guide](guide::metrics)).
//!
//! [axum]: https://docs.rs/axum
//! [tower]: https://docs.rs/tower
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs, unsafe_code)]
#![warn(rust_2018_idioms, missing_debug_implementations)]

// The names an application types are at the root; the plumbing (services, futures,
// bodies, defaults, sealed helper traits) is in the public module of its middleware or
// API, as in tower-http.
mod backend;
mod core;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
mod extract;
pub mod idempotency;
pub mod job;
pub mod key;
pub mod layer;
pub mod leader;
pub mod lock;
mod memory;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql;
mod telemetry;
#[cfg(feature = "zookeeper")]
mod zookeeper;

pub use crate::backend::{BackendStats, LockBackend};
pub use crate::error::{BackendError, BuildError, ConnectFailure, KeyError, LockError};
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use crate::etcd::{EtcdBackend, EtcdBackendBuilder};
pub use crate::extract::{Header, QueryParam};
#[cfg(feature = "axum")]
pub use crate::extract::{PathParam, PathParams};
pub use crate::idempotency::{IdempotencyError, IdempotencyLayer};
pub use crate::job::{JobRequest, JobRun};
pub use crate::key::KeyExtractor;
pub use crate::layer::{LockLayer, OnLockLost};
pub use crate::leader::{LeaderRequest, Leadership};
pub use crate::lock::{
    HeldLock, HeldLocks, LockGuard, LockInfo, LockMode, LockOwner, LockRequest, ManyLockRequest,
};
pub use crate::memory::MemoryBackend;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use crate::mysql::{MySqlBackend, MySqlBackendBuilder};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use crate::postgres::{PostgresBackend, PostgresBackendBuilder};
pub use crate::redis::{RedisBackend, RedisBackendBuilder};
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use crate::telemetry::describe_metrics;
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub use crate::zookeeper::{ZooKeeperBackend, ZooKeeperBackendBuilder};
/// The etcd v3 client that [`EtcdBackend`] is built on, re-exported so that an application
/// (an operator's tool, a test) can reach the same cluster through the same version of it.
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use etcd_client;

/// The guides, also in `docs/` on the repository: each page here is its file, with every
/// snippet compiled (and, where it needs no server, run) as a doctest.
///
/// Links between guides name the files (`settings.md`), so that they work on the
/// repository; here the link definitions below, which come first and so win, point them
/// at these pages instead.
pub mod guide {
    /// Link definitions for the guides' reference-style links (see the module docs).
    macro_rules! links {
        () => {
            concat!(
                "[semantics]: crate::guide::semantics\n\
                 [recipes]: crate::guide::recipes\n\
                 [settings]: crate::guide::settings\n\
                 [deployments]: crate::guide::deployments\n\
                 [fencing]: crate::guide::fencing\n\
                 [idempotency]: crate::guide::idempotency\n\
                 [leaders]: crate::guide::leaders\n\
                 [metrics]: crate::guide::metrics\n\
                 [reliability]: crate::guide::reliability\n\
                 [performance]: crate::guide::performance\n\
                 [stores]: crate#stores\n",
                postgres_link!(),
                mysql_link!(),
                etcd_link!(),
                zookeeper_link!()
            )
        };
    }

    /// The PostgreSQL guide is a page here only with the `postgres` feature; without it,
    /// links to it go to the documentation built with every feature.
    #[cfg(feature = "postgres")]
    macro_rules! postgres_link {
        () => {
            "[postgres]: crate::guide::postgres\n"
        };
    }

    /// See the `postgres` feature's form above.
    #[cfg(not(feature = "postgres"))]
    macro_rules! postgres_link {
        () => {
            "[postgres]: https://docs.rs/tower-lock/latest/tower_lock/guide/postgres/index.html\n"
        };
    }

    /// The MySQL guide is a page here only with the `mysql` feature; without it, links to
    /// it go to the documentation built with every feature.
    #[cfg(feature = "mysql")]
    macro_rules! mysql_link {
        () => {
            "[mysql]: crate::guide::mysql\n"
        };
    }

    /// See the `mysql` feature's form above.
    #[cfg(not(feature = "mysql"))]
    macro_rules! mysql_link {
        () => {
            "[mysql]: https://docs.rs/tower-lock/latest/tower_lock/guide/mysql/index.html\n"
        };
    }

    /// The etcd guide is a page here only with the `etcd` feature; without it, links to it
    /// go to the documentation built with every feature.
    #[cfg(feature = "etcd")]
    macro_rules! etcd_link {
        () => {
            "[etcd]: crate::guide::etcd\n"
        };
    }

    /// See the `etcd` feature's form above.
    #[cfg(not(feature = "etcd"))]
    macro_rules! etcd_link {
        () => {
            "[etcd]: https://docs.rs/tower-lock/latest/tower_lock/guide/etcd/index.html\n"
        };
    }

    /// The ZooKeeper guide is a page here only with the `zookeeper` feature; without it,
    /// links to it go to the documentation built with every feature.
    #[cfg(feature = "zookeeper")]
    macro_rules! zookeeper_link {
        () => {
            "[zookeeper]: crate::guide::zookeeper\n"
        };
    }

    /// See the `zookeeper` feature's form above.
    #[cfg(not(feature = "zookeeper"))]
    macro_rules! zookeeper_link {
        () => {
            "[zookeeper]: https://docs.rs/tower-lock/latest/tower_lock/guide/zookeeper/index.html\n"
        };
    }

    #[doc = links!()]
    #[doc = include_str!("../docs/semantics.md")]
    pub mod semantics {}

    #[doc = links!()]
    #[doc = include_str!("../docs/recipes.md")]
    pub mod recipes {}

    #[doc = links!()]
    #[doc = include_str!("../docs/settings.md")]
    pub mod settings {}

    #[doc = links!()]
    #[doc = include_str!("../docs/deployments.md")]
    pub mod deployments {}

    #[doc = links!()]
    #[doc = include_str!("../docs/fencing.md")]
    pub mod fencing {}

    #[doc = links!()]
    #[doc = include_str!("../docs/idempotency.md")]
    pub mod idempotency {}

    #[doc = links!()]
    #[doc = include_str!("../docs/leaders.md")]
    pub mod leaders {}

    #[doc = links!()]
    #[doc = include_str!("../docs/metrics.md")]
    pub mod metrics {}

    #[doc = links!()]
    #[doc = include_str!("../docs/reliability.md")]
    pub mod reliability {}

    #[doc = links!()]
    #[doc = include_str!("../docs/performance.md")]
    pub mod performance {}

    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    #[doc = links!()]
    #[doc = include_str!("../docs/postgres.md")]
    pub mod postgres {}

    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    #[doc = links!()]
    #[doc = include_str!("../docs/mysql.md")]
    pub mod mysql {}

    #[cfg(feature = "etcd")]
    #[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
    #[doc = links!()]
    #[doc = include_str!("../docs/etcd.md")]
    pub mod etcd {}

    #[cfg(feature = "zookeeper")]
    #[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
    #[doc = links!()]
    #[doc = include_str!("../docs/zookeeper.md")]
    pub mod zookeeper {}
}

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

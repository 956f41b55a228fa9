//! The crate's tests, in one binary: the support (throwaway servers, HTTP helpers, the
//! store matrix) is compiled once, and each shared server or topology is started once per
//! run, the first time a test asks for it, and stopped when the run ends. A module per
//! area; the tests that need a process of their own are the other targets under `tests/`
//! (the Jepsen workload, run as root; the soak; the metrics, whose recorder is global).
//!
//! `cargo test` tests every store whose server is on this machine and ends by naming each
//! store it could not test, with the command that installs what is missing; with
//! `CI=true` (or `TOWER_LOCK_TEST_STRICT=1`) a missing server fails the run instead.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod stores;

mod acl;
mod cluster;
mod cluster_tls;
#[cfg(feature = "axum")]
mod conformance;
mod connect;
mod dataloss;
mod doc_messages;
#[cfg(all(feature = "axum", feature = "etcd"))]
mod etcd;
#[cfg(feature = "etcd")]
mod etcd_shared;
#[cfg(feature = "axum")]
mod extract;
mod faults;
mod fencing_postgres;
mod flash_sale_cli;
mod flash_sale_svg;
mod grant;
#[cfg(feature = "grpc")]
mod grpc;
mod handoff;
mod hold_body;
#[cfg(feature = "axum")]
mod idempotency;
mod inspect;
mod inspect_redis;
mod job;
#[cfg(feature = "axum")]
mod layer;
mod leader;
mod leader_faults;
mod list_held;
mod lock;
#[cfg(feature = "axum")]
mod many;
#[cfg(feature = "axum")]
mod mysql;
mod mysql_faults;
mod outages;
#[cfg(feature = "axum")]
mod postgres;
mod postgres_faults;
mod queue;
mod quorum;
#[cfg(feature = "axum")]
mod retry_after;
#[cfg(feature = "axum")]
mod rwlock;
#[cfg(feature = "axum")]
mod semaphore;
mod sentinel;
#[cfg(feature = "tls")]
mod sentinel_tls;
mod store_list;
#[cfg(feature = "tls")]
mod tls;
mod turns;
mod yielding;
#[cfg(feature = "axum")]
mod zookeeper;

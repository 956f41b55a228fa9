//! The Jepsen workload, in a binary of its own (it runs as root, with hosts of its own in
//! network namespaces, and says it skipped otherwise): instances on hosts of their own run
//! fenced read-modify-write increments while a nemesis kills, pauses, partitions and
//! restarts, and every hold is checked (`support::history`). `redis` runs against one
//! server, `sentinel` through Sentinel, `cluster` against a Redis Cluster, `stores` against
//! each of the other stores.

// Each workload compiles the shared parts (`app.rs`, `common.rs`, `nemesis.rs`) as modules
// of its own: they read the workload's constants (its namespaces, probe hold, partitionable
// instances) through `super::*`.
#![allow(clippy::duplicate_mod)]

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod cluster;
mod redis;
mod sentinel;
mod stores;

//! The store kit: what every store's builder and backend take from the core besides the
//! engine itself.
//!
//! - `settings.rs`: the settings every builder shares, their one validation, and the
//!   setters each builder expands.
//! - `keys.rs`: a user key's names in a store: the key validated once, and its lock's
//!   (or semaphore's) name, which each store spells with a `Naming` of its own.
//! - `listener.rs`: the listening connection of every store (pub/sub, `LISTEN`, the
//!   parked MySQL connection, etcd's watch, ZooKeeper's session) under one supervising
//!   loop, with one backoff (`backoff.rs`) and one log line per outage.
//! - `turn.rs`: whose turn it is among a lock's ordered entries (etcd's keys, ZooKeeper's
//!   nodes): one rule for writers, readers and permits.

pub(crate) mod backoff;
pub(crate) mod keys;
pub(crate) mod listener;
pub(crate) mod settings;
#[cfg_attr(
    not(any(test, feature = "etcd", feature = "zookeeper")),
    expect(
        dead_code,
        reason = "only the stores that queue ordered entries ask whose turn it is"
    )
)]
pub(crate) mod turn;

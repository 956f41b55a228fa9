//! The store kit: what every store's builder and backend take from the core besides the
//! engine itself.
//!
//! - `settings.rs`: the settings every builder shares, their one validation, and the
//!   setters each builder expands.
//! - `listener.rs`: the listening connection of every store (pub/sub, `LISTEN`, the
//!   parked MySQL connection, etcd's watch, ZooKeeper's session) under one supervising
//!   loop, with one backoff (`backoff.rs`) and one log line per outage.

pub(crate) mod backoff;
pub(crate) mod listener;
pub(crate) mod settings;

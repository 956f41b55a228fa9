//! The PostgreSQL names of one user key: its row and its notification channel.

use std::sync::Arc;

use crate::core::store::StoreKey;
use crate::error::KeyError;
use crate::key::{fnv1a, namespaced, validate};

/// The names that belong to one user key: the row's name (`namespace:{key}`, or
/// `namespace:{key}:permits` for the key's semaphore, a primitive of its own) and the
/// channel its releases are announced on.
#[derive(Debug)]
pub(crate) struct PgKey {
    /// The key as the application gave it.
    user: String,
    /// The row's name in the lock table.
    pub(crate) name: Arc<str>,
    /// `LISTEN`/`NOTIFY` channel names are at most 63 bytes, keys up to the key length
    /// limit: the channel is a 64-bit FNV-1a hash of the name (`tl_` and 16 hex digits). Two
    /// names that share one only wake each other's waiters, who try again and wait on.
    pub(crate) channel: String,
}

impl PgKey {
    pub(crate) fn new(
        namespace: &str,
        user: String,
        max_len: usize,
        semaphore: bool,
    ) -> Result<Self, KeyError> {
        validate(&user, max_len)?;
        let mut name = namespaced(namespace, &user);
        if semaphore {
            name.push_str(":permits");
        }
        Ok(PgKey {
            channel: channel(&name),
            name: name.into(),
            user,
        })
    }
}

impl StoreKey for PgKey {
    fn user(&self) -> &str {
        &self.user
    }

    fn lock(&self) -> &Arc<str> {
        &self.name
    }
}

/// The channel every backend of `namespace` listens on: a force-release is announced
/// there, so that the holder re-checks its holds at once. No user key's row has this name
/// (an escaped key has a `%` only before `25`, `7B` or `7D`).
pub(crate) fn admin_channel(namespace: &str) -> String {
    channel(&format!("{namespace}:{{%admin}}"))
}

/// The channel of the row `name` (see [`PgKey::channel`]): a stable hash, the same in
/// every process and build, since instances of several versions share a table.
fn channel(name: &str) -> String {
    format!("tl_{:016x}", fnv1a(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_are_short_stable_and_differ_by_name() {
        // FNV-1a's published value for "a".
        assert_eq!(channel("a"), "tl_af63dc4c8601ec8c");
        let key = PgKey::new("ns", "order:42".into(), 1024, false).unwrap();
        let permits = PgKey::new("ns", "order:42".into(), 1024, true).unwrap();
        assert_eq!(&*key.name, "ns:{order:42}");
        assert_eq!(&*permits.name, "ns:{order:42}:permits");
        assert_ne!(key.channel, permits.channel);
        assert!(key.channel.len() < 64);
    }
}

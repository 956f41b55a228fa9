//! The SQL names of one user key: its row and the channel its waiters are woken on.

use std::sync::Arc;

use super::Dialect;
use crate::core::kit::keys::{KeyName, Namespaced};
use crate::core::store::StoreKey;
use crate::error::KeyError;
use crate::key::fnv1a;

/// The names that belong to one user key: the row's name (`namespace:{key}`, or
/// `namespace:{key}:permits` for the key's semaphore, a primitive of its own) and the
/// channel its waiters are woken on.
#[derive(Debug)]
pub(crate) struct SqlKey {
    /// The key as the application gave it.
    user: String,
    /// The row's name in the lock table.
    pub(crate) name: Arc<str>,
    /// A 64-bit FNV-1a hash of the name (`tl_` and 16 hex digits): PostgreSQL's
    /// `LISTEN`/`NOTIFY` channel names are at most 63 bytes, and MySQL's waiters table's
    /// rows stay short, whatever the key. Two names that share one only wake each other's
    /// waiters, who try again and wait on.
    pub(crate) channel: String,
}

impl SqlKey {
    /// The names of `user`'s lock (or its semaphore) in `namespace` on the server `D`.
    pub(crate) fn new<D: Dialect>(
        namespace: &str,
        user: String,
        max_key_len: usize,
        semaphore: bool,
    ) -> Result<Self, KeyError> {
        let KeyName { user, name } =
            KeyName::new(&Namespaced(namespace), user, max_key_len, semaphore)?;
        // Escaping may lengthen a key up to threefold: refuse what the column cannot hold,
        // in the key's own bytes, rather than let the server truncate or fail.
        if let Some(max_name) = D::MAX_NAME_LEN.filter(|&max| name.len() > max) {
            let max = user.len() - (name.len() - max_name);
            return Err(KeyError::TooLong {
                len: user.len(),
                max,
            });
        }
        Ok(SqlKey {
            channel: channel(&name),
            name: name.into(),
            user,
        })
    }
}

impl StoreKey for SqlKey {
    fn user(&self) -> &str {
        &self.user
    }

    fn lock(&self) -> &Arc<str> {
        &self.name
    }
}

/// The channel every backend of `namespace` is woken on for its holds: a force-release is
/// announced there, so that the holder re-checks its holds at once. No user key's row has
/// this name (an escaped key has a `%` only before `25`, `7B` or `7D`).
pub(crate) fn admin_channel(namespace: &str) -> String {
    channel(&format!("{namespace}:{{%admin}}"))
}

/// The channel of the row `name` (see [`SqlKey::channel`]): a stable hash, the same in
/// every process and build, since instances of several versions share a table.
fn channel(name: &str) -> String {
    format!("tl_{:016x}", fnv1a(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "postgres")]
    #[test]
    fn channels_are_short_stable_and_differ_by_name() {
        // FNV-1a's published value for "a".
        assert_eq!(channel("a"), "tl_af63dc4c8601ec8c");
        let key = SqlKey::new::<sqlx::Postgres>("ns", "order:42".into(), 1024, false).unwrap();
        let permits = SqlKey::new::<sqlx::Postgres>("ns", "order:42".into(), 1024, true).unwrap();
        assert_eq!(&*key.name, "ns:{order:42}");
        assert_eq!(&*permits.name, "ns:{order:42}:permits");
        assert_ne!(key.channel, permits.channel);
        assert!(key.channel.len() < 64);
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn names_past_the_column_are_refused_as_too_long() {
        let key = SqlKey::new::<sqlx::MySql>("ns", "order:42".into(), 4096, false).unwrap();
        assert_eq!(&*key.name, "ns:{order:42}");
        let braces = "{".repeat(1000);
        let refused = SqlKey::new::<sqlx::MySql>("ns", braces, 4096, false).unwrap_err();
        assert!(matches!(refused, KeyError::TooLong { len: 1000, max } if max < 1000));
    }
}

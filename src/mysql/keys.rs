//! The MySQL names of one user key: its row and the channel its waiters register on.

use std::sync::Arc;

use crate::core::store::StoreKey;
use crate::error::KeyError;
use crate::key::{fnv1a, namespaced, validate};

/// The longest row name the tables take (`VARBINARY(2800)`: with the holder, the holders'
/// primary key stays within InnoDB's 3072-byte limit).
pub(crate) const MAX_NAME_LEN: usize = 2800;

/// The names that belong to one user key: the row's name (`namespace:{key}`, or
/// `namespace:{key}:permits` for the key's semaphore, a primitive of its own) and the
/// channel its waiters register on.
#[derive(Debug)]
pub(crate) struct MySqlKey {
    /// The key as the application gave it.
    user: String,
    /// The row's name in the lock table.
    pub(crate) name: Arc<str>,
    /// A 64-bit FNV-1a hash of the name (`tl_` and 16 hex digits): the waiters table's
    /// rows stay short whatever the key. Two names that share one only wake each other's
    /// waiters, who try again and wait on.
    pub(crate) channel: String,
}

impl MySqlKey {
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
        // Escaping may lengthen a key up to threefold: refuse what the column cannot hold,
        // in the key's own bytes, rather than let the server truncate or fail.
        if name.len() > MAX_NAME_LEN {
            let max = user.len() - (name.len() - MAX_NAME_LEN);
            return Err(KeyError::TooLong {
                len: user.len(),
                max,
            });
        }
        Ok(MySqlKey {
            channel: channel(&name),
            name: name.into(),
            user,
        })
    }
}

impl StoreKey for MySqlKey {
    fn user(&self) -> &str {
        &self.user
    }

    fn lock(&self) -> &Arc<str> {
        &self.name
    }
}

/// The channel every backend of `namespace` registers on: a force-release wakes it, so
/// that the holder re-checks its holds at once. No user key's row has this name (an
/// escaped key has a `%` only before `25`, `7B` or `7D`).
pub(crate) fn admin_channel(namespace: &str) -> String {
    channel(&format!("{namespace}:{{%admin}}"))
}

fn channel(name: &str) -> String {
    format!("tl_{:016x}", fnv1a(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_past_the_column_are_refused_as_too_long() {
        let key = MySqlKey::new("ns", "order:42".into(), 4096, false).unwrap();
        assert_eq!(&*key.name, "ns:{order:42}");
        let braces = "{".repeat(1000);
        let refused = MySqlKey::new("ns", braces, 4096, false).unwrap_err();
        assert!(matches!(refused, KeyError::TooLong { len: 1000, max } if max < 1000));
    }
}

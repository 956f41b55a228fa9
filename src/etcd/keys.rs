//! The etcd names of one user key: the lock's directory and its holders' keys in it.

use std::sync::Arc;

use crate::core::store::StoreKey;
use crate::error::KeyError;
use crate::key::{namespaced, validate};

/// The names that belong to one user key: the lock's directory (`namespace:{key}`), under
/// which each backend's hold is the key `namespace:{key}/<lease id in hex>`.
///
/// No directory is a prefix of another's: the key's own braces and `%` are escaped, so the
/// closing brace before the `/` ends the user key.
#[derive(Debug)]
pub(crate) struct EtcdKey {
    /// The key as the application gave it.
    user: String,
    /// The lock's directory, without the trailing `/`: the core's name of the lock, and
    /// the waiters' channel.
    pub(crate) name: Arc<str>,
}

impl EtcdKey {
    pub(crate) fn new(namespace: &str, user: String, max_len: usize) -> Result<Self, KeyError> {
        validate(&user, max_len)?;
        Ok(EtcdKey {
            name: namespaced(namespace, &user).into(),
            user,
        })
    }
}

impl StoreKey for EtcdKey {
    fn user(&self) -> &str {
        &self.user
    }

    fn lock(&self) -> &Arc<str> {
        &self.name
    }
}

/// The prefix of every hold in the lock `name`'s directory.
pub(crate) fn dir(name: &str) -> String {
    format!("{name}/")
}

/// The key of the hold the backend with lease `lease` keeps in the lock `name`.
pub(crate) fn hold_key(name: &str, lease: i64) -> String {
    format!("{name}/{lease:016x}")
}

/// The lock (the waiters' channel) a hold's key belongs to, from a key under the
/// namespace: everything before its last `/`.
pub(crate) fn lock_of(hold_key: &[u8]) -> Option<&str> {
    let key = std::str::from_utf8(hold_key).ok()?;
    key.rsplit_once('/').map(|(lock, _)| lock)
}

/// The prefix under which every lock of `namespace` lives (what the backend watches).
pub(crate) fn namespace_prefix(namespace: &str) -> String {
    format!("{namespace}:{{")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let key = EtcdKey::new("ns", "a/b}".into(), 1024).unwrap();
        assert_eq!(&*key.name, "ns:{a/b%7D}");
        let hold = hold_key(&key.name, 0x2a);
        assert_eq!(hold, "ns:{a/b%7D}/000000000000002a");
        assert_eq!(lock_of(hold.as_bytes()), Some("ns:{a/b%7D}"));
        assert!(hold.starts_with(&dir(&key.name)));
        assert!(hold.starts_with(&namespace_prefix("ns")));
    }
}

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

/// A hold's value: the holder's identity, its re-entry count, and the ids of the releases
/// already applied to it (so that a retried release is recognised), one per line, with
/// `%` and line breaks in them escaped (an owner id is the application's to choose).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HoldValue {
    pub(crate) holder: String,
    pub(crate) count: u64,
    pub(crate) released: Vec<String>,
}

impl HoldValue {
    pub(crate) fn new(holder: &str) -> Self {
        HoldValue {
            holder: holder.to_owned(),
            count: 1,
            released: Vec::new(),
        }
    }

    /// Reads a value this crate wrote; `None` for anything else.
    pub(crate) fn parse(value: &[u8]) -> Option<Self> {
        let value = std::str::from_utf8(value).ok()?;
        let mut lines = value.split('\n');
        let holder = unescape(lines.next()?)?;
        let count = lines.next()?.parse().ok()?;
        let released = lines
            .filter(|l| !l.is_empty())
            .map(unescape)
            .collect::<Option<_>>()?;
        Some(HoldValue {
            holder,
            count,
            released,
        })
    }

    pub(crate) fn encode(&self) -> String {
        let mut out = format!("{}\n{}", escape(&self.holder), self.count);
        for id in &self.released {
            out.push('\n');
            out.push_str(&escape(id));
        }
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('%', "%25")
        .replace('\n', "%0A")
        .replace('\r', "%0D")
}

fn unescape(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let (c, after) = match rest.get(at + 1..at + 3)? {
            "25" => ('%', at + 3),
            "0A" => ('\n', at + 3),
            "0D" => ('\r', at + 3),
            _ => return None,
        };
        out.push(c);
        rest = &rest[after..];
    }
    out.push_str(rest);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_values_round_trip() {
        let key = EtcdKey::new("ns", "a/b}".into(), 1024).unwrap();
        assert_eq!(&*key.name, "ns:{a/b%7D}");
        let hold = hold_key(&key.name, 0x2a);
        assert_eq!(hold, "ns:{a/b%7D}/000000000000002a");
        assert_eq!(lock_of(hold.as_bytes()), Some("ns:{a/b%7D}"));
        assert!(hold.starts_with(&dir(&key.name)));
        assert!(hold.starts_with(&namespace_prefix("ns")));
        let mut value = HoldValue::new("owner\n1%");
        value.count = 3;
        value.released.push("owner\n1%#7".into());
        assert_eq!(value.encode().lines().count(), 3);
        assert_eq!(HoldValue::parse(value.encode().as_bytes()), Some(value));
        assert_eq!(HoldValue::parse(b"no count"), None);
    }
}

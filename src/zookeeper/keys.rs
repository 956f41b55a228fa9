//! The ZooKeeper paths of one user key: the lock's (or its semaphore's) node and its
//! holders' nodes under it.

use std::sync::Arc;

use crate::core::kit::keys::{KeyName, Naming, SEMAPHORE};
use crate::core::kit::turn::EntryKind;
use crate::core::store::StoreKey;
use crate::error::KeyError;
use crate::lock::inspect::Primitive;

/// The paths that belong to one user key: the lock's node `/<namespace>/{<key>}`, or its
/// semaphore's `/<namespace>/{<key>}:permits` (container nodes, which ZooKeeper deletes
/// once they are empty), under which each hold is an ephemeral sequential node named after
/// the session that holds it.
///
/// The key is one path segment: its `/` and `%` are percent-escaped, and the braces
/// around it keep it from being `.` or `..`, so no key reaches outside its namespace and
/// two keys never share a node (a lock's segment ends with `}`, a semaphore's never does).
#[derive(Debug)]
pub(crate) struct ZkKey {
    /// The key as the application gave it.
    user: String,
    /// The lock's (or the semaphore's) node: the core's name of the lock, and the waiters'
    /// channel.
    pub(crate) path: Arc<str>,
}

impl ZkKey {
    /// The paths of `user`'s lock (its semaphore if `semaphore`) under `root`; refuses (400) the characters ZooKeeper refuses in
    /// a path (besides the control characters every store refuses): the private use area
    /// U+E000 to U+F8FF and U+FFF0 to U+FFFF.
    pub(crate) fn new(
        root: &str,
        user: String,
        max_len: usize,
        semaphore: bool,
    ) -> Result<Self, KeyError> {
        let KeyName { user, name } = KeyName::new(&Under(root), user, max_len, semaphore)?;
        Ok(ZkKey {
            path: name.into(),
            user,
        })
    }
}

/// ZooKeeper's naming: a key's lock is the node `{<key>}` under the namespace's node
/// `root`, the key escaped into one path segment.
struct Under<'a>(&'a str);

impl Naming for Under<'_> {
    fn refuse(&self, user: &str) -> Result<(), KeyError> {
        if user
            .chars()
            .any(|c| matches!(c, '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}'))
        {
            return Err(KeyError::Malformed {
                reason: "ZooKeeper paths cannot hold the characters U+E000 to U+F8FF and \
                         U+FFF0 to U+FFFF"
                    .to_owned(),
            });
        }
        Ok(())
    }

    fn lock(&self, user: &str) -> String {
        let root = self.0;
        let mut path = String::with_capacity(root.len() + user.len() + 3);
        path.push_str(root);
        path.push_str("/{");
        escape_into(&mut path, user);
        path.push('}');
        path
    }
}

impl StoreKey for ZkKey {
    fn user(&self) -> &str {
        &self.user
    }

    fn lock(&self) -> &Arc<str> {
        &self.path
    }
}

/// `s` with `%` and `/` percent-escaped: one path segment.
fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            c => out.push(c),
        }
    }
}

/// `segment` with the escapes of [`escape_into`] undone; `None` for a segment it never
/// gives (a `/`, or a `%` that begins neither escape).
fn unescape(segment: &str) -> Option<String> {
    let mut out = String::with_capacity(segment.len());
    let mut chars = segment.chars();
    while let Some(c) = chars.next() {
        out.push(match c {
            '%' => match (chars.next()?, chars.next()?) {
                ('2', '5') => '%',
                ('2', 'F') => '/',
                _ => return None,
            },
            '/' => return None,
            c => c,
        });
    }
    Some(out)
}

/// The user key and primitive whose node is `name`, a child of the namespace's node:
/// `{<key>}` a lock's, `{<key>}:permits` a semaphore's. `None` for the idempotency
/// records' node and any other name this crate does not give a lock.
pub(crate) fn lock_of(name: &str) -> Option<(String, Primitive)> {
    let inner = name.strip_prefix('{')?;
    // A lock's segment ends with the brace, a semaphore's never does (the key's own
    // braces are not escaped: the last one closes it).
    let (escaped, of) = match inner.strip_suffix('}') {
        Some(escaped) => (escaped, Primitive::Lock),
        None => (
            inner.strip_suffix(SEMAPHORE)?.strip_suffix('}')?,
            Primitive::Semaphore,
        ),
    };
    Some((unescape(escaped)?, of))
}

/// The namespace's node, under which every lock lives: `/<namespace>`, escaped as a key
/// is. `None` for a namespace that cannot be a node's name (`.` or `..`).
pub(crate) fn root(namespace: &str) -> Option<String> {
    if matches!(namespace, "." | "..") {
        return None;
    }
    let mut out = String::from("/");
    escape_into(&mut out, namespace);
    Some(out)
}

/// The prefix of the nodes the session `session` creates: a writer's or a permit's; a
/// shared holder's carries [`READ_MARK`] after it. ZooKeeper appends the sequence number
/// (ten digits, or nineteen past `i32::MAX`).
pub(crate) fn hold_prefix(session: i64) -> String {
    format!("{session:016x}-")
}

/// What follows the session's prefix in a shared holder's node name.
pub(crate) const READ_MARK: &str = "r-";

/// A node's kind and sequence number, from its name (`<session>-<sequence>` or
/// `<session>-r-<sequence>`); `None` for a name this crate never gives.
pub(crate) fn node(name: &str) -> Option<(EntryKind, i64)> {
    let (rest, sequence) = name.rsplit_once('-')?;
    let sequence = sequence.parse().ok()?;
    let kind = if rest.ends_with("-r") {
        EntryKind::Read
    } else {
        EntryKind::Write
    };
    Some((kind, sequence))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_one_segment_under_the_namespace() {
        let ns = root("ns/x").unwrap();
        assert_eq!(ns, "/ns%2Fx");
        let key = ZkKey::new(&ns, "../a/b%".into(), 1024, false).unwrap();
        assert_eq!(&*key.path, "/ns%2Fx/{..%2Fa%2Fb%25}");
        let permits = ZkKey::new(&ns, "a}:permits".into(), 1024, true).unwrap();
        assert_eq!(&*permits.path, "/ns%2Fx/{a}:permits}:permits");
        assert!(root("..").is_none());
        assert!(matches!(
            ZkKey::new("/ns", "a\u{e000}".into(), 1024, false),
            Err(KeyError::Malformed { .. })
        ));
        let write = format!("{}0000000012", hold_prefix(7));
        let read = format!("{}{READ_MARK}0000000003", hold_prefix(-2));
        assert_eq!(node(&write), Some((EntryKind::Write, 12)));
        assert_eq!(node(&read), Some((EntryKind::Read, 3)));
        assert_eq!(node("stray"), None);
    }

    #[test]
    fn a_lock_node_gives_back_its_key() {
        for user in [
            "a/b%",
            "%2F",
            "{}",
            "a}:permits",
            "a}",
            "ordér:空",
            "*_?[1]\\",
            "%",
        ] {
            for semaphore in [false, true] {
                let key = ZkKey::new("/ns", user.into(), 1024, semaphore).unwrap();
                let name = key.path.strip_prefix("/ns/").unwrap();
                let of = if semaphore {
                    Primitive::Semaphore
                } else {
                    Primitive::Lock
                };
                assert_eq!(lock_of(name), Some((user.to_owned(), of)), "{name}");
            }
        }
        assert_eq!(unescape("a%25%2Fb"), Some("a%/b".to_owned()));
        for name in [
            "records",
            "{a",
            "a}",
            "{a}:other",
            "{a/b}",
            "{%2f}",
            "{%41}",
            "{%2}",
        ] {
            assert_eq!(lock_of(name), None, "{name}");
        }
    }
}

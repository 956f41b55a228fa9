//! The ZooKeeper paths of one user key: the lock's node and its holders' nodes under it.

use std::sync::Arc;

use crate::core::store::StoreKey;
use crate::error::KeyError;
use crate::key::validate;

/// The paths that belong to one user key: the lock's node `/<namespace>/{<key>}` (a
/// container node, which ZooKeeper deletes once it is empty), under which each hold is an
/// ephemeral sequential node named after the session that holds it.
///
/// The key is one path segment: its `/` and `%` are percent-escaped, and the braces
/// around it keep it from being `.` or `..`, so no key reaches outside its namespace and
/// two keys never share a node.
#[derive(Debug)]
pub(crate) struct ZkKey {
    /// The key as the application gave it.
    user: String,
    /// The lock's node: the core's name of the lock, and the waiters' channel.
    pub(crate) path: Arc<str>,
}

impl ZkKey {
    /// The paths of `user` under `root`; refuses (400) the characters ZooKeeper refuses in
    /// a path (besides the control characters every store refuses): the private use area
    /// U+E000 to U+F8FF and U+FFF0 to U+FFFF.
    pub(crate) fn new(root: &str, user: String, max_len: usize) -> Result<Self, KeyError> {
        validate(&user, max_len)?;
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
        let mut path = String::with_capacity(root.len() + user.len() + 3);
        path.push_str(root);
        path.push_str("/{");
        escape_into(&mut path, &user);
        path.push('}');
        Ok(ZkKey {
            path: path.into(),
            user,
        })
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

/// The prefix of the hold nodes the session `session` creates; ZooKeeper appends the
/// sequence number (ten digits, or nineteen past `i32::MAX`).
pub(crate) fn hold_prefix(session: i64) -> String {
    format!("{session:016x}-")
}

/// A hold node's sequence number, from its name; `None` for a name this crate never
/// gives.
pub(crate) fn sequence(name: &str) -> Option<i64> {
    name.rsplit_once('-')?.1.parse().ok()
}

/// The node among `children` that holds the lock: the lowest sequence number.
pub(crate) fn lowest(children: &[String]) -> Option<&str> {
    children
        .iter()
        .filter_map(|c| sequence(c).map(|s| (s, c.as_str())))
        .min()
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_one_segment_under_the_namespace() {
        let ns = root("ns/x").unwrap();
        assert_eq!(ns, "/ns%2Fx");
        let key = ZkKey::new(&ns, "../a/b%".into(), 1024).unwrap();
        assert_eq!(&*key.path, "/ns%2Fx/{..%2Fa%2Fb%25}");
        assert!(root("..").is_none());
        assert!(matches!(
            ZkKey::new("/ns", "a\u{e000}".into(), 1024),
            Err(KeyError::Malformed { .. })
        ));
        let names = vec![
            format!("{}0000000012", hold_prefix(7)),
            format!("{}0000000003", hold_prefix(-2)),
            "stray".to_owned(),
        ];
        assert_eq!(lowest(&names), Some(names[1].as_str()));
        assert_eq!(sequence(&names[0]), Some(12));
    }
}

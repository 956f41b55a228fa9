//! The keys held under a prefix (`LockBackend::list_held`): the names `SCAN` finds under
//! the prefix's pattern, page by page, on the one server or on each primary of a cluster
//! in turn. `SCAN` looks at a bounded part of the keyspace per call, so a listing never
//! holds the server up as `KEYS` would.
//!
//! A cursor is the `SCAN` cursor of the server being read, followed on a cluster by the
//! primaries still to read, the one being read first (`17 10.0.0.1:7000 10.0.0.2:7000`).
//! The primaries are those of the first page: a key whose slot moves to another primary
//! during a listing (a reshard, a failover) may be missed, as a key taken meanwhile may.

use super::connection::pool::CommandError;
use super::store::RedisStore;
use crate::core::kit::keys::{namespaced_prefix, parse_namespaced};
use crate::core::store::HeldPage;

/// How many keys one `SCAN` call looks at (its `COUNT`): a page's share of the keyspace.
const PAGE: usize = 500;

impl RedisStore {
    /// One page of the keys of this namespace under `prefix` that are a lock or a
    /// semaphore (see `Store::held_page`).
    pub(crate) async fn list_page(
        &self,
        prefix: &str,
        from: Option<String>,
    ) -> Result<HeldPage, CommandError> {
        let (cursor, mut nodes) = match from {
            Some(from) => {
                let mut parts = from.split(' ').map(str::to_owned);
                let cursor = parts.next().unwrap_or_default();
                (cursor, parts.collect())
            }
            None => {
                let nodes = self.pool.primaries().await?;
                ("0".to_owned(), nodes.unwrap_or_default())
            }
        };
        let mut scan = redis::cmd("SCAN");
        scan.arg(&cursor)
            .arg("MATCH")
            .arg(pattern(&self.namespace, prefix))
            .arg("COUNT")
            .arg(PAGE);
        let node = nodes.first().map(String::as_str);
        let (next, names): (String, Vec<Vec<u8>>) = self.pool.query_on(node, &scan).await?;
        let keys = names
            .iter()
            .filter_map(|name| std::str::from_utf8(name).ok())
            .filter_map(|name| parse_namespaced(&self.namespace, name))
            .collect();
        let next = if next != "0" {
            Some(next)
        } else if nodes.len() > 1 {
            // This primary is read: the next one, from the start.
            nodes.remove(0);
            Some("0".to_owned())
        } else {
            None
        };
        let next = next.map(|cursor| {
            let mut from = cursor;
            for node in &nodes {
                from.push(' ');
                from.push_str(node);
            }
            from
        });
        Ok(HeldPage { keys, next })
    }
}

/// The `SCAN` pattern of every name of the namespace whose key starts with `prefix`: the
/// beginning of a lock's name, every glob character in it escaped, then `*`.
fn pattern(namespace: &str, prefix: &str) -> String {
    let name = namespaced_prefix(namespace, prefix);
    let mut pattern = String::with_capacity(name.len() + 8);
    for c in name.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\' | '^' | '-') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('*');
    pattern
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_matches_the_prefix_literally() {
        assert_eq!(pattern("ns", "order:"), "ns:{order:*");
        assert_eq!(
            pattern("n*s", "a*?[]\\^-{}%"),
            "n\\*s:{a\\*\\?\\[\\]\\\\\\^\\-%7B%7D%25*"
        );
        assert_eq!(pattern("ns", ""), "ns:{*");
    }
}

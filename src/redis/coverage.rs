//! `cluster-require-full-coverage`: what a cluster's primaries do while a hash slot has no
//! serving node.
//!
//! With Redis' default, `yes`, a node refuses every command (`CLUSTERDOWN`) while any slot
//! of the cluster is uncovered: one primary down until its replica takes over, or a shard
//! without a replica, stops every shard, so every lock of every key answers 503 meanwhile.
//! With `no`, only the keys of the missing slots fail and the other shards keep serving,
//! which is what the backend's per-shard design assumes. It is availability, not safety
//! (a refused command takes no lock), so `build()` warns rather than refuses.

use std::collections::HashMap;

use super::pool::Pool;

const SETTING: &str = "cluster-require-full-coverage";

/// The warning's text, also what the guide quotes.
const WARNING: &str = "cluster-require-full-coverage is `yes` on these primaries: while any \
    hash slot of the cluster is uncovered (a primary down until its replica takes over, or a \
    shard without a replica), Redis refuses commands on every shard, so every lock answers \
    503; set `cluster-require-full-coverage no` on every node (CONFIG SET and the config file) \
    so that the other shards keep serving";

/// Reads `cluster-require-full-coverage` on every primary (`CONFIG GET`) and logs a warning
/// naming the primaries where it is `yes`. A user who may not run `CONFIG GET` (managed
/// services often refuse it) or a failed read only logs at debug level: the check is
/// advice, and the build goes on.
pub(crate) async fn warn_if_full_coverage_required(pool: &Pool) {
    let mut get = redis::cmd("CONFIG");
    get.arg("GET").arg(SETTING);
    // `CONFIG GET` answers `[name, value]` (RESP2) or `{name: value}` (RESP3).
    let replies = match pool
        .query_each_primary::<HashMap<String, String>>(&get)
        .await
    {
        Ok(replies) => replies,
        Err(error) => {
            tracing::debug!(
                %error,
                "cannot read cluster-require-full-coverage (no CONFIG GET right?)"
            );
            return;
        }
    };
    let requiring = requiring_full_coverage(replies);
    if !requiring.is_empty() {
        tracing::warn!(primaries = %requiring.join(", "), "{WARNING}");
    }
}

/// The primaries (their address, or `?` when redis-rs did not say) whose `CONFIG GET`
/// reply says `yes`.
fn requiring_full_coverage(replies: Vec<(Option<String>, HashMap<String, String>)>) -> Vec<String> {
    replies
        .into_iter()
        .filter(|(_, reply)| {
            reply
                .get(SETTING)
                .is_some_and(|value| value.eq_ignore_ascii_case("yes"))
        })
        .map(|(node, _)| node.unwrap_or_else(|| "?".to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_primaries_that_say_yes_are_named() {
        let reply = |value: &str| HashMap::from([(SETTING.to_owned(), value.to_owned())]);
        let replies = vec![
            (Some("10.0.0.1:7000".to_owned()), reply("yes")),
            (Some("10.0.0.2:7000".to_owned()), reply("no")),
            (None, reply("yes")),
            (Some("10.0.0.3:7000".to_owned()), HashMap::new()),
        ];
        assert_eq!(requiring_full_coverage(replies), ["10.0.0.1:7000", "?"]);
    }
}

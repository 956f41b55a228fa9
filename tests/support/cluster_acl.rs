//! ACL users and settings on some nodes of a test [`Cluster`] (they are per node in a
//! cluster), undone when the [`NodeChanges`] are dropped so that later scenarios on the
//! shared cluster see it as it was.

use std::time::Duration;

use tower_lock::{RedisBackend, RedisBackendBuilder};

use super::cluster::Cluster;

/// A user with every right on the default namespace's keys and channels.
pub const APP_RULES: [&str; 6] = [
    "reset",
    "on",
    ">secret",
    "~tower-lock:*",
    "&tower-lock:*",
    "+@all",
];

/// Changes made to nodes of a cluster, undone on drop (also when a scenario panics, though
/// the cluster is then killed anyway).
pub struct NodeChanges<'a> {
    cluster: &'a Cluster,
    users: Vec<(u16, String)>,
    policies: Vec<u16>,
    full_coverage: Vec<u16>,
}

impl<'a> NodeChanges<'a> {
    pub fn new(cluster: &'a Cluster) -> Self {
        NodeChanges {
            cluster,
            users: Vec::new(),
            policies: Vec::new(),
            full_coverage: Vec::new(),
        }
    }

    /// `ACL SETUSER user rules...` on each node of `ports`.
    pub fn set_user(&mut self, ports: &[u16], user: &str, rules: &[&str]) {
        for &port in ports {
            let mut args = vec!["ACL", "SETUSER", user];
            args.extend_from_slice(rules);
            let reply = self.cluster.run(port, &args);
            assert_eq!(reply.trim(), "OK", "ACL SETUSER on {port}: {reply}");
            self.users.push((port, user.to_owned()));
        }
    }

    /// `CONFIG SET maxmemory-policy policy` on the node on `port`.
    pub fn set_policy(&mut self, port: u16, policy: &str) {
        let reply = self
            .cluster
            .run(port, &["CONFIG", "SET", "maxmemory-policy", policy]);
        assert_eq!(reply.trim(), "OK", "CONFIG SET on {port}: {reply}");
        self.policies.push(port);
    }

    /// `CONFIG SET cluster-require-full-coverage yes` (Redis' default, which the test
    /// cluster turns off) on the node on `port`.
    pub fn require_full_coverage(&mut self, port: u16) {
        let args = ["CONFIG", "SET", "cluster-require-full-coverage", "yes"];
        let reply = self.cluster.run(port, &args);
        assert_eq!(reply.trim(), "OK", "CONFIG SET on {port}: {reply}");
        self.full_coverage.push(port);
    }
}

impl Drop for NodeChanges<'_> {
    fn drop(&mut self) {
        for (port, user) in &self.users {
            self.cluster.run(*port, &["ACL", "DELUSER", user]);
        }
        for port in &self.policies {
            let args = ["CONFIG", "SET", "maxmemory-policy", "noeviction"];
            self.cluster.run(*port, &args);
        }
        for port in &self.full_coverage {
            let args = ["CONFIG", "SET", "cluster-require-full-coverage", "no"];
            self.cluster.run(*port, &args);
        }
    }
}

/// How many times the node on `port` was sent `command`, run or refused (`calls`,
/// `rejected_calls` and `failed_calls` of `INFO commandstats`).
pub fn attempts(cluster: &Cluster, port: u16, command: &str) -> u64 {
    let stats = cluster.run(port, &["INFO", "commandstats"]);
    let prefix = format!("cmdstat_{command}:");
    stats
        .lines()
        .filter_map(|line| line.strip_prefix(&prefix))
        .flat_map(|fields| fields.split(','))
        .filter_map(|field| {
            let (name, value) = field.split_once('=')?;
            ["calls", "rejected_calls", "failed_calls"]
                .contains(&name)
                .then(|| value.trim().parse::<u64>().ok())?
        })
        .sum()
}

/// A cluster builder that logs in as `user:password` on every seed node, with the short
/// timeouts of [`Cluster::backend`].
pub fn builder_as(cluster: &Cluster, user: &str, password: &str) -> RedisBackendBuilder {
    let seeds = cluster
        .live()
        .into_iter()
        .map(|port| format!("redis://{user}:{password}@127.0.0.1:{port}"));
    RedisBackend::cluster(seeds)
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
}

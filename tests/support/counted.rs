//! A server of a store's own for one test, whose counters tell whether a waiter polls:
//! every lock attempt it serves is counted ([`Counted::attempts`]). Instances built on it
//! renew (a lease, a keep-alive, a ping) far apart, so that a test's window of a few
//! seconds sees only what the waiters do. Used by the conformance suite's no-polling test.

use std::time::Duration;

use tokio::task::JoinHandle;
use tower_lock::{BackendStats, LockBackend, LockError};

/// A lease, TTL or ping interval no test window reaches.
pub const FAR: Duration = Duration::from_secs(120);

/// `n` tasks over the instances `waiting` in turn, each waiting up to a minute for `key`,
/// then releasing it.
pub fn spawn_waiters<B>(
    waiting: &[B],
    key: &str,
    n: usize,
) -> Vec<JoinHandle<Result<(), LockError>>>
where
    B: LockBackend + Clone + Send + 'static,
{
    (0..n)
        .map(|i| {
            let (backend, key) = (waiting[i % waiting.len()].clone(), key.to_owned());
            tokio::spawn(async move {
                let guard = backend.lock(key).wait(Duration::from_secs(60)).await?;
                guard.release().await
            })
        })
        .collect()
}

/// Waits (10 s at most each: a hang fails) for every task of [`spawn_waiters`] to take its
/// lock and release it.
pub async fn all_served(waiters: Vec<JoinHandle<Result<(), LockError>>>) {
    for waiter in waiters {
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("served")
            .expect("no panic")
            .expect("acquired after the release, and released");
    }
}

/// A store's server of its own, counting lock attempts.
pub trait Counted: Sized + Sync {
    type Backend: LockBackend + Clone + Send + Sync + 'static;
    /// Attempts one contender makes at least before it waits: it tries, registers for
    /// wake-ups (subscribes, listens, watches) and tries again.
    const CONTENDER_ATTEMPTS: u64;

    async fn start() -> Self;
    /// Another instance of one service on this server.
    async fn instance(&self) -> Self::Backend;
    /// Lock attempts the server has served so far.
    async fn attempts(&self) -> u64;
    fn stats(backend: &Self::Backend) -> BackendStats;

    /// Returns once each of `waiting` has its contender registered for wake-ups and
    /// `queued` tasks waiting behind it in memory.
    async fn registered(&self, waiting: &[Self::Backend], queued: usize) {
        for backend in waiting {
            super::eventually("the waiters are queued and registered", || async move {
                let stats = Self::stats(backend);
                stats.local_waiters == queued && stats.channels_with_waiters == 1
            })
            .await;
        }
    }

    /// Returns once the `contenders` have made their attempts after `start` (each
    /// [`CONTENDER_ATTEMPTS`](Self::CONTENDER_ATTEMPTS)); the calls may still be on their
    /// way when the registration shows in the stats.
    async fn settled(&self, start: u64, contenders: u64) {
        super::eventually("the contenders tried again after registering", || async {
            self.attempts().await >= start + contenders * Self::CONTENDER_ATTEMPTS
        })
        .await;
    }
}

impl Counted for super::RedisServer {
    type Backend = tower_lock::RedisBackend;
    const CONTENDER_ATTEMPTS: u64 = 2;

    async fn start() -> Self {
        super::RedisServer::start()
    }
    async fn instance(&self) -> Self::Backend {
        self.backend().await
    }
    async fn attempts(&self) -> u64 {
        self.command_calls(&["evalsha", "eval"]).await
    }
    fn stats(backend: &Self::Backend) -> BackendStats {
        backend.stats()
    }
}

impl Counted for super::postgres::PostgresServer {
    type Backend = tower_lock::PostgresBackend;
    const CONTENDER_ATTEMPTS: u64 = 2;

    /// Every statement the server runs is logged, with the connection's name.
    async fn start() -> Self {
        Self::start_with(&["log_statement=all", "log_line_prefix=%a| "])
    }
    async fn instance(&self) -> Self::Backend {
        let builder = tower_lock::PostgresBackend::builder(self.url()).migrate();
        builder.build().await.expect("backend")
    }
    /// The acquisition calls in a log the server writes behind the statements it runs.
    async fn attempts(&self) -> u64 {
        self.log().matches("_acquire(").count() as u64
    }
    fn stats(backend: &Self::Backend) -> BackendStats {
        backend.stats()
    }
}

impl Counted for super::mariadb::MariaDbServer {
    type Backend = tower_lock::MySqlBackend;
    /// A try, the registration and a try again: four procedure calls.
    const CONTENDER_ATTEMPTS: u64 = 4;

    async fn start() -> Self {
        Self::start()
    }
    async fn instance(&self) -> Self::Backend {
        super::mariadb::builder_on(&self.url())
            // The wake connections' park, their one statement per interval, lasts longer
            // than the test: any statement in its window is a poll.
            .wake_ping_interval(FAR)
            .build()
            .await
            .expect("backend")
    }
    async fn attempts(&self) -> u64 {
        self.status("Com_call_procedure").await
    }
    fn stats(backend: &Self::Backend) -> BackendStats {
        backend.stats()
    }
}

#[cfg(feature = "etcd")]
impl Counted for super::etcd::EtcdServer {
    type Backend = tower_lock::EtcdBackend;
    const CONTENDER_ATTEMPTS: u64 = 2;

    async fn start() -> Self {
        Self::start()
    }
    async fn instance(&self) -> Self::Backend {
        super::etcd::builder_on(&[self.endpoint()])
            // Renewals and keep-alives, a third and a quarter of it apart, fall outside
            // the test's window.
            .lease_ttl(FAR)
            .build()
            .await
            .expect("backend")
    }
    /// The gRPC calls an attempt makes (its reads and transactions), as etcd counts them.
    async fn attempts(&self) -> u64 {
        ["Range", "Txn", "Put", "DeleteRange", "LeaseGrant"]
            .iter()
            .map(|method| {
                let label = format!("grpc_method=\"{method}\"");
                self.metric("grpc_server_handled_total", &[&label])
            })
            .sum::<f64>() as u64
    }
    fn stats(backend: &Self::Backend) -> BackendStats {
        backend.stats()
    }
}

impl Counted for super::zookeeper::ZkServer {
    type Backend = tower_lock::ZooKeeperBackend;
    /// An attempt lists the lock's nodes: a try and a try once watching.
    const CONTENDER_ATTEMPTS: u64 = 1;

    async fn start() -> Self {
        Self::start()
    }
    async fn instance(&self) -> Self::Backend {
        super::zookeeper::builder_on(&self.hosts())
            // Renewals come a sixth of it apart, and are multi-reads, counted apart.
            .session_timeout(Duration::from_secs(5))
            .build()
            .await
            .expect("backend")
    }
    /// The listings of nodes' children the server answered: every attempt lists the
    /// lock's nodes.
    async fn attempts(&self) -> u64 {
        self.mntr("zk_response_packet_get_children_cache_hits")
            + self.mntr("zk_response_packet_get_children_cache_misses")
    }
    fn stats(backend: &Self::Backend) -> BackendStats {
        backend.stats()
    }

    /// Its last attempt comes before its watch on the node it waits behind: one watch per
    /// waiting instance.
    async fn settled(&self, start: u64, contenders: u64) {
        super::eventually(
            "each waiting instance watches the holder's node",
            || async {
                self.mntr("zk_watch_count") == contenders
                    && self.attempts().await >= start + contenders * Self::CONTENDER_ATTEMPTS
            },
        )
        .await;
    }
}

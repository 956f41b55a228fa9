//! The ZooKeeper store on one standalone server: uncontended acquire + release next to
//! ZooKeeper's own `getData` and `create` + `delete` round trips, and the hot key next to
//! the in-process mutex, measured in the same run.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tower_lock::ZooKeeperBackend;
use zookeeper_client::{Acls, Client, CreateMode};

use super::support::RedisServer;
use super::support::zookeeper::ZkServer;
use super::{Contender, Percentiles, latency_table, sql};

pub async fn zookeeper(redis: &RedisServer, secs: Duration) -> String {
    let server = ZkServer::start();
    let hosts = server.hosts();
    let backend = || async {
        ZooKeeperBackend::builder(hosts.as_str())
            .build()
            .await
            .expect("backend")
    };
    let mut out =
        String::from("## ZooKeeper, one standalone server on loopback (`forceSync=no`)\n\n");
    out += &uncontended(&hosts, &backend().await).await;
    let instance = || async { Contender::ZooKeeper(backend().await) };
    out += &sql::hot_key(redis, secs, "tower-lock on ZooKeeper", instance).await;
    out
}

/// `try_once` + `release` on a free key, interleaved with a `getData` and an ephemeral
/// `create` + `delete` (the floor of taking and giving back a node) on a client of the
/// bench's own.
async fn uncontended(hosts: &str, backend: &ZooKeeperBackend) -> String {
    const N: usize = 2000;
    let client = Client::connect(hosts).await.expect("client");
    let ephemeral = CreateMode::Ephemeral.with_acls(Acls::anyone_all());
    client
        .create(
            "/bench-floor",
            b"x",
            &CreateMode::Persistent.with_acls(Acls::anyone_all()),
        )
        .await
        .expect("create");
    let (mut gets, mut writes, mut locks) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..N + 200 {
        let t = Instant::now();
        client.get_data("/bench-floor").await.expect("get");
        let got = t.elapsed();
        let t = Instant::now();
        client
            .create("/bench-floor/e", b"x", &ephemeral)
            .await
            .expect("create");
        client.delete("/bench-floor/e", None).await.expect("delete");
        let written = t.elapsed();
        let t = Instant::now();
        let guard = backend.lock("bench:solo").try_once().await.expect("free");
        guard.release().await.expect("release");
        let lock = t.elapsed();
        if i >= 200 {
            gets.push(got);
            writes.push(written);
            locks.push(lock);
        }
    }
    let (get, write, lock) = (
        Percentiles::of(gets),
        Percentiles::of(writes),
        Percentiles::of(locks),
    );
    let mut out = String::from("### ZooKeeper: uncontended acquire + release\n\n");
    out += &latency_table(&[
        ("`getData` round trip", &get),
        ("ephemeral `create` + `delete`", &write),
        ("tower-lock `try_once` + `release`", &lock),
    ]);
    let _ = writeln!(
        out,
        "\nRound trips per acquire + release (p50 / `getData` p50): **{:.2}** (list, create \
         the lock's node, create the hold, list; list, read, delete); `create` + `delete`: \
         {:.2}\n",
        lock.p50.as_secs_f64() / get.p50.as_secs_f64(),
        write.p50.as_secs_f64() / get.p50.as_secs_f64()
    );
    out
}

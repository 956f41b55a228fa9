//! The etcd store on one member: uncontended acquire + release next to etcd's own `Range`
//! and `Txn` round trips, and the hot key next to the in-process mutex, measured in the
//! same run.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tower_lock::EtcdBackend;
use tower_lock::etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::support::RedisServer;
use super::support::etcd::EtcdServer;
use super::{Contender, Percentiles, latency_table, sql};

pub async fn etcd(redis: &RedisServer, secs: Duration) -> String {
    let server = EtcdServer::start();
    let endpoint = server.endpoint();
    let backend = || async {
        EtcdBackend::builder([endpoint.as_str()])
            .build()
            .await
            .expect("backend")
    };
    let mut out = String::from("## etcd, one member on loopback (`--unsafe-no-fsync`)\n\n");
    out += &uncontended(&endpoint, &backend().await).await;
    let instance = || async { Contender::Etcd(backend().await) };
    out += &sql::hot_key(redis, secs, "tower-lock on etcd", instance).await;
    out
}

/// `try_once` + `release` on a free key, interleaved with a `get` and a one-key `Txn`
/// (a compare and a put: the floor of one write) on a client of the bench's own.
async fn uncontended(endpoint: &str, backend: &EtcdBackend) -> String {
    const N: usize = 2000;
    let mut client = tower_lock::etcd_client::Client::connect([endpoint], None)
        .await
        .expect("client");
    let (mut gets, mut txns, mut locks) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..N + 200 {
        let t = Instant::now();
        client.get("bench:floor", None).await.expect("get");
        let got = t.elapsed();
        let t = Instant::now();
        let write = Txn::new()
            .when([Compare::version("bench:floor", CompareOp::Greater, -1)])
            .and_then([TxnOp::put("bench:floor", "x", None)]);
        client.txn(write).await.expect("txn");
        let written = t.elapsed();
        let t = Instant::now();
        let guard = backend.lock("bench:solo").try_once().await.expect("free");
        guard.release().await.expect("release");
        let lock = t.elapsed();
        if i >= 200 {
            gets.push(got);
            txns.push(written);
            locks.push(lock);
        }
    }
    let (get, txn, lock) = (
        Percentiles::of(gets),
        Percentiles::of(txns),
        Percentiles::of(locks),
    );
    let mut out = String::from("### etcd: uncontended acquire + release\n\n");
    out += &latency_table(&[
        ("`get` round trip", &get),
        ("one-key `Txn` (a compare and a put)", &txn),
        ("tower-lock `try_once` + `release`", &lock),
    ]);
    let _ = writeln!(
        out,
        "\nRound trips per acquire + release (p50 / `get` p50): **{:.2}** (a transaction to \
         take the key and one to give it back); one `Txn`: {:.2}\n",
        lock.p50.as_secs_f64() / get.p50.as_secs_f64(),
        txn.p50.as_secs_f64() / get.p50.as_secs_f64()
    );
    out
}

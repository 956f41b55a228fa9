//! etcd's read/write locks and semaphores: what they keep in etcd, under which lease, and
//! that a waiter tries again only when the key it waits behind goes (no herd), counted in
//! etcd's own request counters. The bodies every store runs are in rwlock.rs and
//! semaphore.rs (`on_etcd::*`).

use crate::support;

use std::time::Duration;

use support::etcd::{self, EtcdServer, admin, keys_in, keys_under};
use tower_lock::{EtcdBackend, LockError, LockMode};

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(10);
/// Long enough for a waiter of these tests never to give up.
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn shared_holds_and_permits_are_keys_under_the_backends_lease() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let (a, b) = (
        etcd::backend_in(&namespace).await,
        etcd::backend_in(&namespace).await,
    );
    let readers = [
        a.lock("doc").shared().try_once().await.expect("free"),
        b.lock("doc").shared().try_once().await.expect("shared"),
    ];
    let permit = a.lock("doc").permits(2).try_once().await.expect("free");
    let keys = keys_under(format!("{namespace}:")).await;
    // Two shared holds and a permit, each a key of its backend's lease; nothing else.
    let mut leases: Vec<i64> = keys.iter().map(|kv| kv.lease()).collect();
    leases.sort_unstable();
    let mut expected = vec![a.lease_id(), a.lease_id(), b.lease_id()];
    expected.sort_unstable();
    assert_eq!(leases, expected, "{keys:?}");

    let info = a.inspect("doc").await.expect("inspect");
    assert_eq!((info.mode, info.holders), (LockMode::Shared, 2));
    let info = a.inspect_permits("doc").await.expect("inspect");
    assert_eq!((info.mode, info.holders), (LockMode::Permits, 1));
    assert_eq!(info.fencing_token, Some(permit.fencing_token()));

    // The lease revoked: every hold under it is lost, the other backend's is kept.
    let revoked = admin().await.lease_revoke(a.lease_id()).await;
    revoked.expect("revoked");
    for guard in [&readers[0], &permit] {
        tokio::time::timeout(HANG, guard.lost())
            .await
            .expect("lost fires for every hold under the lease");
    }
    assert!(!readers[1].is_lost());
    let [lost, kept] = readers;
    assert!(matches!(lost.release().await, Err(LockError::Lost { .. })));
    kept.release().await.expect("still held");
    let writer = b.lock("doc").try_once().await.expect("every reader gone");
    writer.release().await.expect("released");
}

/// etcd's count of the transactions it served (every call of the store is one).
fn txns(server: &EtcdServer) -> f64 {
    server.metric("grpc_server_handled_total", &["grpc_method=\"Txn\""])
}

/// A backend of its own on `server`, whose lease needs no keep-alive within a test.
async fn instance(server: &EtcdServer) -> EtcdBackend {
    etcd::builder_on(&[server.endpoint()])
        .lease_ttl(Duration::from_secs(120))
        .build()
        .await
        .expect("backend")
}

/// Waits until `server` served `n` transactions since `start`.
async fn served(server: &EtcdServer, start: f64, n: u32) {
    let what = format!("{n} transactions served");
    support::eventually(&what, || async { txns(server) >= start + f64::from(n) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_and_the_readers_behind_it_wake_only_when_their_key_goes() {
    crate::needs!(Etcd);
    // A server of its own: its counters count this test's calls only.
    let server = EtcdServer::start();
    let (readers, writing, reading) = (
        instance(&server).await,
        instance(&server).await,
        instance(&server).await,
    );
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(readers.lock("k").shared().try_once().await.expect("shared"));
    }
    let start = txns(&server);
    let writer = tokio::spawn(async move {
        let guard = writing.lock("k").wait(WAIT).await?;
        guard.release().await
    });
    // Its attempt, its key put in line, and its attempt once its watch is confirmed.
    served(&server, start, 3).await;
    let waiting: Vec<_> = (0..10)
        .map(|_| {
            let reading = reading.clone();
            tokio::spawn(async move {
                let guard = reading.lock("k").shared().wait(WAIT).await?;
                guard.release().await
            })
        })
        .collect();
    // Each reader kept out: an attempt, and one more once its watch is confirmed.
    served(&server, start, 3 + 20).await;
    support::eventually("the readers wait", || async {
        reading.stats().channels_with_waiters == 10
    })
    .await;
    // The writer waits behind the youngest reader: the two older ones wake nobody.
    for guard in held {
        guard.release().await.expect("released");
    }
    for task in std::iter::once(writer).chain(waiting) {
        tokio::time::timeout(HANG, task)
            .await
            .expect("served")
            .expect("no panic")
            .expect("acquired and released");
    }
    // Three releases; the writer's turn (its attempt, its hold); its release; each reader
    // woken once by it, in at its attempt, and its release.
    assert_eq!(
        txns(&server) - start,
        f64::from(3 + 20 + 3 + 2 + 1 + 10 + 10)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freed_permit_wakes_one_waiter() {
    crate::needs!(Etcd);
    let server = EtcdServer::start();
    let (holding, waiting) = (instance(&server).await, instance(&server).await);
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(holding.lock("k").permits(2).try_once().await.expect("free"));
    }
    let start = txns(&server);
    let waiters: Vec<_> = (0..6)
        .map(|_| {
            let waiting = waiting.clone();
            tokio::spawn(async move {
                let guard = waiting.lock("k").permits(2).wait(WAIT).await?;
                guard.release().await
            })
        })
        .collect();
    // Each one: its attempt, its key left in line, its attempt once its watch is confirmed.
    served(&server, start, 6 * 3).await;
    support::eventually("the waiters wait", || async {
        waiting.stats().channels_with_waiters == 6
    })
    .await;
    for guard in held {
        guard.release().await.expect("released");
    }
    for waiter in waiters {
        tokio::time::timeout(HANG, waiter)
            .await
            .expect("served")
            .expect("no panic")
            .expect("acquired and released");
    }
    // Two releases; then each waiter woken once, when a permit is freed for it: its
    // attempt, its turn, its release (which frees the next one's permit).
    assert_eq!(txns(&server) - start, f64::from(6 * 3 + 2 + 6 * 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_stops_waiting_takes_its_key_out_of_line_and_lets_readers_in() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let (a, b) = (
        etcd::backend_in(&namespace).await,
        etcd::backend_in(&namespace).await,
    );
    let reader = a.lock("doc").shared().try_once().await.expect("free");
    let writer = tokio::spawn({
        let b = b.clone();
        async move { b.lock("doc").wait(WAIT).await }
    });
    // Its key in line keeps new readers out.
    support::eventually("the writer waits in line", || async {
        matches!(
            a.lock("doc").shared().try_once().await,
            Err(LockError::Contended { .. })
        )
    })
    .await;
    assert_eq!(
        keys_in(&namespace, "doc}").await.len(),
        2,
        "a reader, a writer"
    );
    // The request goes away (a client gone, a timeout layer).
    writer.abort();
    support::eventually("readers come in again", || async {
        match a.lock("doc").shared().try_once().await {
            Ok(guard) => guard.release().await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    assert_eq!(
        keys_in(&namespace, "doc}").await.len(),
        1,
        "only the reader's"
    );
    reader.release().await.expect("released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_waiter_that_stops_waiting_leaves_the_line_to_the_next() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let (a, b, c) = (
        etcd::backend_in(&namespace).await,
        etcd::backend_in(&namespace).await,
        etcd::backend_in(&namespace).await,
    );
    let held = a.lock("export").permits(1).try_once().await.expect("free");
    let first = tokio::spawn({
        let b = b.clone();
        async move { b.lock("export").permits(1).wait(WAIT).await }
    });
    support::eventually("the first waits in line", || async {
        keys_in(&namespace, "export}:permits").await.len() == 2
    })
    .await;
    let second = tokio::spawn({
        let c = c.clone();
        async move { c.lock("export").permits(1).wait(WAIT).await }
    });
    support::eventually("the second waits in line", || async {
        keys_in(&namespace, "export}:permits").await.len() == 3
    })
    .await;
    first.abort();
    held.release().await.expect("released");
    // Had the first kept its place, the permit would wait for its lease (30 s).
    let next = tokio::time::timeout(HANG, second)
        .await
        .expect("the second is served")
        .expect("no panic")
        .expect("a permit");
    next.release().await.expect("released");
    let left = keys_in(&namespace, "export}:permits").await;
    assert!(left.is_empty(), "{left:?}");
}

//! Masters killed and restarted under a quorum's locks: a minority lost changes nothing, a
//! majority lost fails closed, and a master restarted empty lets no second holder in (the
//! restart guard). Each test holds the binary's quorum alone, and leaves every master up.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::routing::post;
use tower_lock::{LockError, LockLayer};

use super::Shop;
use crate::support::{self, RedisServer, quorum};

/// Generous bound on anything that should happen soon: catches hangs only.
const HANG: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_masters_killed_mid_sale_the_sale_goes_on_one_holder_at_a_time() {
    crate::needs!(Redis);
    const STOCK: i64 = 30;
    let quorum = quorum::shared();
    let _turn = quorum.exclusive().await;
    let db = RedisServer::start();
    let shop = Shop::open(&db, STOCK).await;
    let mut addrs = Vec::new();
    for backend in quorum.backends(3).await {
        addrs.push(shop.serve(backend).await);
    }
    let buyers = support::buy_all(&addrs, 90);
    support::eventually("a third of the stock is sold", || async {
        shop.sold.load(Ordering::SeqCst) >= 10
    })
    .await;
    quorum.kill(3);
    quorum.kill(4);
    // A holder whose majority had masters 3 or 4 in it is left on a minority: it loses its
    // lock and its buyer gets 503, before anyone else is let in. Every other buyer is
    // served.
    for buyer in buyers {
        let status = tokio::time::timeout(HANG * 3, buyer)
            .await
            .expect("answered")
            .expect("no panic");
        assert!(matches!(status, 200 | 503), "{status}");
    }
    // The sale goes on with three masters: the rest of the stock sells to new buyers.
    let (left, _) = shop.state().await;
    support::all_served(support::buy_all(&addrs, left as usize + 3)).await;
    shop.assert_sold_out(STOCK).await;
    quorum.restart(3);
    quorum.restart(4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_masters_killed_fail_closed_then_recover_empty_without_a_second_holder() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.exclusive().await;
    let backends = quorum.backends(2).await;
    let first = backends[0].lock("k").try_once().await.expect("free");
    let app = Router::new()
        .route("/pay", post(|| async { "paid" }))
        .route_layer(
            LockLayer::new(backends[1].clone(), |_: &Request| Some("other".to_owned())).fail_fast(),
        );
    for i in 0..3 {
        quorum.kill(i);
    }
    // Fewer than a majority answer: 503, and the error says so.
    let refused = support::call(&app, http::Method::POST, "/pay").await;
    assert_eq!(refused.status, 503, "{refused:?}");
    match backends[1].lock("other").try_once().await {
        Err(e @ LockError::Backend(_)) => {
            let chain = support::chain(&e);
            assert!(
                chain.contains("only 2 of 5 Redis masters answered"),
                "{chain}"
            );
        }
        other => panic!("fails closed: {other:?}"),
    }
    // The holder cannot get its hold confirmed by a majority: lost within its lease.
    tokio::time::timeout(HANG, first.held().lost())
        .await
        .expect("the holder learns it lost the lock");
    for i in 0..3 {
        quorum.restart(i);
    }
    // Back, empty: the restarted masters grant nothing until their guard has passed, by
    // which time no hold of before can still run.
    let second = backends[1]
        .lock("k")
        .wait(HANG)
        .await
        .expect("granted once the restarted masters' guard has passed");
    assert!(first.is_lost(), "a second holder while the first runs");
    assert!(second.fencing_token() > first.fencing_token());
    let paid = support::call(&app, http::Method::POST, "/pay").await;
    assert_eq!(paid.status, 200, "{paid:?}");
    second.release().await.expect("released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_restarted_empty_under_a_held_lock_lets_no_second_holder_in() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.exclusive().await;
    let backends = quorum.backends(2).await;
    // Held on masters 0, 1 and 2 only: 3 and 4 are down when it is taken.
    quorum.kill(3);
    quorum.kill(4);
    let first = backends[0]
        .lock("k")
        .try_once()
        .await
        .expect("free on a majority");
    quorum.restart(3);
    quorum.restart(4);
    // Master 2 forgets the hold: it is left on 0 and 1, while 2, 3 and 4 are free. Without
    // the restart guard they would make a majority for a second holder right now.
    quorum.restart(2);
    match backends[1].lock("k").try_once().await {
        Err(LockError::Contended { .. }) => {}
        other => panic!("a second holder while the first runs: {other:?}"),
    }
    // The holder learns its hold is on a minority: lost, and only then is there a second.
    tokio::time::timeout(HANG, first.held().lost())
        .await
        .expect("lost");
    let second = backends[1]
        .lock("k")
        .wait(HANG)
        .await
        .expect("granted once the guard passed");
    assert!(second.fencing_token() > first.fencing_token());
    second.release().await.expect("released");
}

/// Master 4 of five down when a backend is built: the build succeeds (a majority is up),
/// says once at WARN which master is down, and every hold is taken and released on the
/// others; started again, the master is checked as a build checks it and takes part in
/// acquisitions from then on (a hold is on it too).
#[test]
fn a_master_down_at_build_is_checked_and_takes_part_once_it_answers() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let log = support::logged_on_this_thread("tower_lock=info", async |log| {
        let _turn = quorum.exclusive().await;
        quorum.kill(4);
        let backend = quorum
            .builder()
            .build()
            .await
            .expect("builds with a majority up");
        let failures = support::failover::holds(&backend, 20).await;
        assert!(failures.is_empty(), "with a master down: {failures:#?}");
        quorum.restart(4);
        log.until("quorum master checked", 1).await;
        quorum.past_guards().await;
        let lock = format!("{}:{{k0}}", backend.namespace());
        let held = backend.lock("k0").try_once().await.expect("free");
        let master = quorum.servers()[4].0.url();
        let on_master: bool = redis::cmd("EXISTS")
            .arg(&lock)
            .query_async(
                &mut redis::Client::open(master.as_str())
                    .expect("url")
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect"),
            )
            .await
            .expect("EXISTS");
        assert!(on_master, "the hold is on the master checked since");
        held.release().await.expect("released");
    });
    let down = format!("master=127.0.0.1:{}", quorum.servers()[4].0.port());
    let warned = log
        .text()
        .lines()
        .filter(|l| l.contains(" WARN ") && l.contains("quorum master down at build"))
        .map(str::to_owned)
        .collect::<Vec<_>>();
    assert_eq!(warned.len(), 1, "{}", log.text());
    assert!(warned[0].contains(&down), "{}", warned[0]);
}

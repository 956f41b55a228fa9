//! Instances served in the order they began waiting, on any store that lines waiting
//! instances up (the store's line read by a probe of the test's own).

use std::future::Future;
use std::time::Duration;

use tower_lock::LockBackend;

const KEY: &str = "turns";

/// `holder` holds [`KEY`]; each of `instances` begins waiting in turn, the next only once
/// `in_line(KEY)` counts the one before in the store's line; released, the key goes to
/// them in that order (each grant's token above the last), one after the other. Then a
/// waiter whose request is cancelled leaves the line.
pub async fn instances_take_the_lock_in_the_order_they_began_waiting<B, F, Fut>(
    holder: B,
    instances: Vec<B>,
    in_line: F,
) where
    B: LockBackend + Clone,
    F: Fn(&'static str) -> Fut,
    Fut: Future<Output = usize>,
{
    let held = holder.lock(KEY).try_once().await.expect("uncontended");
    let mut waiters = Vec::new();
    // The last-built instance first: an order that is not the order of their sessions.
    for (i, instance) in instances.iter().rev().enumerate() {
        let instance = instance.clone();
        waiters.push(tokio::spawn(async move {
            instance.lock(KEY).wait(Duration::from_secs(60)).await
        }));
        super::eventually("the instance is in the store's line", || async {
            in_line(KEY).await == i + 1
        })
        .await;
    }
    let mut last = held.fencing_token();
    held.release().await.expect("holder releases");
    for (i, waiter) in waiters.into_iter().enumerate() {
        let guard = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .unwrap_or_else(|_| panic!("instance {i} is served next"))
            .expect("no panic")
            .expect("acquires");
        assert!(
            guard.fencing_token() > last,
            "instance {i} is served in the order it began waiting: token {} after {last}",
            guard.fencing_token()
        );
        last = guard.fencing_token();
        guard.release().await.expect("releases");
    }
    assert_eq!(in_line(KEY).await, 0, "the line is empty again");

    // A waiter that gives up (its request cancelled) leaves the line.
    let held = holder.lock(KEY).try_once().await.expect("free");
    let instance = instances[0].clone();
    let waiter =
        tokio::spawn(async move { instance.lock(KEY).wait(Duration::from_secs(60)).await });
    super::eventually("the waiter is in the store's line", || async {
        in_line(KEY).await == 1
    })
    .await;
    waiter.abort();
    super::eventually("the cancelled waiter left the line", || async {
        in_line(KEY).await == 0
    })
    .await;
    held.release().await.expect("releases");
}

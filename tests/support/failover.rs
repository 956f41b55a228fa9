//! A key taken in turns across a failover of a consensus store (etcd's leader, a
//! ZooKeeper server): the body both stores' leader-kill tests share; and holds taken one
//! after the other, for the tests of a member down.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tower_lock::LockBackend;

/// What [`take_turns_across`] saw.
pub struct Failover {
    /// Holds before the kill.
    pub at_kill: usize,
    /// Holds in all.
    pub holds: usize,
    /// Acquisitions that failed (503) while the store elected a leader.
    pub failures: u64,
    /// What the first few of them said.
    pub errors: Vec<String>,
}

/// Four tasks of `instances` take one key in turns; after 50 holds `kill` stops the
/// store's leader, and the run goes on for 50 more. Asserts that no two tasks ever hold
/// the key at once and that the tokens, in hold order, strictly increase across the
/// failover.
pub async fn take_turns_across<B>(instances: &[B], kill: impl FnOnce()) -> Failover
where
    B: LockBackend + Clone + Send + Sync + 'static,
{
    let inside = Arc::new(AtomicU64::new(0));
    let tokens = Arc::new(Mutex::new(Vec::<u64>::new()));
    let failures = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|i| {
            let backend = instances[i % instances.len()].clone();
            let (inside, tokens, failures, errors, stop) = (
                inside.clone(),
                tokens.clone(),
                failures.clone(),
                errors.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let guard = match backend.lock("k").wait(Duration::from_secs(30)).await {
                        Ok(guard) => guard,
                        Err(e) => {
                            // 503 while the store elects a leader.
                            failures.fetch_add(1, Ordering::Relaxed);
                            let mut errors = errors.lock().expect("errors");
                            if errors.len() < 4 {
                                errors.push(super::chain(&e));
                            }
                            continue;
                        }
                    };
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    tokens.lock().expect("tokens").push(guard.fencing_token());
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    let _ = guard.release().await;
                }
            })
        })
        .collect();
    let held = || tokens.lock().expect("tokens").len();
    let served_until = |n: usize| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        while held() < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "only {} holds in 90 s",
                held()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    served_until(50).await;
    kill();
    let at_kill = held();
    served_until(at_kill + 50).await;
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        tokio::time::timeout(Duration::from_secs(60), worker)
            .await
            .expect("workers stop")
            .expect("no two holders at once");
    }
    let tokens = tokens.lock().expect("tokens").clone();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens strictly increase in hold order: {tokens:?}"
    );
    Failover {
        at_kill,
        holds: tokens.len(),
        failures: failures.load(Ordering::Relaxed),
        errors: errors.lock().expect("errors").clone(),
    }
}

/// Takes and releases `n` holds of `backend` one after the other (on four keys in turn);
/// the failures, each with its cause.
pub async fn holds<B: LockBackend>(backend: &B, n: usize) -> Vec<String> {
    let mut failures = Vec::new();
    for i in 0..n {
        match backend.lock(format!("k{}", i % 4)).try_once().await {
            Ok(held) => {
                if let Err(e) = held.release().await {
                    failures.push(format!("release {i}: {}", super::chain(&e)));
                }
            }
            Err(e) => failures.push(format!("acquisition {i}: {}", super::chain(&e))),
        }
    }
    failures
}

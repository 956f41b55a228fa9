//! A holder process paused (SIGSTOP) past its lock's validity, while another process takes
//! the lock over: every fenced write the paused holder attempts once resumed is refused.

use std::time::Duration;

use tower_lock::RedisBackend;
use tower_lock::redis::{FencedStore, FencedWrite};

use crate::support::child::{self, ChildProcess};
use crate::support::quorum;

const URLS: &str = "QUORUM_URLS";
const NAMESPACE: &str = "QUORUM_NAMESPACE";
/// Stale writes the child attempts before it stops.
const STALE_WRITES: usize = 3;
/// Writes after which the child stops anyway (a refusal that never comes fails the test
/// instead of hanging it).
const MAX_WRITES: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "entry point of the child process that the pause test spawns"]
async fn holder_child() {
    match child::role().as_deref() {
        None => {}
        Some("holder") => {
            let urls: Vec<String> = child::setting(URLS).split(',').map(str::to_owned).collect();
            let backend = RedisBackend::quorum(&urls)
                .namespace(child::setting(NAMESPACE))
                .max_lease(quorum::MAX_LEASE)
                .build()
                .await
                .expect("the child's backend");
            let store = FencedStore::new(backend.clone());
            let guard = backend.lock("acct").try_once().await.expect("free");
            let token = guard.fencing_token();
            child::report(&format!("held {token}"));
            // Writes with its token until it has been refused a few times: once paused
            // and resumed, its lock is someone else's.
            let mut stale = 0;
            for i in 0..MAX_WRITES {
                let outcome = match store.write("acct", token, &format!("child {i}")).await {
                    Ok(FencedWrite::Written) => "wrote",
                    Ok(FencedWrite::Stale { .. }) => "stale",
                    Err(_) => "error",
                };
                child::report(outcome);
                stale += usize::from(outcome == "stale");
                if stale == STALE_WRITES {
                    break;
                }
                // A pace for the reports, not a wait for anything.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Some(other) => panic!("unknown child role {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_validity_has_every_later_fenced_write_refused() {
    crate::needs!(Redis);
    let quorum = quorum::shared();
    let _turn = quorum.shared_turn().await;
    let backend = quorum.builder().build().await.expect("backend");
    let settings = [
        (URLS, quorum.urls().join(",")),
        (NAMESPACE, backend.namespace().to_owned()),
    ];
    let mut holder = ChildProcess::spawn("quorum::pause::holder_child", "holder", &settings);
    let held = holder
        .next_report()
        .await
        .expect("the child holds the lock");
    let paused_token: u64 = held
        .strip_prefix("held ")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{held}"));
    assert_eq!(holder.next_report().await.as_deref(), Some("wrote"));
    holder.pause();
    // Its watchdog stopped with it: its lease runs out on every master, and the lock is
    // taken over.
    let guard = backend
        .lock("acct")
        .wait(Duration::from_secs(20))
        .await
        .expect("taken over once the paused holder's lease ran out");
    assert!(guard.fencing_token() > paused_token);
    let store = FencedStore::new(backend.clone());
    let written = store
        .write("acct", guard.fencing_token(), "new holder")
        .await
        .expect("write");
    assert_eq!(written, FencedWrite::Written);
    holder.resume();
    let reports = holder.remaining_reports().await;
    holder.assert_success().await;
    // Writes that reached the masters before the takeover succeeded; from the first
    // refusal on, every write is refused.
    let after: Vec<&String> = reports.iter().skip_while(|r| *r == "wrote").collect();
    assert!(after.iter().all(|r| *r == "stale"), "{reports:?}");
    assert_eq!(after.len(), STALE_WRITES, "{reports:?}");
    let value = store.read("acct").await.expect("read").expect("written");
    assert_eq!(
        (value.value.as_str(), value.token),
        ("new holder", guard.fencing_token())
    );
    guard.release().await.expect("released");
}

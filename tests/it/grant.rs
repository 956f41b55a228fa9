//! Grant on release: a release that frees a key while instances wait in its line hands it
//! to the head of the line in the same script, and the head's waiting task holds it once
//! it claimed it (a renewal, no acquire call). A grantee killed, or paused past its grant,
//! costs the others the grant lease; tokens strictly increase and holds never overlap
//! (the history checker).
//! Against a real redis-server per test; the grantee is a child process.

use crate::support;

use std::time::Duration;

use support::RedisServer;
use support::child::{self, ChildProcess};
use support::history::{self, Hold, Registers, Write};
use support::netns::{Net, now_micros};
use support::proxy::FaultProxy;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tower_lock::{LockGuard, RedisBackend};

const KEY: &str = "stock:7";
const LOCK: &str = "tower-lock:{stock:7}";
const WAIT: Duration = Duration::from_secs(30);
/// Only to catch a hang: far below the holders' lease (30 s), which is what a waiter
/// would sleep for if nothing told it to look again when a grant runs out.
const HANG: Duration = Duration::from_secs(10);
/// Passed to the child process.
const URL: &str = "TOWER_LOCK_TEST_REDIS_URL";
/// The child's instance number in the history.
const CHILD: usize = 9;

#[tokio::test]
#[ignore = "entry point of the child process that the tests spawn"]
async fn child_process() {
    if child::role().as_deref() == Some("waiter") {
        let backend = support::backend(&child::setting(URL)).await;
        child::report("waiting");
        if let Ok(guard) = backend.lock(KEY).wait(WAIT).await {
            let start = now_micros();
            tokio::time::sleep(Duration::from_millis(20)).await;
            let hold = hold(CHILD, guard.fencing_token(), start, now_micros());
            child::report(&hold.encode());
            guard.release().await.expect("releases");
        }
        std::future::pending::<()>().await;
    }
}

fn hold(instance: usize, token: u64, start: u64, end: u64) -> Hold {
    Hold {
        instance,
        key: KEY.to_owned(),
        token,
        start,
        end,
        write: Write::Skipped,
    }
}

/// The holders in the key's line, head first.
async fn line(server: &RedisServer) -> Vec<String> {
    server.line(KEY).await
}

/// A field of the lock hash.
async fn lock_field(server: &RedisServer, field: &str) -> Option<String> {
    redis::cmd("HGET")
        .arg(LOCK)
        .arg(field)
        .query_async(&mut server.conn().await)
        .await
        .expect("HGET")
}

/// The token of the key's grant to `head`, which the release just made.
async fn granted_to(server: &RedisServer, head: &str) -> u64 {
    assert_eq!(
        lock_field(server, "granted").await.as_deref(),
        Some(head),
        "the release granted the key to the head of the line"
    );
    lock_field(server, "token")
        .await
        .and_then(|t| t.parse().ok())
        .expect("the grant's token")
}

/// A task of `backend` that takes the key, says so with its token, and holds it until told
/// (or at once); returns its hold.
fn holder_task(backend: &RedisBackend, instance: usize) -> Waiting {
    let (taken_tx, taken) = oneshot::channel();
    let (release, release_rx) = oneshot::channel::<()>();
    let backend = backend.clone();
    let task = tokio::spawn(async move {
        let guard = backend.lock(KEY).wait(WAIT).await.expect("acquires");
        let start = now_micros();
        let _ = taken_tx.send(guard.fencing_token());
        let _ = release_rx.await;
        let hold = hold(instance, guard.fencing_token(), start, now_micros());
        guard.release().await.expect("releases");
        hold
    });
    (taken, release, task)
}

/// `held` released, as a hold of `instance` in the history (ended before its release).
async fn release(held: LockGuard, instance: usize, start: u64) -> Hold {
    let hold = hold(instance, held.fencing_token(), start, now_micros());
    held.release().await.expect("releases");
    hold
}

/// Once `calls` script calls ran: each waiter's attempt before it subscribes and the one
/// after its subscription is confirmed, after which it sleeps until woken (an attempt
/// still in flight when a test pauses the child would run at any time).
async fn settled(server: &RedisServer, calls: u64) {
    support::eventually("the waiters made their attempts", || async {
        server.command_calls(&["evalsha"]).await == calls
    })
    .await;
}

/// What [`holder_task`] returns: its token once it holds the key, the signal to release
/// it, and the task.
type Waiting = (
    oneshot::Receiver<u64>,
    oneshot::Sender<()>,
    JoinHandle<Hold>,
);

/// The key held by an instance of the test (since `started`), a child waiting at the head
/// of its line (`head`) and a waiter of another instance behind it.
async fn lined_up(
    server: &RedisServer,
    spawn: impl FnOnce() -> ChildProcess,
) -> (LockGuard, u64, ChildProcess, String, Waiting) {
    let (holder, next) = (server.backend().await, server.backend().await);
    let held = holder.lock(KEY).try_once().await.expect("uncontended");
    let started = now_micros();
    // The script calls the child's build makes on a probe key, as this build does.
    let built = server.command_calls(&["evalsha"]).await;
    drop(server.backend().await);
    let now = server.command_calls(&["evalsha"]).await;
    let before = now + (now - built);
    let mut grantee = spawn();
    assert_eq!(grantee.next_report().await.as_deref(), Some("waiting"));
    server.wait_for_subscribers(KEY, 1).await;
    support::eventually("the child waits in line", || async {
        line(server).await.len() == 1
    })
    .await;
    settled(server, before + 2).await;
    let waiting = holder_task(&next, 1);
    server.wait_for_subscribers(KEY, 2).await;
    support::eventually("the next waiter is in line", || async {
        line(server).await.len() == 2
    })
    .await;
    settled(server, before + 4).await;
    let head = line(server).await[0].clone();
    (held, started, grantee, head, waiting)
}

/// `held` (since `started`) released while the head of the line cannot answer: the release
/// grants the key to `head`, and the next waiter takes it (`taken`) once the grant ran out,
/// under a later token. Returns the released hold.
async fn moves_on(
    server: &RedisServer,
    (held, started): (LockGuard, u64),
    head: &str,
    taken: oneshot::Receiver<u64>,
) -> Hold {
    let held = release(held, 0, started).await;
    let granted = granted_to(server, head).await;
    let token = timeout(HANG, taken)
        .await
        .expect("the key moves on after the grant lease")
        .expect("taken");
    assert!(token > granted, "{token} after the grant's {granted}");
    held
}

/// A proxy in front of `server`, for a grantee whose calls a test holds up.
async fn proxy_to(server: &RedisServer) -> FaultProxy {
    FaultProxy::start(
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        std::net::SocketAddr::from(([127, 0, 0, 1], server.port())),
    )
    .await
}

/// A backend through `proxy`, whose calls wait for the proxy rather than failing, and
/// whose subscriber sends no ping of its own meanwhile (what the proxy holds is its calls).
async fn through(proxy: &FaultProxy) -> RedisBackend {
    support::builder(&format!("redis://{}", proxy.addr()))
        .command_timeout(HANG)
        .subscriber_ping_interval(Duration::from_secs(3600))
        .build()
        .await
        .expect("backend through the proxy")
}

fn assert_no_violation(holds: &[Hold]) {
    let violations = history::check(holds, &Registers::new());
    assert!(violations.is_empty(), "{violations:#?}");
}

#[tokio::test]
async fn a_key_granted_to_an_instance_killed_right_after_the_grant_moves_on_to_the_next_waiter() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let spawn = || ChildProcess::spawn("grant::child_process", "waiter", &[(URL, server.url())]);
    let (held, started, mut grantee, head, (taken, go, waiter)) = lined_up(&server, spawn).await;

    // Stopped, the child can neither claim the grant nor hold; killed once the grant is in
    // Redis.
    grantee.pause();
    let held = release(held, 0, started).await;
    let released = Instant::now();
    let granted = granted_to(&server, &head).await;
    assert!(granted > held.token, "the grant's token is a new one");
    grantee.kill().await;

    let token = timeout(HANG, taken)
        .await
        .expect("the key moves on after the grant lease")
        .expect("taken");
    println!(
        "the next waiter took the key {:?} after the release that granted it to a dead instance",
        released.elapsed()
    );
    assert!(
        token > granted,
        "tokens strictly increase past the grant: {token} after {granted}"
    );
    let _ = go.send(());
    let next = waiter.await.expect("no panic");
    assert_no_violation(&[held, next]);
}

#[tokio::test]
async fn a_switch_between_instances_costs_the_grantee_no_acquire_call() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let (holder, next) = (server.backend().await, server.backend().await);
    let held = holder.lock(KEY).try_once().await.expect("uncontended");
    let before = server.command_calls(&["evalsha"]).await;
    let (taken, go, waiter) = holder_task(&next, 1);
    server.wait_for_subscribers(KEY, 1).await;
    // Its attempt before subscribing and the one after the subscription is confirmed:
    // then it sleeps until woken.
    support::eventually("the waiter made both its attempts", || async {
        server.command_calls(&["evalsha"]).await == before + 2
    })
    .await;
    assert_eq!(line(&server).await.len(), 1, "the waiter is in line");

    let started = now_micros();
    let (token, sent) = support::monitor::commands_sent(&server.url(), LOCK, async {
        let _ = release(held, 0, started).await;
        timeout(HANG, taken).await.expect("served").expect("taken")
    })
    .await;
    // acquire.lua's keys begin with the lock and its fencing counter; release.lua's with
    // the lock and its line.
    let acquisitions = sent
        .iter()
        .filter(|words| {
            words
                .first()
                .is_some_and(|w| w.eq_ignore_ascii_case("evalsha"))
                && words.get(4).is_some_and(|k| k.ends_with(":fence"))
        })
        .count();
    assert_eq!(
        acquisitions, 0,
        "the grantee took the key without an acquire call: {sent:?}"
    );
    assert!(token > 0);
    let _ = go.send(());
    waiter.await.expect("no panic");
}

#[tokio::test]
async fn a_grantee_that_hears_of_its_grant_after_it_ran_out_does_not_use_it() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let spawn = || ChildProcess::spawn("grant::child_process", "waiter", &[(URL, server.url())]);
    let (held, started, mut grantee, head, (taken, go, waiter)) = lined_up(&server, spawn).await;

    // Paused, as a process that the scheduler, a GC or a partition holds up: the grant's
    // message waits in its socket while the grant runs out and the next waiter takes the
    // key.
    grantee.pause();
    let held = moves_on(&server, (held, started), &head, taken).await;
    grantee.resume();
    // It reads the grant's message now: too late to use, it tries again and waits in line
    // behind the key's holder.
    support::eventually("the resumed child waits in line again", || async {
        line(&server).await == [head.clone()]
    })
    .await;
    let _ = go.send(());
    let next = waiter.await.expect("no panic");
    let report = timeout(HANG, grantee.next_report())
        .await
        .expect("the child holds the key after the next waiter")
        .expect("a report");
    let child = Hold::decode(&report).expect("a hold");
    assert!(child.token > next.token, "tokens strictly increase");
    assert_no_violation(&[held, next, child]);
}

/// The grantee hears of its grant, but its claim is held up (its calls wait in a proxy,
/// while the release's message gets through) until the grant has run out and the next
/// waiter took the key: its task must not have run as the holder meanwhile. A grant alone
/// lasts the short grant lease, so a holder that ran on it before its claim was confirmed
/// overlapped the next one whenever its process stalled past that lease (the Jepsen
/// test's frozen instances did).
#[tokio::test]
async fn a_grantee_whose_claim_is_held_up_past_its_grant_does_not_hold_meanwhile() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let proxy = proxy_to(&server).await;
    let (holder, next) = (server.backend().await, server.backend().await);
    let grantee = through(&proxy).await;
    let held = holder.lock(KEY).try_once().await.expect("uncontended");
    let started = now_micros();
    let before = server.command_calls(&["evalsha"]).await;
    let (mut grantee_taken, grantee_go, grantee_task) = holder_task(&grantee, CHILD);
    server.wait_for_subscribers(KEY, 1).await;
    settled(&server, before + 2).await;
    let (taken, go, waiter) = holder_task(&next, 1);
    server.wait_for_subscribers(KEY, 2).await;
    settled(&server, before + 4).await;
    let head = line(&server).await[0].clone();

    proxy.stall_requests();
    let held = moves_on(&server, (held, started), &head, taken).await;
    assert!(
        grantee_taken.try_recv().is_err(),
        "the grantee's task held the key on a grant it had not claimed, while the next \
         waiter holds it"
    );
    // Its claim comes too late: it waits again, and holds the key after the next waiter.
    proxy.resume();
    support::eventually("the grantee waits in line again", || async {
        line(&server).await.len() == 1
    })
    .await;
    let _ = go.send(());
    let next = waiter.await.expect("no panic");
    timeout(HANG, &mut grantee_taken)
        .await
        .expect("the grantee holds the key after the next waiter")
        .expect("taken");
    let _ = grantee_go.send(());
    let last = grantee_task.await.expect("no panic");
    assert!(last.token > next.token, "tokens strictly increase");
    assert_no_violation(&[held, next, last]);
}

/// The grantee's wait is cancelled (an outer timeout, its client gone) while its claim is
/// on its way: the claim still runs in Redis and makes the grant a hold for the whole lease
/// (30 s), which nobody holds a guard of. It must be released once the claim's reply comes.
#[tokio::test]
async fn a_grantee_cancelled_while_its_claim_is_on_its_way_leaves_the_key_free() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let proxy = proxy_to(&server).await;
    // The grant lasts until the claim gets through, however long the test takes to let it.
    let holder = support::builder(&server.url())
        .grant_lease(WAIT)
        .build()
        .await
        .expect("backend");
    let grantee = through(&proxy).await;
    let held = holder.lock(KEY).try_once().await.expect("uncontended");
    let before = server.command_calls(&["evalsha"]).await;
    let (_taken, _go, task) = holder_task(&grantee, CHILD);
    server.wait_for_subscribers(KEY, 1).await;
    settled(&server, before + 2).await;

    proxy.stall_requests();
    let held_back = proxy.held_requests();
    held.release().await.expect("releases");
    support::eventually("the grantee's claim waits in the proxy", || async {
        proxy.held_requests() > held_back
    })
    .await;
    task.abort();
    assert!(task.await.is_err_and(|e| e.is_cancelled()), "cancelled");
    proxy.resume();
    support::eventually("the claimed grant is released", || async {
        !server.exists(LOCK).await
    })
    .await;
    let next = holder.lock(KEY).try_once().await.expect("the key is free");
    next.release().await.expect("releases");
}

/// The grantee's host is cut off from the network (the Jepsen hosts: a network namespace
/// whose only way to Redis is a forwarder on its uplink) while it waits at the head of the
/// line: the grant's message never reaches it, the grant runs out, and the next waiter
/// takes the key; tokens strictly increase and holds never overlap.
#[tokio::test]
async fn a_key_granted_to_an_instance_partitioned_away_moves_on_to_the_next_waiter() {
    crate::needs!(Redis);
    const TEST: &str = "grant to a partitioned instance";
    if !Net::available() {
        support::netns::skip(TEST);
        return;
    }
    let server = RedisServer::start();
    let net = Net::new(&["app"]);
    let redis = std::net::SocketAddr::from(([127, 0, 0, 1], server.port()));
    let proxy = FaultProxy::start((net.root_ip("app"), 0).into(), redis).await;
    let url = format!("redis://{}", proxy.addr());
    let spawn = || {
        ChildProcess::spawn_in(
            &net.ns("app"),
            "grant::child_process",
            "waiter",
            &[(URL, url)],
        )
    };
    let (held, started, mut grantee, head, (taken, go, waiter)) = lined_up(&server, spawn).await;

    net.isolate("app");
    let held = moves_on(&server, (held, started), &head, taken).await;
    let _ = go.send(());
    let next = waiter.await.expect("no panic");
    grantee.kill().await;
    // Whatever the child reported holding (nothing: it never heard of the grant).
    let child: Vec<Hold> = grantee
        .remaining_reports()
        .await
        .iter()
        .filter_map(|r| Hold::decode(r))
        .collect();
    let mut holds = vec![held, next];
    holds.extend(child);
    assert_no_violation(&holds);
}

//! The `metrics` feature, read back through a recording recorder: names, labels, units
//! and values of what a contended route, a lost lock and the backend's subscriber and
//! watchdog report. Keys never appear in a label.
//!
//! One recorder serves the whole binary (it is process-global) and a snapshot drains it,
//! so the tests take turns ([`Recorded::turn`]).

mod support;

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request};
use axum::routing::{get, post};
use http::Method;
use metrics::Unit;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use support::{Gate, RedisServer, call, eventually, http_client, post as post_to, queued, serve};
use tokio::sync::{Mutex, MutexGuard};
use tower_lock::{LockLayer, MemoryBackend, PathParam, RedisBackend};

/// A metric as recorded: its name and labels, sorted.
type Name = (String, Vec<(String, String)>);

struct Recorded {
    snapshotter: Snapshotter,
    turn: Mutex<()>,
}

impl Recorded {
    fn get() -> &'static Recorded {
        static RECORDED: OnceLock<Recorded> = OnceLock::new();
        RECORDED.get_or_init(|| {
            let recorder = DebuggingRecorder::new();
            let snapshotter = recorder.snapshotter();
            recorder
                .install()
                .expect("the only recorder of this binary");
            Recorded {
                snapshotter,
                turn: Mutex::new(()),
            }
        })
    }

    /// This test's turn, with everything recorded before it drained.
    async fn turn() -> (MutexGuard<'static, ()>, &'static Recorded) {
        let recorded = Recorded::get();
        let turn = recorded.turn.lock().await;
        drop(recorded.snapshotter.snapshot());
        (turn, recorded)
    }

    /// What was recorded since the last snapshot (counters and gauges as deltas).
    fn take(&self) -> Snapshot {
        let mut values = HashMap::new();
        let mut units = HashMap::new();
        for (key, unit, _, value) in self.snapshotter.snapshot().into_vec() {
            let (_, key) = key.into_parts();
            let name = key.name().to_owned();
            let mut labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            if let Some(unit) = unit {
                units.insert(name.clone(), unit);
            }
            values.insert((name, labels), value);
        }
        Snapshot { values, units }
    }
}

struct Snapshot {
    values: HashMap<Name, DebugValue>,
    units: HashMap<String, Unit>,
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut labels: Vec<_> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    labels.sort();
    labels
}

impl Snapshot {
    fn value(&self, name: &str, pairs: &[(&str, &str)]) -> Option<&DebugValue> {
        self.values.get(&(name.to_owned(), labels(pairs)))
    }

    fn counter(&self, name: &str, pairs: &[(&str, &str)]) -> u64 {
        match self.value(name, pairs) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(other) => panic!("{name} {pairs:?} is not a counter: {other:?}"),
        }
    }

    fn gauge(&self, name: &str, pairs: &[(&str, &str)]) -> f64 {
        match self.value(name, pairs) {
            Some(DebugValue::Gauge(v)) => v.into_inner(),
            None => 0.0,
            Some(other) => panic!("{name} {pairs:?} is not a gauge: {other:?}"),
        }
    }

    fn samples(&self, name: &str, pairs: &[(&str, &str)]) -> Vec<f64> {
        match self.value(name, pairs) {
            Some(DebugValue::Histogram(v)) => v.iter().map(|s| s.into_inner()).collect(),
            None => Vec::new(),
            Some(other) => panic!("{name} {pairs:?} is not a histogram: {other:?}"),
        }
    }

    /// Every label value recorded, to show that no key leaks into one.
    fn label_values(&self) -> Vec<&str> {
        self.values
            .keys()
            .flat_map(|(_, labels)| labels.iter().map(|(_, v)| v.as_str()))
            .collect()
    }

    /// Every label name recorded.
    fn label_keys(&self) -> Vec<&str> {
        let mut keys: Vec<&str> = self
            .values
            .keys()
            .flat_map(|(_, labels)| labels.iter().map(|(k, _)| k.as_str()))
            .collect();
        keys.sort();
        keys.dedup();
        keys
    }

    fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.values.keys().map(|(n, _)| n.as_str()).collect();
        names.sort();
        names.dedup();
        names
    }
}

const ACQUISITIONS: &str = "tower_lock_acquisitions_total";
const WAIT: &str = "tower_lock_wait_seconds";
const HOLD: &str = "tower_lock_hold_seconds";
const HELD: &str = "tower_lock_held";
const WAITERS: &str = "tower_lock_waiters";
const SUBSCRIBED: &str = "tower_lock_subscribed_channels";
const RECONNECTS: &str = "tower_lock_subscriber_reconnects_total";
const RENEWALS_FAILED: &str = "tower_lock_renewals_failed_total";

/// The `mode` label of an exclusive hold, the default.
const EXCLUSIVE: (&str, &str) = ("mode", "exclusive");

/// The app under test: `/checkout/{id}` waits under the label `checkout`, `/try/{id}`
/// fails fast with no label (so axum's matched path names it). Both pass `gate`.
fn app(backend: RedisBackend, gate: Gate) -> Router {
    let pass = |gate: Gate| move |Path(_): Path<String>| async move { gate.pass().await };
    let checkout = Router::new()
        .route("/checkout/{id}", post(pass(gate.clone())))
        .route_layer(
            LockLayer::new(backend.clone(), PathParam::new("id").prefix("order"))
                .wait(Duration::from_secs(10))
                .metrics_label("checkout"),
        );
    let try_route = Router::new()
        .route("/try/{id}", post(pass(gate)))
        .route_layer(LockLayer::new(backend, PathParam::new("id").prefix("order")).fail_fast());
    checkout.merge(try_route)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contended_route_records_outcomes_waits_holds_and_gauges_under_its_label() {
    let (_turn, recorded) = Recorded::turn().await;
    let server = RedisServer::start();
    let connect = || {
        RedisBackend::builder(server.url())
            .namespace("shop")
            .build()
    };
    let (backend, other) = (
        connect().await.expect("backend"),
        connect().await.expect("other"),
    );
    let gate = Gate::default();
    let addr = serve(app(backend.clone(), gate.clone())).await;
    let client = http_client();
    let key = format!("k{}", std::process::id());

    // One request holds `checkout`, three wait behind it in this process and one on
    // another instance (which subscribes to the release); two fail fast on `try`.
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (client, path) = (client.clone(), format!("/checkout/{key}"));
        requests.spawn(async move { post_to(&client, addr, &path).await.status });
    }
    gate.wait_inside(1).await;
    queued(&backend, 3).await;
    let elsewhere = other
        .lock(format!("order:{key}"))
        .wait(Duration::from_secs(10));
    let elsewhere = tokio::spawn(async move { elsewhere.await.map(drop).is_ok() });
    let try_path = format!("/try/{key}");
    assert_eq!(post_to(&client, addr, &try_path).await.status, 409);
    assert_eq!(post_to(&client, addr, &try_path).await.status, 409);
    let checkout = [("namespace", "shop"), ("route", "checkout"), EXCLUSIVE];
    let during = recorded.take();
    assert_eq!(during.gauge(HELD, &checkout), 1.0, "one lock held");
    assert_eq!(during.gauge(WAITERS, &checkout), 3.0, "three requests wait");
    assert_eq!(
        during.counter(
            ACQUISITIONS,
            &[checkout[0], checkout[1], EXCLUSIVE, ("outcome", "acquired")]
        ),
        1
    );
    let mut subscribed = during.gauge(SUBSCRIBED, &[("namespace", "shop")]);
    eventually("the other instance subscribes", || {
        subscribed += recorded.take().gauge(SUBSCRIBED, &[("namespace", "shop")]);
        async move { subscribed == 1.0 }
    })
    .await;

    // A hold long enough to tell from a hold time of zero, then everyone through.
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.open();
    let statuses: Vec<u16> = requests.join_all().await;
    assert_eq!(statuses, [200; 4]);
    assert!(
        elsewhere.await.expect("task"),
        "the other instance got the lock"
    );
    let bad = post_to(&client, addr, "/checkout/%0A").await;
    assert_eq!(bad.status, 400, "{bad:?}");

    let after = recorded.take();
    let outcome = |route: &'static str, outcome: &'static str| {
        after.counter(
            ACQUISITIONS,
            &[
                ("namespace", "shop"),
                ("route", route),
                EXCLUSIVE,
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!(outcome("checkout", "acquired"), 3, "the three that waited");
    assert_eq!(outcome("checkout", "invalid_key"), 1);
    let contended = [
        ("namespace", "shop"),
        ("route", "/try/{id}"),
        EXCLUSIVE,
        ("outcome", "contended"),
    ];
    assert_eq!(
        during.counter(ACQUISITIONS, &contended),
        2,
        "axum's matched path"
    );
    assert_eq!(outcome("", "acquired"), 1, "the lock API's own acquisition");
    // The gauges were drained while the lock was held: the releases bring them down.
    assert_eq!(after.gauge(HELD, &checkout), -1.0);
    assert_eq!(after.gauge(WAITERS, &checkout), -3.0);
    let waits = after.samples(WAIT, &checkout);
    assert_eq!(
        waits.len(),
        3,
        "a wait per acquisition that asked: {waits:?}"
    );
    assert!(
        waits.iter().all(|&w| w > 0.04),
        "they waited for the hold: {waits:?}"
    );
    let holds = after.samples(HOLD, &checkout);
    assert_eq!(holds.len(), 4, "a hold time per release: {holds:?}");
    assert!(
        holds.iter().any(|&h| h > 0.04),
        "the first hold lasted: {holds:?}"
    );
    let contended = [("namespace", "shop"), ("route", "/try/{id}"), EXCLUSIVE];
    assert_eq!(
        during.samples(WAIT, &contended).len(),
        2,
        "fail-fast attempts record their (short) wait too"
    );

    // The other instance's subscriber gives up the channel once its waiter is served.
    subscribed += after.gauge(SUBSCRIBED, &[("namespace", "shop")]);
    eventually("the other instance unsubscribes", || {
        subscribed += recorded.take().gauge(SUBSCRIBED, &[("namespace", "shop")]);
        async move { subscribed == 0.0 }
    })
    .await;

    assert_eq!(after.units.get(WAIT), Some(&Unit::Seconds));
    assert_eq!(after.units.get(HOLD), Some(&Unit::Seconds));
    assert_eq!(after.units.get(ACQUISITIONS), Some(&Unit::Count));
    assert_eq!(
        after.label_keys(),
        ["mode", "namespace", "outcome", "route"]
    );
    let values = [during.label_values(), after.label_values()].concat();
    assert!(
        values
            .iter()
            .all(|v| !v.contains(&key) && !v.contains("order")),
        "no key among the label values: {values:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_lost_while_held_is_counted_once_when_its_hold_ends() {
    let (_turn, recorded) = Recorded::turn().await;
    let server = RedisServer::start();
    let backend = support::backend(&server.url()).await;
    let guard = backend
        .lock("lost")
        .lease(Duration::from_millis(300))
        .try_once()
        .await
        .expect("free lock");
    let _: () = redis::cmd("DEL")
        .arg(support::lock_key("lost"))
        .query_async(&mut server.conn().await)
        .await
        .expect("DEL");
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the watchdog finds the lock gone");
    drop(guard);
    let reentry = backend.lock("nested").try_once().await.expect("free");
    let inner = backend
        .lock("nested")
        .reentrant(reentry.held())
        .try_once()
        .await
        .expect("re-entered");
    inner.release().await.expect("released");
    reentry.release().await.expect("released");

    let s = recorded.take();
    let api = |outcome| {
        s.counter(
            ACQUISITIONS,
            &[
                ("namespace", "tower-lock"),
                ("route", ""),
                EXCLUSIVE,
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!(api("lost"), 1);
    assert_eq!(api("acquired"), 2);
    assert_eq!(api("reentered"), 1);
    let api_labels = [("namespace", "tower-lock"), ("route", ""), EXCLUSIVE];
    assert_eq!(s.gauge(HELD, &api_labels), 0.0, "every hold ended");
    assert_eq!(s.samples(HOLD, &api_labels).len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_counts_subscriber_reconnects_and_failed_renewals() {
    let (_turn, recorded) = Recorded::turn().await;
    let server = RedisServer::start();
    // No ping within the test: the reconnects are the two it causes, not one of a ping
    // that happened to fall into the pause below.
    let connect = || {
        RedisBackend::builder(server.url())
            .namespace("faults")
            .command_timeout(Duration::from_millis(200))
            .subscriber_ping_interval(Duration::from_secs(3600))
            .build()
    };
    let (backend, holder) = (
        connect().await.expect("backend"),
        connect().await.expect("holder"),
    );
    // Both subscribers listen on the admin channel (and are of type pubsub), the
    // backend's also on the release channel of the key it waits for.
    eventually("both subscribers listen", || async {
        server.numsub("faults:{%admin}:released").await == 2
    })
    .await;
    let held = holder.lock("busy").try_once().await.expect("free lock");
    let waiting = backend.lock("busy").wait(Duration::from_secs(10));
    let waiting = tokio::spawn(waiting);
    eventually("the waiter subscribes", || async {
        server.numsub("faults:{busy}:released").await == 1
    })
    .await;
    assert_eq!(server.kill_subscribers().await, 2);
    let faults = [("namespace", "faults")];
    eventually("both subscribers reconnect", || async {
        backend.stats().subscriber_connections_made >= 2
            && holder.stats().subscriber_connections_made >= 2
    })
    .await;
    held.release().await.expect("released");
    drop(
        waiting
            .await
            .expect("task")
            .expect("the waiter gets the lock"),
    );

    // A server that answers nothing for longer than the command timeout: renewals fail.
    let guard = backend
        .lock("renewed")
        .lease(Duration::from_millis(900))
        .try_once()
        .await
        .expect("free lock");
    let (mut reconnects, mut failed) = (0, 0);
    server.pause();
    eventually("a renewal fails", || {
        let s = recorded.take();
        reconnects += s.counter(RECONNECTS, &faults);
        failed += s.counter(RENEWALS_FAILED, &faults);
        async move { failed >= 1 }
    })
    .await;
    server.resume();
    drop(guard);

    let s = recorded.take();
    reconnects += s.counter(RECONNECTS, &faults);
    assert_eq!(reconnects, 2, "{:?}", s.names());
}

#[tokio::test]
async fn the_memory_backend_reports_under_the_namespace_memory() {
    let (_turn, recorded) = Recorded::turn().await;
    let backend = MemoryBackend::new();
    let layer = LockLayer::new(backend.clone(), |_: &Request| Some("one"))
        .fail_fast()
        .metrics_label("jobs");
    let app = Router::new()
        .route("/", post(|| async {}))
        .route_layer(layer);
    let request = || Request::post("/").body(axum::body::Body::empty());
    let held = backend.lock("one").try_once().await.expect("free");
    let busy = tower::ServiceExt::oneshot(app.clone(), request().expect("request")).await;
    assert_eq!(busy.expect("infallible").status(), 409);
    held.release().await.expect("released");
    let free = tower::ServiceExt::oneshot(app, request().expect("request")).await;
    assert_eq!(free.expect("infallible").status(), 200);

    let s = recorded.take();
    let jobs = |outcome| {
        s.counter(
            ACQUISITIONS,
            &[
                ("namespace", "memory"),
                ("route", "jobs"),
                EXCLUSIVE,
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!((jobs("contended"), jobs("acquired")), (1, 1));
}

#[tokio::test]
async fn a_waiter_that_gives_up_and_a_dropped_guard_bring_their_gauges_back_to_zero() {
    let (_turn, recorded) = Recorded::turn().await;
    let backend = MemoryBackend::new();
    let held = backend
        .lock("busy")
        .metrics_label("gauges")
        .try_once()
        .await
        .expect("free");
    let waiting = backend
        .lock("busy")
        .metrics_label("gauges")
        .wait(Duration::from_secs(30));
    let waiting = tokio::spawn(waiting);
    let labels = [("namespace", "memory"), ("route", "gauges"), EXCLUSIVE];
    // One runtime thread: yielding lets the waiter run until it parks in the queue.
    tokio::task::yield_now().await;
    // The client went away: the waiting acquisition is dropped.
    waiting.abort();
    assert!(waiting.await.is_err_and(|e| e.is_cancelled()));
    drop(held);

    let s = recorded.take();
    let gauge = |name| match s.value(name, &labels) {
        Some(DebugValue::Gauge(v)) => v.into_inner(),
        other => panic!("{name} was recorded as a gauge: {other:?}"),
    };
    assert_eq!(gauge(WAITERS), 0.0, "counted up, then down");
    assert_eq!(gauge(HELD), 0.0, "counted up, then down");
    assert_eq!(s.samples(HOLD, &labels).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_write_route_counts_reads_and_writes_in_separate_series() {
    let (_turn, recorded) = Recorded::turn().await;
    let backend = MemoryBackend::new();
    let gate = Gate::default();
    let inside = gate.clone();
    let read = move || {
        let gate = inside.clone();
        async move { gate.pass().await }
    };
    let docs = Router::new()
        .route("/docs/{id}", get(read).put(|| async {}))
        .route_layer(
            LockLayer::new(backend.clone(), PathParam::new("id").prefix("doc"))
                .read_write()
                .fail_fast()
                .metrics_label("docs"),
        );
    let exports = Router::new()
        .route("/exports", post(|| async {}))
        .route_layer(
            LockLayer::new(backend, |_: &Request| Some("exports"))
                .permits(2)
                .metrics_label("exports"),
        );
    let app = docs.merge(exports);

    // Two reads hold the document at once; a write meanwhile is refused.
    let reads: Vec<_> = (0..2)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { call(&app, Method::GET, "/docs/1").await.status })
        })
        .collect();
    gate.wait_inside(2).await;
    assert_eq!(call(&app, Method::PUT, "/docs/1").await.status, 409);
    let during = recorded.take();
    gate.open();
    for read in reads {
        assert_eq!(read.await.expect("task"), 200);
    }
    assert_eq!(call(&app, Method::PUT, "/docs/1").await.status, 200);
    assert_eq!(call(&app, Method::POST, "/exports").await.status, 200);
    let after = recorded.take();

    let labels = |route, mode| [("namespace", "memory"), ("route", route), ("mode", mode)];
    let count = |s: &Snapshot, route, mode, outcome| {
        let [namespace, route, mode] = labels(route, mode);
        s.counter(
            ACQUISITIONS,
            &[namespace, route, mode, ("outcome", outcome)],
        )
    };
    assert_eq!(count(&during, "docs", "shared", "acquired"), 2);
    assert_eq!(count(&during, "docs", "exclusive", "contended"), 1);
    assert_eq!(count(&during, "docs", "exclusive", "acquired"), 0);
    assert_eq!(during.gauge(HELD, &labels("docs", "shared")), 2.0);
    assert_eq!(count(&after, "docs", "exclusive", "acquired"), 1);
    assert_eq!(after.samples(HOLD, &labels("docs", "shared")).len(), 2);
    assert_eq!(after.samples(HOLD, &labels("docs", "exclusive")).len(), 1);
    assert_eq!(count(&after, "exports", "permit", "acquired"), 1);
    assert_eq!(after.samples(HOLD, &labels("exports", "permit")).len(), 1);
}

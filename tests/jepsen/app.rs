//! An app instance of the nemesis test, run as a child process in its own network
//! namespace: an axum app with the lock layer on two backends (with and without the
//! delayed-restart guard), a read-modify-write handler with fenced writes, and a probe
//! that holds its lock long enough to be cut off. Every hold is reported when its handler
//! stops, whether it returned or was dropped because the lock was lost.

use axum::extract::{Path, Request};
use axum::routing::post;
use axum::{Extension, Router};
use tower_lock::{FencedStore, FencedWrite, HeldLock, LockLayer, RedisBackend};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "entry point of the app instances that the nemesis test spawns"]
async fn jepsen_child() {
    if child::role().as_deref() == Some("app") {
        app().await;
    }
}

#[derive(Clone)]
struct Ctx {
    instance: usize,
    ns: &'static str,
    store: FencedStore,
}

async fn app() {
    let redis = child::setting(REDIS_URL);
    let instance: usize = child::setting(INSTANCE).parse().expect("instance");
    let store = FencedStore::new(support::backend(&child::setting(DB_URL)).await);
    let mut router = Router::new();
    for ns in NAMESPACES {
        let backend = match std::env::var(TOPOLOGY).as_deref() {
            Ok("cluster") => cluster_backend(&redis, ns).await,
            _ => {
                let mut builder = RedisBackend::builder(redis.as_str())
                    .namespace(namespace(ns))
                    .command_timeout(Duration::from_millis(500))
                    .connect_timeout(Duration::from_millis(500));
                if ns == "g" {
                    builder = builder.restart_guard().max_lease(LEASE);
                }
                builder.build().await.expect("backend")
            }
        };
        let ctx = Ctx {
            instance,
            ns,
            store: store.clone(),
        };
        let layer = LockLayer::new(backend, last_segment as fn(&Request) -> Option<String>)
            .wait(WAIT)
            .lease(LEASE);
        router = router.merge(
            Router::new()
                .route(&format!("/{ns}/rmw/{{key}}"), post(rmw))
                .route(&format!("/{ns}/hold/{{key}}"), post(probe))
                .route_layer(layer)
                .layer(Extension(ctx)),
        );
    }
    let listener = tokio::net::TcpListener::bind(child::setting(LISTEN))
        .await
        .expect("bind");
    child::report("ready");
    axum::serve(listener, router).await.expect("serve");
}

/// The deployment the instances lock on: "single" (one server) when absent, "cluster".
const TOPOLOGY: &str = "JEPSEN_TOPOLOGY";

/// A backend on the cluster whose seed URLs `seeds` lists, comma-separated: namespace "s"
/// safe (every grant and renewal on a replica, the restart guard), "a" asynchronous.
async fn cluster_backend(seeds: &str, ns: &str) -> RedisBackend {
    let mut builder = RedisBackend::cluster(seeds.split(','))
        .namespace(namespace(ns))
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500));
    if ns == "s" {
        builder = builder
            .sync_replicas(1, Duration::from_millis(200))
            .restart_guard()
            .max_lease(LEASE);
    }
    builder.build().await.expect("cluster backend")
}

fn last_segment(req: &Request) -> Option<String> {
    req.uri().path().rsplit('/').next().map(str::to_owned)
}

/// Reports the hold when the handler stops, whether it returned or was dropped.
struct Recorder {
    hold: Hold,
    probe: bool,
    completed: bool,
}

impl Recorder {
    fn new(ctx: &Ctx, key: &str, lock: &HeldLock, probe: bool) -> Self {
        Recorder {
            hold: Hold {
                instance: ctx.instance,
                key: format!("{}-{key}", ctx.ns),
                token: lock.fencing_token(),
                start: now_micros(),
                end: 0,
                write: Write::Skipped,
            },
            probe,
            completed: false,
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.hold.end = now_micros();
        let hold = &self.hold;
        if self.probe {
            let (instance, key, token, end) = (hold.instance, &hold.key, hold.token, hold.end);
            let completed = self.completed;
            child::report(&format!(
                "probe-end {instance} {key} {token} {end} {completed}"
            ));
        }
        child::report(&hold.encode());
    }
}

async fn rmw(
    Extension(ctx): Extension<Ctx>,
    Extension(lock): Extension<HeldLock>,
    Path(key): Path<String>,
) -> &'static str {
    let mut recorder = Recorder::new(&ctx, &key, &lock, false);
    increment(&ctx, &mut recorder).await;
    recorder.completed = true;
    "ok"
}

/// Holds for [`PROBE_HOLD`] (the nemesis cuts this instance off meanwhile), then
/// increments like [`rmw`].
async fn probe(
    Extension(ctx): Extension<Ctx>,
    Extension(lock): Extension<HeldLock>,
    Path(key): Path<String>,
) -> &'static str {
    let mut recorder = Recorder::new(&ctx, &key, &lock, true);
    let hold = &recorder.hold;
    child::report(&format!(
        "probe-held {} {} {}",
        hold.instance, hold.key, hold.token
    ));
    tokio::time::sleep(PROBE_HOLD).await;
    increment(&ctx, &mut recorder).await;
    recorder.completed = true;
    "ok"
}

/// Reads the register, writes it plus one with the hold's token.
async fn increment(ctx: &Ctx, recorder: &mut Recorder) {
    let register = recorder.hold.key.clone();
    let Ok(current) = ctx.store.read(&register).await else {
        return;
    };
    let next = current.map_or(0, |c| c.value.parse::<u64>().expect("a number")) + 1;
    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=2))).await;
    recorder.hold.write = Write::Unknown(next);
    let token = recorder.hold.token;
    recorder.hold.write = match ctx.store.write(&register, token, &next.to_string()).await {
        Ok(FencedWrite::Written) => Write::Written(next),
        Ok(FencedWrite::Stale { .. }) => Write::Stale,
        Err(_) => Write::Unknown(next),
    };
}

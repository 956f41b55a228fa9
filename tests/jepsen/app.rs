//! An app instance of the nemesis test, run as a child process in its own network
//! namespace: an axum app with the lock layer on two backends (with and without the
//! delayed-restart guard; on Sentinel, with and without `sync_replicas` too, see
//! `sentinel_backend`), a read-modify-write handler with fenced writes, and a probe
//! that holds its lock long enough to be cut off. Every hold is reported when its handler
//! stops, whether it returned or was dropped because the lock was lost.

use axum::extract::{Path, Request};
use axum::routing::post;
use axum::{Extension, Router};
use tower_lock::redis::{FencedStore, FencedWrite};
use tower_lock::{HeldLock, LockLayer, RedisBackend, RedisBackendBuilder};

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
    // "single" when absent; `JEPSEN_REDIS_URL` is the topology's URL (or URLs, comma-separated).
    let topology = std::env::var("JEPSEN_TOPOLOGY").unwrap_or_default();
    for ns in NAMESPACES {
        let mut builder = match topology.as_str() {
            "cluster" => cluster_backend(&redis, ns),
            "sentinel" => sentinel_backend(ns),
            _ => RedisBackend::builder(redis.as_str()),
        };
        builder = builder
            .namespace(namespace(ns))
            .command_timeout(Duration::from_millis(500))
            .connect_timeout(Duration::from_millis(500));
        if ns == "g" {
            builder = builder.restart_guard().max_lease(LEASE);
        }
        let backend = builder.build().await.expect("backend");
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

/// On the cluster whose seed URLs `seeds` lists, comma-separated: namespace "s" safe
/// (every grant and renewal on a replica, the restart guard), "a" asynchronous.
fn cluster_backend(seeds: &str, ns: &str) -> RedisBackendBuilder {
    safe_in_s(RedisBackend::cluster(seeds.split(',')), ns)
}

/// Through the sentinels of `JEPSEN_REDIS_URL` to the master, logged in with
/// `JEPSEN_MASTER_PASSWORD`; namespace "s" (safe) waits for a replica's acknowledgement and
/// has the restart guard, "a" (asynchronous replication) has neither.
fn sentinel_backend(ns: &str) -> RedisBackendBuilder {
    let sentinels = child::setting(REDIS_URL);
    let builder = RedisBackend::sentinel(sentinels.split(','), support::sentinel::MASTER_NAME)
        .master_password(child::setting("JEPSEN_MASTER_PASSWORD"));
    safe_in_s(builder, ns)
}

/// In namespace "s" (safe): every grant and renewal acknowledged by a replica, and the
/// restart guard; "a" (asynchronous replication) has neither.
fn safe_in_s(builder: RedisBackendBuilder, ns: &str) -> RedisBackendBuilder {
    match ns {
        "s" => builder
            .sync_replicas(1, Duration::from_millis(200))
            .restart_guard()
            .max_lease(LEASE),
        _ => builder,
    }
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

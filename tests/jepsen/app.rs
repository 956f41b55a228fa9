//! An app instance of the nemesis test, run as a child process in its own network
//! namespace: an axum app with the lock layer on a backend per lock namespace (on Redis,
//! with and without the delayed-restart guard; on Sentinel, with and without
//! `sync_replicas` too, see `sentinel_backend`; on another store, one), a
//! read-modify-write handler with fenced writes, a probe that holds its lock long enough
//! to be cut off, and the successor's increment that waits for the probe's lock. Every
//! hold is reported when its handler stops, whether it returned or was dropped because the
//! lock was lost; with `JEPSEN_LEADERS`, so is every term of the instance's leadership.

use axum::extract::{Path, Request};
use axum::routing::post;
use axum::{Extension, Router};
use tokio_util::sync::CancellationToken;
use tower_lock::redis::{FencedStore, FencedWrite};
use tower_lock::{HeldLock, LockBackend, LockLayer, RedisBackend, RedisBackendBuilder};

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
    /// Cancelled by `POST /stop-leading`: the campaigns end (their terms reported) before
    /// the test drains the instances.
    leading: CancellationToken,
}

async fn app() {
    // The instance's log on stderr, which the test shows, with the filter `JEPSEN_LOG`
    // sets (`warn`: a store server down, a lock lost); none without it.
    let filter = tracing_subscriber::EnvFilter::try_from_env("JEPSEN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let url = child::setting(STORE_URL);
    let instance: usize = child::setting(INSTANCE).parse().expect("instance");
    let store = FencedStore::new(support::backend(&child::setting(DB_URL)).await);
    // The store: Redis ("single" when absent, "sentinel", "cluster") or another one;
    // `JEPSEN_STORE_URL` is its URL (or URLs, comma-separated).
    let topology = std::env::var(TOPOLOGY).unwrap_or_default();
    let leading = CancellationToken::new();
    let stop_leading = leading.clone();
    let mut router = Router::new().route(
        "/stop-leading",
        post(move || async move { stop_leading.cancel() }),
    );
    for ns in NAMESPACES {
        let ctx = Ctx {
            instance,
            ns,
            store: store.clone(),
            leading: leading.clone(),
        };
        router = router.merge(match topology.as_str() {
            #[cfg(feature = "etcd")]
            "etcd" => routes(etcd_backend(&url, ns).await, ctx),
            "postgres" => routes(postgres_backend(&url, ns).await, ctx),
            "mysql" => routes(mysql_backend(&url, ns).await, ctx),
            "zookeeper" => routes(zookeeper_backend(&url, ns).await, ctx),
            _ => routes(redis_backend(&topology, &url, ns).await, ctx),
        });
    }
    let listener = tokio::net::TcpListener::bind(child::setting(LISTEN))
        .await
        .expect("bind");
    child::report("ready");
    axum::serve(listener, router).await.expect("serve");
}

/// The routes of lock namespace `ctx.ns` on `backend`: the increment, the probe and the
/// successor's increment (which waits for up to three leases: a lock its cut-off or frozen
/// holder cannot give back). With `JEPSEN_LEADERS` set, the instance also campaigns.
fn routes<B: LockBackend>(backend: B, ctx: Ctx) -> Router {
    if std::env::var_os(LEADERS).is_some() {
        tokio::spawn(lead(backend.clone(), ctx.clone()));
    }
    let layer = |wait| {
        LockLayer::new(
            backend.clone(),
            last_segment as fn(&Request) -> Option<String>,
        )
        .wait(wait)
        .lease(lease())
    };
    let ns = ctx.ns;
    Router::new()
        .route(&format!("/{ns}/rmw/{{key}}"), post(rmw))
        .route(&format!("/{ns}/hold/{{key}}"), post(probe))
        .route_layer(layer(wait()))
        .merge(
            Router::new()
                .route(&format!("/{ns}/next/{{key}}"), post(rmw))
                .route_layer(layer(3 * lease())),
        )
        .layer(Extension(ctx))
}

/// A Redis backend of `topology` at `url` (on a quorum, the masters' URLs, comma-separated)
/// in lock namespace `ns`: with the delayed-restart guard in "g", and on Sentinel or a
/// cluster safe in "s" (see [`safe_in_s`]).
async fn redis_backend(topology: &str, url: &str, ns: &str) -> RedisBackend {
    let mut builder = match topology {
        "cluster" => cluster_backend(url, ns),
        "sentinel" => sentinel_backend(ns),
        // The restart guard is always on on a quorum: it waits out one lease.
        "quorum" => RedisBackend::quorum(url.split(',')).max_lease(lease()),
        _ => RedisBackend::builder(url),
    };
    builder = builder
        .namespace(namespace(ns))
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500));
    if ns == "g" {
        builder = builder.restart_guard().max_lease(LEASE);
    }
    builder.build().await.expect("backend")
}

/// An etcd backend on the members at `endpoints` (comma-separated), in `ns`, with the
/// default timeouts.
#[cfg(feature = "etcd")]
async fn etcd_backend(endpoints: &str, ns: &str) -> tower_lock::EtcdBackend {
    tower_lock::EtcdBackend::builder(endpoints.split(','))
        .namespace(namespace(ns))
        .lease_ttl(lease())
        .build()
        .await
        .expect("etcd backend")
}

/// A PostgreSQL backend on the server at `url`, in `ns`.
async fn postgres_backend(url: &str, ns: &str) -> tower_lock::PostgresBackend {
    tower_lock::PostgresBackend::builder(url)
        .namespace(namespace(ns))
        .migrate()
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("postgres backend")
}

/// A MySQL/MariaDB backend on the server at `url`, in `ns`.
async fn mysql_backend(url: &str, ns: &str) -> tower_lock::MySqlBackend {
    tower_lock::MySqlBackend::builder(url)
        .namespace(namespace(ns))
        .migrate()
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("mysql backend")
}

/// A ZooKeeper backend on the servers at `hosts` (a connection string), in `ns`, with
/// sessions of the lease.
async fn zookeeper_backend(hosts: &str, ns: &str) -> tower_lock::ZooKeeperBackend {
    tower_lock::ZooKeeperBackend::builder(hosts)
        .namespace(namespace(ns))
        .session_timeout(lease())
        .build()
        .await
        .expect("zookeeper backend")
}

/// Campaigns for the leadership of the namespace until the instance ends: each term makes
/// one fenced increment of the register `NS-leader` with its epoch, and resigns after a
/// while, so that the terms go round the instances. Each term is reported as a hold.
async fn lead<B: LockBackend>(backend: B, ctx: Ctx) {
    let leading = ctx.leading.clone();
    let campaign = backend.leader("jepsen").lease(lease()).run(|leadership| {
        let ctx = ctx.clone();
        async move {
            // Dropped (reporting the term's end) before the leadership it holds.
            let mut recorder = Recorder::new(&ctx, "leader", leadership.fencing_token(), false);
            increment(&ctx, &mut recorder).await;
            let term = Duration::from_millis(fastrand::u64(200..1500));
            tokio::time::sleep(term).await;
            recorder.completed = true;
        }
    });
    tokio::select! {
        result = campaign => {
            if let Err(e) = result {
                eprintln!("instance {}: the campaign ended: {e}", ctx.instance);
            }
        }
        () = leading.cancelled() => {}
    }
}

/// On the cluster whose seed URLs `seeds` lists, comma-separated: namespace "s" safe
/// (every grant and renewal on a replica, the restart guard), "a" asynchronous.
fn cluster_backend(seeds: &str, ns: &str) -> RedisBackendBuilder {
    safe_in_s(RedisBackend::cluster(seeds.split(',')), ns)
}

/// Through the sentinels of `JEPSEN_STORE_URL` to the master, logged in with
/// `JEPSEN_MASTER_PASSWORD`; namespace "s" (safe) waits for a replica's acknowledgement and
/// has the restart guard, "a" (asynchronous replication) has neither.
fn sentinel_backend(ns: &str) -> RedisBackendBuilder {
    let sentinels = child::setting(STORE_URL);
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
    fn new(ctx: &Ctx, key: &str, token: u64, probe: bool) -> Self {
        Recorder {
            hold: Hold {
                instance: ctx.instance,
                key: format!("{}-{key}", ctx.ns),
                token,
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
    let mut recorder = Recorder::new(&ctx, &key, lock.fencing_token(), false);
    increment(&ctx, &mut recorder).await;
    recorder.completed = true;
    "ok"
}

/// Holds for [`PROBE_HOLD`] (scaled to the lease; the nemesis cuts this instance off meanwhile), then
/// increments like [`rmw`].
async fn probe(
    Extension(ctx): Extension<Ctx>,
    Extension(lock): Extension<HeldLock>,
    Path(key): Path<String>,
) -> &'static str {
    let mut recorder = Recorder::new(&ctx, &key, lock.fencing_token(), true);
    let hold = &recorder.hold;
    child::report(&format!(
        "probe-held {} {} {}",
        hold.instance, hold.key, hold.token
    ));
    tokio::time::sleep(scaled(PROBE_HOLD, lease())).await;
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

//! Redis Cluster: three primaries with a replica each, started once for this binary; the
//! scenarios share it, the one that kills a primary last.

#[path = "cluster/checks.rs"]
mod checks;
#[path = "cluster/family.rs"]
mod family;
#[path = "cluster/grant.rs"]
mod grant;
#[path = "cluster/idempotency.rs"]
mod idempotency;
#[path = "cluster/late_resend.rs"]
mod late_resend;
#[path = "cluster/lost_node.rs"]
mod lost_node;
#[path = "cluster/reshard.rs"]
mod reshard;
use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Extension, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{AsyncCommands, Script};
use support::cluster::{Cluster, key_on};
use support::{RedisServer, http_client, request, send, serve};
use tokio::time::Instant;
use tower_lock::redis::{FencedStore, FencedWrite};
use tower_lock::{BuildError, ConnectFailure, HeldLock, LockLayer, RedisBackend};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_scenarios() {
    crate::needs!(Redis);
    support::init_tracing();
    let mut cluster = Cluster::start();
    let shards = cluster.primaries();
    assert_eq!(shards.len(), 3, "three primaries");

    locks_of_every_shard_are_taken_renewed_and_released_on_their_shard(&cluster).await;
    a_multi_key_lock_spans_the_shards_of_its_keys(&cluster).await;
    family::shared_holds_and_permits_live_on_their_shard(&cluster).await;
    idempotency::records_live_on_the_shard_of_their_lock_and_replay(&cluster).await;
    waiters_do_not_poll_and_a_release_reaches_only_its_shard(&cluster).await;
    grant::a_release_grants_the_key_to_the_waiting_instance(&cluster).await;
    three_instances_sell_exactly_the_stock_of_every_shard(&cluster).await;
    acquire_release_latency_next_to_a_single_server(&cluster).await;
    held_keys_of_every_shard_are_listed(&cluster).await;
    a_waiter_follows_its_channel_to_the_new_shard_after_a_reshard(&cluster).await;
    reshard::a_lock_follows_its_slot_through_a_step_by_step_reshard(&cluster).await;
    checks::build_checks_hold_on_every_primary(&cluster).await;
    an_acquisition_resent_after_a_lost_reply_is_taken_once(&cluster).await;
    a_release_resent_after_a_lost_reply_is_not_reported_lost(&cluster).await;
    late_resend::late_copies_take_nothing(&cluster).await;
    sync_replicas_waits_only_on_the_shard_of_the_lock(&cluster).await;
    a_stopped_shard_does_not_hold_up_the_renewals_of_the_others(&cluster).await;
    let killed =
        a_killed_primary_stops_only_its_shard_until_its_replica_takes_over(&mut cluster).await;
    lost_node::the_backends_stop_reconnecting_to_a_killed_node(killed).await;
}

#[tokio::test]
async fn a_cluster_without_seeds_or_answering_nodes_is_a_build_error() {
    let none: [&str; 0] = [];
    let empty = RedisBackend::cluster(none).build().await;
    assert!(matches!(empty, Err(BuildError::Url { .. })), "{empty:?}");
    // A port nothing listens on: refused at once, not after a hang.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let started = Instant::now();
    let refused = RedisBackend::cluster([format!("redis://127.0.0.1:{closed}")])
        .connect_timeout(Duration::from_millis(500))
        .build()
        .await;
    let at = format!("127.0.0.1:{closed}");
    assert!(
        matches!(&refused, Err(BuildError::Connect { addr, failure: ConnectFailure::Refused, .. }) if *addr == at),
        "{refused:?}"
    );
    eprintln!(
        "cluster build refused after {:?}: {}",
        started.elapsed(),
        refused.unwrap_err()
    );
}

/// One key per shard plus 30 more: each lock hash lives on the primary that owns its slot,
/// the watchdog renews them all (one script call per slot: one call across slots would be
/// refused with CROSSSLOT) through three leases, and release leaves nothing behind.
async fn locks_of_every_shard_are_taken_renewed_and_released_on_their_shard(cluster: &Cluster) {
    let backend = cluster.backend().await;
    // Renewed every third of it: a second of room for a renewal delayed on a loaded machine
    // (six servers share it with the test).
    let lease = Duration::from_millis(1500);
    let mut keys: Vec<(String, u16)> = cluster
        .primaries()
        .into_iter()
        .map(|port| (key_on(cluster, port, "spread:"), port))
        .collect();
    for i in 0..30 {
        let key = format!("many:{i}");
        let port = cluster.primary_of(&format!("tower-lock:{{{key}}}"));
        keys.push((key, port));
    }
    let mut guards = Vec::new();
    for (key, _) in &keys {
        let guard = backend.lock(key.clone()).lease(lease).try_once().await;
        guards.push(guard.expect("uncontended"));
    }
    for (key, port) in &keys {
        assert!(
            cluster.exists_on(*port, &format!("tower-lock:{{{key}}}")),
            "{key}'s lock hash is on its shard's primary {port}"
        );
    }
    tokio::time::sleep(lease * 3).await;
    for guard in &guards {
        assert!(!guard.is_lost(), "{} was renewed", guard.key());
    }
    // The fenced value of a key lives on the lock's shard too (one script, one slot).
    let store = FencedStore::new(backend.clone());
    for guard in &guards {
        let write = store.write(guard.key(), guard.fencing_token(), "v").await;
        assert_eq!(write.expect("fenced write"), FencedWrite::Written);
        let stale = store
            .write(guard.key(), guard.fencing_token() - 1, "old")
            .await;
        assert!(matches!(stale, Ok(FencedWrite::Stale { .. })));
    }
    for guard in guards {
        guard.release().await.expect("release");
    }
    for (key, port) in &keys {
        assert!(!cluster.exists_on(*port, &format!("tower-lock:{{{key}}}")));
    }
}

/// `list_held` reads every primary: 1,500 keys held over the three shards are listed once
/// each, the free ones and another namespace's not at all.
async fn held_keys_of_every_shard_are_listed(cluster: &Cluster) {
    let backend = cluster
        .builder()
        .namespace("listing")
        .build()
        .await
        .expect("backend");
    let other = cluster.backend().await;
    let _elsewhere = other
        .lock("held:0")
        .try_once()
        .await
        .expect("other namespace");
    let mut held = Vec::new();
    for n in 0..1_600 {
        let guard = backend.lock(format!("held:{n:04}")).try_once().await;
        held.push(guard.expect("uncontended"));
    }
    for guard in held.split_off(1_500) {
        guard.release().await.expect("release");
    }
    let mut shards: Vec<u16> = held
        .iter()
        .map(|guard| cluster.primary_of(&format!("listing:{{{}}}", guard.key())))
        .collect();
    shards.sort_unstable();
    shards.dedup();
    assert_eq!(shards.len(), 3, "keys on every shard");

    let listed = backend.list_held("held:").await.expect("list");
    let keys: Vec<&str> = listed.iter().map(|info| info.key.as_str()).collect();
    let expected: Vec<String> = (0..1_500).map(|n| format!("held:{n:04}")).collect();
    let missing: Vec<&String> = expected
        .iter()
        .filter(|k| !keys.contains(&k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{} missing, from {:?}",
        missing.len(),
        missing.first()
    );
    assert_eq!(keys.len(), expected.len(), "listed once each, no others");
    for guard in held {
        guard.release().await.expect("release");
    }
    assert_eq!(backend.list_held("").await.expect("list").len(), 0);
}

/// `lock_many` over keys of three shards: each key's lock hash is on its own shard, a
/// second multi-key lock that overlaps gets `Contended` and leaves nothing taken, and the
/// release frees every shard.
async fn a_multi_key_lock_spans_the_shards_of_its_keys(cluster: &Cluster) {
    let backend = cluster.backend().await;
    let keys: Vec<(String, u16)> = cluster
        .primaries()
        .into_iter()
        .map(|port| (key_on(cluster, port, "multi:"), port))
        .collect();
    let guard = backend
        .lock_many(keys.iter().rev().map(|(key, _)| key.clone()))
        .try_once()
        .await
        .expect("free keys on three shards");
    assert_eq!(guard.held().keys().count(), 3);
    for (key, port) in &keys {
        assert!(
            cluster.exists_on(*port, &format!("tower-lock:{{{key}}}")),
            "{key} on {port}"
        );
    }
    // The free key sorts first: it is taken, then given back when the held one is found.
    let overlapping = [keys[0].0.clone(), "a-multi:elsewhere".to_owned()];
    let busy = backend.lock_many(overlapping).try_once().await;
    assert!(
        matches!(busy, Err(tower_lock::LockError::Contended { .. })),
        "{busy:?}"
    );
    let elsewhere = cluster.primary_of("tower-lock:{a-multi:elsewhere}");
    assert!(!cluster.exists_on(elsewhere, "tower-lock:{a-multi:elsewhere}"));
    guard.release().await.expect("released");
    for (key, port) in &keys {
        assert!(
            !cluster.exists_on(*port, &format!("tower-lock:{{{key}}}")),
            "{key} freed"
        );
    }
}

/// `key` held by `holder` and waited for (up to 20 s) by `waiter`, in a task.
async fn held_and_waited_for(
    (holder, waiter): (&RedisBackend, RedisBackend),
    key: &str,
) -> (
    tower_lock::LockGuard,
    tokio::task::JoinHandle<Result<tower_lock::LockGuard, tower_lock::LockError>>,
) {
    let held = holder.lock(key).try_once().await.expect("free");
    let key = key.to_owned();
    let waiting = tokio::spawn(async move { waiter.lock(key).wait(Duration::from_secs(20)).await });
    (held, waiting)
}

/// A waiter subscribes with SSUBSCRIBE on its key's shard only, sends no script while it
/// waits, and the release is published with SPUBLISH on that shard alone (never PUBLISH,
/// which a cluster broadcasts to every node).
async fn waiters_do_not_poll_and_a_release_reaches_only_its_shard(cluster: &Cluster) {
    let primaries = cluster.primaries();
    let owner = primaries[1];
    let key = key_on(cluster, owner, "wait:");
    let channel = format!("tower-lock:{{{key}}}:released");
    let scripts = |c: &Cluster| -> u64 {
        primaries
            .iter()
            .map(|&p| c.command_calls(p, &["evalsha", "eval"]))
            .sum()
    };
    let backends = (&cluster.backend().await, cluster.backend().await);
    let start = scripts(cluster);
    let (held, waiting) = held_and_waited_for(backends, &key).await;
    support::eventually("the waiter subscribed on its shard", || async {
        cluster.shard_subscribers(owner, &channel) == 1
    })
    .await;
    // The hold, the waiter's try, and its try once the subscription was confirmed: the
    // last script before the release.
    support::eventually("the waiter tried again once subscribed", || async {
        scripts(cluster) - start >= 3
    })
    .await;
    for &port in &primaries {
        let expected = i64::from(port == owner);
        assert_eq!(
            cluster.shard_subscribers(port, &channel),
            expected,
            "{port}"
        );
    }
    let before = scripts(cluster);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(scripts(cluster), before, "no script calls while waiting");

    let spublish = |c: &Cluster| -> Vec<u64> {
        let ports = c.live();
        ports
            .iter()
            .map(|&p| c.command_calls(p, &["spublish"]))
            .collect()
    };
    let spublished = spublish(cluster);
    held.release().await.expect("release");
    let guard = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter is woken")
        .expect("task")
        .expect("the waiter gets the lock");
    let after = spublish(cluster);
    for ((port, before), after) in cluster.live().into_iter().zip(spublished).zip(after) {
        let expected = u64::from(port == owner);
        assert_eq!(after - before, expected, "SPUBLISH calls on {port}");
    }
    for port in cluster.live() {
        assert_eq!(
            cluster.command_calls(port, &["publish"]),
            0,
            "PUBLISH on {port}"
        );
    }
    guard.release().await.expect("release");
}

/// The slot of a waited-for key moves to another primary while its lock is held: the old
/// shard ends the subscription, the waiter's channel is subscribed again on the new owner,
/// and the release there (MOVED followed by redis-rs) wakes the waiter long before the
/// holder's 30 s lease would.
async fn a_waiter_follows_its_channel_to_the_new_shard_after_a_reshard(cluster: &Cluster) {
    let primaries = cluster.primaries();
    let (from, to) = (primaries[2], primaries[1]);
    let key = key_on(cluster, from, "reshard:");
    let channel = format!("tower-lock:{{{key}}}:released");
    let backends = (&cluster.backend().await, cluster.backend().await);
    let (held, waiting) = held_and_waited_for(backends, &key).await;
    support::eventually("the waiter subscribed on the old shard", || async {
        cluster.shard_subscribers(from, &channel) == 1
    })
    .await;
    cluster.move_slot(&format!("tower-lock:{{{key}}}"), to);
    support::eventually("the waiter subscribed on the new shard", || async {
        cluster.shard_subscribers(to, &channel) == 1
    })
    .await;
    assert_eq!(cluster.shard_subscribers(from, &channel), 0);
    held.release().await.expect("release on the new shard");
    let guard = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter is woken by the release on the new shard")
        .expect("task")
        .expect("the waiter gets the lock");
    guard.release().await.expect("release");
}

/// Writes a sale only if the seller's fencing token is newer than the last sale's.
///
/// KEYS[1] the shop hash {stock, token}, KEYS[2] the ledger list of "buyer token"
/// ARGV[1] new stock, ARGV[2] fencing token, ARGV[3] buyer id
const SELL: &str = r"
local last = tonumber(redis.call('hget', KEYS[1], 'token') or '0')
if tonumber(ARGV[2]) <= last then return 0 end
redis.call('hset', KEYS[1], 'stock', ARGV[1], 'token', ARGV[2])
redis.call('rpush', KEYS[2], ARGV[3] .. ' ' .. ARGV[2])
return 1
";

#[derive(Clone)]
struct Shop {
    redis: ClusterConnection,
    sell: Arc<Script>,
}

fn shop_key(item: &str) -> String {
    format!("{{{item}}}:shop")
}

fn ledger_key(item: &str) -> String {
    format!("{{{item}}}:ledger")
}

/// Reads the stock, yields, writes it back decremented with the lock's fencing token and
/// appends the buyer to the ledger; any Redis failure is a 503 (nothing was sold).
async fn buy(
    State(mut shop): State<Shop>,
    Path(item): Path<String>,
    Extension(lock): Extension<HeldLock>,
    headers: HeaderMap,
) -> (StatusCode, String) {
    let unavailable =
        |e: redis::RedisError| (StatusCode::SERVICE_UNAVAILABLE, format!("shop: {e}"));
    let stock = match shop
        .redis
        .hget::<_, _, Option<i64>>(shop_key(&item), "stock")
        .await
    {
        Ok(stock) => stock,
        Err(e) => return unavailable(e),
    };
    if stock.unwrap_or(0) <= 0 {
        return (StatusCode::GONE, String::new());
    }
    tokio::time::sleep(Duration::from_millis(2)).await;
    let buyer = headers
        .get("x-buyer")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous");
    let sold = shop
        .sell
        .key(shop_key(&item))
        .key(ledger_key(&item))
        .arg(stock.unwrap_or(0) - 1)
        .arg(lock.fencing_token())
        .arg(buyer)
        .invoke_async::<i64>(&mut shop.redis)
        .await;
    match sold {
        Ok(1) => {
            // The sale reaches the replica before the buyer hears of it, so that a
            // failover does not take back a sale that was answered 200.
            let route = Route::with_key(shop_key(&item), SlotAddr::Master);
            let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
            let mut wait = redis::cmd("WAIT");
            wait.arg(1).arg(200);
            let _ = shop.redis.route_command(wait, routing).await;
            (StatusCode::OK, String::new())
        }
        Ok(_) => (StatusCode::CONFLICT, String::new()),
        Err(e) => unavailable(e),
    }
}

fn item_key(req: &Request) -> Option<String> {
    req.uri().path().strip_prefix("/buy/").map(str::to_owned)
}

/// Three app instances on the cluster, each with its own backend.
async fn instances(cluster: &Cluster, wait: Duration) -> Vec<SocketAddr> {
    let redis = redis::cluster::ClusterClient::builder(cluster.urls())
        .connection_timeout(Duration::from_millis(500))
        .response_timeout(Duration::from_millis(500))
        // As the backends' own connections do: only theirs may reach a killed node's port
        // in `lost_node.rs`.
        .max_connection_attempts(lost_node::RECONNECT_ATTEMPTS)
        .build()
        .expect("cluster client")
        .get_async_connection()
        .await
        .expect("connect");
    let shop = Shop {
        redis,
        sell: Arc::new(Script::new(SELL)),
    };
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let key_fn: fn(&Request) -> Option<String> = item_key;
        let layer = LockLayer::new(cluster.backend().await, key_fn).wait(wait);
        let app = Router::new()
            .route("/buy/{item}", routing::post(buy))
            .route_layer(layer)
            .with_state(shop.clone());
        addrs.push(serve(app).await);
    }
    addrs
}

/// Stocks `item` with `stock` and an empty ledger, on its primary and its replica: a
/// failover must not take the stock back (a replica still resyncing after an earlier
/// failover was once promoted without it, and its shard answered 410 to everyone).
async fn stock(redis: &mut ClusterConnection, item: &str, stock: i64) {
    let _: () = redis.del(ledger_key(item)).await.expect("DEL");
    let _: () = redis
        .hset_multiple(shop_key(item), &[("stock", stock), ("token", 0)])
        .await
        .expect("HSET");
    let route = Route::with_key(shop_key(item), SlotAddr::Master);
    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
    let mut wait = redis::cmd("WAIT");
    // Bounded, so that a shard without a replica fails here instead of hanging.
    wait.arg(1).arg(10_000);
    let acked: i64 = redis
        .route_command(wait, routing)
        .await
        .ok()
        .and_then(|v| redis::FromRedisValue::from_redis_value(v).ok())
        .expect("WAIT");
    assert!(acked >= 1, "the stock of {item} reached a replica");
}

/// Checks the ledger of `item`: the stock left plus the sales equals what was stocked
/// (no sale doubled), every buyer answered 200 is in it (no sale lost), and the fencing
/// tokens of the sales strictly increase in the order they were written.
async fn audit(redis: &mut ClusterConnection, item: &str, stocked: i64, served: &[String]) {
    let left: i64 = redis
        .hget(shop_key(item), "stock")
        .await
        .expect("HGET stock");
    let ledger: Vec<String> = redis.lrange(ledger_key(item), 0, -1).await.expect("LRANGE");
    assert_eq!(
        left + ledger.len() as i64,
        stocked,
        "{item}: stock left + sales"
    );
    let buyers: Vec<&str> = ledger.iter().filter_map(|l| l.split(' ').next()).collect();
    for buyer in served {
        assert!(
            buyers.contains(&buyer.as_str()),
            "{item}: sale to {buyer} lost"
        );
    }
    let tokens: Vec<u64> = ledger
        .iter()
        .filter_map(|l| l.split(' ').nth(1)?.parse().ok())
        .collect();
    assert_eq!(tokens.len(), ledger.len());
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "{item}: fencing tokens strictly increase"
    );
}

/// The flash sale of the core issue, on one item per shard at once: 450 buyers round-robin
/// over three instances sell exactly the stock of each item.
async fn three_instances_sell_exactly_the_stock_of_every_shard(cluster: &Cluster) {
    let mut redis = cluster.conn().await;
    let items: Vec<String> = cluster
        .primaries()
        .into_iter()
        .map(|port| key_on(cluster, port, "sale:"))
        .collect();
    for item in &items {
        stock(&mut redis, item, 50).await;
    }
    let addrs = instances(cluster, Duration::from_secs(60)).await;
    let client = http_client();
    let buyers = (0..450).map(|i| {
        let (client, addr, item) = (client.clone(), addrs[i % 3], items[i % 3].clone());
        tokio::spawn(async move {
            let req = request(addr, &format!("/buy/{item}"))
                .header("x-buyer", format!("b{i}"))
                .body(Default::default())
                .expect("request");
            (item, format!("b{i}"), send(&client, req).await.status)
        })
    });
    let mut served: Vec<(String, String)> = Vec::new();
    for buyer in buyers.collect::<Vec<_>>() {
        let (item, buyer, status) = buyer.await.expect("buyer");
        assert!([200, 410].contains(&status), "{buyer} got {status}");
        if status == 200 {
            served.push((item, buyer));
        }
    }
    for item in &items {
        let sold: Vec<String> = served
            .iter()
            .filter(|(i, _)| i == item)
            .map(|(_, b)| b.clone())
            .collect();
        assert_eq!(sold.len(), 50, "{item} sold exactly its stock");
        audit(&mut redis, item, 50, &sold).await;
    }
}

/// Uncontended acquire + release, one after another, on the cluster and on one server:
/// after a warm-up, rounds of 250 alternate between the two so that machine noise hits
/// both alike.
async fn acquire_release_latency_next_to_a_single_server(cluster: &Cluster) {
    let server = RedisServer::start();
    let backends = [
        ("single server", server.backend().await),
        ("cluster", cluster.backend().await),
    ];
    let mut micros = [Vec::new(), Vec::new()];
    for (_, backend) in &backends {
        latency(backend, 200).await;
    }
    for _ in 0..8 {
        for (i, (_, backend)) in backends.iter().enumerate() {
            micros[i].extend(latency(backend, 250).await);
        }
    }
    for ((name, _), mut micros) in backends.iter().zip(micros) {
        micros.sort_unstable();
        let n = micros.len();
        let mean = micros.iter().sum::<u128>() / n as u128;
        let (p50, p99) = (micros[n / 2], micros[n * 99 / 100]);
        eprintln!(
            "uncontended acquire+release, {name}: p50 {p50} µs, p99 {p99} µs, mean {mean} µs ({n} ops)"
        );
    }
}

/// The time of each of `n` acquire + release pairs on one key, in microseconds.
async fn latency(backend: &RedisBackend, n: usize) -> Vec<u128> {
    let mut micros = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let guard = backend.lock("latency").try_once().await.expect("free");
        guard.release().await.expect("release");
        micros.push(started.elapsed().as_micros());
    }
    micros
}

/// One outcome of the failover run.
struct Outcome {
    item: usize,
    buyer: String,
    status: u16,
    /// The reply's body: says whether a 503 came from the layer or the shop's own Redis.
    body: String,
    sent: Instant,
    done: Instant,
}

/// Buyers hammer one item per shard through three instances; the primary of the first
/// shard is killed. That shard answers 503 until its replica is promoted and then serves
/// again; the other shards serve every request throughout; no sale is lost or doubled and
/// fencing tokens keep increasing across the failover.
/// Returns the killed primary's port.
async fn a_killed_primary_stops_only_its_shard_until_its_replica_takes_over(
    cluster: &mut Cluster,
) -> u16 {
    let primaries = cluster.primaries();
    let victim = primaries[0];
    let items: Vec<String> = primaries
        .iter()
        .map(|&port| key_on(cluster, port, "failover:"))
        .collect();
    let mut redis = cluster.conn().await;
    let stocked = 1_000_000;
    for item in &items {
        stock(&mut redis, item, stocked).await;
    }
    let addrs = instances(cluster, Duration::from_secs(2)).await;
    let client = http_client();
    let (stop, outcomes) = (
        tokio_util::sync::CancellationToken::new(),
        Arc::new(std::sync::Mutex::new(Vec::new())),
    );
    let mut buyers = Vec::new();
    for b in 0..9 {
        let (client, addr) = (client.clone(), addrs[b % 3]);
        let (item, name) = (b % 3, items[b % 3].clone());
        let (stop, outcomes) = (stop.clone(), outcomes.clone());
        buyers.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.is_cancelled() {
                n += 1;
                let buyer = format!("f{b}-{n}");
                let req = request(addr, &format!("/buy/{name}"))
                    .header("x-buyer", &buyer)
                    .body(Default::default())
                    .expect("request");
                let sent = Instant::now();
                let reply = send(&client, req).await;
                let done = Instant::now();
                outcomes.lock().expect("outcomes").push(Outcome {
                    item,
                    buyer,
                    status: reply.status,
                    body: reply.body,
                    sent,
                    done,
                });
            }
        }));
    }
    // The victim's shard served before the kill (checked below).
    support::eventually("the victim's shard serves", || async {
        let outcomes = outcomes.lock().expect("outcomes");
        outcomes.iter().any(|o| o.item == 0 && o.status == 200)
    })
    .await;
    cluster.kill(victim);
    let killed = Instant::now();
    let served_after_kill = |o: &Outcome| o.item == 0 && o.status == 200 && o.sent > killed;
    // Redis promotes the replica in a few node timeouts (1 s here); the bound only catches
    // a shard that never serves again, and says what the nodes thought then.
    let deadline = killed + Duration::from_secs(90);
    while !outcomes
        .lock()
        .expect("outcomes")
        .iter()
        .any(served_after_kill)
    {
        if Instant::now() >= deadline {
            for port in cluster.live() {
                let nodes = cluster.run(port, &["CLUSTER", "NODES"]);
                eprintln!("CLUSTER NODES of {port} after killing {victim}:\n{nodes}");
            }
            let outcomes = outcomes.lock().expect("outcomes");
            let last = outcomes.iter().rev().filter(|o| o.item == 0).take(6);
            for o in last {
                eprintln!(
                    "{} {} after {:?}: {}",
                    o.buyer,
                    o.status,
                    o.sent - killed,
                    o.body
                );
            }
        }
        assert!(
            Instant::now() < deadline,
            "the killed shard serves again within 90 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    for buyer in buyers {
        buyer.await.expect("buyer");
    }
    let outcomes = std::mem::take(&mut *outcomes.lock().expect("outcomes"));
    let first_served = outcomes
        .iter()
        .filter(|o| served_after_kill(o))
        .map(|o| o.done)
        .min()
        .expect("served after the kill");
    let rejected = outcomes
        .iter()
        .filter(|o| o.item == 0 && o.status == 503)
        .count();
    eprintln!(
        "cluster failover: kill -> first served request on that shard {:?} ({} requests of it answered 503 meanwhile)",
        first_served - killed,
        rejected
    );
    for o in &outcomes {
        match o.item {
            0 => assert!(
                [200, 503].contains(&o.status),
                "{} got {}",
                o.buyer,
                o.status
            ),
            _ => assert_eq!(
                o.status, 200,
                "{} on a healthy shard got {}",
                o.buyer, o.status
            ),
        }
    }
    assert!(
        rejected > 0,
        "the killed shard's requests were refused meanwhile"
    );
    let before_kill = outcomes.iter().filter(|o| o.item == 0 && o.done < killed);
    assert!(before_kill.clone().count() > 0 && before_kill.clone().all(|o| o.status == 200));
    cluster.wait_until_ok();
    for port in cluster.live() {
        assert_eq!(
            cluster.command_calls(port, &["publish"]),
            0,
            "PUBLISH on {port}"
        );
    }
    let mut redis = cluster.conn().await;
    for (i, item) in items.iter().enumerate() {
        let served: Vec<String> = outcomes
            .iter()
            .filter(|o| o.item == i && o.status == 200)
            .map(|o| o.buyer.clone())
            .collect();
        audit(&mut redis, item, stocked, &served).await;
    }
    victim
}

/// Runs `op` while the node on `port` is stopped, and has the node drop its command
/// connections right after running what `op` sent: `CLIENT KILL TYPE normal`, sent after
/// `op`'s command, is read in the same event-loop turn once the node resumes, so it runs
/// after that command but before the reply is written. redis-rs sees the connection
/// dropped without a reply and sends the command again on a new connection: one call, run
/// twice, as after a connection lost at the wrong moment. Returns how many times the node
/// ran a script meanwhile: `op`'s command and the kill each get a generous 300 ms to reach
/// the stopped node, but on a loaded machine the kill may still overtake it, and the
/// caller then tries again (a run with one script run proves nothing).
async fn with_reply_lost<T: Send + 'static>(
    cluster: &Cluster,
    port: u16,
    op: impl std::future::Future<Output = T> + Send + 'static,
) -> (T, u64) {
    let mut killer = cluster.node_conn(port).await;
    let before = cluster.command_calls(port, &["evalsha"]);
    cluster.pause(port);
    let op = tokio::spawn(op);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let kill = tokio::spawn(async move {
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .query_async::<i64>(&mut killer)
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.resume(port);
    let killed = kill.await.expect("task").expect("CLIENT KILL");
    let out = op.await.expect("task");
    let runs = cluster.command_calls(port, &["evalsha"]) - before;
    eprintln!("reply lost: {killed} connections dropped, {runs} script runs for one call");
    (out, runs)
}

/// How many times a scenario tries to have a reply lost before it gives up.
const REPLY_LOSS_TRIES: usize = 5;

/// A backend whose calls outlast the node's stop in [`with_reply_lost`].
async fn patient_backend(cluster: &Cluster) -> RedisBackend {
    cluster
        .builder()
        .command_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("backend connects to the test cluster")
}

/// Fails the scenario when no try made the node run the script twice.
fn assert_resent(runs: u64, tries: usize) {
    assert!(
        runs >= 2 || tries < REPLY_LOSS_TRIES,
        "in {REPLY_LOSS_TRIES} tries the script was never sent again after its connection dropped"
    );
}

/// An acquisition whose connection drops after its script ran is sent again by the
/// cluster client; the second run finds the first one's hold and does not count it again,
/// so the one release frees the lock (instead of leaving it held for a whole lease).
async fn an_acquisition_resent_after_a_lost_reply_is_taken_once(cluster: &Cluster) {
    let port = cluster.primaries()[1];
    let key = key_on(cluster, port, "resent:");
    let lock = format!("tower-lock:{{{key}}}");
    let backend = patient_backend(cluster).await;
    let warm = backend.lock(key.clone()).try_once().await.expect("free");
    warm.release().await.expect("release");
    for tries in 1..=REPLY_LOSS_TRIES {
        let taking = {
            let (backend, key) = (backend.clone(), key.clone());
            async move { backend.lock(key).try_once().await }
        };
        let (guard, runs) = with_reply_lost(cluster, port, taking).await;
        let guard = guard.expect("acquired");
        let owner = guard.held().owner().as_str().to_owned();
        assert_eq!(
            cluster.hold_count(port, &lock, &owner),
            Some(1),
            "one acquisition, one hold"
        );
        guard.release().await.expect("release");
        assert!(
            !cluster.exists_on(port, &lock),
            "released by its one release"
        );
        cluster.wait_until_ok();
        assert_resent(runs, tries);
        if runs >= 2 {
            break;
        }
    }
}

/// A release whose connection drops after its script ran is sent again by the cluster
/// client and finds the lock already freed or handed over: that is the release done, not
/// a lost lock, and the handoff to the queued task stands.
async fn a_release_resent_after_a_lost_reply_is_not_reported_lost(cluster: &Cluster) {
    let port = cluster.primaries()[2];
    let key = key_on(cluster, port, "rerelease:");
    let lock = format!("tower-lock:{{{key}}}");
    let backend = patient_backend(cluster).await;
    for tries in 1..=REPLY_LOSS_TRIES {
        let guard = backend.lock(key.clone()).try_once().await.expect("free");
        let (released, runs) = with_reply_lost(cluster, port, guard.release()).await;
        assert!(released.is_ok(), "freed, not lost: {released:?}");
        assert!(!cluster.exists_on(port, &lock));
        cluster.wait_until_ok();
        assert_resent(runs, tries);
        if runs >= 2 {
            break;
        }
    }

    // Handed over to a task of the same backend waiting for the key.
    for tries in 1..=REPLY_LOSS_TRIES {
        let guard = backend.lock(key.clone()).try_once().await.expect("free");
        let waiting = tokio::spawn({
            let (backend, key) = (backend.clone(), key.clone());
            async move { backend.lock(key).wait(Duration::from_secs(10)).await }
        });
        support::queued(&backend, 1).await;
        let (released, runs) = with_reply_lost(cluster, port, guard.release()).await;
        assert!(released.is_ok(), "handed over, not lost: {released:?}");
        let next = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("the queued task gets the lock")
            .expect("task")
            .expect("handed over");
        let owner = next.held().owner().as_str().to_owned();
        assert_eq!(cluster.hold_count(port, &lock, &owner), Some(1));
        next.release().await.expect("release");
        assert!(!cluster.exists_on(port, &lock));
        cluster.wait_until_ok();
        assert_resent(runs, tries);
        if runs >= 2 {
            break;
        }
    }
}

/// `sync_replicas` waits for the replica of the lock's own shard only: with the replica of
/// one shard stopped, that shard refuses acquisitions and the others keep granting them.
async fn sync_replicas_waits_only_on_the_shard_of_the_lock(cluster: &Cluster) {
    let backend = RedisBackend::cluster(cluster.urls())
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
        .sync_replicas(1, Duration::from_millis(200))
        .build()
        .await
        .expect("backend");
    let primaries = cluster.primaries();
    let keys: Vec<String> = primaries
        .iter()
        .map(|&port| key_on(cluster, port, "synced:"))
        .collect();
    for key in &keys {
        let guard = backend.lock(key.clone()).try_once().await;
        guard
            .expect("acknowledged by its replica")
            .release()
            .await
            .expect("release");
    }
    let stopped = cluster.replica_of(primaries[2]);
    cluster.pause(stopped);
    let refused = backend.lock(keys[2].clone()).try_once().await;
    let mut granted = Vec::new();
    for key in &keys[..2] {
        let started = Instant::now();
        granted.push((
            backend.lock(key.clone()).try_once().await,
            started.elapsed(),
        ));
    }
    cluster.resume(stopped);
    assert!(
        refused.is_err(),
        "its replica is stopped: {:?}",
        refused.map(|g| g.fencing_token())
    );
    for (guard, took) in granted {
        eprintln!(
            "sync_replicas acquisition on a healthy shard while another's replica is stopped: {took:?}"
        );
        guard
            .expect("a healthy shard grants")
            .release()
            .await
            .expect("release");
    }
    cluster.wait_until_healthy();
}

/// The watchdog's renewal calls of different shards complete on their own: while one
/// primary is stopped for two leases (its renewal call hangs for the command timeout, far
/// longer), locks on the other shards keep being renewed and are not declared lost.
async fn a_stopped_shard_does_not_hold_up_the_renewals_of_the_others(cluster: &Cluster) {
    // Renewed every third of it: a second of room for a renewal delayed on a loaded
    // machine; a renewal waiting behind the stopped shard's would wait out the pause.
    let lease = Duration::from_millis(1500);
    let backend = cluster
        .builder()
        .command_timeout(4 * lease)
        .build()
        .await
        .expect("backend connects to the test cluster");
    let primaries = cluster.primaries();
    let mut guards = Vec::new();
    for &port in &primaries {
        let key = key_on(cluster, port, "renewed:");
        let guard = backend.lock(key).lease(lease).try_once().await;
        guards.push(guard.expect("free"));
    }
    let stopped = primaries[0];
    cluster.pause(stopped);
    tokio::time::sleep(2 * lease).await;
    cluster.resume(stopped);
    let stopped_lost = guards[0].is_lost();
    for guard in &guards[1..] {
        assert!(
            !guard.is_lost(),
            "{} on a healthy shard was renewed",
            guard.key()
        );
    }
    eprintln!("the lock on the stopped shard was found lost: {stopped_lost}");
    let mut guards = guards.into_iter();
    drop(guards.next());
    for guard in guards {
        guard.release().await.expect("release");
    }
    // The pause may have outlasted the node timeout: a replica promoted, the old primary
    // rejoining as its replica. The next scenario kills a primary and needs its replica.
    cluster.wait_until_healthy();
}

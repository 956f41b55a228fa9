//! The ready-made key extractors behind a real router, against a real redis-server.

use crate::support;

use std::net::SocketAddr;

use axum::Router;
use axum::extract::{Request, State};
use axum::routing::post as route_post;
use http_body_util::Full;
use support::{Gate, HttpClient, RedisServer, Reply, http_client, post, request, send, serve};
use tower::Layer;
use tower_lock::{
    Header, HeldLock, HeldLocks, KeyError, KeyExtractor, LockLayer, PathParam, QueryParam,
    RedisBackend,
};

/// Answers with the key the request is locked on, or `unlocked`.
async fn echo(req: Request) -> String {
    req.extensions()
        .get::<HeldLock>()
        .map_or_else(|| "unlocked".to_owned(), |lock| lock.key().to_owned())
}

/// Like [`echo`], after waiting at the gate while holding the lock.
async fn gated(State(gate): State<Gate>, req: Request) -> String {
    gate.pass().await;
    echo(req).await
}

fn fail_fast<K>(backend: &RedisBackend, key: K) -> LockLayer<K> {
    LockLayer::new(backend.clone(), key).fail_fast()
}

/// `path` answers with the key it is locked on, behind a fail-fast layer keyed by `key`.
fn echo_route<S, K>(backend: &RedisBackend, path: &str, key: K) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    K: KeyExtractor<axum::body::Body>,
{
    Router::new()
        .route(path, route_post(echo))
        .route_layer(fail_fast(backend, key))
}

/// One server and client for a test; `post` is 200 with the locked key, or a problem.
struct Shop {
    server: RedisServer,
    backend: RedisBackend,
    client: HttpClient,
    addr: SocketAddr,
}

impl Shop {
    async fn start(app: impl FnOnce(&RedisBackend) -> Router) -> Self {
        let server = RedisServer::start();
        let backend = server.backend().await;
        let addr = serve(app(&backend)).await;
        Shop {
            server,
            backend,
            client: http_client(),
            addr,
        }
    }

    async fn post(&self, path: &str) -> Reply {
        post(&self.client, self.addr, path).await
    }

    /// POSTs with `header` set to each of `values` (raw bytes, repeated if several).
    async fn post_with(&self, path: &str, header: &str, values: &[&[u8]]) -> Reply {
        let request = values
            .iter()
            .fold(request(self.addr, path), |r, v| r.header(header, *v))
            .body(Full::default())
            .expect("request");
        send(&self.client, request).await
    }

    /// Asserts that `key` is what `post` locks: 200 echoing it while free, 409 while held.
    async fn assert_locks(&self, key: &str, post: impl AsyncFn() -> Reply) {
        let free = post().await;
        assert_eq!((free.status, free.body.as_str()), (200, key));
        let held = self.backend.lock(key).try_once().await.expect("free");
        post().await.problem(409);
        held.release().await.expect("release");
        assert_eq!(post().await.status, 200);
    }

    /// Lock scripts run so far: rejected keys must not reach Redis.
    async fn lock_scripts_run(&self) -> u64 {
        self.server.command_calls(&["evalsha", "eval"]).await
    }
}

#[tokio::test]
async fn path_param_locks_the_named_parameter_under_its_prefix() {
    crate::needs!(Redis);
    let shop = Shop::start(|backend| {
        echo_route(
            backend,
            "/shops/{shop}/orders/{id}/pay",
            PathParam::new("id").prefix("order"),
        )
    })
    .await;
    shop.assert_locks("order:42", || shop.post("/shops/7/orders/42/pay"))
        .await;
    shop.assert_locks("order:a b/c", || shop.post("/shops/7/orders/a%20b%2Fc/pay"))
        .await;
}

#[tokio::test]
async fn path_param_absent_from_the_route_or_not_utf8_is_400() {
    crate::needs!(Redis);
    let shop = Shop::start(|backend| {
        let misnamed = echo_route(backend, "/orders/{id}", PathParam::new("order_id"));
        // Wrapped around a router from outside, the layer runs before routing, where no
        // route parameters exist yet.
        let routed_inside = Router::new().route("/{id}", route_post(echo));
        let before_routing = Router::new().nest_service(
            "/refunds",
            fail_fast(backend, PathParam::new("id")).layer(routed_inside),
        );
        let right = echo_route(backend, "/carts/{id}", PathParam::new("id"));
        misnamed.merge(before_routing).merge(right)
    })
    .await;
    let before = shop.lock_scripts_run().await;
    let detail = shop.post("/orders/42").await.problem(400);
    assert!(detail.contains("path parameter \"order_id\""), "{detail}");
    shop.post("/refunds/42").await.problem(400);
    let detail = shop.post("/carts/%FF").await.problem(400);
    assert!(detail.contains("not UTF-8"), "{detail}");
    assert_eq!(shop.lock_scripts_run().await, before);
}

#[tokio::test]
async fn header_locks_its_value_and_rejects_missing_empty_repeated_and_non_utf8() {
    crate::needs!(Redis);
    let shop = Shop::start(|backend| {
        let required = Router::new()
            .route("/payments", route_post(echo))
            .route_layer(fail_fast(
                backend,
                Header::new("Idempotency-Key").prefix("payment"),
            ));
        let optional = echo_route(backend, "/quotes", Header::new("x-quote").optional());
        required.merge(optional)
    })
    .await;
    let key = "Idempotency-Key";
    shop.assert_locks("payment:abc", || {
        shop.post_with("/payments", key, &[b"abc"])
    })
    .await;

    let before = shop.lock_scripts_run().await;
    let detail = shop.post("/payments").await.problem(400);
    assert!(detail.contains("header \"idempotency-key\""), "{detail}");
    shop.post_with("/payments", key, &[b""]).await.problem(400);
    shop.post_with("/payments", key, &[b"a", b"b"])
        .await
        .problem(400);
    let detail = shop
        .post_with("/payments", key, &[b"caf\xe9"])
        .await
        .problem(400);
    assert!(detail.contains("not UTF-8"), "{detail}");
    assert_eq!(shop.lock_scripts_run().await, before);

    let unlocked = shop.post("/quotes").await;
    assert_eq!((unlocked.status, unlocked.body.as_str()), (200, "unlocked"));
    let utf8 = shop
        .post_with("/quotes", "x-quote", &["ünï".as_bytes()])
        .await;
    assert_eq!((utf8.status, utf8.body.as_str()), (200, "ünï"));
}

#[tokio::test]
async fn query_param_locks_its_value_and_rejects_missing_repeated_and_non_utf8() {
    crate::needs!(Redis);
    let shop = Shop::start(|backend| {
        echo_route(backend, "/checkout", QueryParam::new("cart").prefix("cart"))
    })
    .await;
    shop.assert_locks("cart:7", || shop.post("/checkout?coupon=x&cart=7"))
        .await;
    shop.assert_locks("cart:a b", || shop.post("/checkout?cart=a+b"))
        .await;

    let before = shop.lock_scripts_run().await;
    let detail = shop.post("/checkout?coupon=x").await.problem(400);
    assert!(detail.contains("query parameter \"cart\""), "{detail}");
    shop.post("/checkout?cart=").await.problem(400);
    shop.post("/checkout?cart=1&cart=2").await.problem(400);
    shop.post("/checkout?cart=%FF").await.problem(400);
    assert_eq!(shop.lock_scripts_run().await, before);
}

#[tokio::test]
async fn routes_contend_only_when_they_share_a_prefix() {
    crate::needs!(Redis);
    let gate = Gate::default();
    let shop = Shop::start(|backend| {
        let orders = Router::new()
            .route("/orders/{id}/pay", route_post(gated))
            .route("/orders/{id}/cancel", route_post(echo))
            .route_layer(fail_fast(backend, PathParam::new("id").prefix("order")));
        let refunds = echo_route(
            backend,
            "/refunds/{id}",
            PathParam::new("id").prefix("refund"),
        );
        orders.merge(refunds).with_state(gate.clone())
    })
    .await;
    let paying = tokio::spawn({
        let (client, addr) = (shop.client.clone(), shop.addr);
        async move { post(&client, addr, "/orders/42/pay").await }
    });
    gate.wait_inside(1).await;

    shop.post("/orders/42/cancel").await.problem(409);
    let refund = shop.post("/refunds/42").await;
    assert_eq!((refund.status, refund.body.as_str()), (200, "refund:42"));
    let other_order = shop.post("/orders/43/cancel").await;
    assert_eq!(
        (other_order.status, other_order.body.as_str()),
        (200, "order:43")
    );

    gate.open();
    let paid = paying.await.expect("paying task");
    assert_eq!((paid.status, paid.body.as_str()), (200, "order:42"));
    assert_eq!(shop.post("/orders/42/cancel").await.status, 200);
}

/// The key closure of `/v/{..}`: a `Result<String, KeyError>` that refuses ids that are
/// not numbers, written as a user would.
fn numeric_id(req: &Request) -> Result<String, KeyError> {
    let id = req.uri().path().trim_start_matches("/v/");
    match id.parse::<u64>() {
        Ok(_) => Ok(format!("v:{id}")),
        Err(_) => Err(KeyError::malformed(format!("id {id:?} is not a number"))),
    }
}

#[tokio::test]
async fn closures_returning_result_lock_or_refuse_with_400_before_redis() {
    crate::needs!(Redis);
    let shop = Shop::start(|backend| {
        let required = echo_route(backend, "/v/{id}", numeric_id);
        // `Result<Option<K>, KeyError>`: no header is unlocked, an empty one is refused.
        let optional = echo_route(backend, "/o", |req: &Request| {
            match req.headers().get("x-order") {
                None => Ok(None),
                Some(v) if v.is_empty() => Err(KeyError::missing("non-empty header \"x-order\"")),
                Some(v) => Ok(Some(
                    v.to_str()
                        .map_err(|_| KeyError::malformed("x-order is not text"))?
                        .to_owned(),
                )),
            }
        });
        // `Option<K>`, inferred from the closure's body alone.
        let plain = echo_route(backend, "/p/{id}", |req: &Request| {
            req.uri().path().strip_prefix("/p/").map(str::to_owned)
        });
        required.merge(optional).merge(plain)
    })
    .await;
    shop.assert_locks("v:7", || shop.post("/v/7")).await;
    shop.assert_locks("o:1", || shop.post_with("/o", "x-order", &[b"o:1"]))
        .await;
    shop.assert_locks("p:1", || shop.post("/p/p:1")).await;

    let (before, keys) = (shop.lock_scripts_run().await, shop.server.keys().await);
    let detail = shop.post("/v/seven").await.problem(400);
    assert!(detail.contains("id \"seven\" is not a number"), "{detail}");
    let detail = shop.post_with("/o", "x-order", &[b""]).await.problem(400);
    assert!(detail.contains("non-empty header"), "{detail}");
    let unlocked = shop.post("/o").await;
    assert_eq!((unlocked.status, unlocked.body.as_str()), (200, "unlocked"));
    assert_eq!(shop.lock_scripts_run().await, before);
    assert_eq!(shop.server.keys().await, keys);
}

/// Answers with `key=token` for the one lock the handler asked for.
async fn held(lock: HeldLock) -> String {
    format!("{}={}", lock.key(), lock.fencing_token())
}

/// Answers with the key it is locked on, or `unlocked`, through `Option<HeldLock>`.
async fn maybe_held(lock: Option<HeldLock>) -> String {
    lock.map_or_else(|| "unlocked".to_owned(), |lock| lock.key().to_owned())
}

/// Answers with every lock of the request, outermost first.
async fn all_held(locks: HeldLocks) -> String {
    let held: Vec<String> = locks
        .iter()
        .map(|lock| format!("{}={}", lock.key(), lock.fencing_token()))
        .collect();
    held.join(",")
}

#[tokio::test]
async fn held_lock_is_an_extractor_and_a_500_naming_the_cause_without_a_layer() {
    crate::needs!(Redis);
    let shop = Shop::start(|backend| {
        let locked = Router::new()
            .route("/held/{id}", route_post(held))
            .route_layer(fail_fast(backend, PathParam::new("id")));
        let maybe = Router::new()
            .route("/maybe", route_post(maybe_held))
            .route_layer(fail_fast(backend, Header::new("x-order").optional()));
        let bare = Router::new().route("/bare", route_post(held));
        locked.merge(maybe).merge(bare)
    })
    .await;
    let first = tokens(&shop.post("/held/a").await, &["a"]);
    let second = tokens(&shop.post("/held/a").await, &["a"]);
    assert!(second[0] > first[0], "{first:?} then {second:?}");

    let unlocked = shop.post("/maybe").await;
    assert_eq!((unlocked.status, unlocked.body.as_str()), (200, "unlocked"));
    shop.assert_locks("m", || shop.post_with("/maybe", "x-order", &[b"m"]))
        .await;

    let bare = shop.post("/bare").await;
    assert_eq!(bare.status, 500);
    assert!(bare.body.contains("no LockLayer"), "{}", bare.body);
}

#[tokio::test]
async fn nested_layers_keep_every_lock_and_its_token_reachable() {
    crate::needs!(Redis);
    let shop = Shop::start(|backend| {
        Router::new()
            .route("/shops/{shop}/orders/{id}", route_post(all_held))
            .route_layer(fail_fast(backend, PathParam::new("id").prefix("order")))
            .route_layer(fail_fast(backend, PathParam::new("shop").prefix("shop")))
    })
    .await;
    let first = tokens(
        &shop.post("/shops/1/orders/2").await,
        &["shop:1", "order:2"],
    );
    let again = tokens(
        &shop.post("/shops/1/orders/3").await,
        &["shop:1", "order:3"],
    );
    assert!(again[0] > first[0], "{first:?} then {again:?}");
    assert!(first[1] > 0 && again[1] > 0);
}

/// The fencing tokens of a 200 reply of `key=token,...`, checking the keys are `keys`.
fn tokens(reply: &Reply, keys: &[&str]) -> Vec<u64> {
    assert_eq!(reply.status, 200, "{reply:?}");
    let pairs: Vec<(&str, u64)> = reply
        .body
        .split(',')
        .map(|pair| {
            let (key, token) = pair.split_once('=').expect("key=token");
            (key, token.parse().expect("token"))
        })
        .collect();
    assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), keys);
    pairs.into_iter().map(|p| p.1).collect()
}

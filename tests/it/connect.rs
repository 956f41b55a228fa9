//! What a new user sees when the backend cannot connect: each failure names its own cause,
//! at once, instead of "timed out waiting for a Redis connection" after the connect
//! timeout. Every call runs with a deliberately large connect timeout under a shorter hang
//! guard, so a failure that only surfaces as a timeout fails the test.

use crate::support;

use std::error::Error;
use std::net::TcpListener;
use std::time::Duration;

use support::{RedisServer, assert_says};
use tower_lock::{BuildError, ConnectFailure, LockError, RedisBackend};

/// Far longer than any of these failures may take to be reported.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Catches a call that waits for the connect timeout instead of failing at once.
const HANG_GUARD: Duration = Duration::from_secs(10);

/// The error of building a backend on `url`, which must fail.
async fn build_error(url: &str) -> BuildError {
    let build = RedisBackend::builder(url)
        .connect_timeout(CONNECT_TIMEOUT)
        .build();
    match tokio::time::timeout(HANG_GUARD, build).await {
        Err(_) => panic!("build({url}) still pending after {HANG_GUARD:?}"),
        Ok(Ok(_)) => panic!("build({url}) connected"),
        Ok(Err(e)) => {
            eprintln!("{url}: {}", chain(&e));
            e
        }
    }
}

/// The Display of every level of the error chain, outermost first.
fn levels(error: &(dyn Error + 'static)) -> Vec<String> {
    let mut levels = vec![error.to_string()];
    let mut source = error.source();
    while let Some(e) = source {
        levels.push(e.to_string());
        source = e.source();
    }
    levels
}

/// The error chain as anyhow's `{:#}` prints it: every level's Display joined by ": ".
fn chain(error: &(dyn Error + 'static)) -> String {
    levels(error).join(": ")
}

/// Each level prints only its own part, so the innermost cause appears once.
fn assert_cause_once(error: &(dyn Error + 'static)) {
    let text = chain(error);
    let cause = levels(error).pop().expect("a chain");
    assert_eq!(text.matches(&cause).count(), 1, "{text}");
}

fn assert_names(error: &(dyn Error + 'static), causes: &[&str]) {
    let text = chain(error).to_lowercase();
    assert!(
        causes.iter().any(|c| text.contains(&c.to_lowercase())),
        "error chain does not name any of {causes:?}: {text}"
    );
}

/// Building on `url` fails at once with a connect error of `failure` at `addr`, which its
/// own message names with `says`.
async fn assert_connect_fails(url: &str, addr: &str, failure: ConnectFailure, says: &str) {
    let error = build_error(url).await;
    assert!(
        matches!(&error, BuildError::Connect { addr: a, failure: f, .. } if a == addr && *f == failure),
        "{error:?}"
    );
    assert_says(&error, &[addr, says]);
}

/// A loopback port with nothing listening on it.
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

#[tokio::test]
async fn build_names_a_refused_connection_at_once() {
    let addr = format!("127.0.0.1:{}", closed_port());
    let url = format!("redis://{addr}");
    assert_connect_fails(&url, &addr, ConnectFailure::Refused, "was refused").await;
}

#[tokio::test]
async fn build_names_a_host_that_does_not_resolve_at_once() {
    let addr = "no-such-host.invalid:6379";
    let url = format!("redis://{addr}");
    let says = "does not resolve (DNS lookup failed";
    assert_connect_fails(&url, addr, ConnectFailure::UnknownHost, says).await;
}

/// A server that accepts connections and never answers (a plain listener that reads
/// nothing): the build ends at its connect timeout, saying so.
#[tokio::test]
async fn build_names_a_server_that_does_not_answer() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("addr").to_string();
    let build = RedisBackend::builder(format!("redis://{addr}"))
        .connect_timeout(Duration::from_millis(300))
        .build();
    let error = tokio::time::timeout(HANG_GUARD, build)
        .await
        .expect("build() ends at its connect timeout")
        .expect_err("nothing answers");
    assert!(
        matches!(&error, BuildError::Connect { addr: a, failure: ConnectFailure::TimedOut, .. } if *a == addr),
        "{error:?}"
    );
    assert_says(
        &error,
        &[
            &addr,
            "did not answer within the connect or command timeout",
        ],
    );
    drop(silent);
}

#[tokio::test]
async fn build_names_a_wrong_password_at_once() {
    crate::needs!(Redis);
    let server = RedisServer::start_with(&["--user", "app", "on", ">right", "~*", "&*", "+@all"]);
    let url = format!("redis://app:wrong@127.0.0.1:{}", server.port());
    let error = build_error(&url).await;
    assert!(matches!(error, BuildError::Auth { .. }), "{error:?}");
    let at = format!("the server at 127.0.0.1:{}", server.port());
    assert_says(&error, &[&at, "refused the credentials of user `app`"]);
}

#[tokio::test]
async fn build_names_a_db_index_out_of_range_at_once() {
    crate::needs!(Redis);
    let server = RedisServer::start_with(&["--databases", "16"]);
    let url = format!("{}/99", server.url());
    let addr = format!("127.0.0.1:{}", server.port());
    let failure = ConnectFailure::NoDatabase { db: 99 };
    assert_connect_fails(&url, &addr, failure, "has no database 99").await;
}

#[tokio::test]
async fn build_refuses_a_bad_namespace_as_configuration() {
    let error = RedisBackend::builder("redis://127.0.0.1:1")
        .namespace("a{b}")
        .build()
        .await
        .expect_err("braces in the namespace");
    assert!(matches!(error, BuildError::Namespace { .. }), "{error:?}");
    assert_names(&error, &["namespace"]);
}

#[tokio::test]
async fn build_refuses_settings_that_would_fail_every_call() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let builds = [
        (
            "command_timeout",
            RedisBackend::builder(server.url()).command_timeout(Duration::ZERO),
        ),
        (
            "connect_timeout",
            RedisBackend::builder(server.url()).connect_timeout(Duration::ZERO),
        ),
        (
            "max_key_len",
            RedisBackend::builder(server.url()).max_key_len(0),
        ),
    ];
    for (setting, builder) in builds {
        let error = builder.build().await.expect_err(setting);
        assert!(
            matches!(error, BuildError::Setting { name, .. } if name == setting),
            "{setting}: {error:?}"
        );
        assert_names(&error, &[setting]);
    }
}

#[tokio::test]
async fn build_refuses_an_unparsable_url() {
    let error = build_error("http://127.0.0.1:6379").await;
    assert!(matches!(error, BuildError::Url { .. }), "{error:?}");
}

/// A backend whose server was killed after it connected, with one pooled connection.
async fn backend_of_a_dead_server() -> (RedisServer, RedisBackend) {
    let mut server = RedisServer::start();
    let backend = RedisBackend::builder(server.url())
        .pool_size(1)
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .await
        .expect("connects");
    server.kill();
    (server, backend)
}

/// The error of a lock call, which must fail.
async fn failed_lock_call(backend: &RedisBackend) -> LockError {
    let call = backend.lock("order:1").try_once();
    match tokio::time::timeout(HANG_GUARD, call).await {
        Err(_) => panic!("lock call still pending after {HANG_GUARD:?}"),
        Ok(Ok(_)) => panic!("locked on a dead server"),
        Ok(Err(e)) => e,
    }
}

/// After the server went away, a lock call reports why no new connection can be made
/// (the first call may still fail on the dead pooled connection itself).
#[tokio::test]
async fn lock_call_names_the_last_connection_error_at_once() {
    crate::needs!(Redis);
    let (_server, backend) = backend_of_a_dead_server().await;
    let mut last = String::new();
    for _ in 0..3 {
        last = chain(&failed_lock_call(&backend).await);
        if last.to_lowercase().contains("refused") {
            return;
        }
    }
    panic!("no lock call named the refused connection; last: {last}");
}

/// Under anyhow's `{:#}` each level prints only its own part: the cause appears once.
#[tokio::test]
async fn error_chain_names_its_cause_once() {
    crate::needs!(Redis);
    let refused = format!("redis://127.0.0.1:{}", closed_port());
    assert_cause_once(&build_error(&refused).await);
    let (_server, backend) = backend_of_a_dead_server().await;
    for _ in 0..3 {
        assert_cause_once(&failed_lock_call(&backend).await);
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A backend built in one runtime and used from another after the first shut down (a
/// `static` shared by `#[tokio::test]`s) takes, hands over and releases locks, and does not
/// claim a subscriber connection it lost with its runtime.
#[test]
fn backend_works_after_the_runtime_it_was_built_in_shut_down() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    let first = runtime();
    let backend = first.block_on(async {
        let backend = server.backend().await;
        support::eventually("the subscriber connects", || async {
            backend.stats().subscriber_connected
        })
        .await;
        backend
    });
    drop(first);
    assert!(
        !backend.stats().subscriber_connected,
        "{:?}",
        backend.stats()
    );

    runtime().block_on(async {
        let locked = tokio::time::timeout(HANG_GUARD, backend.lock("order:7").try_once())
            .await
            .expect("try_once hung")
            .expect("locks from the second runtime");
        server.wait_until_held("order:7").await;
        locked.release().await.expect("release");
        assert!(!server.exists(&support::lock_key("order:7")).await);

        // Woken by another instance's release: the subscriber runs again.
        let other = server.backend().await;
        let held = other.lock("order:7").try_once().await.expect("free");
        let waiter = tokio::spawn({
            let backend = backend.clone();
            async move { backend.lock("order:7").wait(HANG_GUARD).await }
        });
        server.wait_for_subscribers("order:7", 1).await;
        assert!(backend.stats().subscriber_connected);
        held.release().await.expect("release");
        let next = tokio::time::timeout(HANG_GUARD, waiter)
            .await
            .expect("waiter hung")
            .expect("waiter task")
            .expect("waiter takes the lock");
        // Dropping a guard releases it in the background, on this runtime.
        drop(next);
        server.wait_until_released("order:7").await;
    });
}

/// Without the `tls` feature a `rediss://` URL cannot work: `build` says why at once.
#[cfg(not(feature = "tls"))]
#[tokio::test]
async fn build_without_the_tls_feature_names_it() {
    let error = build_error("rediss://127.0.0.1:1").await;
    assert!(matches!(error, BuildError::Tls { .. }), "{error:?}");
    assert_names(&error, &["the crate's `tls` feature"]);
}

/// A single-server backend pointed at a node of a Redis Cluster is refused at build with
/// the builder to use, instead of failing later with a bare `MOVED` for most keys.
#[tokio::test]
async fn a_cluster_node_given_to_the_single_server_builder_names_the_cluster_builder() {
    crate::needs!(Redis);
    let node = RedisServer::start_with(&["--cluster-enabled", "yes"]);
    let error = RedisBackend::builder(node.url())
        .build()
        .await
        .expect_err("a cluster node is not a single server");
    assert!(
        matches!(error, BuildError::Setting { .. }),
        "unexpected error: {error:?}"
    );
    assert!(
        error.to_string().contains("RedisBackend::cluster"),
        "the error names the cluster builder: {error}"
    );
}

//! `rediss://` against real TLS-only redis-servers with certificates the test makes: locks
//! over TLS (state checked with `redis-cli --tls`), mutual TLS, and clients that must be
//! refused at `build()` with the cause. The test never installs a rustls crypto provider:
//! the backend picks its own.

use crate::support;

use std::time::Duration;

use support::tls::{Certs, TlsServer};
use support::{assert_says, chain, lock_key};
use tower_lock::{BuildError, ConnectFailure, LockError, RedisBackend, RedisBackendBuilder};

/// Generous bound on anything that should end within a few seconds.
const HANG: Duration = Duration::from_secs(20);

/// Builds with a connect timeout long enough that a failure which only times out would
/// read "timed out", not the cause (see `support::timed_build`).
async fn build(what: &str, builder: RedisBackendBuilder) -> Result<RedisBackend, BuildError> {
    support::timed_build(what, builder.connect_timeout(Duration::from_secs(5))).await
}

/// A backend on `host` trusting the server's CA.
async fn trusting(server: &TlsServer, host: &str) -> RedisBackend {
    build(
        host,
        RedisBackend::builder(server.url(host)).tls_root_cert(server.certs.pem("ca.crt")),
    )
    .await
    .expect("a client trusting the CA connects")
}

#[tokio::test]
async fn locks_are_taken_waited_for_and_released_over_tls() {
    crate::needs!(Redis);
    let server = TlsServer::start(false);
    let holder = trusting(&server, "127.0.0.1").await;
    let waiter = trusting(&server, "localhost").await;
    assert_eq!(
        server.keys(),
        Vec::<String>::new(),
        "the checks leave nothing"
    );

    let guard = holder.lock("order:1").try_once().await.expect("lock");
    let owner = guard.held().owner().as_str().to_owned();
    assert_eq!(server.cli(&["HGET", &lock_key("order:1"), &owner]), "1");
    let contended = waiter.lock("order:1").try_once().await.expect_err("held");
    assert!(
        matches!(contended, LockError::Contended { .. }),
        "{contended}"
    );

    // The release reaches the waiter through the subscriber's TLS connection.
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        async move { waiter.lock("order:1").wait(HANG).await }
    });
    support::eventually("the waiter subscribes over TLS", || async {
        waiter.stats().channels_with_waiters == 1
    })
    .await;
    guard.release().await.expect("release over TLS");
    let next = tokio::time::timeout(HANG, waiting)
        .await
        .expect("the waiter is woken")
        .expect("no panic")
        .expect("the waiter gets the lock");
    let next_owner = next.held().owner().as_str().to_owned();
    assert_eq!(
        server.cli(&["HGET", &lock_key("order:1"), &next_owner]),
        "1"
    );
    assert_eq!(server.cli(&["HGET", &lock_key("order:1"), &owner]), "");
    next.release().await.expect("release");
    assert_eq!(server.cli(&["EXISTS", &lock_key("order:1")]), "0");
}

#[tokio::test]
async fn mutual_tls_works_and_a_missing_client_certificate_is_named() {
    crate::needs!(Redis);
    let server = TlsServer::start(true);
    let certs = &server.certs;
    let backend = build(
        "with client certificate",
        RedisBackend::builder(server.url("localhost"))
            .tls_root_cert(certs.pem("ca.crt"))
            .tls_client_cert(certs.pem("client.crt"), certs.pem("client.key")),
    )
    .await
    .expect("mutual TLS");
    let guard = backend.lock("k").try_once().await.expect("lock");
    assert_eq!(server.cli(&["EXISTS", &lock_key("k")]), "1");
    guard.release().await.expect("release");
    assert_eq!(server.cli(&["EXISTS", &lock_key("k")]), "0");

    let error = build(
        "without client certificate",
        RedisBackend::builder(server.url("localhost")).tls_root_cert(certs.pem("ca.crt")),
    )
    .await
    .expect_err("the server demands a client certificate");
    let text = chain(&error);
    assert!(matches!(error, BuildError::Tls { .. }), "{text}");
    let addr = format!("the server at localhost:{}", server.port());
    assert_says(&error, &[&addr, "client certificate"]);
}

/// The certificate's problem is named by rustls' name for it, in the error's own message.
#[tokio::test]
async fn a_client_that_does_not_trust_the_server_is_refused_at_build() {
    crate::needs!(Redis);
    let server = TlsServer::start(false);
    let other_ca = Certs::new();
    let addr = format!("localhost:{}", server.port());
    let cases = [
        (
            "system roots",
            RedisBackend::builder(server.url("localhost")),
            "UnknownIssuer",
        ),
        (
            // The other CA has the same name as the server's: the signature tells them apart.
            "another CA",
            RedisBackend::builder(server.url("localhost")).tls_root_cert(other_ca.pem("ca.crt")),
            "BadSignature",
        ),
    ];
    for (what, builder, problem) in cases {
        let error = build(what, builder).await.expect_err("not trusted");
        let text = chain(&error);
        assert!(
            matches!(&error, BuildError::Tls { addr: Some(a), certificate: Some(c), .. }
                if *a == addr && c == problem),
            "{text}"
        );
        let failed = format!(
            "the server at {addr} presented a TLS certificate that failed verification: {problem}"
        );
        assert_says(&error, &[&failed]);
    }
}

/// A plaintext Redis waits for the end of a line the TLS hello may never contain, or
/// answers it with an error: either way `build()` says that the server does not speak TLS,
/// by asking it a plaintext PING, after the connect timeout at most.
#[tokio::test]
async fn tls_to_a_plaintext_server_says_the_server_does_not_speak_tls() {
    crate::needs!(Redis);
    let server = support::RedisServer::start();
    let addr = format!("127.0.0.1:{}", server.port());
    let builder = RedisBackend::builder(format!("rediss://{addr}"))
        .connect_timeout(Duration::from_millis(500));
    let error = support::timed_build("rediss:// to a plaintext port", builder)
        .await
        .expect_err("no TLS there");
    let text = chain(&error);
    assert!(
        matches!(&error, BuildError::Tls { addr: Some(a), certificate: None, .. } if *a == addr),
        "{text}"
    );
    let says =
        format!("the server at {addr} does not speak TLS (is it a plaintext port? use `redis://`)");
    assert_says(&error, &[&says]);
}

/// A TLS-only port resets a connection whose first bytes are a plaintext command.
#[tokio::test]
async fn plaintext_to_a_tls_port_says_the_server_may_expect_tls() {
    crate::needs!(Redis);
    let server = TlsServer::start(false);
    let addr = format!("127.0.0.1:{}", server.port());
    let error = build(
        "redis:// to a TLS port",
        RedisBackend::builder(format!("redis://{addr}")),
    )
    .await
    .expect_err("the server speaks TLS only");
    let text = chain(&error);
    assert!(
        matches!(&error, BuildError::Connect { addr: a, failure: ConnectFailure::ClosedOnPlaintext, .. } if *a == addr),
        "{text}"
    );
    let says = format!(
        "the server at {addr} closed the connection on a plaintext command: it may expect TLS \
         (use `rediss://`)"
    );
    assert_says(&error, &[&says]);
}

#[tokio::test]
async fn unusable_tls_settings_are_refused_before_connecting() {
    let certs = Certs::new();
    let cases = [
        (
            "certificates for redis://",
            RedisBackend::builder("redis://127.0.0.1:1").tls_root_cert(certs.pem("ca.crt")),
            "needs `rediss://`",
        ),
        (
            "no PEM in the root certificate",
            RedisBackend::builder("rediss://127.0.0.1:1").tls_root_cert("not a certificate"),
            "holds no PEM certificate",
        ),
        (
            "a client key that is no key",
            RedisBackend::builder("rediss://127.0.0.1:1")
                .tls_client_cert(certs.pem("client.crt"), "not a key"),
            "invalid",
        ),
    ];
    for (what, builder, says) in cases {
        let error = build(what, builder).await.expect_err("refused");
        let text = chain(&error);
        assert!(matches!(error, BuildError::Tls { .. }), "{text}");
        assert!(text.contains(says), "{what}: {text}");
    }
}

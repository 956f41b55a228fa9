//! What an operator sees of a store that goes away and comes back: on every store, one
//! WARN line when the backend's listening connection is lost (its cause beside it), DEBUG
//! while it stays down, and one INFO line when it is back.
//!
//! The backend runs on a runtime of the test's own thread, so that its tasks log to the
//! thread's subscriber ([`support::logged_on_this_thread`]); each step waits for the line
//! it needs, not for a time.

use crate::support;

use std::future::Future;

use tower_lock::LockBackend;

/// A server that can be stopped and started again on its port.
trait Outage {
    fn stop(&mut self);
    fn start(&mut self);
}

/// Builds a backend with `build` on a runtime of this thread, stops the server, waits
/// until the backend's listener (`name`) logged the loss and then failed to reconnect
/// twice more, starts the server, and waits for the INFO line: the WARN is logged once.
fn an_outage_is_logged_once<S, B, F>(name: &str, server: &mut S, build: impl FnOnce() -> F)
where
    S: Outage,
    B: LockBackend,
    F: Future<Output = B>,
{
    through_an_outage(name, server, build, async |_| {});
}

/// [`an_outage_is_logged_once`], running `after` once the backend's listener is back.
fn through_an_outage<S, B, F>(
    name: &str,
    server: &mut S,
    build: impl FnOnce() -> F,
    after: impl AsyncFnOnce(&B),
) where
    S: Outage,
    B: LockBackend,
    F: Future<Output = B>,
{
    let log = support::logged_on_this_thread("tower_lock=debug", async |log| {
        let backend = build().await;
        // Its listening connection is open before the server goes away: the loss is
        // the one logged.
        log.until(&format!("{name} connected"), 1).await;
        // Eight at once: the command pool opens several connections, idle from now.
        let holds = futures_util::future::join_all(
            (0..8).map(|i| backend.lock(format!("k{i}")).try_once()),
        )
        .await;
        for hold in holds {
            hold.expect("free").release().await.expect("released");
        }
        server.stop();
        log.until(&format!("{name} connection lost; reconnecting"), 1)
            .await;
        log.until(&format!("{name} still cannot connect"), 2).await;
        server.start();
        log.until(&format!("{name} connected again"), 1).await;
        after(&backend).await;
        drop(backend);
    });
    let warnings = log
        .text()
        .lines()
        .filter(|l| l.contains(" WARN ") && l.contains(name))
        .map(str::to_owned)
        .collect::<Vec<_>>();
    assert_eq!(warnings.len(), 1, "one WARN per outage: {warnings:#?}");
    assert!(
        warnings[0].contains("reason="),
        "its cause: {}",
        warnings[0]
    );
}

impl Outage for support::RedisServer {
    fn stop(&mut self) {
        self.kill();
    }

    fn start(&mut self) {
        self.restart();
    }
}

#[test]
fn redis_an_outage_is_logged_once_and_the_return_at_info() {
    crate::needs!(Redis);
    let mut server = support::RedisServer::start();
    let url = server.url();
    an_outage_is_logged_once("lock subscriber", &mut server, || async move {
        tower_lock::RedisBackend::connect(&url)
            .await
            .expect("backend")
    });
}

impl Outage for support::postgres::PostgresServer {
    fn stop(&mut self) {
        support::postgres::PostgresServer::stop(self);
    }

    fn start(&mut self) {
        self.start_again();
    }
}

#[test]
fn postgres_an_outage_is_logged_once_and_the_first_requests_after_it_are_served() {
    crate::needs!(Postgres);
    let mut server = support::postgres::PostgresServer::start();
    let url = server.url();
    let build = || async move {
        tower_lock::PostgresBackend::builder(url)
            .migrate()
            .build()
            .await
            .expect("backend")
    };
    through_an_outage("lock listener", &mut server, build, every_request_served);
}

/// Once the server is back, none of the pool's connections from before the outage fails
/// a request: sixteen acquisitions in turn, each served.
async fn every_request_served<B: LockBackend>(backend: &B) {
    for i in 0..16 {
        let hold = backend.lock(format!("after{i}")).try_once().await;
        let hold = hold.unwrap_or_else(|e| panic!("request {i} after the restart: {e:?}"));
        hold.release().await.expect("released");
    }
}

impl Outage for support::mariadb::MariaDbServer {
    fn stop(&mut self) {
        support::mariadb::MariaDbServer::stop(self);
    }

    fn start(&mut self) {
        self.start_again();
    }
}

#[test]
fn mariadb_an_outage_is_logged_once_and_the_first_requests_after_it_are_served() {
    crate::needs!(MariaDb);
    let mut server = support::mariadb::MariaDbServer::start();
    let url = server.url();
    let build = || async move {
        support::mariadb::builder_on(&url)
            .build()
            .await
            .expect("backend")
    };
    through_an_outage("lock waker", &mut server, build, every_request_served);
}

#[cfg(feature = "etcd")]
impl Outage for support::etcd::EtcdServer {
    fn stop(&mut self) {
        self.kill();
    }

    fn start(&mut self) {
        self.start_again();
    }
}

#[cfg(feature = "etcd")]
#[test]
fn etcd_an_outage_is_logged_once_and_the_return_at_info() {
    crate::needs!(Etcd);
    let mut server = support::etcd::EtcdServer::start();
    let endpoint = server.endpoint();
    an_outage_is_logged_once("etcd watch", &mut server, || async move {
        support::etcd::builder_on(&[endpoint])
            .build()
            .await
            .expect("backend")
    });
}

impl Outage for support::zookeeper::ZkServer {
    fn stop(&mut self) {
        self.kill();
    }

    fn start(&mut self) {
        self.start_again();
    }
}

#[test]
fn zookeeper_an_outage_is_logged_once_and_the_return_at_info() {
    crate::needs!(ZooKeeper);
    let mut server = support::zookeeper::ZkServer::start();
    let hosts = server.hosts();
    an_outage_is_logged_once("ZooKeeper session", &mut server, || async move {
        support::zookeeper::builder_on(&hosts)
            .build()
            .await
            .expect("backend")
    });
}

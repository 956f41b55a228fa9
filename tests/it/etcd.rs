//! etcd: what `build()` refuses, what the lease does for the holds under it, etcd down, a
//! holder partitioned from etcd (stops before its lock is freed, the margin printed). The
//! semantics every store keeps run in the conformance suite (conformance.rs, rwlock.rs,
//! semaphore.rs: `on_etcd::*`); shared holds and permits in etcd in etcd_shared.rs.

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::routing::post;
use support::child::{self, ChildProcess};
use support::etcd::{self, EtcdCluster, EtcdServer};
use support::netns::{CutOffHolder, Net};
use tower_lock::{BuildError, ConnectFailure, LockError, LockLayer};

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(10);

/// An etcd client of the test's own.
async fn client(endpoint: &str) -> tower_lock::etcd_client::Client {
    tower_lock::etcd_client::Client::connect([endpoint], None)
        .await
        .expect("the test's etcd client connects")
}

#[tokio::test]
async fn build_refuses_misconfiguration_naming_the_cause() {
    crate::needs!(Etcd);
    let none: [&str; 0] = [];
    let refused = tower_lock::EtcdBackend::builder(none).build().await;
    let Err(
        error @ BuildError::Setting {
            name: "endpoints", ..
        },
    ) = &refused
    else {
        panic!("no endpoint is refused: {refused:?}");
    };
    assert!(error.to_string().contains("endpoint"), "{error}");

    for bad in [
        "etcd-without-port",
        "redis://127.0.0.1:2379",
        "http://127.0.0.1:2379/v3",
    ] {
        let refused = tower_lock::EtcdBackend::builder([bad]).build().await;
        assert!(
            matches!(refused, Err(BuildError::Url { .. })),
            "{bad}: {refused:?}"
        );
    }
    for builder in [
        tower_lock::EtcdBackend::builder(["https://127.0.0.1:2379", "http://127.0.0.1:2380"]),
        tower_lock::EtcdBackend::builder(["http://127.0.0.1:2379"]).tls_root_cert("pem"),
    ] {
        let refused = builder.build().await;
        let Err(error @ BuildError::Tls { .. }) = &refused else {
            panic!("refused before anything is contacted: {refused:?}");
        };
        assert!(error.to_string().contains("https://"), "{error}");
    }

    let refused = etcd::builder(&etcd::fresh_namespace())
        .lease_ttl(Duration::from_millis(500))
        .build()
        .await;
    assert!(
        matches!(
            refused,
            Err(BuildError::Setting {
                name: "lease_ttl",
                ..
            })
        ),
        "{refused:?}"
    );

    // Nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let refused = tower_lock::EtcdBackend::builder([endpoint.as_str()])
        .connect_timeout(Duration::from_secs(2))
        .build()
        .await;
    let Err(BuildError::Connect { addr, failure, .. }) = &refused else {
        panic!("an unreachable endpoint is refused: {refused:?}");
    };
    assert!(addr.contains(&port.to_string()), "{addr}");
    assert!(
        matches!(failure, ConnectFailure::Refused | ConnectFailure::TimedOut),
        "{failure:?}"
    );
}

#[tokio::test]
async fn credentials_etcd_refuses_are_refused_at_build() {
    crate::needs!(Etcd);
    let server = EtcdServer::start();
    let mut admin = client(&server.endpoint()).await;
    admin.user_add("root", "secret", None).await.expect("root");
    let _ = admin.role_add("root").await;
    admin
        .user_grant_role("root", "root")
        .await
        .expect("root role");
    admin.auth_enable().await.expect("auth on");

    let refused = etcd::builder_on(&[server.endpoint()])
        .user("root", "wrong")
        .build()
        .await;
    let Err(BuildError::Auth { user, .. }) = &refused else {
        panic!("a wrong password is refused: {refused:?}");
    };
    assert_eq!(user, "root");
    let refused = etcd::builder_on(&[server.endpoint()]).build().await;
    assert!(refused.is_err(), "no credentials where auth is on");

    let backend = etcd::builder_on(&[server.endpoint()])
        .user("root", "secret")
        .build()
        .await
        .expect("the right password");
    let guard = backend.lock("k").try_once().await.expect("a lock");
    guard.release().await.expect("released");
}

#[cfg(feature = "tls")]
#[tokio::test]
async fn https_endpoints_with_a_private_ca_and_a_client_certificate() {
    crate::needs!(Etcd);
    let certs = support::tls::Certs::new();
    let server = EtcdServer::start_tls(&certs);
    let endpoint = server.endpoint();
    assert!(endpoint.starts_with("https://"), "{endpoint}");
    let backend = etcd::builder_on(std::slice::from_ref(&endpoint))
        .tls_root_cert(certs.pem("ca.crt"))
        .tls_client_cert(certs.pem("client.crt"), certs.pem("client.key"))
        .build()
        .await
        .expect("TLS with a client certificate");
    let guard = backend.lock("k").try_once().await.expect("a lock over TLS");
    guard.release().await.expect("released");

    // The server wants a client certificate; and a client that does not trust its CA
    // refuses the server.
    for builder in [
        etcd::builder_on(std::slice::from_ref(&endpoint)).tls_root_cert(certs.pem("ca.crt")),
        etcd::builder_on(std::slice::from_ref(&endpoint))
            .tls_client_cert(certs.pem("client.crt"), certs.pem("client.key")),
    ] {
        let refused = builder
            .connect_timeout(Duration::from_secs(2))
            .build()
            .await;
        assert!(
            matches!(refused, Err(BuildError::Connect { .. })),
            "{refused:?}"
        );
    }
    // Plain HTTP to the TLS port.
    let plain = endpoint.replace("https://", "http://");
    let refused = etcd::builder_on(std::slice::from_ref(&plain))
        .connect_timeout(Duration::from_secs(2))
        .build()
        .await;
    let Err(error) = &refused else {
        panic!("plain HTTP to a TLS port is refused: {refused:?}");
    };
    assert_eq!(
        error.to_string(),
        format!(
            "the server at {plain} closed the connection on a plaintext request: it may \
             expect TLS (use `https://`), or not be the store's client port"
        )
    );
}

#[cfg(feature = "tls")]
#[tokio::test]
async fn an_https_endpoint_at_a_plaintext_port_is_refused_naming_tls() {
    crate::needs!(Etcd);
    let tls = etcd::shared().endpoint().replace("http://", "https://");
    let refused = etcd::builder_on(std::slice::from_ref(&tls))
        .connect_timeout(Duration::from_secs(2))
        .build()
        .await;
    let Err(error @ BuildError::Tls { .. }) = &refused else {
        panic!("https:// at a plaintext port is refused as TLS: {refused:?}");
    };
    assert_eq!(
        error.to_string(),
        format!("the server at {tls} does not speak TLS (is it a plaintext port? use `http://`)")
    );
}

#[tokio::test]
async fn fencing_tokens_are_create_revisions_increasing_across_instances() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let (a, b) = (
        etcd::backend_in(&namespace).await,
        etcd::backend_in(&namespace).await,
    );
    let mut last = 0;
    for backend in [&a, &b, &a, &b, &b] {
        let guard = backend.lock("k").try_once().await.expect("free");
        assert!(
            guard.fencing_token() > last,
            "{} after {last}",
            guard.fencing_token()
        );
        last = guard.fencing_token();
        let info = backend.inspect("k").await.expect("inspect");
        assert_eq!(info.fencing_token, Some(last));
        guard.release().await.expect("released");
    }
}

#[tokio::test]
async fn a_revoked_lease_reports_every_hold_under_it_lost_and_frees_the_keys() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let holder = etcd::builder(&namespace)
        .lease_ttl(Duration::from_secs(3))
        .build()
        .await
        .expect("backend");
    let other = etcd::backend_in(&namespace).await;
    let a = holder.lock("a").try_once().await.expect("free");
    let b = holder.lock("b").try_once().await.expect("free");
    let lease = holder.lease_id();
    // An operator revokes the lease (or etcd expired it while the process was cut off).
    let mut admin = client(&etcd::shared().endpoint()).await;
    admin.lease_revoke(lease).await.expect("revoked");
    for guard in [&a, &b] {
        tokio::time::timeout(HANG, guard.lost())
            .await
            .expect("lost fires for every hold under the lease");
    }
    // The keys went with the lease: another instance takes them, with higher tokens.
    let next = other
        .lock("a")
        .try_once()
        .await
        .expect("freed with the lease");
    assert!(next.fencing_token() > a.fencing_token());
    let (a_token, b_token) = (a.fencing_token(), b.fencing_token());
    assert!(matches!(a.release().await, Err(LockError::Lost { .. })));
    assert!(matches!(b.release().await, Err(LockError::Lost { .. })));
    assert!(!next.is_lost(), "the stale release left the new hold alone");
    // The holder goes on under a new lease.
    assert_ne!(holder.lease_id(), lease);
    let again = holder.lock("b").try_once().await.expect("a new lease");
    assert!(again.fencing_token() > b_token.max(a_token));
}

const ENDPOINT: &str = "TOWER_LOCK_TEST_ETCD";
const NAMESPACE: &str = "TOWER_LOCK_TEST_NAMESPACE";
/// `report-lost`: the holder reports when its hold is lost (optional: it holds on).
const WAKES: &str = "TOWER_LOCK_TEST_WAKES";

#[tokio::test]
#[ignore = "entry point of the child processes that the tests spawn"]
async fn child_process() {
    if child::role().as_deref() == Some("holder") {
        let backend = etcd::builder_on(&[child::setting(ENDPOINT)])
            .namespace(child::setting(NAMESPACE))
            .lease_ttl(Duration::from_secs(2))
            .build()
            .await
            .expect("backend");
        let guard = backend.lock("k").try_once().await.expect("uncontended");
        child::report(&format!("held {}", guard.fencing_token()));
        if std::env::var(WAKES).as_deref() == Ok("report-lost") {
            // Cut off from etcd: reports when its hold is given up.
            tokio::time::timeout(HANG, guard.lost())
                .await
                .expect("lost fires");
            child::report(&format!("lost {}", support::netns::now_micros()));
        }
        std::future::pending::<()>().await;
    }
}

/// A holder on its own host, whose way to etcd is cut (the Jepsen hosts of
/// `support::netns`): the holder gives its hold up (`lost()`, its handler aborted) before
/// etcd ends its lease and frees the lock for others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_partitioned_from_etcd_stops_before_its_lock_is_freed() {
    crate::needs!(Etcd);
    const TEST: &str = "etcd partition";
    if !Net::available() {
        support::netns::skip(TEST);
        return;
    }
    let endpoint = etcd::shared().endpoint();
    let namespace = etcd::fresh_namespace();
    let mut holder = CutOffHolder::start(
        endpoint
            .trim_start_matches("http://")
            .parse()
            .expect("host:port"),
        |netns, store| {
            let settings = [
                (ENDPOINT, format!("http://{store}")),
                (NAMESPACE, namespace.clone()),
                (WAKES, "report-lost".to_owned()),
            ];
            ChildProcess::spawn_in(netns, "etcd::child_process", "holder", &settings)
        },
    )
    .await;
    // Watches the lock's directory from the revision after the grant: the first deletion
    // is the lease's end (the holder, cut off, cannot release).
    let mut observer = client(&endpoint).await;
    let options = tower_lock::etcd_client::WatchOptions::new()
        .with_prefix()
        .with_start_revision(i64::try_from(holder.token).expect("a revision") + 1);
    let mut events = observer
        .watch(format!("{namespace}:{{k}}/"), Some(options))
        .await
        .expect("watch");
    let lost = holder.cut().await;
    let freed = loop {
        let reply = tokio::time::timeout(HANG, events.message())
            .await
            .expect("the lease ends")
            .expect("watch stream")
            .expect("watch open");
        if reply.created() {
            continue;
        }
        if reply
            .events()
            .iter()
            .any(|e| e.event_type() == tower_lock::etcd_client::EventType::Delete)
        {
            break support::netns::now_micros();
        }
    };
    support::netns::report_margin("etcd", lost, freed);
    let next = etcd::backend_in(&namespace)
        .await
        .lock("k")
        .try_once()
        .await
        .expect("free once the lease ended");
    assert!(next.fencing_token() > holder.token);
}

#[tokio::test]
async fn a_holder_killed_with_sigkill_frees_its_lock_when_its_lease_ends() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let waiter = etcd::backend_in(&namespace).await;
    let settings = [
        (ENDPOINT, etcd::shared().endpoint()),
        (NAMESPACE, namespace.clone()),
    ];
    let mut holder = ChildProcess::spawn("etcd::child_process", "holder", &settings);
    let report = holder
        .next_report()
        .await
        .expect("the child reports its lock");
    let killed_token: u64 = report
        .strip_prefix("held ")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("unexpected report {report:?}"));
    assert!(matches!(
        waiter.lock("k").try_once().await,
        Err(LockError::Contended { .. })
    ));
    holder.kill().await;
    // Its lease of 2 s, no longer kept alive, ends: etcd deletes the key and the watch
    // wakes the waiter.
    let next = tokio::time::timeout(HANG, waiter.lock("k").wait(HANG))
        .await
        .expect("no hang")
        .expect("freed when the killed holder's lease ended");
    assert!(next.fencing_token() > killed_token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_answers_503_holds_are_lost_and_service_resumes() {
    crate::needs!(Etcd);
    let mut server = EtcdServer::start();
    let backend = etcd::builder_on(&[server.endpoint()])
        .lease_ttl(Duration::from_secs(3))
        .command_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("backend");
    let app = Router::new()
        .route("/lock/{key}", post(|| async { "locked" }))
        .route_layer(
            LockLayer::new(backend.clone(), |req: &Request| {
                req.uri().path().strip_prefix("/lock/").map(str::to_owned)
            })
            .fail_fast(),
        );
    assert_eq!(
        support::call(&app, http::Method::POST, "/lock/a")
            .await
            .status,
        200
    );
    let held = backend.lock("held").try_once().await.expect("free");

    server.kill();
    assert_eq!(
        support::call(&app, http::Method::POST, "/lock/a")
            .await
            .status,
        503,
        "etcd unreachable: the store's failure"
    );
    tokio::time::timeout(HANG, held.lost())
        .await
        .expect("a hold whose lease cannot be confirmed is lost");

    server.start_again();
    support::eventually("requests are served again", || async {
        support::call(&app, http::Method::POST, "/lock/a")
            .await
            .status
            == 200
    })
    .await;
    // etcd renews every lease when it restarts; the lapsed one was revoked, so the key
    // whose holder was told it lost it is free.
    let again = backend.lock("held").try_once().await;
    assert!(again.is_ok(), "{again:?}");
}

/// Three members; four tasks of two instances take one key in turns while the leader is
/// killed: requests are served again after the election, no two tasks ever hold the key
/// at once, and the tokens, taken in hold order, strictly increase across the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_mid_run_loses_no_hold_and_tokens_keep_increasing() {
    crate::needs!(Etcd);
    let mut cluster = EtcdCluster::start();
    let namespace = etcd::fresh_namespace();
    let mut instances = Vec::new();
    for _ in 0..2 {
        let backend = etcd::builder_on(&cluster.endpoints())
            .namespace(&namespace)
            .build()
            .await
            .expect("backend on the cluster");
        instances.push(backend);
    }
    let mut leader = None;
    let seen = support::failover::take_turns_across(&instances, || {
        let index = cluster.leader().expect("a leader");
        cluster.members[index].kill();
        leader = Some(index);
    })
    .await;
    eprintln!(
        "leader n{} killed after {} holds; {} holds in all, {} failed acquisitions",
        leader.map_or(0, |i| i + 1),
        seen.at_kill,
        seen.holds,
        seen.failures
    );
    for error in &seen.errors {
        eprintln!("  {error}");
    }
}

/// Three members, a follower stopped (a minority, which etcd survives): a backend that
/// ran before keeps taking and releasing every hold on the other two, one built with the
/// stopped member first in its list builds and does the same, and each backend says once,
/// at WARN, which member is down.
#[test]
fn a_member_down_costs_no_call_and_each_backend_names_it_once() {
    crate::needs!(Etcd);
    let mut cluster = EtcdCluster::start();
    let down = (cluster.leader().expect("a leader") + 1) % 3;
    // The stopped member first: the member every backend calls first.
    let mut endpoints = cluster.endpoints();
    endpoints.rotate_left(down);
    let stopped = endpoints[0].clone();
    let namespace = etcd::fresh_namespace();
    let log = support::logged_on_this_thread("tower_lock=info", async |_| {
        let running = etcd::builder_on(&endpoints)
            .namespace(&namespace)
            .build()
            .await
            .expect("a backend on the cluster");
        assert_eq!(
            support::failover::holds(&running, 4).await,
            Vec::<String>::new(),
            "before"
        );
        cluster.members[down].kill();
        let failures = support::failover::holds(&running, 50).await;
        assert!(
            failures.is_empty(),
            "a backend that ran before: {failures:#?}"
        );
        let fresh = etcd::builder_on(&endpoints)
            .namespace(&namespace)
            .build()
            .await
            .expect("builds with its first member down");
        let failures = support::failover::holds(&fresh, 50).await;
        assert!(failures.is_empty(), "a backend built since: {failures:#?}");
    });
    let said = |endpoint: &str| {
        log.text()
            .lines()
            .filter(|l| l.contains(" WARN ") && l.contains("etcd member down"))
            .filter(|l| l.contains(&format!("member={endpoint} ")))
            .count()
    };
    for line in log.text().lines().filter(|l| l.contains("etcd member")) {
        eprintln!("{line}");
    }
    assert_eq!(said(&stopped), 2, "once per backend: {}", log.text());
    for up in &endpoints[1..] {
        assert_eq!(said(up), 0, "{up} is up: {}", log.text());
    }
}

#[tokio::test]
async fn force_release_frees_the_key_and_its_holder_sees_lost() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let holder = etcd::builder(&namespace)
        .lease_ttl(Duration::from_secs(3))
        .build()
        .await
        .expect("backend");
    let operator = etcd::backend_in(&namespace).await;
    let guard = holder.lock("k").try_once().await.expect("free");
    let freed = operator.force_release("k").await.expect("force-released");
    assert_eq!(freed.holders, 1);
    assert_eq!(freed.fencing_token, Some(guard.fencing_token()));
    assert!(operator.inspect("k").await.expect("inspect").is_free());
    tokio::time::timeout(HANG, guard.lost())
        .await
        .expect("the holder sees lost at its next renewal");
    let next = operator.lock("k").try_once().await.expect("free");
    assert!(next.fencing_token() > guard.fencing_token());
}

#[tokio::test]
async fn several_keys_at_once_and_a_hold_without_watchdog() {
    crate::needs!(Etcd);
    let backend = etcd::backend().await;
    let both = backend
        .lock_many(["a", "b"])
        .try_once()
        .await
        .expect("both free");
    assert!(matches!(
        backend.lock("b").try_once().await,
        Err(LockError::Contended { .. })
    ));
    both.release().await.expect("released");

    // Its key lives under the backend's lease, renewed for every hold: a hold that asked
    // for no renewal is reported lost at its deadline, and its key deleted when its guard
    // goes, rather than kept for as long as the backend lives.
    let backend = etcd::builder(&etcd::fresh_namespace())
        .lease_ttl(Duration::from_secs(2))
        .build()
        .await
        .expect("backend");
    let unrenewed = backend
        .lock("c")
        .without_watchdog()
        .try_once()
        .await
        .expect("free");
    let token = unrenewed.fencing_token();
    tokio::time::timeout(HANG, unrenewed.lost())
        .await
        .expect("reported lost");
    assert!(matches!(
        unrenewed.release().await,
        Err(LockError::Lost { .. })
    ));
    let next = tokio::time::timeout(HANG, backend.lock("c").wait(HANG))
        .await
        .expect("no hang")
        .expect("its key deleted in etcd too");
    assert!(next.fencing_token() > token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_take_the_lock_in_the_order_they_began_waiting() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let holder = etcd::backend_in(&namespace).await;
    let mut instances = Vec::new();
    for _ in 0..4 {
        instances.push(etcd::backend_in(&namespace).await);
    }
    let observer = client(&etcd::shared().endpoint()).await;
    let (observer, namespace) = (&observer, &namespace);
    // Each waiting instance keeps one key in line (`q...`) in the lock's directory.
    let in_line = |key: &'static str| async move {
        let options = tower_lock::etcd_client::GetOptions::new()
            .with_prefix()
            .with_count_only();
        let reply = observer
            .kv_client()
            .get(format!("{namespace}:{{{key}}}/q"), Some(options))
            .await
            .expect("count the line");
        usize::try_from(reply.count()).expect("a count")
    };
    support::turns::instances_take_the_lock_in_the_order_they_began_waiting(
        holder, instances, in_line,
    )
    .await;
}

/// A waiter that gives up while etcd cannot be reached takes its key out of line once etcd
/// answers again: its key lives under its backend's lease, which outlives the outage, and
/// would otherwise keep every later waiter behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_during_an_outage_leaves_the_line_when_etcd_is_back() {
    crate::needs!(Etcd);
    let mut server = EtcdServer::start();
    let instance = || async {
        etcd::builder_on(&[server.endpoint()])
            .lease_ttl(Duration::from_secs(30))
            .command_timeout(Duration::from_millis(500))
            .build()
            .await
            .expect("backend")
    };
    let (holder, quitter, next) = (instance().await, instance().await, instance().await);
    let observer = client(&server.endpoint()).await;
    let in_line = || async {
        let options = tower_lock::etcd_client::GetOptions::new()
            .with_prefix()
            .with_count_only();
        observer
            .kv_client()
            .get("tower-lock:{k}/q", Some(options))
            .await
            .map(|reply| reply.count())
            .unwrap_or(-1)
    };
    let held = holder.lock("k").try_once().await.expect("uncontended");
    let waiting = quitter.clone();
    let waiter = tokio::spawn(async move { waiting.lock("k").wait(HANG * 6).await });
    support::eventually("the waiter is in line", || async { in_line().await == 1 }).await;
    server.kill();
    // The waiter's backend has seen the outage: its calls fail now, rather than wait for
    // a connection.
    support::eventually("the waiter's backend finds etcd down", || async {
        quitter.inspect("other").await.is_err()
    })
    .await;
    // Its request cancelled while etcd is down (or already ended by the outage, with
    // 503): either way it gave up, and its withdrawal cannot be sent now.
    waiter.abort();
    let gave_up = waiter.await;
    assert!(gave_up.as_ref().map_or(true, |r| r.is_err()), "{gave_up:?}");
    server.start_again();
    support::eventually("the waiter's key left the line", || async {
        in_line().await == 0
    })
    .await;
    // Whether the holder kept its hold through the outage or lost it, the next waiter is
    // served once it is released.
    drop(held.release().await);
    let served = tokio::time::timeout(HANG, next.lock("k").wait(HANG))
        .await
        .expect("no hang")
        .expect("served");
    served.release().await.expect("released");
}

/// A write whose answer never came may be applied after its acquisition ended (a member
/// that held it forwards it once it has a leader): a take that lands while the lock is
/// free puts a hold that nobody holds, under the backend's lease, which lives as long as
/// the backend. The backend that lost the write deletes such a key, and the lock serves
/// the next waiter. Here the take's answer is held in a proxy until the acquisition gave
/// up, and a key of its holder is put as a late write would.
#[tokio::test]
async fn a_hold_put_by_a_write_applied_after_its_acquisition_ended_is_deleted() {
    crate::needs!(Etcd);
    let namespace = etcd::fresh_namespace();
    let server = etcd::shared().endpoint();
    let port = server
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok());
    let proxy = support::proxy::FaultProxy::start(
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        std::net::SocketAddr::from(([127, 0, 0, 1], port.expect("the etcd port"))),
    )
    .await;
    let lost = etcd::builder_on(&[format!("http://{}", proxy.addr())])
        .namespace(&namespace)
        .command_timeout(Duration::from_millis(300))
        // No HTTP/2 ping to time out in the stall: the take is what goes unanswered.
        .keep_alive_interval(Duration::from_secs(3600))
        .build()
        .await
        .expect("backend through the proxy");
    let anchor = lost.lock("anchor").try_once().await.expect("uncontended");
    let holds = etcd::keys_under(format!("{namespace}:{{anchor}}/")).await;
    let lease = holds.first().expect("the anchor's hold").lease();

    // The take is sent and never answered: the acquisition fails, its write may run later.
    proxy.stall_requests();
    let refused = lost.lock("k").reentrant(anchor.held()).try_once().await;
    assert!(
        matches!(refused, Err(LockError::Backend { .. })),
        "{refused:?}"
    );
    proxy.resume();
    let late = format!("{namespace}:{{k}}/h{lease:016x}");
    // A re-entry's count, as a late re-entry leaves it: the undo of the lost call, which
    // deletes only a first hold of that holder, leaves it (and a count of one may or may
    // not be put before it, as the real late write may).
    let value = format!("{}\n2", anchor.held().owner().as_str());
    let on_lease = tower_lock::etcd_client::PutOptions::new().with_lease(lease);
    etcd::admin()
        .await
        .put(late.clone(), value, Some(on_lease))
        .await
        .expect("the late write");

    let next = etcd::backend_in(&namespace).await;
    let taken = next.lock("k").wait(HANG).await;
    assert!(
        taken.is_ok(),
        "the lock stayed held by the late write's key: {taken:?}"
    );
    assert!(
        etcd::keys_under(late).await.is_empty(),
        "the late write's key was deleted"
    );
    drop(anchor);
}

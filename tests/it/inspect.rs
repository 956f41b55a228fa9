//! The operator calls, `inspect` and `force_release` (and their semaphore forms), written
//! once and run against every store with three instances each: a throwaway redis-server
//! (three backends, as three processes), the binary's PostgreSQL, MariaDB and etcd (three
//! backends in a namespace of the test's own) and one `MemoryBackend` (three clones).
//!
//! The promise tested for a force-release: the holder sees `lost()` before its next
//! renewal could have told it (a third of its lease; at once in memory), a waiter gets the
//! key with a token above every earlier one, and the old guard's release is `Lost` and
//! leaves the new holder alone. Redis-only cases are in `tests/it/inspect_redis.rs`.

use crate::support;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tower_lock::{
    HeldLock, KeyError, LockBackend, LockError, LockGuard, LockMode, MemoryBackend, MySqlBackend,
    PostgresBackend, RedisBackend,
};

/// Generous bound on anything that should happen at once: catches hangs only.
const HANG: Duration = Duration::from_secs(10);
/// The holders' lease: renewed every 20 s, so a holder that sees `lost()` within
/// [`LOST_BY`] did not learn it from a renewal.
const LEASE: Duration = Duration::from_secs(60);
const LOST_BY: Duration = Duration::from_secs(15);

/// What a test needs of a store beyond [`LockBackend`].
trait Instance: LockBackend {
    /// Whether a holder sees `lost()` as the force-release returns.
    const LOST_AT_ONCE: bool;

    /// Waits until an acquisition of this instance started with [`started`] waits in the
    /// store (on Redis: subscribed to the key's channel).
    fn waiting(&self) -> impl Future<Output = ()> + Send;
}

impl Instance for RedisBackend {
    const LOST_AT_ONCE: bool = false;

    fn waiting(&self) -> impl Future<Output = ()> + Send {
        let backend = self.clone();
        async move {
            support::eventually("the waiter subscribed", || async {
                backend.stats().channels_with_waiters > 0
            })
            .await;
        }
    }
}

/// The SQL stores and etcd: the waiter listens (PostgreSQL), is registered for wake-ups
/// (MySQL) or watches (etcd) once its connection is up.
macro_rules! listening_instance {
    ($backend:ty) => {
        impl Instance for $backend {
            const LOST_AT_ONCE: bool = false;

            fn waiting(&self) -> impl Future<Output = ()> + Send {
                let backend = self.clone();
                async move {
                    support::eventually("the waiter listens", || async {
                        let stats = backend.stats();
                        stats.channels_with_waiters > 0 && stats.subscriber_connected
                    })
                    .await;
                }
            }
        }
    };
}

listening_instance!(PostgresBackend);
listening_instance!(MySqlBackend);
#[cfg(feature = "etcd")]
listening_instance!(tower_lock::EtcdBackend);

impl Instance for MemoryBackend {
    const LOST_AT_ONCE: bool = true;

    /// A memory acquisition waits from its first poll, which [`started`] made.
    fn waiting(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

/// Runs each body once per store: `on_redis::NAME`, `on_quorum::NAME` (the binary's
/// five-master quorum), `in_memory::NAME`, `on_postgres::NAME`, `on_mariadb::NAME`,
/// `on_etcd::NAME` (the binary's etcd).
macro_rules! for_each_store {
    ($($name:ident),* $(,)?) => {
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    crate::needs!(Redis);
                    let server = crate::support::RedisServer::start();
                    let b = [
                        server.backend().await,
                        server.backend().await,
                        server.backend().await,
                    ];
                    super::$name(b).await;
                    assert!(server.keys().await.iter().all(|k| k.ends_with(":fence")));
                }
            )*
        }
        mod on_quorum {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    crate::needs!(Redis);
                    let quorum = crate::support::quorum::shared();
                    let _turn = quorum.shared_turn().await;
                    let b: [tower_lock::RedisBackend; 3] =
                        quorum.backends(3).await.try_into().expect("three backends");
                    super::$name(b).await;
                }
            )*
        }
        mod in_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let b = tower_lock::MemoryBackend::new();
                    super::$name([b.clone(), b.clone(), b.clone()]).await;
                    assert_eq!(b.held(), 0);
                }
            )*
        }
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    crate::needs!(Postgres);
                    use crate::support::postgres;
                    let namespace = postgres::fresh_namespace();
                    let b = [
                        postgres::backend_in(&namespace).await,
                        postgres::backend_in(&namespace).await,
                        postgres::backend_in(&namespace).await,
                    ];
                    super::$name(b).await;
                }
            )*
        }
        mod on_mariadb {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    crate::needs!(MariaDb);
                    use crate::support::mariadb;
                    let namespace = mariadb::fresh_namespace();
                    let b = [
                        mariadb::backend_in(&namespace).await,
                        mariadb::backend_in(&namespace).await,
                        mariadb::backend_in(&namespace).await,
                    ];
                    super::$name(b).await;
                }
            )*
        }
        crate::on_etcd!($($name),*);
    };
}

for_each_store!(
    inspect_shows_free_exclusive_reentered_shared_and_permits_but_never_owners,
    force_release_frees_an_exclusive_hold_fenced_and_the_holder_sees_lost,
    force_release_frees_every_shared_holder,
    force_release_permits_frees_every_permit,
    force_release_in_a_run_of_one_instances_tasks_fences_above_the_run,
    bad_keys_are_refused_as_a_lock_refuses_them,
);

/// Starts `acquire` in a task after polling it once here: an acquisition that queues in
/// memory is queued when this returns.
async fn started<F>(acquire: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let mut acquire = Box::pin(acquire);
    tokio::select! {
        biased;
        done = &mut acquire => tokio::spawn(async move { done }),
        () = std::future::ready(()) => tokio::spawn(acquire),
    }
}

/// The guard an acquisition task ended with.
async fn joined(task: JoinHandle<Result<LockGuard, LockError>>) -> LockGuard {
    timeout(HANG, task)
        .await
        .expect("the waiter is served")
        .expect("task")
        .expect("the waiter gets the key")
}

fn is_lost(result: Result<(), LockError>) -> bool {
    matches!(result, Err(LockError::Lost { .. }))
}

/// Waits for `held`'s `lost()` within the promise: at once in memory, before the next
/// renewal on Redis.
async fn sees_lost<B: Instance>(held: &HeldLock) {
    if B::LOST_AT_ONCE {
        assert!(held.is_lost(), "lost as the force-release returns");
    }
    timeout(LOST_BY, held.lost())
        .await
        .expect("the holder sees lost() before its next renewal");
}

async fn inspect_shows_free_exclusive_reentered_shared_and_permits_but_never_owners<B: Instance>(
    b: [B; 3],
) {
    let free = b[2].inspect("order:1").await.expect("inspect");
    assert!(free.is_free());
    assert_eq!(
        (free.holders, free.holds, free.lease_remaining),
        (0, 0, None)
    );

    let guard = b[0]
        .lock("order:1")
        .lease(LEASE)
        .try_once()
        .await
        .expect("free");
    let again = b[0].lock("order:1").reentrant(guard.held());
    let inner = again.lease(LEASE).try_once().await.expect("re-entry");
    let info = b[2].inspect("order:1").await.expect("inspect");
    assert_eq!(
        (info.mode, info.holders, info.holds),
        (LockMode::Exclusive, 1, 2)
    );
    let lease = info.lease_remaining.expect("a lease");
    assert!(lease > Duration::ZERO && lease <= LEASE, "{lease:?}");
    let token = guard.fencing_token();
    assert_eq!(info.fencing_token, Some(token));
    let owner = guard.held().owner().as_str();
    let instance = owner.split(':').next().expect("instance part");
    let shown = format!("{info:?}");
    assert!(!shown.contains(instance), "no owner in {shown}");
    inner.release().await.expect("release the re-entry");
    guard.release().await.expect("release");
    let after = b[2].inspect("order:1").await.expect("inspect");
    assert!(after.is_free());
    assert!(after.fencing_token >= Some(token));

    let readers = [
        b[0].lock("doc").shared().lease(LEASE).try_once().await,
        b[1].lock("doc").shared().lease(LEASE).try_once().await,
    ]
    .map(|r| r.expect("shared holds admit each other"));
    let again = b[1].lock("doc").shared().reentrant(readers[1].held());
    let nested = again.lease(LEASE).try_once().await.expect("re-entry");
    let info = b[2].inspect("doc").await.expect("inspect");
    assert_eq!(
        (info.mode, info.holders, info.holds),
        (LockMode::Shared, 2, 3)
    );
    assert!(info.lease_remaining.is_some_and(|l| l <= LEASE));
    assert!(
        b[2].inspect_permits("doc")
            .await
            .expect("inspect")
            .is_free()
    );
    nested.release().await.expect("release");
    for reader in readers {
        reader.release().await.expect("release");
    }

    let permits = [
        b[0].lock("export").permits(3).lease(LEASE).try_once().await,
        b[1].lock("export").permits(3).lease(LEASE).try_once().await,
    ]
    .map(|r| r.expect("a permit"));
    let info = b[2].inspect_permits("export").await.expect("inspect");
    assert_eq!(
        (info.mode, info.holders, info.holds),
        (LockMode::Permits, 2, 2)
    );
    let newest = permits.iter().map(LockGuard::fencing_token).max();
    assert_eq!(info.fencing_token, newest);
    assert!(b[2].inspect("export").await.expect("the lock").is_free());
    for permit in permits {
        permit.release().await.expect("release");
    }
}

async fn force_release_frees_an_exclusive_hold_fenced_and_the_holder_sees_lost<B: Instance>(
    b: [B; 3],
) {
    let holder = b[0]
        .lock("order:1")
        .lease(LEASE)
        .try_once()
        .await
        .expect("free");
    let again = b[0].lock("order:1").reentrant(holder.held());
    let inner = again.lease(LEASE).try_once().await.expect("re-entry");
    let waiter = started(b[1].lock("order:1").lease(LEASE).wait(HANG)).await;
    b[1].waiting().await;

    let freed = b[2].force_release("order:1").await.expect("force_release");
    assert_eq!(
        (freed.mode, freed.holders, freed.holds),
        (LockMode::Exclusive, 1, 2)
    );
    assert_eq!(freed.fencing_token, Some(holder.fencing_token()));
    sees_lost::<B>(holder.held()).await;
    let next = joined(waiter).await;
    assert!(next.fencing_token() > holder.fencing_token());

    assert!(is_lost(inner.release().await));
    assert!(is_lost(holder.release().await));
    let info = b[2].inspect("order:1").await.expect("inspect");
    assert_eq!((info.mode, info.holds), (LockMode::Exclusive, 1));
    let contended = b[2].lock("order:1").try_once().await;
    assert!(matches!(contended, Err(LockError::Contended { .. })));
    next.release()
        .await
        .expect("the new holder still holds the key");
    let again = b[2].force_release("order:1").await.expect("force_release");
    assert!(again.is_free(), "nothing left to free: {again:?}");
}

async fn force_release_frees_every_shared_holder<B: Instance>(b: [B; 3]) {
    let readers = [
        b[0].lock("doc").shared().lease(LEASE).try_once().await,
        b[1].lock("doc").shared().lease(LEASE).try_once().await,
    ]
    .map(|r| r.expect("shared"));
    let writer = started(b[2].lock("doc").lease(LEASE).wait(HANG)).await;
    b[2].waiting().await;
    let freed = b[1].force_release("doc").await.expect("force_release");
    assert_eq!((freed.mode, freed.holders), (LockMode::Shared, 2));
    for reader in &readers {
        sees_lost::<B>(reader.held()).await;
    }
    let writer = joined(writer).await;
    assert!(writer.fencing_token() > freed.fencing_token.unwrap_or(0));
    for reader in readers {
        assert!(is_lost(reader.release().await));
    }
    writer
        .release()
        .await
        .expect("the writer still holds the key");
}

async fn force_release_permits_frees_every_permit<B: Instance>(b: [B; 3]) {
    let permits = [
        b[0].lock("export").permits(2).lease(LEASE).try_once().await,
        b[1].lock("export").permits(2).lease(LEASE).try_once().await,
    ]
    .map(|r| r.expect("a permit"));
    let waiter = started(b[2].lock("export").permits(2).lease(LEASE).wait(HANG)).await;
    b[2].waiting().await;
    // The lock of the same name is another primitive: nothing to free there.
    assert!(b[1].force_release("export").await.expect("lock").is_free());
    let freed = b[1].force_release_permits("export").await.expect("permits");
    assert_eq!((freed.mode, freed.holders), (LockMode::Permits, 2));
    let newest = permits.iter().map(LockGuard::fencing_token).max();
    assert_eq!(freed.fencing_token, newest);
    for permit in &permits {
        sees_lost::<B>(permit.held()).await;
    }
    let next = joined(waiter).await;
    assert!(Some(next.fencing_token()) > newest);
    for permit in permits {
        assert!(is_lost(permit.release().await));
    }
    next.release().await.expect("the new permit is held");
}

/// Five tasks of one instance queue for a key another instance holds, so the first takes
/// it with a block of tokens set aside for the others (on Redis) and passes it on in
/// memory. Freed by force while the second holds it: every later holder, of any instance,
/// has a token above the run's block.
async fn force_release_in_a_run_of_one_instances_tasks_fences_above_the_run<B: Instance>(
    b: [B; 3],
) {
    const KEY: &str = "hot";
    let blocker = b[1].lock(KEY).lease(LEASE).try_once().await.expect("free");
    let (held, mut holders) = mpsc::unbounded_channel::<HeldLock>();
    let turns = Arc::new(Semaphore::new(0));
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let (backend, held, turns) = (b[0].clone(), held.clone(), turns.clone());
        tasks.push(
            started(async move {
                let lock = backend.lock(KEY).lease(LEASE).wait(HANG);
                let guard = lock.await.expect("every task gets the key");
                held.send(guard.held().clone()).expect("test alive");
                turns.acquire().await.expect("open").forget();
                let _ = guard.release().await;
            })
            .await,
        );
    }
    b[0].waiting().await;
    blocker.release().await.expect("release");
    let first = timeout(HANG, holders.recv())
        .await
        .expect("first")
        .expect("held");
    turns.add_permits(1);
    let second = timeout(HANG, holders.recv())
        .await
        .expect("second")
        .expect("held");
    assert!(second.fencing_token() > first.fencing_token());
    let waiter = started(b[1].lock(KEY).lease(LEASE).wait(HANG)).await;
    b[1].waiting().await;

    let freed = b[2].force_release(KEY).await.expect("force_release");
    assert_eq!(freed.mode, LockMode::Exclusive);
    let fence = freed.fencing_token.expect("a token");
    assert!(fence >= second.fencing_token());
    sees_lost::<B>(&second).await;
    turns.add_permits(10);
    let next = joined(waiter).await;
    let mut later = vec![next.fencing_token()];
    next.release().await.expect("release");
    for _ in 0..3 {
        let holder = timeout(HANG, holders.recv())
            .await
            .expect("later")
            .expect("held");
        later.push(holder.fencing_token());
    }
    for task in tasks {
        timeout(HANG, task).await.expect("task ends").expect("task");
    }
    assert!(later.iter().all(|&t| t > fence), "{later:?} above {fence}");
}

async fn bad_keys_are_refused_as_a_lock_refuses_them<B: Instance>(b: [B; 3]) {
    let too_long = "k".repeat(2048);
    let cases = [
        ("", KeyError::Empty),
        (
            too_long.as_str(),
            KeyError::TooLong {
                len: 2048,
                max: 1024,
            },
        ),
        ("a\nb", KeyError::ControlCharacter),
    ];
    for (key, error) in cases {
        let refusals = [
            b[0].inspect(key).await,
            b[0].inspect_permits(key).await,
            b[0].force_release(key).await,
            b[0].force_release_permits(key).await,
        ];
        for refused in refusals {
            assert!(
                matches!(&refused, Err(LockError::InvalidKey(e)) if *e == error),
                "{refused:?}"
            );
        }
        let locked = b[0].lock(key).try_once().await;
        assert!(matches!(locked, Err(LockError::InvalidKey(e)) if e == error));
    }
}

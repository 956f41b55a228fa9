//! The ZooKeeper store: the core's primitive calls as reads and versioned writes of the
//! lock's nodes, every hold an ephemeral sequential node of the backend's session.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client::{Client, Error as ClientError, Stat};

use super::attempt::Run;
use super::error::ZkError;
use super::keys::ZkKey;
use super::records::Shelf;
use super::session::Session;
use crate::core::kit::backoff::Backoff;
use crate::core::kit::listener::Listener;
use crate::core::runtime::Daemon;
use crate::core::store::{
    Attempt, Capabilities, HeldPage, LostHolds, Release, Released, Sent, Store,
};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, Kind, LockOwner};

/// How many times a call goes round when the lock's node changed under it (a container
/// deleted between a read and a create, a node gone between a listing and a read).
pub(super) const ROUNDS: usize = 16;

/// Holds checked by one renewal call: its two multi-reads stay far below ZooKeeper's
/// bound on a packet (`jute.maxbuffer`, 1 MiB by default) with keys of the default length.
const RENEW_BATCH: usize = 100;

/// Locks in one ZooKeeper ensemble, under the namespace's node.
pub(crate) struct ZkStore {
    pub(crate) session: Arc<Session>,
    /// Follows the session, confirms waiters, replaces an ended session.
    pub(crate) listener: Listener,
    /// The hold nodes a watch waits on (one watch per node, however many attempts).
    pub(crate) watched: Arc<Mutex<HashSet<String>>>,
    pub(crate) namespace: String,
    /// The namespace's node.
    pub(crate) root: String,
    pub(crate) max_key_len: usize,
    /// Where the namespace's idempotency records live, and the ensemble's clock.
    pub(crate) shelf: Arc<Shelf>,
    /// Deletes expired idempotency records.
    pub(crate) janitor: Daemon,
}

/// The longest pause before an attempt whose connection was lost again is sent again.
const MAX_AGAIN_BACKOFF: Duration = Duration::from_millis(500);

/// A fencing token from a node's creation zxid (zxids start above zero).
pub(super) fn token(stat: &Stat) -> u64 {
    u64::try_from(stat.czxid).unwrap_or(0)
}

/// A node's path under the lock's node.
pub(super) fn child(lock: &str, name: &str) -> String {
    format!("{lock}/{name}")
}

/// The lock's holds (the children of its node); none when the node is gone.
pub(super) async fn holds(client: &Client, lock: &str) -> Result<Vec<String>, ZkError> {
    match client.get_children(lock).await {
        Ok((children, _)) => Ok(children),
        Err(ClientError::NoNode) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    }
}

impl Store for ZkStore {
    type Key = ZkKey;
    type Error = ZkError;
    // A release needs no particular connection.
    type Sent = ();

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // The session outlives a hold that asked for no renewal.
            lost_holds: LostHolds::MayRemain,
            ..Capabilities::default()
        }
    }

    fn key(&self, user: String, kind: Kind) -> Result<ZkKey, LockError> {
        let semaphore = matches!(kind, Kind::Permit(_));
        Ok(ZkKey::new(&self.root, user, self.max_key_len, semaphore)?)
    }

    fn attempt(
        self: &Arc<Self>,
        key: &Arc<ZkKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>> {
        // Runs again on this caller's runtime if the one it ran on is gone.
        self.listener.ensure_running();
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            // Sent again while the wait it was sent for lasts (a try: once more only).
            let until = attempt.waits.map(|waits| Instant::now() + waits);
            let lost = store.session.id();
            let mut run = Run::default();
            let mut backoff = Backoff::up_to(MAX_AGAIN_BACKOFF);
            let mut lost_connections = 0u32;
            let attempted = loop {
                match store.attempt_once(&key, &attempt, &mut run).await {
                    Err(e) if e.session_ended() => {
                        break match store.session.replace(lost).await {
                            // The old session's nodes went with it.
                            Ok(_) => {
                                store
                                    .attempt_once(&key, &attempt, &mut Run::default())
                                    .await
                            }
                            Err(e) => Err(e),
                        };
                    }
                    // The connection was lost, not the session: the client moves it to
                    // another server, and the attempt runs again there, settling what a
                    // call whose answer never came did (see `Run`). Once at once; again, as
                    // the ensemble elects (the server the session moved to may lose it
                    // too), with backoff while the wait lasts.
                    Err(e) if e.connection_failed() => {
                        run.again = true;
                        lost_connections += 1;
                        if lost_connections > 1 {
                            let pause = backoff.next();
                            if until.is_none_or(|until| Instant::now() + pause >= until) {
                                break Err(e);
                            }
                            tokio::time::sleep(pause).await;
                        }
                    }
                    attempted => break attempted,
                }
            };
            (attempted, Some(()))
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a ZkKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, ZkError>> {
        Box::pin(async move {
            let client = self.session.client();
            match self.release_once(client, key, release).await {
                // Every node of an ended session is gone with it.
                Err(e) if e.session_ended() => Ok(Released::NotHeld),
                released => released,
            }
        })
    }

    fn release_after<'a>(
        &'a self,
        key: &'a ZkKey,
        release: &'a Release<'a>,
        (): (),
    ) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.release(key, release).await.is_ok() })
    }

    fn withdraw_writer(
        self: &Arc<Self>,
        key: &Arc<ZkKey>,
        holder: LockOwner,
        _wake: bool,
    ) -> BoxFuture<'static, ()> {
        // Deleting the writer's node fires the watches on it: those it kept out are woken
        // whatever `wake` says.
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move { store.withdraw_until_answered(&key, holder.as_str()).await })
    }

    fn renew<'a>(&'a self, batch: &'a [Due]) -> BoxFuture<'a, Result<Vec<bool>, ZkError>> {
        Box::pin(async move {
            // A read answered on the session is the ensemble hearing from it: the session,
            // and every node of it, lives a session timeout on from there at least.
            let client = self.session.client();
            let lost = client.session_id().0;
            match self.check(client, batch).await {
                Err(e) if e.session_ended() => {
                    // Its holds are gone; new ones go on a new session.
                    if let Err(error) = self.session.replace(lost).await {
                        tracing::debug!(%error, "could not open a new ZooKeeper session");
                    }
                    Ok(vec![false; batch.len()])
                }
                checked => checked,
            }
        })
    }

    fn renewal_calls(&self, due: Vec<Due>) -> Vec<Vec<Due>> {
        due.chunks(RENEW_BATCH).map(<[Due]>::to_vec).collect()
    }

    fn subscribe(&self, key: &ZkKey) -> Waiter {
        self.listener.ensure_running();
        self.listener.register(&key.path)
    }

    fn lease(&self, _lease: Duration) -> Duration {
        self.session.hold_lease()
    }

    fn inspect(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let store = self.clone();
        Box::pin(async move { store.snapshot(user, of, false).await })
    }

    fn held_page(
        self: &Arc<Self>,
        prefix: Arc<str>,
        _from: Option<String>,
    ) -> BoxFuture<'static, Result<HeldPage, LockError>> {
        // One page: ZooKeeper has no paged listing, the namespace node's children come
        // in one reply.
        let store = self.clone();
        Box::pin(async move { store.held_keys(&prefix).await })
    }

    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let store = self.clone();
        Box::pin(async move { store.snapshot(user, of, true).await })
    }
}

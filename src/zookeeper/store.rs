//! The ZooKeeper store: the core's primitive calls as reads and versioned writes of the
//! lock's node, every hold an ephemeral sequential node of the backend's session.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zookeeper_client::{Acls, Client, CreateMode, Error as ClientError, Stat};

use super::error::ZkError;
use super::keys::{ZkKey, hold_prefix, lowest};
use super::session::Session;
use crate::core::hold_value::HoldValue;
use crate::core::runtime::Daemon;
use crate::core::store::{Attempt, Attempted, Release, Released, Sent, Store, StoreKey};
use crate::core::wakeups::{Waiter, Wakeups};
use crate::core::watchdog::Due;
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, LockMode, Primitive};
use crate::lock::{BoxFuture, Kind};

/// How many times a call goes round when the lock's node changed under it (a container
/// deleted between a read and a create, a node gone between a listing and a read).
const ROUNDS: usize = 16;

/// Holds checked by one renewal call: its two multi-reads stay far below ZooKeeper's
/// bound on a packet (`jute.maxbuffer`, 1 MiB by default) with keys of the default length.
const RENEW_BATCH: usize = 100;

/// Locks in one ZooKeeper ensemble, under the namespace's node.
pub(crate) struct ZkStore {
    pub(crate) session: Arc<Session>,
    pub(crate) wakeups: Wakeups,
    /// Follows the session, confirms waiters, replaces an ended session.
    pub(crate) follower: Daemon,
    /// The hold nodes a watch waits on (one watch per node, however many attempts).
    pub(crate) watched: Arc<Mutex<HashSet<String>>>,
    pub(crate) namespace: String,
    /// The namespace's node.
    pub(crate) root: String,
    pub(crate) max_key_len: usize,
}

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

/// A hold node's value and stat; `None` when it is gone.
pub(super) async fn read(
    client: &Client,
    path: &str,
) -> Result<Option<(HoldValue, Stat)>, ZkError> {
    match client.get_data(path).await {
        Ok((data, stat)) => {
            let value = HoldValue::parse(&data).ok_or(ZkError::Foreign)?;
            Ok(Some((value, stat)))
        }
        Err(ClientError::NoNode) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

impl ZkStore {
    /// One exclusive attempt (see the module docs of `zookeeper`): re-enters this
    /// session's hold if it is the holder's own, else creates this session's node if the
    /// lock has none and keeps it if it is the lowest; else watches the lowest.
    async fn attempt_exclusive(&self, key: &ZkKey, holder: &str) -> Result<Attempted, ZkError> {
        let lock = &key.path;
        for _ in 0..ROUNDS {
            let client = self.session.client();
            let mine = hold_prefix(client.session_id().0);
            let children = holds(&client, lock).await?;
            if let Some(first) = lowest(&children) {
                if first.starts_with(&mine) {
                    let path = child(lock, first);
                    let Some((mut value, stat)) = read(&client, &path).await? else {
                        continue;
                    };
                    if value.holder != holder {
                        // Another request of this process: the core queues behind it.
                        return Ok(Attempted::Held {
                            left: None,
                            queued: false,
                        });
                    }
                    value.count += 1;
                    match client
                        .set_data(&path, value.encode().as_bytes(), Some(stat.version))
                        .await
                    {
                        Ok(_) => {
                            return Ok(Attempted::Acquired {
                                token: token(&stat),
                                count: value.count,
                            });
                        }
                        Err(ClientError::BadVersion | ClientError::NoNode) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                if !self.watch(&client, lock, first).await? {
                    continue;
                }
                return Ok(Attempted::Held {
                    left: None,
                    queued: false,
                });
            }
            // The lock's node lives while it has holds, and goes some time after.
            let container = CreateMode::Container.with_acls(Acls::anyone_all());
            match client.create(lock, &[], &container).await {
                Ok(_) | Err(ClientError::NodeExists) => {}
                Err(e) => return Err(e.into()),
            }
            let hold = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
            let value = HoldValue::new(holder).encode();
            let (stat, _) = match client
                .create(&child(lock, &mine), value.as_bytes(), &hold)
                .await
            {
                Ok(created) => created,
                // The empty container was deleted in between: again.
                Err(ClientError::NoNode) => continue,
                Err(e) => return Err(e.into()),
            };
            let children = holds(&client, lock).await?;
            let Some(first) = lowest(&children) else {
                continue;
            };
            if first.starts_with(&mine) {
                return Ok(Attempted::Acquired {
                    token: token(&stat),
                    count: 1,
                });
            }
            // Another process created its node first: it holds the lock; this one leaves
            // nothing behind and waits for that node's deletion.
            for name in children.iter().filter(|c| c.starts_with(&mine)) {
                match client.delete(&child(lock, name), None).await {
                    Ok(()) | Err(ClientError::NoNode) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if !self.watch(&client, lock, first).await? {
                continue;
            }
            return Ok(Attempted::Held {
                left: None,
                queued: false,
            });
        }
        Err(ZkError::Contended)
    }

    /// One release of an exclusive hold: the count down, or the node deleted, each a write
    /// on the node's version; a release already applied (its id recorded) changes nothing.
    async fn release_exclusive(
        &self,
        client: Client,
        key: &ZkKey,
        release: &Release<'_>,
    ) -> Result<Released, ZkError> {
        let lock = &key.path;
        let mine = hold_prefix(client.session_id().0);
        for _ in 0..ROUNDS {
            let children = holds(&client, lock).await?;
            let Some(name) = children.iter().find(|c| c.starts_with(&mine)) else {
                return Ok(Released::NotHeld);
            };
            let path = child(lock, name);
            let Some((mut value, stat)) = read(&client, &path).await? else {
                return Ok(Released::NotHeld);
            };
            if value.holder != release.holder.as_str()
                || release.only_token.is_some_and(|t| t != token(&stat))
            {
                return Ok(Released::NotHeld);
            }
            if value.released.iter().any(|id| id == release.release_id) {
                return Ok(Released::Remains);
            }
            let written = if value.count > 1 {
                value.count -= 1;
                value.released.push(release.release_id.to_owned());
                let data = value.encode();
                let set = client.set_data(&path, data.as_bytes(), Some(stat.version));
                set.await.map(|_| Released::Remains)
            } else {
                let delete = client.delete(&path, Some(stat.version));
                delete.await.map(|()| Released::Freed)
            };
            match written {
                Ok(released) => return Ok(released),
                Err(ClientError::BadVersion | ClientError::NoNode) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ZkError::Contended)
    }

    async fn snapshot(
        &self,
        user: String,
        of: Primitive,
        free: bool,
    ) -> Result<LockInfo, LockError> {
        let context = if free { "force_release" } else { "inspect" };
        let key = ZkKey::new(&self.root, user, self.max_key_len)?;
        if of == Primitive::Semaphore {
            return Ok(LockInfo::free(key.user().to_owned(), None));
        }
        let fail = |e: ZkError| LockError::backend(context, e);
        let client = self.session.client();
        let children = holds(&client, &key.path).await.map_err(fail)?;
        let Some(first) = lowest(&children) else {
            return Ok(LockInfo::free(key.user().to_owned(), None));
        };
        let Some((value, stat)) = read(&client, &child(&key.path, first))
            .await
            .map_err(fail)?
        else {
            return Ok(LockInfo::free(key.user().to_owned(), None));
        };
        if free {
            for name in &children {
                match client.delete(&child(&key.path, name), None).await {
                    Ok(()) | Err(ClientError::NoNode) => {}
                    Err(e) => return Err(fail(e.into())),
                }
            }
        }
        Ok(LockInfo {
            key: key.user().to_owned(),
            mode: LockMode::Exclusive,
            holders: 1,
            holds: u32::try_from(value.count).unwrap_or(u32::MAX),
            // At most the session's timeout: its holder confirms it every sixth of that.
            lease_remaining: Some(self.session.hold_lease() * 2),
            fencing_token: Some(token(&stat)),
        })
    }
}

/// Why the ZooKeeper backend refuses shared locks and permits, for now.
const EXCLUSIVE_ONLY: &str =
    "the ZooKeeper backend supports exclusive locks only for now (no shared locks or permits)";

impl Store for ZkStore {
    type Key = ZkKey;
    type Error = ZkError;
    // A release needs no particular connection.
    type Sent = ();

    fn key(&self, user: String, kind: Kind) -> Result<ZkKey, LockError> {
        if kind != Kind::Exclusive {
            return Err(LockError::Unsupported {
                key: user,
                what: EXCLUSIVE_ONLY,
            });
        }
        Ok(ZkKey::new(&self.root, user, self.max_key_len)?)
    }

    fn attempt(
        self: &Arc<Self>,
        key: &Arc<ZkKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>> {
        // Runs again on this caller's runtime if the one it ran on is gone.
        self.follower.ensure_running();
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            let attempted = match attempt.kind {
                Kind::Exclusive => {
                    let holder = attempt.holder.as_str();
                    let lost = store.session.id();
                    match store.attempt_exclusive(&key, holder).await {
                        Err(e) if e.session_ended() => match store.session.replace(lost).await {
                            Ok(_) => store.attempt_exclusive(&key, holder).await,
                            Err(e) => Err(e),
                        },
                        attempted => attempted,
                    }
                }
                // Refused by `key`.
                Kind::Shared | Kind::Permit(_) => Err(ZkError::Foreign),
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
            match self.release_exclusive(client, key, release).await {
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
        self.follower.ensure_running();
        self.wakeups.register(&key.path)
    }

    fn releases_lost_holds(&self) -> bool {
        // The session outlives a hold that asked for no renewal.
        true
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

    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let store = self.clone();
        Box::pin(async move { store.snapshot(user, of, true).await })
    }
}

//! Giving back: one hold's release, a waiting writer's withdrawal, and the operator's
//! snapshot, force-release and listing.

use std::time::Duration;

use zookeeper_client::{Client, Error as ClientError};

use super::error::ZkError;
use super::keys::{ZkKey, lock_of};
use super::line::{line, shared_token};
use super::store::{ROUNDS, ZkStore, child, token};
use crate::core::kit::backoff::Backoff;
use crate::core::kit::turn::EntryKind;
use crate::core::store::Failure;
use crate::core::store::{HeldPage, Release, Released, StoreKey};
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, LockMode, Primitive};

/// The longest wait between two sends of a withdrawal.
const MAX_WITHDRAW_BACKOFF: Duration = Duration::from_secs(1);

impl ZkStore {
    /// One release of a hold: the count down, or the node deleted, each a write on the
    /// node's version; a release already applied (its id recorded) changes nothing.
    pub(super) async fn release_once(
        &self,
        client: Client,
        key: &ZkKey,
        release: &Release<'_>,
    ) -> Result<Released, ZkError> {
        let lock = &key.path;
        for _ in 0..ROUNDS {
            let now = line(&client, lock, |_, mine| mine).await?;
            let Some(at) = now.find(release.holder.as_str()) else {
                return Ok(Released::NotHeld);
            };
            let entry = &now.0[at];
            let Some((mut value, stat)) = entry.value.clone() else {
                continue;
            };
            let path = child(lock, &entry.name);
            if let Some(only) = release.only_token {
                let held = match entry.kind {
                    EntryKind::Read => shared_token(&client, lock).await?,
                    EntryKind::Write => token(&stat),
                };
                if held != only {
                    return Ok(Released::NotHeld);
                }
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
                // A writer still in line (an attempt undone) holds nothing: it leaves.
                let freed = if entry.holds() {
                    Released::Freed
                } else {
                    Released::NotHeld
                };
                let delete = client.delete(&path, Some(stat.version));
                delete.await.map(|()| freed)
            };
            match written {
                Ok(released) => return Ok(released),
                Err(ClientError::BadVersion | ClientError::NoNode) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ZkError::Contended)
    }

    /// Takes `owner`'s writer out of the line (see [`withdraw`](Self::withdraw)), sent again
    /// with backoff after a failure that may pass until ZooKeeper answers, the session ends
    /// (its nodes with it) or the backend shuts down. A writer's node left in line keeps
    /// the lock from every later holder for as long as the session lives: a withdrawal sent
    /// while the connection was down, or one whose answer was lost, must not be given up.
    pub(super) async fn withdraw_until_answered(&self, key: &ZkKey, owner: &str) {
        let mut backoff = Backoff::up_to(MAX_WITHDRAW_BACKOFF);
        loop {
            match self.withdraw(key, owner).await {
                Ok(()) => return,
                Err(e) if e.session_ended() => return,
                Err(error) if error.is_transient() => {
                    tracing::debug!(key = %key.path, %error, "a waiting writer was not withdrawn; again");
                }
                Err(error) => {
                    tracing::warn!(key = %key.path, %error, "a waiting writer could not be withdrawn; it leaves the line when the session ends");
                    return;
                }
            }
            if !backoff.pause(self.session.shutdown()).await {
                return;
            }
        }
    }

    /// Takes `owner`'s writer out of the line, if it still waits there (its count 0: a
    /// writer granted meanwhile keeps its hold, which its attempt's undo gives back).
    /// The deletion fires the watches on it.
    pub(super) async fn withdraw(&self, key: &ZkKey, owner: &str) -> Result<(), ZkError> {
        let client = self.session.client();
        let now = line(&client, &key.path, |kind, mine| {
            mine && kind == EntryKind::Write
        })
        .await?;
        let Some(entry) = now.find(owner).map(|at| &now.0[at]) else {
            return Ok(());
        };
        let Some((_, stat)) = entry.value.as_ref().filter(|_| !entry.holds()) else {
            return Ok(());
        };
        let path = child(&key.path, &entry.name);
        match client.delete(&path, Some(stat.version)).await {
            Ok(()) | Err(ClientError::NoNode | ClientError::BadVersion) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The snapshot of `user`'s lock or semaphore (`of`), after freeing it if `free`.
    pub(super) async fn snapshot(
        &self,
        user: String,
        of: Primitive,
        free: bool,
    ) -> Result<LockInfo, LockError> {
        let context = if free { "force_release" } else { "inspect" };
        let key = ZkKey::new(
            &self.root,
            user,
            self.max_key_len,
            of == Primitive::Semaphore,
        )?;
        let fail = |e: ZkError| LockError::backend(context, e);
        let client = self.session.client();
        let now = line(&client, &key.path, |_, _| true).await.map_err(fail)?;
        let holds: Vec<_> = now.0.iter().filter(|e| e.holds()).collect();
        let writer = holds.iter().find(|e| e.kind == EntryKind::Write);
        let (mode, holding): (_, Vec<_>) = match (of, writer) {
            (_, _) if holds.is_empty() => (LockMode::Free, Vec::new()),
            (Primitive::Semaphore, _) => (LockMode::Permits, holds.clone()),
            (Primitive::Lock, Some(writer)) => (LockMode::Exclusive, vec![*writer]),
            (Primitive::Lock, None) => (LockMode::Shared, holds.clone()),
        };
        let fencing_token = match mode {
            LockMode::Free => None,
            LockMode::Shared => Some(shared_token(&client, &key.path).await.map_err(fail)?),
            LockMode::Exclusive | LockMode::Permits => holding
                .iter()
                .filter_map(|e| e.value.as_ref().map(|(_, stat)| token(stat)))
                .max(),
        };
        if free {
            for entry in &now.0 {
                match client.delete(&child(&key.path, &entry.name), None).await {
                    Ok(()) | Err(ClientError::NoNode) => {}
                    Err(e) => return Err(fail(e.into())),
                }
            }
        }
        if mode == LockMode::Free {
            return Ok(LockInfo::free(key.user().to_owned(), None));
        }
        let holds: u64 = holding
            .iter()
            .map(|e| e.value.as_ref().map_or(0, |(v, _)| v.count))
            .sum();
        Ok(LockInfo {
            key: key.user().to_owned(),
            mode,
            holders: holding.len(),
            holds: u32::try_from(holds).unwrap_or(u32::MAX),
            // At most the session's timeout: its holder confirms it every sixth of that.
            lease_remaining: Some(self.session.hold_lease() * 2),
            fencing_token,
        })
    }

    /// The locks and semaphores under `prefix` that may be held (see `Store::held_page`),
    /// in one page: one read of the namespace's node's children (ZooKeeper has no paged
    /// listing; they come in one reply). Every lock and semaphore under the prefix that
    /// has a node comes, held or not (an empty container ZooKeeper has not deleted yet):
    /// the core inspects each. The idempotency records' node and names this crate never
    /// gives are left out; nothing comes when the namespace's node is gone.
    pub(super) async fn held_keys(&self, prefix: &str) -> Result<HeldPage, LockError> {
        let client = self.session.client();
        let children = match client.get_children(&self.root).await {
            Ok((children, _)) => children,
            Err(ClientError::NoNode) => Vec::new(),
            Err(e) => return Err(LockError::backend("list_held", ZkError::from(e))),
        };
        let keys = children
            .iter()
            .filter_map(|name| lock_of(name))
            .filter(|(user, _)| user.starts_with(prefix))
            .collect();
        Ok(HeldPage { keys, next: None })
    }
}

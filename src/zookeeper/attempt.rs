//! One acquisition attempt, of any kind: the lock's line read, the holder's own node
//! re-entered, or a node created and kept if its turn has come (see [`turn`]).

use std::sync::Arc;

use zookeeper_client::{Client, CreateMode, Error as ClientError, Stat};

use super::error::ZkError;
use super::keys::{READ_MARK, ZkKey, hold_prefix};
use super::line::{Line, line, record_writer, shared_token};
use super::store::{ROUNDS, ZkStore, child, token};
use crate::core::hold::value::HoldValue;
use crate::core::holder;
use crate::core::kit::turn::{EntryKind, Turn, turn};
use crate::core::store::{Attempt, Attempted};
use crate::lock::Kind;

/// What a round of an attempt came to: an answer, or go round again (the line changed
/// under it).
type Round = Option<Attempted>;

fn held(queued: bool) -> Round {
    Some(Attempted::Held { left: None, queued })
}

/// The holder's own node as an attempt's first look found it: what a write of that
/// attempt whose answer never came (the connection was lost) may have changed.
#[derive(Clone, Copy, Debug)]
pub(super) enum Before {
    /// No node: one found later was created by the attempt.
    Nothing,
    /// Its node at this version, with this count.
    Node { version: i32, count: u64 },
}

/// How an attempt runs: afresh (`Run::default()`), or again after a call of an earlier run
/// was lost.
#[derive(Default)]
pub(super) struct Run {
    /// Set by the run's first look at the lock (kept by a run again).
    pub(super) before: Option<Before>,
    /// A call of an earlier run may have changed the holder's node.
    pub(super) again: bool,
}

impl ZkStore {
    /// One attempt (see the module docs of `zookeeper`).
    pub(super) async fn attempt_once(
        &self,
        key: &ZkKey,
        attempt: &Attempt,
        run: &mut Run,
    ) -> Result<Attempted, ZkError> {
        let kind = attempt.kind;
        for _ in 0..ROUNDS {
            let client = self.session.client();
            // This session's values: the holder's own node, the owner's other holds.
            let now = line(&client, &key.path, |_, mine| mine).await?;
            let mine = now.find(attempt.holder.as_str());
            let before = *run.before.get_or_insert_with(|| before(&now, mine));
            if let (true, Some(at)) = (std::mem::take(&mut run.again), mine) {
                if let Some(answer) = self.settle(&client, key, &now, at, attempt, before).await? {
                    return Ok(answer);
                }
            }
            if let Some(at) = mine {
                if let Some(answer) = self.again(&client, key, &now, at, attempt).await? {
                    return Ok(answer);
                }
                continue;
            }
            if kind == Kind::Exclusive {
                let reader = holder(Kind::Shared, &attempt.owner);
                if now.holds_as(EntryKind::Read, reader.as_str()) {
                    return Ok(Attempted::UpgradeRefused);
                }
                if let Some(at) = now.my_writer() {
                    // Another request of this process holds or waits: the core queues
                    // behind it.
                    if !self.watch(&client, &key.path, &now.0[at].name).await? {
                        continue;
                    }
                    return Ok(Attempted::Held {
                        left: None,
                        queued: false,
                    });
                }
            }
            let order = now.order(attempt.owner.as_str());
            // The turn of a node created now, last in line.
            let stays = match turn(&order, None, kind) {
                Turn::Holds => false,
                Turn::Waits { .. } if keeps_place(kind) && attempt.waits.is_some() => true,
                Turn::Waits { behind } => {
                    // No node: it would leave at once.
                    if self.watch_all(&client, key, &now, &behind).await? {
                        return Ok(Attempted::Held {
                            left: None,
                            queued: false,
                        });
                    }
                    continue;
                }
            };
            if let Some(answer) = self.enter(&client, key, attempt, stays).await? {
                return Ok(answer);
            }
        }
        Err(ZkError::Contended)
    }

    /// What a lost write of an earlier run did to the holder's node at `at` (found with
    /// `before` at its first look), finished: a node created since, as a hold, is placed as
    /// one just created; a count raised by one since (the version moved on) is the hold the
    /// write took (a writer's turn from the line, or a re-entry). `None`: nothing of the
    /// kind, the attempt goes on as any other.
    async fn settle(
        &self,
        client: &Client,
        key: &ZkKey,
        now: &Line,
        at: usize,
        attempt: &Attempt,
        before: Before,
    ) -> Result<Round, ZkError> {
        let entry = &now.0[at];
        let Some((value, stat)) = &entry.value else {
            return Ok(None);
        };
        match before {
            // Created as a hold (one created to wait in line has a count of 0, which the
            // next look handles as any writer's in line).
            Before::Nothing if value.count >= 1 => {
                let node = Node {
                    path: child(&key.path, &entry.name),
                    stat: *stat,
                };
                self.placed(client, key, attempt, false, (&entry.name, node))
                    .await
            }
            Before::Node { version, count }
                if stat.version > version && value.count == count + 1 =>
            {
                let writer = count == 0;
                taken(client, &key.path, attempt.kind, stat, writer, value.count).await
            }
            _ => Ok(None),
        }
    }

    /// An attempt by a holder that has a node already: a re-entry of its hold, or the
    /// next look of a writer that waits in line.
    async fn again(
        &self,
        client: &Client,
        key: &ZkKey,
        now: &Line,
        at: usize,
        attempt: &Attempt,
    ) -> Result<Round, ZkError> {
        let entry = &now.0[at];
        let Some((mut value, stat)) = entry.value.clone() else {
            return Ok(None);
        };
        let path = child(&key.path, &entry.name);
        // A writer in line: its turn may have come.
        let in_line = value.count == 0;
        if in_line {
            let order = now.order(attempt.owner.as_str());
            if let Turn::Waits { behind } = turn(&order, now.sequence(at), attempt.kind) {
                let watched = self.watch_all(client, key, now, &behind).await?;
                return Ok(watched.then(|| held(true)).flatten());
            }
        }
        value.count += 1;
        if !write(client, &path, &value, stat.version).await? {
            return Ok(None);
        }
        taken(client, &key.path, attempt.kind, &stat, in_line, value.count).await
    }

    /// Creates the holder's node, last in line, and keeps it if its turn has come, or if
    /// it `stays` in line (a writer that waits behind shared holders); else deletes it.
    async fn enter(
        &self,
        client: &Client,
        key: &ZkKey,
        attempt: &Attempt,
        stays: bool,
    ) -> Result<Round, ZkError> {
        let Some((name, stat)) = self.create(client, &key.path, attempt, stays).await? else {
            return Ok(None);
        };
        let path = child(&key.path, &name);
        self.placed(client, key, attempt, stays, (&name, Node { path, stat }))
            .await
    }

    /// The holder's node `node`, just created (named `name`), kept if its turn has come or
    /// if it `stays` in line; else deleted.
    async fn placed(
        &self,
        client: &Client,
        key: &ZkKey,
        attempt: &Attempt,
        stays: bool,
        (name, node): (&str, Node),
    ) -> Result<Round, ZkError> {
        let (lock, kind) = (&key.path, attempt.kind);
        // A reader needs the owner's own write node, if any, to tell a downgrade; a reader
        // or a permit its session's holders, to tell its twin (below).
        let now = line(client, lock, |_, mine| mine && kind != Kind::Exclusive).await?;
        let Some(at) = now.place(name) else {
            return Ok(None);
        };
        if now.twin_before(at, attempt.holder.as_str()) {
            // Another attempt of this holder (a re-entry beside the holder's own queued
            // attempt) got its node in first: this one goes, and the next round re-enters
            // that one (or, for another request's writer, waits behind it).
            delete(client, &node.path).await?;
            return Ok(None);
        }
        match turn(&now.order(attempt.owner.as_str()), now.sequence(at), kind) {
            Turn::Holds => granted(client, lock, attempt, stays, node).await,
            Turn::Waits { behind } if keeps_place(kind) && attempt.waits.is_some() => {
                if !stays
                    && !write(client, &node.path, &waiting(attempt), node.stat.version).await?
                {
                    return Ok(None);
                }
                let watched = self.watch_all(client, key, &now, &behind).await?;
                Ok(watched.then(|| held(true)).flatten())
            }
            Turn::Waits { behind } => {
                // Another node came first: this one leaves nothing behind and waits.
                delete(client, &node.path).await?;
                let watched = self.watch_all(client, key, &now, &behind).await?;
                Ok(watched.then(|| held(false)).flatten())
            }
        }
    }

    /// Creates `attempt`'s node under `lock` (and `lock` itself if it is not there), with a
    /// count of 0 if it `stays` in line: its name and stat, or `None` when the lock's node
    /// went in between (the attempt goes round again).
    async fn create(
        &self,
        client: &Client,
        lock: &str,
        attempt: &Attempt,
        stays: bool,
    ) -> Result<Option<(String, Stat)>, ZkError> {
        // The lock's node lives while it has nodes, and goes some time after.
        let container = CreateMode::Container.with_acls(self.session.acls());
        match client.create(lock, &[], &container).await {
            Ok(_) | Err(ClientError::NodeExists) => {}
            Err(e) => return Err(e.into()),
        }
        let mut prefix = hold_prefix(client.session_id().0);
        if attempt.kind == Kind::Shared {
            prefix.push_str(READ_MARK);
        }
        // A writer in line waits with a count of 0: no hold yet.
        let value = if stays {
            waiting(attempt)
        } else {
            HoldValue::new(attempt.holder.as_str())
        };
        let hold = CreateMode::EphemeralSequential.with_acls(self.session.acls());
        match client
            .create(&child(lock, &prefix), value.encode().as_bytes(), &hold)
            .await
        {
            Ok((stat, sequence)) => Ok(Some((format!("{prefix}{sequence}"), stat))),
            // The empty container was deleted in between: again.
            Err(ClientError::NoNode) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Watches the nodes at places `behind` in `now`: `false` when one of them is gone
    /// already (the attempt goes round again).
    async fn watch_all(
        &self,
        client: &Client,
        key: &ZkKey,
        now: &Line,
        behind: &[usize],
    ) -> Result<bool, ZkError> {
        let lock: &Arc<str> = &key.path;
        for &at in behind {
            if !self.watch(client, lock, &now.0[at].name).await? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// A node just created, at its path.
struct Node {
    path: String,
    stat: Stat,
}

/// The node just created for `attempt` holds: made a hold if it was created to stay in
/// line, and the token read (a writer's recorded for the shared holders after it).
async fn granted(
    client: &Client,
    lock: &str,
    attempt: &Attempt,
    stays: bool,
    node: Node,
) -> Result<Round, ZkError> {
    let value = HoldValue::new(attempt.holder.as_str());
    if stays && !write(client, &node.path, &value, node.stat.version).await? {
        return Ok(None);
    }
    let writer = attempt.kind == Kind::Exclusive;
    taken(client, lock, attempt.kind, &node.stat, writer, 1).await
}

/// A hold of `kind` taken with `count` by the node of `stat`: its token read (a shared
/// hold's is the last writer's), and a `writer`'s token recorded for the shared holders
/// after it.
async fn taken(
    client: &Client,
    lock: &str,
    kind: Kind,
    stat: &Stat,
    writer: bool,
    count: u64,
) -> Result<Round, ZkError> {
    if writer {
        record_writer(client, lock, token(stat)).await?;
    }
    let token = match kind {
        Kind::Shared => shared_token(client, lock).await?,
        Kind::Exclusive | Kind::Permit(_) => token(stat),
    };
    Ok(Some(Attempted::Acquired { token, count }))
}

/// Whether a waiter of `kind` keeps its node in line: a writer does, so that the processes
/// waiting for an exclusive lock take it in the order they came (Curator's
/// `InterProcessMutex`), and new shared holders line up behind it (a stream of readers
/// cannot starve it).
fn keeps_place(kind: Kind) -> bool {
    kind == Kind::Exclusive
}

/// The value of `attempt`'s holder waiting in line: a count of 0, no hold yet.
fn waiting(attempt: &Attempt) -> HoldValue {
    let mut value = HoldValue::new(attempt.holder.as_str());
    value.count = 0;
    value
}

/// Deletes the node at `path`, if it is still there.
async fn delete(client: &Client, path: &str) -> Result<(), ZkError> {
    match client.delete(path, None).await {
        Ok(()) | Err(ClientError::NoNode) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Writes `value` to the node at `path` if it is still at `version`: `false` when it
/// changed or went meanwhile (the attempt goes round again).
async fn write(
    client: &Client,
    path: &str,
    value: &HoldValue,
    version: i32,
) -> Result<bool, ZkError> {
    let data = value.encode();
    match client.set_data(path, data.as_bytes(), Some(version)).await {
        Ok(_) => Ok(true),
        Err(ClientError::BadVersion | ClientError::NoNode) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// What an attempt's first look at `now` found of the holder's own node (at `mine`).
fn before(now: &Line, mine: Option<usize>) -> Before {
    match mine.and_then(|at| now.0[at].value.as_ref()) {
        Some((value, stat)) => Before::Node {
            version: stat.version,
            count: value.count,
        },
        None => Before::Nothing,
    }
}

//! A lock's nodes in line order, as one listing and one multi-read of the values asked
//! for, and the token that shared holders carry.

use zookeeper_client::{Client, Error as ClientError, MultiReadResult, Stat};

use super::error::ZkError;
use super::keys::{hold_prefix, node};
use super::store::{child, holds, token};
use crate::core::hold::value::HoldValue;
use crate::core::kit::turn::{self, EntryKind};

/// One node of a lock.
pub(super) struct Entry {
    pub(super) name: String,
    /// Its sequence number: its place in the lock's line.
    pub(super) sequence: i64,
    pub(super) kind: EntryKind,
    /// Created by this session.
    pub(super) mine: bool,
    /// Its value and stat, when read (see [`line`]).
    pub(super) value: Option<(HoldValue, Stat)>,
}

impl Entry {
    /// Whether it holds (or waits, with `count == 0`) for `holder`: read, and this
    /// session's.
    fn of(&self, holder: &str) -> bool {
        self.mine && self.value.as_ref().is_some_and(|(v, _)| v.holder == holder)
    }

    /// Whether it is a hold (not a writer still waiting).
    pub(super) fn holds(&self) -> bool {
        self.value.as_ref().is_some_and(|(v, _)| v.count > 0)
    }
}

/// A lock's nodes in line order (their sequence numbers: one counter for the lock's node,
/// whatever kind they are).
pub(super) struct Line(pub(super) Vec<Entry>);

impl Line {
    /// The place of this session's node for `holder`.
    pub(super) fn find(&self, holder: &str) -> Option<usize> {
        self.0.iter().position(|e| e.of(holder))
    }

    /// Whether this session holds a node of `kind` for `holder`.
    pub(super) fn holds_as(&self, kind: EntryKind, holder: &str) -> bool {
        self.0
            .iter()
            .any(|e| e.kind == kind && e.of(holder) && e.holds())
    }

    /// The place of a write node of this session (the one exclusive contender per process
    /// and key holds or waits with it).
    pub(super) fn my_writer(&self) -> Option<usize> {
        self.0
            .iter()
            .position(|e| e.mine && e.kind == EntryKind::Write)
    }

    /// The line as the ordering rule sees it, for an attempt by `owner`.
    pub(super) fn order(&self, owner: &str) -> Vec<turn::Entry<i64>> {
        self.0
            .iter()
            .map(|e| turn::Entry {
                order: e.sequence,
                kind: e.kind,
                own: e.kind == EntryKind::Write && e.of(owner) && e.holds(),
            })
            .collect()
    }

    /// The order of the node at place `at`, as the ordering rule takes it.
    pub(super) fn sequence(&self, at: usize) -> Option<&i64> {
        Some(&self.0[at].sequence)
    }

    /// Whether a node of the same kind as the one at `at`, of this session and of `holder`
    /// (or not read), comes before it: another attempt of the same holder.
    pub(super) fn twin_before(&self, at: usize, holder: &str) -> bool {
        let kind = self.0[at].kind;
        self.0[..at].iter().any(|e| {
            e.mine && e.kind == kind && e.value.as_ref().is_none_or(|(v, _)| v.holder == holder)
        })
    }

    /// The place of the node named `name`.
    pub(super) fn place(&self, name: &str) -> Option<usize> {
        self.0.iter().position(|e| e.name == name)
    }
}

/// Lists `lock`'s nodes in line order and reads, in one multi-read, the values of those
/// `wanted` picks (by kind and whether this session created them). A node that went
/// between the two calls is left out; a node this crate never names is ignored.
pub(super) async fn line(
    client: &Client,
    lock: &str,
    wanted: impl Fn(EntryKind, bool) -> bool,
) -> Result<Line, ZkError> {
    let mine = hold_prefix(client.session_id().0);
    let mut entries: Vec<Entry> = holds(client, lock)
        .await?
        .into_iter()
        .filter_map(|name| {
            let (kind, sequence) = node(&name)?;
            Some(Entry {
                mine: name.starts_with(&mine),
                name,
                sequence,
                kind,
                value: None,
            })
        })
        .collect();
    entries.sort_unstable_by_key(|e| e.sequence);
    let read: Vec<usize> = (0..entries.len())
        .filter(|&i| wanted(entries[i].kind, entries[i].mine))
        .collect();
    if read.is_empty() {
        return Ok(Line(entries));
    }
    let mut reads = client.new_multi_reader();
    for &i in &read {
        reads.add_get_data(&child(lock, &entries[i].name))?;
    }
    let results = reads.commit().await?;
    if results.len() != read.len() {
        return Err(ZkError::Unexpected("a multi-read of a lock's nodes"));
    }
    let mut gone = Vec::new();
    for (i, result) in read.into_iter().zip(results) {
        match result {
            MultiReadResult::Data { data, stat } => {
                let value = HoldValue::parse(&data).ok_or(ZkError::Foreign)?;
                entries[i].value = Some((value, stat));
            }
            MultiReadResult::Error {
                err: ClientError::NoNode,
            } => gone.push(i),
            MultiReadResult::Error { err } => return Err(err.into()),
            _ => return Err(ZkError::Unexpected("a multi-read of a lock's nodes")),
        }
    }
    for i in gone.into_iter().rev() {
        entries.remove(i);
    }
    Ok(Line(entries))
}

/// The token shared holders of `lock` carry: the last exclusive holder's, which every
/// writer records in the lock's node when it is granted; on a lock's node no writer was
/// granted under yet, the node's own creation zxid (above every earlier writer's token,
/// whose nodes came before it, and below every later one's).
pub(super) async fn shared_token(client: &Client, lock: &str) -> Result<u64, ZkError> {
    let (data, stat) = client.get_data(lock).await?;
    if data.is_empty() {
        return Ok(token(&stat));
    }
    std::str::from_utf8(&data)
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or(ZkError::Foreign)
}

/// Records `granted` as the last exclusive holder's token, in the lock's node.
pub(super) async fn record_writer(
    client: &Client,
    lock: &str,
    granted: u64,
) -> Result<(), ZkError> {
    client
        .set_data(lock, granted.to_string().as_bytes(), None)
        .await?;
    Ok(())
}

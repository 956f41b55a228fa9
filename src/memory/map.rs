//! The map a [`MemoryBackend`](super::MemoryBackend) keeps its locks in: one row per lock
//! or semaphore name, and the protocol's calls on it, each one step under the map's mutex
//! (as the SQL stores' functions each take their row first).
//!
//! A row keeps the exclusive holder, the holders with a lease of their own (shared holds,
//! permits, and writers waiting for shared holds to leave) and the key's fencing counter.
//! Leases are read on the map's clock (tokio's, so a test that pauses time pauses them):
//! an expired hold counts as gone at the next call that looks at it, and the core's
//! watchdog finds it lost then. Tokens come from one counter for every name, started at
//! the clock in microseconds (as a Redis token never falls below it), so a token is above
//! every token issued before it, a run's reserved ones included.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::records::Stored;
use crate::core::queue::Claim;
use crate::core::store::{Attempt, Attempted, Release, Released};
use crate::core::watchdog::Due;
use crate::lock::inspect::{LockInfo, LockMode};
use crate::lock::{Kind, LockOwner};

/// How long a free row is kept, for its last exclusive token (which shared holds carry)
/// and its counter, as Redis keeps its fencing counter by default.
const ROW_TTL: Duration = Duration::from_secs(600);

/// Every row, the records, and the token counter.
pub(super) struct Map {
    rows: HashMap<Arc<str>, Row>,
    /// Idempotency records, beside the locks they were stored under.
    pub(super) records: Stored,
    /// The next token of any name: above every token issued or reserved so far.
    next_token: u64,
    /// The size at which free rows are swept next (amortised over the inserts).
    sweep_at: usize,
}

/// One lock or semaphore name.
#[derive(Default)]
struct Row {
    exclusive: Option<Exclusive>,
    /// Holders with a lease of their own, by holder id.
    holders: HashMap<String, Holder>,
    /// The token of the last exclusive hold (shared holds carry it).
    token: u64,
    /// The highest token issued or reserved for the name.
    fence: u64,
    touched: Option<Instant>,
}

struct Exclusive {
    holder: String,
    count: u64,
    expires: Instant,
    /// Release ids of re-entries given back (a retried release is a no-op).
    undone: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Of {
    Shared,
    Permit,
    /// A writer waiting for the shared holds to leave, until the end of its wait.
    Writer,
}

struct Holder {
    of: Of,
    count: u64,
    token: u64,
    expires: Instant,
    undone: Vec<String>,
}

impl Exclusive {
    fn live(&self, now: Instant) -> bool {
        self.expires > now
    }
}

impl Row {
    fn exclusive(&self, now: Instant) -> Option<&Exclusive> {
        self.exclusive.as_ref().filter(|e| e.live(now))
    }

    /// Drops the holders of `of` whose lease ended; the ones left, and when the first and
    /// the last of their leases end.
    fn prune(&mut self, of: Of, now: Instant) -> (usize, Option<Instant>, Option<Instant>) {
        self.holders.retain(|_, h| h.of != of || h.expires > now);
        let ends = self
            .holders
            .values()
            .filter(|h| h.of == of)
            .map(|h| h.expires);
        let (mut live, mut first, mut last) = (0, None::<Instant>, None::<Instant>);
        for end in ends {
            live += 1;
            first = Some(first.map_or(end, |f| f.min(end)));
            last = Some(last.map_or(end, |l| l.max(end)));
        }
        (live, first, last)
    }

    /// One more hold of `holder`'s live hold with a lease of its own, the lease extended
    /// to `until` (never shortened): its token and count.
    fn reenter(&mut self, holder: &str, now: Instant, until: Instant) -> Option<(u64, u64)> {
        let h = self.holders.get_mut(holder).filter(|h| h.expires > now)?;
        h.count += 1;
        h.expires = h.expires.max(until);
        Some((h.token, h.count))
    }

    fn holder(&self, holder: &str, now: Instant) -> Option<&Holder> {
        self.holders.get(holder).filter(|h| h.expires > now)
    }

    fn is_held(&self, now: Instant) -> bool {
        self.exclusive(now).is_some()
            || self
                .holders
                .values()
                .any(|h| h.of != Of::Writer && h.expires > now)
    }
}

/// How long from `now` until `end`.
fn left(now: Instant, end: Instant) -> Duration {
    end.saturating_duration_since(now)
}

impl Default for Map {
    fn default() -> Self {
        Map {
            rows: HashMap::new(),
            records: Stored::default(),
            next_token: clock_micros(),
            sweep_at: 1024,
        }
    }
}

impl Map {
    fn row(&mut self, name: &Arc<str>) -> &mut Row {
        if !self.rows.contains_key(name) && self.rows.len() >= self.sweep_at {
            self.sweep();
        }
        self.rows.entry(name.clone()).or_default()
    }

    /// Drops the rows nobody holds or waits for and nobody used for [`ROW_TTL`].
    fn sweep(&mut self) {
        let now = Instant::now();
        self.rows.retain(|_, row| {
            row.exclusive(now).is_some()
                || row.holders.values().any(|h| h.expires > now)
                || row.touched.is_some_and(|t| now.duration_since(t) < ROW_TTL)
        });
        self.sweep_at = (self.rows.len() * 2).max(1024);
    }

    /// A new token for `row`, with `reserve` more set aside above it.
    fn issue(next_token: &mut u64, row: &mut Row, reserve: u64) -> u64 {
        let token = (*next_token).max(row.fence + 1);
        row.fence = token + reserve;
        *next_token = row.fence + 1;
        token
    }

    /// One attempt on `name` (see `Store::attempt`).
    pub(super) fn attempt(&mut self, name: &Arc<str>, attempt: &Attempt) -> Attempted {
        let now = Instant::now();
        match attempt.kind {
            Kind::Exclusive => self.exclusive(name, attempt, now),
            Kind::Shared => self.shared(name, attempt, now),
            Kind::Permit(permits) => self.permit(name, attempt, permits, now),
        }
    }

    fn exclusive(&mut self, name: &Arc<str>, attempt: &Attempt, now: Instant) -> Attempted {
        let holder = attempt.holder.as_str();
        let lease = now + attempt.lease;
        let mut counter = self.next_token;
        let row = self.row(name);
        if let Some(e) = row.exclusive.as_mut().filter(|e| e.live(now)) {
            if e.holder == holder {
                e.count += 1;
                e.expires = e.expires.max(lease);
                return Attempted::Acquired {
                    token: row.token,
                    count: e.count,
                };
            }
            let left = Some(left(now, e.expires));
            return Attempted::Held {
                left,
                queued: false,
            };
        }
        let (readers, first, last) = row.prune(Of::Shared, now);
        if readers > 0 {
            if row.holder(&format!("r:{holder}"), now).is_some() {
                return Attempted::UpgradeRefused;
            }
            let Some(wait) = attempt.waits.filter(|w| !w.is_zero()) else {
                let left = last.map(|end| left(now, end));
                return Attempted::Held {
                    left,
                    queued: false,
                };
            };
            let writer = row.holders.entry(holder.to_owned()).or_insert(Holder {
                of: Of::Writer,
                count: 0,
                token: 0,
                expires: now,
                undone: Vec::new(),
            });
            writer.expires = now + wait;
            let left = first.map(|end| left(now, end));
            return Attempted::Held { left, queued: true };
        }
        if row.holders.get(holder).is_some_and(|h| h.of == Of::Writer) {
            row.holders.remove(holder);
        }
        let token = Map::issue(&mut counter, row, attempt.reserve);
        row.token = token;
        row.touched = Some(now);
        row.exclusive = Some(Exclusive {
            holder: holder.to_owned(),
            count: 1,
            expires: lease,
            undone: Vec::new(),
        });
        self.next_token = counter;
        Attempted::Acquired { token, count: 1 }
    }

    fn shared(&mut self, name: &Arc<str>, attempt: &Attempt, now: Instant) -> Attempted {
        let holder = attempt.holder.as_str();
        let lease = now + attempt.lease;
        let row = self.row(name);
        if let Some((_, count)) = row.reenter(holder, now, lease) {
            let token = row.token;
            return Attempted::Acquired { token, count };
        }
        row.holders.remove(holder);
        if let Some(e) = row.exclusive(now) {
            // The writer itself holding it shared too is a downgrade: it comes in.
            if e.holder != attempt.owner.as_str() {
                let left = Some(left(now, e.expires));
                return Attempted::Held {
                    left,
                    queued: false,
                };
            }
        } else {
            let (writers, first, _) = row.prune(Of::Writer, now);
            if writers > 0 {
                let left = first.map(|end| left(now, end));
                return Attempted::Held {
                    left,
                    queued: false,
                };
            }
        }
        let token = row.token;
        row.holders
            .insert(holder.to_owned(), Holder::new(Of::Shared, token, lease));
        row.touched = Some(now);
        Attempted::Acquired { token, count: 1 }
    }

    fn permit(
        &mut self,
        name: &Arc<str>,
        attempt: &Attempt,
        permits: u32,
        now: Instant,
    ) -> Attempted {
        let holder = attempt.holder.as_str();
        let lease = now + attempt.lease;
        let mut counter = self.next_token;
        let row = self.row(name);
        if let Some((token, count)) = row.reenter(holder, now, lease) {
            return Attempted::Acquired { token, count };
        }
        let (taken, first, _) = row.prune(Of::Permit, now);
        if taken >= usize::try_from(permits).unwrap_or(usize::MAX) {
            let left = first.map(|end| left(now, end));
            return Attempted::Held {
                left,
                queued: false,
            };
        }
        let token = Map::issue(&mut counter, row, 0);
        row.holders
            .insert(holder.to_owned(), Holder::new(Of::Permit, token, lease));
        row.touched = Some(now);
        self.next_token = counter;
        Attempted::Acquired { token, count: 1 }
    }

    /// One release on `name` (see `Store::release`); `true` in the second place when the
    /// name's waiters are to be woken.
    pub(super) fn release(&mut self, name: &Arc<str>, release: &Release<'_>) -> (Released, bool) {
        let now = Instant::now();
        match release.kind {
            Kind::Exclusive => self.release_exclusive(name, release, now),
            Kind::Shared | Kind::Permit(_) => self.release_holder(name, release, now),
        }
    }

    fn release_exclusive(
        &mut self,
        name: &Arc<str>,
        release: &Release<'_>,
        now: Instant,
    ) -> (Released, bool) {
        let mut counter = self.next_token;
        let Some(row) = self.rows.get_mut(name) else {
            return (Released::NotHeld, false);
        };
        let holder = release.holder.as_str();
        let downgraded = row.holder(&format!("r:{holder}"), now).is_some();
        let Some(e) = row.exclusive.as_mut().filter(|e| e.live(now)) else {
            return (Released::NotHeld, false);
        };
        if e.undone.iter().any(|id| id == release.release_id) {
            return (Released::Remains, false);
        }
        if let Some(next) = release.successor.filter(|_| release.may_have_run)
            && e.holder == next.owner.as_str()
        {
            return (Released::HandedOver(row.token), false);
        }
        if e.holder != holder || release.only_token.is_some_and(|t| t != row.token) {
            return (Released::NotHeld, false);
        }
        if e.count > 1 {
            e.count -= 1;
            e.undone.push(release.release_id.to_owned());
            e.expires = e.expires.max(now + release.lease);
            return (Released::Remains, false);
        }
        let last = release.issued.unwrap_or(row.token);
        if let Some(next) = release.successor.filter(|_| !downgraded) {
            *e = successor(next, now);
            row.token = last + 1;
            row.fence = row.fence.max(last + 1 + release.reserve);
            row.touched = Some(now);
            counter = counter.max(row.fence + 1);
            self.next_token = counter;
            return (Released::HandedOver(last + 1), false);
        }
        row.exclusive = None;
        row.token = last;
        row.fence = row.fence.max(last);
        row.touched = Some(now);
        self.next_token = counter.max(row.fence + 1);
        (Released::Freed, true)
    }

    fn release_holder(
        &mut self,
        name: &Arc<str>,
        release: &Release<'_>,
        now: Instant,
    ) -> (Released, bool) {
        let Some(row) = self.rows.get_mut(name) else {
            return (Released::NotHeld, false);
        };
        let holder = release.holder.as_str();
        let Some(h) = row.holders.get_mut(holder) else {
            return (Released::NotHeld, false);
        };
        if h.undone.iter().any(|id| id == release.release_id) {
            return (Released::Remains, false);
        }
        if h.of == Of::Writer
            || h.expires <= now
            || release.only_token.is_some_and(|t| t != h.token)
        {
            return (Released::NotHeld, false);
        }
        if h.count > 1 {
            h.count -= 1;
            h.undone.push(release.release_id.to_owned());
            h.expires = h.expires.max(now + release.lease);
            return (Released::Remains, false);
        }
        let of = h.of;
        row.holders.remove(holder);
        row.touched = Some(now);
        if of == Of::Permit {
            return (Released::Freed, true);
        }
        let (readers, _, _) = row.prune(Of::Shared, now);
        // A downgraded writer's shared hold: its exclusive hold still keeps everyone out.
        let wake = readers == 0 && row.exclusive(now).is_none();
        (Released::Freed, wake)
    }

    /// Renews (or, with `renew == false`, checks) each hold of `batch`: whether its holder
    /// still holds it.
    pub(super) fn renew(&mut self, batch: &[Due]) -> Vec<bool> {
        let now = Instant::now();
        let renew = |expires: &mut Instant, due: &Due| {
            if due.renew {
                *expires = (*expires).max(now + due.lease);
            }
        };
        batch
            .iter()
            .map(|due| {
                let (name, holder) = (&due.key.0, due.key.1.as_str());
                let Some(row) = self.rows.get_mut(name) else {
                    return false;
                };
                if let Some(e) = row
                    .exclusive
                    .as_mut()
                    .filter(|e| e.live(now) && e.holder == holder)
                {
                    renew(&mut e.expires, due);
                    return true;
                }
                match row.holders.get_mut(holder) {
                    Some(h) if h.of != Of::Writer && h.expires > now => {
                        renew(&mut h.expires, due);
                        true
                    }
                    _ => false,
                }
            })
            .collect()
    }

    /// Withdraws `holder`'s registration as a waiting writer of `name`: whether it had one.
    pub(super) fn withdraw(&mut self, name: &Arc<str>, holder: &LockOwner) -> bool {
        let Some(row) = self.rows.get_mut(name) else {
            return false;
        };
        match row.holders.get(holder.as_str()) {
            Some(h) if h.of == Of::Writer => row.holders.remove(holder.as_str()).is_some(),
            _ => false,
        }
    }

    /// How long the exclusive holder of `name` may still hold it.
    pub(super) fn remaining(&self, name: &str) -> Option<Duration> {
        let now = Instant::now();
        let e = self.rows.get(name)?.exclusive(now)?;
        Some(left(now, e.expires))
    }

    /// A snapshot of `name` for `key`'s operator (a semaphore's if `semaphore`).
    pub(super) fn snapshot(&self, key: String, name: &str, semaphore: bool) -> LockInfo {
        let now = Instant::now();
        let Some(row) = self.rows.get(name) else {
            return LockInfo::free(key, None);
        };
        let token = Some(row.fence).filter(|&t| t > 0);
        let of = if semaphore { Of::Permit } else { Of::Shared };
        let holders: Vec<&Holder> = row
            .holders
            .values()
            .filter(|h| h.of == of && h.expires > now)
            .collect();
        let latest = holders.iter().map(|h| h.expires).max();
        let info = |mode, holders, holds, end: Option<Instant>| LockInfo {
            key: key.clone(),
            mode,
            holders,
            holds,
            lease_remaining: end.map(|end| left(now, end)),
            fencing_token: token,
        };
        let holds = |holders: &[&Holder]| {
            u32::try_from(holders.iter().map(|h| h.count).sum::<u64>()).unwrap_or(u32::MAX)
        };
        match (semaphore, row.exclusive(now)) {
            (false, Some(e)) => {
                let end = latest.map_or(e.expires, |l| l.max(e.expires));
                let count = u32::try_from(e.count).unwrap_or(u32::MAX);
                info(LockMode::Exclusive, 1, count, Some(end))
            }
            _ if !holders.is_empty() => {
                let mode = if semaphore {
                    LockMode::Permits
                } else {
                    LockMode::Shared
                };
                info(mode, holders.len(), holds(&holders), latest)
            }
            _ => LockInfo::free(key, token),
        }
    }

    /// Frees `name` whatever holds it (every permit if `semaphore`): its snapshot from
    /// before, and the holders it took the name from. Waiting writers stay registered.
    pub(super) fn force_release(
        &mut self,
        key: String,
        name: &Arc<str>,
        semaphore: bool,
    ) -> (LockInfo, Vec<LockOwner>) {
        let freed = self.snapshot(key, name, semaphore);
        let Some(row) = self.rows.get_mut(name).filter(|_| !freed.is_free()) else {
            return (freed, Vec::new());
        };
        let of = if semaphore { Of::Permit } else { Of::Shared };
        let mut holders: Vec<LockOwner> = Vec::new();
        row.holders.retain(|holder, h| {
            let taken = h.of == of;
            if taken {
                holders.push(LockOwner::new(holder.clone()));
            }
            !taken
        });
        if !semaphore && let Some(e) = row.exclusive.take() {
            holders.push(LockOwner::new(e.holder));
        }
        row.touched = Some(Instant::now());
        (freed, holders)
    }

    /// Whether the hold of `token` (or a hold passed on in memory from it: a lower token)
    /// holds `name`'s lock now.
    pub(super) fn holds(&self, name: &str, token: u64) -> bool {
        self.rows
            .get(name)
            .is_some_and(|row| row.exclusive(Instant::now()).is_some() && row.token <= token)
    }

    /// How many names are held now (locked, held shared, or with a permit taken).
    pub(super) fn held(&self) -> usize {
        let now = Instant::now();
        self.rows.values().filter(|row| row.is_held(now)).count()
    }

    /// The names of the held rows whose names start with one of `prefixes`.
    pub(super) fn held_under(&self, prefixes: &[String]) -> Vec<Arc<str>> {
        let now = Instant::now();
        let under = |name: &str| {
            prefixes
                .iter()
                .any(|prefix| name.starts_with(prefix.as_str()))
        };
        self.rows
            .iter()
            .filter(|(name, row)| under(name) && row.is_held(now))
            .map(|(name, _)| name.clone())
            .collect()
    }
}

impl Holder {
    fn new(of: Of, token: u64, expires: Instant) -> Self {
        Holder {
            of,
            count: 1,
            token,
            expires,
            undone: Vec::new(),
        }
    }
}

/// The exclusive hold of a successor a release hands the name to.
fn successor(next: &Claim, now: Instant) -> Exclusive {
    Exclusive {
        holder: next.owner.as_str().to_owned(),
        count: 1,
        expires: now + next.lease,
        undone: Vec::new(),
    }
}

/// Microseconds since the Unix epoch (1 if the clock reads earlier).
fn clock_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

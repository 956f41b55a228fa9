//! Who waits behind which key: the wake-ups of this backend's waiters, so that a deletion
//! wakes only the acquisitions it may let in (no herd).
//!
//! Each acquisition waits on a channel of its own (see `EtcdKey::channel`). A writer, or a
//! reader kept out by writers, waits behind one key (etcd's recipe: a writer behind its
//! predecessor, a reader behind the last writer before it) and is woken when that key is
//! deleted. A permit waiter waits for any permit of its semaphore: a permit's deletion
//! wakes the first of this backend's waiters in line for it, one per permit freed (each
//! backend wakes one of its own).
//!
//! A wait is recorded after the read it rests on: a deletion the watch already passed on
//! by then (the watch has seen a revision above the read's) wakes the waiter at once.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use super::keys::{Entry, is_semaphore};
use crate::core::wakeups::{Registry, Wakeups};

/// The waits of one backend's acquisitions (see the module docs).
#[derive(Default)]
pub(crate) struct Behind(Mutex<Waits>);

#[derive(Default)]
struct Waits {
    /// Etcd key -> the channels waiting behind it.
    keys: HashMap<Vec<u8>, Vec<String>>,
    /// Semaphore -> the channels in line for one of its permits, with their keys' create
    /// revisions, oldest key first (etcd's line).
    permits: HashMap<String, VecDeque<(i64, String)>>,
    /// Channel -> what it waits for (an etcd key, or a semaphore's name).
    waiting: HashMap<String, Vec<u8>>,
    /// Channels woken for a permit that have not tried again yet: one that stops waiting
    /// passes its turn on.
    woken: HashSet<String>,
    /// The highest revision of a deletion the watch passed on.
    seen: i64,
}

impl Behind {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waits> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `channel` waits behind the etcd key `key`, which a read at revision `read_at` found.
    pub(crate) fn key(&self, wakeups: &Wakeups, channel: &str, key: Vec<u8>, read_at: i64) {
        self.wait(wakeups, channel, read_at, |waits| {
            let behind = waits.keys.entry(key.clone()).or_default();
            behind.push(channel.to_owned());
            key
        });
    }

    /// `channel`, whose key in line was created at revision `place`, waits for a permit of
    /// `semaphore`, all taken at revision `read_at`.
    pub(crate) fn permit(
        &self,
        wakeups: &Wakeups,
        channel: &str,
        (semaphore, place): (&str, i64),
        read_at: i64,
    ) {
        self.wait(wakeups, channel, read_at, |waits| {
            let line = waits.permits.entry(semaphore.to_owned()).or_default();
            let at = line.partition_point(|(before, _)| *before < place);
            line.insert(at, (place, channel.to_owned()));
            semaphore.as_bytes().to_vec()
        });
    }

    /// Records what `channel` waits for (`record` files it and says what it is), unless a
    /// deletion after `read_at` was passed on already: then it tries again at once.
    fn wait(
        &self,
        wakeups: &Wakeups,
        channel: &str,
        read_at: i64,
        record: impl FnOnce(&mut Waits) -> Vec<u8>,
    ) {
        let registry = wakeups.registry();
        let mut waits = self.lock();
        waits.forget(channel);
        if waits.seen > read_at {
            // What it waits for may be gone already, its deletion passed on.
            registry.wake_channel(channel);
            return;
        }
        let what = record(&mut waits);
        waits.waiting.insert(channel.to_owned(), what);
    }

    /// `channel` tries again (or got what it waited for): it waits for nothing now.
    pub(crate) fn tried(&self, channel: &str) {
        let mut waits = self.lock();
        waits.forget(channel);
        waits.woken.remove(channel);
    }

    /// `channel` stops waiting: a permit's turn it was woken for goes to the next in line.
    pub(crate) fn withdraw(&self, wakeups: &Wakeups, channel: &str, semaphore: &str) {
        let registry = wakeups.registry();
        let mut waits = self.lock();
        waits.forget(channel);
        if waits.woken.remove(channel) {
            waits.wake_next(&registry, semaphore);
        }
    }

    /// The watch passed on the deletion of `key` at `revision` (the registry locked).
    pub(crate) fn deleted(&self, registry: &Registry, key: &[u8], revision: i64) {
        let mut waits = self.lock();
        waits.seen = waits.seen.max(revision);
        if let Some(channels) = waits.keys.remove(key) {
            for channel in channels {
                waits.waiting.remove(&channel);
                registry.wake_channel(&channel);
            }
        }
        if Entry::of(key) == Some(Entry::Permit) {
            let semaphore = key
                .iter()
                .rposition(|&b| b == b'/')
                .and_then(|at| std::str::from_utf8(&key[..at]).ok())
                .filter(|name| is_semaphore(name));
            if let Some(semaphore) = semaphore {
                waits.wake_next(registry, semaphore);
            }
        }
    }

    /// The watch (re)opened at `revision`: deletions before it may have been missed (its
    /// waiters were all woken).
    pub(crate) fn opened(&self, revision: i64) {
        let mut waits = self.lock();
        waits.seen = waits.seen.max(revision);
    }

    /// How many channels wait behind keys or for permits (for tests and stats).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().waiting.len()
    }
}

impl Waits {
    /// Takes `channel` out of what it waited for.
    fn forget(&mut self, channel: &str) {
        let Some(what) = self.waiting.remove(channel) else {
            return;
        };
        if let Some(channels) = self.keys.get_mut(&what) {
            channels.retain(|c| c != channel);
            if channels.is_empty() {
                self.keys.remove(&what);
            }
        }
        if let Ok(semaphore) = std::str::from_utf8(&what)
            && let Some(line) = self.permits.get_mut(semaphore)
        {
            line.retain(|(_, c)| c != channel);
            if line.is_empty() {
                self.permits.remove(semaphore);
            }
        }
    }

    /// Wakes the first channel in line for `semaphore` that still has a waiter.
    fn wake_next(&mut self, registry: &Registry, semaphore: &str) {
        let Some(line) = self.permits.get_mut(semaphore) else {
            return;
        };
        while let Some((_, channel)) = line.pop_front() {
            self.waiting.remove(&channel);
            if registry.has_waiters(&channel) {
                registry.wake_channel(&channel);
                self.woken.insert(channel);
                break;
            }
        }
        if line.is_empty() {
            self.permits.remove(semaphore);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::Namespace;

    #[test]
    fn a_deletion_wakes_only_what_waits_behind_it() {
        let wakeups = Wakeups::new(Namespace::new("test"));
        let behind = Behind::default();
        let (a, b) = (wakeups.register("a"), wakeups.register("b"));
        behind.key(&wakeups, "a", b"k/h1".to_vec(), 10);
        behind.key(&wakeups, "b", b"k/h2".to_vec(), 10);
        behind.deleted(&wakeups.registry(), b"k/h1", 11);
        assert!(futures_util::FutureExt::now_or_never(a.woken()).is_some());
        assert!(futures_util::FutureExt::now_or_never(b.woken()).is_none());
        // A wait resting on a read older than a deletion passed on wakes at once.
        behind.key(&wakeups, "b", b"k/h3".to_vec(), 10);
        assert!(futures_util::FutureExt::now_or_never(b.woken()).is_some());
        // Neither is left waiting behind anything.
        assert_eq!(behind.len(), 0);
    }

    #[test]
    fn a_freed_permit_wakes_one_waiter_and_a_withdrawn_one_passes_it_on() {
        let wakeups = Wakeups::new(Namespace::new("test"));
        let behind = Behind::default();
        let (a, b) = (wakeups.register("a"), wakeups.register("b"));
        // In line by their keys' age, not by when they said so.
        behind.permit(&wakeups, "b", ("s:permits", 9), 10);
        behind.permit(&wakeups, "a", ("s:permits", 8), 10);
        behind.deleted(&wakeups.registry(), b"s:permits/p1x", 11);
        assert!(futures_util::FutureExt::now_or_never(a.woken()).is_some());
        assert!(futures_util::FutureExt::now_or_never(b.woken()).is_none());
        behind.withdraw(&wakeups, "a", "s:permits");
        assert!(futures_util::FutureExt::now_or_never(b.woken()).is_some());
    }
}

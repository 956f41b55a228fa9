//! One waiting contender per semaphore per process: the permit waiters' line.
//!
//! Permits admit several holders at once, so their tasks do not line up behind one slot
//! per key as locks do: each takes its permit in the store. But a task whose first attempt
//! found every permit taken and that will wait goes through its key's gate, in FIFO order:
//! only the task through the gate waits in the store (subscribed, woken by releases, trying
//! again), and it leaves the gate as soon as it holds a permit or stops waiting. So a
//! release wakes one waiter per process instead of every waiting task of every process,
//! all of them trying again for the one permit freed (the herd).
//!
//! The gate is taken only after a first attempt was refused, never while holding: a
//! holder's re-entry of its permit succeeds at its first attempt, so it never waits behind
//! a contender that waits for that very permit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::OwnedMutexGuard;
use tokio::time::{Instant, timeout_at};

/// The gates of the semaphores with a waiting task in this process.
#[derive(Clone, Default)]
pub(crate) struct Gates {
    gates: Arc<Mutex<HashMap<Arc<str>, Arc<Gate>>>>,
}

#[derive(Default)]
struct Gate {
    /// Held by the task that waits in the store; tokio's mutex serves in FIFO order.
    through: Arc<tokio::sync::Mutex<()>>,
    /// Tasks waiting for `through`.
    queued: AtomicUsize,
}

/// A task's passage through a gate: while it lives, the other waiting tasks of the process
/// wait behind it. Dropped when its task holds a permit or stops waiting; the last task of
/// a gate removes it.
pub(crate) struct Passage {
    _through: OwnedMutexGuard<()>,
    _entry: Entry,
}

/// A task's share of its gate's entry in the map.
struct Entry {
    gates: Arc<Mutex<HashMap<Arc<str>, Arc<Gate>>>>,
    key: Arc<str>,
    gate: Arc<Gate>,
}

impl Gates {
    /// Passes `key`'s gate, after the tasks that came to it before, by `deadline`; `None`
    /// when the deadline came first.
    pub(crate) async fn pass(&self, key: &Arc<str>, deadline: Instant) -> Option<Passage> {
        let entry = {
            let mut gates = lock(&self.gates);
            let gate = gates.entry(key.clone()).or_default().clone();
            Entry {
                gates: self.gates.clone(),
                key: key.clone(),
                gate,
            }
        };
        entry.gate.queued.fetch_add(1, Ordering::Relaxed);
        let through = timeout_at(deadline, entry.gate.through.clone().lock_owned()).await;
        entry.gate.queued.fetch_sub(1, Ordering::Relaxed);
        Some(Passage {
            _through: through.ok()?,
            _entry: entry,
        })
    }

    /// Tasks waiting behind another task of this process for a permit of the same key.
    pub(crate) fn waiting(&self) -> usize {
        lock(&self.gates)
            .values()
            .map(|gate| gate.queued.load(Ordering::Relaxed))
            .sum()
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let mut gates = lock(&self.gates);
        // The map's reference and this one: nobody else waits at or passes the gate.
        if Arc::strong_count(&self.gate) == 2 {
            gates.remove(&self.key);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The map is consistent after every statement: a panic elsewhere cannot corrupt it.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

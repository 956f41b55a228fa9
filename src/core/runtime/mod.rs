//! Where a backend's tasks run, and its long-lived tasks (a store's listener, the
//! watchdog), started again on the caller's runtime when the runtime they ran on is gone.
//!
//! A backend may outlive the runtime it was built or first used in: a `static` shared by
//! `#[tokio::test]`s belongs to the first test's runtime, which is shut down when that
//! test ends. So every task is spawned on the caller's runtime when there is one, and on
//! the remembered runtime only when the caller runs outside any (a guard dropped in plain
//! code).

#[cfg(any(feature = "postgres", feature = "mysql", feature = "zookeeper"))]
pub(crate) mod janitor;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::runtime::Handle;

use tokio_util::sync::{CancellationToken, DropGuard};

type Start =
    Box<dyn Fn(CancellationToken) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// A task that runs until `shutdown`, and is started again on the caller's runtime by
/// [`ensure_running`](Self::ensure_running) if the runtime it ran on dropped it.
pub(crate) struct Daemon {
    start: Start,
    spawner: Spawner,
    shutdown: CancellationToken,
    /// Cleared when the running instance's future is dropped, finished or not.
    running: Arc<AtomicBool>,
}

/// Clears its flag when dropped with the task's future.
struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Whether the runtime it was created on still runs: a task parked on that runtime clears
/// it when the runtime drops the task. Dropping this ends the task.
pub(crate) struct RuntimeAlive {
    alive: Arc<AtomicBool>,
    _stop: DropGuard,
}

impl RuntimeAlive {
    /// Watches the current runtime. Must be called inside one.
    pub(crate) fn here() -> Self {
        let alive = Arc::new(AtomicBool::new(true));
        let stop = CancellationToken::new();
        let parked = (Running(alive.clone()), stop.clone());
        tokio::spawn(async move {
            let (_running, stop) = parked;
            stop.cancelled().await;
        });
        RuntimeAlive {
            alive,
            _stop: stop.drop_guard(),
        }
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

impl Daemon {
    /// Spawns `start(shutdown)` now and whenever [`ensure_running`](Self::ensure_running)
    /// finds it gone before `shutdown`.
    pub(crate) fn spawn<F, Fut>(start: F, spawner: &Spawner, shutdown: CancellationToken) -> Self
    where
        F: Fn(CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let daemon = Daemon {
            start: Box::new(move |shutdown| Box::pin(start(shutdown))),
            spawner: spawner.clone(),
            shutdown,
            running: Arc::new(AtomicBool::new(false)),
        };
        daemon.ensure_running();
        daemon
    }

    /// Starts the task again if the runtime it ran on has shut down.
    pub(crate) fn ensure_running(&self) {
        // Only the instance that cleared the flag is gone, so one caller wins the restart.
        if self.shutdown.is_cancelled()
            || self
                .running
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return;
        }
        // Made outside the task, so a task dropped before its first poll clears it too.
        let running = Running(self.running.clone());
        let task = (self.start)(self.shutdown.clone());
        self.spawner.spawn(async move {
            let _running = running;
            task.await;
        });
    }
}

/// Spawns on the caller's runtime, or outside any runtime on the one it remembers.
#[derive(Clone, Debug, Default)]
pub(crate) struct Spawner {
    remembered: OnceLock<Handle>,
}

impl Spawner {
    /// Remembers the current runtime. Panics outside a runtime, as a backend builder's `build`
    /// is documented to.
    pub(crate) fn current() -> Self {
        let spawner = Spawner::default();
        spawner.remembered.get_or_init(Handle::current);
        spawner
    }

    /// Remembers the caller's runtime, if it runs in one and none is remembered yet.
    pub(crate) fn remember_current(&self) {
        if self.remembered.get().is_none()
            && let Ok(current) = Handle::try_current()
        {
            self.remembered.get_or_init(|| current);
        }
    }

    /// Spawns `future`; outside any runtime and with none remembered, it is dropped unrun.
    pub(crate) fn spawn<F>(&self, future: F)
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match Handle::try_current() {
            Ok(current) => drop(current.spawn(future)),
            Err(_) => {
                if let Some(remembered) = self.remembered.get() {
                    drop(remembered.spawn(future));
                }
            }
        }
    }
}

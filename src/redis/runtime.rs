//! The backend's long-lived tasks (subscriber, watchdog), started again on the caller's
//! runtime when the runtime they ran on is gone (see `src/spawner.rs` for why a backend
//! outlives runtimes).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::{CancellationToken, DropGuard};

pub(crate) use crate::spawner::Spawner;

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

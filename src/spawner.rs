//! Where a backend's background tasks run.
//!
//! A backend may outlive the runtime it was built or first used in: a `static` shared by
//! `#[tokio::test]`s belongs to the first test's runtime, which is shut down when that
//! test ends. So every task is spawned on the caller's runtime when there is one, and on
//! the remembered runtime only when the caller runs outside any (a guard dropped in plain
//! code).

use std::future::Future;
use std::sync::OnceLock;

use tokio::runtime::Handle;

/// Spawns on the caller's runtime, or outside any runtime on the one it remembers.
#[derive(Clone, Debug, Default)]
pub(crate) struct Spawner {
    remembered: OnceLock<Handle>,
}

impl Spawner {
    /// Remembers the current runtime. Panics outside a runtime, as `RedisBackendBuilder::build`
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

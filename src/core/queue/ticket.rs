//! A task's place in its key's queue.

use std::sync::Arc;

use tokio::sync::oneshot;

use super::{Grant, Shared};

/// A place in a key's queue. Dropping it leaves the queue; a grant that arrived meanwhile
/// is passed on, not lost.
pub(crate) struct Ticket {
    pub(super) shared: Arc<Shared>,
    pub(super) key: Arc<str>,
    pub(super) id: u64,
    pub(super) granted: oneshot::Receiver<Grant>,
}

impl Ticket {
    /// Resolves when the task's turn comes. `None` if its grant was dropped unsent (the
    /// runtime is shutting down); the caller may queue again.
    pub(super) async fn granted(&mut self) -> Option<Grant> {
        (&mut self.granted).await.ok()
    }

    /// A grant that has already arrived, if any.
    pub(super) fn try_granted(&mut self) -> Option<Grant> {
        self.granted.try_recv().ok()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.granted.close();
        match self.granted.try_recv() {
            // Dropping a grant passes it on: a slot to the next task, a guard by releasing.
            Ok(grant) => drop(grant),
            Err(_) => {
                if let Some(queue) = self.shared.keys().get_mut(&self.key) {
                    queue.waiting.retain(|s| s.id != self.id);
                }
            }
        }
    }
}

//! Wake-ups: a watch on the holder's node, one per process and node, whose firing wakes
//! the lock's waiters in this process.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use zookeeper_client::Client;

use super::error::ZkError;
use super::store::{ZkStore, child};

impl ZkStore {
    fn guard(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        // A set of strings, updated in single calls: a poisoned lock is still consistent.
        self.watched.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Watches the hold node `holder` of `lock` for its deletion, which wakes the lock's
    /// waiters in this process: `false` when the node is already gone. One watch per node:
    /// a second attempt that finds the same holder relies on the first's.
    pub(super) async fn watch(
        &self,
        client: &Client,
        lock: &Arc<str>,
        holder: &str,
    ) -> Result<bool, ZkError> {
        let path = child(lock, holder);
        if self.guard().contains(&path) {
            return Ok(true);
        }
        let (stat, watcher) = client.check_and_watch_stat(&path).await?;
        if stat.is_none() {
            return Ok(false);
        }
        if !self.guard().insert(path.clone()) {
            return Ok(true);
        }
        let (wakeups, lock, watched) = (
            self.listener.wakeups().clone(),
            lock.clone(),
            self.watched.clone(),
        );
        tokio::spawn(async move {
            // Unwatched when the task ends however (its runtime may go away), so that a
            // later attempt sets a watch of its own.
            let _unwatch = Unwatch(watched, path);
            // Deleted, or the session's end: either way the waiters try again.
            watcher.changed().await;
            wakeups.registry().wake_channel(&lock);
        });
        Ok(true)
    }
}

/// Takes a node off the watched set when its watch's task ends.
struct Unwatch(Arc<Mutex<HashSet<String>>>, String);

impl Drop for Unwatch {
    fn drop(&mut self) {
        let mut watched = self.0.lock().unwrap_or_else(|e| e.into_inner());
        watched.remove(&self.1);
    }
}

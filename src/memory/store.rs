//! The memory store as the core's [`Store`]: each call is one step on the [`Map`] under
//! its mutex, taken when the call's future is first polled (lazy, as futures are) and
//! answered at once; a release wakes the name's waiters in the same step, and
//! a force-release fires its holders' `lost()` before it returns (every holder of the map
//! is a task of this process, watched by this backend's watchdog).

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use super::map::Map;
use crate::core::kit::keys::{KeyName, Naming};
use crate::core::store::{
    Answers, Attempt, Capabilities, Failure, HeldPage, Release, Released, Sent, Store, StoreKey,
};
use crate::core::wakeups::{Waiter, Wakeups};
use crate::core::watchdog::recheck::Recheck;
use crate::core::watchdog::{Due, Watchdog};
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, Kind};

/// Locks in this process's memory.
pub(crate) struct MemoryStore {
    map: Mutex<Map>,
    wakeups: Wakeups,
    /// The backend's watchdog: a force-release tells it which holds it took.
    watchdog: Watchdog,
    /// Raised by a force-release, so that holds passed on in memory are checked too.
    recheck: Recheck,
    max_key_len: usize,
}

/// The names of one key in the map: its lock's and its semaphore's are apart.
pub(crate) struct MemoryKey {
    user: String,
    name: Arc<str>,
}

impl MemoryKey {
    fn new(user: String, semaphore: bool, max_key_len: usize) -> Result<Self, LockError> {
        let KeyName { user, name } = KeyName::new(&InMap, user, max_key_len, semaphore)?;
        Ok(MemoryKey {
            user,
            name: name.into(),
        })
    }

    /// The name of `user`'s lock in the map.
    pub(super) fn lock_name(user: &str) -> String {
        InMap.lock(user)
    }
}

/// The map's naming: `lock:<key>` and `permits:<key>`, one-to-one with no escaping (a
/// listing matches a name's beginning, which holds the key's beginning as it is).
struct InMap;

impl InMap {
    /// The key and primitive a name of the map is of.
    fn user(name: &str) -> Option<(String, Primitive)> {
        let (of, user) = name.split_once(':')?;
        let of = match of {
            "lock" => Primitive::Lock,
            "permits" => Primitive::Semaphore,
            _ => return None,
        };
        Some((user.to_owned(), of))
    }
}

impl Naming for InMap {
    fn lock(&self, user: &str) -> String {
        format!("lock:{user}")
    }

    fn semaphore(&self, user: &str) -> String {
        format!("permits:{user}")
    }
}

impl StoreKey for MemoryKey {
    fn user(&self) -> &str {
        &self.user
    }

    fn lock(&self) -> &Arc<str> {
        &self.name
    }
}

/// A memory store's calls never fail.
#[derive(Debug)]
pub(crate) enum Never {}

impl fmt::Display for Never {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {}
    }
}

impl std::error::Error for Never {}

impl Failure for Never {
    fn may_have_run(&self) -> bool {
        match *self {}
    }

    fn is_transient(&self) -> bool {
        match *self {}
    }

    fn is_foreign(&self) -> bool {
        match *self {}
    }
}

impl MemoryStore {
    pub(crate) fn new(
        wakeups: Wakeups,
        watchdog: Watchdog,
        recheck: Recheck,
        max_key_len: usize,
    ) -> Self {
        MemoryStore {
            map: Mutex::default(),
            wakeups,
            watchdog,
            recheck,
            max_key_len,
        }
    }

    pub(super) fn map(&self) -> MutexGuard<'_, Map> {
        // Nothing under this lock can panic half-way through an update.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An operator's call on `user`'s lock or semaphore, run when first polled: `call`
    /// with the key's names and whether it is the semaphore.
    fn operator(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
        call: impl FnOnce(&MemoryStore, MemoryKey, bool) -> LockInfo + Send + 'static,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let store = self.clone();
        Box::pin(async move {
            let semaphore = of == Primitive::Semaphore;
            let key = MemoryKey::new(user, semaphore, store.max_key_len)?;
            Ok(call(&store, key, semaphore))
        })
    }
}

impl Store for MemoryStore {
    type Key = MemoryKey;
    type Error = Never;
    type Sent = ();

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            answers: Answers::AtOnce,
            ..Capabilities::default()
        }
    }

    fn key(&self, user: String, kind: Kind) -> Result<MemoryKey, LockError> {
        MemoryKey::new(user, matches!(kind, Kind::Permit(_)), self.max_key_len)
    }

    fn attempt(
        self: &Arc<Self>,
        key: &Arc<MemoryKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>> {
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move { (Ok(store.map().attempt(&key.name, &attempt)), None) })
    }

    fn release<'a>(
        &'a self,
        key: &'a MemoryKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, Never>> {
        Box::pin(async move {
            let (released, wake) = self.map().release(&key.name, release);
            if wake {
                self.wakeups.registry().wake_channel(&key.name);
            }
            Ok(released)
        })
    }

    fn release_after<'a>(
        &'a self,
        key: &'a MemoryKey,
        release: &'a Release<'a>,
        (): (),
    ) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.release(key, release).await.is_ok() })
    }

    fn renew<'a>(&'a self, batch: &'a [Due]) -> BoxFuture<'a, Result<Vec<bool>, Never>> {
        Box::pin(async move { Ok(self.map().renew(batch)) })
    }

    fn subscribe(&self, key: &MemoryKey) -> Waiter {
        self.wakeups.register_confirmed(&key.name)
    }

    fn remaining(
        self: &Arc<Self>,
        key: &Arc<MemoryKey>,
    ) -> BoxFuture<'static, Option<std::time::Duration>> {
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move { store.map().remaining(&key.name) })
    }

    fn withdraw_writer(
        self: &Arc<Self>,
        key: &Arc<MemoryKey>,
        holder: crate::lock::LockOwner,
        wake: bool,
    ) -> BoxFuture<'static, ()> {
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            if store.map().withdraw(&key.name, &holder) && wake {
                store.wakeups.registry().wake_channel(&key.name);
            }
        })
    }

    fn inspect(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        self.operator(user, of, |store, key, semaphore| {
            store.map().snapshot(key.user, &key.name, semaphore)
        })
    }

    fn held_page(
        self: &Arc<Self>,
        prefix: Arc<str>,
        _from: Option<String>,
    ) -> BoxFuture<'static, Result<HeldPage, LockError>> {
        // One page: the map is in this process, and a look at it is one step under its
        // mutex.
        let store = self.clone();
        Box::pin(async move {
            let (lock, semaphore) = (InMap.lock(&prefix), InMap.semaphore(&prefix));
            let names = store.map().held_under(&[lock, semaphore]);
            let keys = names.iter().filter_map(|name| InMap::user(name)).collect();
            Ok(HeldPage { keys, next: None })
        })
    }

    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        self.operator(user, of, |store, key, semaphore| {
            let (freed, holders) = store.map().force_release(key.user, &key.name, semaphore);
            if !holders.is_empty() {
                store.wakeups.registry().wake_channel(&key.name);
                for holder in &holders {
                    store.watchdog.lose(&key.name, holder);
                }
                store.recheck.raise("a lock was force-released");
            }
            freed
        })
    }
}

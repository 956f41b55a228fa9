//! The Redis names of one user key: the lock hash, its fencing counter and its channel
//! (and the same for the key's semaphore, a primitive of its own).

use std::sync::Arc;

use crate::core::kit::keys::{KeyName, Namespaced};
use crate::error::KeyError;

/// The Redis names that belong to one user key.
///
/// The user key is escaped and wrapped in a hash tag, `namespace:{key}`, so the lock hash,
/// its fencing counter and its release channel always hash to one cluster slot, and no
/// user input can close the tag early or reach outside the namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LockKey {
    /// The key as the application gave it (for errors, spans and `HeldLock::key`).
    pub(crate) user: String,
    /// The lock hash: `owner -> reentry count`, plus the token field and the ids of
    /// acquisition attempts and undone re-entries (see acquire.lua and release.lua).
    pub(crate) lock: Arc<str>,
    /// The fencing counter, kept apart from the lock so tokens survive its deletion.
    pub(crate) fence: String,
    /// The channel a release is published on.
    pub(crate) channel: String,
}

impl LockKey {
    pub(crate) fn new(namespace: &str, user: String, max_len: usize) -> Result<Self, KeyError> {
        let names = KeyName::new(&Namespaced(namespace), user, max_len, false)?;
        Ok(Self::named(names))
    }

    /// The names of `user`'s semaphore (see permit_acquire.lua): a hash, counter and
    /// channel of their own, in the same hash slot as the lock's.
    pub(crate) fn semaphore(
        namespace: &str,
        user: String,
        max_len: usize,
    ) -> Result<Self, KeyError> {
        let names = KeyName::new(&Namespaced(namespace), user, max_len, true)?;
        Ok(Self::named(names))
    }

    /// The sorted set of writers waiting for the lock's shared holders to leave (see
    /// shared_acquire.lua).
    pub(crate) fn writers(&self) -> String {
        format!("{}:writers", self.lock)
    }

    /// The line of holders waiting for the lock, in the order they began waiting, and the
    /// time up to which each is known to wait (see line.lua).
    pub(crate) fn line(&self) -> [String; 2] {
        [
            format!("{}:line", self.lock),
            format!("{}:line:until", self.lock),
        ]
    }

    /// The serial of each instance's latest release of the lock, on a cluster (see
    /// release.lua and acquire.lua), beside the lock in its hash slot.
    pub(crate) fn releases(&self) -> String {
        format!("{}:releases", self.lock)
    }

    /// The key's idempotency record (see record_store.lua), beside the lock in its hash
    /// slot.
    pub(crate) fn record(&self) -> String {
        format!("{}:record", self.lock)
    }

    fn named(names: KeyName) -> Self {
        let KeyName { user, name: tagged } = names;
        LockKey {
            fence: format!("{tagged}:fence"),
            channel: format!("{tagged}:released"),
            lock: tagged.into(),
            user,
        }
    }
}

/// The namespace's admin channel: a force-release is announced there, and every backend's
/// subscriber listens, so that holders of the namespace re-check their locks at once.
///
/// It has the shape of a release channel (`namespace:{..}:released`, so the channel rights
/// that cover those cover it) under a tag no user key can have: an escaped key has a `%`
/// only before `25`, `7B` or `7D`.
pub(crate) fn admin_channel(namespace: &str) -> String {
    format!("{namespace}:{{%admin}}:released")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_and_its_semaphore_keep_their_names_in_one_hash_slot() {
        let key = LockKey::new("ns", "a{b}%".into(), 64).unwrap();
        assert_eq!(&*key.lock, "ns:{a%7Bb%7D%25}");
        assert_eq!(key.fence, "ns:{a%7Bb%7D%25}:fence");
        assert_eq!(key.channel, "ns:{a%7Bb%7D%25}:released");
        assert_eq!(key.user, "a{b}%");
        let semaphore = LockKey::semaphore("ns", "a".into(), 64).unwrap();
        assert_eq!(&*semaphore.lock, "ns:{a}:permits");
        assert_eq!(semaphore.fence, "ns:{a}:permits:fence");
        assert_eq!(semaphore.channel, "ns:{a}:permits:released");
        assert_eq!(semaphore.record(), "ns:{a}:permits:record");
        assert!(matches!(
            LockKey::semaphore("ns", String::new(), 64),
            Err(KeyError::Empty)
        ));
    }
}

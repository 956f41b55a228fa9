//! The Lua scripts, compiled into the binary and run through EVALSHA.
//!
//! `redis::Script` sends EVALSHA and, on NOSCRIPT (a restarted or flushed server), loads
//! the script and retries once, so a script is shipped over the wire only when needed.
//! Lua has no includes: the helpers the scripts share (`lease.lua`: extend a lease, never
//! shorten it; `token.lua`: the next fencing token; `guard.lua`: the restart guard;
//! `holders.lua`: holders with a lease of their own; `snapshot.lua`: what an operator sees
//! of a key) are prepended at compile time.

use redis::Script;

/// The scripts of the lock protocol and the fenced store; see the header of each `.lua` file.
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) renew: Script,
    pub(crate) fence: Script,
    /// Shared holds of a read/write lock (the exclusive side is `acquire` and `release`).
    pub(crate) shared_acquire: Script,
    pub(crate) shared_release: Script,
    /// Semaphore permits.
    pub(crate) permit_acquire: Script,
    pub(crate) permit_release: Script,
    /// The operator's calls: a snapshot of a key, and freeing it by force (not loaded at
    /// build: a user that may lock need not be allowed these).
    pub(crate) inspect: Script,
    pub(crate) force_release: Script,
    /// Whether releases publish on sharded pub/sub (`SPUBLISH`, a Redis Cluster) rather
    /// than `PUBLISH`, which a cluster broadcasts to every node (Redisson #3349) and which
    /// Redis before 7 needs.
    pub(crate) sharded: bool,
}

/// A script with the shared helpers before it.
macro_rules! script {
    ($($file:literal),+) => {
        Script::new(concat!(
            include_str!("lease.lua"),
            include_str!("holders.lua"),
            $(include_str!($file)),+
        ))
    };
}

impl Scripts {
    pub(crate) fn new(sharded: bool) -> Self {
        Scripts {
            acquire: script!("token.lua", "guard.lua", "acquire.lua"),
            release: script!("token.lua", "release.lua"),
            renew: script!("renew.lua"),
            fence: Script::new(include_str!("fence.lua")),
            shared_acquire: script!("guard.lua", "shared_acquire.lua"),
            shared_release: script!("shared_release.lua"),
            permit_acquire: script!("token.lua", "guard.lua", "permit_acquire.lua"),
            permit_release: script!("permit_release.lua"),
            inspect: script!("snapshot.lua", "inspect.lua"),
            force_release: script!("snapshot.lua", "force_release.lua"),
            sharded,
        }
    }

    pub(crate) fn all(&self) -> [&Script; 8] {
        [
            &self.acquire,
            &self.release,
            &self.renew,
            &self.fence,
            &self.shared_acquire,
            &self.shared_release,
            &self.permit_acquire,
            &self.permit_release,
        ]
    }
}

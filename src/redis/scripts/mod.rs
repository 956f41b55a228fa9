//! The Lua scripts, compiled into the binary and run through EVALSHA.
//!
//! `redis::Script` sends EVALSHA and, on NOSCRIPT (a restarted or flushed server), loads
//! the script and retries once, so a script is shipped over the wire only when needed.
//! Lua has no includes: the helpers the scripts share (`lease.lua`: extend a lease, never
//! shorten it; `token.lua`: the next fencing token; `guard.lua`: the restart guard;
//! `holders.lua`: holders with a lease of their own) are prepended at compile time.

pub(crate) mod release_call;

use std::time::Duration;

use redis::Script;

use crate::lock::MAX_DURATION;

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

/// `d` as the milliseconds of a `PEXPIRE` or `SET .. PX`: at least 1 (Redis refuses 0)
/// and at most [`MAX_DURATION`], since Redis refuses a deadline past its 64-bit clock
/// ("value is not an integer or out of range", once on every acquisition).
pub(crate) fn millis(d: Duration) -> u64 {
    let ms = d.clamp(Duration::from_millis(1), MAX_DURATION).as_millis();
    u64::try_from(ms).unwrap_or(u64::MAX)
}

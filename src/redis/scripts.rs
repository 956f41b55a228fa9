//! The Lua scripts, compiled into the binary and run through EVALSHA.
//!
//! `redis::Script` sends EVALSHA and, on NOSCRIPT (a restarted or flushed server), loads
//! the script and retries once, so a script is shipped over the wire only when needed.
//! Lua has no includes: the helpers the scripts share (`lease.lua`: extend a lease, never
//! shorten it; `token.lua`: the next fencing token) are prepended at compile time.

use redis::Script;

/// The scripts of the lock protocol and the fenced store; see the header of each `.lua` file.
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) renew: Script,
    pub(crate) fence: Script,
    /// Whether releases publish on sharded pub/sub (`SPUBLISH`, a Redis Cluster) rather
    /// than `PUBLISH`, which a cluster broadcasts to every node (Redisson #3349) and which
    /// Redis before 7 needs.
    pub(crate) sharded: bool,
}

impl Scripts {
    pub(crate) fn new(sharded: bool) -> Self {
        Scripts {
            acquire: Script::new(concat!(
                include_str!("lease.lua"),
                include_str!("token.lua"),
                include_str!("acquire.lua")
            )),
            release: Script::new(concat!(
                include_str!("lease.lua"),
                include_str!("token.lua"),
                include_str!("release.lua")
            )),
            renew: Script::new(concat!(
                include_str!("lease.lua"),
                include_str!("renew.lua")
            )),
            fence: Script::new(include_str!("fence.lua")),
            sharded,
        }
    }

    pub(crate) fn all(&self) -> [&Script; 4] {
        [&self.acquire, &self.release, &self.renew, &self.fence]
    }
}

//! The Lua scripts, compiled into the binary and run through EVALSHA.
//!
//! `redis::Script` sends EVALSHA and, on NOSCRIPT (a restarted or flushed server), loads
//! the script and retries once, so a script is shipped over the wire only when needed.
//! Lua has no includes: the token logic shared by acquire and release (`fence.lua`) is
//! prepended to both at compile time.

use redis::Script;

/// The three scripts of the lock protocol; see the header of each `.lua` file.
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) renew: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Scripts {
            acquire: Script::new(concat!(
                include_str!("fence.lua"),
                include_str!("acquire.lua")
            )),
            release: Script::new(concat!(
                include_str!("fence.lua"),
                include_str!("release.lua")
            )),
            renew: Script::new(include_str!("renew.lua")),
        }
    }

    pub(crate) fn all(&self) -> [&Script; 3] {
        [&self.acquire, &self.release, &self.renew]
    }
}

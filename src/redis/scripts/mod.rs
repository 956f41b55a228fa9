//! The Lua scripts, compiled into the binary and run through EVALSHA.
//!
//! `redis::Script` sends EVALSHA and, on NOSCRIPT (a restarted or flushed server), loads
//! the script and retries once, so a script is shipped over the wire only when needed.
//!
//! The scripts by what they do: `lock/` (acquire, release, renew), `shared/` (read
//! holds), `permits/` (semaphores), `operator/` (inspect, force-release), `writes/` (writes
//! guarded by a hold's token: `FencedStore`, idempotency records, a quorum's token
//! write-back), and `helpers/`. Lua has no includes: the helpers the scripts share
//! (`lease.lua`: extend a lease, never shorten it; `token.lua`: the next fencing token;
//! `guard.lua`: the restart guard; `holders.lua`: holders with a lease of their own;
//! `snapshot.lua`: what an operator sees of a key; `line.lua`: the line of waiting holders;
//! `resent.lua`: late copies on a cluster) are prepended at compile time.

pub(crate) mod release_call;

use std::time::Duration;

use redis::Script;

use crate::lock::MAX_DURATION;

/// The scripts of the lock protocol and the fenced store; see the header of each `.lua` file.
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) renew: Script,
    /// An exclusive acquisition that stops waiting leaves the waiting writers and the line.
    pub(crate) withdraw: Script,
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
    /// A quorum grant's token written back to the granting masters (needs no right that
    /// the acquire script does not).
    pub(crate) quorum_token: Script,
    /// Whether releases publish on sharded pub/sub (`SPUBLISH`, a Redis Cluster) rather
    /// than `PUBLISH`, which a cluster broadcasts to every node (Redisson #3349) and which
    /// Redis before 7 needs.
    pub(crate) sharded: bool,
}

/// A script's source: the shared helpers, then its own files.
macro_rules! source {
    ($($file:literal),+) => {
        concat!(
            include_str!("helpers/lease.lua"),
            include_str!("helpers/holders.lua"),
            $(include_str!($file)),+
        )
    };
}

/// The sources of the scripts the build-time checks run, kept to name the command on the
/// line an ACL refusal points at.
pub(crate) const ACQUIRE: &str = source!(
    "helpers/token.lua",
    "helpers/guard.lua",
    "helpers/line.lua",
    "helpers/resent.lua",
    "lock/acquire.lua"
);
pub(crate) const RELEASE: &str = source!(
    "helpers/token.lua",
    "helpers/line.lua",
    "helpers/resent.lua",
    "lock/release.lua"
);
pub(crate) const RENEW: &str = source!("lock/renew.lua");
pub(crate) const WITHDRAW: &str = source!("helpers/line.lua", "lock/withdraw.lua");
pub(crate) const PERMIT_ACQUIRE: &str = source!(
    "helpers/token.lua",
    "helpers/guard.lua",
    "helpers/resent.lua",
    "permits/permit_acquire.lua"
);
pub(crate) const PERMIT_RELEASE: &str = source!("helpers/resent.lua", "permits/permit_release.lua");
/// The operator's scripts, kept to name the command of a refusal when they are called.
pub(crate) const INSPECT: &str = source!("helpers/snapshot.lua", "operator/inspect.lua");
pub(crate) const FORCE_RELEASE: &str =
    source!("helpers/snapshot.lua", "operator/force_release.lua");

impl Scripts {
    pub(crate) fn new(sharded: bool) -> Self {
        Scripts {
            acquire: Script::new(ACQUIRE),
            release: Script::new(RELEASE),
            renew: Script::new(RENEW),
            withdraw: Script::new(WITHDRAW),
            fence: Script::new(include_str!("writes/fence.lua")),
            shared_acquire: Script::new(source!(
                "helpers/guard.lua",
                "helpers/resent.lua",
                "shared/shared_acquire.lua"
            )),
            shared_release: Script::new(source!("helpers/resent.lua", "shared/shared_release.lua")),
            permit_acquire: Script::new(PERMIT_ACQUIRE),
            permit_release: Script::new(PERMIT_RELEASE),
            inspect: Script::new(INSPECT),
            force_release: Script::new(FORCE_RELEASE),
            quorum_token: Script::new(include_str!("writes/quorum_token.lua")),
            sharded,
        }
    }

    pub(crate) fn all(&self) -> [&Script; 9] {
        [
            &self.acquire,
            &self.release,
            &self.renew,
            &self.withdraw,
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

/// The command `source` calls on its line `line` (1-based, as Redis numbers the line of an
/// ACL refusal inside a script): `redis.call('pexpire', ..)` calls PEXPIRE. A call that
/// picks its command by the deployment (`sharded and 'spublish' or 'publish'`) is the one
/// this deployment uses.
pub(crate) fn command_on_line(source: &str, line: usize, sharded: bool) -> Option<String> {
    called(source.lines().nth(line.checked_sub(1)?)?, sharded)
}

/// Every command `source` calls, in the order of first use, for a refusal whose line is
/// unknown.
pub(crate) fn commands(source: &str, sharded: bool) -> String {
    let mut names: Vec<String> = Vec::new();
    for name in source.lines().filter_map(|line| called(line, sharded)) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names.join(", ")
}

/// The command of the first `redis.call` or `redis.pcall` of `line`.
fn called(line: &str, sharded: bool) -> Option<String> {
    let code = line.split("--").next()?;
    let at = code
        .find("redis.call(")
        .or_else(|| code.find("redis.pcall("))?;
    let args = &code[at..];
    let args = &args[args.find('(')? + 1..];
    let pick = |cluster: &'static str, server: &'static str| if sharded { cluster } else { server };
    if args.contains("'publish'") {
        return Some(pick("SPUBLISH", "PUBLISH").to_owned());
    }
    let name = args.strip_prefix('\'')?.split('\'').next()?;
    Some(name.to_ascii_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_of_a_refused_line_is_the_one_it_calls() {
        let line = |needle: &str| {
            RELEASE
                .lines()
                .position(|l| l.contains(needle) && !l.trim_start().starts_with("--"))
                .map(|i| i + 1)
                .expect("the line is in the script")
        };
        let publish = line("'spublish' or 'publish'");
        assert_eq!(
            command_on_line(RELEASE, publish, false).as_deref(),
            Some("PUBLISH")
        );
        assert_eq!(
            command_on_line(RELEASE, publish, true).as_deref(),
            Some("SPUBLISH")
        );
        assert_eq!(
            command_on_line(RELEASE, line("redis.call('pexpire'"), false).as_deref(),
            Some("PEXPIRE")
        );
        assert_eq!(
            command_on_line(RELEASE, line("redis.call('zcount'"), false).as_deref(),
            Some("ZCOUNT")
        );
        assert_eq!(command_on_line(RELEASE, 0, false), None);
        let all = commands(RENEW, false);
        assert!(all.starts_with("PTTL, PEXPIRE"), "{all}");
        assert!(all.contains("HMGET"), "{all}");
    }
}

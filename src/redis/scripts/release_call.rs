//! One call of a release script, as its keys and arguments.

use std::time::Duration;

use redis::ScriptInvocation;

use super::{Scripts, millis};
use crate::core::queue::Claim;
use crate::lock::{Kind, LockOwner};
use crate::redis::keys::LockKey;

/// One call of the release script (see release.lua for what each argument does).
pub(crate) struct ReleaseCall<'a> {
    pub(crate) key: &'a LockKey,
    /// The hash field the hold is kept under (see [`holder`]).
    pub(crate) owner: &'a LockOwner,
    /// Which script releases it: release.lua, or for a shared hold or a permit
    /// shared_release.lua or permit_release.lua (these take no successor).
    pub(crate) kind: Kind,
    pub(crate) release_id: &'a str,
    pub(crate) lease: Duration,
    pub(crate) successor: Option<&'a Claim>,
    pub(crate) streak_spent: bool,
    pub(crate) may_have_run: bool,
    /// Only acts on the hold of this fencing token (a replay after a failover).
    pub(crate) token: Option<u64>,
    /// The last fencing token issued in memory under this hold, when later holders of this
    /// process got it that way: the lock's next token must exceed it.
    pub(crate) issued: Option<u64>,
    /// Tokens to reserve above the successor's own, for the run it starts.
    pub(crate) reserve: u64,
    /// On a cluster, the owner's instance id and the release's serial, recorded so that a
    /// late copy of an earlier attempt takes nothing (see release.lua).
    pub(crate) resent_guard: Option<(&'a str, u64)>,
    /// The grant lease and the turn grace: a release that frees the lock grants it to the
    /// head of the line of waiting holders (see release.lua); `None`: it frees it.
    pub(crate) grant: Option<(Duration, Duration)>,
}

impl ReleaseCall<'_> {
    pub(crate) fn invocation<'s>(
        self,
        scripts: &'s Scripts,
        fence_ttl: Duration,
    ) -> ScriptInvocation<'s> {
        let token = self.token.map(|t| t.to_string()).unwrap_or_default();
        let single = match self.kind {
            Kind::Exclusive => None,
            Kind::Shared => Some(&scripts.shared_release),
            Kind::Permit(_) => Some(&scripts.permit_release),
        };
        if let Some(script) = single {
            let mut invocation = script.key(&*self.key.lock);
            invocation
                .arg(self.owner.as_str())
                .arg(self.release_id)
                .arg(millis(self.lease))
                .arg(&self.key.channel)
                .arg(u8::from(scripts.sharded))
                .arg(token);
            if let Some((instance, serial)) = self.resent_guard {
                invocation
                    .key(self.key.releases())
                    .arg(instance)
                    .arg(serial)
                    .arg(millis(fence_ttl));
            }
            return invocation;
        }
        // The arguments a plain release does not need are left off from the end (see
        // release.lua): each one Redis hands to a script costs it.
        let mut invocation = scripts.release.key(&*self.key.lock);
        let [line, until] = self.key.line();
        invocation
            .key(line)
            .key(until)
            .arg(self.owner.as_str())
            .arg(self.release_id)
            .arg(millis(self.lease))
            .arg(&self.key.channel)
            .arg(u8::from(scripts.sharded));
        let plain = self.successor.is_none() && self.issued.is_none();
        // A release that may grant, or on a cluster, needs every argument.
        let full = self.resent_guard.is_some() || self.grant.is_some();
        if plain && !full && !self.may_have_run && token.is_empty() {
            return invocation;
        }
        invocation.arg(token).arg(u8::from(self.may_have_run));
        if plain && !full {
            return invocation;
        }
        // The fencing counter is written: by a handoff, a grant, and by a release after
        // handoffs in memory (the counter goes back to the last token issued). On a cluster
        // and where releases grant, every release gets here, for the arguments after it.
        invocation.key(&self.key.fence);
        match self.successor {
            Some(successor) => invocation
                .arg(successor.owner.as_str())
                .arg(millis(successor.lease)),
            None => invocation.arg("").arg(0),
        };
        invocation
            .arg(millis(fence_ttl))
            .arg(u8::from(self.streak_spent))
            .arg(self.issued.map(|t| t.to_string()).unwrap_or_default())
            .arg(self.reserve);
        match (self.resent_guard, self.grant) {
            (Some((instance, serial)), _) => {
                invocation
                    .key(self.key.releases())
                    .arg(instance)
                    .arg(serial);
            }
            // Their places, before the grant's.
            (None, Some(_)) => {
                invocation.arg("").arg("");
            }
            (None, None) => {}
        }
        if let Some((lease, grace)) = self.grant {
            invocation
                .key(self.key.writers())
                .arg(millis(lease))
                .arg(millis(grace));
        }
        invocation
    }
}

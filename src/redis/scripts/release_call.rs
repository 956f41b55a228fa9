//! One call of a release script, as its keys and arguments.

use std::time::Duration;

use redis::{Script, ScriptInvocation};

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
    /// The call of a shared hold's or a permit's release (`script`), of `token` only
    /// unless it is empty.
    fn holder_invocation<'s>(
        self,
        script: &'s Script,
        sharded: bool,
        token: String,
        fence_ttl: Duration,
    ) -> ScriptInvocation<'s> {
        let mut invocation = script.key(&*self.key.lock);
        invocation
            .arg(self.owner.as_str())
            .arg(self.release_id)
            .arg(millis(self.lease))
            .arg(&self.key.channel)
            .arg(u8::from(sharded))
            .arg(token);
        if let Some((instance, serial)) = self.resent_guard {
            invocation
                .key(self.key.releases())
                .arg(instance)
                .arg(serial)
                .arg(millis(fence_ttl));
        }
        invocation
    }

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
            return self.holder_invocation(script, scripts.sharded, token, fence_ttl);
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
        let cluster = self.resent_guard.is_some();
        let checked = self.may_have_run || !token.is_empty();
        if plain && !cluster && !checked && self.grant.is_none() {
            return invocation;
        }
        // The grant's arguments, and the counter it writes (as a handoff does, and a
        // release after handoffs in memory, which sets it back to the last token issued).
        let (grant, grace) = self
            .grant
            .map_or((0, 0), |(lease, grace)| (millis(lease), millis(grace)));
        invocation
            .key(&self.key.fence)
            .key(self.key.writers())
            .arg(grant)
            .arg(grace)
            .arg(millis(fence_ttl))
            .arg(self.reserve);
        if plain && !cluster && !checked {
            return invocation;
        }
        invocation.arg(token).arg(u8::from(self.may_have_run));
        if plain && !cluster {
            return invocation;
        }
        match self.successor {
            Some(successor) => invocation
                .arg(successor.owner.as_str())
                .arg(millis(successor.lease)),
            None => invocation.arg("").arg(0),
        };
        invocation
            .arg(u8::from(self.streak_spent))
            .arg(self.issued.map(|t| t.to_string()).unwrap_or_default());
        if let Some((instance, serial)) = self.resent_guard {
            invocation
                .key(self.key.releases())
                .arg(instance)
                .arg(serial);
        }
        invocation
    }
}

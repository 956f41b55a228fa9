//! The calls of the Redis store's scripts, as built from the core's attempts and releases:
//! which script, which keys and which arguments (each script's header says what they do),
//! and the undo of an attempt on the connection it ran on.

use tokio::time::timeout;

use super::connection::pool::Conn;
use super::keys::LockKey;
use super::scripts::millis;
use super::scripts::release_call::ReleaseCall;
use super::store::RedisStore;
use crate::core::store::{Attempt, Calls, Release};
use crate::lock::Kind;

impl RedisStore {
    /// The script call of one attempt (see acquire.lua, shared_acquire.lua and
    /// permit_acquire.lua for what each argument does).
    pub(super) fn acquire_invocation<'s>(
        &'s self,
        key: &LockKey,
        attempt: &Attempt,
    ) -> redis::ScriptInvocation<'s> {
        let scripts = &self.scripts;
        let holder = attempt.holder.as_str();
        // One id per attempt: a copy that the cluster client sends again after a lost
        // reply carries the same id, and takes no second hold (see acquire.lua).
        let attempt_id = format!("{holder}@{}", attempt.serial);
        let guard = self.restart_guard.map_or(0, millis);
        match attempt.kind {
            Kind::Exclusive => {
                let waits = attempt.waits.map_or(0, millis);
                let mut invocation = scripts.acquire.key(&*key.lock);
                let [line, until] = key.line();
                // A yielding attempt is an ordinary one here: the line of waiting holders
                // leaves a free key to the instances that wait for it (see line.lua).
                invocation
                    .key(&key.fence)
                    .key(key.writers())
                    .key(line)
                    .key(until)
                    .arg(holder)
                    .arg(millis(attempt.lease))
                    .arg(millis(self.fence_ttl))
                    .arg(guard)
                    .arg(attempt_id)
                    .arg(waits)
                    .arg(self.turn_grace.map_or(0, millis));
                if let Some(instance) = &self.resent_guard {
                    invocation
                        .key(key.releases())
                        .arg(attempt.reserve)
                        .arg(&**instance)
                        .arg(attempt.serial);
                } else if attempt.reserve > 0 {
                    invocation.arg(attempt.reserve);
                }
                if attempt.record {
                    invocation.key(key.record());
                }
                invocation
            }
            Kind::Shared => {
                let mut invocation = scripts.shared_acquire.key(&*key.lock);
                invocation
                    .key(&key.fence)
                    .key(key.writers())
                    .arg(holder)
                    .arg(millis(attempt.lease))
                    .arg(guard)
                    .arg(attempt_id)
                    .arg(attempt.owner.as_str());
                self.refuse_late_copies(&mut invocation, key, attempt);
                invocation
            }
            Kind::Permit(permits) => {
                let mut invocation = scripts.permit_acquire.key(&*key.lock);
                invocation
                    .key(&key.fence)
                    .arg(holder)
                    .arg(millis(attempt.lease))
                    .arg(millis(self.fence_ttl))
                    .arg(guard)
                    .arg(attempt_id)
                    .arg(permits);
                self.refuse_late_copies(&mut invocation, key, attempt);
                invocation
            }
        }
    }

    /// On a cluster, the key's releases and the attempt's instance and serial, after a
    /// shared or permit attempt's own arguments: a copy that the cluster client sends again
    /// after a release of the instance takes nothing (see resent.lua).
    fn refuse_late_copies(
        &self,
        invocation: &mut redis::ScriptInvocation<'_>,
        key: &LockKey,
        attempt: &Attempt,
    ) {
        if let Some(instance) = &self.resent_guard {
            invocation
                .key(key.releases())
                .arg(&**instance)
                .arg(attempt.serial);
        }
    }

    /// The release script's call for `release`.
    pub(super) fn release_call<'a>(
        &'a self,
        key: &'a LockKey,
        release: &'a Release<'a>,
    ) -> ReleaseCall<'a> {
        ReleaseCall {
            key,
            owner: release.holder,
            kind: release.kind,
            release_id: release.release_id,
            lease: release.lease,
            successor: release.successor,
            streak_spent: release.run_spent,
            may_have_run: release.may_have_run,
            token: release.only_token,
            issued: release.issued,
            reserve: release.reserve,
            resent_guard: self
                .resent_guard
                .as_deref()
                .map(|instance| (instance, release.serial)),
            grant: self.grant_lease.zip(self.turn_grace),
        }
    }

    /// Gives back what `attempt` took, on the connection it ran on; the connection back
    /// when that failed.
    pub(crate) async fn undo(
        &self,
        key: &LockKey,
        attempt: &Attempt,
        mut conn: Conn,
    ) -> Result<(), Conn> {
        let release_id = format!("{}#{}", attempt.holder.as_str(), attempt.serial);
        let release = Release {
            holder: &attempt.holder,
            kind: attempt.kind,
            release_id: &release_id,
            lease: attempt.lease,
            successor: None,
            run_spent: false,
            may_have_run: self.calls() == Calls::MayRunTwice,
            only_token: None,
            issued: None,
            reserve: 0,
            // What the attempt may have taken is given back: it refuses a copy of itself.
            serial: attempt.serial,
        };
        let invocation = self
            .release_call(key, &release)
            .invocation(&self.scripts, self.fence_ttl);
        match timeout(self.command_timeout, conn.invoke::<Vec<i64>>(&invocation)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(conn),
        }
    }
}

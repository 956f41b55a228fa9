//! A quorum grant's fencing token: the highest token the granting majority issued, written
//! back to every master of that majority before the grant is returned.
//!
//! Why tokens then strictly increase across the quorum: each master issues a token above
//! its own counter (`token.lua`), and a grant's token `t` is the highest of its majority's,
//! so `t` exceeds the counter of every master of that majority as it was before the grant.
//! Writing `t` back raises the counter of every master of the majority to `t`. A later
//! grant needs the key free on a majority of its own, which happens only after this hold
//! was released or ran out, so after the write-back; its majority shares at least one
//! master with this one (two majorities of `n` cannot be disjoint), whose counter is at
//! least `t`, so that master issues above `t`, and the later grant's token, the highest of
//! its majority's, is above `t` too.
//!
//! What breaks it: a master of the intersection that forgot its counter (restarted without
//! persistence, flushed, or its counter expired after `fence_ttl` and its clock is behind
//! another master's by more than the time between the grants). The restart guard keeps a
//! restarted master from granting for one longest lease, by which time every hold it may
//! have forgotten has ended; the clock floor of `token.lua` keeps tokens above a counter
//! lost that long ago, as long as the masters' clocks agree to within that time.

use std::time::Instant;

use futures_util::future::join_all;
use tokio::time::timeout;

use super::QuorumStore;
use crate::lock::{Kind, LockOwner};
use crate::redis::keys::LockKey;
use crate::redis::scripts::millis;

impl QuorumStore {
    /// Writes `token` back to the masters of `granted` (their indices) for `holder`'s hold
    /// of `kind`: whether as many as its grant needs confirmed while still holding the key,
    /// and when the
    /// last answer came.
    pub(super) async fn write_back(
        &self,
        key: &LockKey,
        (holder, kind): (&LockOwner, Kind),
        token: u64,
        granted: &[usize],
    ) -> (bool, Instant) {
        let field = match kind {
            Kind::Permit(_) => format!("tok:{}", holder.as_str()),
            Kind::Exclusive | Kind::Shared => "token".to_owned(),
        };
        let (field, fence_ttl) = (&field, millis(self.lead.fence_ttl));
        let calls = granted
            .iter()
            .filter_map(|&i| self.masters.get(i))
            .map(|master| async move {
                let mut invocation = master.scripts.quorum_token.key(&*key.lock);
                invocation
                    .key(&key.fence)
                    .arg(holder.as_str())
                    .arg(token)
                    .arg(fence_ttl)
                    .arg(field.as_str());
                timeout(self.master_timeout, master.pool.invoke::<i64>(&invocation)).await
            });
        let replies = join_all(calls).await;
        let confirmed = replies.iter().filter(|r| matches!(r, Ok(Ok(1)))).count();
        (confirmed >= self.needed(kind), Instant::now())
    }
}

//! The integer replies of the routines the crate runs inside a store: the Redis scripts
//! and the SQL functions answer an attempt, a release and an operator's snapshot in one
//! form, read here for the
//! stores that run them (`redis/replies.rs`, `postgres/`, `mysql/`). Part of the kit the
//! stores share; the engine never reads a reply, only the [`Attempted`] and [`Released`]
//! a store makes of it. A store's answers beyond this form (the Redis scripts' line,
//! grants and restart guard) are read by that store before it falls back on these.

use std::time::Duration;

use super::{Attempted, Released};
use crate::lock::inspect::{LockInfo, LockMode};

/// Reads an attempt's reply: `{1, token, count}`, `{0, ms}`, `{0, ms, 1}` (registered as
/// a waiting writer), `{4}` (an upgrade refused), `{5}` (left to others). `None` for
/// anything else, a hold included that cannot be read as one.
pub(crate) fn attempted(reply: &[i64]) -> Option<Attempted> {
    Some(match *reply {
        [1, token, count] if token >= 0 && count > 0 => Attempted::Acquired {
            token: token.unsigned_abs(),
            count: count.unsigned_abs(),
        },
        [0, ms] => Attempted::Held {
            left: millis(ms),
            queued: false,
        },
        [0, ms, 1] => Attempted::Held {
            left: millis(ms),
            queued: true,
        },
        [4] => Attempted::UpgradeRefused,
        [5] => Attempted::LeftToOthers,
        _ => return None,
    })
}

/// Reads a release's reply: `{3, token}` (handed over), `{2}` (freed), `{1}` (an outer
/// hold remains), `{0}` (not held). `None` for anything else.
pub(crate) fn released(reply: &[i64]) -> Option<Released> {
    Some(match *reply {
        [3, token] if token >= 0 => Released::HandedOver(token.unsigned_abs()),
        [2] => Released::Freed,
        [1] => Released::Remains,
        [0] => Released::NotHeld,
        _ => return None,
    })
}

/// Reads an operator's snapshot of `key` (snapshot.lua and the SQL functions):
/// `{mode, holders, holds, lease, token}`, mode 0 free, 1 exclusive, 2 shared, 3 permits;
/// lease in milliseconds, -1 when free; token 0 when none is remembered. `None` for
/// anything else.
pub(crate) fn snapshot(key: String, reply: &[i64]) -> Option<LockInfo> {
    let &[mode, holders, holds, lease, token] = reply else {
        return None;
    };
    let fencing_token = u64::try_from(token).ok().filter(|&t| t > 0);
    let mode = match mode {
        0 => return Some(LockInfo::free(key, fencing_token)),
        1 => LockMode::Exclusive,
        2 => LockMode::Shared,
        3 => LockMode::Permits,
        _ => return None,
    };
    Some(LockInfo {
        key,
        mode,
        holders: usize::try_from(holders).ok()?,
        holds: u32::try_from(holds).ok()?,
        lease_remaining: millis(lease),
        fencing_token,
    })
}

/// A reply's milliseconds as a duration; `None` for a negative count (no end known).
pub(crate) fn millis(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

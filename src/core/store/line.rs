//! A store's line of waiting holders (Redis): the exclusive acquisitions that wait for a key
//! take their turns in the store, and a release may grant a freed key to the head of the
//! line in its own call, telling the grantee in its message.
//!
//! Such a store answers an attempt that joined the line, or that found the key granted to
//! it, with [`Attempted::Line`](super::Attempted) ([`InLine`]); a store that grants also
//! declares [`Grants`] ([`Store::grants`](super::Store::grants)), through which the core
//! registers the waiter a grant is told to. A store without a line gives neither: the core
//! consults them only for the answers and waiters such a store makes (`acquire/grant.rs`).

use std::time::Duration;

use crate::core::wakeups::Waiter;
use crate::lock::LockOwner;

/// What an attempt in a store's line of waiting holders found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InLine {
    /// Another holder has the key for about `left` longer (`None`: no end known; for a free
    /// key, another waiting holder's turn), and the attempt is in line, as of the store's
    /// clock `at` (milliseconds): a grant made later than that is timed from the attempt.
    /// The acquisition withdraws ([`Store::withdraw_writer`](super::Store::withdraw_writer))
    /// when it stops waiting without the key.
    Waiting { left: Option<Duration>, at: u64 },
    /// A release granted the key to this holder, which has not claimed it: it is the
    /// holder's for `left` more unless claimed, under `token`, with `reserved` tokens
    /// above it for a run of holders in memory. Nothing was taken: the acquisition makes
    /// it a hold, or a re-entry claims it first.
    Granted {
        token: u64,
        left: Duration,
        reserved: u64,
    },
}

/// A store that grants a freed key to the head of its line of waiting holders.
pub(crate) trait Grants<K>: Send + Sync {
    /// Registers the waiter of an exclusive acquisition that waits in the line as
    /// `holder`: a release that grants it the key tells this waiter the grant
    /// ([`Wake::Granted`](crate::core::wakeups::Wake)), and the key's other waiters when
    /// to look again. Otherwise as [`Store::subscribe`](super::Store::subscribe).
    fn subscribe_in_line(&self, key: &K, holder: &LockOwner) -> Waiter;
}

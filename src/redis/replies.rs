//! What the lock scripts' replies say, as the core's outcomes: the answers only the scripts
//! give (the restart guard, records, late copies, the line of waiting holders), then the
//! form they share with the SQL functions (`core/store/replies.rs`).

use std::sync::atomic::{AtomicBool, Ordering};

use super::UnexpectedReply;
use super::connection::pool::CommandError;
use crate::core::store::replies::{self, millis};
use crate::core::store::{Attempted, InLine, Released};

/// Says once, at INFO, that the restart guard keeps a server from granting anything (it
/// started less than `max_lease` ago), so that an operator who sees every request wait
/// after a server's start knows why; and once that it grants again.
pub(crate) struct GuardSaid {
    server: String,
    said: AtomicBool,
}

impl GuardSaid {
    pub(crate) fn new(server: &str) -> Self {
        GuardSaid {
            server: server.to_owned(),
            said: AtomicBool::new(false),
        }
    }

    /// The server's guard refused an acquisition for `wait_ms` more.
    fn refused(&self, wait_ms: i64) {
        if self.said.swap(true, Ordering::Relaxed) {
            tracing::debug!(wait_ms, "restart guard refuses new acquisitions");
        } else {
            tracing::info!(
                server = %self.server,
                wait_ms,
                "the Redis server started less than max_lease ago: its restart guard grants \
                 nothing until a lease from before the start has run out"
            );
        }
    }

    /// The server answered an acquisition past its guard.
    fn passed(&self) {
        if self.said.load(Ordering::Relaxed) && self.said.swap(false, Ordering::Relaxed) {
            tracing::info!(server = %self.server, "the restart guard has passed: the Redis server grants again");
        }
    }
}

/// What an acquire script's reply says (see acquire.lua for the replies); `lined`: the
/// store keeps a line of waiting holders; `guard`: what the restart guard said so far.
pub(super) fn parse_attempt(
    reply: &[i64],
    lined: bool,
    guard: &GuardSaid,
) -> Result<Attempted, CommandError> {
    if !matches!(reply, [2, _]) {
        guard.passed();
    }
    let attempted = match *reply {
        // Refused for `wait` more, as if held.
        [2, wait] if wait >= 0 => {
            guard.refused(wait);
            Some(Attempted::Held {
                left: millis(wait),
                queued: false,
            })
        }
        [0, left, 1, at] if lined && at >= 0 => Some(Attempted::Line(InLine::Waiting {
            left: millis(left),
            at: at.unsigned_abs(),
        })),
        [8, token, left, reserved] if token >= 0 && reserved >= 0 => {
            Some(Attempted::Line(InLine::Granted {
                token: token.unsigned_abs(),
                left: millis(left).unwrap_or_default(),
                reserved: reserved.unsigned_abs(),
            }))
        }
        // Registered as a waiting writer, in no line (a quorum's master).
        [0, left, 1, _] => Some(Attempted::Held {
            left: millis(left),
            queued: true,
        }),
        [6] => Some(Attempted::Recorded),
        [7] => Some(Attempted::Overtaken),
        _ => replies::attempted(reply),
    };
    // A reply that cannot be read (a hold included, from a proxy or server that mangles
    // replies) fails the attempt, and the core gives back what it may have taken.
    attempted.ok_or(CommandError::Unexpected(UnexpectedReply("acquire")))
}

/// What a release script's reply says (see release.lua for the replies).
pub(super) fn parse_release(reply: &[i64]) -> Result<Released, CommandError> {
    replies::released(reply).ok_or(CommandError::Unexpected(UnexpectedReply("release")))
}

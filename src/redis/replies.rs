//! What the lock scripts' replies say, as the core's outcomes: the answers only the scripts
//! give (the restart guard, records, late copies, the line of waiting holders), then the
//! form they share with the SQL functions (`core/store/replies.rs`).

use super::UnexpectedReply;
use super::connection::pool::CommandError;
use crate::core::store::replies::{self, millis};
use crate::core::store::{Attempted, InLine, Released};

/// What an acquire script's reply says (see acquire.lua for the replies); `lined`: the
/// store keeps a line of waiting holders.
pub(super) fn parse_attempt(reply: &[i64], lined: bool) -> Result<Attempted, CommandError> {
    let attempted = match *reply {
        // Refused for `wait` more, as if held.
        [2, wait] if wait >= 0 => {
            tracing::debug!(wait_ms = wait, "restart guard refuses new acquisitions");
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

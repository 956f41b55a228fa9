//! What the lock scripts' replies say, as the core's outcomes.

use std::time::Duration;

use super::UnexpectedReply;
use super::connection::pool::CommandError;
use crate::core::store::{Attempted, Released};

/// What an acquire script's reply says (see acquire.lua for the replies); `lined`: the
/// store keeps a line of waiting holders.
pub(super) fn parse_attempt(reply: &[i64], lined: bool) -> Result<Attempted, CommandError> {
    let ms = |ms: i64| u64::try_from(ms).ok();
    match *reply {
        [2, wait] => tracing::debug!(wait_ms = wait, "restart guard refuses new acquisitions"),
        [0, left, 1, at] if lined && at >= 0 => {
            return Ok(Attempted::Lined {
                left: ms(left).map(Duration::from_millis),
                at: at.unsigned_abs(),
            });
        }
        [8, token, left, reserved] if token >= 0 && reserved >= 0 => {
            return Ok(Attempted::Granted {
                token: token.unsigned_abs(),
                left: Duration::from_millis(ms(left).unwrap_or(0)),
                reserved: reserved.unsigned_abs(),
            });
        }
        // Registered as a waiting writer, in no line (a quorum's master).
        [0, left, 1, _] => {
            return Ok(Attempted::Held {
                left: ms(left).map(Duration::from_millis),
                queued: true,
            });
        }
        _ => {}
    }
    // A reply that cannot be read (a hold included, from a proxy or server that mangles
    // replies) fails the attempt, and the core gives back what it may have taken.
    Attempted::from_reply(reply).ok_or(CommandError::Unexpected(UnexpectedReply("acquire")))
}

/// What a release script's reply says (see release.lua for the replies).
pub(super) fn parse_release(reply: &[i64]) -> Result<Released, CommandError> {
    Released::from_reply(reply).ok_or(CommandError::Unexpected(UnexpectedReply("release")))
}

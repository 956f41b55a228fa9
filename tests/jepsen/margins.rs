//! The stop-before-expiry margins: how long before its lease ended on the server a
//! cut-off holder stopped, from the expiries the nemesis read while it held.

use super::*;

/// The server-side expiry of a lock, in wall-clock µs, as far as one `PTTL` can tell.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expiry {
    /// When `PTTL` was sent.
    pub(crate) asked: u64,
    /// The earliest and the latest the expiry can be: Redis answered at some moment between
    /// sending and receiving, in whole milliseconds.
    pub(crate) earliest: u64,
    pub(crate) latest: u64,
}

/// The server's expiry of `lock_key` (see [`Expiry`]).
pub(crate) async fn server_expiry(
    observer: &mut Option<redis::aio::MultiplexedConnection>,
    cluster: &Cluster,
    lock_key: &str,
) -> Option<Expiry> {
    if observer.is_none() {
        *observer = redis::Client::open(format!("redis://{}", cluster.redis.addr()))
            .ok()?
            .get_multiplexed_async_connection()
            .await
            .ok();
    }
    let conn = observer.as_mut()?;
    let asked = now_micros();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(lock_key)
        .query_async(conn)
        .await
        .ok()?;
    Expiry::from_pttl(asked, now_micros(), pttl)
}

impl Expiry {
    /// The expiry that a `PTTL` sent at `asked` and answered at `answered` (µs) reported as
    /// `pttl` ms; `None` for a key without one.
    pub(crate) fn from_pttl(asked: u64, answered: u64, pttl: i64) -> Option<Expiry> {
        let pttl = 1000 * u64::try_from(pttl).ok()?;
        Some(Expiry {
            asked,
            earliest: (asked + pttl).saturating_sub(1000),
            latest: answered + pttl + 1000,
        })
    }
}

#[derive(Debug)]
pub(crate) struct Margin<F = Fault> {
    pub(crate) fault: F,
    /// Server-side expiry minus the holder's stop, µs, at the latest the expiry can have
    /// been: negative only when the holder certainly ran past it.
    pub(crate) margin: i64,
    /// The same at the earliest the expiry can have been: positive when the holder
    /// certainly stopped before it.
    pub(crate) proven: i64,
    /// The same from the `expired` event's arrival at the observer (later than the expiry
    /// itself: Redis deletes an expired key on access or in its expiry cycle).
    pub(crate) by_event: Option<i64>,
}

/// The margin of every cut-off holder that was stopped (not those that outlived a
/// short cut-off).
pub(crate) fn margins<F: Copy>(cut_offs: &[CutOff<F>], log: &Log) -> Vec<Margin<F>> {
    cut_offs
        .iter()
        .filter_map(|c| {
            let &(end, completed) = log.probe_ends.get(&c.probe)?;
            if completed {
                return None;
            }
            let expiry = c
                .expiries
                .iter()
                .rev()
                .find(|e| e.asked < end)
                .unwrap_or_else(|| panic!("no expiry observed while {:?} was held", c.probe));
            let by_event = log
                .expired
                .iter()
                .find(|(key, at)| *key == c.lock_key && *at >= c.began)
                .map(|(_, at)| *at as i64 - end as i64);
            Some(Margin {
                fault: c.fault,
                margin: expiry.latest as i64 - end as i64,
                proven: expiry.earliest as i64 - end as i64,
                by_event,
            })
        })
        .collect()
}

//! The backend's one lease: every hold of the backend is a key attached to it, so keeping
//! it alive keeps every hold, and losing it loses every hold at once.
//!
//! etcd counts a lease from the moment its leader last answered a keep-alive (or granted
//! it): a lease confirmed by a keep-alive *sent* at `c` lives until `c + ttl` at least.
//! The backend remembers when the last confirmed keep-alive was sent, and works with three
//! fractions of the TTL:
//!
//! - a hold is only put on a lease confirmed within the last sixth of the TTL (else a
//!   keep-alive goes first): [`Lease::for_hold`];
//! - the core counts a hold's lease as half the TTL from its attempt or its last renewal
//!   ([`Lease::hold_lease`]), a renewal being one keep-alive answered, so that every
//!   holder's deadline falls within two thirds of the TTL after the last confirmation;
//! - a lease unconfirmed for longer than those two thirds was given up for lost by every
//!   holder under it, so it is revoked and replaced even if etcd still has it (a
//!   restarted etcd grants every lease its TTL anew): no key of a hold that its holder
//!   stopped keeps the lock.
//!
//! A keep-alive stream that stalls silently confirms nothing: the core counts the holds
//! lost when their lease passes unconfirmed, before etcd frees their keys.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use tokio::time::{Instant, sleep, timeout};
use tokio_util::sync::CancellationToken;

use super::error::EtcdError;
use super::members::{Members, no_answer};
use crate::core::watchdog::recheck::Recheck;

/// The current lease and what etcd last confirmed of it.
#[derive(Clone, Copy, Debug)]
struct State {
    id: i64,
    /// The TTL etcd granted (it may raise a short one to its minimum).
    ttl: Duration,
    /// When the last answered keep-alive (or the grant) was sent.
    confirmed: Instant,
}

/// An open keep-alive stream of the lease `id`.
struct Stream {
    id: i64,
    /// The member it is open on.
    member: usize,
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
}

/// The backend's lease (see the module docs).
pub(crate) struct Lease {
    members: Arc<Members>,
    /// The TTL asked for, in whole seconds.
    ttl_secs: i64,
    state: Mutex<State>,
    /// One keep-alive at a time: an answer is read by the call that sent its request.
    stream: tokio::sync::Mutex<Option<Stream>>,
    /// Raised when the lease is found gone: every hold is checked at once.
    recheck: Recheck,
}

impl Lease {
    /// Grants the backend's lease.
    pub(crate) async fn grant(
        members: Arc<Members>,
        ttl_secs: i64,
        recheck: Recheck,
    ) -> Result<Self, EtcdError> {
        let sent = Instant::now();
        let granted = members.grant(ttl_secs).await?;
        let state = State {
            id: granted.id(),
            ttl: secs(granted.ttl()),
            confirmed: sent,
        };
        Ok(Lease {
            members,
            ttl_secs,
            state: Mutex::new(state),
            stream: tokio::sync::Mutex::new(None),
            recheck,
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Plain data, updated in single assignments: a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current lease's id.
    pub(crate) fn id(&self) -> i64 {
        self.state().id
    }

    /// The TTL etcd granted.
    pub(crate) fn ttl(&self) -> Duration {
        self.state().ttl
    }

    /// The lease the core counts for a hold: half the TTL (see the module docs).
    pub(crate) fn hold_lease(&self) -> Duration {
        self.ttl() / 2
    }

    /// The lease a new hold goes on: confirmed within a sixth of its TTL, by a keep-alive
    /// now if the last one is older (the keep-alive task fell behind or stalled).
    pub(crate) async fn for_hold(&self) -> Result<i64, EtcdError> {
        let state = *self.state();
        if state.confirmed.elapsed() < state.ttl / 6 {
            return Ok(state.id);
        }
        match self.keep_alive().await {
            Ok(id) => Ok(id),
            // A new lease was granted (and confirmed) in place of the lost one.
            Err(e) if e.is_lease_not_found() => Ok(self.id()),
            Err(e) => Err(e),
        }
    }

    /// Sends one keep-alive and waits for its answer: `Ok(id)` when the lease `id` lives
    /// on (its confirmation recorded), [`EtcdError::LeaseLost`] when it is gone, in which
    /// case a new lease is granted for new holds. Cancel-safe: a stream whose answer was
    /// not read is dropped, so no later call takes that answer for its own.
    pub(crate) async fn keep_alive(&self) -> Result<i64, EtcdError> {
        let asked = Instant::now();
        let mut slot = self.stream.lock().await;
        // A keep-alive sent since this call asked, by the call it waited behind, confirms
        // the lease as well as its own would: one keep-alive for all who asked meanwhile,
        // not one each in turn (during an election, each takes up to its member's share
        // of the command timeout, and acquisitions that queued here waited for the sum).
        let state = *self.state();
        if state.confirmed >= asked {
            return Ok(state.id);
        }
        let id = self.id();
        let sent = Instant::now();
        // On the open stream, within its member's share of the command timeout: a stream
        // that fails or does not answer by then is dropped (its member passed over) and a
        // new one opened on the next member, so that a member paused or cut off does not
        // keep the lease unconfirmed past its lapse.
        let share = self.members.share();
        let renewed = match slot.take().filter(|s| s.id == id) {
            Some(mut stream) => {
                let renewal = timeout(share, renew(&mut stream)).await;
                match renewal.unwrap_or_else(|_| Err(no_answer(share))) {
                    Ok(ttl) => Some((stream, ttl)),
                    Err(e) => {
                        self.members.pass_over(stream.member, &e);
                        None
                    }
                }
            }
            None => None,
        };
        let ttl = match renewed {
            Some((stream, ttl)) => {
                if ttl > 0 {
                    *slot = Some(stream);
                }
                ttl
            }
            // The first keep-alive of a new stream is sent and answered when it opens.
            None => match self.members.keep_alive(id).await {
                Ok((member, keeper, answers)) => {
                    *slot = Some(Stream {
                        id,
                        member,
                        keeper,
                        answers,
                    });
                    1
                }
                Err(e) => {
                    let e = EtcdError::from(e);
                    if !e.is_lease_not_found() {
                        return Err(e);
                    }
                    0
                }
            },
        };
        let previous = *self.state();
        // Unconfirmed for longer than two thirds of its TTL, the lease was given up for lost
        // by every hold under it (see the module docs), even if etcd kept it: it is
        // revoked, so that no key of a hold its holder stopped keeps the lock.
        let lapsed =
            previous.id == id && sent.duration_since(previous.confirmed) > previous.ttl * 2 / 3;
        if ttl <= 0 || lapsed {
            drop(slot);
            if lapsed {
                let revoked = self.members.revoke(id).await;
                if let Err(error) = revoked {
                    tracing::debug!(%error, lease = id, "could not revoke a lapsed etcd lease");
                }
            }
            self.replace(id).await?;
            return Err(EtcdError::LeaseLost);
        }
        let mut state = self.state();
        if state.id == id {
            state.confirmed = state.confirmed.max(sent);
        }
        Ok(id)
    }

    /// Grants a new lease in place of `lost` (unless that was done already): the holds
    /// under `lost` are gone, and every hold is checked at once.
    pub(crate) async fn replace(&self, lost: i64) -> Result<i64, EtcdError> {
        let _one_at_a_time = self.stream.lock().await;
        if self.id() != lost {
            return Ok(self.id());
        }
        tracing::warn!(
            lease = lost,
            "the etcd lease was lost; every hold under it is lost"
        );
        self.recheck.raise("the etcd lease was lost");
        let sent = Instant::now();
        let granted = self.members.grant(self.ttl_secs).await?;
        *self.state() = State {
            id: granted.id(),
            ttl: secs(granted.ttl()),
            confirmed: sent,
        };
        Ok(granted.id())
    }

    /// Revokes the lease: every hold under it is freed at once.
    pub(crate) async fn revoke(&self) -> Result<(), EtcdError> {
        self.members.revoke(self.id()).await?;
        Ok(())
    }
}

/// Keeps the lease alive every eighth of its TTL (more often than a new hold needs it
/// confirmed) while the backend lives, so that an idle
/// backend's next hold finds it confirmed; revokes it at shutdown, freeing the backend's
/// holds at once.
pub(crate) async fn keep_alive_until_shutdown(
    lease: Arc<Lease>,
    command_timeout: Duration,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = sleep(lease.ttl() / 8) => {}
        }
        match timeout(command_timeout, lease.keep_alive()).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::debug!(%error, "etcd lease keep-alive failed"),
            Err(_) => tracing::debug!("etcd lease keep-alive timed out"),
        }
    }
    if let Ok(Err(error)) = timeout(command_timeout, lease.revoke()).await {
        tracing::debug!(%error, "could not revoke the etcd lease at shutdown");
    }
}

/// One keep-alive on an open stream: the TTL its answer gives.
async fn renew(stream: &mut Stream) -> Result<i64, etcd_client::Error> {
    stream.keeper.keep_alive().await?;
    let answer = stream.answers.message().await?.ok_or_else(|| {
        etcd_client::Error::LeaseKeepAliveError("keep-alive stream closed".into())
    })?;
    Ok(answer.ttl())
}

/// etcd's seconds as a duration (a lease's TTL is never negative when granted).
fn secs(ttl: i64) -> Duration {
    Duration::from_secs(u64::try_from(ttl).unwrap_or(0))
}

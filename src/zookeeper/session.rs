//! The backend's session: every hold of the backend is an ephemeral node of it, so a live
//! session keeps every hold, and an ended one (expired, or closed) has lost them all.
//!
//! A connection loss is not a session loss (Curator's lesson): the client reconnects, to
//! any server of the ensemble, and the session with its nodes goes on if it does so within
//! the session timeout. The core counts a hold's lease as half the negotiated timeout from
//! its acquisition or its last renewal, a renewal being a read answered on the session
//! (which the ensemble counts as hearing from the session), so a holder stops before the
//! ensemble could expire the session and free its nodes. Once the session has ended, the
//! backend opens a new one for new holds, and every hold is checked at once.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use zookeeper_client::{Acls, Client, Error as ClientError, SessionState};

use super::error::ZkError;
use crate::core::wakeups::{Disconnected, Wakeups};
use crate::core::watchdog::recheck::Recheck;

/// How the backend connects.
#[derive(Clone, Debug)]
pub(crate) struct Connect {
    /// The connection string (`host:port,...[/chroot]`).
    pub(crate) hosts: String,
    pub(crate) session_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    /// The identity every session authenticates as (the `digest` scheme), if any.
    pub(crate) digest: Option<Digest>,
}

/// A `digest` identity: `user:password`, which ZooKeeper hashes into the id its ACLs name.
#[derive(Clone)]
pub(crate) struct Digest {
    pub(crate) user: String,
    pub(crate) password: String,
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("Digest")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

impl Connect {
    /// Opens a new session, within the connect timeout.
    pub(crate) async fn open(&self) -> Result<Client, ZkError> {
        let mut connector = Client::connector()
            .with_session_timeout(self.session_timeout)
            .with_connection_timeout(self.connect_timeout)
            // Every host tried once, then the error: the backend decides when to go again.
            .with_fail_eagerly();
        if let Some(Digest { user, password }) = &self.digest {
            connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
        }
        let connecting = connector.connect(&self.hosts);
        match timeout(self.connect_timeout, connecting).await {
            Ok(connected) => Ok(connected?),
            Err(_) => Err(ZkError::Client(ClientError::Timeout)),
        }
    }
}

impl Connect {
    /// The ACL of every node the backend creates: only the backend's identity may read,
    /// write or delete it when the session authenticates (`digest`), anyone otherwise.
    pub(crate) fn acls(&self) -> Acls<'static> {
        if self.digest.is_some() {
            Acls::creator_all()
        } else {
            Acls::anyone_all()
        }
    }
}

/// The backend's current session (see the module docs).
pub(crate) struct Session {
    connect: Connect,
    current: watch::Sender<Client>,
    /// One replacement at a time.
    replacing: tokio::sync::Mutex<()>,
    /// Raised when a session ended: every hold is checked at once.
    recheck: Recheck,
}

impl Session {
    pub(crate) fn new(connect: Connect, client: Client, recheck: Recheck) -> Self {
        Session {
            connect,
            current: watch::Sender::new(client),
            replacing: tokio::sync::Mutex::new(()),
            recheck,
        }
    }

    /// The current session's client.
    pub(crate) fn client(&self) -> Client {
        self.current.borrow().clone()
    }

    /// The ACL of every node the backend creates (see [`Connect::acls`]).
    pub(crate) fn acls(&self) -> Acls<'static> {
        self.connect.acls()
    }

    /// The current session's id.
    pub(crate) fn id(&self) -> i64 {
        self.current.borrow().session_id().0
    }

    /// The lease the core counts for a hold: half the session timeout the ensemble
    /// negotiated (see the module docs).
    pub(crate) fn hold_lease(&self) -> Duration {
        self.current.borrow().session_timeout() / 2
    }

    /// Opens a new session in place of the ended `lost` (unless that was done already):
    /// the holds under `lost` are gone, and every hold is checked at once.
    pub(crate) async fn replace(&self, lost: i64) -> Result<Client, ZkError> {
        let _one_at_a_time = self.replacing.lock().await;
        if self.id() != lost {
            return Ok(self.client());
        }
        tracing::warn!(
            session = format_args!("{lost:#x}"),
            "the ZooKeeper session ended; every hold under it is lost"
        );
        self.recheck.raise("the ZooKeeper session ended");
        let client = self.connect.open().await?;
        self.current.send_replace(client.clone());
        Ok(client)
    }
}

/// Follows the session's state until `shutdown`: a connected session confirms every
/// waiter's channel (the watches that wake them ride on it); a disconnection wakes every
/// waiter (a deletion may be missed meanwhile); an ended session is replaced, with capped
/// exponential backoff, and every waiter tries again on the new one. (The session closes,
/// freeing the backend's holds at once, when the backend's last clone is dropped.)
pub(crate) async fn follow_until_shutdown(
    session: Arc<Session>,
    wakeups: Wakeups,
    max_backoff: Duration,
    shutdown: CancellationToken,
) {
    let _disconnected = Disconnected(&wakeups);
    let mut replaced = session.current.subscribe();
    let mut backoff = Duration::from_millis(20);
    while !shutdown.is_cancelled() {
        replaced.mark_unchanged();
        let client = session.client();
        let mut states = client.state_watcher();
        let mut state = states.state();
        let mut connected = false;
        let ended = loop {
            match state {
                SessionState::SyncConnected | SessionState::ConnectedReadOnly => {
                    if !connected {
                        connected = true;
                        backoff = Duration::from_millis(20);
                        wakeups.connected();
                    }
                    let mut registry = wakeups.registry();
                    let (new, _) = registry.changes();
                    registry.confirmed(new);
                    drop(registry);
                    wakeups.report_subscriptions();
                }
                SessionState::Disconnected => {
                    if connected {
                        connected = false;
                        tracing::debug!("ZooKeeper connection lost; the session may go on");
                        wakeups.disconnected();
                    }
                }
                SessionState::Expired | SessionState::Closed | SessionState::AuthFailed => {
                    break true;
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = wakeups.changed() => {}
                next = states.changed() => state = next,
                // Another call replaced the session: follow the new one.
                _ = replaced.changed() => break false,
            }
        };
        wakeups.disconnected();
        if !ended {
            continue;
        }
        let lost = client.session_id().0;
        loop {
            match session.replace(lost).await {
                Ok(_) => break,
                Err(error) => tracing::debug!(%error, "could not open a new ZooKeeper session"),
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(max_backoff);
        }
    }
}

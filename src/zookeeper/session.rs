//! The backend's session: every hold of the backend is an ephemeral node of it, so a live
//! session keeps every hold, and an ended one (expired, or closed) has lost them all.
//!
//! A connection loss is not a session loss (Curator's lesson): the client reconnects, to
//! any server of the ensemble, and the session with its nodes goes on if it does so within
//! the session timeout. The core counts a hold's lease as half the negotiated timeout from
//! its acquisition or its last renewal, a renewal being a read answered on the session
//! (which the ensemble counts as hearing from the session), so a holder stops before the
//! ensemble could expire the session and free its nodes. Once the session has ended, the
//! backend opens a new one for new holds, every hold is checked at once, and the ended
//! session is closed at the servers, which may still keep it ([`Connect::close`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use zookeeper_client::{Acls, Client, Error as ClientError, SessionInfo, SessionState};

use super::error::ZkError;
use crate::core::kit::backoff::Backoff;
use crate::core::kit::listener::{Listen, Listener, Lost};
use crate::core::runtime::Spawner;
use crate::core::wakeups::Wakeups;
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

    /// Closes the session `abandoned` at the servers, if they still keep it: the client
    /// gives a session up on its side when it could not reach the ensemble for 7/5 of the
    /// session timeout, but the servers expire it only once a leader has heard nothing of
    /// it for the whole timeout, and each new leader starts that count again. While
    /// leaders change, a session the client gave up on keeps its nodes (a hold whose
    /// release could not be sent, a waiting node), which keep its locks from everyone.
    /// So it is taken up again and closed, which deletes them at once; tried again with
    /// backoff until the servers close it or say it expired, or `shutdown`.
    async fn close(&self, abandoned: SessionInfo, shutdown: &CancellationToken) {
        let id = abandoned.id().0;
        let mut backoff = Backoff::up_to(MAX_CLOSE_BACKOFF);
        loop {
            let connecting = Client::connector()
                .with_session(abandoned.clone())
                .with_session_timeout(self.session_timeout)
                .with_connection_timeout(self.connect_timeout)
                .with_fail_eagerly()
                .connect(&self.hosts);
            let retry = match timeout(self.connect_timeout, connecting).await {
                // Dropped, the client sends `CloseSession`, and its task ends once that is
                // answered.
                Ok(Ok(client)) => {
                    tracing::info!(
                        session = format_args!("{id:#x}"),
                        "closed a ZooKeeper session the servers still kept after the client \
                         gave it up; its nodes are deleted"
                    );
                    drop(client);
                    return;
                }
                Ok(Err(ClientError::SessionExpired | ClientError::ClientClosed)) => return,
                Ok(Err(error)) => error.to_string(),
                Err(_) => "timed out".to_owned(),
            };
            tracing::debug!(
                session = format_args!("{id:#x}"),
                error = retry,
                "could not close a session the client gave up; again"
            );
            if !backoff.pause(shutdown).await {
                return;
            }
        }
    }
}

/// The longest pause between two tries to close a session the client gave up.
const MAX_CLOSE_BACKOFF: Duration = Duration::from_secs(1);

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
    /// One replacement at a time, over the id of the last ended session announced: its
    /// loss is logged and rechecked once, however many tries its replacement takes.
    replacing: tokio::sync::Mutex<Option<i64>>,
    /// Raised when a session ended: every hold is checked at once.
    recheck: Recheck,
    /// Where an ended session is closed at the servers (see [`Connect::close`]), until
    /// the backend shuts down.
    closing: (CancellationToken, Spawner),
}

impl Session {
    pub(crate) fn new(
        connect: Connect,
        client: Client,
        recheck: Recheck,
        closing: (CancellationToken, Spawner),
    ) -> Self {
        Session {
            connect,
            current: watch::Sender::new(client),
            replacing: tokio::sync::Mutex::new(None),
            recheck,
            closing,
        }
    }

    /// Cancelled when the backend shuts down: what is tried again until answered stops then.
    pub(crate) fn shutdown(&self) -> &CancellationToken {
        &self.closing.0
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
        let mut announced = self.replacing.lock().await;
        if self.id() != lost {
            return Ok(self.client());
        }
        if Self::announce(&mut announced, lost) {
            tracing::warn!(
                session = format_args!("{lost:#x}"),
                "the ZooKeeper session ended; every hold under it is lost"
            );
            self.recheck.raise("the ZooKeeper session ended");
        }
        let client = self.connect.open().await?;
        let ended = self.current.send_replace(client.clone());
        let (connect, (shutdown, spawner)) = (self.connect.clone(), self.closing.clone());
        let abandoned = ended.session().clone();
        drop(ended);
        spawner.spawn(async move { connect.close(abandoned, &shutdown).await });
        Ok(client)
    }
}

impl Session {
    /// Records that session `lost` ended: `true` the first time.
    fn announce(announced: &mut Option<i64>, lost: i64) -> bool {
        announced.replace(lost) != Some(lost)
    }

    /// Records, for the listening loop that logs it itself, that session `lost` ended:
    /// its holds are checked at once, and [`replace`](Self::replace) logs nothing of it.
    async fn ended(&self, lost: i64) {
        if Self::announce(&mut *self.replacing.lock().await, lost) {
            self.recheck.raise("the ZooKeeper session ended");
        }
    }
}

/// Starts the task that follows the session until `shutdown`: a connected session
/// confirms every waiter's channel (the watches that wake them ride on it); a
/// disconnection wakes every waiter (a deletion may be missed meanwhile); an ended session
/// is replaced, with capped exponential backoff, and every waiter tries again on the new
/// one. (The session closes, freeing the backend's holds at once, when the backend's last
/// clone is dropped.)
pub(crate) fn follow(
    session: Arc<Session>,
    wakeups: Wakeups,
    max_backoff: Duration,
    (shutdown, spawner): (CancellationToken, &Spawner),
) -> Listener {
    let serving = wakeups.clone();
    let make = move || Following {
        session: session.clone(),
        wakeups: serving.clone(),
        ended: None,
    };
    Listener::spawn(wakeups, make, max_backoff, (shutdown, spawner))
}

/// The session, as the store kit's loop drives it.
struct Following {
    session: Arc<Session>,
    wakeups: Wakeups,
    /// The id of the session that ended, to be replaced by the next connect.
    ended: Option<i64>,
}

impl Listen for Following {
    const NAME: &'static str = "ZooKeeper session";
    type Connection = Client;

    /// The current session, or a new one in place of the one that ended.
    async fn connect(&mut self) -> Result<Client, String> {
        let Some(lost) = self.ended else {
            return Ok(self.session.client());
        };
        let client = self
            .session
            .replace(lost)
            .await
            .map_err(|e| e.to_string())?;
        self.ended = None;
        Ok(client)
    }

    async fn serve(&mut self, mut client: Client, proven: &mut bool) -> Lost {
        let mut replaced = self.session.current.subscribe();
        loop {
            replaced.mark_unchanged();
            match self.follow(&client, &mut replaced, proven).await {
                // Another call replaced the session: follow the new one.
                Followed::Replaced => client = self.session.client(),
                Followed::Ended(state) => {
                    let lost = client.session_id().0;
                    self.session.ended(lost).await;
                    self.ended = Some(lost);
                    return Lost::Failed(format!(
                        "the session {lost:#x} ended ({state:?}); every hold under it is lost"
                    ));
                }
            }
        }
    }
}

/// How following one session ended.
enum Followed {
    /// Another call replaced it.
    Replaced,
    /// It expired, closed, or its authentication failed.
    Ended(SessionState),
}

impl Following {
    /// Follows `client`'s session until it ends or is replaced. Sets `proven` once it is
    /// connected.
    async fn follow(
        &self,
        client: &Client,
        replaced: &mut watch::Receiver<Client>,
        proven: &mut bool,
    ) -> Followed {
        let wakeups = &self.wakeups;
        let mut states = client.state_watcher();
        let mut state = states.state();
        let mut connected = false;
        loop {
            match state {
                SessionState::SyncConnected | SessionState::ConnectedReadOnly => {
                    if !connected {
                        connected = true;
                        *proven = true;
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
                    return Followed::Ended(state);
                }
            }
            tokio::select! {
                () = wakeups.changed() => {}
                next = states.changed() => state = next,
                _ = replaced.changed() => {
                    wakeups.disconnected();
                    return Followed::Replaced;
                }
            }
        }
    }
}

//! The cluster's members as the backend calls them: one connection per endpoint, every
//! call sent to the member in use, and a call that member could not take (it is down,
//! unreachable, or has no leader) sent to the next member, each member once.
//!
//! etcd-client balances one channel over every endpoint: with a member down, the calls
//! that channel sends there fail (a third of them with one member of three down), and
//! none is sent again elsewhere. Here the backend keeps to one member while it answers,
//! as etcd's own Go client pins one endpoint, and moves on only when a call proves that
//! member cannot take it. A call moves on only when it surely did not run: the member
//! could not be connected to, or refused it for want of a leader (the backend asks for
//! one, see the builder) before looking at it; a read moves on also when its answer never
//! came (a read that ran changed nothing). A write that was sent and whose answer never
//! came may have run: it fails, and the caller settles what it did on the next member (an
//! exclusive acquisition's next round reads whether its hold was put or re-entered, see
//! `Settle` in `rw.rs`), as etcd is linearizable.
//!
//! A member that does not answer within its share of the command timeout (with more than
//! one member, a quarter of it and at most 500 ms) is passed over as down too: a paused member, one cut off
//! from the network, or a follower holding a call it forwarded to a leader that died; a
//! write it did not answer fails as above, and later calls start on the next member. And
//! while they elect a leader (a member says it has none or holds the call past its share,
//! and no other takes it), the call goes round the members again, after a pause of 25 ms
//! doubling up to 250 ms, until the command timeout: an election takes about a second
//! with etcd's defaults. A call that every member refused to connect fails at once.
//!
//! An operator reads one WARN line when a member is found down, naming it and the cause,
//! and one INFO line when it answers again; calls meanwhile go to the others, silently.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{
    Client, ConnectOptions, Error as ClientError, GetOptions, GetResponse, LeaseGrantResponse,
    LeaseKeepAliveStream, LeaseKeeper, LeaseRevokeResponse, LeaseTimeToLiveResponse, Txn,
    TxnResponse, WatchOptions, WatchStream,
};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::error::{code, status_code, unanswered};

/// Which failures of a call send it to the next member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Moves {
    /// Only those of a call that surely did not run ([`not_taken`]): a write.
    IfNotTaken,
    /// Also those of a call whose answer never came: a read.
    IfUnanswered,
}

/// One member's endpoint and connection.
struct Member {
    endpoint: String,
    /// Connected on first use (with credentials, connecting authenticates: a member down
    /// at build is connected to when it is first needed).
    client: OnceCell<Client>,
    /// Found down, and said so.
    down: AtomicBool,
}

/// The cluster's members (see the module docs).
pub(crate) struct Members {
    members: Vec<Member>,
    /// The member calls go to first: the last one that took a call. Its watchers are told
    /// each time calls move to another member (see [`moves`](Members::moves)).
    current: tokio::sync::watch::Sender<usize>,
    /// The highest revision a transaction's answer carried: whatever a later write puts
    /// gets a higher one.
    seen: AtomicI64,
    options: ConnectOptions,
    /// How long a call may go round the members (milliseconds): the connect timeout while
    /// `build()` connects, the command timeout after.
    command_timeout: AtomicU64,
}

/// The longest a member of several has to answer a call (see [`Members::share`]): a call
/// etcd takes answers in milliseconds.
const MAX_SHARE: Duration = Duration::from_millis(500);

/// The first pause before a call goes round the members again, and the longest.
const FIRST_PAUSE: Duration = Duration::from_millis(25);
const LONGEST_PAUSE: Duration = Duration::from_millis(250);

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let endpoints: Vec<&str> = self.members.iter().map(|m| &*m.endpoint).collect();
        f.debug_struct("Members")
            .field("endpoints", &endpoints)
            .field("current", &*self.current.borrow())
            .finish_non_exhaustive()
    }
}

impl Members {
    /// The members at `endpoints` (at least one), connected to with `options` when first
    /// called; a call goes round them for up to `command_timeout`.
    pub(crate) fn new(
        endpoints: Vec<String>,
        options: ConnectOptions,
        command_timeout: Duration,
    ) -> Self {
        let members = endpoints
            .into_iter()
            .map(|endpoint| Member {
                endpoint,
                client: OnceCell::new(),
                down: AtomicBool::new(false),
            })
            .collect();
        Members {
            members,
            current: tokio::sync::watch::Sender::new(0),
            seen: AtomicI64::new(0),
            options,
            command_timeout: AtomicU64::new(millis(command_timeout)),
        }
    }

    /// From now on a call goes round the members for up to `command_timeout`.
    pub(crate) fn set_command_timeout(&self, command_timeout: Duration) {
        self.command_timeout
            .store(millis(command_timeout), Ordering::Relaxed);
    }

    fn command_timeout(&self) -> Duration {
        Duration::from_millis(self.command_timeout.load(Ordering::Relaxed))
    }

    /// The highest revision an answered transaction carried so far: a key whose create
    /// revision is above it was put by a write sent after this was read.
    pub(crate) fn seen(&self) -> i64 {
        self.seen.load(Ordering::Acquire)
    }

    /// Runs `call` on the member in use; one that member could not take runs on the next
    /// (see [`Moves`]), and so on, each member once, and round again while none could take
    /// it and the command timeout lasts (see the module docs). The error is the last
    /// member's.
    async fn call<T, F, R>(&self, moves: Moves, call: F) -> Result<T, ClientError>
    where
        F: FnMut(&Client) -> R,
        R: Future<Output = Result<T, ClientError>>,
    {
        Ok(self.call_at(moves, call).await?.0)
    }

    /// [`call`](Self::call), with the index of the member that answered.
    async fn call_at<T, F, R>(&self, moves: Moves, mut call: F) -> Result<(T, usize), ClientError>
    where
        F: FnMut(&Client) -> R,
        R: Future<Output = Result<T, ClientError>>,
    {
        let deadline = Instant::now() + self.command_timeout();
        let share = self.share();
        let mut pause = FIRST_PAUSE;
        loop {
            let first = *self.current.borrow();
            let (mut last, mut electing) = (None, false);
            for step in 0..self.members.len() {
                let at = (first + step) % self.members.len();
                let member = &self.members[at];
                let bound = share.min(deadline.saturating_duration_since(Instant::now()));
                let answer = tokio::time::timeout(bound, async {
                    match self.client(member).await {
                        Ok(client) => call(client).await,
                        Err(e) => Err(e),
                    }
                })
                .await
                .unwrap_or_else(|_| Err(no_answer(bound)));
                match answer {
                    Err(e) if not_taken(&e) || (moves == Moves::IfUnanswered && unanswered(&e)) => {
                        self.down(member, &e);
                        // A member with no leader says so, or holds the call until one is
                        // elected (past its share).
                        electing |= no_leader(&e) || unanswered(&e);
                        last = Some(e);
                    }
                    Err(e) if unanswered(&e) => {
                        // A write that may have run: the caller settles it, and later
                        // calls start on the next member.
                        self.pass_over(at, &e);
                        return Err(e);
                    }
                    answer => {
                        if member.down.swap(false, Ordering::Relaxed) {
                            tracing::info!(member = %member.endpoint, "etcd member answers again");
                        }
                        if step > 0 {
                            // Moved on: later calls start here. A call that moved on at the
                            // same time may have stored its own; either member answers.
                            self.move_to(at);
                        }
                        return answer.map(|answer| (answer, at));
                    }
                }
            }
            let last =
                last.unwrap_or_else(|| ClientError::InvalidArgs("no etcd endpoint".to_owned()));
            // None could take the call: while they elect a leader (one said so, or held
            // it), round again after a pause, as long as time is left. Members that all
            // refused to connect are down: the call fails at once.
            if !electing || Instant::now() + pause >= deadline {
                return Err(last);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(LONGEST_PAUSE);
        }
    }

    /// How long one member has to answer a call before it is passed over: the command
    /// timeout with one member; with more, a quarter of it and at most [`MAX_SHARE`], so
    /// that a call can go round while an election makes every member hold what it is sent.
    pub(crate) fn share(&self) -> Duration {
        match self.members.len() {
            1 => self.command_timeout(),
            _ => (self.command_timeout() / 4).min(MAX_SHARE),
        }
    }

    /// Passes over member `at`, which left a write unanswered or failed a stream of its
    /// own (a lease's keep-alive): it is down, and later calls start on the next member
    /// (unless another call moved them meanwhile).
    pub(crate) fn pass_over(&self, at: usize, e: &ClientError) {
        self.down(&self.members[at], e);
        let next = (at + 1) % self.members.len();
        self.current.send_if_modified(|current| {
            let moved = *current == at && next != at;
            if moved {
                *current = next;
            }
            moved
        });
    }

    /// Later calls start on member `at`.
    fn move_to(&self, at: usize) {
        self.current.send_if_modified(|current| {
            let moved = *current != at;
            *current = at;
            moved
        });
    }

    /// The member calls start on, told each time they move to another one: a stream open
    /// on a member that calls have left (the watch) moves with them, as that member failed
    /// a call or went unanswered.
    pub(crate) fn moves(&self) -> tokio::sync::watch::Receiver<usize> {
        self.current.subscribe()
    }

    /// Says once that `member` is down, with why.
    fn down(&self, member: &Member, e: &ClientError) {
        if !member.down.swap(true, Ordering::Relaxed) {
            let (member, error) = (&member.endpoint, reason(e));
            if self.members.len() > 1 {
                tracing::warn!(%member, %error, "etcd member down; calls go to the other members");
            } else {
                tracing::warn!(%member, %error, "etcd member down");
            }
        }
    }

    /// `member`'s connection, connected now if it is not yet.
    async fn client<'a>(&self, member: &'a Member) -> Result<&'a Client, ClientError> {
        member
            .client
            .get_or_try_init(|| {
                Client::connect([member.endpoint.as_str()], Some(self.options.clone()))
            })
            .await
    }
}

/// What a failed call says of its member, in a line: the status's message and the
/// innermost cause (`tcp connect error: Connection refused (os error 111)`), not
/// etcd-client's debug print of the whole chain.
fn reason(e: &ClientError) -> String {
    let ClientError::GRpcStatus(status) = e else {
        return e.to_string();
    };
    let mut innermost: Option<&(dyn std::error::Error + 'static)> = None;
    let mut cause = std::error::Error::source(status);
    while let Some(error) = cause {
        innermost = Some(error);
        cause = error.source();
    }
    match innermost {
        Some(root) if root.to_string() != status.message() => {
            format!("{}: {root}", status.message())
        }
        _ => status.message().to_owned(),
    }
}

/// `d` in whole milliseconds (the settings are clamped far below `u64::MAX` of them).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The error of a call a member did not answer within `bound`.
pub(crate) fn no_answer(bound: Duration) -> ClientError {
    ClientError::GRpcStatus(tonic::Status::deadline_exceeded(format!(
        "no answer within {bound:?}"
    )))
}

/// The member refused the call for want of a leader (asked to, see the builder).
fn no_leader(e: &ClientError) -> bool {
    matches!(e, ClientError::GRpcStatus(status)
        if status_code(e) == Some(code::UNAVAILABLE) && status.message().contains("no leader"))
}

/// The member did not take the call, so that another one may, and the call surely did
/// not run: no connection could be made to it, or it has no leader (asked to refuse
/// then, it does so before looking at the call).
pub(crate) fn not_taken(e: &ClientError) -> bool {
    let ClientError::GRpcStatus(status) = e else {
        // etcd-client's own errors come before any call is sent.
        return matches!(e, ClientError::TransportError(_));
    };
    if no_leader(e) {
        return true;
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(status);
    while let Some(error) = cause {
        if error.is::<tonic::ConnectError>() {
            return true;
        }
        cause = error.source();
    }
    false
}

/// The calls the backend makes, each on the member in use (see [`Members::call`]).
impl Members {
    /// A transaction that may write.
    pub(crate) async fn txn(&self, txn: Txn) -> Result<TxnResponse, ClientError> {
        self.transaction(Moves::IfNotTaken, txn).await
    }

    /// A transaction that only reads.
    pub(crate) async fn read(&self, txn: Txn) -> Result<TxnResponse, ClientError> {
        self.transaction(Moves::IfUnanswered, txn).await
    }

    async fn transaction(&self, moves: Moves, txn: Txn) -> Result<TxnResponse, ClientError> {
        let reply = self
            .call(moves, |client| {
                let (mut kv, txn) = (client.kv_client(), txn.clone());
                async move { kv.txn(txn).await }
            })
            .await?;
        if let Some(header) = reply.header() {
            self.seen.fetch_max(header.revision(), Ordering::AcqRel);
        }
        Ok(reply)
    }

    pub(crate) async fn get(
        &self,
        key: impl Into<Vec<u8>>,
        options: Option<GetOptions>,
    ) -> Result<GetResponse, ClientError> {
        let key = key.into();
        self.call(Moves::IfUnanswered, |client| {
            let (mut kv, key, options) = (client.kv_client(), key.clone(), options.clone());
            async move { kv.get(key, options).await }
        })
        .await
    }

    /// Grants a lease. One granted by a call whose answer never came has nothing on it,
    /// and expires: the call moves on.
    pub(crate) async fn grant(&self, ttl_secs: i64) -> Result<LeaseGrantResponse, ClientError> {
        self.call(Moves::IfUnanswered, |client| {
            let mut leases = client.lease_client();
            async move { leases.grant(ttl_secs, None).await }
        })
        .await
    }

    /// How long a lease still lives, in whole seconds (`-1` once it expired).
    pub(crate) async fn time_to_live(
        &self,
        lease: i64,
    ) -> Result<LeaseTimeToLiveResponse, ClientError> {
        self.call(Moves::IfUnanswered, |client| {
            let mut leases = client.lease_client();
            async move { leases.time_to_live(lease, None).await }
        })
        .await
    }

    /// Revokes a lease (once revoked, it stays so).
    pub(crate) async fn revoke(&self, lease: i64) -> Result<LeaseRevokeResponse, ClientError> {
        self.call(Moves::IfUnanswered, |client| {
            let mut leases = client.lease_client();
            async move { leases.revoke(lease).await }
        })
        .await
    }

    /// Opens a keep-alive stream of `lease` (which keeps it alive): on the member it names.
    pub(crate) async fn keep_alive(
        &self,
        lease: i64,
    ) -> Result<(usize, LeaseKeeper, LeaseKeepAliveStream), ClientError> {
        // Opens a stream, and keeps the lease alive: either may run twice.
        let ((keeper, answers), at) = self
            .call_at(Moves::IfUnanswered, |client| {
                let mut leases = client.lease_client();
                async move { leases.keep_alive(lease).await }
            })
            .await?;
        Ok((at, keeper, answers))
    }

    /// Opens a watch: on the member it names.
    pub(crate) async fn watch(
        &self,
        key: impl Into<Vec<u8>>,
        options: WatchOptions,
    ) -> Result<(usize, WatchStream), ClientError> {
        let key = key.into();
        let (stream, at) = self
            .call_at(Moves::IfUnanswered, |client| {
                let (mut watches, key, options) =
                    (client.watch_client(), key.clone(), options.clone());
                async move { watches.watch(key, Some(options)).await }
            })
            .await?;
        Ok((at, stream))
    }
}

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
//! An operator reads one WARN line when a member is found down, naming it and the cause,
//! and one INFO line when it answers again; calls meanwhile go to the others, silently.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};

use etcd_client::{
    Client, ConnectOptions, Error as ClientError, GetOptions, GetResponse, LeaseGrantResponse,
    LeaseKeepAliveStream, LeaseKeeper, LeaseRevokeResponse, LeaseTimeToLiveResponse, Txn,
    TxnResponse, WatchOptions, WatchStream,
};
use tokio::sync::OnceCell;

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
    /// The member calls go to first: the last one that took a call.
    current: AtomicUsize,
    /// The highest revision a transaction's answer carried: whatever a later write puts
    /// gets a higher one.
    seen: AtomicI64,
    options: ConnectOptions,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let endpoints: Vec<&str> = self.members.iter().map(|m| &*m.endpoint).collect();
        f.debug_struct("Members")
            .field("endpoints", &endpoints)
            .field("current", &self.current.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Members {
    /// The members at `endpoints` (at least one), connected to with `options` when first
    /// called.
    pub(crate) fn new(endpoints: Vec<String>, options: ConnectOptions) -> Self {
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
            current: AtomicUsize::new(0),
            seen: AtomicI64::new(0),
            options,
        }
    }

    /// The highest revision an answered transaction carried so far: a key whose create
    /// revision is above it was put by a write sent after this was read.
    pub(crate) fn seen(&self) -> i64 {
        self.seen.load(Ordering::Acquire)
    }

    /// Runs `call` on the member in use; one that member could not take runs on the next
    /// (see [`Moves`]), and so on, each member once. The error is the last member's.
    async fn call<T, F, R>(&self, moves: Moves, mut call: F) -> Result<T, ClientError>
    where
        F: FnMut(&Client) -> R,
        R: Future<Output = Result<T, ClientError>>,
    {
        let first = self.current.load(Ordering::Relaxed);
        let mut last = None;
        for step in 0..self.members.len() {
            let at = (first + step) % self.members.len();
            let member = &self.members[at];
            let answer = match self.client(member).await {
                Ok(client) => call(client).await,
                Err(e) => Err(e),
            };
            match answer {
                Err(e) if not_taken(&e) || (moves == Moves::IfUnanswered && unanswered(&e)) => {
                    if !member.down.swap(true, Ordering::Relaxed) {
                        let (member, error) = (&member.endpoint, reason(&e));
                        if self.members.len() > 1 {
                            tracing::warn!(%member, %error, "etcd member down; calls go to the other members");
                        } else {
                            tracing::warn!(%member, %error, "etcd member down");
                        }
                    }
                    last = Some(e);
                }
                answer => {
                    if member.down.swap(false, Ordering::Relaxed) {
                        tracing::info!(member = %member.endpoint, "etcd member answers again");
                    }
                    if step > 0 {
                        // Moved on: later calls start here. A call that moved on at the
                        // same time may have stored its own; either member answers.
                        self.current.store(at, Ordering::Relaxed);
                    }
                    return answer;
                }
            }
        }
        Err(last.unwrap_or_else(|| ClientError::InvalidArgs("no etcd endpoint".to_owned())))
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

/// The member did not take the call, so that another one may, and the call surely did
/// not run: no connection could be made to it, or it has no leader (asked to refuse
/// then, it does so before looking at the call).
pub(crate) fn not_taken(e: &ClientError) -> bool {
    let ClientError::GRpcStatus(status) = e else {
        // etcd-client's own errors come before any call is sent.
        return matches!(e, ClientError::TransportError(_));
    };
    if status_code(e) == Some(code::UNAVAILABLE) && status.message().contains("no leader") {
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

    pub(crate) async fn keep_alive(
        &self,
        lease: i64,
    ) -> Result<(LeaseKeeper, LeaseKeepAliveStream), ClientError> {
        // Opens a stream, and keeps the lease alive: either may run twice.
        self.call(Moves::IfUnanswered, |client| {
            let mut leases = client.lease_client();
            async move { leases.keep_alive(lease).await }
        })
        .await
    }

    pub(crate) async fn watch(
        &self,
        key: impl Into<Vec<u8>>,
        options: WatchOptions,
    ) -> Result<WatchStream, ClientError> {
        let key = key.into();
        self.call(Moves::IfUnanswered, |client| {
            let (mut watches, key, options) = (client.watch_client(), key.clone(), options.clone());
            async move { watches.watch(key, Some(options)).await }
        })
        .await
    }
}

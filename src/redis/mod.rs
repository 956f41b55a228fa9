//! The Redis backend: Redisson-style reentrant hash locks driven by Lua scripts.
//!
//! Each backend owns a bb8 pool of multiplexed command connections, one subscriber
//! connection that carries the release channels of every key with local waiters, and one
//! watchdog task that renews held leases in batches. Its background tasks stop when the
//! last clone of the backend and the last guard it issued are dropped.
//!
//! Tasks of one backend that wait for the same key queue in-process (see `queue.rs`):
//! only the first talks to Redis, and a release hands the lock straight to the next task
//! in line, in one script, for up to
//! [`max_local_handoffs`](RedisBackendBuilder::max_local_handoffs) times in a row while
//! other instances wait.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_lock::RedisBackend;
//!
//! # async fn run() -> Result<(), tower_lock::BuildError> {
//! let backend = RedisBackend::builder("redis://127.0.0.1:6379")
//!     .namespace("shop")
//!     .pool_size(8)
//!     .command_timeout(Duration::from_millis(500))
//!     .build()
//!     .await?;
//! # drop(backend);
//! # Ok(())
//! # }
//! ```

mod fence;
mod pool;
mod pubsub;
mod queue;
mod runtime;
mod scripts;
mod watchdog;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::ScriptInvocation;
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use self::fence::{FencedStore, FencedValue, FencedWrite};
use self::pool::{CommandError, Conn, Pool};
use self::pubsub::{Subscriber, SubscriberConfig};
use self::queue::{Claim, Entry, Grant, Queues, Slot};
use self::runtime::Spawner;
use self::scripts::Scripts;
use self::watchdog::{OnLost, Watchdog, millis};
use crate::backend::LockBackend;
use crate::error::{BuildError, LockError};
use crate::key::LockKey;
use crate::lock::{BoxFuture, HeldLock, LockGuard, LockOwner, LockRequest, Mode, ReleaseHold};

/// Default upper bound on a key's length in bytes.
pub const DEFAULT_MAX_KEY_LEN: usize = 1024;

/// A command never gets less time than this, even right at a wait's deadline, so that a
/// final attempt is not failed by its own budget on a busy machine.
const MIN_COMMAND_BUDGET: Duration = Duration::from_millis(250);

/// Default bound on consecutive handoffs within one process while other instances wait.
pub const DEFAULT_MAX_LOCAL_HANDOFFS: u32 = 4;

/// Distributed locks on one Redis server. Cheap to clone; clones share connections.
///
/// Create one per process with [`connect`](Self::connect) or [`builder`](Self::builder)
/// and hand clones to every [`LockLayer`](crate::LockLayer).
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    scripts: Arc<Scripts>,
    subscriber: Subscriber,
    watchdog: Watchdog,
    queues: Queues,
    max_local_handoffs: u32,
    namespace: String,
    max_key_len: usize,
    command_timeout: Duration,
    fence_ttl: Duration,
    instance: String,
    sequence: AtomicU64,
    runtime: Spawner,
    shutdown: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl RedisBackend {
    /// Connects with default settings. Fails if Redis does not answer a PING.
    pub async fn connect(url: &str) -> Result<Self, BuildError> {
        Self::builder(url).build().await
    }

    /// Starts configuring a backend for the Redis server at `url`
    /// (`redis://[:password@]host:port[/db]`).
    pub fn builder(url: impl Into<String>) -> RedisBackendBuilder {
        RedisBackendBuilder {
            url: url.into(),
            pool_size: 4,
            namespace: "tower-lock".to_owned(),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            connect_timeout: Duration::from_secs(1),
            command_timeout: Duration::from_secs(1),
            fence_ttl: Duration::from_secs(7 * 24 * 3600),
            ping_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(2),
            max_local_handoffs: DEFAULT_MAX_LOCAL_HANDOFFS,
        }
    }

    /// Starts building an acquisition of `key` (see [`LockRequest`]).
    pub fn lock(&self, key: impl Into<String>) -> LockRequest<Self> {
        LockBackend::lock(self, key)
    }

    /// A snapshot of the backend's connections and bookkeeping.
    pub fn stats(&self) -> BackendStats {
        let subscriber = &self.inner.subscriber;
        BackendStats {
            subscriber_connected: subscriber.is_connected(),
            subscriber_connections_made: subscriber.connections_made(),
            channels_with_waiters: subscriber.channels_with_waiters(),
            watched_locks: self.inner.watchdog.watched(),
            local_queues: self.inner.queues.keys(),
            local_waiters: self.inner.queues.waiting(),
        }
    }

    /// The namespace that prefixes every Redis key of this backend.
    pub fn namespace(&self) -> &str {
        &self.inner.namespace
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("namespace", &self.inner.namespace)
            .field("instance", &self.inner.instance)
            .finish_non_exhaustive()
    }
}

/// A snapshot returned by [`RedisBackend::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackendStats {
    /// Whether the subscriber connection is up.
    pub subscriber_connected: bool,
    /// How many times the subscriber connection has been established (1 + reconnects).
    pub subscriber_connections_made: u64,
    /// Release channels with at least one local waiter.
    pub channels_with_waiters: usize,
    /// Held locks the watchdog is renewing or watching.
    pub watched_locks: usize,
    /// Keys with a task of this backend contending for, holding or queued on them. Entries
    /// are removed when the last task leaves, so this returns to 0 when the backend is idle.
    pub local_queues: usize,
    /// Tasks queued in-process behind another task of this backend for the same key.
    pub local_waiters: usize,
}

/// Configures a [`RedisBackend`]; created by [`RedisBackend::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct RedisBackendBuilder {
    url: String,
    pool_size: u32,
    namespace: String,
    max_key_len: usize,
    connect_timeout: Duration,
    command_timeout: Duration,
    fence_ttl: Duration,
    ping_interval: Duration,
    max_backoff: Duration,
    max_local_handoffs: u32,
}

impl RedisBackendBuilder {
    /// Number of multiplexed command connections (default 4). Each carries many
    /// concurrent commands, so a handful is plenty.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// Prefix of every Redis key and channel (default `tower-lock`). Services that must
    /// not contend with each other use different namespaces. Must not contain `{`, `}` or
    /// control characters.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// Longest accepted key in bytes (default 1024). Longer keys are rejected with
    /// [`KeyError::TooLong`](crate::KeyError::TooLong), never truncated.
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.max_key_len = len;
        self
    }

    /// How long to wait for a new connection (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one command may take before it counts as failed (default 1 s). Waiting
    /// for a held lock is not a command: it is bounded by the wait, not by this.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// How long a key's fencing counter is kept after its last acquisition (default
    /// 7 days). Tokens never fall below the Redis clock in microseconds, so they keep
    /// increasing after the counter expires as long as that clock does not go back.
    pub fn fence_ttl(mut self, ttl: Duration) -> Self {
        self.fence_ttl = ttl;
        self
    }

    /// How often the subscriber connection is pinged to detect a half-open connection
    /// (default 1 s).
    pub fn subscriber_ping_interval(mut self, interval: Duration) -> Self {
        self.ping_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// How many times in a row a release may hand the lock straight to the next task of
    /// this backend while tasks of other instances wait for it (default 4). Then it is
    /// released for real and the other instances go first, so they are not starved. With
    /// no other instance waiting, handoffs go on without a bound; 0 turns handoff off.
    pub fn max_local_handoffs(mut self, max: u32) -> Self {
        self.max_local_handoffs = max;
        self
    }

    /// Connects and starts the backend's tasks. Must be called inside a Tokio runtime.
    ///
    /// The backend may be used from other runtimes too, also after this one shut down (a
    /// `static` shared by `#[tokio::test]`s): its tasks run on the caller's runtime, and
    /// its connections and background tasks are started again there when theirs is gone.
    ///
    /// Fails with the cause as soon as it is known (connection refused, unknown host,
    /// wrong password, ...); only a server that does not answer takes the connect timeout.
    pub async fn build(self) -> Result<RedisBackend, BuildError> {
        validate_namespace(&self.namespace)?;
        let client = redis::Client::open(self.url.as_str()).map_err(|e| BuildError::Url {
            source: Box::new(e),
        })?;
        let runtime = Spawner::current();
        let shutdown = CancellationToken::new();
        let scripts = Arc::new(Scripts::new());
        let pool = Pool::new(
            client.clone(),
            self.pool_size,
            self.connect_timeout,
            self.command_timeout,
        );
        // The pool bounds the connect by the connect timeout and the reply by the command
        // timeout, so no outer timeout is needed (one would cut a slow connect short).
        pool.query::<String>(&redis::cmd("PING"))
            .await
            .map_err(|e| BuildError::Connect {
                source: e.into_cause(),
            })?;
        for script in scripts.all() {
            pool.load(script).await.map_err(|e| BuildError::Scripts {
                source: e.into_cause(),
            })?;
        }
        let subscriber = Subscriber::spawn(
            client,
            SubscriberConfig {
                connect_timeout: self.connect_timeout,
                command_timeout: self.command_timeout,
                ping_interval: self.ping_interval,
                max_backoff: self.max_backoff,
            },
            pool.suspicion(),
            shutdown.clone(),
            &runtime,
        );
        let watchdog = Watchdog::spawn(
            pool.clone(),
            scripts.clone(),
            self.command_timeout,
            shutdown.clone(),
            &runtime,
        );
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                pool,
                scripts,
                subscriber,
                watchdog,
                queues: Queues::default(),
                max_local_handoffs: self.max_local_handoffs,
                namespace: self.namespace,
                max_key_len: self.max_key_len,
                command_timeout: self.command_timeout,
                fence_ttl: self.fence_ttl,
                instance: uuid::Uuid::new_v4().simple().to_string(),
                sequence: AtomicU64::new(0),
                runtime,
                shutdown,
            }),
        })
    }
}

fn validate_namespace(namespace: &str) -> Result<(), BuildError> {
    if namespace.is_empty()
        || namespace.contains(['{', '}'])
        || namespace.contains(char::is_control)
    {
        return Err(BuildError::Namespace {
            namespace: namespace.to_owned(),
        });
    }
    Ok(())
}

impl LockBackend for RedisBackend {
    fn acquire(
        self,
        request: LockRequest<Self>,
    ) -> BoxFuture<'static, Result<LockGuard, LockError>> {
        Box::pin(self.inner.acquire(request))
    }

    fn new_owner(&self) -> LockOwner {
        self.inner.new_owner()
    }
}

/// What one run of the acquire script found.
enum Attempt {
    Acquired {
        token: u64,
        sent_at: Instant,
    },
    /// Held by another owner, for about this much longer (`None`: no expiry set).
    Held(Option<Duration>),
}

#[derive(Debug)]
struct UnexpectedReply(&'static str);

impl fmt::Display for UnexpectedReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unexpected reply from the {} script", self.0)
    }
}

impl std::error::Error for UnexpectedReply {}

impl Inner {
    fn new_owner(&self) -> LockOwner {
        let seq = self.sequence.fetch_add(1, Ordering::Relaxed);
        LockOwner::new(format!("{}:{seq}", self.instance))
    }

    fn acquire(
        self: &Arc<Self>,
        request: LockRequest<RedisBackend>,
    ) -> impl Future<Output = Result<LockGuard, LockError>> + Send + 'static {
        // A rejected key may be huge or hold control characters: never log it raw.
        let shown = if request.key.len() <= self.max_key_len {
            request.key.as_str()
        } else {
            "<oversized key>"
        };
        let span = tracing::info_span!(
            "lock.acquire",
            key = ?shown,
            mode = match request.mode { Mode::TryOnce => "try_once", Mode::Wait(_) => "wait" },
            waited_ms = tracing::field::Empty,
            outcome = tracing::field::Empty,
            token = tracing::field::Empty,
        );
        let this = self.clone();
        async move {
            let started = Instant::now();
            let result = this.acquire_traced(request).await;
            let span = tracing::Span::current();
            span.record(
                "waited_ms",
                u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            );
            match &result {
                Ok(guard) => {
                    span.record("outcome", "acquired");
                    span.record("token", guard.fencing_token());
                }
                Err(e) => {
                    span.record("outcome", outcome(e));
                }
            }
            tracing::debug!("lock acquisition finished");
            result
        }
        .instrument(span)
    }

    async fn acquire_traced(
        self: Arc<Self>,
        request: LockRequest<RedisBackend>,
    ) -> Result<LockGuard, LockError> {
        let key = Arc::new(LockKey::new(
            &self.namespace,
            request.key,
            self.max_key_len,
        )?);
        let owner = match request.owner {
            Some(owner) => owner,
            None => self.new_owner(),
        };
        let started = Instant::now();
        let deadline = match request.mode {
            Mode::TryOnce => None,
            Mode::Wait(wait) => Some(started + wait),
        };
        let c = Contender {
            key,
            claim: Claim {
                owner,
                lease: request.lease,
                renew: request.watchdog,
            },
            started,
            deadline,
        };
        let limit = deadline.map(|_| request.max_local_waiters);
        loop {
            let slot = match (self.queues.enter(&c.key.lock, &c.claim, limit), deadline) {
                (Entry::Head(slot), _) => Some(slot),
                (Entry::Reentrant, _) => None,
                (Entry::Full, _) => {
                    return Err(LockError::QueueFull {
                        key: c.key.user.clone(),
                    });
                }
                (Entry::Busy, _) | (Entry::Queued(_), None) => {
                    return Err(Box::pin(self.busy(&c)).await);
                }
                (Entry::Queued(mut ticket), Some(deadline)) => {
                    let grant = tokio::select! {
                        grant = ticket.granted() => grant,
                        _ = sleep_until(deadline) => match ticket.try_granted() {
                            Some(Grant::Handoff(guard)) => return Ok(guard),
                            // A slot that came just now passes on with the ticket.
                            _ => return Err(c.timed_out(None)),
                        },
                    };
                    match grant {
                        Some(Grant::Handoff(guard)) => return Ok(guard),
                        Some(Grant::Slot(slot)) => Some(*slot),
                        None => continue,
                    }
                }
            };
            // Boxed, so that the many tasks waiting in a queue do not each carry the space
            // of the Redis round trips that only the one contender makes.
            return Box::pin(self.contend(&c, slot)).await;
        }
    }

    /// The answer to a try while another task of this backend has the key: no attempt,
    /// which would jump the queue, only the holder's remaining lease for `Retry-After`.
    async fn busy(&self, c: &Contender) -> LockError {
        let mut pttl = redis::cmd("PTTL");
        pttl.arg(&*c.key.lock);
        let retry_after = match timeout(self.command_timeout, self.pool.query::<i64>(&pttl)).await {
            Ok(Ok(ms)) => u64::try_from(ms).ok().map(Duration::from_millis),
            _ => None,
        };
        LockError::Contended {
            key: c.key.user.clone(),
            retry_after,
        }
    }

    /// Takes the lock in Redis: try -> subscribe -> try again -> wait for a release or for
    /// the holder's lease -> loop. Holding `slot`, this is the only task of the backend
    /// doing so for the key; the slot goes into the guard.
    async fn contend(
        self: &Arc<Self>,
        c: &Contender,
        slot: Option<Slot>,
    ) -> Result<LockGuard, LockError> {
        let mut pttl = None;
        // A slot passed on by a release that ended a handoff streak skips the first try:
        // the task waits for its subscription to be confirmed, a round trip in which the
        // other instances, woken by that release, get their turn.
        if !slot.as_ref().is_some_and(Slot::yielded) {
            match self.attempt(c).await? {
                Attempt::Acquired { token, sent_at } => {
                    return Ok(self.guard(c.key.clone(), c.claim.clone(), token, sent_at, slot));
                }
                Attempt::Held(p) => pttl = p,
            }
        }
        let Some(deadline) = c.deadline else {
            return Err(LockError::Contended {
                key: c.key.user.clone(),
                retry_after: pttl,
            });
        };
        // Subscribe, then try again before sleeping: a release published between the
        // failed attempt and the subscription would otherwise be missed (Redisson #5761).
        // The waiter starts with a permit when its channel is already subscribed, and gets
        // one when the subscription is confirmed, so the next attempt follows either way.
        let waiter = self.subscriber.register(&c.key.channel);
        loop {
            let nap = pttl.map_or(deadline, |p| (Instant::now() + p).min(deadline));
            tokio::select! {
                _ = waiter.woken() => {}
                _ = sleep_until(nap) => {}
            }
            match self.attempt(c).await? {
                Attempt::Acquired { token, sent_at } => {
                    drop(waiter);
                    return Ok(self.guard(c.key.clone(), c.claim.clone(), token, sent_at, slot));
                }
                Attempt::Held(p) => pttl = p,
            }
            if Instant::now() >= deadline {
                return Err(c.timed_out(pttl));
            }
        }
    }

    /// Runs the acquire script once.
    async fn attempt(self: &Arc<Self>, c: &Contender) -> Result<Attempt, LockError> {
        let budget = match c.deadline {
            Some(deadline) => self.command_timeout.min(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(MIN_COMMAND_BUDGET),
            ),
            None => self.command_timeout,
        };
        let sent_at = Instant::now();
        // The script runs in its own task, so that its reply is read even when this
        // attempt is cancelled or runs out of budget: an acquisition nobody is waiting for
        // any more is then released, exactly one hold, re-entries included.
        let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
        let unclaimed = InFlight {
            inner: self.clone(),
            key: c.key.clone(),
            owner: c.claim.owner.clone(),
            lease: c.claim.lease,
        };
        self.runtime.spawn(unclaimed.run(reply_tx));
        let reply = match timeout(budget, reply_rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(CommandError::Shutdown),
            Err(elapsed) => return Err(LockError::backend("acquire", elapsed)),
        };
        let unexpected = || LockError::backend("acquire", UnexpectedReply("acquire"));
        match reply {
            Ok(reply) => match reply.as_slice() {
                [1, token, _count] => u64::try_from(*token)
                    .map(|token| Attempt::Acquired { token, sent_at })
                    .map_err(|_| unexpected()),
                [0, pttl] => Ok(Attempt::Held(
                    u64::try_from(*pttl).ok().map(Duration::from_millis),
                )),
                _ => Err(unexpected()),
            },
            Err(e) if e.is_wrong_type() => Err(LockError::WrongType {
                key: c.key.user.clone(),
            }),
            Err(e) => Err(LockError::backend("acquire", e)),
        }
    }

    /// Builds the guard of a hold that Redis confirmed (the acquisition or handoff was sent
    /// at `sent_at`) and starts watching its lease.
    fn guard(
        self: &Arc<Self>,
        key: Arc<LockKey>,
        claim: Claim,
        token: u64,
        sent_at: Instant,
        slot: Option<Slot>,
    ) -> LockGuard {
        let on_lost = slot.as_ref().map(|slot| Box::new(slot.revoker()) as OnLost);
        let hold = RedisHold::new(self.clone(), key, claim.owner, claim.lease, slot);
        let (lost, generation) = self.watchdog.register(
            hold.key.lock.clone(),
            hold.owner.clone(),
            claim.lease,
            claim.renew,
            sent_at,
            on_lost,
        );
        let renew = claim.renew;
        let held = HeldLock::new(
            hold.key.user.clone(),
            hold.owner.clone(),
            token,
            lost.clone(),
        );
        LockGuard::new(
            held,
            Box::new(WatchedHold {
                hold,
                generation,
                renew,
                lost,
            }),
        )
    }
}

/// One acquisition in progress.
struct Contender {
    key: Arc<LockKey>,
    claim: Claim,
    started: Instant,
    deadline: Option<Instant>,
}

impl Contender {
    fn timed_out(&self, retry_after: Option<Duration>) -> LockError {
        LockError::TimedOut {
            key: self.key.user.clone(),
            waited: self.started.elapsed(),
            retry_after,
        }
    }
}

fn outcome(error: &LockError) -> &'static str {
    match error {
        LockError::Contended { .. } => "contended",
        LockError::TimedOut { .. } => "timed_out",
        LockError::QueueFull { .. } => "queue_full",
        LockError::InvalidKey(_) => "invalid_key",
        LockError::Lost { .. } => "lost",
        LockError::WrongType { .. } => "wrong_type",
        LockError::Backend(_) => "backend_error",
    }
}

/// An acquire script call whose reply may find nobody waiting for it.
/// It may run although its reply never comes (Redis paused, a slow network), or its
/// attempt may be cancelled while it runs (client gone, an outer timeout).
struct InFlight {
    inner: Arc<Inner>,
    key: Arc<LockKey>,
    owner: LockOwner,
    lease: Duration,
}

impl InFlight {
    /// Runs the script and hands the reply to the attempt; if the attempt is gone, gives
    /// back what the script took.
    async fn run(self, reply_tx: tokio::sync::oneshot::Sender<Result<Vec<i64>, CommandError>>) {
        let mut conn = match self.inner.pool.connection().await {
            Ok(conn) => conn,
            // Nothing was sent, so nothing to undo.
            Err(e) => return drop(reply_tx.send(Err(e))),
        };
        let mut invocation = self.inner.scripts.acquire.key(&*self.key.lock);
        invocation
            .key(&self.key.fence)
            .arg(self.owner.as_str())
            .arg(millis(self.lease))
            .arg(millis(self.inner.fence_ttl));
        let reply = conn.invoke::<Vec<i64>>(&invocation).await;
        let ambiguous = matches!(&reply, Err(e) if e.is_ambiguous());
        let undelivered = reply_tx.send(reply).err();
        let hold = || {
            RedisHold::new(
                self.inner.clone(),
                self.key.clone(),
                self.owner.clone(),
                self.lease,
                None,
            )
        };
        match undelivered {
            // Acquired (or re-entered) for an attempt that gave up: release that one hold.
            Some(Ok(reply)) if reply.first() == Some(&1) => {
                let mut hold = hold();
                let retry_for = self.lease;
                let _ = hold.run(retry_for).await;
            }
            // No reply: the script may have run. Undo it on the same connection, so Redis
            // runs the undo after it; not when the owner holds the key already (a re-entry),
            // where a release that the script did not need would take the outer hold away.
            _ if ambiguous && !self.inner.watchdog.is_held(&self.key.lock, &self.owner) => {
                hold().undo(conn).await;
            }
            _ => {}
        }
    }
}

/// One hold of one lock, and everything needed to give it back.
struct RedisHold {
    inner: Arc<Inner>,
    key: Arc<LockKey>,
    owner: LockOwner,
    /// Distinguishes this hold from the owner's other holds of the key (see release.lua).
    latch: String,
    lease: Duration,
    /// The key's slot in this backend's queue, when this hold took it (re-entries and
    /// clean-ups do not): releasing passes it, and possibly the lock, to the next task.
    slot: Option<Slot>,
    /// Whether a release script of this hold may have run without its reply reaching us.
    may_have_run: bool,
}

impl RedisHold {
    fn new(
        inner: Arc<Inner>,
        key: Arc<LockKey>,
        owner: LockOwner,
        lease: Duration,
        slot: Option<Slot>,
    ) -> Self {
        let seq = inner.sequence.fetch_add(1, Ordering::Relaxed);
        RedisHold {
            latch: format!("{}#{seq}", owner.as_str()),
            inner,
            key,
            owner,
            lease,
            slot,
            may_have_run: false,
        }
    }

    /// The release script for this hold, handing the lock to `successor` if given.
    fn invocation(&self, successor: Option<&Claim>, streak_spent: bool) -> ScriptInvocation<'_> {
        let mut invocation = self.inner.scripts.release.key(&*self.key.lock);
        invocation
            .key(&self.key.fence)
            .arg(self.owner.as_str())
            .arg(&self.latch)
            .arg(millis(self.lease))
            .arg(&self.key.channel)
            .arg(successor.map_or("", |s| s.owner.as_str()))
            .arg(successor.map_or(0, |s| millis(s.lease)))
            .arg(millis(self.inner.fence_ttl))
            .arg(u8::from(streak_spent))
            .arg(u8::from(self.may_have_run));
        invocation
    }

    /// Undoes an acquire script whose outcome is unknown. The release goes first on the
    /// connection the acquire script was sent on, so Redis runs it after that script even
    /// if both are still queued (Redis paused); a plain retry on another connection could
    /// find nothing to release, stop, and let the late acquisition stand.
    async fn undo(mut self, mut conn: Conn) {
        let invocation = self.invocation(None, false);
        let sent = timeout(
            self.inner.command_timeout,
            conn.invoke::<Vec<i64>>(&invocation),
        );
        // Any reply settles it; without one, the queued release still runs in order.
        if matches!(sent.await, Ok(Ok(_))) {
            return;
        }
        let retry_for = self.lease;
        let _ = self.run(retry_for).await;
    }

    /// Releases in a spawned task, retrying for up to a lease: after that Redis has freed
    /// the lock by itself.
    fn finish_in_background(mut self) {
        let runtime = self.inner.runtime.clone();
        runtime.spawn(async move {
            let lease = self.lease;
            match self.run(lease).await {
                Ok(()) | Err(LockError::Lost { .. }) => {}
                Err(error) => {
                    let key = &self.key.user;
                    tracing::warn!(%key, %error, "background lock release failed; the lease will free it");
                }
            }
        });
    }

    /// Runs the release script, retrying transport failures for up to `retry_for`.
    /// A retry is safe: the script recognises a hold it already released or handed over.
    ///
    /// When a task of this backend is queued for the key, the script hands the lock to it
    /// instead of freeing it, unless this process's run of handoffs is used up while other
    /// instances wait. Either way the queued task gets the slot when the hold is dropped.
    async fn run(&mut self, retry_for: Duration) -> Result<(), LockError> {
        let inner = self.inner.clone();
        let successor = self.reserve_successor();
        let streak_spent = self
            .slot
            .as_ref()
            .is_some_and(|slot| slot.streak().saturating_add(1) >= inner.max_local_handoffs);
        let give_up = Instant::now() + retry_for;
        let mut backoff = Duration::from_millis(20);
        loop {
            let invocation = self.invocation(successor.as_ref(), streak_spent);
            let sent_at = Instant::now();
            let reply = timeout(
                inner.command_timeout,
                inner.pool.invoke::<Vec<i64>>(&invocation),
            )
            .await;
            let error = match reply {
                Ok(Ok(reply)) => return self.released(&reply, sent_at),
                // The key was overwritten with another type: the lock is gone.
                Ok(Err(e)) if e.is_wrong_type() => {
                    return Err(LockError::Lost {
                        key: self.key.user.clone(),
                    });
                }
                Ok(Err(e)) => {
                    let retry = e.is_ambiguous() || matches!(e, CommandError::Connect(_));
                    self.may_have_run |= e.is_ambiguous();
                    if !retry {
                        return Err(LockError::backend("release", e));
                    }
                    LockError::backend("release", e)
                }
                Err(elapsed) => {
                    self.may_have_run = true;
                    LockError::backend("release", elapsed)
                }
            };
            if Instant::now() + backoff >= give_up {
                return Err(error);
            }
            sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    /// Picks the queued task this release hands the lock to, if any (idempotent).
    fn reserve_successor(&mut self) -> Option<Claim> {
        if self.inner.max_local_handoffs == 0 {
            return None;
        }
        self.slot.as_mut()?.reserve_successor().cloned()
    }

    /// Acts on the release script's reply (see release.lua). The slot, unless it went
    /// along with the lock, is passed on when the hold is dropped.
    fn released(&mut self, reply: &[i64], sent_at: Instant) -> Result<(), LockError> {
        match reply {
            [3, token] => {
                let token = u64::try_from(*token)
                    .map_err(|_| LockError::backend("release", UnexpectedReply("release")))?;
                if let Some((successor, slot)) = self.slot.take().and_then(Slot::hand_over) {
                    let guard = self.inner.guard(
                        self.key.clone(),
                        successor.claim.clone(),
                        token,
                        sent_at,
                        Some(slot),
                    );
                    successor.hand_over(guard);
                }
                Ok(())
            }
            [2] => {
                if let Some(slot) = self.slot.as_mut() {
                    slot.yield_to_others();
                }
                Ok(())
            }
            [1] => Ok(()),
            // Not held: lost, unless an earlier attempt whose reply was lost did it.
            [0] if self.may_have_run => Ok(()),
            [0] => Err(LockError::Lost {
                key: self.key.user.clone(),
            }),
            _ => Err(LockError::backend("release", UnexpectedReply("release"))),
        }
    }
}

/// A hold registered with the watchdog: releasing deregisters it first, so renewal never
/// outlives the unlock (Redisson #7272).
struct WatchedHold {
    hold: RedisHold,
    generation: u64,
    /// Whether this hold asked for renewal (see `LockRequest::without_watchdog`).
    renew: bool,
    /// Fired by the watchdog when the lock was found lost.
    lost: CancellationToken,
}

impl WatchedHold {
    /// Stops renewal; returns the hold if a release is still owed to Redis. A hold known
    /// lost is owed nothing: its owner may hold the key again under a new hold, which a
    /// release of the old one would take away.
    fn stop(self) -> Result<RedisHold, LockError> {
        let hold = self.hold;
        hold.inner
            .watchdog
            .unregister(&hold.key.lock, &hold.owner, self.generation, self.renew);
        if self.lost.is_cancelled() {
            return Err(LockError::Lost {
                key: hold.key.user.clone(),
            });
        }
        Ok(hold)
    }
}

impl ReleaseHold for WatchedHold {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let hold = match self.stop() {
            Ok(hold) => hold,
            Err(lost) => return Box::pin(std::future::ready(Err(lost))),
        };
        // The caller awaits this one: retry briefly, then report. What is still owed then
        // (or when the caller stops waiting) is finished in the background, so a release
        // that could not reach Redis (paused, restarting) happens once it can, instead of
        // leaving the lock to its lease.
        let retry_for = hold.inner.command_timeout * 2;
        Box::pin(Owed(Some(hold)).settle(retry_for))
    }

    fn release_in_background(self: Box<Self>) {
        if let Ok(hold) = self.stop() {
            hold.finish_in_background();
        }
    }
}

/// A release still owed to Redis: dropped unsettled, it is finished in the background.
struct Owed(Option<RedisHold>);

impl Owed {
    async fn settle(mut self, retry_for: Duration) -> Result<(), LockError> {
        let result = match &mut self.0 {
            Some(hold) => hold.run(retry_for).await,
            None => Ok(()),
        };
        // Only a backend failure leaves the release undone; `Lost` means nothing is owed.
        // Dropping the hold passes its slot (if it did not go with a handoff) on.
        if !matches!(result, Err(LockError::Backend(_))) {
            self.0 = None;
        }
        result
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        if let Some(mut hold) = self.0.take() {
            // Dropped while its script was in flight, the release may have run: the retry
            // must recognise a handoff or a release already done.
            hold.may_have_run = true;
            hold.finish_in_background();
        }
    }
}

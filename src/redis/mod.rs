//! The Redis backend: Redisson-style reentrant hash locks driven by Lua scripts.
//!
//! Each backend owns a bb8 pool of multiplexed command connections, one subscriber
//! connection that carries the release channels of every key with local waiters, and one
//! watchdog task that renews held leases in batches. Its background tasks stop when the
//! last clone of the backend and the last guard it issued are dropped.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_lock::RedisBackend;
//!
//! # async fn run() -> Result<(), tower_lock::LockError> {
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
use self::scripts::Scripts;
use self::watchdog::{Watchdog, millis};
use crate::backend::LockBackend;
use crate::error::{KeyError, LockError};
use crate::key::LockKey;
use crate::lock::{BoxFuture, HeldLock, LockGuard, LockOwner, LockRequest, Mode, ReleaseHold};

/// Default upper bound on a key's length in bytes.
pub const DEFAULT_MAX_KEY_LEN: usize = 1024;

/// A command never gets less time than this, even right at a wait's deadline, so that a
/// final attempt is not failed by its own budget on a busy machine.
const MIN_COMMAND_BUDGET: Duration = Duration::from_millis(250);

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
    namespace: String,
    max_key_len: usize,
    command_timeout: Duration,
    fence_ttl: Duration,
    instance: String,
    sequence: AtomicU64,
    runtime: tokio::runtime::Handle,
    shutdown: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl RedisBackend {
    /// Connects with default settings. Fails if Redis does not answer a PING.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
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
    /// [`KeyError::TooLong`], never truncated.
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

    /// Connects and starts the backend's tasks. Must be called inside a Tokio runtime.
    pub async fn build(self) -> Result<RedisBackend, LockError> {
        validate_namespace(&self.namespace)?;
        let client =
            redis::Client::open(self.url.as_str()).map_err(|e| LockError::backend("connect", e))?;
        let runtime = tokio::runtime::Handle::current();
        let shutdown = CancellationToken::new();
        let scripts = Arc::new(Scripts::new());
        let pool = Pool::new(
            client.clone(),
            self.pool_size,
            self.connect_timeout,
            self.command_timeout,
        );
        timeout(
            self.command_timeout,
            pool.query::<String>(&redis::cmd("PING")),
        )
        .await
        .map_err(|e| LockError::backend("connect", e))?
        .map_err(|e| LockError::backend("connect", e))?;
        for script in scripts.all() {
            pool.load(script)
                .await
                .map_err(|e| LockError::backend("connect", e))?;
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

fn validate_namespace(namespace: &str) -> Result<(), LockError> {
    if namespace.is_empty()
        || namespace.contains(['{', '}'])
        || namespace.contains(char::is_control)
    {
        return Err(LockError::InvalidKey(KeyError::Malformed {
            reason: format!(
                "namespace {namespace:?} must be non-empty, without braces or control characters"
            ),
        }));
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
        let lease = request.lease;
        let started = Instant::now();
        let deadline = match request.mode {
            Mode::TryOnce => None,
            Mode::Wait(wait) => Some(started + wait),
        };
        let mut pttl = match self.attempt(&key, &owner, lease, deadline).await? {
            Attempt::Acquired { token, sent_at } => {
                return Ok(self.guard(
                    key.clone(),
                    owner.clone(),
                    lease,
                    request.watchdog,
                    token,
                    sent_at,
                ));
            }
            Attempt::Held(pttl) => pttl,
        };
        let Some(deadline) = deadline else {
            return Err(LockError::Contended {
                key: key.user.clone(),
                retry_after: pttl,
            });
        };
        // Subscribe, then try again before sleeping: a release published between the
        // failed attempt and the subscription would otherwise be missed (Redisson #5761).
        // The waiter starts with a permit when its channel is already subscribed, and gets
        // one when the subscription is confirmed, so the next attempt follows either way.
        let waiter = self.subscriber.register(&key.channel);
        loop {
            let nap = pttl.map_or(deadline, |p| (Instant::now() + p).min(deadline));
            tokio::select! {
                _ = waiter.woken() => {}
                _ = sleep_until(nap) => {}
            }
            match self.attempt(&key, &owner, lease, Some(deadline)).await? {
                Attempt::Acquired { token, sent_at } => {
                    drop(waiter);
                    return Ok(self.guard(
                        key.clone(),
                        owner.clone(),
                        lease,
                        request.watchdog,
                        token,
                        sent_at,
                    ));
                }
                Attempt::Held(p) => pttl = p,
            }
            if Instant::now() >= deadline {
                return Err(LockError::TimedOut {
                    key: key.user.clone(),
                    waited: started.elapsed(),
                    retry_after: pttl,
                });
            }
        }
    }

    /// Runs the acquire script once.
    async fn attempt(
        self: &Arc<Self>,
        key: &Arc<LockKey>,
        owner: &LockOwner,
        lease: Duration,
        deadline: Option<Instant>,
    ) -> Result<Attempt, LockError> {
        let mut invocation = self.scripts.acquire.key(&key.lock);
        invocation
            .key(&key.fence)
            .arg(owner.as_str())
            .arg(millis(lease))
            .arg(millis(self.fence_ttl));
        let budget = match deadline {
            Some(deadline) => self.command_timeout.min(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(MIN_COMMAND_BUDGET),
            ),
            None => self.command_timeout,
        };
        let sent_at = Instant::now();
        let mut in_flight = InFlight {
            inner: self.clone(),
            key: key.clone(),
            owner: owner.clone(),
            lease,
            conn: None,
            settled: false,
        };
        let reply = timeout(budget, async {
            let mut conn = self.pool.connection().await?;
            in_flight.conn = Some(conn.clone());
            conn.invoke::<Vec<i64>>(&invocation).await
        })
        .await;
        let error = match reply {
            Ok(Ok(reply)) => {
                in_flight.settled = true;
                return match reply.as_slice() {
                    [1, token, _count] => u64::try_from(*token)
                        .map(|token| Attempt::Acquired { token, sent_at })
                        .map_err(|_| LockError::backend("acquire", UnexpectedReply("acquire"))),
                    [0, pttl] => Ok(Attempt::Held(
                        u64::try_from(*pttl).ok().map(Duration::from_millis),
                    )),
                    _ => Err(LockError::backend("acquire", UnexpectedReply("acquire"))),
                };
            }
            Ok(Err(e)) if e.is_wrong_type() => {
                in_flight.settled = true;
                LockError::WrongType {
                    key: key.user.clone(),
                }
            }
            Ok(Err(e)) => {
                in_flight.settled = !e.is_ambiguous();
                LockError::backend("acquire", e)
            }
            Err(elapsed) => LockError::backend("acquire", elapsed),
        };
        Err(error)
    }

    fn guard(
        self: &Arc<Self>,
        key: Arc<LockKey>,
        owner: LockOwner,
        lease: Duration,
        renew: bool,
        token: u64,
        sent_at: Instant,
    ) -> LockGuard {
        let hold = RedisHold::new(self.clone(), key, owner, lease);
        let lost = self.watchdog.register(
            hold.lock_key.clone(),
            hold.owner.clone(),
            lease,
            renew,
            sent_at,
        );
        let held = HeldLock::new(hold.key.user.clone(), hold.owner.clone(), token, lost);
        LockGuard::new(held, Box::new(WatchedHold(hold)))
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

/// An acquire script that was sent and whose outcome is not known. It may have run
/// although its reply never came (Redis paused, a slow network), or the acquisition may
/// have been cancelled while waiting for the reply (client gone, an outer timeout).
/// Dropping it unsettled undoes the script in the background; otherwise the lock would
/// stay taken, by an owner nobody holds a guard for, for a whole lease.
struct InFlight {
    inner: Arc<Inner>,
    key: Arc<LockKey>,
    owner: LockOwner,
    lease: Duration,
    /// The connection the script was sent on, once it was.
    conn: Option<Conn>,
    /// The reply arrived, or the command certainly did not run.
    settled: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Nothing to undo if the script was never handed to a connection. And not when
        // the owner already holds the key (a re-entry through a shared owner): there one
        // release too many would take the outer hold away.
        if self.settled
            || self.conn.is_none()
            || self.inner.watchdog.is_held(&self.key.lock, &self.owner)
        {
            return;
        }
        let hold = RedisHold::new(
            self.inner.clone(),
            self.key.clone(),
            self.owner.clone(),
            self.lease,
        );
        let conn = self.conn.take();
        self.inner.runtime.spawn(hold.undo(conn));
    }
}

/// One hold of one lock, and everything needed to give it back.
struct RedisHold {
    inner: Arc<Inner>,
    key: Arc<LockKey>,
    lock_key: Arc<str>,
    owner: LockOwner,
    /// Distinguishes this hold from the owner's other holds of the key (see release.lua).
    latch: String,
    lease: Duration,
}

impl RedisHold {
    fn new(inner: Arc<Inner>, key: Arc<LockKey>, owner: LockOwner, lease: Duration) -> Self {
        let seq = inner.sequence.fetch_add(1, Ordering::Relaxed);
        RedisHold {
            latch: format!("{}#{seq}", owner.as_str()),
            lock_key: key.lock.as_str().into(),
            inner,
            key,
            owner,
            lease,
        }
    }

    fn invocation(&self) -> ScriptInvocation<'_> {
        let mut invocation = self.inner.scripts.release.key(&*self.lock_key);
        invocation
            .arg(self.owner.as_str())
            .arg(&self.latch)
            .arg(millis(self.lease))
            .arg(&self.key.channel);
        invocation
    }

    /// Undoes an acquire script whose outcome is unknown. The release goes first on the
    /// connection the acquire script was sent on, so Redis runs it after that script even
    /// if both are still queued (Redis paused); a plain retry on another connection could
    /// find nothing to release, stop, and let the late acquisition stand.
    async fn undo(self, conn: Option<Conn>) {
        if let Some(mut conn) = conn {
            let invocation = self.invocation();
            let sent = timeout(self.inner.command_timeout, conn.invoke::<i64>(&invocation));
            // Any reply settles it; without one, the queued release still runs in order.
            if matches!(sent.await, Ok(Ok(_))) {
                return;
            }
        }
        let retry_for = self.lease;
        let _ = self.run(retry_for).await;
    }

    /// Releases in a spawned task, retrying for up to a lease: after that Redis has freed
    /// the lock by itself.
    fn finish_in_background(self) {
        let runtime = self.inner.runtime.clone();
        runtime.spawn(async move {
            match self.run(self.lease).await {
                Ok(()) | Err(LockError::Lost { .. }) => {}
                Err(error) => {
                    let key = &self.key.user;
                    tracing::warn!(%key, %error, "background lock release failed; the lease will free it");
                }
            }
        });
    }

    /// Runs the release script, retrying transport failures for up to `retry_for`.
    /// A retry is safe: the script recognises a hold it already released.
    async fn run(&self, retry_for: Duration) -> Result<(), LockError> {
        let invocation = self.invocation();
        let give_up = Instant::now() + retry_for;
        let mut backoff = Duration::from_millis(20);
        let mut may_have_run = false;
        loop {
            let error = match timeout(
                self.inner.command_timeout,
                self.inner.pool.invoke::<i64>(&invocation),
            )
            .await
            {
                // Not held: lost, unless an earlier attempt whose reply was lost did it.
                Ok(Ok(0)) if !may_have_run => {
                    return Err(LockError::Lost {
                        key: self.key.user.clone(),
                    });
                }
                Ok(Ok(_)) => return Ok(()),
                // The key was overwritten with another type: the lock is gone.
                Ok(Err(e)) if e.is_wrong_type() => {
                    return Err(LockError::Lost {
                        key: self.key.user.clone(),
                    });
                }
                Ok(Err(e)) => {
                    let retry = e.is_ambiguous() || matches!(e, CommandError::Connect(_));
                    may_have_run |= e.is_ambiguous();
                    if !retry {
                        return Err(LockError::backend("release", e));
                    }
                    LockError::backend("release", e)
                }
                Err(elapsed) => {
                    may_have_run = true;
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
}

/// A hold registered with the watchdog: releasing deregisters it first, so renewal never
/// outlives the unlock (Redisson #7272).
struct WatchedHold(RedisHold);

impl ReleaseHold for WatchedHold {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let hold = self.0;
        hold.inner.watchdog.unregister(&hold.lock_key, &hold.owner);
        // The caller awaits this one: retry briefly, then report. What is still owed then
        // (or when the caller stops waiting) is finished in the background, so a release
        // that could not reach Redis (paused, restarting) happens once it can, instead of
        // leaving the lock to its lease.
        let retry_for = hold.inner.command_timeout * 2;
        Box::pin(Owed(Some(hold)).settle(retry_for))
    }

    fn release_in_background(self: Box<Self>) {
        let hold = self.0;
        hold.inner.watchdog.unregister(&hold.lock_key, &hold.owner);
        hold.finish_in_background();
    }
}

/// A release still owed to Redis: dropped unsettled, it is finished in the background.
struct Owed(Option<RedisHold>);

impl Owed {
    async fn settle(mut self, retry_for: Duration) -> Result<(), LockError> {
        let result = match &self.0 {
            Some(hold) => hold.run(retry_for).await,
            None => Ok(()),
        };
        // Only a backend failure leaves the release undone; `Lost` means nothing is owed.
        if !matches!(result, Err(LockError::Backend(_))) {
            self.0 = None;
        }
        result
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        if let Some(hold) = self.0.take() {
            hold.finish_in_background();
        }
    }
}

//! [`RedisBackendBuilder`]: configuration, validation and the connection at build time.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::pool::{Pool, RedisCause};
use super::pubsub::{Subscriber, SubscriberConfig};
use super::runtime::Spawner;
use super::scripts::Scripts;
use super::sentinel::{MasterAuth, SentinelGroup};
use super::topology::Topology;
use super::watchdog::Watchdog;
use super::{DEFAULT_MAX_KEY_LEN, DEFAULT_MAX_LOCAL_HANDOFFS, Inner, RedisBackend};
use crate::backend::OwnerIds;
use crate::error::BuildError;
use crate::queue::Queues;

/// Configures a [`RedisBackend`]; created by [`RedisBackend::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct RedisBackendBuilder {
    target: Target,
    pool_size: u32,
    namespace: String,
    max_key_len: usize,
    connect_timeout: Duration,
    command_timeout: Duration,
    fence_ttl: Duration,
    ping_interval: Duration,
    max_backoff: Duration,
    max_local_handoffs: u32,
    /// The master's credentials when they differ from the first sentinel URL's.
    master_username: Option<String>,
    master_password: Option<String>,
}

/// Where the backend's Redis is, as the user gave it.
#[derive(Debug, Clone)]
enum Target {
    /// One server's URL.
    Url(String),
    /// The URLs of the sentinels that monitor `master_name`.
    Sentinel {
        urls: Vec<String>,
        master_name: String,
    },
}

impl RedisBackendBuilder {
    pub(super) fn new(url: String) -> Self {
        Self::with_target(Target::Url(url))
    }

    pub(super) fn sentinel(urls: Vec<String>, master_name: String) -> Self {
        Self::with_target(Target::Sentinel { urls, master_name })
    }

    fn with_target(target: Target) -> Self {
        RedisBackendBuilder {
            target,
            pool_size: 4,
            namespace: "tower-lock".to_owned(),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            connect_timeout: Duration::from_secs(1),
            command_timeout: Duration::from_secs(1),
            // Ten minutes: see `fence_ttl` for why.
            fence_ttl: Duration::from_secs(10 * 60),
            ping_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(2),
            max_local_handoffs: DEFAULT_MAX_LOCAL_HANDOFFS,
            master_username: None,
            master_password: None,
        }
    }

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

    /// How long a key's fencing counter is kept after the last token was issued for it
    /// (default 10 minutes; clamped to 1 ms ..= [`MAX_DURATION`](crate::lock::MAX_DURATION),
    /// so that `Duration::MAX` or zero still give `SET .. PX` a value Redis accepts).
    ///
    /// The counter is the only state a released key leaves in Redis: with a new key per
    /// request (say, keyed on an `Idempotency-Key` header) Redis holds one counter, about
    /// 165 bytes, per key taken in the last `ttl`. Under the default that is some 100 MB
    /// at 1,000 new keys a second, where the former 7 days meant 600 M counters and an
    /// out-of-memory Redis within hours.
    ///
    /// Once the counter is gone, a key's next token is the Redis clock (`TIME`) in
    /// microseconds. Tokens stay strictly increasing as long as the Redis server clock
    /// does not step back by more than `ttl` − *L*, where *L* is how many microseconds the
    /// key's last token ran ahead of that clock when the script issuing it started. Redis
    /// deletes the counter only once its clock is more than `ttl` past the counter's last
    /// write, so a clock that has since lost no more than `ttl` − *L* still reads above
    /// that token. *L* is at most the few microseconds a script runs unless the clock
    /// already stepped back while the counter was kept (tokens then continue from the
    /// counter, ahead of the clock, so such steps count against the same window) or the
    /// key got more than one token per microsecond, which one Redis cannot serve.
    ///
    /// NTP and chrony corrections and leap seconds are a second or less: ten minutes
    /// covers them many times over while keeping the counters small, and a clock wrong by
    /// more is a misconfigured host that an hour would not cover either. A counter lost
    /// another way (`DEL`, `FLUSHALL`, eviction under an `allkeys-*` policy, a restart
    /// without persistence) leaves only the clock: tokens then keep increasing as long as
    /// it has not stepped back since the last token was issued.
    pub fn fence_ttl(mut self, ttl: Duration) -> Self {
        self.fence_ttl = ttl.clamp(Duration::from_millis(1), crate::lock::MAX_DURATION);
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

    /// Sentinel only: the username the master is reached with, when it is not the first
    /// sentinel URL's (see [`RedisBackend::sentinel`]).
    pub fn master_username(mut self, username: impl Into<String>) -> Self {
        self.master_username = Some(username.into());
        self
    }

    /// Sentinel only: the password the master is reached with, when it is not the first
    /// sentinel URL's: for sentinels that need another password than the data nodes, or
    /// none (see [`RedisBackend::sentinel`]).
    pub fn master_password(mut self, password: impl Into<String>) -> Self {
        self.master_password = Some(password.into());
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
        self.validate_settings()?;
        let topology = self.topology().await?;
        let runtime = Spawner::current();
        let shutdown = CancellationToken::new();
        let scripts = Arc::new(Scripts::new());
        let pool = Pool::new(
            topology.clone(),
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
            topology,
            SubscriberConfig {
                connect_timeout: self.connect_timeout,
                command_timeout: self.command_timeout,
                ping_interval: self.ping_interval,
                max_backoff: self.max_backoff,
            },
            pool.failure_epoch(),
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
                owners: OwnerIds::new(),
                runtime,
                shutdown,
            }),
        })
    }
}

impl RedisBackendBuilder {
    /// Opens the target: a server's client, or the Sentinel group once it named a master.
    async fn topology(&self) -> Result<Topology, BuildError> {
        match &self.target {
            Target::Url(url) => redis::Client::open(url.as_str())
                .map(Topology::Server)
                .map_err(|e| BuildError::Url {
                    source: Box::new(e),
                }),
            Target::Sentinel { urls, master_name } => {
                let master = MasterAuth {
                    username: self.master_username.as_deref(),
                    password: self.master_password.as_deref(),
                };
                let group = SentinelGroup::new(urls, master_name, master)?;
                // Asked here once, so that unreachable sentinels or an unknown name fail
                // the build with that cause rather than as a failed PING. redis-rs bounds
                // each sentinel's connect and reply by its own timeouts.
                group.master().await.map_err(|e| BuildError::Sentinel {
                    master_name: master_name.clone(),
                    source: Box::new(RedisCause::from(e)),
                })?;
                Ok(Topology::Sentinel(Arc::new(group)))
            }
        }
    }

    /// Refuses values that would fail every call, instead of failing each request later.
    fn validate_settings(&self) -> Result<(), BuildError> {
        let refuse = |name, reason| Err(BuildError::Setting { name, reason });
        if self.command_timeout.is_zero() {
            return refuse("command_timeout", "it must be above zero");
        }
        if self.connect_timeout.is_zero() {
            return refuse("connect_timeout", "it must be above zero");
        }
        if self.max_key_len == 0 {
            return refuse("max_key_len", "it must be at least one byte");
        }
        if matches!(self.target, Target::Url(_)) {
            let sentinel_only = "it applies to a Sentinel backend; put the credentials in the URL";
            if self.master_username.is_some() {
                return refuse("master_username", sentinel_only);
            }
            if self.master_password.is_some() {
                return refuse("master_password", sentinel_only);
            }
        }
        Ok(())
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

//! Redis Sentinel: the master of a named group, looked up through the sentinels each time a
//! connection is opened.
//!
//! The lookup is redis-rs' own (`SENTINEL MASTERS` on each sentinel in turn, skipping a
//! master flagged down, then `ROLE` on the named master to confirm it takes writes). The
//! backend never caches the answer: a connection that fails (the master died, or it
//! answered `READONLY` after a demotion) is retired by the pool, and the next one asks the
//! sentinels again, which is how the backend follows a failover.
//!
//! That alone would find the new master only when something retries: a release owed to
//! the dead master, or the subscriber, may be sleeping in its backoff for up to a second or
//! two after the promotion. So the backend also listens to `+switch-master` on one sentinel
//! at a time and announces each promotion of its group ([`SentinelGroup::promotions`]):
//! the subscriber reconnects at once and owed releases retry at once. On the failover test
//! (tests/sentinel.rs) that brought the first served request from about 0.7 s after the
//! promotion down to about 20 ms. A listener whose sentinel connection went half-open
//! hears nothing; the backoffs above are then the fallback. The announcement also redoes
//! the releases the old master took after the promotion (see `replay.rs`).
//!
//! At build the sentinels are also asked for the master's replicas, whose eviction policy
//! is checked (`builder/replica_checks.rs`); they are reached as the master is.
//!
//! TLS (`rediss://` sentinel URLs) covers the sentinels, the listener and the master. Each
//! sentinel's connection info carries the builder's certificates; the master's come from
//! the sentinels as a bare address, which redis-rs' `Sentinel` reaches with the system
//! roots only, so with certificates the lookup goes through its `SentinelClient`, which
//! takes them for the master too (but one login for all sentinels).

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use futures_util::StreamExt;
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{
    AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo,
    RedisError, RedisResult,
};
use tokio::sync::{Mutex, watch};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

use super::pool::FailureEpoch;
use super::tls::TlsSettings;
use crate::error::BuildError;

/// The master's credentials where they differ from the first sentinel URL's.
pub(crate) struct MasterAuth<'a> {
    pub(crate) username: Option<&'a str>,
    pub(crate) password: Option<&'a str>,
}

/// The sentinels of one master group and how to reach the master they name.
pub(crate) struct SentinelGroup {
    /// redis-rs' lookup keeps one connection per sentinel; lookups take turns on it.
    lookup: Mutex<Lookup>,
    /// The sentinels again, for the `+switch-master` listener.
    sentinels: Vec<ConnectionInfo>,
    master_name: String,
    master: SentinelNodeConnectionInfo,
    /// How the master is logged in to, and so its replicas (see [`replica`](Self::replica)).
    master_login: RedisConnectionInfo,
    /// Whether the data nodes are reached over TLS, with `tls`.
    use_tls: bool,
    tls: TlsSettings,
    /// Counts the promotions of this group the listener has heard of.
    promotions: watch::Sender<u64>,
}

/// redis-rs' two ways to ask the sentinels for the master.
enum Lookup {
    /// Each sentinel is reached with its own URL's credentials; a TLS master is verified
    /// against the system roots.
    Plain(Sentinel),
    /// TLS with the builder's certificates, which redis-rs applies to the master only
    /// through its `SentinelClient`; that one logs in to every sentinel as the same user.
    #[cfg(feature = "tls")]
    Certified(redis::sentinel::SentinelClient),
}

impl SentinelGroup {
    /// Parses the sentinel URLs. The master is reached with the username, password and
    /// database of the first URL unless `auth` says otherwise; the sentinels themselves
    /// with each URL's credentials and no database (a sentinel has none, and refuses
    /// `SELECT`). With `rediss://` URLs (`use_tls`, see [`TlsSettings::check_sentinel`])
    /// the sentinels and the master are reached over TLS, with the certificates of `tls`.
    pub(crate) fn new(
        urls: &[String],
        master_name: &str,
        auth: MasterAuth<'_>,
        tls: &TlsSettings,
        use_tls: bool,
    ) -> Result<Self, BuildError> {
        let url_error =
            |source: Box<dyn std::error::Error + Send + Sync>| BuildError::Url { source };
        if master_name.is_empty() {
            return Err(BuildError::Setting {
                name: "sentinel",
                reason: "the master name must not be empty",
            });
        }
        // A client per URL carries its TLS certificates in its connection info.
        let infos = urls
            .iter()
            .map(|url| Ok(tls.client(url)?.get_connection_info().clone()))
            .collect::<Result<Vec<ConnectionInfo>, BuildError>>()?;
        let Some(first) = infos.first() else {
            return Err(BuildError::Setting {
                name: "sentinel",
                reason: "at least one sentinel URL is needed",
            });
        };
        let mut settings = first.redis_settings().clone();
        if let Some(username) = auth.username {
            settings = settings.set_username(username);
        }
        if let Some(password) = auth.password {
            settings = settings.set_password(password);
        }
        let mut master =
            SentinelNodeConnectionInfo::default().set_redis_connection_info(settings.clone());
        if use_tls {
            master = master.set_tls_mode(redis::TlsMode::Secure);
        }
        let sentinels: Vec<ConnectionInfo> = infos
            .into_iter()
            .map(|info| {
                let settings = info.redis_settings().clone().set_db(0);
                info.set_redis_settings(settings)
            })
            .collect();
        let lookup = match use_tls && !tls.is_empty() {
            #[cfg(feature = "tls")]
            true => Lookup::Certified(certified(&sentinels, master_name, &settings, tls)?),
            _ => Lookup::Plain(
                Sentinel::build(sentinels.clone()).map_err(|e| url_error(Box::new(e)))?,
            ),
        };
        Ok(SentinelGroup {
            lookup: Mutex::new(lookup),
            sentinels,
            master_name: master_name.to_owned(),
            master,
            master_login: settings,
            use_tls,
            tls: tls.clone(),
            promotions: watch::Sender::new(0),
        })
    }

    /// The client of the master the sentinels name now, confirmed by its `ROLE`.
    pub(crate) async fn master(&self) -> RedisResult<redis::Client> {
        let master = match &mut *self.lookup.lock().await {
            Lookup::Plain(sentinel) => {
                sentinel
                    .async_master_for(&self.master_name, Some(&self.master))
                    .await?
            }
            #[cfg(feature = "tls")]
            Lookup::Certified(client) => client.async_get_client().await?,
        };
        tracing::debug!(master = ?master.get_connection_info().addr(), "sentinels named the master");
        Ok(master)
    }

    /// The replicas of the master as the first sentinel that answers `SENTINEL REPLICAS`
    /// reports them (`ip`, `port`), leaving out those it flags down (`s_down`, `o_down`) or
    /// `disconnected`: the sentinels promote none of those. On failure, the last sentinel
    /// asked and its error.
    ///
    /// redis-rs' `async_get_replica_clients` is not used: it connects to each replica in
    /// turn and leaves out, without a word, one it cannot reach or log in to.
    pub(crate) async fn replicas(
        &self,
        config: &AsyncConnectionConfig,
    ) -> Result<Vec<(String, u16)>, (&ConnectionInfo, RedisError)> {
        let mut failed = None;
        for sentinel in &self.sentinels {
            let asked = async {
                let mut conn = redis::Client::open(sentinel.clone())?
                    .get_multiplexed_async_connection_with_config(config)
                    .await?;
                redis::cmd("SENTINEL")
                    .arg("REPLICAS")
                    .arg(&self.master_name)
                    .query_async::<Vec<HashMap<String, String>>>(&mut conn)
                    .await
            };
            match asked.await {
                Ok(replicas) => return Ok(replicas.iter().filter_map(promotable).collect()),
                Err(error) => failed = Some((sentinel, error)),
            }
        }
        // Without sentinels (which `new` refuses) none reports a replica.
        failed.map_or(Ok(Vec::new()), Err)
    }

    /// A client of the replica at `host:port` that logs in as the master's client does, and
    /// over TLS with the same certificates when the master is reached so.
    pub(crate) fn replica(&self, host: &str, port: u16) -> Result<redis::Client, BuildError> {
        let host = host.to_owned();
        let addr = match self.use_tls {
            true => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                tls_params: None,
            },
            false => ConnectionAddr::Tcp(host, port),
        };
        let info = addr
            .into_connection_info()
            .map_err(|e| BuildError::Url {
                source: Box::new(e),
            })?
            .set_redis_settings(self.master_login.clone());
        self.tls.node(info)
    }

    /// Changes whenever a sentinel announces that another server became the master.
    pub(crate) fn promotions(&self) -> watch::Receiver<u64> {
        self.promotions.subscribe()
    }

    /// How many promotions the listener has heard of.
    pub(crate) fn generation(&self) -> u64 {
        *self.promotions.borrow()
    }

    /// Listens to `+switch-master` on the sentinels, one at a time, until `shutdown`; each
    /// promotion of this group raises `failure_epoch` (pooled connections to the old master
    /// prove themselves before use) and is announced to [`promotions`](Self::promotions).
    pub(crate) async fn listen_for_promotions(
        &self,
        failure_epoch: FailureEpoch,
        connect_timeout: Duration,
        max_backoff: Duration,
        shutdown: CancellationToken,
    ) {
        let initial_backoff = Duration::from_millis(20);
        let mut backoff = initial_backoff;
        for sentinel in self.sentinels.iter().cycle() {
            let listened = tokio::select! {
                _ = shutdown.cancelled() => return,
                listened = self.listen_to(sentinel, &failure_epoch, connect_timeout) => listened,
            };
            let wait = backoff;
            match listened {
                // Its connection ended after subscribing: the next sentinel may be fine.
                Ok(()) => backoff = initial_backoff,
                Err(error) => {
                    tracing::debug!(%error, "cannot listen to a sentinel for promotions");
                    backoff = (backoff * 2).min(max_backoff);
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Listens to one sentinel until its connection ends. `Err` if it could not subscribe.
    async fn listen_to(
        &self,
        sentinel: &ConnectionInfo,
        failure_epoch: &FailureEpoch,
        connect_timeout: Duration,
    ) -> RedisResult<()> {
        let subscribe = async {
            let mut pubsub = redis::Client::open(sentinel.clone())?
                .get_async_pubsub()
                .await?;
            pubsub.subscribe("+switch-master").await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        let pubsub = timeout(connect_timeout, subscribe).await.map_err(|_| {
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
        })??;
        let mut messages = pubsub.into_on_message();
        // Payload: "<master name> <old ip> <old port> <new ip> <new port>".
        while let Some(message) = messages.next().await {
            let payload = String::from_utf8_lossy(message.get_payload_bytes());
            if payload.split(' ').next() == Some(self.master_name.as_str()) {
                tracing::info!(switch = %payload, "the sentinels promoted a new master");
                failure_epoch.raise();
                self.promotions.send_modify(|n| *n += 1);
            }
        }
        Ok(())
    }
}

/// The address of a replica of a `SENTINEL REPLICAS` reply, unless it is flagged down or
/// disconnected (or names no address, which no sentinel sends).
fn promotable(replica: &HashMap<String, String>) -> Option<(String, u16)> {
    let flags = replica.get("flags")?;
    if flags
        .split(',')
        .any(|flag| matches!(flag, "s_down" | "o_down" | "disconnected"))
    {
        return None;
    }
    Some((
        replica.get("ip")?.clone(),
        replica.get("port")?.parse().ok()?,
    ))
}

/// redis-rs' `SentinelClient` for TLS with the builder's certificates: to the sentinels (as
/// the user of the first URL, the only one it takes) and to the master (as `master`).
#[cfg(feature = "tls")]
fn certified(
    sentinels: &[ConnectionInfo],
    master_name: &str,
    master: &redis::RedisConnectionInfo,
    tls: &TlsSettings,
) -> Result<redis::sentinel::SentinelClient, BuildError> {
    use redis::TlsMode;
    use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
    let login = |info: &ConnectionInfo| {
        let settings = info.redis_settings();
        (
            settings.username().map(str::to_owned),
            settings.password().map(str::to_owned),
        )
    };
    let (username, password) = sentinels.first().map(login).unwrap_or_default();
    if sentinels
        .iter()
        .any(|info| login(info) != (username.clone(), password.clone()))
    {
        return Err(BuildError::tls_settings(
            "with TLS certificates every sentinel URL must carry the same username and \
             password",
        ));
    }
    let built = |e: redis::RedisError| BuildError::Url {
        source: Box::new(e),
    };
    let addrs = sentinels.iter().map(|info| info.addr().clone());
    let certificates = || {
        tls.certificates()
            .ok_or(BuildError::tls_settings("no TLS certificates were given"))
    };
    let mut builder = SentinelClientBuilder::new(addrs, master_name, SentinelServerType::Master)
        .map_err(built)?
        .set_client_to_sentinel_tls_mode(TlsMode::Secure)
        .set_client_to_sentinel_certificates(certificates()?)
        .set_client_to_redis_tls_mode(TlsMode::Secure)
        .set_client_to_redis_certificates(certificates()?)
        .set_client_to_redis_db(master.db());
    if let Some(username) = username {
        builder = builder.set_client_to_sentinel_username(username);
    }
    if let Some(password) = password {
        builder = builder.set_client_to_sentinel_password(password);
    }
    if let Some(username) = master.username() {
        builder = builder.set_client_to_redis_username(username);
    }
    if let Some(password) = master.password() {
        builder = builder.set_client_to_redis_password(password);
    }
    builder.build().map_err(built)
}

impl fmt::Debug for SentinelGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelGroup")
            .field("master_name", &self.master_name)
            .finish_non_exhaustive()
    }
}

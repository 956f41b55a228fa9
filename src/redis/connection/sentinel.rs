//! Redis Sentinel: the master of a named group, found at each connection the backend opens.
//!
//! Where the master is comes from two sources. The sentinels are asked, all at once, and a
//! server counts as the master only when a majority of the configured sentinels name it
//! (see `master_lookup.rs` for why the first answer is not enough). And the backend listens
//! to `+switch-master` on one sentinel at a time: the address a promotion announces is
//! *pinned*, and new connections go there without asking, whatever a sentinel that has
//! not yet heard of the promotion says. The pin holds until a newer announcement, or
//! until the pinned server stops answering as a master (it is down, or was demoted since),
//! and the lookup is used again. Either way the server must answer `ROLE` as a master on
//! the connection the backend is about to use, or the connection is refused.
//!
//! The backend never caches a connection's master otherwise: a connection that fails (the
//! master died, or it answered `READONLY` after a demotion) is retired by the pool, and
//! the next one finds the master again, which is how the backend follows a failover.
//!
//! The announcement also makes the backend follow a promotion at once instead of when
//! something retries: a release owed to the dead master, or the subscriber, may be
//! sleeping in its backoff for up to a second or two after it. Each promotion of the group
//! is announced to [`SentinelGroup::promotions`]: the subscriber reconnects at once and
//! owed releases retry at once. On the failover test (tests/it/sentinel.rs) that brought the
//! first served request from about 0.7 s after the promotion down to about 20 ms. A
//! listener whose sentinel connection went half-open hears nothing; the backoffs above are
//! then the fallback. The announcement also redoes the releases the old master took after
//! the promotion (see `replay.rs`).
//!
//! At build the sentinels are also asked for the master's replicas, whose eviction policy
//! is checked (`builder/replica_checks.rs`); they are reached as the master is.
//!
//! TLS (`rediss://` sentinel URLs) covers the sentinels, the listener, the master and its
//! replicas, with the builder's certificates where given: each sentinel's connection info
//! carries them, and the data nodes, which the sentinels name by a bare address, are given
//! them with the master's login. The protocol is redis-rs' throughout; only the choice of
//! the address is the backend's.

use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo,
    RedisConnectionInfo, RedisError, RedisResult,
};
use tokio::sync::watch;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

use super::master_lookup::{self, Addr};
use super::pool::FailureEpoch;
use super::tls::TlsSettings;
use crate::core::kit::backoff::Backoff;
use crate::error::BuildError;

/// The master's credentials where they differ from the first sentinel URL's.
pub(crate) struct MasterAuth<'a> {
    pub(crate) username: Option<&'a str>,
    pub(crate) password: Option<&'a str>,
}

/// The sentinels of one master group and how to reach the master they name.
pub(crate) struct SentinelGroup {
    /// Each sentinel's address, login and TLS settings (no database: a sentinel has none).
    sentinels: Vec<ConnectionInfo>,
    master_name: String,
    /// How the master is logged in to, and so its replicas (see [`data_node`](Self::data_node)).
    master_login: RedisConnectionInfo,
    /// Whether the data nodes are reached over TLS, with `tls`.
    use_tls: bool,
    tls: TlsSettings,
    /// The connect and command timeouts, for the sentinels and the build's master client.
    timeouts: AsyncConnectionConfig,
    /// How long one sentinel's answer may take, connecting included: the command timeout.
    ask_bound: Duration,
    /// The master the last `+switch-master` of the group announced, while it answers as one.
    announced: Mutex<Option<Addr>>,
    /// Counts the promotions of this group the listener has heard of.
    promotions: watch::Sender<u64>,
}

impl SentinelGroup {
    /// Parses the sentinel URLs. The master is reached with the username, password and
    /// database of the first URL unless `auth` says otherwise; the sentinels themselves
    /// with each URL's credentials and no database (a sentinel has none, and refuses
    /// `SELECT`). With `rediss://` URLs (`use_tls`, see [`TlsSettings::check_sentinel`])
    /// the sentinels and the master are reached over TLS, with the certificates of `tls`.
    /// A sentinel is connected to within `connect_timeout`, and its answer, connecting
    /// included, is awaited for `command_timeout` at most.
    pub(crate) fn new(
        urls: &[String],
        master_name: &str,
        auth: MasterAuth<'_>,
        (tls, use_tls): (&TlsSettings, bool),
        (connect_timeout, command_timeout): (Duration, Duration),
    ) -> Result<Self, BuildError> {
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
        let sentinels: Vec<ConnectionInfo> = infos
            .into_iter()
            .map(|info| {
                let settings = info.redis_settings().clone().set_db(0);
                info.set_redis_settings(settings)
            })
            .collect();
        Ok(SentinelGroup {
            sentinels,
            master_name: master_name.to_owned(),
            master_login: settings,
            use_tls,
            tls: tls.clone(),
            timeouts: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(connect_timeout))
                .set_response_timeout(Some(command_timeout)),
            ask_bound: command_timeout,
            announced: Mutex::new(None),
            promotions: watch::Sender::new(0),
        })
    }

    /// The client of the master, confirmed by its `ROLE` (see [`connect`](Self::connect)).
    pub(crate) async fn master(&self) -> RedisResult<redis::Client> {
        let (client, _) = self.connect(&self.timeouts).await?;
        Ok(client)
    }

    /// A connection (with `config`) to the master: the one the last promotion announced,
    /// else the one a majority of the sentinels name; refused unless it answers as a master.
    pub(crate) async fn connect(
        &self,
        config: &AsyncConnectionConfig,
    ) -> RedisResult<(redis::Client, MultiplexedConnection)> {
        let pinned = self.announced.lock().map(|a| a.clone()).unwrap_or_default();
        if let Some(addr) = pinned {
            match self.open_master(&addr, config).await {
                Ok(opened) => return Ok(opened),
                Err(error) => {
                    tracing::info!(
                        %error,
                        master = %format_args!("{}:{}", addr.0, addr.1),
                        "the announced master does not answer as one; asking the sentinels",
                    );
                    // Unless a newer announcement replaced it meanwhile.
                    if let Ok(mut announced) = self.announced.lock() {
                        if announced.as_ref() == Some(&addr) {
                            *announced = None;
                        }
                    }
                }
            }
        }
        let addr = master_lookup::elect(
            &self.sentinels,
            &self.master_name,
            &self.timeouts,
            self.ask_bound,
        )
        .await?;
        tracing::debug!(master = %format_args!("{}:{}", addr.0, addr.1), "sentinels named the master");
        self.open_master(&addr, config).await
    }

    /// Connects to the server at `addr` as the master is reached and checks its `ROLE`.
    async fn open_master(
        &self,
        addr: &Addr,
        config: &AsyncConnectionConfig,
    ) -> RedisResult<(redis::Client, MultiplexedConnection)> {
        let client = self.data_node(&addr.0, addr.1).map_err(|e| {
            RedisError::from((
                ErrorKind::InvalidClientConfig,
                "cannot make a client of the master",
                e.to_string(),
            ))
        })?;
        let mut conn = client
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        master_lookup::confirm_master(&mut conn, addr).await?;
        Ok((client, conn))
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

    /// A client of the data node (the master or a replica) at `host:port` that logs in as
    /// the master is, over TLS with the builder's certificates when the sentinels are.
    pub(crate) fn data_node(&self, host: &str, port: u16) -> Result<redis::Client, BuildError> {
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
        let mut backoff = Backoff::up_to(max_backoff);
        for sentinel in self.sentinels.iter().cycle() {
            let listened = tokio::select! {
                _ = shutdown.cancelled() => return,
                listened = self.listen_to(sentinel, &failure_epoch, connect_timeout) => listened,
            };
            // Its connection ended after subscribing: the next sentinel may be fine.
            if let Err(error) = listened {
                tracing::debug!(%error, "cannot listen to a sentinel for promotions");
            } else {
                backoff.reset();
            }
            let wait = backoff.next();
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
            let fields: Vec<&str> = payload.split(' ').collect();
            if fields.first() != Some(&self.master_name.as_str()) {
                continue;
            }
            tracing::info!(switch = %payload, "the sentinels promoted a new master");
            // Pinned before the announcement, so that what it wakes connects there.
            if let [_, _, _, host, port] = fields[..] {
                if let (Ok(port), Ok(mut announced)) = (port.parse(), self.announced.lock()) {
                    *announced = Some((host.to_owned(), port));
                }
            }
            failure_epoch.raise();
            self.promotions.send_modify(|n| *n += 1);
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

impl fmt::Debug for SentinelGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelGroup")
            .field("master_name", &self.master_name)
            .finish_non_exhaustive()
    }
}

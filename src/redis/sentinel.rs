//! Redis Sentinel: the master of a named group, looked up through the sentinels each time a
//! connection is opened.
//!
//! The lookup is redis-rs' own (`SENTINEL MASTERS` on each sentinel in turn, skipping a
//! master flagged down, then `ROLE` on the named master to confirm it takes writes). The
//! backend never caches the answer: a connection that fails (the master died, or it
//! answered `READONLY` after a demotion) is retired by the pool, and the next one asks the
//! sentinels again, which is how the backend follows a failover.

use std::fmt;

use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{ConnectionInfo, IntoConnectionInfo, RedisResult};
use tokio::sync::Mutex;

use crate::error::BuildError;

/// The sentinels of one master group and how to reach the master they name.
pub(crate) struct SentinelGroup {
    /// redis-rs' lookup keeps one connection per sentinel; lookups take turns on it.
    sentinel: Mutex<Sentinel>,
    master_name: String,
    master: SentinelNodeConnectionInfo,
}

impl SentinelGroup {
    /// Parses the sentinel URLs. The master is reached with the username, password and
    /// database of the first URL; the sentinels themselves with each URL's credentials and
    /// no database (a sentinel has none, and refuses `SELECT`).
    pub(crate) fn new(urls: &[String], master_name: &str) -> Result<Self, BuildError> {
        let url_error =
            |source: Box<dyn std::error::Error + Send + Sync>| BuildError::Url { source };
        if master_name.is_empty() {
            return Err(BuildError::Setting {
                name: "sentinel",
                reason: "the master name must not be empty",
            });
        }
        let infos = urls
            .iter()
            .map(|url| url.as_str().into_connection_info())
            .collect::<RedisResult<Vec<ConnectionInfo>>>()
            .map_err(|e| url_error(Box::new(e)))?;
        let Some(first) = infos.first() else {
            return Err(BuildError::Setting {
                name: "sentinel",
                reason: "at least one sentinel URL is needed",
            });
        };
        let master = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(first.redis_settings().clone());
        let sentinels = infos
            .into_iter()
            .map(|info| {
                let settings = info.redis_settings().clone().set_db(0);
                info.set_redis_settings(settings)
            })
            .collect();
        let sentinel = Sentinel::build(sentinels).map_err(|e| url_error(Box::new(e)))?;
        Ok(SentinelGroup {
            sentinel: Mutex::new(sentinel),
            master_name: master_name.to_owned(),
            master,
        })
    }

    /// The client of the master the sentinels name now, confirmed by its `ROLE`.
    pub(crate) async fn master(&self) -> RedisResult<redis::Client> {
        let mut sentinel = self.sentinel.lock().await;
        let master = sentinel
            .async_master_for(&self.master_name, Some(&self.master))
            .await?;
        tracing::debug!(master = ?master.get_connection_info().addr(), "sentinels named the master");
        Ok(master)
    }
}

impl fmt::Debug for SentinelGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelGroup")
            .field("master_name", &self.master_name)
            .finish_non_exhaustive()
    }
}

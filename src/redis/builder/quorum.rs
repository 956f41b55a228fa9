//! [`RedisBackendBuilder::build`] for a quorum: each master connected and checked as a
//! single server is, then refused if it is not an independent master.

use std::sync::Arc;

use futures_util::future::join_all;

use super::{RedisBackendBuilder, Target};
use crate::core::Core;
use crate::error::BuildError;
use crate::redis::connection::pool::Pool;
use crate::redis::quorum::QuorumStore;
use crate::redis::store::RedisStore;
use crate::redis::{Inner, RedisBackend};

impl RedisBackendBuilder {
    /// Builds a backend on the masters at `urls` (see `RedisBackend::quorum`).
    pub(super) async fn build_quorum(self, urls: Vec<String>) -> Result<RedisBackend, BuildError> {
        let refuse = |addr: String, reason| Err(BuildError::Quorum { addr, reason });
        if urls.len() < 3 {
            return refuse(
                String::new(),
                "it needs at least three masters (a majority of two is both: one down stops \
                 every lock)",
            );
        }
        if self.sync_replicas.is_some() {
            return Err(BuildError::Setting {
                name: "sync_replicas",
                reason: "a quorum's masters are independent servers: its majority is what \
                         keeps a lock when one is lost",
            });
        }
        // No handoffs in memory: they would hand a hold on and issue tokens on the word of
        // the one master a release went to first.
        let parts = self.settings.clone().without_handoffs().parts();
        let builders: Vec<Self> = urls
            .iter()
            .map(|url| RedisBackendBuilder {
                target: Target::Url(url.clone()),
                quorum_master: true,
                ..self.clone()
            })
            .collect();
        let stores = join_all(builders.iter().map(|b| b.store(&parts))).await;
        let masters = match distinct_masters(&urls, stores).await {
            Ok(masters) => masters,
            Err(e) => {
                // The masters built so far have tasks running: stop them.
                parts.shutdown.cancel();
                return Err(e);
            }
        };
        let Some(lead) = masters.first().cloned() else {
            return refuse(String::new(), "it has no master");
        };
        let store = QuorumStore {
            masters,
            lead,
            master_timeout: self.settings.command_timeout / 2,
            permits: Default::default(),
        };
        Ok(RedisBackend {
            inner: Inner::Quorum(Core::new(store, parts)),
        })
    }
}

/// The masters built for `urls`, unless one failed or two are the same server.
async fn distinct_masters(
    urls: &[String],
    stores: Vec<Result<RedisStore, BuildError>>,
) -> Result<Vec<Arc<RedisStore>>, BuildError> {
    let mut masters: Vec<Arc<RedisStore>> = Vec::with_capacity(urls.len());
    let mut run_ids: Vec<String> = Vec::with_capacity(urls.len());
    for (url, store) in urls.iter().zip(stores) {
        let store = store?;
        let info = store
            .pool
            .query::<String>(redis::cmd("INFO").arg("server"))
            .await
            .unwrap_or_default();
        let run_id = info_field(&info, "run_id").unwrap_or_default().to_owned();
        if run_ids.contains(&run_id) {
            return Err(BuildError::Quorum {
                addr: addr_of(url),
                reason: "it is the same server (run_id) as another URL of the quorum: a \
                         majority must be of distinct servers",
            });
        }
        run_ids.push(run_id);
        masters.push(Arc::new(store));
    }
    Ok(masters)
}

/// Refuses a quorum's master that is a node of a Redis Cluster or a replica, naming it,
/// before the checks that would fail on it with a less telling error. A user who may not
/// run `INFO` is refused too: the restart guard needs it.
pub(super) async fn refuse_non_master(pool: &Pool, addr: &str) -> Result<(), BuildError> {
    let info = pool
        .query::<String>(redis::cmd("INFO").arg("cluster").arg("replication"))
        .await
        .unwrap_or_default();
    let refuse = |reason| {
        Err(BuildError::Quorum {
            addr: addr.to_owned(),
            reason,
        })
    };
    if info_field(&info, "cluster_enabled") == Some("1") {
        return refuse(
            "it is a node of a Redis Cluster; a quorum's masters are independent single servers",
        );
    }
    if info_field(&info, "role") != Some("master") {
        return refuse(
            "it is a replica (or its user may not run INFO): a quorum's masters must each take \
             writes on their own",
        );
    }
    Ok(())
}

/// The `host:port` of `url`, for errors (the URL itself may carry a password).
fn addr_of(url: &str) -> String {
    redis::IntoConnectionInfo::into_connection_info(url).map_or_else(
        |_| "an invalid URL".to_owned(),
        |info| info.addr().to_string(),
    )
}

/// The value of `name` in an `INFO` reply.
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

//! [`RedisBackendBuilder::build`] for a quorum: each master connected and checked as a
//! single server is, then refused if it is not an independent master.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::future::join_all;

use super::build::{LaterChecks, is_down};
use super::{RedisBackendBuilder, Target};
use crate::core::kit::backoff::Backoff;
use crate::core::{Core, Parts};
use crate::error::BuildError;
use crate::redis::connection::pool::Pool;
use crate::redis::quorum::{QuorumStore, majority};
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
        let stores = join_all(builders.iter().map(|b| b.master(&parts, true))).await;
        let (masters, later) = match distinct_masters(&urls, stores).await {
            Ok(built) => built,
            Err(e) => {
                // The masters built so far have tasks running: stop them.
                parts.shutdown.cancel();
                return Err(e);
            }
        };
        let checked: Vec<Arc<AtomicBool>> = (later.slots.iter())
            .map(|slot| Arc::new(AtomicBool::new(slot.is_none())))
            .collect();
        let up = checked.iter().filter(|c| c.load(Ordering::Relaxed)).count();
        if up < majority(urls.len()) {
            parts.shutdown.cancel();
            // The first master that could not be reached says why.
            let error = later.slots.into_iter().flatten().next().map(|l| l.error);
            return Err(error.unwrap_or(BuildError::Quorum {
                addr: String::new(),
                reason: "fewer than a majority of its masters answered",
            }));
        }
        later.check_when_up(&urls, &checked, &parts, self.settings.max_backoff);
        let Some(lead) = masters.first().cloned() else {
            return refuse(String::new(), "it has no master");
        };
        let store = QuorumStore {
            masters,
            lead,
            master_timeout: self.settings.command_timeout / 2,
            permits: Default::default(),
            checked,
        };
        Ok(RedisBackend {
            inner: Inner::Quorum(Core::new(store, parts)),
        })
    }
}

/// The masters built for `urls`, and the checks of those that were down (unless one
/// failed otherwise, or two are the same server).
async fn distinct_masters(
    urls: &[String],
    stores: Vec<Result<(RedisStore, Option<LaterChecks>), BuildError>>,
) -> Result<(Vec<Arc<RedisStore>>, Later), BuildError> {
    let mut masters: Vec<Arc<RedisStore>> = Vec::with_capacity(urls.len());
    let mut later = Later::default();
    for (url, store) in urls.iter().zip(stores) {
        let (store, checks) = store?;
        if checks.is_none() && !later.run_ids.distinct(run_id(&store.pool).await) {
            return Err(same_server(addr_of(url)));
        }
        later.slots.push(checks);
        masters.push(Arc::new(store));
    }
    Ok((masters, later))
}

fn same_server(addr: String) -> BuildError {
    BuildError::Quorum {
        addr,
        reason: "it is the same server (run_id) as another URL of the quorum: a majority \
                 must be of distinct servers",
    }
}

/// The server's `run_id` (empty if it does not tell it).
pub(super) async fn run_id(pool: &Pool) -> String {
    let info = pool
        .query::<String>(redis::cmd("INFO").arg("server"))
        .await
        .unwrap_or_default();
    info_field(&info, "run_id").unwrap_or_default().to_owned()
}

/// The `run_id`s of the masters checked so far, at build and since.
#[derive(Clone, Default)]
struct RunIds(Arc<std::sync::Mutex<Vec<String>>>);

impl RunIds {
    /// Records a checked master's `run_id`: `false` if another master has it.
    fn distinct(&self, run_id: String) -> bool {
        let mut run_ids = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if run_ids.contains(&run_id) {
            return false;
        }
        run_ids.push(run_id);
        true
    }
}

/// The checks of the masters that were down at build (by index), and the `run_id`s of the
/// masters checked.
#[derive(Default)]
struct Later {
    slots: Vec<Option<LaterChecks>>,
    run_ids: RunIds,
}

impl Later {
    /// Checks each master that was down at build once it answers (with capped backoff,
    /// until the backend is dropped), and lets it take part in acquisitions once it passed
    /// the build's checks and is not another master's server. Logged once each way: WARN
    /// when built without it, INFO when it takes part, ERROR when a check refuses it.
    fn check_when_up(
        self,
        urls: &[String],
        checked: &[Arc<AtomicBool>],
        parts: &Parts,
        max_backoff: Duration,
    ) {
        let run_ids = self.run_ids.clone();
        for (i, slot) in self.slots.into_iter().enumerate() {
            let (Some(checks), Some(flag)) = (slot, checked.get(i).cloned()) else {
                continue;
            };
            let addr = addr_of(&urls[i]);
            tracing::warn!(
                master = %addr,
                error = %checks.error,
                "quorum master down at build; it takes part in acquisitions once it answers \
                 and passes the build's checks"
            );
            let (run_ids, shutdown) = (run_ids.clone(), parts.shutdown.clone());
            parts.runtime.spawn(async move {
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = check_until_passed(&checks, &addr, run_ids, max_backoff) => {
                        flag.store(true, Ordering::Release);
                    }
                }
            });
        }
    }
}

/// Runs `checks` until they pass (a refusal logged once at ERROR, then again after the
/// backoff), and the master proves a server of its own.
async fn check_until_passed(
    checks: &LaterChecks,
    addr: &str,
    run_ids: RunIds,
    max_backoff: Duration,
) {
    let mut backoff = Backoff::up_to(max_backoff);
    let mut refused = false;
    loop {
        match checks.run().await {
            Ok(()) => {
                if run_ids.distinct(run_id(checks.pool()).await) {
                    tracing::info!(master = %addr, "quorum master checked; it takes part in acquisitions");
                    return;
                }
                if !std::mem::replace(&mut refused, true) {
                    tracing::error!(master = %addr, error = %same_server(addr.to_owned()), "quorum master refused");
                }
            }
            Err(e) if is_down(&e) => {
                tracing::debug!(master = %addr, error = %e, "quorum master still down")
            }
            Err(e) => {
                if !std::mem::replace(&mut refused, true) {
                    tracing::error!(master = %addr, error = %e, "quorum master refused");
                }
            }
        }
        tokio::time::sleep(backoff.next()).await;
    }
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

//! Which server of a Sentinel group is the master: the address a majority of the configured
//! sentinels name, and a server that says it is a master when asked (`ROLE`).
//!
//! A sentinel's view can be old. One cut off from the others during a failover, or behind
//! them in hearing of it, still names the old master, and that server may still answer as
//! a master (the sentinels that promoted the replica could not reach it to demote it). A
//! client that takes the first sentinel's answer, as redis-rs' lookup does (the sentinels
//! in the configured order, the first that names a server answering `ROLE` as master
//! wins), then writes locks to the old master while other clients write them to the new
//! one: two holders of one lock.
//!
//! So every sentinel is asked at once, each answer awaited for the command timeout at
//! most, and a server is the master only if more than half of the *configured* sentinels
//! name it (the lookup ends as soon as that many do, so a silent sentinel delays nothing
//! while the others agree). Not half of those that answer: a stale sentinel alone would then decide whenever
//! the others cannot be reached, which is just when it is likely stale. It is the rule
//! Sentinel itself follows to authorise a failover (a majority of the sentinels must elect
//! its leader), so any majority that answers holds a sentinel that took part in the last
//! authorised failover, and a stale answer cannot outvote it. Without such a majority the
//! connection attempt fails (the request gets a 503) with the error naming what each
//! sentinel said; a sentinel that flags its master down (`s_down`, `o_down`) names none, as
//! in redis-rs.
//!
//! The server so named must then answer `ROLE` (or, where ACLs deny it, `INFO
//! replication`) as a master on the very connection the backend will use: a server that
//! reports itself a replica is refused with an error that says so.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionInfo, ErrorKind, RedisError, RedisResult, Role};
use tokio::time::timeout;

/// `host:port` of a data node.
pub(crate) type Addr = (String, u16);

/// What one sentinel said about the master.
enum Answer {
    /// It names the master at this address and does not flag it down.
    Named(Addr),
    /// It flags the master down: it names none that it can reach.
    Down,
    /// It does not monitor a master of that name.
    Unknown(RedisError),
    /// It could not be asked: unreachable, too slow, or it refused the login.
    Failed(RedisError),
}

/// Asks the sentinel at `sentinel` for the master named `name` (`SENTINEL MASTER`), within
/// `bound`, connecting included.
async fn ask(
    sentinel: &ConnectionInfo,
    name: &str,
    config: &AsyncConnectionConfig,
    bound: Duration,
) -> Answer {
    let asked = async {
        let mut conn = redis::Client::open(sentinel.clone())?
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(name)
            .query_async::<HashMap<String, String>>(&mut conn)
            .await
    };
    let master = match timeout(bound, asked).await {
        Ok(Ok(master)) => master,
        Ok(Err(e)) if e.code() == Some("ERR") && e.to_string().contains("No such master") => {
            return Answer::Unknown(e);
        }
        Ok(Err(e)) => return Answer::Failed(e),
        Err(_) => return Answer::Failed(std::io::Error::from(std::io::ErrorKind::TimedOut).into()),
    };
    let down = master.get("flags").is_some_and(|flags| {
        flags
            .split(',')
            .any(|flag| matches!(flag, "s_down" | "o_down"))
    });
    let addr = master
        .get("ip")
        .zip(master.get("port").and_then(|port| port.parse().ok()));
    match addr {
        Some((ip, port)) if !down => Answer::Named((ip.clone(), port)),
        // Every sentinel reports both; one that does not names nothing usable.
        _ => Answer::Down,
    }
}

/// The address more than half of `sentinels` name for the master `name`, each asked at
/// once within `bound`: as soon as one has that many. Otherwise: the error of the last
/// sentinel when none could be asked (the cause a build reports), the sentinels' own error
/// when none of those asked knows the name, or the disagreement.
pub(crate) async fn elect(
    sentinels: &[ConnectionInfo],
    name: &str,
    config: &AsyncConnectionConfig,
    bound: Duration,
) -> RedisResult<Addr> {
    let configured = sentinels.len();
    let mut asks: FuturesUnordered<_> = sentinels
        .iter()
        .map(|sentinel| ask(sentinel, name, config, bound))
        .collect();
    let mut named: BTreeMap<Addr, usize> = BTreeMap::new();
    let (mut down, mut unknown, mut failed) = (0, None, None);
    let mut failures = 0;
    while let Some(answer) = asks.next().await {
        match answer {
            Answer::Named(addr) => {
                let votes = named.entry(addr.clone()).or_default();
                *votes += 1;
                if *votes > configured / 2 {
                    return Ok(addr);
                }
            }
            Answer::Down => down += 1,
            Answer::Unknown(e) => unknown = Some(e),
            Answer::Failed(e) => {
                failures += 1;
                failed = Some(e);
            }
        }
    }
    if named.is_empty() && down == 0 {
        if let Some(e) = unknown.or(failed.clone()) {
            return Err(e);
        }
    }
    let mut said = String::new();
    for ((host, port), n) in &named {
        let _ = write!(said, "{host}:{port} named by {n}, ");
    }
    if down > 0 {
        let _ = write!(said, "flagged down by {down}, ");
    }
    let unknowing = configured - named.values().sum::<usize>() - down - failures;
    if unknowing > 0 {
        let _ = write!(said, "unknown to {unknowing}, ");
    }
    if let Some(e) = failed {
        let _ = write!(said, "{failures} could not be asked (last: {e}), ");
    }
    Err(RedisError::from((
        ErrorKind::MasterNameNotFoundBySentinel,
        "no master named by a majority of the sentinels",
        format!(
            "of the {configured} sentinels of `{name}`, {} need to agree: {}",
            configured / 2 + 1,
            said.trim_end_matches(", ")
        ),
    )))
}

/// Checks that the server behind `conn`, at `addr`, says it is a master.
pub(crate) async fn confirm_master(
    conn: &mut MultiplexedConnection,
    addr: &Addr,
) -> RedisResult<()> {
    let role = match redis::cmd("ROLE").query_async::<Role>(conn).await {
        Ok(Role::Primary { .. }) => return Ok(()),
        Ok(Role::Replica { .. }) => "slave".to_owned(),
        Ok(Role::Sentinel { .. }) => "sentinel".to_owned(),
        Ok(_) => "unknown".to_owned(),
        // ROLE denied (an ACL) or unknown: the same line of `INFO replication`.
        Err(e) if matches!(e.kind(), ErrorKind::Server(_)) => {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(conn)
                .await?;
            let role = info
                .lines()
                .find_map(|line| line.strip_prefix("role:"))
                .unwrap_or("unknown");
            if role == "master" {
                return Ok(());
            }
            role.to_owned()
        }
        Err(e) => return Err(e),
    };
    Err(RedisError::from((
        ErrorKind::MasterNameNotFoundBySentinel,
        "the server named as master is not one",
        format!(
            "{}:{} reports role:{role}; refused until a master is named",
            addr.0, addr.1
        ),
    )))
}

//! A master with one replica (`redis-server --replicaof`), both throwaway servers on free
//! loopback ports, killed on drop like every [`RedisServer`].

use std::time::Duration;

use super::{RedisServer, eventually};

/// A master and one replica linked to it.
pub struct Replicated {
    pub master: RedisServer,
    pub replica: RedisServer,
}

impl Replicated {
    /// Starts both and waits (generously) until the replica has synced with the master and
    /// acknowledges writes.
    pub async fn start() -> Self {
        // Diskless sync without its default 5 s delay: the replica links at once.
        let master = RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]);
        let port = master.port().to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
        let set = Replicated { master, replica };
        eventually("the replica is linked to the master", || async {
            info_field(&set.replica, "replication", "master_link_status").await == "up"
                && info_field(&set.master, "replication", "slave0")
                    .await
                    .contains("state=online")
        })
        .await;
        // A freshly linked replica may be slow to acknowledge its first writes: wait until
        // it acknowledges one, so that the tests measure a settled pair.
        let mut conn = set.master.conn().await;
        eventually("the replica acknowledges a write", || {
            let mut conn = conn.clone();
            async move {
                let mut pipe = redis::pipe();
                pipe.cmd("SET").arg("replica-warm-up").arg(1).ignore();
                pipe.cmd("WAIT").arg(1).arg(100);
                let (acked,): (i64,) = pipe.query_async(&mut conn).await.expect("SET, WAIT");
                acked == 1
            }
        })
        .await;
        let _: () = redis::cmd("DEL")
            .arg("replica-warm-up")
            .query_async(&mut conn)
            .await
            .expect("DEL");
        set
    }
}

/// One `field:value` line of `INFO section` on `server`.
pub async fn info_field(server: &RedisServer, section: &str, field: &str) -> String {
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query_async(&mut server.conn().await)
        .await
        .expect("INFO");
    let prefix = format!("{field}:");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// How long a replica may take to acknowledge in the tests that expect it to (generous:
/// the replica shares a busy machine).
pub const ACK_TIMEOUT: Duration = Duration::from_secs(1);

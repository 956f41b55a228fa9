//! Faults of a [`SentinelSet`]: sentinels locked out of data nodes (their ACL users
//! turned off and their connections cut) while clients still reach them, sentinels paused,
//! the master killed, a data node restarted empty or made a replica.

use std::collections::HashMap;

use super::{MASTER_NAME, SentinelSet, connect, sentinel_user};
use crate::support::{RedisServer, eventually};

impl SentinelSet {
    /// Locks the sentinels out of the current master (their users are disabled and their
    /// connections cut) while clients keep reaching it: to the sentinels it is down, so
    /// they promote the replica and cannot demote the old master, which stays writable.
    /// Returns the old master's port. Needs [`require_password`](Self::require_password).
    pub async fn cut_sentinels_off(&self) -> u16 {
        let port = self.master_port().await;
        let all: Vec<usize> = (0..self.sentinels.len()).collect();
        self.lock_out(port, &all).await;
        port
    }

    /// A partition with the sentinel `stale` on the master's side: the other sentinels are
    /// locked out of the master, `stale` out of the replica and out of their hello
    /// messages. The others promote the replica; `stale` hears of it neither from them nor
    /// from the new master, so it keeps naming the
    /// old master, which keeps answering and taking writes. Waits until the sentinels say
    /// so (see [`named_by`](Self::named_by)); returns the old and the new master's ports.
    /// Needs [`require_password`](Self::require_password); undone by
    /// [`reconnect_sentinels`](Self::reconnect_sentinels).
    pub async fn split_off_sentinel(&self, stale: usize) -> (u16, u16) {
        let (old, replica) = self.ports().await;
        let others: Vec<usize> = (0..self.sentinels.len()).filter(|i| *i != stale).collect();
        self.deafen(&[stale], true).await;
        self.lock_out(replica, &[stale]).await;
        self.lock_out(old, &others).await;
        eventually("the other sentinels promote the replica", || async {
            let mut named = Vec::new();
            for i in &others {
                named.push(self.named_by(*i).await);
            }
            named
                .iter()
                .all(|n| n.as_ref() == Some(&(replica, "master".to_owned())))
        })
        .await;
        let view = self.named_by(stale).await;
        assert_eq!(
            view,
            Some((old, "master".to_owned())),
            "the cut-off sentinel still names the old master, healthy"
        );
        (old, replica)
    }

    /// The reverse of [`split_off_sentinel`](Self::split_off_sentinel): sentinel `leader`
    /// is locked out of the master, the others out of the replica and out of its hello
    /// messages, and `leader` alone is
    /// asked to fail over (`SENTINEL FAILOVER` takes no vote). It promotes the replica and
    /// announces it; the others hear nothing of it and keep naming the old master, which
    /// they still reach and which no sentinel can demote. Returns the old and the new
    /// master's ports. Undone by [`reconnect_sentinels`](Self::reconnect_sentinels).
    pub async fn fail_over_alone(&self, leader: usize) -> (u16, u16) {
        let (old, replica) = self.ports().await;
        let others: Vec<usize> = (0..self.sentinels.len()).filter(|i| *i != leader).collect();
        self.deafen(&others, true).await;
        self.lock_out(old, &[leader]).await;
        self.lock_out(replica, &others).await;
        self.switchover_by(leader).await;
        eventually("the leader names the replica", || async {
            self.named_by(leader).await == Some((replica, "master".to_owned()))
        })
        .await;
        for i in others {
            let view = self.named_by(i).await;
            assert_eq!(
                view,
                Some((old, "master".to_owned())),
                "sentinel {i} is stale"
            );
        }
        (old, replica)
    }

    /// The ports of the master and of the replica.
    async fn ports(&self) -> (u16, u16) {
        let master = self.master_port().await;
        let replica = self
            .servers
            .iter()
            .map(RedisServer::port)
            .find(|port| *port != master)
            .expect("a replica");
        (master, replica)
    }

    /// The port of the master sentinel `i` names and the flags it gives it (`master`,
    /// `master,s_down`, ...); none if it cannot be asked.
    pub async fn named_by(&self, i: usize) -> Option<(u16, String)> {
        let mut conn = connect(&self.sentinel_urls()[i]).await.ok()?;
        let master: HashMap<String, String> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(MASTER_NAME)
            .query_async(&mut conn)
            .await
            .ok()?;
        Some((
            master.get("port")?.parse().ok()?,
            master.get("flags")?.clone(),
        ))
    }

    /// Makes the sentinels `sentinels` refuse (or, with `deaf` false, take again) the
    /// `PUBLISH` of the other sentinels' hello messages: a sentinel announces each new
    /// configuration to its peers directly too, not only through the data nodes.
    async fn deafen(&self, sentinels: &[usize], deaf: bool) {
        let urls = self.sentinel_urls();
        for i in sentinels {
            let _: () = redis::cmd("ACL")
                .arg("SETUSER")
                .arg("default")
                .arg(if deaf { "-publish" } else { "+publish" })
                .query_async(&mut connect(&urls[*i]).await.expect("sentinel"))
                .await
                .expect("ACL SETUSER on a sentinel");
        }
    }

    /// Disables the users of the sentinels `sentinels` on the data node on `port` and cuts
    /// their connections there.
    async fn lock_out(&self, port: u16, sentinels: &[usize]) {
        let mut conn = self.data_conn(self.server(port)).await;
        for i in sentinels {
            let _: () = redis::cmd("ACL")
                .arg("SETUSER")
                .arg(sentinel_user(*i))
                .arg("off")
                .query_async(&mut conn)
                .await
                .expect("ACL SETUSER off");
            let _: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("USER")
                .arg(sentinel_user(*i))
                .query_async(&mut conn)
                .await
                .expect("CLIENT KILL USER");
        }
    }

    /// SIGKILLs the current master, as a crash would; returns its port.
    pub async fn kill_master(&mut self) -> u16 {
        let port = self.master_port().await;
        self.servers
            .iter_mut()
            .find(|s| s.port() == port)
            .expect("the master is a data node of the set")
            .kill();
        port
    }

    /// Makes the data node on `old_master` a replica of the current master, as the
    /// sentinels do on their own only at their next `INFO` round (every 10 s), so that
    /// the next failover has a replica to promote.
    pub async fn demote(&self, old_master: u16) {
        let master = self.master_port().await;
        assert_ne!(master, old_master, "the sentinels named a new master");
        let _: () = redis::cmd("REPLICAOF")
            .arg(self.ip.to_string())
            .arg(master)
            .query_async(&mut self.data_conn(self.server(old_master)).await)
            .await
            .expect("REPLICAOF");
    }

    /// SIGSTOPs sentinel `i`: it accepts connections and answers nothing.
    pub fn pause_sentinel(&self, i: usize) {
        crate::support::send_signal(self.sentinels[i].child.id(), "-STOP");
    }

    /// SIGCONT of sentinel `i` after [`pause_sentinel`](Self::pause_sentinel).
    pub fn resume_sentinel(&self, i: usize) {
        crate::support::send_signal(self.sentinels[i].child.id(), "-CONT");
    }

    /// Starts the data node on `port` again (after a kill), empty: as a replica of the
    /// node on `replica_of`, or as a master; with the password and the sentinels' users
    /// that [`require_password`](Self::require_password) set.
    pub async fn restart_empty(&mut self, port: u16, replica_of: Option<u16>) {
        let mut args = self.node_args.clone();
        if let Some(password) = &self.password {
            args.extend(["--masterauth".into(), password.clone()]);
            for i in 0..self.sentinels.len() {
                let user = [sentinel_user(i), "on".into(), format!(">{password}")];
                args.push("--user".into());
                args.extend(
                    user.into_iter()
                        .chain(["+@all", "~*", "&*"].map(Into::into)),
                );
            }
        }
        if let Some(master) = replica_of {
            args.extend([
                "--replicaof".into(),
                self.ip.to_string(),
                master.to_string(),
            ]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let server = self.servers.iter_mut().find(|s| s.port() == port);
        server.expect("a data node of the set").restart_with(&args);
        // Set last: the restart waits for an `INFO` without a password.
        if let Some(password) = self.password.clone() {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("requirepass")
                .arg(password)
                .query_async(&mut connect(&self.server(port).url()).await.expect("node"))
                .await
                .expect("CONFIG SET requirepass");
        }
    }

    /// Undoes [`cut_sentinels_off`](Self::cut_sentinels_off) or
    /// [`split_off_sentinel`](Self::split_off_sentinel) and makes the old master a replica
    /// of the new one.
    pub async fn reconnect_sentinels(&self, old_master: u16) {
        for server in &self.servers {
            let mut conn = self.data_conn(server).await;
            for i in 0..self.sentinels.len() {
                let _: () = redis::cmd("ACL")
                    .arg("SETUSER")
                    .arg(sentinel_user(i))
                    .arg("on")
                    .query_async(&mut conn)
                    .await
                    .expect("ACL SETUSER on");
            }
            // A sentinel keeps a connection whose AUTH was refused and takes every -NOAUTH
            // reply as the node being down: cut those connections (all but this one), so
            // that the sentinels reconnect and authenticate.
            for kind in ["normal", "pubsub"] {
                let _: i64 = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg(kind)
                    .query_async(&mut conn)
                    .await
                    .expect("CLIENT KILL TYPE");
            }
        }
        let all: Vec<usize> = (0..self.sentinels.len()).collect();
        self.deafen(&all, false).await;
        self.demote(old_master).await;
        self.wait_until_ready().await;
    }
}

//! One hash slot moved between primaries a step at a time, as `redis-cli --cluster
//! reshard` moves each slot, so that a test can act between the steps: the slot marked
//! IMPORTING on the target and MIGRATING on the source, its keys moved with `MIGRATE`
//! (some, then the rest), then its new owner announced to every primary.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Instant;

use super::cluster::Cluster;

/// A slot on its way from one primary to another.
pub struct Migration<'c> {
    cluster: &'c Cluster,
    /// The slot, as `CLUSTER KEYSLOT` writes it.
    pub slot: String,
    pub from: u16,
    pub to: u16,
    to_id: String,
}

impl<'c> Migration<'c> {
    /// Marks the slot of `key` IMPORTING on the primary on `to`, then MIGRATING on its
    /// owner (the order `redis-cli` uses: the target must accept ASKING first).
    pub fn begin(cluster: &'c Cluster, key: &str, to: u16) -> Self {
        let from = cluster.primary_of(key);
        let slot = cluster
            .run(from, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .to_owned();
        let id = |port: u16| cluster.run(port, &["CLUSTER", "MYID"]).trim().to_owned();
        let (from_id, to_id) = (id(from), id(to));
        let imported = cluster.run(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]);
        assert_eq!(imported.trim(), "OK", "IMPORTING on {to}");
        let migrating = cluster.run(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]);
        assert_eq!(migrating.trim(), "OK", "MIGRATING on {from}");
        Migration {
            cluster,
            slot,
            from,
            to,
            to_id,
        }
    }

    /// Moves `keys` (of the slot) to the target with one `MIGRATE`.
    pub fn migrate(&self, keys: &[&str]) {
        let to = self.to.to_string();
        let mut migrate = vec!["MIGRATE", "127.0.0.1", &to, "", "0", "5000", "KEYS"];
        migrate.extend(keys);
        let reply = self.cluster.run(self.from, &migrate);
        assert_eq!(reply.trim(), "OK", "MIGRATE {keys:?}");
    }

    /// The slot's keys still on the source.
    pub fn left(&self) -> Vec<String> {
        let keys = self
            .cluster
            .run(self.from, &["CLUSTER", "GETKEYSINSLOT", &self.slot, "1000"]);
        keys.lines()
            .filter(|k| !k.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// Moves whatever keys of the slot are left on the source.
    pub fn migrate_rest(&self) {
        let left = self.left();
        if !left.is_empty() {
            self.migrate(&left.iter().map(String::as_str).collect::<Vec<_>>());
        }
    }

    /// `SETSLOT NODE` on the target, then the source (which drops the slot's sharded
    /// subscriptions then), then the other primaries; waits until the slot map says so.
    /// Returns when the command went out to the source, on a connection opened before.
    pub fn finish(self) -> Instant {
        let others = self
            .cluster
            .primaries()
            .into_iter()
            .filter(|p| ![self.to, self.from].contains(p));
        let node = ["CLUSTER", "SETSLOT", &self.slot, "NODE", &self.to_id];
        self.cluster.run(self.to, &node);
        let mut source = TcpStream::connect(("127.0.0.1", self.from)).expect("connect");
        let left_source = Instant::now();
        let reply = send(&mut source, &node);
        assert_eq!(reply, "+OK", "SETSLOT NODE on the source");
        for port in others {
            self.cluster.run(port, &node);
        }
        self.cluster.wait_until_slot_served(&self.slot, self.to);
        left_source
    }
}

/// Sends `args` as one RESP command on `conn` and returns the first line of the reply.
fn send(conn: &mut TcpStream, args: &[&str]) -> String {
    let mut command = format!("*{}\r\n", args.len());
    for arg in args {
        command.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    conn.write_all(command.as_bytes()).expect("send");
    let mut reply = String::new();
    BufReader::new(conn).read_line(&mut reply).expect("reply");
    reply.trim_end().to_owned()
}

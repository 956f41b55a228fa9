//! A throwaway MariaDB: `mariadb-install-db` and `mariadbd` in a temp dir, on a free
//! loopback port with its socket in that dir, stopped when dropped (SIGTERM, then SIGKILL
//! if it is not gone within [`STOP_BOUND`](process::STOP_BOUND)). Nothing here touches a
//! MariaDB it did not start: the machine's own (on 3306) is never used, and
//! `--no-defaults` keeps the machine's option files out. As root (CI), both programs run with `--user=root`.
//!
//! Grants are kept (no `--skip-grant-tables`), so that tests can create users without
//! rights and see `build()` refuse them.

use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::process::{self, NetHost, command_on, free_port, lan_ip, uplink_ip};

/// Ports tried: between picking a free port and `mariadbd` binding it, another process
/// may take it.
const ATTEMPTS: usize = 10;

/// A `mariadbd` this process started and owns; its data is gone when it is dropped.
pub struct MariaDbServer {
    child: Option<Child>,
    port: u16,
    /// A reaper, and with it the write end of its stdin (see [`shared`]).
    reaper: Option<Child>,
    /// The host it runs in (see `netns.rs`), or `None` for the test's own loopback.
    host: Option<NetHost>,
    // Removed after the server is stopped (fields drop after `Drop::drop`).
    dir: tempfile::TempDir,
}

impl MariaDbServer {
    /// Installs a data directory, starts a server on it and waits until it accepts
    /// connections; panics with the cause if it cannot (MariaDB not installed, ...).
    pub fn start() -> Self {
        Self::try_start().unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_start() -> Result<Self, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let out = Command::new(program("mariadb-install-db"))
            .args(["--no-defaults", "--skip-test-db"])
            .args(as_root())
            .arg("--auth-root-authentication-method=normal")
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            // Its own temporary files: the bootstrap's in a shared /tmp have been seen to
            // collide with another bootstrap's ("Error on delete of '/tmp/#sql-temptable-..").
            .arg(format!("--tmpdir={}", dir.path().display()))
            .stdin(Stdio::null())
            .output()
            .map_err(|e| {
                format!(
                    "could not run mariadb-install-db ({e}): install MariaDB (Debian/Ubuntu: \
                     apt-get install mariadb-server)"
                )
            })?;
        if !out.status.success() {
            return Err(format!(
                "mariadb-install-db failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let mut server = MariaDbServer {
            child: None,
            port: 0,
            reaper: None,
            host: None,
            dir,
        };
        for _ in 0..ATTEMPTS {
            if server.spawn(free_port()?)? {
                server.client("CREATE DATABASE test")?;
                return Ok(server);
            }
        }
        Err(format!(
            "mariadbd did not start ({ATTEMPTS} ports tried); its log ends: {}",
            server.log().lines().last().unwrap_or("(nothing)")
        ))
    }

    /// Runs `mariadbd` on `port`; false if it exited before it was ready (the port was
    /// taken).
    fn spawn(&mut self, port: u16) -> Result<bool, String> {
        let dir = self.dir.path();
        // On a host of its own, on every address (`ip netns exec` execs mariadbd: the pid
        // is the server's).
        let bind = if self.host.is_some() {
            "0.0.0.0"
        } else {
            "127.0.0.1"
        };
        let child = command_on(self.host.as_ref(), program("mariadbd"))
            .arg("--no-defaults")
            .arg(format!("--bind-address={bind}"))
            .args(as_root())
            .arg(format!("--port={port}"))
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg(format!("--tmpdir={}", dir.display()))
            .arg(format!("--socket={}", dir.join("sock").display()))
            .arg(format!("--pid-file={}", dir.join("mariadbd.pid").display()))
            .arg(format!(
                "--log-error={}",
                dir.join("mariadbd.log").display()
            ))
            // Throwaway data: nothing needs to survive a crash.
            .args(["--innodb-flush-log-at-trx-commit=2", "--sync-binlog=0"])
            .args(["--skip-name-resolve", "--max-connections=500"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("could not run mariadbd: {e}"))?;
        self.port = port;
        self.child = Some(child);
        self.wait_until_ready()
    }

    /// Runs `sql` with the `mariadb` client, as root.
    pub fn client(&self, sql: &str) -> Result<(), String> {
        let out = Command::new("mariadb")
            .args(["--no-defaults", "-uroot", "-h127.0.0.1"])
            .arg(format!("-P{}", self.port))
            .args(["-e", sql])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("could not run the mariadb client: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{sql}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(())
    }

    /// Waits until this server's log says it is ready for connections on its port, so
    /// another server that won the port race cannot be mistaken for it.
    fn wait_until_ready(&mut self) -> Result<bool, String> {
        let ready = "ready for connections.\nVersion: ";
        let deadline = Instant::now() + Duration::from_secs(60);
        let port = format!("port: {}", self.port);
        let before = self.log().len();
        while Instant::now() < deadline {
            let Some(child) = self.child.as_mut() else {
                return Ok(false);
            };
            if let Ok(Some(_)) = child.try_wait() {
                self.child = None;
                return Ok(false);
            }
            let log = self.log();
            let new = log.get(before..).unwrap_or_default();
            if new.contains(ready) && new.contains(&port) {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err("mariadbd did not become ready within 60 s".to_owned())
    }

    /// Stops the server (clients are cut off) and starts it again on the same port and
    /// data, waiting until it accepts connections.
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// Starts a server stopped with [`stop`](Self::stop) again, on the same port and data.
    pub fn start_again(&mut self) {
        assert!(
            self.spawn(self.port).expect("mariadbd runs again"),
            "mariadbd did not start again on port {}",
            self.port
        );
    }

    /// What the server logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("mariadbd.log")).unwrap_or_default()
    }

    /// A connection of the test's own, as root.
    pub async fn conn(&self) -> sqlx::MySqlConnection {
        use sqlx::Connection;
        sqlx::MySqlConnection::connect(&self.url())
            .await
            .expect("connect to the test MariaDB")
    }

    /// Runs `statement` as root (text protocol: any statement).
    pub async fn execute(&self, statement: &str) {
        use sqlx::Executor;
        self.conn()
            .await
            .execute(sqlx::raw_sql(statement))
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }

    /// A global status counter (`SHOW GLOBAL STATUS LIKE name`).
    pub async fn status(&self, name: &str) -> u64 {
        let show = format!("SHOW GLOBAL STATUS LIKE '{name}'");
        let (_, value) = sqlx::query_as::<_, (String, String)>(&show)
            .fetch_one(&mut self.conn().await)
            .await
            .expect("global status");
        value.parse().expect("a counter")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `mysql://root@127.0.0.1:PORT/test` (the `test` database, created at start).
    pub fn url(&self) -> String {
        self.url_as("root", "")
    }

    /// The URL of `user` with `password`, on the `test` database.
    pub fn url_as(&self, user: &str, password: &str) -> String {
        self.url_at(user, password, uplink_ip(self.host.as_ref()))
    }

    /// Where clients on other hosts reach a server on a host of its own
    /// ([`start_in`](Self::start_in)), as root.
    pub fn lan_url(&self) -> String {
        self.url_at("root", "", lan_ip(self.host.as_ref()))
    }

    /// The URL of `user` at `ip`, an address of the server's host.
    fn url_at(&self, user: &str, password: &str, ip: std::net::Ipv4Addr) -> String {
        format!("mysql://{user}:{password}@{ip}:{}/test", self.port)
    }

    /// A server on `host`, listening on every address of it, with root allowed from every
    /// address without a password: clients on other hosts dial it at its `lan` address,
    /// the test at its `uplink`.
    pub fn start_in(host: NetHost) -> Self {
        let mut server = Self::start();
        server
            .client(
                "CREATE USER 'root'@'%'; \
                 GRANT ALL PRIVILEGES ON *.* TO 'root'@'%' WITH GRANT OPTION",
            )
            .unwrap_or_else(|e| panic!("{e}"));
        server.stop();
        server.host = Some(host);
        server.start_again();
        server
    }

    /// `kill -9` of the server; returns once it is gone.
    pub fn kill(&mut self) {
        process::kill(&mut self.child, &[]);
    }

    /// The server's pid while it runs (one process: pausing it pauses every connection).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `KILL CONNECTION` of every backend's wake connection (each is registered in the
    /// waiters table of the `test` database); returns how many.
    pub async fn kill_wake_connections(&self) -> usize {
        let mut conn = self.conn().await;
        let wake: Vec<i64> =
            sqlx::query_scalar("SELECT DISTINCT CAST(conn AS SIGNED) FROM tower_lock_waiters")
                .fetch_all(&mut conn)
                .await
                .expect("the wake connections in the waiters table");
        let mut killed = 0;
        for id in wake {
            // One that ended since the read is no longer there to kill.
            let kill = format!("KILL CONNECTION {id}");
            if sqlx::query(&kill).execute(&mut conn).await.is_ok() {
                killed += 1;
            }
        }
        killed
    }

    /// A fast shutdown (SIGTERM: clients are cut off), then SIGKILL if it is not gone
    /// within [`STOP_BOUND`](process::STOP_BOUND); returns once it is gone.
    pub fn stop(&mut self) {
        process::stop(&mut self.child, "TERM");
    }

    /// Hands this server to a reaper that stops it and removes its files once this process
    /// has exited (its end of the reaper's stdin closes then): for a server in a `static`,
    /// which is never dropped.
    fn reap_at_exit(&mut self) {
        let (Some(child), dir) = (&self.child, self.dir.path()) else {
            return;
        };
        self.reaper = Some(process::reaper(child, dir, "TERM", "MariaDB"));
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `name` on `PATH`, else in `/usr/sbin` (where Debian puts `mariadbd`, off a plain user's
/// `PATH`).
pub fn program(name: &str) -> std::path::PathBuf {
    let sbin = std::path::Path::new("/usr/sbin").join(name);
    let on_path = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .any(|dir| dir.join(name).is_file());
    if on_path || !sbin.is_file() {
        name.into()
    } else {
        sbin
    }
}

/// `--user=root` when this process runs as root: the server refuses root without it.
fn as_root() -> Option<&'static str> {
    let uid = Command::new("id").arg("-u").output().ok()?;
    (String::from_utf8_lossy(&uid.stdout).trim() == "0").then_some("--user=root")
}

/// The server this test binary's MariaDB tests share: started by the first test that asks, and stopped (its files removed) when the binary exits. Tests
/// keep apart by namespace.
pub fn shared() -> &'static MariaDbServer {
    static SERVER: OnceLock<MariaDbServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let mut server = MariaDbServer::start();
        server.reap_at_exit();
        server
    })
}

/// A backend on [`shared`] in its own namespace (`test-` and a fresh id), creating the lock
/// tables if needed.
pub async fn backend() -> tower_lock::MySqlBackend {
    backend_in(&fresh_namespace()).await
}

/// A backend on [`shared`] in `namespace`: several of them are instances of one service.
pub async fn backend_in(namespace: &str) -> tower_lock::MySqlBackend {
    builder(namespace)
        .build()
        .await
        .expect("backend connects to the test MariaDB")
}

/// The builder of [`backend_in`], to set more before building.
pub fn builder(namespace: &str) -> tower_lock::MySqlBackendBuilder {
    builder_on(&shared().url()).namespace(namespace)
}

/// A builder for the database at `url`, migrating it, with a connect timeout that only
/// catches hangs: on a loaded machine (the tests of a binary start their backends at once,
/// on two cores) a new connection has been seen to take over the default second.
pub fn builder_on(url: &str) -> tower_lock::MySqlBackendBuilder {
    tower_lock::MySqlBackend::builder(url)
        .migrate()
        .connect_timeout(Duration::from_secs(10))
}

/// A database of its own on [`shared`] (empty: no lock tables); its URL, as root.
pub async fn fresh_database() -> String {
    let server = shared();
    let name = format!("db_{}", uuid::Uuid::new_v4().simple());
    server.execute(&format!("CREATE DATABASE {name}")).await;
    server.url().replace("/test", &format!("/{name}"))
}

/// A namespace no other test uses.
pub fn fresh_namespace() -> String {
    format!("test-{}", uuid::Uuid::new_v4().simple())
}

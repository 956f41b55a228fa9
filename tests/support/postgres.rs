//! A throwaway PostgreSQL: `initdb` and `postgres` in a temp dir, on a free loopback port
//! with its socket in that dir, stopped when dropped (SIGINT, a fast shutdown; SIGKILL if
//! it is not gone within [`STOP_BOUND`](process::STOP_BOUND)). Nothing here touches a
//! PostgreSQL it did not start: the machine's own (on 5432) is never used.
//!
//! initdb refuses to run as root, and CI runs as root: then both programs run as the
//! unprivileged `postgres` user (the uid and gid set on the child, which is the postmaster
//! itself, so that it is the process signalled), and the temp dir is handed to that user.
//!
//! Also used by `examples/fencing_postgres` (with process.rs beside it), which falls back to
//! a throwaway server when no `DATABASE_URL` is given: errors are returned,
//! [`PostgresServer::start`] panics with them.

use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::process::{self, NetHost, free_port};

/// Ports tried: between picking a free port and `postgres` binding it, another process may
/// take it.
const ATTEMPTS: usize = 10;

/// A `postgres` this process started and owns; its data is gone when it is dropped.
pub struct PostgresServer {
    child: Option<Child>,
    port: u16,
    /// Where the binaries are, as whom they run, and the `-c` settings given at start.
    bin: PathBuf,
    user: Option<(u32, u32)>,
    settings: Vec<String>,
    /// A reaper, and with it the write end of its stdin (see [`shared`]).
    reaper: Option<Child>,
    /// The host it runs in (see `netns.rs`), or `None` for the test's own loopback.
    host: Option<NetHost>,
    // Removed after the server is stopped (fields drop after `Drop::drop`).
    dir: tempfile::TempDir,
}

impl PostgresServer {
    /// Starts one and waits until it accepts connections; panics with the cause if it
    /// cannot (PostgreSQL not installed, initdb failed, ...).
    pub fn start() -> Self {
        Self::try_start().unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`start`](Self::start) with server settings (`name=value`, as `postgres -c` takes).
    pub fn start_with(settings: &[&str]) -> Self {
        Self::try_start_with(settings).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts one and waits until it accepts connections.
    pub fn try_start() -> Result<Self, String> {
        Self::try_start_with(&[])
    }

    fn try_start_with(settings: &[&str]) -> Result<Self, String> {
        let bin = bindir()?;
        let user = unprivileged_user()?;
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
        if let Some((uid, gid)) = user {
            chown(dir.path(), Some(uid), Some(gid)).map_err(|e| format!("chown: {e}"))?;
        }
        let data = dir.path().join("data");
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8"])
            .args(["--no-locale", "--no-sync"]);
        run(&mut initdb, user, "initdb")?;
        let server = PostgresServer {
            child: None,
            port: 0,
            bin: bin.clone(),
            user,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
            reaper: None,
            host: None,
            dir,
        };
        server.start_on_a_free_port()
    }

    /// A hot standby of this server (`pg_basebackup -R`), started on its own free port:
    /// read-only, as a replica URL given by mistake would be.
    pub fn replica(&self) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        if let Some((uid, gid)) = self.user {
            chown(dir.path(), Some(uid), Some(gid)).expect("chown");
        }
        let mut backup = Command::new(self.bin.join("pg_basebackup"));
        backup
            .arg("-D")
            .arg(dir.path().join("data"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-R", "-X", "stream", "--no-sync"]);
        run(&mut backup, self.user, "pg_basebackup").unwrap_or_else(|e| panic!("{e}"));
        let replica = PostgresServer {
            child: None,
            port: 0,
            bin: self.bin.clone(),
            user: self.user,
            settings: Vec::new(),
            reaper: None,
            host: None,
            dir,
        };
        replica
            .start_on_a_free_port()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `postgres` on a free port, trying another when one was taken meanwhile.
    fn start_on_a_free_port(mut self) -> Result<Self, String> {
        for _ in 0..ATTEMPTS {
            if self.spawn(free_port()?)? {
                return Ok(self);
            }
        }
        let server = self;
        let log = std::fs::read_to_string(server.dir.path().join("postgres.log"));
        Err(format!(
            "postgres did not start ({ATTEMPTS} ports tried); its log ends: {}",
            log.unwrap_or_default()
                .lines()
                .last()
                .unwrap_or("(nothing)")
        ))
    }

    /// Runs `postgres` on a free port; false if it exited before it was ready (the port was
    /// taken).
    fn spawn(&mut self, port: u16) -> Result<bool, String> {
        let (bin, user) = (self.bin.clone(), self.user);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("postgres.log"))
            .map_err(|e| format!("postgres log: {e}"))?;
        let stderr = log.try_clone().map_err(|e| format!("postgres log: {e}"))?;
        let mut command = match &self.host {
            // `ip netns exec` and `setpriv` exec what follows: the pid is the postmaster's.
            Some(host) => {
                let mut command = host.exec();
                if let Some((uid, gid)) = user {
                    command.args(["setpriv", "--reuid", &uid.to_string()]);
                    command.args(["--regid", &gid.to_string(), "--clear-groups"]);
                }
                command.arg(bin.join("postgres"));
                command.args(["-c", "listen_addresses=*"]);
                command
            }
            None => {
                let mut command = Command::new(bin.join("postgres"));
                command.args(["-c", "listen_addresses=127.0.0.1"]);
                run_as(&mut command, user);
                command
            }
        };
        let child = command
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &port.to_string()])
            .arg("-k")
            .arg(self.dir.path())
            // Throwaway data: nothing needs to survive a crash.
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("could not run {}: {e}", bin.join("postgres").display()))?;
        self.port = port;
        self.child = Some(child);
        self.wait_until_ready()
    }

    /// Waits until this server says it accepts connections: its `postmaster.pid` names
    /// its process and says `ready` (which it writes once its sockets are bound, so another
    /// server that won the port race cannot be mistaken for it).
    fn wait_until_ready(&mut self) -> Result<bool, String> {
        let pid_file = self.dir.path().join("data").join("postmaster.pid");
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let Some(child) = self.child.as_mut() else {
                return Ok(false);
            };
            if let Ok(Some(_)) = child.try_wait() {
                self.child = None;
                return Ok(false);
            }
            let pid = child.id().to_string();
            let status = std::fs::read_to_string(&pid_file).unwrap_or_default();
            let lines: Vec<&str> = status.lines().collect();
            // A hot standby says `standby` once it takes connections.
            if lines.first() == Some(&pid.as_str())
                && matches!(lines.get(7).map(|s| s.trim()), Some("ready" | "standby"))
            {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err("postgres did not become ready within 30 s".to_owned())
    }

    /// Stops the server (a fast shutdown: clients are cut off) and starts it again on the
    /// same port and data, waiting until it accepts connections.
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// Starts a server stopped with [`stop`](Self::stop) again, on the same port and data.
    pub fn start_again(&mut self) {
        assert!(
            self.spawn(self.port).expect("postgres runs again"),
            "postgres did not start again on port {}",
            self.port
        );
    }

    /// What the server logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    /// A connection of the test's own, as the superuser.
    pub async fn conn(&self) -> sqlx::PgConnection {
        use sqlx::Connection;
        sqlx::PgConnection::connect(&self.url())
            .await
            .expect("connect to the test PostgreSQL")
    }

    /// Terminates the backends whose `application_name` is `name`; returns how many.
    pub async fn terminate(&self, name: &str) -> i64 {
        let mut conn = self.conn().await;
        sqlx::query_scalar::<_, i64>(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = $1",
        )
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .expect("terminate backends")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres` (trust authentication), at the
    /// server's uplink address for one on a host of its own.
    pub fn url(&self) -> String {
        self.url_at(process::uplink_ip(self.host.as_ref()))
    }

    /// Where clients on other hosts reach a server on a host of its own
    /// ([`start_in`](Self::start_in)).
    pub fn lan_url(&self) -> String {
        self.url_at(process::lan_ip(self.host.as_ref()))
    }

    /// The URL at `ip`, an address of the server's host.
    fn url_at(&self, ip: std::net::Ipv4Addr) -> String {
        format!("postgres://postgres@{ip}:{}/postgres", self.port)
    }

    /// A server on `host`, listening on every address of it and taking every client
    /// without a password: clients on other hosts dial it at its `lan` address, the test
    /// at its `uplink`.
    pub fn start_in(host: NetHost) -> Self {
        let mut server = Self::try_start().unwrap_or_else(|e| panic!("{e}"));
        server.stop();
        let hba = server.dir.path().join("data").join("pg_hba.conf");
        let mut rules = std::fs::read_to_string(&hba).expect("pg_hba.conf");
        rules.push_str("host all all 0.0.0.0/0 trust\n");
        std::fs::write(&hba, rules).expect("pg_hba.conf");
        server.host = Some(host);
        server.start_again();
        server
    }

    /// `kill -9` of the postmaster and of every backend it started (as a crash of the
    /// machine would end them); returns once they are gone.
    pub fn kill(&mut self) {
        let pids = self.pids();
        process::kill(&mut self.child, pids.get(1..).unwrap_or_default());
    }

    /// SIGSTOP to the postmaster and every backend: the server keeps its sockets but
    /// answers nothing, as a frozen machine would.
    pub fn pause(&self) {
        self.signal_all("-STOP");
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.signal_all("-CONT");
    }

    /// `signal` (as `kill(1)` spells it) to every process of [`pids`](Self::pids); a
    /// backend that exits meanwhile (its client gone) is passed over.
    fn signal_all(&self, signal: &str) {
        for pid in self.pids() {
            process::signal(pid, signal);
        }
    }

    /// The postmaster's pid and its backends', while it runs (to pause them all).
    pub fn pids(&self) -> Vec<u32> {
        let Some(postmaster) = self.child.as_ref().map(Child::id) else {
            return Vec::new();
        };
        let children = Command::new("pgrep")
            .args(["-P", &postmaster.to_string()])
            .output()
            .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
            .unwrap_or_default();
        let children = children.lines().filter_map(|l| l.trim().parse().ok());
        std::iter::once(postmaster).chain(children).collect()
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl PostgresServer {
    /// A fast shutdown (SIGINT: clients are cut off), then SIGKILL if it is not gone
    /// within [`STOP_BOUND`](process::STOP_BOUND); returns once it is gone.
    pub fn stop(&mut self) {
        process::stop(&mut self.child, "INT");
    }
}

/// Where `initdb` and `postgres` are: `pg_config --bindir`, else the newest
/// `/usr/lib/postgresql/VERSION/bin` (Debian), else the directory on `PATH` that has
/// `initdb`.
pub fn bindir() -> Result<PathBuf, String> {
    let has_initdb = |dir: &Path| dir.join("initdb").is_file();
    let pg_config = Command::new("pg_config").arg("--bindir").output().ok();
    if let Some(out) = pg_config.filter(|out| out.status.success()) {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if has_initdb(&dir) {
            return Ok(dir);
        }
    }
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, dir)| has_initdb(dir))
        .collect();
    debian.sort();
    if let Some((_, dir)) = debian.pop() {
        return Ok(dir);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .find(|dir| has_initdb(dir))
        .ok_or_else(|| {
            "initdb not found (pg_config --bindir, /usr/lib/postgresql/*/bin, PATH): install \
             PostgreSQL (Debian/Ubuntu: apt-get install postgresql)"
                .to_owned()
        })
}

/// The uid and gid of the `postgres` user when this process runs as root (initdb refuses
/// root); `None` otherwise.
fn unprivileged_user() -> Result<Option<(u32, u32)>, String> {
    let id = |args: &[&str]| -> Result<u32, String> {
        let out = Command::new("id")
            .args(args)
            .output()
            .map_err(|e| format!("id: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim().parse().map_err(|_| {
            format!(
                "`id {}` failed: running as root, the tests need the unprivileged `postgres` \
                 user (Debian's postgresql package creates it)",
                args.join(" ")
            )
        })
    };
    if id(&["-u"])? != 0 {
        return Ok(None);
    }
    Ok(Some((id(&["-u", "postgres"])?, id(&["-g", "postgres"])?)))
}

/// Runs `command` (named `what`) to its end as the given user, if any.
fn run(command: &mut Command, user: Option<(u32, u32)>, what: &str) -> Result<(), String> {
    let out = run_as(command, user)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("could not run {what}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// `command` as the given user, if any.
fn run_as(command: &mut Command, user: Option<(u32, u32)>) -> &mut Command {
    if let Some((uid, gid)) = user {
        // std drops root's supplementary groups when it sets the uid.
        command.gid(gid).uid(uid);
    }
    command
}

/// The server this test binary's PostgreSQL tests share: started by the first test that
/// asks, and stopped (its files removed) when the binary exits, by a reaper process that
/// waits for the end of this process's pipe to its stdin. Tests keep apart by namespace.
pub fn shared() -> &'static PostgresServer {
    static SERVER: OnceLock<PostgresServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let mut server = PostgresServer::start();
        server.reap_at_exit();
        server
    })
}

/// A backend on [`shared`] in its own namespace (`test-` and a fresh id), creating the lock
/// table if needed.
pub async fn backend() -> tower_lock::PostgresBackend {
    backend_in(&fresh_namespace()).await
}

/// A backend on [`shared`] in `namespace`: several of them are instances of one service.
pub async fn backend_in(namespace: &str) -> tower_lock::PostgresBackend {
    builder(namespace)
        .build()
        .await
        .expect("backend connects to the test PostgreSQL")
}

/// The builder of [`backend_in`], to set more before building, with a connect timeout
/// that only catches hangs (as MariaDB's: the tests of a binary start their backends at
/// once, on two cores, and a new connection may take over the default second).
pub fn builder(namespace: &str) -> tower_lock::PostgresBackendBuilder {
    builder_at(&shared().url(), namespace)
}

/// [`builder`] on the server at `url` (one of the test's own).
pub fn builder_at(url: &str, namespace: &str) -> tower_lock::PostgresBackendBuilder {
    tower_lock::PostgresBackend::builder(url)
        .namespace(namespace)
        .migrate()
        .connect_timeout(std::time::Duration::from_secs(10))
}

/// A namespace no other test uses.
pub fn fresh_namespace() -> String {
    format!("test-{}", uuid::Uuid::new_v4().simple())
}

impl PostgresServer {
    /// Hands this server to a reaper that stops it and removes its files once this process
    /// has exited (its end of the reaper's stdin closes then): for a server in a `static`,
    /// which is never dropped.
    fn reap_at_exit(&mut self) {
        let (Some(child), dir) = (&self.child, self.dir.path()) else {
            return;
        };
        self.reaper = Some(process::reaper(child, dir, "INT", "PostgreSQL"));
    }
}

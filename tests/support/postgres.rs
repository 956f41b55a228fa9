//! A throwaway PostgreSQL: `initdb` and `postgres` in a temp dir, on a free loopback port
//! with its socket in that dir, stopped when dropped (SIGINT, a fast shutdown; SIGKILL if
//! it is not gone within [`STOP_BOUND`]). Nothing here touches a PostgreSQL it did not
//! start: the machine's own (on 5432) is never used.
//!
//! initdb refuses to run as root, and CI runs as root: then both programs run as the
//! unprivileged `postgres` user (the uid and gid set on the child, which is the postmaster
//! itself, so that it is the process signalled), and the temp dir is handed to that user.
//!
//! Also used by `examples/fencing_postgres`, which falls back to a throwaway server when no
//! `DATABASE_URL` is given: errors are returned, [`PostgresServer::start`] panics with them.

use std::fs::File;
use std::net::TcpListener;
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a stopped server gets to shut down before it is killed.
const STOP_BOUND: Duration = Duration::from_secs(10);
/// Ports tried: between picking a free port and `postgres` binding it, another process may
/// take it.
const ATTEMPTS: usize = 10;

/// A `postgres` this process started and owns; its data is gone when it is dropped.
pub struct PostgresServer {
    child: Option<Child>,
    port: u16,
    // Removed after the server is stopped (fields drop after `Drop::drop`).
    dir: tempfile::TempDir,
}

impl PostgresServer {
    /// Starts one and waits until it accepts connections; panics with the cause if it
    /// cannot (PostgreSQL not installed, initdb failed, ...).
    pub fn start() -> Self {
        Self::try_start().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts one and waits until it accepts connections.
    pub fn try_start() -> Result<Self, String> {
        let bin = bindir()?;
        let user = unprivileged_user()?;
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
        if let Some((uid, gid)) = user {
            chown(dir.path(), Some(uid), Some(gid)).map_err(|e| format!("chown: {e}"))?;
        }
        let data = dir.path().join("data");
        let initdb = run_as(
            Command::new(bin.join("initdb"))
                .arg("-D")
                .arg(&data)
                .args(["-U", "postgres", "-A", "trust", "-E", "UTF8"])
                .args(["--no-locale", "--no-sync"]),
            user,
        )
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("could not run {}: {e}", bin.join("initdb").display()))?;
        if !initdb.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&initdb.stderr).trim()
            ));
        }
        let mut server = PostgresServer {
            child: None,
            port: 0,
            dir,
        };
        for _ in 0..ATTEMPTS {
            if server.spawn(&bin, user)? {
                return Ok(server);
            }
        }
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
    fn spawn(&mut self, bin: &Path, user: Option<(u32, u32)>) -> Result<bool, String> {
        let port = free_port()?;
        let log = File::create(self.dir.path().join("postgres.log"))
            .map_err(|e| format!("postgres log: {e}"))?;
        let stderr = log.try_clone().map_err(|e| format!("postgres log: {e}"))?;
        let child = run_as(
            Command::new(bin.join("postgres"))
                .arg("-D")
                .arg(self.dir.path().join("data"))
                .args(["-p", &port.to_string()])
                .arg("-k")
                .arg(self.dir.path())
                .args(["-c", "listen_addresses=127.0.0.1"])
                // Throwaway data: nothing needs to survive a crash.
                .args(["-c", "fsync=off", "-c", "full_page_writes=off"]),
            user,
        )
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
            if lines.first() == Some(&pid.as_str())
                && lines.get(7).map(|s| s.trim()) == Some("ready")
            {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err("postgres did not become ready within 30 s".to_owned())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres` (trust authentication).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // SIGINT: a fast shutdown (clients are cut off, nothing is waited for).
        let _ = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + STOP_BOUND;
        while Instant::now() < deadline {
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Where `initdb` and `postgres` are: `pg_config --bindir`, else the newest
/// `/usr/lib/postgresql/VERSION/bin` (Debian), else the directory on `PATH` that has
/// `initdb`.
fn bindir() -> Result<PathBuf, String> {
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

/// `command` as the given user, if any.
fn run_as(command: &mut Command, user: Option<(u32, u32)>) -> &mut Command {
    if let Some((uid, gid)) = user {
        // std drops root's supplementary groups when it sets the uid.
        command.gid(gid).uid(uid);
    }
    command
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("free port: {e}"))
}

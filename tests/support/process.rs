//! What the throwaway database servers (mariadb.rs, postgres.rs) do alike with their
//! process: stop it with a signal, then SIGKILL if it is not gone within [`STOP_BOUND`];
//! hand a server kept in a `static` to a reaper; pick a free port; run it on a host of its
//! own ([`NetHost`]).
//!
//! Standalone, as postgres.rs is: `examples/fencing_postgres` includes both with `#[path]`.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a stopped server gets to shut down before it is killed.
pub const STOP_BOUND: Duration = Duration::from_secs(10);

/// Sends `signal` (as `kill(1)` spells it: `-STOP`, `-TERM`) to process `pid`: whether it
/// was delivered (not, to a process that has exited).
pub fn signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .args([signal, &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Sends `signal` (`TERM`, `INT`: the server's fast shutdown, which cuts clients off) to
/// the server `child`, if it runs, then SIGKILL if it is not gone within [`STOP_BOUND`];
/// returns once it is gone.
pub fn stop(child: &mut Option<Child>, signal: &str) {
    let Some(mut child) = child.take() else {
        return;
    };
    self::signal(child.id(), &format!("-{signal}"));
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

/// A reaper that stops the server `child` with `signal` and removes `dir` once this
/// process has exited (its end of the reaper's stdin closes then): for a server in a
/// `static`, which is never dropped. Keep it (and with it that end) as long as the server.
pub fn reaper(child: &Child, dir: &Path, signal: &str, what: &str) -> Child {
    let script = format!(
        "cat >/dev/null; kill -{signal} \"$1\"; \
         while kill -0 \"$1\" 2>/dev/null; do sleep 0.1; done; rm -rf \"$2\""
    );
    Command::new("sh")
        .args(["-c", &script, "reaper", &child.id().to_string()])
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("the reaper of the shared {what} starts: {e}"))
}

/// The ports [`free_port`] hands out: below the kernel's ephemeral range (32768 and up on
/// Linux), where no client socket is given a port, so that none takes one between the
/// check and the server's bind; with room for a cluster's bus port (port + 10000) below it
/// too.
const PORTS: std::ops::Range<u32> = 12_000..22_000;

/// A port free right now on every address, for a server this process is about to start;
/// never the same twice in a process (tests start their servers at once). A port taken
/// from the ephemeral range could be given to one of the many client connections of the
/// tests running meanwhile before the server binds it: a ZooKeeper member that cannot bind
/// its election port leaves its ensemble a member short.
pub fn free_port() -> Result<u16, String> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = PORTS.end - PORTS.start;
    // Processes of one run (a test binary, the children it runs) start apart.
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = u16::try_from(PORTS.start + (start + n) % span).map_err(|e| e.to_string())?;
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(format!("no free port in {PORTS:?}"))
}

/// Where a server on a host of its own (a network namespace of `netns.rs`) runs and is
/// reached.
pub struct NetHost {
    pub netns: String,
    /// Its address on the hosts' switch, where clients on other hosts dial it.
    pub lan: std::net::Ipv4Addr,
    /// Its address on its uplink: where the test reaches it.
    pub uplink: std::net::Ipv4Addr,
}

impl NetHost {
    /// `ip netns exec NETNS`, to which the program and its arguments are added: it execs
    /// them, so the child's pid is the program's.
    pub fn exec(&self) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.netns]);
        command
    }
}

/// `program` run on `host` (see [`NetHost::exec`]), or on the test's own for `None`.
pub fn command_on(host: Option<&NetHost>, program: impl AsRef<std::ffi::OsStr>) -> Command {
    match host {
        Some(host) => {
            let mut command = host.exec();
            command.arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// Where clients on other hosts dial a server on `host` (loopback for one on the test's
/// own).
pub fn lan_ip(host: Option<&NetHost>) -> std::net::Ipv4Addr {
    host.map_or(std::net::Ipv4Addr::LOCALHOST, |h| h.lan)
}

/// Where the test reaches a server on `host` (loopback for one on the test's own).
pub fn uplink_ip(host: Option<&NetHost>) -> std::net::Ipv4Addr {
    host.map_or(std::net::Ipv4Addr::LOCALHOST, |h| h.uplink)
}

/// `kill -9` of `child` and of `others` (processes it started, which a crash of the machine
/// would end with it); returns once `child` is gone.
pub fn kill(child: &mut Option<Child>, others: &[u32]) {
    for &pid in others {
        signal(pid, "-KILL");
    }
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

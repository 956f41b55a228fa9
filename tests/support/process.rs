//! What the throwaway database servers (mariadb.rs, postgres.rs) do alike with their
//! process: stop it with a signal, then SIGKILL if it is not gone within [`STOP_BOUND`];
//! hand a server kept in a `static` to a reaper; pick a free port.
//!
//! Standalone, as postgres.rs is: `examples/fencing_postgres` includes both with `#[path]`.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a stopped server gets to shut down before it is killed.
pub const STOP_BOUND: Duration = Duration::from_secs(10);

/// Sends `signal` (`TERM`, `INT`: the server's fast shutdown, which cuts clients off) to
/// the server `child`, if it runs, then SIGKILL if it is not gone within [`STOP_BOUND`];
/// returns once it is gone.
pub fn stop(child: &mut Option<Child>, signal: &str) {
    let Some(mut child) = child.take() else {
        return;
    };
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
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

/// A loopback port free right now.
pub fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("free port: {e}"))
}

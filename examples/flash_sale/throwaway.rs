//! A throwaway `redis-server` for the demo: a free loopback port, a temp dir, nothing saved
//! to disk, killed when dropped (on every way out of the demo, errors included).

use std::fs::File;
use std::io;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Ports tried before giving up: between picking a free port and `redis-server` binding it,
/// another process may take it.
const ATTEMPTS: usize = 10;

/// A `redis-server` this process started and owns.
pub struct ThrowawayRedis {
    child: Child,
    url: String,
    version: String,
    // Removed after the server is killed (fields drop after `Drop::drop`).
    dir: TempDir,
}

impl ThrowawayRedis {
    /// Starts one, or returns `Ok(None)` when `redis-server` is not on `PATH`.
    pub async fn start() -> Result<Option<Self>, Error> {
        let mut last_log = String::new();
        for _ in 0..ATTEMPTS {
            let dir = tempfile::tempdir()?;
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            // Its log (stdout) and complaints (stderr), to tell why it did not start.
            let log = File::create(dir.path().join("redis.log"))?;
            let spawned = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(format!("could not run redis-server: {e}").into()),
            };
            // From here on, dropping `server` kills the process.
            let mut server = ThrowawayRedis {
                child,
                url: format!("redis://127.0.0.1:{port}"),
                version: String::new(),
                dir,
            };
            if server.wait_until_up().await? {
                return Ok(Some(server));
            }
            last_log =
                std::fs::read_to_string(server.dir.path().join("redis.log")).unwrap_or_default();
        }
        let mut tail: Vec<&str> = last_log.lines().rev().take(5).collect();
        tail.reverse();
        Err(format!(
            "redis-server did not start ({ATTEMPTS} attempts); the last one said: {}",
            if tail.is_empty() {
                "nothing".to_owned()
            } else {
                tail.join(" / ")
            }
        )
        .into())
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's `redis_version`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Waits until this process's server answers on its port; false if it exited first
    /// (the port was taken).
    async fn wait_until_up(&mut self) -> Result<bool, Error> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::time::Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(false);
            }
            // Another Redis may own the port: only an answer from our pid counts.
            if let Ok(info) = server_info(&self.url).await {
                if info.process_id == Some(self.child.id()) {
                    self.version = info.version;
                    return Ok(true);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("redis-server on {} did not answer within 10 s", self.url).into())
    }
}

impl Drop for ThrowawayRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What `INFO server` says about a Redis.
pub struct ServerInfo {
    pub version: String,
    process_id: Option<u32>,
}

/// Asks the Redis at `url` for `INFO server` (bounded to 2 s: something else than Redis
/// may listen there).
pub async fn server_info(url: &str) -> Result<ServerInfo, Error> {
    let ask = async {
        let mut conn = redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?;
        redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut conn)
            .await
    };
    let info = tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .map_err(|_| "INFO server did not answer within 2 s")??;
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    Ok(ServerInfo {
        version: field("redis_version").unwrap_or("(unknown)").to_owned(),
        process_id: field("process_id").and_then(|pid| pid.parse().ok()),
    })
}

//! Five redis-servers for a test binary's quorum tests: started by the first test that asks,
//! stopped when the binary exits (a reaper process per server start, as the shared
//! PostgreSQL's). Tests keep apart by namespace; a test that kills or restarts masters
//! holds [`Quorum::exclusive`] so that no other quorum test runs meanwhile.

use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tower_lock::RedisBackend;

use super::RedisServer;

/// The longest lease of the quorum tests' namespaces: what the masters' restart guard
/// outwaits after a start.
pub const MAX_LEASE: Duration = Duration::from_secs(2);

/// The masters of this binary's quorum.
pub struct Quorum {
    servers: Mutex<Vec<(RedisServer, Option<Child>)>>,
    urls: Vec<String>,
    /// Held by a test that changes the masters, shared by the others.
    turn: tokio::sync::RwLock<()>,
}

/// The quorum this binary's tests share (five masters).
pub fn shared() -> &'static Quorum {
    static QUORUM: OnceLock<Quorum> = OnceLock::new();
    QUORUM.get_or_init(|| {
        let servers: Vec<_> = (0..5)
            .map(|_| {
                let server = RedisServer::start();
                let reaper = reaper(&server);
                (server, reaper)
            })
            .collect();
        let urls = servers.iter().map(|(s, _)| s.url()).collect();
        Quorum {
            servers: Mutex::new(servers),
            urls,
            turn: tokio::sync::RwLock::new(()),
        }
    })
}

/// The only turn on the quorum (see [`Quorum::exclusive`]).
pub struct Exclusive<'a> {
    quorum: &'a Quorum,
    _turn: tokio::sync::RwLockWriteGuard<'a, ()>,
}

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        let down: Vec<usize> = (self.quorum.servers().iter())
            .enumerate()
            .filter(|(_, (server, _))| server.pid().is_none())
            .map(|(i, _)| i)
            .collect();
        for i in down {
            self.quorum.restart(i);
        }
    }
}

/// A process that kills `server` once this test binary has exited (the end of its stdin
/// closes then): a server in a `static` is never dropped.
fn reaper(server: &RedisServer) -> Option<Child> {
    Command::new("sh")
        .args([
            "-c",
            "cat >/dev/null; kill -9 \"$1\" 2>/dev/null",
            "reaper",
            &server.pid()?.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()
}

impl Quorum {
    /// The masters' URLs.
    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// A builder on the quorum in a namespace of the test's own, with short timeouts.
    pub fn builder(&self) -> tower_lock::RedisBackendBuilder {
        builder_on(&self.urls).namespace(super::postgres::fresh_namespace())
    }

    /// `n` backends of one namespace: instances of one service.
    pub async fn backends(&self, n: usize) -> Vec<RedisBackend> {
        let builder = self.builder();
        let mut backends = Vec::with_capacity(n);
        for _ in 0..n {
            backends.push(
                builder
                    .clone()
                    .build()
                    .await
                    .expect("quorum backend builds"),
            );
        }
        backends
    }

    /// Waits for a turn among tests that do not change the masters, once every master
    /// grants (past its restart guard).
    pub async fn shared_turn(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        let turn = self.turn.read().await;
        self.past_guards().await;
        turn
    }

    /// Waits for the only turn (a test that kills or restarts masters), once every master
    /// grants. Masters left down when the turn ends (a test failed half-way) are started
    /// again.
    pub async fn exclusive(&self) -> Exclusive<'_> {
        let turn = self.turn.write().await;
        self.past_guards().await;
        Exclusive {
            quorum: self,
            _turn: turn,
        }
    }

    /// The servers, to kill, pause or restart one.
    pub fn servers(&self) -> MutexGuard<'_, Vec<(RedisServer, Option<Child>)>> {
        self.servers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Kills master `i` (SIGKILL, as a crash would).
    pub fn kill(&self, i: usize) {
        self.servers()[i].0.kill();
    }

    /// Starts master `i` again, empty, on its port.
    pub fn restart(&self, i: usize) {
        let mut servers = self.servers();
        let (server, reaper) = &mut servers[i];
        server.restart();
        *reaper = self::reaper(server);
    }

    /// Waits until every master grants new holds: a lock taken and given back on each
    /// through a single-server backend with the same guard (a waiting acquisition waits
    /// the guard out, by the server's own uptime).
    pub async fn past_guards(&self) {
        for url in &self.urls {
            let probe = super::builder(url)
                .namespace("quorum-probe")
                .restart_guard()
                .max_lease(MAX_LEASE)
                .build()
                .await
                .expect("probe backend");
            let guard = probe
                .lock("guard")
                .wait(Duration::from_secs(10))
                .await
                .expect("the master grants once its guard passed");
            guard.release().await.expect("probe released");
        }
    }
}

/// A builder on the masters at `urls` with the shared quorum's settings (short timeouts,
/// its `max_lease`), for a process of the test's own that has only the URLs.
pub fn builder_on(urls: &[String]) -> tower_lock::RedisBackendBuilder {
    RedisBackend::quorum(urls)
        .max_lease(MAX_LEASE)
        .command_timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_millis(500))
}

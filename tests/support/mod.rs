//! Test support: a throwaway `redis-server` per test, on a free port in a temp dir, killed
//! on drop; plus small HTTP helpers. Nothing here touches a Redis it did not start.

#![allow(dead_code)] // each test binary uses a different subset of these helpers

pub mod child;
pub mod cluster;
pub mod cluster_acl;
pub mod counted;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod failover;
pub mod history;
pub mod mariadb;
pub mod monitor;
pub mod netns;
pub mod postgres;
pub mod process;
pub mod proxy;
pub mod quorum;
pub mod replica;
pub mod reshard;
pub mod sentinel;
// The shop reads its lock's token through the `HeldLock` extractor (feature `axum`).
#[cfg(feature = "axum")]
pub mod shop;
pub mod sql;
pub mod stores;
pub mod tls;
pub mod tls_cluster;
pub mod tls_sentinel;
pub mod turns;
pub mod zookeeper;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tower_lock::RedisBackend;

/// A redis-server process owned by one test.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    extra_args: Vec<String>,
    /// A command the server runs under (`valgrind ...`), or empty.
    wrapper: Vec<String>,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra `redis-server` arguments (kept across `restart`).
    pub fn start_with(extra_args: &[&str]) -> Self {
        Self::start_under(&[], extra_args)
    }

    /// Starts a server run by `wrapper` (`["valgrind", "--tool=callgrind", ..]`), which
    /// runs it in its own process (the pid [`pid`](Self::pid) gives).
    pub fn start_under(wrapper: &[&str], extra_args: &[&str]) -> Self {
        // Another process may take the free port before redis-server binds it: retry.
        for _ in 0..20 {
            let mut server = RedisServer {
                child: None,
                port: free_port(),
                dir: tempfile::tempdir().expect("temp dir"),
                extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
                wrapper: wrapper.iter().map(|a| a.to_string()).collect(),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start redis-server on a free port");
    }

    /// Spawns on `self.port`; false if it did not come up (for example the port was taken).
    fn spawn(&mut self) -> bool {
        let mut command = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg("redis-server");
                command
            }
            None => Command::new("redis-server"),
        };
        let child = redis_tool(
            command
                .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(self.dir.path())
                .args(&self.extra_args)
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            Command::spawn,
        )
        .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(_)) = child.try_wait() {
                    self.child = None;
                    return false;
                }
            }
            // Another test's server may have won the port race: only ours counts.
            let pid = self.child.as_ref().map(Child::id);
            if pid.is_some_and(|pid| serves_pid(self.port, pid)) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A backend with a per-server namespace and short timeouts, so fault tests end fast.
    pub async fn backend(&self) -> RedisBackend {
        backend(&self.url()).await
    }

    /// A plain connection for inspecting and tampering with the server's state.
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        test_conn(&self.url()).await.expect("connect to test redis")
    }

    /// Sum of `calls=` over the given commands in `INFO commandstats`.
    pub async fn command_calls(&self, commands: &[&str]) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut self.conn().await)
            .await
            .expect("INFO commandstats");
        calls_in(&info, commands)
    }

    /// The re-entry count of `owner` in the lock hash `lock`; `None` if it does not hold it.
    pub async fn hold_count(&self, lock: &str, owner: &str) -> Option<i64> {
        redis::cmd("HGET")
            .arg(lock)
            .arg(owner)
            .query_async(&mut self.conn().await)
            .await
            .expect("HGET")
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts again on the same port (after `kill`).
    pub fn restart(&mut self) {
        self.kill();
        assert!(self.spawn(), "redis-server restarts on port {}", self.port);
    }

    /// [`restart`](Self::restart) with other extra arguments (kept for later restarts).
    pub fn restart_with(&mut self, extra_args: &[&str]) {
        self.extra_args = extra_args.iter().map(|a| a.to_string()).collect();
        self.restart();
    }

    /// SIGSTOP: the server keeps its sockets but answers nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        send_signal(self.child.as_ref().expect("server running").id(), signal);
    }

    /// `CLIENT KILL TYPE pubsub`: drops every subscriber connection, as a proxy or a
    /// network fault would. Returns how many were killed.
    pub async fn kill_subscribers(&self) -> i64 {
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("pubsub")
            .query_async(&mut self.conn().await)
            .await
            .expect("CLIENT KILL TYPE pubsub")
    }

    /// `PUBSUB NUMSUB channel`: how many connections subscribe to `channel`.
    pub async fn numsub(&self, channel: &str) -> i64 {
        let reply: (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(channel)
            .query_async(&mut self.conn().await)
            .await
            .expect("PUBSUB NUMSUB");
        reply.1
    }

    /// Every channel with a subscriber, sorted, but for the namespace's admin channel
    /// ([`ADMIN_CHANNEL`]), which every backend's subscriber listens on.
    pub async fn channels(&self) -> Vec<String> {
        let mut channels = self.sorted(redis::cmd("PUBSUB").arg("CHANNELS")).await;
        channels.retain(|c| c != ADMIN_CHANNEL);
        channels
    }

    /// Whether `key` exists.
    /// Waits (generously) until the lock of user key `key` exists.
    pub async fn wait_until_held(&self, key: &str) {
        let lock = lock_key(key);
        eventually("the lock is held", || self.exists(&lock)).await;
    }

    /// Waits until the lock of user key `key` is gone.
    pub async fn wait_until_released(&self, key: &str) {
        self.wait_until_gone(&lock_key(key)).await;
    }

    /// Waits until the Redis key `redis_key` is gone.
    pub async fn wait_until_gone(&self, redis_key: &str) {
        eventually(&format!("{redis_key} is gone"), || async {
            !self.exists(redis_key).await
        })
        .await;
    }

    /// Waits until the release channel of user key `key` has `n` subscribers.
    pub async fn wait_for_subscribers(&self, key: &str, n: i64) {
        let channel = channel(key);
        eventually(&format!("{n} subscriber(s) on {channel}"), || async {
            self.numsub(&channel).await == n
        })
        .await;
    }

    pub async fn exists(&self, key: &str) -> bool {
        redis::cmd("EXISTS")
            .arg(key)
            .query_async(&mut self.conn().await)
            .await
            .expect("EXISTS")
    }

    /// The holders in the line of `user`'s lock (see line.lua), head first.
    pub async fn line(&self, user: &str) -> Vec<String> {
        redis::cmd("ZRANGE")
            .arg(format!("{}:line", lock_key(user)))
            .arg(0)
            .arg(-1)
            .query_async(&mut self.conn().await)
            .await
            .expect("ZRANGE")
    }

    /// Every key in the database, sorted.
    pub async fn keys(&self) -> Vec<String> {
        self.sorted(redis::cmd("KEYS").arg("*")).await
    }

    async fn sorted(&self, cmd: &redis::Cmd) -> Vec<String> {
        let mut names: Vec<String> = cmd
            .query_async(&mut self.conn().await)
            .await
            .expect("list names");
        names.sort();
        names
    }

    /// Every key with its type and value as a string, to prove that nothing was touched.
    pub async fn dump(&self) -> Vec<(String, Vec<u8>)> {
        let mut conn = self.conn().await;
        let mut dump = Vec::new();
        for key in self.keys().await {
            let value: Option<Vec<u8>> = redis::cmd("DUMP")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("DUMP");
            dump.push((key, value.unwrap_or_default()));
        }
        dump
    }
}

/// The Redis names the default namespace gives a plain (brace-free) user key.
pub fn lock_key(user: &str) -> String {
    format!("tower-lock:{{{user}}}")
}

/// The default namespace's admin channel: a force-release is announced there.
pub const ADMIN_CHANNEL: &str = "tower-lock:{%admin}:released";

/// The release channel of a plain user key (see [`lock_key`]).
pub fn channel(user: &str) -> String {
    format!("{}:released", lock_key(user))
}

/// Runs a `redis-server` or `redis-cli` command through `run` (`Command::spawn`,
/// `Command::output`, ...). When the program is not on `PATH` the test fails here, naming
/// the package to install: a test that needs Redis never skips.
pub fn redis_tool<T>(
    command: &mut Command,
    run: impl FnOnce(&mut Command) -> std::io::Result<T>,
) -> std::io::Result<T> {
    let result = run(command);
    if let Err(e) = &result {
        if e.kind() == std::io::ErrorKind::NotFound {
            panic!(
                "{} not found on PATH: install it (Debian/Ubuntu: apt-get install redis-server; \
                 macOS: brew install redis)",
                command.get_program().to_string_lossy()
            );
        }
    }
    result
}

/// Sends `signal` (as `kill(1)` spells it, `-STOP`, `-KILL`, ...) to a process.
pub fn send_signal(pid: u32, signal: &str) {
    assert!(process::signal(pid, signal), "kill {signal} {pid}");
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL also ends a server stopped by `pause`.
        self.kill();
    }
}

/// A backend on `url` with short timeouts, so fault tests end fast (also used by child
/// processes, which only know the server's url).
pub async fn backend(url: &str) -> RedisBackend {
    builder(url)
        .build()
        .await
        .expect("backend connects to the test server")
}

/// The builder of [`backend`], for tests that set more before building.
pub fn builder(url: &str) -> tower_lock::RedisBackendBuilder {
    RedisBackend::builder(url)
        .command_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
}

/// [`process::free_port`], for the servers that cannot start without one.
fn free_port() -> u16 {
    process::free_port().unwrap_or_else(|e| panic!("{e}"))
}

/// Whether the Redis answering on `port` is the process `pid`.
fn serves_pid(port: u16, pid: u32) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    if stream.write_all(b"INFO server\r\n").is_err() {
        return false;
    }
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = stream.read(&mut buf) {
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        if let Some(at) = text.find("process_id:") {
            if let Some(line) = text[at..]
                .split("\r\n")
                .next()
                .filter(|_| text[at..].contains("\r\n"))
            {
                return line == format!("process_id:{pid}");
            }
        }
    }
    false
}

/// Serves `app` on a free loopback port; the server runs until the test's runtime ends.
pub async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// A reply as the tests look at it.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: String,
}

impl Reply {
    /// Asserts a problem+json rejection with `status`; returns its `detail`.
    pub fn problem(&self, status: u16) -> String {
        assert_eq!(self.status, status, "status of {self:?}");
        assert_eq!(
            self.headers[http::header::CONTENT_TYPE],
            tower_lock::layer::response::PROBLEM_JSON
        );
        let body: serde_json::Value = serde_json::from_str(&self.body).expect("JSON body");
        assert_eq!(body["status"], status);
        body["detail"].as_str().expect("detail").to_owned()
    }
}

pub type HttpClient = Client<HttpConnector, Full<bytes::Bytes>>;

pub fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// POSTs with an empty body and reads the whole reply.
pub async fn post(client: &HttpClient, addr: SocketAddr, path: &str) -> Reply {
    send(client, post_request(addr, path)).await
}

/// `n` buyers, each a task that POSTs /buy to one of `addrs` in turn: the flash sale.
pub fn buy_all(addrs: &[SocketAddr], n: usize) -> Vec<tokio::task::JoinHandle<u16>> {
    let client = http_client();
    (0..n)
        .map(|i| {
            let (client, addr) = (client.clone(), addrs[i % addrs.len()]);
            tokio::spawn(async move { post(&client, addr, "/buy").await.status })
        })
        .collect()
}

/// Waits (a minute at most each) for every buyer of [`buy_all`] and asserts each was
/// served.
pub async fn all_served(buyers: Vec<tokio::task::JoinHandle<u16>>) {
    for buyer in buyers {
        let status = tokio::time::timeout(Duration::from_secs(60), buyer)
            .await
            .expect("served")
            .expect("no panic");
        assert_eq!(status, 200, "a buyer was not served");
    }
}

/// A POST request to `path` on `addr`, to add headers to before [`send`].
pub fn request(addr: SocketAddr, path: &str) -> http::request::Builder {
    http::Request::post(format!("http://{addr}{path}"))
}

/// An empty POST to `path`, ready to [`send`].
pub fn post_request(addr: SocketAddr, path: &str) -> http::Request<Full<bytes::Bytes>> {
    request(addr, path).body(Full::default()).expect("request")
}

/// Sends `request` and reads the whole reply.
pub async fn send(client: &HttpClient, request: http::Request<Full<bytes::Bytes>>) -> Reply {
    try_send(client, request).await.expect("HTTP request")
}

/// Sends `request` and reads the whole reply, or tells why there is none (for example
/// the server closed the connection).
pub async fn try_send(
    client: &HttpClient,
    request: http::Request<Full<bytes::Bytes>>,
) -> Result<Reply, axum::BoxError> {
    let response = client.request(request).await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await?.to_bytes();
    Ok(Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Holds handlers inside their lock until the test opens it.
#[derive(Clone, Default)]
pub struct Gate {
    inside: Arc<tokio::sync::watch::Sender<usize>>,
    open: tokio_util::sync::CancellationToken,
}

impl Gate {
    /// Called by a handler: counts it as inside, then waits until [`open`](Self::open).
    pub async fn pass(&self) {
        self.inside.send_modify(|n| *n += 1);
        self.open.cancelled().await;
    }

    /// Waits (generously) until `n` handlers are inside.
    pub async fn wait_inside(&self, n: usize) {
        let mut inside = self.inside.subscribe();
        tokio::time::timeout(Duration::from_secs(10), inside.wait_for(|&k| k >= n))
            .await
            .expect("handlers enter the gate")
            .expect("gate alive");
    }

    /// Lets every handler, present and future, through.
    pub fn open(&self) {
        self.open.cancel();
    }
}

/// Waits (generously) until `check` holds; for catching hangs, not for timing.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Runs `future`, returning its output and the WARN and ERROR lines the crate logged
/// meanwhile (in its task: what it spawns logs elsewhere).
pub async fn warnings_of<T>(future: impl std::future::Future<Output = T>) -> (T, String) {
    use tracing::instrument::WithSubscriber;
    let lines = Lines::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer({
            let lines = lines.clone();
            move || lines.clone()
        })
        .finish();
    let output = future.with_subscriber(subscriber).await;
    let text = String::from_utf8(lines.0.lock().expect("lines").clone()).expect("UTF-8");
    (output, text)
}

/// Where a test's subscriber writes ([`warnings_of`]'s, or a [`Log`]'s).
#[derive(Clone, Default)]
struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);

impl Lines {
    /// What was written so far.
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lines")).into_owned()
    }
}

/// A subscriber's lines, and a signal on every write: what a test waits for in the log.
#[derive(Clone, Default)]
pub struct Log {
    lines: Lines,
    written: Arc<tokio::sync::Notify>,
}

impl Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.lines.write(buf)?;
        self.written.notify_waiters();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    /// Waits until `count` lines contain `text` (woken by each write; the bound catches
    /// hangs only).
    pub async fn until(&self, text: &str, count: usize) {
        let seen = async {
            loop {
                let written = self.written.notified();
                tokio::pin!(written);
                written.as_mut().enable();
                if self.count(text) >= count {
                    return;
                }
                written.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), seen)
            .await
            .unwrap_or_else(|_| panic!("{count} lines of {text:?}:\n{}", self.text()));
    }

    /// How many lines contain `text`.
    pub fn count(&self, text: &str) -> usize {
        self.text().lines().filter(|l| l.contains(text)).count()
    }

    /// What was logged so far.
    pub fn text(&self) -> String {
        self.lines.text()
    }
}

/// Runs `body` on a runtime of this thread under a subscriber that writes what `filter`
/// lets through to the [`Log`] it is given: the tasks a backend spawns there log to it,
/// which they would not under [`warnings_of`].
pub fn logged_on_this_thread<F: std::future::Future<Output = ()>>(
    filter: &str,
    body: impl FnOnce(Log) -> F,
) -> Log {
    use tracing_subscriber::layer::SubscriberExt;
    // A global subscriber first, which stays registered: with this thread's the only one
    // registered, tracing-core caches a call site first hit on another thread (a backend
    // of a test running beside this one) with that thread's interest, none, and this
    // thread's subscriber never sees its events.
    init_tracing();
    let log = Log::default();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new(filter))
        .with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer({
                    let log = log.clone();
                    move || log.clone()
                }),
        );
    tracing::subscriber::with_default(subscriber, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(body(log.clone()));
    });
    log
}

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lines").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Routes the crate's tracing to the test output, filtered by `RUST_LOG` (off by default).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Waits until `n` tasks of `backend` are queued in-process behind the contender or
/// holder of a key (they do not subscribe: only the first task of a process talks to
/// Redis).
pub async fn queued(backend: &RedisBackend, n: usize) {
    eventually(&format!("{n} tasks are queued"), || async move {
        backend.stats().local_waiters == n
    })
    .await;
}

/// Sum of `calls=` over `commands` in the text of `INFO commandstats`.
pub fn calls_in(commandstats: &str, commands: &[&str]) -> u64 {
    commandstats
        .lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            commands.contains(&name).then_some(stats)
        })
        .filter_map(|stats| stats.split(',').find_map(|kv| kv.strip_prefix("calls=")))
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}

/// Whether a master's `INFO replication` (`info`) shows its first replica at the master's
/// own offset: it has acknowledged every write the master made.
pub fn replica_caught_up(info: &str) -> bool {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
    };
    let own = field("master_repl_offset:");
    let replica = field("slave0:").and_then(|v| {
        v.split(',')
            .find_map(|kv| kv.strip_prefix("offset="))
            .map(str::to_owned)
    });
    own.is_some() && own == replica
}

/// The error chain as anyhow's `{:#}` prints it: every level's Display joined by ": ".
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut levels = vec![error.to_string()];
    let mut source = error.source();
    while let Some(e) = source {
        levels.push(e.to_string());
        source = e.source();
    }
    levels.join(": ")
}

/// A build error's own message (its Display, without the source) says each of `says`, and
/// leaves the source's text to the source: in the chain the innermost cause appears once.
pub fn assert_says(error: &tower_lock::BuildError, says: &[&str]) {
    let message = error.to_string();
    for part in says {
        assert!(message.contains(part), "{message:?} does not say {part:?}");
    }
    let mut innermost = None;
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let text = cause.to_string();
        assert!(
            !message.contains(&text),
            "{message:?} repeats its cause {text:?}"
        );
        innermost = Some(text);
        source = cause.source();
    }
    if let Some(cause) = innermost {
        let text = chain(error);
        assert_eq!(text.matches(&cause).count(), 1, "{text}");
    }
}

/// Builds, printing how long the build took and how it ended (a figure, not an
/// assertion); a build that does not end within 20 s fails the test.
pub async fn timed_build(
    what: &str,
    builder: tower_lock::RedisBackendBuilder,
) -> Result<RedisBackend, tower_lock::BuildError> {
    let started = Instant::now();
    let built = tokio::time::timeout(Duration::from_secs(20), builder.build())
        .await
        .expect("build() ends");
    let outcome = match &built {
        Ok(_) => "ok".to_owned(),
        Err(e) => chain(e),
    };
    eprintln!("{what}: build() took {:?}: {outcome}", started.elapsed());
    built
}

/// [`for_each_store!`] on one throwaway redis-server and on `MemoryBackend` only.
#[macro_export]
macro_rules! on_redis_and_memory {
    ($($name:ident),* $(,)?) => {
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::needs!(Redis);
                    let server = $crate::support::RedisServer::start();
                    let b = [
                        server.backend().await,
                        server.backend().await,
                        server.backend().await,
                    ];
                    super::$name(b).await;
                }
            )*
        }
        mod in_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let b = tower_lock::MemoryBackend::new();
                    super::$name([b.clone(), b.clone(), b]).await;
                }
            )*
        }
    };
}

/// Runs each named test body once per store, with three instances of it: `on_redis::NAME`
/// gets three backends of one throwaway redis-server (three processes, as far as the locks
/// can tell: each has its own owners, queue and connections), `on_quorum::NAME` three
/// backends of the binary's five-master quorum in a namespace of the test's own,
/// `in_memory::NAME` three clones of one `MemoryBackend`, and `on_postgres::NAME` and
/// `on_mariadb::NAME` three backends of the binary's shared PostgreSQL and MariaDB (see
/// [`on_sql!`]). A body is `async fn NAME<B: LockBackend>(b: [B; 3])`.
#[macro_export]
macro_rules! for_each_store {
    ($($name:ident),* $(,)?) => {
        $crate::on_redis_and_memory!($($name),*);
        mod on_quorum {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::needs!(Redis);
                    let quorum = $crate::support::quorum::shared();
                    let _turn = quorum.shared_turn().await;
                    let b: [tower_lock::RedisBackend; 3] =
                        quorum.backends(3).await.try_into().expect("three backends");
                    super::$name(b).await;
                }
            )*
        }
        $crate::on_sql!($($name),*);
    };
}

/// `MODULE::NAME` for each body `async fn NAME<B: LockBackend>(b: [B; 3])`, run with three
/// backends of the binary's shared server of `support::STORE` (its `fresh_namespace` and
/// `backend_in`), in a namespace of the test's own.
#[macro_export]
macro_rules! on_three_backends_of {
    ($module:ident, $store:ident, $server:ident; $($name:ident),* $(,)?) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::needs!($server);
                    use $crate::support::$store;
                    let namespace = $store::fresh_namespace();
                    let b = [
                        $store::backend_in(&namespace).await,
                        $store::backend_in(&namespace).await,
                        $store::backend_in(&namespace).await,
                    ];
                    super::$name(b).await;
                }
            )*
        }
    };
}

/// [`for_each_store!`] on the SQL stores only: `on_postgres::NAME` gets three backends of
/// the binary's shared PostgreSQL in a namespace of the test's own, `on_mariadb::NAME`
/// three of its shared MariaDB.
#[macro_export]
macro_rules! on_sql {
    ($($name:ident),* $(,)?) => {
        $crate::on_three_backends_of!(on_postgres, postgres, Postgres; $($name),*);
        $crate::on_three_backends_of!(on_mariadb, mariadb, MariaDb; $($name),*);
    };
}

/// [`for_each_store!`] without the Redis quorum, and with etcd and ZooKeeper: on the stores
/// that keep idempotency records (`IdempotencyBackend`).
#[macro_export]
macro_rules! for_each_records_store {
    ($($name:ident),* $(,)?) => {
        $crate::on_redis_and_memory!($($name),*);
        $crate::on_sql!($($name),*);
        $crate::on_etcd!($($name),*);
        $crate::on_zookeeper_stores!($($name),*);
    };
}

/// The bodies of [`for_each_store!`] that apply to etcd, `on_etcd::NAME` with three
/// backends of the binary's shared etcd in a namespace of the test's own (each with its
/// own lease, owners, queue and watch). Not every body applies: a hold there lives under
/// its backend's lease, renewed for all of them, so no hold runs out on its own lease.
#[cfg(feature = "etcd")]
#[macro_export]
macro_rules! on_etcd {
    ($($name:ident),* $(,)?) => {
        $crate::on_three_backends_of!(on_etcd, etcd, Etcd; $($name),*);
    };
}

/// Without the `etcd` feature there is no etcd store to run the bodies on (the stores
/// report names it).
#[cfg(not(feature = "etcd"))]
#[macro_export]
macro_rules! on_etcd {
    ($($name:ident),* $(,)?) => {};
}

/// [`for_each_store!`], [`on_etcd!`] and `on_zookeeper_stores!` (support/zookeeper.rs):
/// the bodies before `;` on every store, those after it on every store but the consensus
/// stores, where a hold lives under its backend's lease or session whatever lease it asked.
#[macro_export]
macro_rules! for_each_store_and_consensus {
    ($($name:ident),* $(,)? ; not on etcd or zookeeper: $($other:ident),* $(,)?) => {
        $crate::for_each_store!($($name,)* $($other),*);
        $crate::on_etcd!($($name),*);
        $crate::on_zookeeper_stores!($($name),*);
    };
}

/// Sends an empty `method` request to `path` through `app` (no socket) and reads the whole
/// reply; a reply that takes over 10 s fails the test.
pub async fn call(app: &Router, method: http::Method, path: &str) -> Reply {
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .body(axum::body::Body::empty())
        .expect("request");
    oneshot(app, request).await
}

/// Sends `request` through `app` (no socket) and reads the whole reply; a reply that takes
/// over 10 s fails the test.
pub async fn oneshot(app: &Router, request: http::Request<axum::body::Body>) -> Reply {
    use tower::ServiceExt;
    let response = tokio::time::timeout(Duration::from_secs(10), app.clone().oneshot(request))
        .await
        .expect("a reply within 10 s")
        .expect("infallible");
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.expect("body");
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// A connection of the test's own to the Redis server (or sentinel) at `url`, for
/// inspecting and tampering with it. Its bounds only catch hangs: redis-rs' defaults (a
/// second to connect, 500 ms per response) fail queries that a machine loaded by the
/// other tests answers late.
pub async fn test_conn(url: &str) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let bounds = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(10)))
        .set_response_timeout(Some(Duration::from_secs(10)));
    redis::Client::open(url)?
        .get_multiplexed_async_connection_with_config(&bounds)
        .await
}

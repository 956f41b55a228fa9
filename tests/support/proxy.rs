//! A TCP fault proxy between an application and Redis, steered by the test: latency on
//! every chunk, a stall of all traffic (connections stay open and go silent, as behind a
//! half-open link), and replies cut in the middle (part of a server reply forwarded, then
//! the connection closed). `tc netem` is not available on these kernels; this is.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The proxy; its connections close when it is dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    control: Arc<Control>,
    shutdown: CancellationToken,
}

#[derive(Clone, Copy, Default)]
struct Settings {
    latency: Duration,
    stalled: bool,
    /// Only what the application sends is held back; replies and pushed messages flow.
    requests_stalled: bool,
    /// Only what the server sends is held back; what the application sends gets through.
    replies_stalled: bool,
    rejecting: bool,
}

struct Control {
    settings: watch::Sender<Settings>,
    /// Server replies still to be cut.
    cuts_armed: AtomicUsize,
    cuts_done: AtomicUsize,
    connections: AtomicUsize,
    /// Chunks of what the application sent that a stall held back.
    held_requests: AtomicUsize,
    /// Forwarded connections not closed yet.
    open: AtomicUsize,
}

impl FaultProxy {
    /// Listens on `listen` and forwards every connection to `upstream`.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind(listen).await.expect("proxy binds");
        let addr = listener.local_addr().expect("proxy address");
        let control = Arc::new(Control {
            settings: watch::Sender::new(Settings::default()),
            cuts_armed: AtomicUsize::new(0),
            cuts_done: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            held_requests: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
        });
        let shutdown = CancellationToken::new();
        let (accepting, stop) = (control.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => continue,
                    },
                };
                if accepting.settings.borrow().rejecting {
                    continue; // dropped: closed at once
                }
                let (control, conn) = (accepting.clone(), stop.child_token());
                tokio::spawn(async move {
                    // Redis down: the client sees its connection close at once.
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    control.connections.fetch_add(1, Ordering::Relaxed);
                    control.open.fetch_add(1, Ordering::SeqCst);
                    let _ = (client.set_nodelay(true), server.set_nodelay(true));
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    let requests = pump(client_read, server_write, control.clone(), false, &conn);
                    let replies = pump(server_read, client_write, control.clone(), true, &conn);
                    tokio::join!(requests, replies);
                    control.open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        FaultProxy {
            addr,
            control,
            shutdown,
        }
    }

    /// Where applications connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Delays every chunk, both ways, by `latency` (zero: none).
    pub fn set_latency(&self, latency: Duration) {
        self.control.settings.send_modify(|s| s.latency = latency);
    }

    /// Stops forwarding anything, both ways; connections stay open and silent.
    pub fn stall(&self) {
        self.control.settings.send_modify(|s| s.stalled = true);
    }

    /// Stops forwarding what the application sends (its calls wait in the proxy), while
    /// what the server sends (replies, pub/sub messages) still gets through.
    pub fn stall_requests(&self) {
        self.control
            .settings
            .send_modify(|s| s.requests_stalled = true);
    }

    /// Stops forwarding what the server sends (replies wait in the proxy), while what the
    /// application sends still gets through: the server hears the application, which hears
    /// nothing back.
    pub fn stall_replies(&self) {
        self.control
            .settings
            .send_modify(|s| s.replies_stalled = true);
    }

    /// Forwards again what was held back by [`stall`](Self::stall),
    /// [`stall_requests`](Self::stall_requests) or [`stall_replies`](Self::stall_replies),
    /// and what follows.
    pub fn resume(&self) {
        self.control.settings.send_modify(|s| {
            s.stalled = false;
            s.requests_stalled = false;
            s.replies_stalled = false;
        });
    }

    /// Closes every connection, and every new one at once, as a cut link whose resets get
    /// through does: each call fails fast. [`accept`](Self::accept) ends it.
    pub fn reject(&self) {
        self.control.settings.send_modify(|s| s.rejecting = true);
    }

    /// Forwards new connections again after [`reject`](Self::reject).
    pub fn accept(&self) {
        self.control.settings.send_modify(|s| s.rejecting = false);
    }

    /// The next `n` chunks of server replies are forwarded in part (the first half), then
    /// their connection is closed. `0` disarms.
    pub fn cut_replies(&self, n: usize) {
        self.control.cuts_armed.store(n, Ordering::SeqCst);
    }

    /// How many replies were cut so far.
    pub fn cuts_done(&self) -> usize {
        self.control.cuts_done.load(Ordering::SeqCst)
    }

    /// How many chunks of what the application sent a stall held back so far: a call
    /// that waits in the proxy.
    pub fn held_requests(&self) -> usize {
        self.control.held_requests.load(Ordering::SeqCst)
    }

    /// How many forwarded connections are open now.
    pub fn open_connections(&self) -> usize {
        self.control.open.load(Ordering::SeqCst)
    }

    /// How many connections were forwarded so far.
    pub fn connections(&self) -> usize {
        self.control.connections.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Copies `from` to `to` under the proxy's settings until either side closes, the reply is
/// cut, or the proxy stops; then closes the whole connection (`conn`).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    control: Arc<Control>,
    replies: bool,
    conn: &CancellationToken,
) {
    let mut settings = control.settings.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            _ = conn.cancelled() => break,
            _ = settings.wait_for(|s| s.rejecting) => break,
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
        };
        // A chunk read while stalled is held until the stall ends.
        let held = |s: &Settings| {
            s.stalled || (s.requests_stalled && !replies) || (s.replies_stalled && replies)
        };
        if !replies && held(&settings.borrow()) {
            control.held_requests.fetch_add(1, Ordering::SeqCst);
        }
        let latency = tokio::select! {
            _ = conn.cancelled() => break,
            now = settings.wait_for(|s| !held(s) || s.rejecting) => match now {
                Ok(now) if !now.rejecting => now.latency,
                _ => break,
            },
        };
        if !latency.is_zero() {
            tokio::select! {
                _ = conn.cancelled() => break,
                _ = tokio::time::sleep(latency) => {}
            }
        }
        let cut = replies
            && control
                .cuts_armed
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if cut {
            let _ = to.write_all(&buf[..n / 2]).await;
            control.cuts_done.fetch_add(1, Ordering::SeqCst);
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    conn.cancel();
}

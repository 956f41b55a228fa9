//! A TLS-only `redis-server` (`--port 0 --tls-port P`) with a CA, a server certificate and a
//! client certificate made by the `openssl` CLI in a temp dir; killed on drop. The tests
//! look at its state with `redis-cli --tls`, so no TLS client of the test's own is needed
//! (the backend must bring its crypto provider itself).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::redis_tool;
/// A CA and the certificates it signed, as PEM files in a temp dir.
pub struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    /// A new CA, a server certificate for `localhost` and `127.0.0.1`, and a client
    /// certificate, all signed by the CA.
    pub fn new() -> Self {
        let certs = Certs {
            dir: tempfile::tempdir().expect("temp dir"),
        };
        certs.ca("ca");
        certs.signed(
            "server",
            "serverAuth",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        );
        certs.signed(
            "client",
            "clientAuth",
            "subjectAltName=DNS:tower-lock-test-client",
        );
        certs
    }

    /// redis-server's arguments to serve TLS with the server certificate and to trust this
    /// CA (for client certificates, and as a client of other nodes).
    pub fn server_args(&self) -> Vec<std::ffi::OsString> {
        let mut args = Vec::new();
        for (flag, file) in [
            ("--tls-cert-file", "server.crt"),
            ("--tls-key-file", "server.key"),
            ("--tls-ca-cert-file", "ca.crt"),
        ] {
            args.push(flag.into());
            args.push(self.path(file).into());
        }
        args
    }

    /// The path of `name` (`ca.crt`, `server.key`, ...).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The contents of `name`.
    pub fn pem(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).expect("certificate file")
    }

    /// A self-signed CA `name.crt` / `name.key`.
    pub fn ca(&self, name: &str) {
        openssl(
            self.dir.path(),
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=tower-lock test CA",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.crt"),
            ],
        );
    }

    /// `name.crt` / `name.key` signed by `ca`, for `usage` with the extension `san`.
    fn signed(&self, name: &str, usage: &str, san: &str) {
        let dir = self.dir.path();
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
            ],
        );
        let ext = format!("{name}.ext");
        std::fs::write(
            dir.join(&ext),
            format!("basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n{san}\n"),
        )
        .expect("write extensions");
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &ext,
                "-out",
                &format!("{name}.crt"),
            ],
        );
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl is installed (apt-get install openssl)");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A redis-server that speaks only TLS, owned by one test.
pub struct TlsServer {
    child: Child,
    port: u16,
    pub certs: Certs,
    _dir: tempfile::TempDir,
}

impl TlsServer {
    /// Starts a TLS-only server; `auth_clients`: whether it demands client certificates.
    pub fn start(auth_clients: bool) -> Self {
        let certs = Certs::new();
        // Another process may take the free port before redis-server binds it: retry.
        for _ in 0..20 {
            let dir = tempfile::tempdir().expect("temp dir");
            let port = super::free_port();
            let mut child = redis_tool(
                Command::new("redis-server")
                    .args(["--port", "0", "--bind", "127.0.0.1"])
                    .args(["--tls-port", &port.to_string()])
                    .args(certs.server_args())
                    .args([
                        "--tls-auth-clients",
                        if auth_clients { "yes" } else { "no" },
                    ])
                    .args(["--save", "", "--appendonly", "no"])
                    .arg("--dir")
                    .arg(dir.path())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
                Command::spawn,
            )
            .expect("spawn redis-server");
            if wait_ready(&mut child, port, &certs) {
                return TlsServer {
                    child,
                    port,
                    certs,
                    _dir: dir,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("could not start a TLS redis-server on a free port");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `rediss://HOST:PORT`.
    pub fn url(&self, host: &str) -> String {
        format!("rediss://{host}:{}", self.port)
    }

    /// Runs a command through `redis-cli --tls` (trusting the CA, with the client
    /// certificate) and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, &self.certs, args).expect("redis-cli --tls answers")
    }

    /// Every key in the database, sorted.
    pub fn keys(&self) -> Vec<String> {
        let out = self.cli(&["KEYS", "*"]);
        let mut keys: Vec<String> = out
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        keys.sort();
        keys
    }
}

/// Waits until `child` (not another process that took the port) answers over TLS.
pub fn wait_ready(child: &mut Child, port: u16, certs: &Certs) -> bool {
    let pid = format!("process_id:{}", child.id());
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if cli(port, certs, &["INFO", "server"]).is_some_and(|info| info.contains(&pid)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Runs `redis-cli --tls` against the TLS port `port`, trusting `certs`' CA and presenting
/// its client certificate; the output, if the command succeeded.
pub fn cli(port: u16, certs: &Certs, args: &[&str]) -> Option<String> {
    let output = redis_tool(
        Command::new("redis-cli")
            .args(["--tls", "--cacert"])
            .arg(certs.path("ca.crt"))
            .arg("--cert")
            .arg(certs.path("client.crt"))
            .arg("--key")
            .arg(certs.path("client.key"))
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .stderr(Stdio::null()),
        Command::output,
    )
    .ok()?;
    let text = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    output.status.success().then_some(text)
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

//! [`EtcdBackendBuilder`]: the settings, and `build`: connect, grant the backend's lease,
//! start the watch and the lease's keep-alive.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::time::timeout;

use super::EtcdBackend;
use super::error::{EtcdError, code, status_code};
use super::keys::namespace_prefix;
use super::lease::{Lease, keep_alive_until_shutdown};
use super::store::EtcdStore;
use super::watch::{Listener, WatchConfig};
use crate::core::runtime::Daemon;
use crate::core::telemetry::{self, Namespace};
use crate::core::wakeups::Wakeups;
use crate::core::{Core, DEFAULT_MAX_KEY_LEN, DEFAULT_MAX_LOCAL_HANDOFF_TIME, Parts, Settings};
use crate::error::{BuildError, ConnectFailure};
use crate::key::validate_namespace;

/// Configures an [`EtcdBackend`]; created by [`EtcdBackend::builder`].
#[derive(Clone)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct EtcdBackendBuilder {
    endpoints: Vec<String>,
    namespace: String,
    lease_ttl: Duration,
    user: Option<(String, String)>,
    tls_root_cert: Option<Vec<u8>>,
    tls_client_cert: Option<(Vec<u8>, Vec<u8>)>,
    max_key_len: usize,
    connect_timeout: Duration,
    command_timeout: Duration,
    keep_alive_interval: Duration,
    max_backoff: Duration,
}

impl std::fmt::Debug for EtcdBackendBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackendBuilder")
            .field("endpoints", &self.endpoints)
            .field("namespace", &self.namespace)
            .field("lease_ttl", &self.lease_ttl)
            // Never the password.
            .field("user", &self.user.as_ref().map(|(user, _)| user))
            .field("tls_root_cert", &self.tls_root_cert.is_some())
            .field("tls_client_cert", &self.tls_client_cert.is_some())
            .field("max_key_len", &self.max_key_len)
            .field("connect_timeout", &self.connect_timeout)
            .field("command_timeout", &self.command_timeout)
            .finish_non_exhaustive()
    }
}

impl EtcdBackendBuilder {
    pub(super) fn new(endpoints: Vec<String>) -> Self {
        EtcdBackendBuilder {
            endpoints,
            namespace: "tower-lock".to_owned(),
            lease_ttl: Duration::from_secs(30),
            user: None,
            tls_root_cert: None,
            tls_client_cert: None,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            connect_timeout: Duration::from_secs(2),
            command_timeout: Duration::from_secs(2),
            keep_alive_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(2),
        }
    }

    /// The prefix of every lock key in etcd (default `tower-lock`): backends whose locks
    /// must not contend with each other use different namespaces. Must not contain `{`,
    /// `}` or control characters.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// The TTL of the backend's lease in etcd (default 30 s; whole seconds, rounded up, at
    /// least 2 s). Every hold of the backend lives under it: a process that stops (or is
    /// cut off from etcd) loses its holds at most this long after its last keep-alive. A
    /// holder's own deadline is half of it from its last renewal, which is the lease every
    /// request gets whatever it asks for (see [`EtcdBackend`]); renewals come every sixth.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Authenticates as `user` with `password` (etcd's user/password auth); refused at
    /// build when etcd does not accept them.
    pub fn user(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// Trusts the CA certificate `pem` (PEM) for `https://` endpoints instead of the
    /// system's roots: for a cluster whose certificates a private CA signed.
    ///
    /// Needs the crate's `tls` feature (on by default); without it `build` fails with
    /// [`BuildError::Tls`].
    pub fn tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_cert = Some(pem.into());
        self
    }

    /// Presents the client certificate `cert_pem` (a PEM chain, leaf first) with its private
    /// key `key_pem` to a cluster that requires one (`--client-cert-auth`).
    ///
    /// Needs the crate's `tls` feature (on by default); without it `build` fails with
    /// [`BuildError::Tls`].
    pub fn tls_client_cert(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls_client_cert = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// The longest key accepted, in bytes (default 1024); longer keys are refused with
    /// 400, never truncated.
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.max_key_len = len;
        self
    }

    /// How long to wait for a connection (default 2 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one call may take (default 2 s): an election in a cluster takes about a
    /// second with etcd's defaults, and a call waits it out within this bound.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// How often the gRPC connection is pinged (default 1 s): a half-open connection is
    /// noticed within this plus the command timeout, and the waiters are woken.
    pub fn keep_alive_interval(mut self, interval: Duration) -> Self {
        self.keep_alive_interval = interval;
        self
    }

    /// Connects, grants the backend's lease (which proves the endpoints, the credentials
    /// and a cluster with a leader), and starts the backend's watch and the lease's
    /// keep-alive. Must be called inside a Tokio runtime.
    ///
    /// Refused with the cause: no endpoint, an endpoint that is not `http://host:port` or
    /// `https://host:port` (or a mix of both), certificates for `http://` endpoints,
    /// unreachable endpoints or no leader in time, a failed TLS handshake, credentials etcd
    /// refuses, a user without rights on the namespace.
    pub async fn build(self) -> Result<EtcdBackend, BuildError> {
        let endpoints = self.validate()?;
        let addr = endpoints.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_keep_alive(self.keep_alive_interval, self.command_timeout)
            .with_keep_alive_while_idle(true)
            // A member cut off from the cluster's leader refuses calls (and ends its
            // watches) rather than serving stale reads.
            .with_require_leader(true);
        if let Some((user, password)) = &self.user {
            options = options.with_user(user.clone(), password.clone());
        }
        if endpoints.iter().any(|e| e.starts_with("https://")) {
            options = self.tls(options)?;
        }
        let connecting = Client::connect(endpoints.clone(), Some(options));
        let client = match timeout(self.connect_timeout, connecting).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(self.refused(&addr, e)),
            Err(_) => return Err(timed_out(&addr)),
        };
        let metrics = Namespace::new(&self.namespace);
        telemetry::describe_metrics();
        let parts = Parts::new(
            Settings {
                command_timeout: self.command_timeout,
                // Tokens are revisions: none can be set aside for a run in memory.
                max_local_handoffs: 0,
                max_local_handoff_time: DEFAULT_MAX_LOCAL_HANDOFF_TIME,
                max_key_len: self.max_key_len,
            },
            metrics.clone(),
        );
        let ttl =
            i64::try_from(self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0))
                .unwrap_or(i64::MAX);
        let granting = Lease::grant(client.lease_client(), ttl, parts.recheck.clone());
        let lease = match timeout(self.connect_timeout, granting).await {
            Ok(Ok(lease)) => Arc::new(lease),
            Ok(Err(EtcdError::Client(e))) => return Err(self.refused(&addr, e)),
            Ok(Err(e)) => {
                return Err(BuildError::Connect {
                    addr,
                    failure: ConnectFailure::Other,
                    source: Box::new(e),
                });
            }
            Err(_) => return Err(timed_out(&addr)),
        };
        let probing = probe(&client, &self.namespace);
        match timeout(self.connect_timeout, probing).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(self.refused(&addr, e)),
            Err(_) => return Err(timed_out(&addr)),
        }
        let listener = Listener::spawn(
            Wakeups::new(metrics),
            WatchConfig {
                client: client.watch_client(),
                prefix: namespace_prefix(&self.namespace),
                connect_timeout: self.connect_timeout,
                max_backoff: self.max_backoff,
            },
            parts.recheck.clone(),
            parts.shutdown.clone(),
            &parts.runtime,
        );
        let keeper = {
            let (lease, command_timeout) = (lease.clone(), self.command_timeout);
            Daemon::spawn(
                move |shutdown| keep_alive_until_shutdown(lease.clone(), command_timeout, shutdown),
                &parts.runtime,
                parts.shutdown.clone(),
            )
        };
        let store = EtcdStore {
            client,
            lease,
            listener,
            keeper,
            namespace: self.namespace,
            max_key_len: self.max_key_len,
        };
        Ok(EtcdBackend {
            inner: Core::new(store, parts),
        })
    }

    /// The settings checked, and the endpoints as etcd-client takes them.
    fn validate(&self) -> Result<Vec<String>, BuildError> {
        validate_namespace(&self.namespace)?;
        let refuse = |name, reason| Err(BuildError::Setting { name, reason });
        if self.endpoints.is_empty() {
            return refuse(
                "endpoints",
                "at least one etcd endpoint (http://host:port) is needed",
            );
        }
        if self.command_timeout.is_zero() {
            return refuse("command_timeout", "it must be above zero");
        }
        if self.connect_timeout.is_zero() {
            return refuse("connect_timeout", "it must be above zero");
        }
        if self.keep_alive_interval.is_zero() {
            return refuse("keep_alive_interval", "it must be above zero");
        }
        if self.max_key_len == 0 {
            return refuse("max_key_len", "it must be at least one byte");
        }
        if self.lease_ttl < Duration::from_secs(2) {
            return refuse(
                "lease_ttl",
                "it must be at least 2 s (etcd counts leases in whole seconds)",
            );
        }
        let endpoints: Vec<String> = self
            .endpoints
            .iter()
            .map(|e| endpoint(e))
            .collect::<Result<_, _>>()?;
        let https = endpoints
            .iter()
            .filter(|e| e.starts_with("https://"))
            .count();
        if https > 0 && https < endpoints.len() {
            return Err(BuildError::tls_settings(
                "the etcd endpoints mix http:// and https://: give one scheme for all",
            ));
        }
        if https == 0 && (self.tls_root_cert.is_some() || self.tls_client_cert.is_some()) {
            return Err(BuildError::tls_settings(
                "TLS certificates were given for http:// etcd endpoints: use https://",
            ));
        }
        Ok(endpoints)
    }

    /// `options` with TLS: the root certificate given, else the system's roots, and the
    /// client certificate if given.
    #[cfg(feature = "tls")]
    fn tls(&self, options: ConnectOptions) -> Result<ConnectOptions, BuildError> {
        use etcd_client::{Certificate, Identity, TlsOptions};
        let mut tls = match &self.tls_root_cert {
            Some(pem) => TlsOptions::new().ca_certificate(Certificate::from_pem(pem)),
            None => TlsOptions::new().with_native_roots(),
        };
        if let Some((cert, key)) = &self.tls_client_cert {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        Ok(options.with_tls(tls))
    }

    /// Without the `tls` feature, `https://` endpoints are refused.
    #[cfg(not(feature = "tls"))]
    fn tls(&self, _options: ConnectOptions) -> Result<ConnectOptions, BuildError> {
        Err(BuildError::tls_settings(
            "https:// etcd endpoints need the crate's `tls` feature",
        ))
    }

    /// What a failed connect or first call says, as a build error.
    fn refused(&self, addr: &str, e: etcd_client::Error) -> BuildError {
        let message = e.to_string();
        let status = status_code(&e);
        if let Some((user, _)) = &self.user
            && (matches!(status, Some(code::UNAUTHENTICATED))
                || (matches!(
                    status,
                    Some(code::INVALID_ARGUMENT | code::FAILED_PRECONDITION)
                ) && message.contains("authentication failed")))
        {
            return BuildError::Auth {
                user: user.clone(),
                addr: addr.to_owned(),
                source: Box::new(e),
            };
        }
        if matches!(status, Some(code::PERMISSION_DENIED)) {
            return BuildError::Rights {
                user: self
                    .user
                    .as_ref()
                    .map_or_else(String::new, |(u, _)| u.clone()),
                right: format!(
                    "read and write the keys under `{}`",
                    namespace_prefix(&self.namespace)
                ),
                addr: addr.to_owned(),
                source: Box::new(e),
            };
        }
        let failure = if message.contains("onnection refused") {
            ConnectFailure::Refused
        } else if message.contains("dns error") || message.contains("failed to lookup") {
            ConnectFailure::UnknownHost
        } else if matches!(status, Some(code::DEADLINE_EXCEEDED)) {
            ConnectFailure::TimedOut
        } else {
            ConnectFailure::Other
        };
        BuildError::Connect {
            addr: addr.to_owned(),
            failure,
            source: Box::new(e),
        }
    }
}

/// Proves the rights the backend needs on the namespace, writing nothing: a transaction
/// whose condition never holds, with a write in the namespace and a read of it in its
/// branches
/// (etcd checks the rights of both branches before it evaluates the condition).
async fn probe(client: &Client, namespace: &str) -> Result<(), etcd_client::Error> {
    use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
    let prefix = namespace_prefix(namespace);
    let probe_key = format!("{prefix}%probe}}");
    let never = Txn::new()
        .when([Compare::version(probe_key.clone(), CompareOp::Less, 0)])
        .and_then([TxnOp::put(probe_key, "", None)])
        .or_else([TxnOp::get(
            prefix,
            Some(GetOptions::new().with_prefix().with_limit(1)),
        )]);
    client.kv_client().txn(never).await.map(drop)
}

fn timed_out(addr: &str) -> BuildError {
    BuildError::Connect {
        addr: addr.to_owned(),
        failure: ConnectFailure::TimedOut,
        source: "no answer from etcd (or no leader elected) within the connect timeout".into(),
    }
}

/// An endpoint as `http://host:port` or `https://host:port`: `host:port` is taken as plain
/// HTTP; anything else that is not a host and a port is refused.
fn endpoint(given: &str) -> Result<String, BuildError> {
    let url = if given.contains("://") {
        given.to_owned()
    } else {
        format!("http://{given}")
    };
    let uri: http::Uri = url.parse().map_err(|e| BuildError::Url {
        source: Box::new(e),
    })?;
    let scheme = match uri.scheme_str() {
        Some(scheme @ ("http" | "https")) => scheme,
        _ => {
            return Err(BuildError::Url {
                source: format!("`{given}` is not an etcd endpoint (http://host:port)").into(),
            });
        }
    };
    let path_free = matches!(uri.path(), "" | "/") && uri.query().is_none();
    match uri.authority() {
        Some(authority) if authority.port().is_some() && path_free => {
            Ok(format!("{scheme}://{authority}"))
        }
        _ => Err(BuildError::Url {
            source: format!(
                "`{given}` is not an etcd endpoint: it needs a host and a port (http://host:2379)"
            )
            .into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_http_host_and_port() {
        assert_eq!(endpoint("127.0.0.1:2379").unwrap(), "http://127.0.0.1:2379");
        assert_eq!(
            endpoint("http://etcd-1:2379/").unwrap(),
            "http://etcd-1:2379"
        );
        // TLS is checked at build (the `tls` feature, certificates), not here.
        assert_eq!(endpoint("https://etcd:2379").unwrap(), "https://etcd:2379");
        for bad in [
            "etcd",
            "http://etcd",
            "redis://etcd:2379",
            "http://etcd:2379/x",
            "http://a b:1",
        ] {
            assert!(
                matches!(endpoint(bad), Err(BuildError::Url { .. })),
                "{bad}"
            );
        }
    }
}

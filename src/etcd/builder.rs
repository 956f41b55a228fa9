//! [`EtcdBackendBuilder`]: the settings, and `build`: connect, grant the backend's lease,
//! start the watch and the lease's keep-alive.

mod checks;

use std::sync::Arc;
use std::time::Duration;

use etcd_client::ConnectOptions;
use tokio::time::timeout;

use self::checks::{probe, timed_out};
use super::EtcdBackend;
use super::error::EtcdError;
use super::keys::namespace_prefix;
use super::lease::{Lease, keep_alive_until_shutdown};
use super::members::Members;
use super::orphans::{Orphans, sweep_until_shutdown};
use super::store::EtcdStore;
use super::watch::{Listener, WatchConfig};
use crate::core::Core;
use crate::core::kit::settings::{StoreSettings, store_setters};
use crate::core::runtime::Daemon;
use crate::core::wakeups::Wakeups;
use crate::error::{BuildError, ConnectFailure};

/// Configures an [`EtcdBackend`]; created by [`EtcdBackend::builder`].
#[derive(Clone)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct EtcdBackendBuilder {
    endpoints: Vec<String>,
    settings: StoreSettings,
    lease_ttl: Duration,
    user: Option<(String, String)>,
    tls_root_cert: Option<Vec<u8>>,
    tls_client_cert: Option<(Vec<u8>, Vec<u8>)>,
    keep_alive_interval: Duration,
}

impl std::fmt::Debug for EtcdBackendBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackendBuilder")
            .field("endpoints", &self.endpoints)
            .field("settings", &self.settings)
            .field("lease_ttl", &self.lease_ttl)
            // Never the password.
            .field("user", &self.user.as_ref().map(|(user, _)| user))
            .field("tls_root_cert", &self.tls_root_cert.is_some())
            .field("tls_client_cert", &self.tls_client_cert.is_some())
            .field("keep_alive_interval", &self.keep_alive_interval)
            .finish()
    }
}

impl EtcdBackendBuilder {
    pub(super) fn new(endpoints: Vec<String>) -> Self {
        EtcdBackendBuilder {
            endpoints,
            // Tokens are revisions: none can be set aside for a run in memory.
            settings: StoreSettings::new(Duration::from_secs(2))
                .with_command_timeout(Duration::from_secs(5))
                .without_handoffs(),
            lease_ttl: Duration::from_secs(30),
            user: None,
            tls_root_cert: None,
            tls_client_cert: None,
            keep_alive_interval: Duration::from_secs(1),
        }
    }

    store_setters! {
        settings;
        /// On etcd it prefixes every key.
        fn namespace;
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

    store_setters! {
        settings;
        fn max_key_len;
        fn connect_timeout = "2 s";
        /// A call that no member can take (the leader failed, and the others elect
        /// another: one to two seconds with etcd's defaults, from the leader's last
        /// heartbeat to the new leader's first) goes round the members again until this
        /// bound, so that it waits the election out; etcdctl's own default. Set it above
        /// the cluster's election timeout plus a second.
        fn command_timeout = "5 s";
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
            .with_connect_timeout(self.settings.connect_timeout)
            .with_keep_alive(self.keep_alive_interval, self.settings.command_timeout)
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
        // While it connects, a call goes round the members within the connect timeout, so
        // that what failed is told before `build()` gives up.
        let connecting = self
            .settings
            .command_timeout
            .min(self.settings.connect_timeout);
        let members = Arc::new(Members::new(endpoints, options, connecting));
        let parts = self.settings.parts();
        let ttl =
            i64::try_from(self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0))
                .unwrap_or(i64::MAX);
        let granting = Lease::grant(members.clone(), ttl, parts.recheck.clone());
        let lease = match timeout(self.settings.connect_timeout, granting).await {
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
        let probing = probe(&members, &self.settings.namespace);
        match timeout(self.settings.connect_timeout, probing).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(self.refused(&addr, e)),
            Err(_) => return Err(timed_out(&addr)),
        }
        members.set_command_timeout(self.settings.command_timeout);
        let listener = Listener::spawn(
            Wakeups::new(parts.metrics.clone()),
            WatchConfig {
                members: members.clone(),
                prefix: namespace_prefix(&self.settings.namespace),
                connect_timeout: self.settings.connect_timeout,
                max_backoff: self.settings.max_backoff,
            },
            parts.recheck.clone(),
            parts.shutdown.clone(),
            &parts.runtime,
        );
        let keeper = {
            let (lease, command_timeout) = (lease.clone(), self.settings.command_timeout);
            Daemon::spawn(
                move |shutdown| keep_alive_until_shutdown(lease.clone(), command_timeout, shutdown),
                &parts.runtime,
                parts.shutdown.clone(),
            )
        };
        let orphans = Arc::new(Orphans::default());
        let sweeper = {
            let (orphans, members) = (orphans.clone(), members.clone());
            Daemon::spawn(
                move |shutdown| sweep_until_shutdown(orphans.clone(), members.clone(), shutdown),
                &parts.runtime,
                parts.shutdown.clone(),
            )
        };
        let store = EtcdStore {
            members,
            lease,
            listener,
            keeper,
            orphans,
            sweeper,
            namespace: self.settings.namespace,
            max_key_len: self.settings.max_key_len,
            acquisitions: std::sync::atomic::AtomicU64::new(0),
        };
        Ok(EtcdBackend {
            inner: Core::new(store, parts),
        })
    }
}

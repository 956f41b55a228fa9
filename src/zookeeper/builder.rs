//! [`ZooKeeperBackendBuilder`]: the settings, and `build`: open the backend's session,
//! prove the namespace's node, start following the session.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zookeeper_client::{Client, CreateMode, Error as ClientError};

use super::ZooKeeperBackend;
use super::error::ZkError;
use super::keys::{hold_prefix, root};
use super::records::{self, Shelf};
use super::session::{self, Connect, Digest, Session};
use super::store::ZkStore;
use crate::core::Core;
use crate::core::kit::settings::{StoreSettings, refuse_under_a_second, store_setters};
use crate::core::runtime::janitor;
use crate::core::wakeups::Wakeups;
use crate::error::{BuildError, ConnectFailure};

/// How often the janitor sweeps expired idempotency records: the buckets known to hold
/// some, and one more in turn.
const SWEEP_PERIOD: Duration = Duration::from_secs(5);

/// Configures a [`ZooKeeperBackend`]; created by [`ZooKeeperBackend::builder`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct ZooKeeperBackendBuilder {
    hosts: String,
    settings: StoreSettings,
    digest: Option<Digest>,
    session_timeout: Duration,
}

impl ZooKeeperBackendBuilder {
    pub(super) fn new(hosts: String) -> Self {
        ZooKeeperBackendBuilder {
            hosts,
            // Tokens are zxids: none can be set aside for a run in memory.
            settings: StoreSettings::new(Duration::from_secs(2))
                .with_command_timeout(Duration::from_secs(5))
                .without_handoffs(),
            digest: None,
            session_timeout: Duration::from_secs(10),
        }
    }

    store_setters! {
        settings;
        /// On ZooKeeper it names the node under which every lock lives (`/tower-lock` by
        /// default, created at build if missing), which must not be `.` or `..` either.
        fn namespace;
    }

    /// Authenticates every session of the backend as `user` with `password` (ZooKeeper's
    /// built-in `digest` scheme, `addauth digest user:password`), and creates every node
    /// with the ACL `creator_all`: only sessions of that identity (the instances of the
    /// service, configured alike) may read, write or delete the locks' nodes. Without it,
    /// nodes are created open to anyone (`world:anyone`).
    ///
    /// ZooKeeper accepts any digest identity, so a wrong password is not refused as such:
    /// it is another identity, which `build()` refuses when the namespace's node belongs
    /// to the right one (it cannot create nodes under it). Refused at build: an empty user,
    /// or one containing `:`. Use TLS or a trusted network: the digest scheme sends the
    /// password in clear on a plain connection.
    pub fn digest(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.digest = Some(Digest {
            user: user.into(),
            password: password.into(),
        });
        self
    }

    /// The session timeout asked of the ensemble (default 10 s; the servers bound it to
    /// between 2 and 20 of their ticks). Every hold of the backend is a node of its
    /// session: a process that stops (or is cut off from the ensemble) loses its holds at
    /// most this long after it was last heard. A holder's own deadline is half the
    /// negotiated timeout from its last renewal, which is the lease every request gets
    /// whatever it asks for (see [`ZooKeeperBackend`]).
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    store_setters! {
        settings;
        fn max_key_len;
        /// On ZooKeeper it bounds opening a session.
        fn connect_timeout = "2 s";
        /// A call whose connection is lost waits within it while the client moves the
        /// session to another server, and while the ensemble elects a leader (a few
        /// seconds with ZooKeeper's defaults, from the old leader's last word to the
        /// new leader serving); an acquisition tries again within its wait. Set it above
        /// the ensemble's election time plus the client's connection timeout.
        fn command_timeout = "5 s";
    }

    /// Opens the backend's session (which proves the hosts), checks the chroot of the
    /// connection string, creates the namespace's node if missing and proves the right to
    /// create and delete nodes under it, then starts following the session. Must be
    /// called inside a Tokio runtime.
    ///
    /// Refused with the cause: no host, a host without a port, no server reachable in
    /// time, a chroot that does not exist, a namespace node the session may not write
    /// under.
    pub async fn build(self) -> Result<ZooKeeperBackend, BuildError> {
        let root = self.validate()?;
        let addr = self.hosts.clone();
        let connect = Connect {
            hosts: self.hosts.clone(),
            session_timeout: self.session_timeout,
            connect_timeout: self.settings.connect_timeout,
            digest: self.digest.clone(),
        };
        let client = connect.open().await.map_err(|e| refused(&addr, e))?;
        let shelf = Arc::new(Shelf::new(&root));
        self.prove(&client, &root, connect.acls(), &shelf)
            .await
            .map_err(|e| e.unwrap_or_else(|e| refused(&addr, e)))?;
        let parts = self.settings.parts();
        let session = Arc::new(Session::new(
            connect,
            client,
            parts.recheck.clone(),
            (parts.shutdown.clone(), parts.runtime.clone()),
        ));
        let listener = session::follow(
            session.clone(),
            Wakeups::new(parts.metrics.clone()),
            self.settings.max_backoff,
            (parts.shutdown.clone(), &parts.runtime),
        );
        let janitor = {
            let (session, shelf) = (session.clone(), shelf.clone());
            let sweep: janitor::Sweep = Box::new(move |_, _| {
                let (session, shelf) = (session.clone(), shelf.clone());
                Box::pin(async move {
                    let client = session.client();
                    shelf.sweep(client).await.map_err(|e| e.to_string())
                })
            });
            janitor::spawn(
                sweep,
                SWEEP_PERIOD * 4,
                parts.shutdown.clone(),
                &parts.runtime,
            )
        };
        let store = ZkStore {
            session,
            listener,
            watched: Arc::new(Mutex::new(HashSet::new())),
            namespace: self.settings.namespace,
            root,
            max_key_len: self.settings.max_key_len,
            shelf,
            janitor,
        };
        Ok(ZooKeeperBackend {
            inner: Core::new(store, parts),
        })
    }

    /// The settings checked, and the namespace's node.
    fn validate(&self) -> Result<String, BuildError> {
        self.settings.validate()?;
        let root = root(&self.settings.namespace).ok_or_else(|| BuildError::Namespace {
            namespace: self.settings.namespace.clone(),
        })?;
        let refuse = |name, reason| Err(BuildError::Setting { name, reason });
        let (hosts, _chroot) = self
            .hosts
            .split_once('/')
            .unwrap_or((self.hosts.as_str(), ""));
        if hosts.trim().is_empty() {
            return refuse(
                "hosts",
                "at least one ZooKeeper server (host:port) is needed",
            );
        }
        for host in hosts.split(',') {
            let port = host
                .trim()
                .rsplit_once(':')
                .map(|(h, p)| (h, p.parse::<u16>()));
            if !matches!(port, Some((h, Ok(_))) if !h.is_empty()) {
                return Err(BuildError::Url {
                    source: format!(
                        "`{host}` is not a ZooKeeper server: it needs a host and a port \
                         (zk-1:2181)"
                    )
                    .into(),
                });
            }
        }
        if let Some(Digest { user, .. }) = &self.digest {
            if user.is_empty() || user.contains(':') {
                return refuse(
                    "digest",
                    "the user must be non-empty and must not contain `:`",
                );
            }
        }
        refuse_under_a_second("session_timeout", self.session_timeout)?;
        Ok(root)
    }

    /// Checks the chroot, creates the namespace's node if missing, creates and deletes a
    /// node under it, creates the records' node if missing and reads the ensemble's clock
    /// by a write to it, every node with `acls`: `Err(Ok(_))` names what is wrong,
    /// `Err(Err(_))` is a failed call.
    async fn prove(
        &self,
        client: &Client,
        root: &str,
        acls: zookeeper_client::Acls<'static>,
        shelf: &Shelf,
    ) -> Result<(), Result<BuildError, ZkError>> {
        let call = |e: ClientError| Err(ZkError::Client(e));
        if client.check_stat("/").await.map_err(call)?.is_none() {
            return Err(Ok(BuildError::Setting {
                name: "hosts",
                reason: "the chroot of the connection string does not exist in ZooKeeper \
                         (create its node first)",
            }));
        }
        let rights = |e: ClientError| match e {
            ClientError::NoAuth => Ok(BuildError::Rights {
                user: self
                    .digest
                    .as_ref()
                    .map_or_else(String::new, |digest| digest.user.clone()),
                right: format!(
                    "create and delete nodes under `{root}` ({})",
                    if self.digest.is_some() {
                        "its ACL names another identity: check the digest user and password"
                    } else {
                        "its ACL asks for an identity: see `digest`"
                    }
                ),
                addr: self.hosts.clone(),
                source: Box::new(e),
            }),
            e => Err(ZkError::Client(e)),
        };
        let persistent = CreateMode::Persistent.with_acls(acls);
        match client.create(root, &[], &persistent).await {
            Ok(_) | Err(ClientError::NodeExists) => {}
            Err(e) => return Err(rights(e)),
        }
        let probe = format!("{root}/{}probe", hold_prefix(client.session_id().0));
        let ephemeral = CreateMode::Ephemeral.with_acls(acls);
        client
            .create(&probe, &[], &ephemeral)
            .await
            .map_err(rights)?;
        client.delete(&probe, None).await.map_err(rights)?;
        records::prepare(client, shelf, acls)
            .await
            .map_err(rights)?;
        match shelf.tick(client).await {
            Ok(_) => Ok(()),
            Err(ZkError::Client(e)) => Err(rights(e)),
            Err(e) => Err(Err(e)),
        }
    }
}

/// What a failed session or first call says, as a build error.
fn refused(addr: &str, e: ZkError) -> BuildError {
    let failure = match &e {
        ZkError::Client(ClientError::NoHosts) => ConnectFailure::Refused,
        ZkError::Client(ClientError::Timeout) => ConnectFailure::TimedOut,
        ZkError::Client(ClientError::ConnectionLoss) => ConnectFailure::Closed,
        _ => ConnectFailure::Other,
    };
    BuildError::Connect {
        addr: addr.to_owned(),
        failure,
        source: Box::new(e),
    }
}

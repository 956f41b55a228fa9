//! TLS: the builder's certificates, the clients they make, and telling a failed handshake
//! from other connection failures.
//!
//! redis-rs builds a rustls `ClientConfig` for every TLS connection, and rustls panics there
//! when it cannot tell which crypto provider to use (none installed and both ring and
//! aws-lc-rs compiled in, as another crate in the build may arrange). So before making a TLS
//! client the crate installs ring as the process default, unless the application installed
//! a provider already (then that one is used).

use std::error::Error as StdError;
use std::fmt;

#[cfg(feature = "tls")]
use super::pool::CommandError;
use crate::error::BuildError;

/// Certificates for `rediss://` connections beyond the system roots. Kept by the builder so
/// that every client of every topology (each Sentinel, each cluster node) is made with them.
#[derive(Clone, Default)]
pub(crate) struct TlsSettings {
    /// PEM certificates to trust instead of the system roots.
    pub(crate) root_cert: Option<Vec<u8>>,
    /// PEM certificate chain and private key presented to servers that ask for one.
    pub(crate) client_cert: Option<(Vec<u8>, Vec<u8>)>,
}

// Certificates and keys are never printed.
impl fmt::Debug for TlsSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsSettings")
            .field("root_cert", &self.root_cert.as_ref().map(|_| "<set>"))
            .field("client_cert", &self.client_cert.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// Whether `url` asks for TLS (`rediss://`).
pub(crate) fn is_tls_url(url: &str) -> bool {
    url.trim_start()
        .get(..9)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("rediss://"))
}

impl TlsSettings {
    pub(crate) fn is_empty(&self) -> bool {
        self.root_cert.is_none() && self.client_cert.is_none()
    }

    /// A client for `url` with these settings: verified against the system roots, or the
    /// root certificate given, presenting the client certificate given.
    pub(crate) fn client(&self, url: &str) -> Result<redis::Client, BuildError> {
        let tls = is_tls_url(url);
        if !tls && !self.is_empty() {
            return Err(refused(
                "TLS certificates were given for a `redis://` URL; TLS needs `rediss://`",
            ));
        }
        let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(url_error)?;
        if tls || !self.is_empty() {
            return self.tls_client(info);
        }
        redis::Client::open(info).map_err(url_error)
    }

    /// A client of the cluster node at `host:port` with the credentials and TLS settings of
    /// the cluster's seed URL `seed` (a node the slot map names, not among the seeds).
    pub(crate) fn node_client(
        &self,
        seed: &str,
        host: &str,
        port: u16,
    ) -> Result<redis::Client, BuildError> {
        let info = redis::IntoConnectionInfo::into_connection_info(seed).map_err(url_error)?;
        // A node that does not know its own address announces an empty host: it is the
        // seed's then, as redis-rs reads the slot map.
        let host = match info.addr() {
            redis::ConnectionAddr::Tcp(seed_host, _)
            | redis::ConnectionAddr::TcpTls {
                host: seed_host, ..
            } if host.is_empty() => seed_host.clone(),
            _ => host.to_owned(),
        };
        let addr = match info.addr() {
            redis::ConnectionAddr::TcpTls { insecure, .. } => redis::ConnectionAddr::TcpTls {
                host: host.clone(),
                port,
                insecure: *insecure,
                tls_params: None,
            },
            _ => redis::ConnectionAddr::Tcp(host, port),
        };
        self.node(info.set_addr(addr))
    }

    /// A client of the node `info` describes (its address, credentials and database, as
    /// the seed's or the master's), over TLS with these settings when its address is TLS.
    pub(crate) fn node(&self, info: redis::ConnectionInfo) -> Result<redis::Client, BuildError> {
        if matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) || !self.is_empty() {
            return self.tls_client(info);
        }
        redis::Client::open(info).map_err(url_error)
    }

    /// Checks these settings against a cluster's seed URLs as [`client`](Self::client)
    /// does against one server's, and readies rustls when a seed asks for TLS.
    pub(crate) fn check_cluster(&self, nodes: &[String]) -> Result<(), BuildError> {
        let tls = nodes.iter().any(|url| is_tls_url(url));
        if !tls && !self.is_empty() {
            return Err(refused(
                "TLS certificates were given for `redis://` seed URLs; TLS needs `rediss://`",
            ));
        }
        if !tls {
            return Ok(());
        }
        #[cfg(feature = "tls")]
        {
            install_crypto_provider();
            self.check_root_cert()
        }
        #[cfg(not(feature = "tls"))]
        Err(refused(
            "`rediss://` URLs and TLS certificates need the crate's `tls` feature",
        ))
    }

    /// Checks these settings against the sentinel URLs, and readies rustls when they ask
    /// for TLS. Returns whether they do: then the sentinels and the master they name are
    /// all reached over TLS, with these certificates.
    pub(crate) fn check_sentinel(&self, sentinels: &[String]) -> Result<bool, BuildError> {
        let tls = sentinels.iter().filter(|url| is_tls_url(url)).count();
        if tls != 0 && tls != sentinels.len() {
            return Err(refused(
                "the sentinel URLs mix `redis://` and `rediss://`: TLS is on for the whole \
                 deployment (the sentinels and the master) or off",
            ));
        }
        // Certificates without TLS URLs are refused, as for a cluster's seeds.
        self.check_cluster(sentinels)?;
        Ok(tls != 0)
    }

    /// The certificates for redis-rs, when any were given.
    #[cfg(feature = "tls")]
    pub(crate) fn certificates(&self) -> Option<redis::TlsCertificates> {
        if self.is_empty() {
            return None;
        }
        Some(redis::TlsCertificates {
            client_tls: self.client_cert.clone().map(|(client_cert, client_key)| {
                redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                }
            }),
            root_cert: self.root_cert.clone(),
        })
    }

    #[cfg(feature = "tls")]
    fn check_root_cert(&self) -> Result<(), BuildError> {
        if let Some(pem) = &self.root_cert {
            use rustls::pki_types::CertificateDer;
            use rustls::pki_types::pem::PemObject;
            if CertificateDer::pem_slice_iter(pem).next().is_none() {
                return Err(refused("`tls_root_cert` holds no PEM certificate"));
            }
        }
        Ok(())
    }

    #[cfg(feature = "tls")]
    fn tls_client(&self, info: redis::ConnectionInfo) -> Result<redis::Client, BuildError> {
        install_crypto_provider();
        if self.is_empty() {
            return redis::Client::open(info).map_err(|e| BuildError::Url {
                source: Box::new(e),
            });
        }
        self.check_root_cert()?;
        let certificates = self.certificates().unwrap_or(redis::TlsCertificates {
            client_tls: None,
            root_cert: None,
        });
        redis::Client::build_with_tls(info, certificates).map_err(|e| BuildError::Tls {
            reason: "the TLS certificates or key given to the builder are invalid",
            addr: None,
            certificate: None,
            source: Some(CommandError::Redis(e).into_cause()),
        })
    }

    #[cfg(not(feature = "tls"))]
    fn tls_client(&self, _info: redis::ConnectionInfo) -> Result<redis::Client, BuildError> {
        Err(refused(
            "`rediss://` URLs and TLS certificates need the crate's `tls` feature",
        ))
    }
}

fn url_error(error: redis::RedisError) -> BuildError {
    BuildError::Url {
        source: Box::new(error),
    }
}

fn refused(reason: &'static str) -> BuildError {
    BuildError::tls_settings(reason)
}

/// Makes ring the process's rustls crypto provider unless one is installed already.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // An error means another thread installed one first: that one is used, as the
        // application's own choice would be.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// What went wrong in a failed TLS handshake.
pub(crate) struct Handshake {
    /// What the server did, as a predicate of "the server at ADDR" (see
    /// [`BuildError::Tls`]).
    pub(crate) reason: &'static str,
    /// rustls' name of the certificate problem, when the certificate failed verification.
    pub(crate) certificate: Option<String>,
}

/// The reason of a handshake the server answered with something that is not TLS: a
/// plaintext server's error reply to the TLS hello, which `diagnose.rs` can confirm.
pub(crate) const NOT_TLS_LIKE: &str = "answered the TLS handshake with something that is not TLS";

/// What went wrong in a TLS handshake, if `error` (or one of its causes) is a TLS error.
#[cfg(feature = "tls")]
pub(crate) fn handshake_failure(error: &(dyn StdError + 'static)) -> Option<Handshake> {
    let mut level = Some(error);
    while let Some(e) = level {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            let failed = |reason| Handshake {
                reason,
                certificate: None,
            };
            return Some(match tls {
                rustls::Error::InvalidCertificate(problem) => Handshake {
                    certificate: Some(certificate_problem(problem)),
                    ..failed("presented a TLS certificate that failed verification")
                },
                rustls::Error::AlertReceived(_) => failed(
                    "refused the TLS handshake (does it require a client certificate, or one \
                     it trusts?)",
                ),
                rustls::Error::InvalidMessage(_) => failed(NOT_TLS_LIKE),
                _ => failed("failed the TLS handshake"),
            });
        }
        // `source` skips the error an `io::Error` wraps, and a `RedisError`'s source is
        // the `Arc` it keeps its cause in: look inside both.
        level = if let Some(io) = e.downcast_ref::<std::io::Error>() {
            io.get_ref().map(|inner| inner as &(dyn StdError + 'static))
        } else if let Some(shared) = e.downcast_ref::<std::sync::Arc<dyn StdError + Send + Sync>>()
        {
            Some(&**shared as &(dyn StdError + 'static))
        } else {
            e.source()
        };
    }
    None
}

/// rustls' name of a certificate problem, without the details some variants carry (the
/// names a certificate lists, its validity dates): those are in the cause.
#[cfg(feature = "tls")]
fn certificate_problem(problem: &rustls::CertificateError) -> String {
    use rustls::CertificateError as E;
    let name = match problem {
        E::UnknownIssuer => "UnknownIssuer",
        E::BadSignature => "BadSignature",
        E::NotValidForName | E::NotValidForNameContext { .. } => "NotValidForName",
        E::Expired | E::ExpiredContext { .. } => "Expired",
        E::NotValidYet | E::NotValidYetContext { .. } => "NotValidYet",
        E::Revoked => "Revoked",
        E::InvalidPurpose | E::InvalidPurposeContext { .. } => "InvalidPurpose",
        // The variant's name is what rustls calls it.
        other => {
            let debug = format!("{other:?}");
            let end = debug.find([' ', '(', '{']).unwrap_or(debug.len());
            return debug[..end].to_owned();
        }
    };
    name.to_owned()
}

/// Without TLS support no handshake ever happens.
#[cfg(not(feature = "tls"))]
pub(crate) fn handshake_failure(_error: &(dyn StdError + 'static)) -> Option<Handshake> {
    None
}

//! What `build` checks before and while it connects: the settings, the endpoints, TLS,
//! the rights on the namespace, and what a refusal says.

use std::time::Duration;

use etcd_client::ConnectOptions;

use super::EtcdBackendBuilder;
use crate::core::kit::settings::refuse_zero;
use crate::error::{BuildError, ConnectFailure};
use crate::etcd::error::{code, status_code};
use crate::etcd::keys::namespace_prefix;
use crate::etcd::members::Members;

impl EtcdBackendBuilder {
    /// The settings checked, and the endpoints as etcd-client takes them.
    pub(super) fn validate(&self) -> Result<Vec<String>, BuildError> {
        self.settings.validate()?;
        let refuse = |name, reason| Err(BuildError::Setting { name, reason });
        if self.endpoints.is_empty() {
            return refuse(
                "endpoints",
                "at least one etcd endpoint (http://host:port) is needed",
            );
        }
        refuse_zero("keep_alive_interval", self.keep_alive_interval)?;
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
    pub(super) fn tls(&self, options: ConnectOptions) -> Result<ConnectOptions, BuildError> {
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
    pub(super) fn tls(&self, _options: ConnectOptions) -> Result<ConnectOptions, BuildError> {
        Err(BuildError::tls_settings(
            "https:// etcd endpoints need the crate's `tls` feature",
        ))
    }

    /// What a failed connect or first call says, as a build error.
    pub(super) fn refused(&self, addr: &str, e: etcd_client::Error) -> BuildError {
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
                    namespace_prefix(&self.settings.namespace)
                ),
                addr: addr.to_owned(),
                source: Box::new(e),
            };
        }
        let tls = addr.contains("https://");
        // rustls reading a plaintext server's answer, or the server closing on a
        // ClientHello (a reset when it closes with the hello unread).
        let closed = message.contains("tls handshake eof") || message.contains("onnection reset");
        if tls && (closed || message.contains("corrupt message")) {
            return BuildError::Tls {
                reason: "does not speak TLS (is it a plaintext port? use `http://`)",
                addr: Some(addr.to_owned()),
                certificate: None,
                source: Some(Box::new(e)),
            };
        }
        let failure = if message.contains("onnection refused") {
            ConnectFailure::Refused
        } else if !tls && message.contains("broken pipe") {
            // A TLS port drops the HTTP/2 preface it cannot read.
            ConnectFailure::ExpectsTls { scheme: "https://" }
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
pub(super) async fn probe(members: &Members, namespace: &str) -> Result<(), etcd_client::Error> {
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
    // It never writes.
    members.read(never).await.map(drop)
}

pub(super) fn timed_out(addr: &str) -> BuildError {
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

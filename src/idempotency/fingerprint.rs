//! What tells a retry from a different request under the same key: the request's
//! fingerprint, and the lock key a scope and an idempotency key make.

use http::header::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

/// SHA-256 of the method, the path and query, the chosen headers and the body, each
/// length-prefixed so that no two requests' fields run together into the same input.
/// Stable across processes and Rust versions (unlike std's hashers), since the instances
/// that compare it may run different builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint([u8; 32]);

impl Fingerprint {
    pub(crate) fn of(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Self {
        let mut hash = Sha256::new();
        let mut field = |bytes: &[u8]| {
            hash.update((bytes.len() as u64).to_be_bytes());
            hash.update(bytes);
        };
        field(parts.method.as_str().as_bytes());
        field(
            parts
                .uri
                .path_and_query()
                .map_or("", |p| p.as_str())
                .as_bytes(),
        );
        for name in headers {
            field(name.as_str().as_bytes());
            // Every value, in order; a header sent twice differs from one sent once.
            let values = parts.headers.get_all(name);
            field(&(values.iter().count() as u64).to_be_bytes());
            for value in values {
                field(value.as_bytes());
            }
        }
        field(body);
        Fingerprint(hash.finalize().into())
    }

    pub(crate) fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Fingerprint)
    }

    pub(crate) fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

/// The lock key of idempotency key `key` in scope `scope`: the scope's length first, so
/// that no scope and key can spell another pair's (`a:b` + `c` is not `a` + `b:c`), and
/// a client's key cannot reach another tenant's.
pub(crate) fn scoped_key(scope: &str, key: &str) -> String {
    format!("idempotency:{}:{scope}:{key}", scope.len())
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    fn parts(method: &str, uri: &str, header: Option<&str>) -> Parts {
        let mut request = Request::builder().method(method).uri(uri);
        if let Some(value) = header {
            request = request.header("x-account", value);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn each_part_of_the_request_changes_the_fingerprint() {
        let chosen = [HeaderName::from_static("x-account")];
        let base = Fingerprint::of(&parts("POST", "/pay?a=1", Some("x")), &chosen, b"{}");
        assert_eq!(
            base,
            Fingerprint::of(&parts("POST", "/pay?a=1", Some("x")), &chosen, b"{}")
        );
        for other in [
            Fingerprint::of(&parts("PUT", "/pay?a=1", Some("x")), &chosen, b"{}"),
            Fingerprint::of(&parts("POST", "/pay?a=2", Some("x")), &chosen, b"{}"),
            Fingerprint::of(&parts("POST", "/pay?a=1", Some("y")), &chosen, b"{}"),
            Fingerprint::of(&parts("POST", "/pay?a=1", None), &chosen, b"{}"),
            Fingerprint::of(&parts("POST", "/pay?a=1", Some("x")), &chosen, b"{ }"),
        ] {
            assert_ne!(base, other);
        }
        // A header nobody chose does not count.
        assert_eq!(
            Fingerprint::of(&parts("POST", "/pay", Some("x")), &[], b""),
            Fingerprint::of(&parts("POST", "/pay", None), &[], b"")
        );
    }

    #[test]
    fn scopes_and_keys_never_spell_each_other() {
        assert_ne!(scoped_key("a:b", "c"), scoped_key("a", "b:c"));
        assert_ne!(scoped_key("", "1:x"), scoped_key("1:x", ""));
    }
}

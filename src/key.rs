//! Keys from requests: [`KeyExtractor`] (also at the crate root), and the sealed traits
//! naming what a key closure may return ([`KeyOutcome`], [`OptionalKey`]).

// Key validation and namespacing, which every store shares, are here too.

use std::borrow::Cow;

use http::Request;

use crate::error::{BuildError, KeyError};

/// Extracts the lock key from a request.
///
/// Returning `Ok(None)` lets the request through without a lock; returning an error
/// rejects it with 400 before the backend is contacted. Most routes never name this
/// trait: a closure `Fn(&Request<B>) -> R` implements it when `R` is one of
///
/// | `R` | locks on | unlocked | refused with 400 |
/// |---|---|---|---|
/// | `Option<K>` | `Some(key)` | `None` | never |
/// | `Result<K, KeyError>` | `Ok(key)` | never | `Err(e)` |
/// | `Result<Option<K>, KeyError>` | `Ok(Some(key))` | `Ok(None)` | `Err(e)` |
/// | `Vec<K>` | every key, all or none (see [`lock_many`](crate::LockBackend::lock_many)) | never | an empty list, more than [`MAX_KEYS`](crate::lock::MAX_KEYS) different keys (a key given twice is taken once) |
/// | `Result<Vec<K>, KeyError>` | as `Vec<K>` | never | as `Vec<K>`, and `Err(e)` |
///
/// where `K: Into<String>` (in the `Result` shapes: `String`, `&str`, `Box<str>`
/// or `Cow<str>`). A route that must never run unlocked returns a `Result`, so
/// a missing header is refused instead of let through; [`KeyError::missing`] and
/// [`KeyError::malformed`] build the refusal with its reason, which the 400 body shows.
/// Ready-made extractors for path parameters, headers and query parameters are
/// [below](#ready-made-extractors).
///
/// ```
/// use axum::extract::Request;
/// use tower_lock::{KeyError, KeyExtractor};
///
/// let by_path = |req: &Request| req.uri().path().strip_prefix("/orders/").map(str::to_owned);
/// let tenant = |req: &Request| match req.headers().get("x-tenant") {
///     Some(v) => v.to_str().map(|t| format!("tenant:{t}")).map_err(|_| KeyError::malformed("x-tenant is not text")),
///     None => Err(KeyError::missing("header \"x-tenant\"")),
/// };
/// let req = Request::builder().uri("/orders/42").body(axum::body::Body::empty()).unwrap();
/// assert_eq!(by_path.extract(&req), Ok(Some("42".to_owned())));
/// assert_eq!(tenant.extract(&req), Err(KeyError::missing("header \"x-tenant\"")));
/// ```
///
///# Ready-made extractors
///
/// Ready-made key extractors for per-route locks: from a path parameter, a header or a
/// query parameter, each with an optional per-route prefix.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use tower_lock::KeyExtractor;
/// use tower_lock::{Header, QueryParam};
///
/// let by_cart = QueryParam::new("cart").prefix("cart");
/// let req = Request::get("/checkout?cart=7").body(Body::empty()).unwrap();
/// assert_eq!(by_cart.extract(&req), Ok(Some("cart:7".to_owned())));
///
/// // Required by default: a request without the header is rejected with 400.
/// let by_idempotency_key = Header::new("Idempotency-Key");
/// assert!(by_idempotency_key.extract(&req).is_err());
/// ```
///
/// On a router, add them with `route_layer` (or `layer`), which run after routing, so
/// that [`PathParam`](crate::PathParam) can see the route's parameters:
///
/// ```no_run
/// use axum::{Router, routing::post};
/// use tower_lock::{LockLayer, RedisBackend};
/// use tower_lock::{Header, PathParam};
///
/// # async fn run() -> Result<(), tower_lock::BuildError> {
/// let backend = RedisBackend::connect("redis://127.0.0.1:6379").await?;
/// let orders: Router = Router::new()
///     .route("/orders/{id}/pay", post(|| async { "paid" }))
///     .route("/orders/{id}/cancel", post(|| async { "cancelled" }))
///     // Both routes lock `order:{id}`: paying and cancelling one order exclude each other.
///     .route_layer(LockLayer::new(backend.clone(), PathParam::new("id").prefix("order")));
/// let refunds: Router = Router::new()
///     .route("/refunds/{id}", post(|| async { "refunded" }))
///     // `refund:{id}`: refund 42 does not wait for order 42.
///     .route_layer(LockLayer::new(backend.clone(), PathParam::new("id").prefix("refund")));
/// let payments: Router = Router::new()
///     .route("/payments", post(|| async { "accepted" }))
///     // A retried payment with the same key gets 409 while the first is running.
///     .route_layer(LockLayer::new(backend, Header::new("Idempotency-Key")).fail_fast());
/// let app = orders.merge(refunds).merge(payments);
/// # drop(app);
/// # Ok(())
/// # }
/// ```
///
/// Every extractor rejects a present but empty value with [`KeyError::Empty`] and input
/// that is not UTF-8 with [`KeyError::Malformed`]; the layer answers both with 400.
///
/// Give every route that takes its key from client input a prefix. Without one the client
/// chooses the whole key, and a header value of `order:42` would lock order 42 for the
/// routes keyed `PathParam::new("id").prefix("order")`.
pub trait KeyExtractor<B>: Clone + Send + Sync + 'static {
    /// Reads the key for `req`.
    fn extract(&self, req: &Request<B>) -> Result<Option<String>, KeyError>;

    /// Reads every key for `req`, for an extractor that may name several (the layer then
    /// takes them all or none, as [`lock_many`](crate::LockBackend::lock_many) does).
    /// `Ok(None)` runs the request unlocked; an empty list is refused with 400
    /// ([`KeyError::NoKeys`]); a key named twice is taken once. The layer calls this; the default reads
    /// the one key of [`extract`](Self::extract).
    fn extract_all(&self, req: &Request<B>) -> Result<Option<Vec<String>>, KeyError> {
        self.extract(req).map(|key| key.map(|key| vec![key]))
    }
}

// One blanket impl over the return type keeps closures' types inferred from their bodies;
// the shapes are told apart by `KeyOutcome`, which no user type can implement.
impl<B, F, R> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> R + Clone + Send + Sync + 'static,
    R: KeyOutcome,
{
    fn extract(&self, req: &Request<B>) -> Result<Option<String>, KeyError> {
        self(req).into_key()
    }

    fn extract_all(&self, req: &Request<B>) -> Result<Option<Vec<String>>, KeyError> {
        self(req).into_keys()
    }
}

impl KeyError {
    /// A refusal because the input that carries the key is absent; `source` names it, for
    /// example `header "x-tenant"` (the 400 body reads "the request has no {source}").
    pub fn missing(source: impl Into<String>) -> Self {
        KeyError::Missing {
            source: source.into(),
        }
    }

    /// A refusal because the input that carries the key is unusable; `reason` says why in
    /// words a client can act on, and is shown in the 400 body.
    pub fn malformed(reason: impl Into<String>) -> Self {
        KeyError::Malformed {
            reason: reason.into(),
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// What a key closure may return: `Option<K>`, `Result<K, KeyError>` or
/// `Result<Option<K>, KeyError>` (see [`KeyExtractor`]). Sealed.
pub trait KeyOutcome: sealed::Sealed {
    /// The key, `None` to run unlocked, or the reason to refuse the request.
    fn into_key(self) -> Result<Option<String>, KeyError>;

    /// Every key, `None` to run unlocked, or the reason to refuse the request.
    fn into_keys(self) -> Result<Option<Vec<String>>, KeyError>
    where
        Self: Sized,
    {
        self.into_key().map(|key| key.map(|key| vec![key]))
    }
}

/// A key or no key, as a `Result`'s success value. A separate trait from `Into<String>`
/// because `Result<K, _>` and `Result<Option<K>, _>` would overlap under it for the
/// coherence checker (std may one day add `From<Option<_>> for String`).
pub trait OptionalKey: sealed::Sealed {
    /// The key, or `None` to run unlocked.
    fn into_optional_key(self) -> Option<String>;
}

impl<K: Into<String>> sealed::Sealed for Option<K> {}
impl<K: Into<String>> OptionalKey for Option<K> {
    fn into_optional_key(self) -> Option<String> {
        self.map(Into::into)
    }
}

macro_rules! key_types {
    ($($ty:ty),*) => {$(
        impl sealed::Sealed for $ty {}
        impl OptionalKey for $ty {
            fn into_optional_key(self) -> Option<String> {
                Some(self.into())
            }
        }
    )*};
}
key_types!(String, &str, Box<str>, Cow<'_, str>);

impl<K: Into<String>> KeyOutcome for Option<K> {
    fn into_key(self) -> Result<Option<String>, KeyError> {
        Ok(self.into_optional_key())
    }
}

impl<K: OptionalKey> sealed::Sealed for Result<K, KeyError> {}
impl<K: OptionalKey> KeyOutcome for Result<K, KeyError> {
    fn into_key(self) -> Result<Option<String>, KeyError> {
        self.map(OptionalKey::into_optional_key)
    }
}

/// Several keys, locked all or none (see [`KeyExtractor::extract_all`]). As one key
/// ([`KeyExtractor::extract`]), a list of one is that key and a longer one is refused.
impl<K: Into<String>> sealed::Sealed for Vec<K> {}
impl<K: Into<String>> KeyOutcome for Vec<K> {
    fn into_key(self) -> Result<Option<String>, KeyError> {
        one_of(self.into_keys()?)
    }

    fn into_keys(self) -> Result<Option<Vec<String>>, KeyError> {
        Ok(Some(self.into_iter().map(Into::into).collect()))
    }
}

impl<K: Into<String>> sealed::Sealed for Result<Vec<K>, KeyError> {}
impl<K: Into<String>> KeyOutcome for Result<Vec<K>, KeyError> {
    fn into_key(self) -> Result<Option<String>, KeyError> {
        one_of(self?.into_keys()?)
    }

    fn into_keys(self) -> Result<Option<Vec<String>>, KeyError> {
        self?.into_keys()
    }
}

/// The one key of `keys`, for a caller that asked for one.
fn one_of(keys: Option<Vec<String>>) -> Result<Option<String>, KeyError> {
    match keys {
        Some(mut keys) if keys.len() <= 1 => keys.pop().map(Some).ok_or(KeyError::NoKeys),
        Some(keys) => Err(KeyError::TooManyKeys {
            count: keys.len(),
            max: 1,
        }),
        None => Ok(None),
    }
}

pub(crate) fn validate(key: &str, max_len: usize) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > max_len {
        return Err(KeyError::TooLong {
            len: key.len(),
            max: max_len,
        });
    }
    if key.chars().any(char::is_control) {
        return Err(KeyError::ControlCharacter);
    }
    Ok(())
}

/// Refuses a namespace that is empty or holds `{`, `}` or a control character (see
/// [`namespaced`]).
pub(crate) fn validate_namespace(namespace: &str) -> Result<(), BuildError> {
    if namespace.is_empty()
        || namespace.contains(['{', '}'])
        || namespace.contains(char::is_control)
    {
        return Err(BuildError::Namespace {
            namespace: namespace.to_owned(),
        });
    }
    Ok(())
}

/// The store name of `key` in `namespace`: `namespace:{key}`, with the braces and `%` of
/// the key percent-escaped, so that the mapping from (namespace, key) to name is one-to-one
/// (a namespace has no braces), no key can reach outside its namespace, and the braces are
/// a Redis Cluster hash tag covering the key alone.
pub(crate) fn namespaced(namespace: &str, key: &str) -> String {
    let mut out = String::with_capacity(namespace.len() + key.len() + 3);
    out.push_str(namespace);
    out.push_str(":{");
    for c in key.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out.push('}');
    out
}

/// The key whose escaped form, the text between the braces of [`namespaced`], is
/// `escaped`: `%25`, `%7B` and `%7D` back to `%`, `{` and `}`. `None` for a text
/// `namespaced` never writes (a brace, a `%` that starts none of those three escapes).
pub(crate) fn unescape(escaped: &str) -> Option<String> {
    let mut key = String::with_capacity(escaped.len());
    let mut rest = escaped;
    while let Some(at) = rest.find(['%', '{', '}']) {
        key.push_str(&rest[..at]);
        key.push(match rest.get(at..at + 3)? {
            "%25" => '%',
            "%7B" => '{',
            "%7D" => '}',
            _ => return None,
        });
        rest = &rest[at + 3..];
    }
    key.push_str(rest);
    Some(key)
}

/// The inverse of [`namespaced`]: the key whose store name in `namespace` `name` begins
/// with, and what follows that name's closing brace. `None` when `name` begins with no
/// name [`namespaced`] gives in `namespace`: another namespace's, a brace left unescaped, a
/// `%` that begins none of its escapes.
pub(crate) fn split_namespaced<'a>(namespace: &str, name: &'a str) -> Option<(String, &'a str)> {
    let escaped = name.strip_prefix(namespace)?.strip_prefix(":{")?;
    // An escaped key has no brace: the first one closes it.
    let (escaped, rest) = escaped.split_once('}')?;
    Some((unescape(escaped)?, rest))
}

/// A stable 64-bit FNV-1a hash of `name`, the same in every process and build (instances
/// of several versions share a store): the SQL stores' short channel names.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn fnv1a(name: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    name.bytes().fold(OFFSET, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braces_cannot_move_the_hash_tag_and_escaping_is_one_to_one() {
        assert_eq!(namespaced("ns", "a}b{c"), "ns:{a%7Db%7Bc}");
        assert_ne!(namespaced("ns", "%7B"), namespaced("ns", "{"));
    }

    #[test]
    fn a_namespaced_name_gives_back_its_key_and_what_follows() {
        for key in [
            "a}b{c",
            "%7B",
            "{",
            "%",
            "ordér:空",
            "a*b?_[1]\\",
            "}:permits",
        ] {
            let name = format!("{}/h1", namespaced("ns", key));
            assert_eq!(split_namespaced("ns", &name), Some((key.to_owned(), "/h1")));
        }
        let semaphore = format!("{}:permits/p1", namespaced("ns", "k"));
        assert_eq!(
            split_namespaced("ns", &semaphore),
            Some(("k".to_owned(), ":permits/p1"))
        );
        // Another namespace's, or a name escaped otherwise than `namespaced` escapes.
        for name in [
            "ns2:{a}", "n:{a}", "ns{a}", "ns:{a", "ns:{a{b}", "ns:{%7b}", "ns:{%2}", "ns:{%41}",
        ] {
            assert_eq!(split_namespaced("ns", name), None, "{name}");
        }
    }

    #[test]
    fn unescaping_inverts_the_escapes_and_refuses_what_they_never_write() {
        for key in ["order:1", "a}b{c", "%7B", "%%", "é空%{}", ""] {
            let name = namespaced("ns", key);
            let escaped = &name["ns:{".len()..name.len() - 1];
            assert_eq!(unescape(escaped).as_deref(), Some(key), "{name}");
        }
        for never in ["a{b", "a}b", "%", "%2", "%7b", "%41", "a%é1"] {
            assert_eq!(unescape(never), None, "{never:?}");
        }
    }

    #[test]
    fn empty_long_and_control_keys_are_rejected() {
        assert_eq!(validate("", 8), Err(KeyError::Empty));
        assert_eq!(
            validate("123456789", 8),
            Err(KeyError::TooLong { len: 9, max: 8 })
        );
        assert_eq!(validate("a\nb", 8), Err(KeyError::ControlCharacter));
        assert_eq!(validate("ordér", 8), Ok(()));
    }
}

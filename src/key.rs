//! Pulling a lock key out of a request, and turning it into Redis names safely.
//!
//! Any `Fn(&Request<B>) -> Option<impl Into<String>>` closure is a [`KeyExtractor`]:
//! `Some(key)` locks the request, `None` lets it through unlocked. Ready-made extractors
//! for path parameters, headers and query parameters are in [`extract`](crate::extract).
//!
//! ```
//! use axum::extract::Request;
//! use tower_lock::KeyExtractor;
//!
//! let by_path = |req: &Request| req.uri().path().strip_prefix("/orders/").map(str::to_owned);
//! let req = Request::builder().uri("/orders/42").body(axum::body::Body::empty()).unwrap();
//! assert_eq!(by_path.extract(&req), Ok(Some("42".to_owned())));
//! ```

use std::sync::Arc;

use http::Request;

use crate::error::KeyError;

/// Extracts the lock key from a request.
///
/// Returning `Ok(None)` lets the request through without a lock; returning an error
/// rejects it with 400 before Redis is contacted. Closures returning
/// `Option<impl Into<String>>` implement this trait, so most routes never name it.
pub trait KeyExtractor<B>: Clone + Send + Sync + 'static {
    /// Reads the key for `req`.
    fn extract(&self, req: &Request<B>) -> Result<Option<String>, KeyError>;
}

impl<B, F, K> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> Option<K> + Clone + Send + Sync + 'static,
    K: Into<String>,
{
    fn extract(&self, req: &Request<B>) -> Result<Option<String>, KeyError> {
        Ok(self(req).map(Into::into))
    }
}

/// The Redis names that belong to one user key.
///
/// The user key is escaped and wrapped in a hash tag, `namespace:{key}`, so the lock hash,
/// its fencing counter and its release channel always hash to one cluster slot, and no
/// user input can close the tag early or reach outside the namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LockKey {
    /// The key as the application gave it (for errors, spans and `HeldLock::key`).
    pub(crate) user: String,
    /// The lock hash: `owner -> reentry count`, plus the token field.
    pub(crate) lock: Arc<str>,
    /// The fencing counter, kept apart from the lock so tokens survive its deletion.
    pub(crate) fence: String,
    /// The channel a release is published on.
    pub(crate) channel: String,
}

impl LockKey {
    pub(crate) fn new(namespace: &str, user: String, max_len: usize) -> Result<Self, KeyError> {
        validate(&user, max_len)?;
        let tagged = format!("{namespace}:{{{}}}", escape(&user));
        Ok(LockKey {
            fence: format!("{tagged}:fence"),
            channel: format!("{tagged}:released"),
            lock: tagged.into(),
            user,
        })
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

/// Percent-escapes the characters that would change the hash tag (`{`, `}`) and the escape
/// character itself, so that the mapping from user key to Redis key stays one-to-one.
fn escape(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for c in key.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braces_cannot_move_the_hash_tag() {
        let k = LockKey::new("ns", "a}b{c".into(), 64).unwrap();
        assert_eq!(&*k.lock, "ns:{a%7Db%7Bc}");
        assert_eq!(k.channel, "ns:{a%7Db%7Bc}:released");
    }

    #[test]
    fn escaping_is_one_to_one() {
        let a = LockKey::new("ns", "%7B".into(), 64).unwrap();
        let b = LockKey::new("ns", "{".into(), 64).unwrap();
        assert_ne!(a.lock, b.lock);
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

//! Pulling a lock key out of a request, and validating it.
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

#[cfg(test)]
mod tests {
    use super::*;

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

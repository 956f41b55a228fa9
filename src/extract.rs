//! Ready-made key extractors: a path parameter, a header or a query parameter.

use std::fmt;
use std::sync::Arc;

use http::{HeaderName, Request};

use crate::error::KeyError;
use crate::key::KeyExtractor;

/// A per-route prefix, joined to the extracted value with `:`.
#[derive(Debug, Clone, Default)]
struct Prefix(Option<Arc<str>>);

impl Prefix {
    /// # Panics
    ///
    /// If `prefix` is empty or contains `:` or a control character. With `:` ruled out, the
    /// first `:` of a key always ends its prefix, so no value can make the key of one
    /// prefixed route equal that of a route with another prefix.
    fn new(prefix: &str) -> Self {
        assert!(
            !prefix.is_empty() && !prefix.contains(|c: char| c == ':' || c.is_control()),
            "a key prefix must be non-empty and must not contain ':' or control characters \
             (got {prefix:?})"
        );
        Prefix(Some(prefix.into()))
    }

    /// Prefixes `value`, rejecting an empty one first: a prefix must not turn "no key"
    /// into a valid key such as `order:`.
    fn apply(&self, value: &str) -> Result<Option<String>, KeyError> {
        if value.is_empty() {
            return Err(KeyError::Empty);
        }
        Ok(Some(match &self.0 {
            Some(prefix) => format!("{prefix}:{value}"),
            None => value.to_owned(),
        }))
    }
}

/// The builder methods every extractor shares.
macro_rules! builder_methods {
    ($ty:ident) => {
        impl $ty {
            /// Locks `prefix:value` instead of `value`, so routes with different prefixes
            /// lock the same id independently and routes with the same prefix exclude each
            /// other.
            ///
            /// # Panics
            ///
            /// If `prefix` is empty or contains `:` or a control character.
            #[must_use]
            pub fn prefix(mut self, prefix: &str) -> Self {
                self.prefix = Prefix::new(prefix);
                self
            }
        }
    };
    ($ty:ident, optional) => {
        builder_methods!($ty);

        impl $ty {
            /// Lets a request without this input through unlocked instead of rejecting it.
            #[must_use]
            pub fn optional(mut self) -> Self {
                self.required = false;
                self
            }
        }
    };
}

#[cfg(feature = "axum")]
builder_methods!(PathParam);
#[cfg(feature = "axum")]
builder_methods!(PathParams);
builder_methods!(Header, optional);
builder_methods!(QueryParam, optional);

/// Keys a request on one of its route's path parameters, such as `id` in
/// `/orders/{id}/pay`, percent-decoded.
///
/// The parameters exist only after routing: add the layer with `Router::route_layer` (or
/// `Router::layer`), not around the whole router from outside. A request whose route has
/// no such parameter is rejected with [`KeyError::Missing`] (400): the lock is never
/// skipped silently.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[derive(Debug, Clone)]
pub struct PathParam {
    name: Arc<str>,
    prefix: Prefix,
}

#[cfg(feature = "axum")]
impl PathParam {
    /// Keys on the path parameter called `name`.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        PathParam {
            name: name.into(),
            prefix: Prefix::default(),
        }
    }

    fn missing(&self) -> KeyError {
        KeyError::Missing {
            source: format!("path parameter {:?}", self.name),
        }
    }
}

#[cfg(feature = "axum")]
impl<B> KeyExtractor<B> for PathParam {
    fn extract(&self, req: &Request<B>) -> Result<Option<String>, KeyError> {
        let params = raw_path_params(req, &self.name)?;
        match params.iter().find(|(name, _)| *name == &*self.name) {
            Some((_, value)) => self.prefix.apply(value),
            None => Err(self.missing()),
        }
    }
}

/// The route's path parameters, percent-decoded; `name` is the one asked for, for the
/// error.
#[cfg(feature = "axum")]
fn raw_path_params<B>(
    req: &Request<B>,
    name: &str,
) -> Result<axum::extract::RawPathParams, KeyError> {
    use axum::extract::{FromRequestParts, RawPathParams};
    use futures_util::FutureExt;

    // axum keeps the parameters in a private extension that only its extractors read, and
    // extractors need owned parts: give `RawPathParams` a copy of the extensions.
    let (mut parts, ()) = Request::new(()).into_parts();
    parts.extensions = req.extensions().clone();
    match RawPathParams::from_request_parts(&mut parts, &()).now_or_never() {
        Some(Ok(params)) => Ok(params),
        Some(Err(axum::extract::rejection::RawPathParamsRejection::InvalidUtf8InPathParam(_))) => {
            Err(KeyError::Malformed {
                reason: format!("path parameter {name:?} is not UTF-8"),
            })
        }
        // No parameters at all (the layer ran before routing), or a future that would
        // have to wait, which the extractor never does.
        Some(Err(_)) | None => Err(KeyError::Missing {
            source: format!("path parameter {name:?}"),
        }),
    }
}

/// Keys a request on several of its route's path parameters at once, such as `from` and
/// `to` in `/transfer/{from}/{to}`, percent-decoded: a multi-key lock (every key or none,
/// in canonical order; see [`lock_many`](crate::LockBackend::lock_many)).
///
/// ```
/// use axum::{Router, routing::post};
/// use tower_lock::{LockLayer, MemoryBackend, PathParams};
///
/// let app: Router = Router::new()
///     .route("/transfer/{from}/{to}", post(|| async { "moved" }))
///     // Locks `account:{from}` and `account:{to}`; `/transfer/7/7` is refused with 400.
///     .route_layer(LockLayer::new(MemoryBackend::new(), PathParams::new(["from", "to"]).prefix("account")));
/// ```
///
/// As with [`PathParam`], a request whose route lacks one of the parameters is rejected
/// with [`KeyError::Missing`] (400).
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[derive(Debug, Clone)]
pub struct PathParams {
    names: Arc<[Arc<str>]>,
    prefix: Prefix,
}

#[cfg(feature = "axum")]
impl PathParams {
    /// Keys on the path parameters called `names`, one key each.
    pub fn new<I>(names: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<Arc<str>>,
    {
        PathParams {
            names: names.into_iter().map(Into::into).collect(),
            prefix: Prefix::default(),
        }
    }
}

#[cfg(feature = "axum")]
impl<B> KeyExtractor<B> for PathParams {
    /// The one key of a single parameter; several are refused (read them with
    /// [`extract_all`](KeyExtractor::extract_all), as the layer does).
    fn extract(&self, req: &Request<B>) -> Result<Option<String>, KeyError> {
        let mut keys = self.extract_all(req)?.unwrap_or_default();
        match (keys.pop(), keys.is_empty()) {
            (Some(key), true) => Ok(Some(key)),
            (None, _) => Err(KeyError::NoKeys),
            (Some(_), false) => Err(KeyError::TooManyKeys {
                count: keys.len() + 1,
                max: 1,
            }),
        }
    }

    fn extract_all(&self, req: &Request<B>) -> Result<Option<Vec<String>>, KeyError> {
        let first = self.names.first().map_or("", |name| &**name);
        let params = raw_path_params(req, first)?;
        let mut keys = Vec::with_capacity(self.names.len());
        for name in self.names.iter() {
            match params.iter().find(|(param, _)| *param == &**name) {
                Some((_, value)) => keys.extend(self.prefix.apply(value)?),
                None => {
                    return Err(KeyError::Missing {
                        source: format!("path parameter {name:?}"),
                    });
                }
            }
        }
        Ok(Some(keys))
    }
}

/// Keys a request on a header, such as `Idempotency-Key`.
///
/// Required by default: a request without the header is rejected with
/// [`KeyError::Missing`] (400). After [`optional`](Self::optional) it passes unlocked
/// instead. A header sent more than once, or one that is not UTF-8, is rejected with
/// [`KeyError::Malformed`].
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
    required: bool,
    prefix: Prefix,
}

impl Header {
    /// Keys on the header `name` (any case: `"Idempotency-Key"` or
    /// `http::header::AUTHORIZATION`).
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name, like [`HeaderName::from_static`].
    pub fn new<N>(name: N) -> Self
    where
        HeaderName: TryFrom<N>,
        <HeaderName as TryFrom<N>>::Error: fmt::Debug,
    {
        let name = match HeaderName::try_from(name) {
            Ok(name) => name,
            Err(e) => panic!("invalid header name for a lock key: {e:?}"),
        };
        Header {
            name,
            required: true,
            prefix: Prefix::default(),
        }
    }
}

impl<B> KeyExtractor<B> for Header {
    fn extract(&self, req: &Request<B>) -> Result<Option<String>, KeyError> {
        let mut values = req.headers().get_all(&self.name).iter();
        let value = match (values.next(), values.next()) {
            (None, _) if self.required => {
                return Err(KeyError::Missing {
                    source: format!("header {:?}", self.name.as_str()),
                });
            }
            (None, _) => return Ok(None),
            (Some(value), None) => value,
            (Some(_), Some(_)) => {
                return Err(KeyError::Malformed {
                    reason: format!("header {:?} is sent more than once", self.name.as_str()),
                });
            }
        };
        let value = std::str::from_utf8(value.as_bytes()).map_err(|_| KeyError::Malformed {
            reason: format!("header {:?} is not UTF-8", self.name.as_str()),
        })?;
        self.prefix.apply(value)
    }
}

/// Keys a request on a query parameter, such as `cart` in `/checkout?cart=7`,
/// percent-decoded (`+` is a space, as in HTML forms).
///
/// Required by default, like [`Header`]: missing is [`KeyError::Missing`], repeated or
/// not UTF-8 is [`KeyError::Malformed`], both 400.
#[derive(Debug, Clone)]
pub struct QueryParam {
    name: Arc<str>,
    required: bool,
    prefix: Prefix,
}

impl QueryParam {
    /// Keys on the query parameter called `name` (matched after decoding).
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        QueryParam {
            name: name.into(),
            required: true,
            prefix: Prefix::default(),
        }
    }

    fn malformed(&self, what: &str) -> KeyError {
        KeyError::Malformed {
            reason: format!("query parameter {:?} {what}", self.name),
        }
    }
}

impl<B> KeyExtractor<B> for QueryParam {
    fn extract(&self, req: &Request<B>) -> Result<Option<String>, KeyError> {
        let mut found = None;
        for pair in req.uri().query().unwrap_or_default().split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            // A name that does not decode cannot be the one we look for.
            if decode(name).as_deref() != Some(&*self.name) {
                continue;
            }
            if found.is_some() {
                return Err(self.malformed("is given more than once"));
            }
            found = Some(decode(value).ok_or_else(|| self.malformed("is not UTF-8"))?);
        }
        match found {
            Some(value) => self.prefix.apply(&value),
            None if self.required => Err(KeyError::Missing {
                source: format!("query parameter {:?}", self.name),
            }),
            None => Ok(None),
        }
    }
}

/// Decodes one `application/x-www-form-urlencoded` component; `None` if not UTF-8.
/// Decodes a query component; borrows it when there is nothing to decode, since every
/// pair's name is decoded just to be compared.
fn decode(component: &str) -> Option<std::borrow::Cow<'_, str>> {
    if !component.contains(['+', '%']) {
        return Some(component.into());
    }
    let spaced = component.replace('+', " ");
    percent_encoding::percent_decode_str(&spaced)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(uri: &str) -> Request<()> {
        Request::get(uri).body(()).unwrap()
    }

    #[test]
    fn query_values_are_decoded_and_prefixed() {
        let by_cart = QueryParam::new("cart id").prefix("cart");
        let req = get("/checkout?x=1&cart+id=a%2Fb+c&y");
        assert_eq!(by_cart.extract(&req), Ok(Some("cart:a/b c".to_owned())));
    }

    #[test]
    fn empty_values_are_rejected_before_the_prefix_hides_them() {
        let by_cart = QueryParam::new("cart").prefix("cart");
        assert_eq!(by_cart.extract(&get("/?cart=")), Err(KeyError::Empty));
        assert_eq!(by_cart.extract(&get("/?cart")), Err(KeyError::Empty));
    }

    #[test]
    fn optional_inputs_let_requests_through_unlocked() {
        assert_eq!(
            QueryParam::new("cart").optional().extract(&get("/")),
            Ok(None)
        );
        assert_eq!(Header::new("x-key").optional().extract(&get("/")), Ok(None));
    }

    #[test]
    #[should_panic(expected = "must not contain ':'")]
    fn prefixes_with_colons_are_refused() {
        let _ = Header::new("x-order").prefix("order:item");
    }
}

//! What is stored of a completed request: its fingerprint and its response (status, the
//! headers worth replaying, body), in a compact binary form.
//!
//! The form: a version byte, the 32-byte fingerprint, the status (u16), the header count
//! (u16), each header as name length (u16), name, value length (u32), value, then the body
//! to the end. Big-endian. A record that does not read back is refused, never replayed.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};

use super::fingerprint::Fingerprint;

const VERSION: u8 = 1;

/// A completed request, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Record {
    pub(crate) fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(64 + self.body.len());
        out.put_u8(VERSION);
        out.put_slice(self.fingerprint.as_bytes());
        out.put_u16(self.status.as_u16());
        // At most u16::MAX headers are kept (see `kept_headers`).
        out.put_u16(u16::try_from(self.headers.len()).unwrap_or(u16::MAX));
        for (name, value) in self.headers.iter().take(usize::from(u16::MAX)) {
            // Header names are short (hyper refuses names over 64 KiB), values under 4 GiB.
            out.put_u16(u16::try_from(name.as_str().len()).unwrap_or(u16::MAX));
            out.put_slice(name.as_str().as_bytes());
            out.put_u32(u32::try_from(value.len()).unwrap_or(u32::MAX));
            out.put_slice(value.as_bytes());
        }
        out.put_slice(&self.body);
        out.freeze()
    }

    /// Reads a stored record; `None` when it is not one this crate wrote.
    pub(crate) fn decode(mut raw: Bytes) -> Option<Self> {
        if raw.remaining() < 1 + 32 + 4 || raw.get_u8() != VERSION {
            return None;
        }
        let fingerprint = Fingerprint::from_slice(&raw.split_to(32))?;
        let status = StatusCode::from_u16(raw.get_u16()).ok()?;
        let count = raw.get_u16();
        let mut headers = HeaderMap::with_capacity(usize::from(count));
        for _ in 0..count {
            let name = take(&mut raw, |r| r.try_get_u16().ok().map(usize::from))?;
            let value = take(&mut raw, |r| {
                r.try_get_u32().ok().and_then(|n| usize::try_from(n).ok())
            })?;
            headers.append(
                HeaderName::from_bytes(&name).ok()?,
                HeaderValue::from_maybe_shared(value).ok()?,
            );
        }
        Some(Record {
            fingerprint,
            status,
            headers,
            body: raw,
        })
    }

    /// The replayed response, with `replayed` added to its headers.
    pub(crate) fn response(&self, replayed: Option<&(HeaderName, HeaderValue)>) -> Response<Bytes> {
        let mut response = Response::new(self.body.clone());
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers.clone();
        if let Some((name, value)) = replayed {
            response.headers_mut().insert(name.clone(), value.clone());
        }
        response
    }
}

/// Takes a length-prefixed field off `raw`.
fn take(raw: &mut Bytes, len: impl FnOnce(&mut Bytes) -> Option<usize>) -> Option<Bytes> {
    let len = len(raw)?;
    (raw.remaining() >= len).then(|| raw.split_to(len))
}

/// Hop-by-hop headers (RFC 9110 section 7.6.1): they describe one connection, never a
/// response to replay on another.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The headers of `headers` worth storing: neither hop-by-hop (those above and those the
/// `Connection` header names) nor in `deny`.
pub(crate) fn kept_headers(headers: &HeaderMap, deny: &[HeaderName]) -> HeaderMap {
    let named_by_connection: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    let mut kept = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let dropped =
            HOP_BY_HOP.contains(name) || named_by_connection.contains(name) || deny.contains(name);
        if !dropped && kept.len() < usize::from(u16::MAX) {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        let mut headers = HeaderMap::new();
        headers.append("x-charge", HeaderValue::from_static("ch_1"));
        headers.append("x-charge", HeaderValue::from_static("ch_2"));
        headers.append(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        Record {
            fingerprint: Fingerprint::from_slice(&[7; 32]).unwrap(),
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"\x00binary\xffbody"),
        }
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let record = record();
        assert_eq!(Record::decode(record.encode()), Some(record));
    }

    #[test]
    fn a_truncated_or_foreign_record_is_refused() {
        let raw = record().encode();
        // Cut inside the headers.
        assert_eq!(Record::decode(raw.slice(..45)), None);
        assert_eq!(
            Record::decode(Bytes::from_static(b"not a record at all, not at all")),
            None
        );
        assert_eq!(Record::decode(Bytes::new()), None);
    }

    #[test]
    fn hop_by_hop_denied_and_connection_named_headers_are_dropped() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-conn-only"),
        );
        headers.insert("x-conn-only", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("s=1"));
        headers.insert("x-kept", HeaderValue::from_static("yes"));
        let kept = kept_headers(&headers, &[header::SET_COOKIE]);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept["x-kept"], "yes");
    }
}

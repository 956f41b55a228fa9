//! A hold's value in a store that keeps one record per holder (etcd's key, ZooKeeper's
//! node): who holds it, how often it re-entered, which releases were already applied.

/// A hold's value: the holder's identity, its re-entry count, and the ids of the releases
/// already applied to it (so that a retried release is recognised), one per line, with
/// `%` and line breaks in them escaped (an owner id is the application's to choose).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HoldValue {
    pub(crate) holder: String,
    pub(crate) count: u64,
    pub(crate) released: Vec<String>,
}

impl HoldValue {
    pub(crate) fn new(holder: &str) -> Self {
        HoldValue {
            holder: holder.to_owned(),
            count: 1,
            released: Vec::new(),
        }
    }

    /// Reads a value this crate wrote; `None` for anything else.
    pub(crate) fn parse(value: &[u8]) -> Option<Self> {
        let value = std::str::from_utf8(value).ok()?;
        let mut lines = value.split('\n');
        let holder = unescape(lines.next()?)?;
        let count = lines.next()?.parse().ok()?;
        let released = lines
            .filter(|l| !l.is_empty())
            .map(unescape)
            .collect::<Option<_>>()?;
        Some(HoldValue {
            holder,
            count,
            released,
        })
    }

    pub(crate) fn encode(&self) -> String {
        let mut out = format!("{}\n{}", escape(&self.holder), self.count);
        for id in &self.released {
            out.push('\n');
            out.push_str(&escape(id));
        }
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('%', "%25")
        .replace('\n', "%0A")
        .replace('\r', "%0D")
}

fn unescape(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let (c, after) = match rest.get(at + 1..at + 3)? {
            "25" => ('%', at + 3),
            "0A" => ('\n', at + 3),
            "0D" => ('\r', at + 3),
            _ => return None,
        };
        out.push(c);
        rest = &rest[after..];
    }
    out.push_str(rest);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip() {
        let mut value = HoldValue::new("owner\n1%");
        value.count = 3;
        value.released.push("owner\n1%#7".into());
        assert_eq!(value.encode().lines().count(), 3);
        assert_eq!(HoldValue::parse(value.encode().as_bytes()), Some(value));
        assert_eq!(HoldValue::parse(b"no count"), None);
    }
}

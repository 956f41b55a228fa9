//! The history of a lock workload and its checker, after Jepsen's: every hold recorded as
//! (instance, key, token, start, end) with its fenced write, then checked per key against
//! the mutex model Knossos checks (holds never overlap, tokens increase in hold order) and
//! against the fenced register (`FencedStore`): it holds exactly the acknowledged writes.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// One hold as its instance saw it; times are wall-clock µs, shared by the processes of
/// one machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub instance: usize,
    pub key: String,
    pub token: u64,
    /// After the lock was granted (the handler started).
    pub start: u64,
    /// When the handler stopped: returned, or dropped because the lock was lost.
    pub end: u64,
    pub write: Write,
}

/// The fenced write of a read-modify-write increment: the value read plus one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Acknowledged.
    Written(u64),
    /// Refused: a holder with a newer token had written.
    Stale,
    /// Sent, without an answer (it may have happened).
    Unknown(u64),
    /// Not sent (the read failed, or the handler was stopped first).
    Skipped,
}

impl Hold {
    /// One line for `child::report`.
    pub fn encode(&self) -> String {
        let (kind, value) = match self.write {
            Write::Written(v) => ("written", v),
            Write::Stale => ("stale", 0),
            Write::Unknown(v) => ("unknown", v),
            Write::Skipped => ("skipped", 0),
        };
        let Hold {
            instance,
            key,
            token,
            start,
            end,
            ..
        } = self;
        format!("hold {instance} {key} {token} {start} {end} {kind} {value}")
    }

    /// The hold of a line made by [`encode`](Self::encode).
    pub fn decode(line: &str) -> Option<Hold> {
        let mut parts = line.strip_prefix("hold ")?.split(' ');
        let instance = parts.next()?.parse().ok()?;
        let key = parts.next()?.to_owned();
        let mut number = || parts.next()?.parse::<u64>().ok();
        let (token, start, end) = (number()?, number()?, number()?);
        let kind = parts.next()?.to_owned();
        let value = parts.next()?.parse().ok()?;
        let write = match kind.as_str() {
            "written" => Write::Written(value),
            "stale" => Write::Stale,
            "unknown" => Write::Unknown(value),
            "skipped" => Write::Skipped,
            _ => return None,
        };
        Some(Hold {
            instance,
            key,
            token,
            start,
            end,
            write,
        })
    }
}

/// What the register of a key held at the end: `(token, value)`, `None` if never written.
pub type Registers = HashMap<String, Option<(u64, u64)>>;

/// A broken rule, with the holds that break it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub rule: &'static str,
    pub holds: Vec<Hold>,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.rule)?;
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        for hold in &self.holds {
            write!(f, "\n    {hold:?}")?;
        }
        Ok(())
    }
}

/// Prints every violation found, then fails the test if there was one.
pub fn assert_none(violations: &[Violation]) {
    for v in violations {
        println!("  VIOLATION: {v}");
    }
    assert!(
        violations.is_empty(),
        "{} checker violations",
        violations.len()
    );
}

/// Checks every key's holds and register; returns every violation found.
pub fn check(holds: &[Hold], registers: &Registers) -> Vec<Violation> {
    let mut by_key: BTreeMap<&str, Vec<&Hold>> = BTreeMap::new();
    for hold in holds {
        by_key.entry(&hold.key).or_default().push(hold);
    }
    for key in registers.keys() {
        by_key.entry(key).or_default();
    }
    let mut violations = Vec::new();
    for (key, mut holds) in by_key {
        holds.sort_by_key(|h| (h.start, h.token));
        check_mutex(&holds, &mut violations);
        check_register(
            key,
            &holds,
            registers.get(key).copied().flatten(),
            &mut violations,
        );
    }
    violations
}

/// Holds in start order: none starts before every earlier one ended, tokens increase.
fn check_mutex(holds: &[&Hold], violations: &mut Vec<Violation>) {
    let mut latest: Option<&Hold> = None;
    for pair in holds.windows(2) {
        if pair[0].token >= pair[1].token {
            violations.push(violation("tokens do not increase in hold order", pair, ""));
        }
    }
    for &hold in holds {
        if let Some(earlier) = latest.filter(|l| hold.start < l.end) {
            let overlap = format!("{} µs", earlier.end - hold.start);
            violations.push(violation("holds overlap", &[earlier, hold], &overlap));
        }
        if latest.is_none_or(|l| hold.end > l.end) {
            latest = Some(hold);
        }
    }
}

/// Acknowledged increments, in token order, never repeat a value (no lost update), no
/// write was refused as stale (its holder was overtaken while running), and the register
/// holds the acknowledged write with the highest token, or a later unacknowledged one.
fn check_register(
    key: &str,
    holds: &[&Hold],
    stored: Option<(u64, u64)>,
    violations: &mut Vec<Violation>,
) {
    let mut by_token = holds.to_vec();
    by_token.sort_by_key(|h| h.token);
    for (i, stale) in by_token.iter().enumerate() {
        if stale.write == Write::Stale {
            let newer: Vec<&Hold> = by_token[i..].iter().take(2).copied().collect();
            let detail = "its holder ran on after a newer hold wrote";
            violations.push(violation("write refused as stale", &newer, detail));
        }
    }
    let written: Vec<(&Hold, u64)> = by_token
        .iter()
        .filter_map(|h| match h.write {
            Write::Written(v) => Some((*h, v)),
            _ => None,
        })
        .collect();
    for pair in written.windows(2) {
        if pair[0].1 >= pair[1].1 {
            let detail = format!("values {} then {}", pair[0].1, pair[1].1);
            violations.push(violation("lost update", &[pair[0].0, pair[1].0], &detail));
        }
    }
    let last = written.last().map(|(h, v)| (h.token, *v));
    let explained = match (stored, last) {
        (None, None) => true,
        (None, Some(_)) => false,
        (Some(s), Some(l)) if s == l => true,
        // Only a write with a newer token than every acknowledged one, whose reply was lost.
        (Some((token, value)), last) => by_token.iter().any(|h| {
            h.write == Write::Unknown(value)
                && h.token == token
                && last.is_none_or(|(t, _)| token > t)
        }),
    };
    if !explained {
        let last_hold: Vec<&Hold> = written.last().map(|(h, _)| *h).into_iter().collect();
        let detail = format!("{key}: register holds {stored:?}, last acknowledged write {last:?}");
        violations.push(violation(
            "register does not hold the acknowledged writes",
            &last_hold,
            &detail,
        ));
    }
}

fn violation(rule: &'static str, holds: &[&Hold], detail: &str) -> Violation {
    Violation {
        rule,
        holds: holds.iter().map(|h| (*h).clone()).collect(),
        detail: detail.to_owned(),
    }
}

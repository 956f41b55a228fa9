//! The etcd names of one user key: the lock's directory and the keys in it.

use std::sync::Arc;

use super::line::Line;
pub(crate) use crate::core::kit::keys::is_semaphore;
use crate::core::kit::keys::{KeyName, Namespaced, SEMAPHORE, namespaced_prefix, past_prefix};
use crate::core::store::StoreKey;
use crate::error::KeyError;
use crate::key::split_namespaced;
use crate::lock::inspect::Primitive;

/// The names that belong to one acquisition of a user key: the lock's directory
/// (`namespace:{key}`, or `namespace:{key}:permits` for its semaphore), and the channel
/// the acquisition's waiter is woken on.
///
/// In a lock's directory every key starts with a letter saying what it is (see
/// [`Entry`]), then the lease id of the backend that wrote it in hex, then, for a key of one
/// holder, the holder escaped (no `/` in it). No directory is a prefix of another's: the
/// key's own braces and `%` are escaped, so the closing brace ends the user key.
#[derive(Debug)]
pub(crate) struct EtcdKey {
    /// The key as the application gave it.
    user: String,
    /// The lock's directory, without the trailing `/`: the core's name of the lock.
    pub(crate) name: Arc<str>,
    /// The semaphore's directory rather than the read/write lock's.
    pub(crate) semaphore: bool,
    /// This acquisition's own channel: it is woken when the key it waits behind goes.
    pub(crate) channel: String,
    /// Its key waiting in line, taken out when the acquisition ends (`None`: an operator's
    /// call, which waits for nothing).
    pub(crate) line: Option<Line>,
}

impl EtcdKey {
    /// The names of `user`'s lock (or its semaphore), for the acquisition numbered `serial`.
    pub(crate) fn new(
        namespace: &str,
        user: String,
        max_len: usize,
        semaphore: bool,
        serial: u64,
    ) -> Result<Self, KeyError> {
        let KeyName { user, name } =
            KeyName::new(&Namespaced(namespace), user, max_len, semaphore)?;
        Ok(EtcdKey {
            channel: format!("{name}#{serial}"),
            name: name.into(),
            user,
            semaphore,
            line: None,
        })
    }

    /// An attempt left `key`, holding `value`, waiting in line.
    pub(crate) fn left_in_line(&self, key: String, value: String) {
        if let Some(line) = &self.line {
            line.left(key, value);
        }
    }

    /// An attempt took the hold: nothing of the acquisition waits in line any more.
    pub(crate) fn out_of_line(&self) {
        if let Some(line) = &self.line {
            line.taken();
        }
    }

    /// An attempt of this acquisition by `holder` is sent.
    pub(crate) fn attempts(&self, holder: &str) {
        if let Some(line) = &self.line {
            line.attempts(&self.name, holder);
        }
    }

    /// A write of this acquisition may run unanswered (see `orphans.rs`).
    pub(crate) fn lost_write(&self) {
        if let Some(line) = &self.line {
            line.lost_write();
        }
    }

    /// These names for an acquisition, which may wait in `line`.
    pub(crate) fn waiting_in(mut self, line: Line) -> Self {
        self.line = Some(line);
        self
    }
}

impl Drop for EtcdKey {
    /// The acquisition ended (every call of it returned): it waits for nothing any more.
    fn drop(&mut self) {
        let Some(line) = &mut self.line else {
            return;
        };
        if self.semaphore {
            // A permit's turn it was woken for goes to the next in line.
            line.behind
                .withdraw(&line.wakeups, &self.channel, &self.name);
        } else {
            line.behind.tried(&self.channel);
        }
        line.leave();
        line.ended(&self.name);
    }
}

impl StoreKey for EtcdKey {
    fn user(&self) -> &str {
        &self.user
    }

    fn lock(&self) -> &Arc<str> {
        &self.name
    }
}

/// What a key in a lock's directory is, by its first letter after the `/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entry {
    /// `h`: the exclusive hold of a backend (one contender per backend and key).
    Hold,
    /// `q`: a writer waiting for the shared holders (and writers) before it.
    Queued,
    /// `r`: one shared holder's hold.
    Reader,
    /// `p`: one permit of a semaphore.
    Permit,
    /// `f`: the fence record, written with every exclusive hold: its mod revision is the
    /// last writer's token, which shared holders carry.
    Fence,
    /// `d`: the idempotency record of a request done under the lock, on a lease of its
    /// own (its retention); below every holder's letter, so no range of holders has it.
    Record,
}

impl Entry {
    const fn letter(self) -> char {
        match self {
            Entry::Hold => 'h',
            Entry::Queued => 'q',
            Entry::Reader => 'r',
            Entry::Permit => 'p',
            Entry::Fence => 'f',
            Entry::Record => 'd',
        }
    }

    /// What the key `key` of a directory is.
    pub(crate) fn of(key: &[u8]) -> Option<Self> {
        let at = key.iter().rposition(|&b| b == b'/')?;
        Some(match key.get(at + 1)? {
            b'h' => Entry::Hold,
            b'q' => Entry::Queued,
            b'r' => Entry::Reader,
            b'p' => Entry::Permit,
            b'f' => Entry::Fence,
            b'd' => Entry::Record,
            _ => return None,
        })
    }

    /// A writer's key: a hold or a waiting writer.
    pub(crate) fn is_writer(self) -> bool {
        matches!(self, Entry::Hold | Entry::Queued)
    }
}

/// The key of the exclusive hold the backend with lease `lease` keeps in the lock `name`.
pub(crate) fn hold_key(name: &str, lease: i64) -> String {
    format!("{name}/h{lease:016x}")
}

/// The key of `holder`'s `entry` (a waiting writer, a shared hold, a permit) under the
/// lease `lease` in the lock `name`.
pub(crate) fn holder_key(name: &str, entry: Entry, lease: i64, holder: &str) -> String {
    let mut key = format!("{name}/{}{lease:016x}", entry.letter());
    for c in holder.chars() {
        match c {
            '%' => key.push_str("%25"),
            '/' => key.push_str("%2F"),
            c => key.push(c),
        }
    }
    key
}

/// The key of the lock `name`'s fence record.
pub(crate) fn fence_key(name: &str) -> String {
    format!("{name}/f")
}

/// The key of the lock `name`'s idempotency record.
pub(crate) fn record_key(name: &str) -> String {
    format!("{name}/{}", Entry::Record.letter())
}

/// The range (start, end) of the keys of the entries `from` up to (not including) `to` in
/// the lock `name` (letters in between included: `q` lies between `h` and `r`).
pub(crate) fn range(name: &str, from: Entry, to: char) -> (String, String) {
    (format!("{name}/{}", from.letter()), format!("{name}/{to}"))
}

/// Every holder's key of a lock: holds, waiting writers and shared holds.
pub(crate) fn holders(name: &str) -> (String, String) {
    range(name, Entry::Hold, 's')
}

/// The writers' keys of a lock: holds and waiting writers.
pub(crate) fn writers(name: &str) -> (String, String) {
    range(name, Entry::Hold, 'r')
}

/// The permits' keys of a semaphore.
pub(crate) fn permits(name: &str) -> (String, String) {
    range(name, Entry::Permit, 'q')
}

/// The prefix under which every lock of `namespace` lives (what the backend watches).
pub(crate) fn namespace_prefix(namespace: &str) -> String {
    format!("{namespace}:{{")
}

/// The range (start, end) of the names of every lock and semaphore of `namespace` whose
/// key begins with `prefix`, and of every key in their directories. The key is escaped one
/// character at a time, so the name of a key that begins with `prefix` begins with the
/// escaped prefix, and only such a key's does.
pub(crate) fn under(namespace: &str, prefix: &str) -> (String, Vec<u8>) {
    let start = namespaced_prefix(namespace, prefix);
    let end = past_prefix(&start);
    (start, end)
}

/// The user key and primitive whose hold the etcd key `key` is, if it is one: an exclusive
/// or shared hold in a lock's directory, or a permit in a semaphore's (a permit waiting in
/// line too, which only its value tells apart). `None` for a fence or idempotency record,
/// a writer waiting in line, and any key this crate does not write in `namespace`.
pub(crate) fn hold_of(namespace: &str, key: &[u8]) -> Option<(String, Primitive)> {
    let key = std::str::from_utf8(key).ok()?;
    let (user, rest) = split_namespaced(namespace, key)?;
    let (directory, entry) = rest.split_once('/')?;
    // A holder's `/` is escaped: the directory's is the last.
    if entry.contains('/') {
        return None;
    }
    let of = match (directory, Entry::of(key.as_bytes())?) {
        ("", Entry::Hold | Entry::Reader) => Primitive::Lock,
        (SEMAPHORE, Entry::Permit) => Primitive::Semaphore,
        _ => return None,
    };
    Some((user, of))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let key = EtcdKey::new("ns", "a/b}".into(), 1024, false, 7).unwrap();
        assert_eq!(&*key.name, "ns:{a/b%7D}");
        let hold = hold_key(&key.name, 0x2a);
        assert_eq!(hold, "ns:{a/b%7D}/h000000000000002a");
        assert_eq!(Entry::of(hold.as_bytes()), Some(Entry::Hold));
        let (start, end) = holders(&key.name);
        assert!(hold > start && hold < end);
        assert!(hold.starts_with(&namespace_prefix("ns")));
        let reader = holder_key(&key.name, Entry::Reader, 1, "r:x/%y");
        assert!(reader.ends_with("/r0000000000000001r:x%2F%25y"));
        assert_eq!(Entry::of(reader.as_bytes()), Some(Entry::Reader));
        let (start, end) = writers(&key.name);
        assert!(reader >= end && hold >= start);
        assert!(fence_key(&key.name) < start);
        let record = record_key(&key.name);
        assert_eq!(Entry::of(record.as_bytes()), Some(Entry::Record));
        let (start, end) = holders(&key.name);
        assert!(record < start && record != fence_key(&key.name) && record < end);
        assert!(record.starts_with(&format!("{}/", key.name)));
        let semaphore = EtcdKey::new("ns", "a".into(), 1024, true, 8).unwrap();
        assert!(is_semaphore(&semaphore.name) && !is_semaphore(&key.name));
        assert!(!semaphore.name.starts_with(&format!("{}/", key.name)));
        assert_ne!(semaphore.channel, key.channel);
    }

    #[test]
    fn holds_name_their_key_and_nothing_else_does() {
        let lock = EtcdKey::new("ns", "a/b{%}".into(), 1024, false, 0).unwrap();
        let semaphore = EtcdKey::new("ns", "a/b{%}".into(), 1024, true, 0).unwrap();
        let user = || "a/b{%}".to_owned();
        let of = |key: &str| hold_of("ns", key.as_bytes());
        assert_eq!(
            of(&hold_key(&lock.name, 1)),
            Some((user(), Primitive::Lock))
        );
        let reader = holder_key(&lock.name, Entry::Reader, 1, "r:x/y");
        assert_eq!(of(&reader), Some((user(), Primitive::Lock)));
        let permit = holder_key(&semaphore.name, Entry::Permit, 1, "x/y");
        assert_eq!(of(&permit), Some((user(), Primitive::Semaphore)));
        // Not holds: records, writers in line, a semaphore's key in a lock's directory,
        // another namespace's, keys this crate never writes.
        for key in [
            fence_key(&lock.name),
            record_key(&lock.name),
            holder_key(&lock.name, Entry::Queued, 1, "x"),
            holder_key(&lock.name, Entry::Permit, 1, "x"),
            hold_key(&semaphore.name, 1),
            hold_key(
                &EtcdKey::new("ns2", user(), 1024, false, 0).unwrap().name,
                1,
            ),
            format!("{}/x/h1", lock.name),
            format!("{}:other/p1", lock.name),
            "ns:{a}".to_owned(),
        ] {
            assert_eq!(of(&key), None, "{key}");
        }
        assert_eq!(hold_of("ns", b"ns:{\xff}/h1"), None);
    }

    #[test]
    fn a_prefix_ranges_over_exactly_the_keys_that_begin_with_it() {
        let (start, end) = under("ns", "a{");
        assert_eq!((&*start, &*end), ("ns:{a%7B", &b"ns:{a%7C"[..]));
        let inside = |user: &str| {
            let key = EtcdKey::new("ns", user.into(), 1024, false, 0).unwrap();
            let hold = hold_key(&key.name, 1);
            hold.as_str() >= start.as_str() && hold.as_bytes() < end.as_slice()
        };
        assert!(inside("a{") && inside("a{b}") && inside("a{{"));
        assert!(!inside("a") && !inside("a}") && !inside("a%7B") && !inside("b"));
        assert_eq!(under("ns", "").0, namespace_prefix("ns"));
    }
}

//! A user key's names in a store: the key validated once, and its lock's (or its
//! semaphore's) name, spelt by the store's [`Naming`].
//!
//! Each store's key type (Redis's `LockKey`, `SqlKey`, `EtcdKey`, `ZkKey`, `MemoryKey`)
//! starts from a [`KeyName`] and adds what only it names (counters, channels, a line).

use crate::error::KeyError;
use crate::key::{namespaced, split_namespaced, validate};
use crate::lock::inspect::Primitive;

/// What ends the name of a key's semaphore, after its lock's name: a primitive of its own,
/// apart from the key's lock.
pub(crate) const SEMAPHORE: &str = ":permits";

/// How a store spells the name of a user key's lock: the part of naming that is the
/// store's own.
pub(crate) trait Naming {
    /// Refuses (400) a key the store cannot name, besides what every store refuses (an
    /// empty or over-long key, control characters): nothing more by default.
    fn refuse(&self, _user: &str) -> Result<(), KeyError> {
        Ok(())
    }

    /// The name of `user`'s lock (`user` valid).
    fn lock(&self, user: &str) -> String;

    /// The name of `user`'s semaphore: its lock's, then [`SEMAPHORE`].
    fn semaphore(&self, user: &str) -> String {
        let mut name = self.lock(user);
        name.push_str(SEMAPHORE);
        name
    }
}

/// The naming of the stores whose names are flat strings, `namespace:{key}` (see
/// [`namespaced`]): Redis (the braces are the cluster hash tag), the SQL stores and etcd.
pub(crate) struct Namespaced<'a>(pub(crate) &'a str);

impl Naming for Namespaced<'_> {
    fn lock(&self, user: &str) -> String {
        namespaced(self.0, user)
    }
}

/// How the name in `namespace` (as [`Namespaced`] spells it) of every key that starts with
/// `prefix` starts, and no other key's name: `namespace:{` and the escaped prefix. The
/// escaping is character by character and reads back one way only, so a name starts with
/// it exactly when its key starts with `prefix`, byte for byte; with the empty prefix,
/// every name of the namespace does.
pub(crate) fn namespaced_prefix(namespace: &str, prefix: &str) -> String {
    let mut name = namespaced(namespace, prefix);
    // The closing brace.
    name.pop();
    name
}

/// The first byte string above every one that starts with `prefix`: `prefix` with its last
/// byte raised by one, which a `str` leaves room for (UTF-8 has no `0xFF` byte). With
/// [`namespaced_prefix`], the end of the range of the names under a prefix, for the stores
/// that read names in byte order (etcd's range reads, MySQL's `VARBINARY` key).
#[cfg_attr(
    not(any(test, feature = "etcd", feature = "mysql")),
    expect(dead_code, reason = "only etcd and MySQL read names by byte range")
)]
pub(crate) fn past_prefix(prefix: &str) -> Vec<u8> {
    let mut past = prefix.as_bytes().to_vec();
    if let Some(last) = past.last_mut() {
        *last = last.saturating_add(1);
    }
    past
}

/// The key and primitive that the name `name` is of in `namespace`, as [`Namespaced`]
/// spells it: `namespace:{key}` is the key's lock, `namespace:{key}:permits` its semaphore.
/// `None` for any other name: another namespace's, one with another suffix (a key's
/// counters and channels), or one that no key has (an escape the escaping never writes, an
/// empty key).
pub(crate) fn parse_namespaced(namespace: &str, name: &str) -> Option<(String, Primitive)> {
    let (user, suffix) = split_namespaced(namespace, name)?;
    let of = match suffix {
        "" => Primitive::Lock,
        SEMAPHORE => Primitive::Semaphore,
        _ => return None,
    };
    Some((user, of)).filter(|(user, _)| !user.is_empty())
}

/// A user key, validated, and the store's name of its lock (or its semaphore).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyName {
    /// The key as the application gave it (errors, spans, `HeldLock::key`).
    pub(crate) user: String,
    /// The lock's (or the semaphore's) name in the store.
    pub(crate) name: String,
}

impl KeyName {
    /// The names of `user`'s lock (its semaphore's if `semaphore`) as `naming` spells them;
    /// refuses (400) an empty key, one over `max_len` bytes, one with control characters,
    /// and what `naming` refuses.
    pub(crate) fn new(
        naming: &impl Naming,
        user: String,
        max_len: usize,
        semaphore: bool,
    ) -> Result<Self, KeyError> {
        validate(&user, max_len)?;
        naming.refuse(&user)?;
        let name = if semaphore {
            naming.semaphore(&user)
        } else {
            naming.lock(&user)
        };
        Ok(KeyName { user, name })
    }
}

/// Whether the store name `name` is a semaphore's (named by a [`Naming`] that keeps the
/// default [`Naming::semaphore`]).
#[cfg_attr(
    not(any(test, feature = "etcd")),
    expect(dead_code, reason = "only etcd tells a semaphore by its name")
)]
pub(crate) fn is_semaphore(name: &str) -> bool {
    name.ends_with(SEMAPHORE)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A naming that refuses keys that start with `x` and spells a lock `<key>!`.
    struct Bang;

    impl Naming for Bang {
        fn refuse(&self, user: &str) -> Result<(), KeyError> {
            if user.starts_with('x') {
                return Err(KeyError::Malformed {
                    reason: "no x".to_owned(),
                });
            }
            Ok(())
        }

        fn lock(&self, user: &str) -> String {
            format!("{user}!")
        }
    }

    #[test]
    fn every_store_refuses_empty_over_long_and_control_keys_before_its_own_refusals() {
        let named = |user: &str, max_len| KeyName::new(&Bang, user.to_owned(), max_len, false);
        assert_eq!(named("", 8), Err(KeyError::Empty));
        assert_eq!(
            named("abcdefghi", 8),
            Err(KeyError::TooLong { len: 9, max: 8 })
        );
        assert_eq!(named("a\nb", 8), Err(KeyError::ControlCharacter));
        assert!(matches!(named("x", 8), Err(KeyError::Malformed { .. })));
        // What every store refuses comes first.
        assert_eq!(named("x\n", 8), Err(KeyError::ControlCharacter));
        assert_eq!(
            named("xxxxxxxxx", 8),
            Err(KeyError::TooLong { len: 9, max: 8 })
        );
        assert_eq!(
            named("abcdefgh", 8).map(|k| k.name),
            Ok("abcdefgh!".to_owned())
        );
    }

    #[test]
    fn a_semaphore_is_named_after_its_lock_and_a_store_may_spell_the_lock() {
        let key = KeyName::new(&Bang, "k".into(), 8, true).unwrap();
        assert_eq!((&*key.user, &*key.name), ("k", "k!:permits"));
        assert!(is_semaphore(&key.name));
        let lock = KeyName::new(&Namespaced("ns"), "a{b}%:permits".into(), 64, false).unwrap();
        assert_eq!(lock.name, "ns:{a%7Bb%7D%25:permits}");
        assert!(!is_semaphore(&lock.name));
        let semaphore = KeyName::new(&Namespaced("ns"), "a{b}".into(), 64, true).unwrap();
        assert_eq!(semaphore.name, "ns:{a%7Bb%7D}:permits");
        assert_eq!(semaphore.user, "a{b}");
    }

    #[test]
    fn a_name_reads_back_as_its_key_and_primitive_and_no_other_name_does() {
        for user in ["k", "a{b}%:permits", "order:é空", "%7B", "}:permits"] {
            for (semaphore, of) in [(false, Primitive::Lock), (true, Primitive::Semaphore)] {
                let key = KeyName::new(&Namespaced("ns"), user.into(), 64, semaphore).unwrap();
                let parsed = parse_namespaced("ns", &key.name);
                assert_eq!(parsed, Some((user.to_owned(), of)), "{}", key.name);
                assert_eq!(parse_namespaced("n", &key.name), None);
                assert_eq!(parse_namespaced("ns:{k", &key.name), None);
            }
        }
        for other in [
            "ns:{k}:releases",
            "ns:{k}:permits:x",
            "ns:{k}}",
            "ns:{k",
            "ns:k}",
            "ns:{}",
            "ns:{%admin}",
            "ns:{a%7bb}",
            "nsx:{k}",
            "other:{k}",
        ] {
            assert_eq!(parse_namespaced("ns", other), None, "{other}");
        }
    }

    #[test]
    fn past_a_prefix_is_above_every_name_under_it_and_below_the_names_after() {
        assert_eq!(past_prefix("ns:{"), b"ns:|");
        assert_eq!(past_prefix("ns:{é"), b"ns:{\xC3\xAA");
        for prefix in ["ns:{", "ns:{order:", "ns:{é", "ns:{\u{10FFFF}"] {
            let bound = past_prefix(prefix);
            for under in ["", "}", "\u{10FFFF}\u{10FFFF}}:permits", "a"] {
                let name = format!("{prefix}{under}");
                assert!(name.as_bytes() < bound.as_slice(), "{name:?}");
            }
            assert!(!bound.starts_with(prefix.as_bytes()));
        }
    }

    #[test]
    fn the_names_under_a_prefix_are_the_names_of_the_keys_under_it() {
        let name = |user: &str| namespaced("ns", user);
        let prefix = namespaced_prefix("ns", "order:{");
        assert_eq!(prefix, "ns:{order:%7B");
        assert!(name("order:{x}").starts_with(&prefix));
        assert!(!name("order:%7B").starts_with(&prefix));
        assert!(!name("order:").starts_with(&prefix));
        // A prefix that ends with `%` ends with a whole escape.
        let percent = namespaced_prefix("ns", "a%");
        assert!(name("a%7B").starts_with(&percent));
        assert!(!name("a{").starts_with(&percent));
        // The empty prefix: every name of the namespace, locks and semaphores, and only
        // those.
        let all = namespaced_prefix("ns", "");
        assert_eq!(all, "ns:{");
        let semaphore = KeyName::new(&Namespaced("ns"), "k".into(), 8, true).unwrap();
        assert!(semaphore.name.starts_with(&all));
        assert!(!namespaced("nsx", "k").starts_with(&all));
    }
}

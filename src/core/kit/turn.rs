//! Whose turn it is: the one ordering rule of the stores that queue contenders as ordered
//! entries (etcd's keys by create revision, ZooKeeper's sequential nodes), as Curator's and
//! etcd's recipes decide it, apart from any store call.

use crate::lock::Kind;

/// What an entry in a lock's line stands for, as the rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryKind {
    /// A writer's (an exclusive holder's, or a writer waiting in line), or a permit's.
    Write,
    /// A shared holder's.
    Read,
}

/// One entry of a lock's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry<O> {
    /// Its place in the store's order (a create revision, a sequence number).
    pub(crate) order: O,
    pub(crate) kind: EntryKind,
    /// A writer's hold of the owner that asks (a writer taking a shared hold of its own
    /// key: its exclusive hold does not keep its shared one out).
    pub(crate) own: bool,
}

/// Whether an entry holds, and if not, what it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Turn {
    Holds,
    /// Not yet: the places (in the line given) of the entries whose going may let it in,
    /// each watched once.
    Waits {
        behind: Vec<usize>,
    },
}

/// The turn of the entry ordered `mine` (`None`: an entry not there yet, which would come
/// last) among `line` (in order, ascending) for an acquisition of `kind`:
///
/// - a writer holds when no entry is ahead of it; else it watches the entry just ahead
///   (every entry ahead must go, so waiting for any one of them misses nothing): writers
///   go first come, first served;
/// - a reader holds when no writer's entry is ahead of it, its owner's own excepted; else
///   it watches the nearest such writer's (the last of them to go, in line order);
/// - a permit holds when fewer than `n` entries are ahead of it; else it watches the `n`
///   first: any of them leaving lets it in, and which goes first is not known.
///
/// Each waiter watches only entries it waits behind, never the whole line (the herd
/// effect).
pub(crate) fn turn<O: Ord>(line: &[Entry<O>], mine: Option<&O>, kind: Kind) -> Turn {
    let ahead = match mine {
        Some(mine) => &line[..line.partition_point(|e| e.order < *mine)],
        None => line,
    };
    let waits = |behind: Vec<usize>| Turn::Waits { behind };
    match kind {
        Kind::Exclusive if ahead.is_empty() => Turn::Holds,
        Kind::Exclusive => waits(vec![ahead.len() - 1]),
        Kind::Shared => match ahead
            .iter()
            .rposition(|e| e.kind == EntryKind::Write && !e.own)
        {
            None => Turn::Holds,
            Some(writer) => waits(vec![writer]),
        },
        Kind::Permit(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if ahead.len() < n {
                Turn::Holds
            } else {
                waits((0..n).collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line of entries ordered 10, 20, 30, ... of the kinds `kinds` spells (`w` a writer's,
    /// `r` a reader's, `o` the asking owner's own writer's hold).
    fn line(kinds: &str) -> Vec<Entry<u32>> {
        (10..)
            .step_by(10)
            .zip(kinds.chars())
            .map(|(order, c)| Entry {
                order,
                kind: if c == 'r' {
                    EntryKind::Read
                } else {
                    EntryKind::Write
                },
                own: c == 'o',
            })
            .collect()
    }

    fn waits(behind: &[usize]) -> Turn {
        Turn::Waits {
            behind: behind.to_vec(),
        }
    }

    #[test]
    fn a_writer_holds_first_in_line_and_else_watches_the_entry_just_ahead() {
        let w = Kind::Exclusive;
        assert_eq!(turn(&line(""), None, w), Turn::Holds);
        assert_eq!(turn(&line("w"), Some(&10), w), Turn::Holds);
        assert_eq!(turn(&line("wrw"), Some(&10), w), Turn::Holds);
        // In the middle, or last: behind the entry just ahead, whatever it is.
        assert_eq!(turn(&line("wrw"), Some(&20), w), waits(&[0]));
        assert_eq!(turn(&line("wrw"), Some(&30), w), waits(&[1]));
        assert_eq!(turn(&line("rr"), Some(&20), w), waits(&[0]));
        // Not there yet: it would come last.
        assert_eq!(turn(&line("w"), None, w), waits(&[0]));
        assert_eq!(turn(&line("rwr"), None, w), waits(&[2]));
        // Its owner's own hold is ahead of it as any other.
        assert_eq!(turn(&line("o"), None, w), waits(&[0]));
    }

    #[test]
    fn a_reader_holds_unless_a_writer_is_ahead_and_else_watches_the_nearest_writer() {
        let r = Kind::Shared;
        assert_eq!(turn(&line(""), None, r), Turn::Holds);
        assert_eq!(turn(&line("rr"), None, r), Turn::Holds);
        // A waiting writer keeps later readers out, not earlier ones.
        assert_eq!(turn(&line("rwr"), None, r), waits(&[1]));
        assert_eq!(turn(&line("rwr"), Some(&10), r), Turn::Holds);
        assert_eq!(turn(&line("rwr"), Some(&30), r), waits(&[1]));
        // Behind several writers: the last of them ahead of it.
        assert_eq!(turn(&line("wrwr"), None, r), waits(&[2]));
        assert_eq!(turn(&line("wrwr"), Some(&20), r), waits(&[0]));
        // The owner's own exclusive hold lets its shared hold in (a downgrade).
        assert_eq!(turn(&line("o"), None, r), Turn::Holds);
        assert_eq!(turn(&line("or"), Some(&20), r), Turn::Holds);
        assert_eq!(turn(&line("ow"), None, r), waits(&[1]));
        assert_eq!(turn(&line("wo"), None, r), waits(&[0]));
    }

    #[test]
    fn a_permit_holds_among_the_n_first_and_else_watches_them() {
        let p = Kind::Permit;
        assert_eq!(turn(&line(""), None, p(1)), Turn::Holds);
        assert_eq!(turn(&line("ww"), None, p(3)), Turn::Holds);
        assert_eq!(turn(&line("www"), None, p(3)), waits(&[0, 1, 2]));
        // First, in the middle, last of the n.
        assert_eq!(turn(&line("wwww"), Some(&10), p(3)), Turn::Holds);
        assert_eq!(turn(&line("wwww"), Some(&20), p(3)), Turn::Holds);
        assert_eq!(turn(&line("wwww"), Some(&30), p(3)), Turn::Holds);
        // Past them: behind all n, whichever goes first.
        assert_eq!(turn(&line("wwww"), Some(&40), p(3)), waits(&[0, 1, 2]));
        // A smaller n than the holders took: no new permit until fewer than n are held.
        assert_eq!(turn(&line("www"), None, p(2)), waits(&[0, 1]));
        assert_eq!(turn(&line("www"), Some(&30), p(2)), waits(&[0, 1]));
        // Readers' entries count as any other (a semaphore has no kinds).
        assert_eq!(turn(&line("rr"), None, p(2)), waits(&[0, 1]));
    }

    #[test]
    fn the_order_decides_not_the_place_an_entry_is_given_at() {
        // The line a store read may be cut short (etcd reads the `n` first permits only):
        // an entry ordered past every entry read has them all ahead of it.
        assert_eq!(
            turn(&line("ww"), Some(&99), Kind::Permit(2)),
            waits(&[0, 1])
        );
        assert_eq!(turn(&line("ww"), Some(&15), Kind::Exclusive), waits(&[0]));
        assert_eq!(turn(&line("ww"), Some(&5), Kind::Exclusive), Turn::Holds);
    }
}

//! Whose turn it is: the ordering rule of Curator's recipes, on the lock's nodes in order,
//! apart from any ZooKeeper call.

/// What a node under a lock's (or semaphore's) node stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeKind {
    /// A writer's (an exclusive holder's, or a writer waiting behind shared holders), or a
    /// permit's.
    Write,
    /// A shared holder's.
    Read,
}

/// One node of the lock, as the ordering sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Node {
    pub(crate) kind: NodeKind,
    /// A write node of the owner that asks (a writer taking a shared hold of its own key:
    /// its exclusive hold does not keep its shared one out).
    pub(crate) own: bool,
}

/// What an attempt asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wants {
    Write,
    Read,
    /// One of this many permits.
    Permit(u32),
}

/// Whether a node at some place in the line is granted, and if not, what it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Turn {
    Granted,
    /// Not yet: the nodes (their places) whose deletion may let it in, each watched once;
    /// `keep`: a writer that waits keeps its node, so that the processes waiting for an
    /// exclusive lock take it in the order they came (Curator's `InterProcessMutex`), and
    /// new shared holders line up behind it (a stream of readers cannot starve it).
    Waits {
        behind: Vec<usize>,
        keep: bool,
    },
}

/// The turn of the node at place `mine` among `nodes` (in creation order; `mine ==
/// nodes.len()` for a node not created yet, which would come last), as Curator's recipes
/// decide it:
///
/// - a writer is granted when it is the lowest; else it keeps its node in line (when it
///   waits at all) and watches the node just before it (every node before it must go, so
///   waiting for any one of them misses nothing): writers go first come, first served;
/// - a reader is granted when no write node is before it, its owner's own excepted; else
///   it watches the nearest such write node (the last of them to go, in line order);
/// - a permit is granted among the `n` lowest nodes; else it watches those `n`: any of
///   them leaving lets it in, and which goes first is not known.
///
/// Each waiter watches only nodes it waits behind, never the lock's children (the herd
/// effect).
pub(crate) fn turn(nodes: &[Node], mine: usize, wants: Wants) -> Turn {
    let before = &nodes[..mine.min(nodes.len())];
    match wants {
        Wants::Write if before.is_empty() => Turn::Granted,
        Wants::Write => Turn::Waits {
            behind: vec![before.len() - 1],
            keep: true,
        },
        Wants::Read => match before
            .iter()
            .rposition(|n| n.kind == NodeKind::Write && !n.own)
        {
            None => Turn::Granted,
            Some(writer) => Turn::Waits {
                behind: vec![writer],
                keep: false,
            },
        },
        Wants::Permit(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if before.len() < n {
                Turn::Granted
            } else {
                Turn::Waits {
                    behind: (0..n).collect(),
                    keep: false,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Node = Node {
        kind: NodeKind::Read,
        own: false,
    };
    const W: Node = Node {
        kind: NodeKind::Write,
        own: false,
    };
    const OWN_W: Node = Node {
        kind: NodeKind::Write,
        own: true,
    };

    fn waits(behind: &[usize], keep: bool) -> Turn {
        Turn::Waits {
            behind: behind.to_vec(),
            keep,
        }
    }

    #[test]
    fn a_writer_goes_when_lowest_and_watches_its_predecessor() {
        assert_eq!(turn(&[], 0, Wants::Write), Turn::Granted);
        assert_eq!(turn(&[W], 0, Wants::Write), Turn::Granted);
        // Behind a writer or readers: it stays in line, watching the node just before it.
        assert_eq!(turn(&[W], 1, Wants::Write), waits(&[0], true));
        assert_eq!(turn(&[W, W], 2, Wants::Write), waits(&[1], true));
        assert_eq!(turn(&[R, R], 2, Wants::Write), waits(&[1], true));
        assert_eq!(turn(&[R, W, R], 3, Wants::Write), waits(&[2], true));
        // Its turn comes when every node before it has gone.
        assert_eq!(turn(&[W, W], 1, Wants::Write), waits(&[0], true));
        assert_eq!(turn(&[W], 0, Wants::Write), Turn::Granted);
    }

    #[test]
    fn a_reader_goes_unless_a_write_node_is_before_it() {
        assert_eq!(turn(&[R, R], 2, Wants::Read), Turn::Granted);
        // A waiting writer keeps later readers out, not earlier ones.
        assert_eq!(turn(&[R, W, R], 3, Wants::Read), waits(&[1], false));
        assert_eq!(turn(&[R, W, R], 0, Wants::Read), Turn::Granted);
        assert_eq!(turn(&[W, R, W], 3, Wants::Read), waits(&[2], false));
        // The owner's own exclusive hold lets its shared hold in (a downgrade).
        assert_eq!(turn(&[OWN_W], 1, Wants::Read), Turn::Granted);
        assert_eq!(turn(&[OWN_W, W], 2, Wants::Read), waits(&[1], false));
    }

    #[test]
    fn a_permit_goes_among_the_n_lowest_and_else_watches_them() {
        assert_eq!(turn(&[W, W], 2, Wants::Permit(3)), Turn::Granted);
        assert_eq!(
            turn(&[W, W, W], 3, Wants::Permit(3)),
            waits(&[0, 1, 2], false)
        );
        assert_eq!(turn(&[W, W, W], 1, Wants::Permit(3)), Turn::Granted);
        // A smaller n than the holders took: no new permit until fewer than n are held.
        assert_eq!(turn(&[W, W, W], 3, Wants::Permit(2)), waits(&[0, 1], false));
    }
}

//! Renewal: whether the holds of a batch are still this session's nodes, with their
//! holders, in two multi-reads.

use zookeeper_client::{Client, Error as ClientError, MultiReadResult};

use super::error::ZkError;
use super::keys::hold_prefix;
use super::store::{ZkStore, child};
use crate::core::hold::value::HoldValue;
use crate::core::watchdog::Due;

impl ZkStore {
    /// Whether each hold of `batch` is still this session's node, with its holder: two
    /// multi-reads for the whole batch (the locks' children, then this session's nodes).
    pub(super) async fn check(&self, client: Client, batch: &[Due]) -> Result<Vec<bool>, ZkError> {
        let mine = hold_prefix(client.session_id().0);
        let mut lists = client.new_multi_reader();
        for due in batch {
            lists.add_get_children(&due.key.0)?;
        }
        let listed = lists.commit().await?;
        if listed.len() != batch.len() {
            return Err(ZkError::Unexpected("a renewal listing"));
        }
        // For each hold, the nodes of this session in its lock (one per holder of the
        // session: several shared holders, a writer's exclusive and shared holds).
        let nodes: Vec<Vec<String>> = batch
            .iter()
            .zip(listed)
            .map(|(due, listed)| match listed {
                MultiReadResult::Children { children } => Ok(children
                    .into_iter()
                    .filter(|c| c.starts_with(&mine))
                    .map(|name| child(&due.key.0, &name))
                    .collect()),
                MultiReadResult::Error {
                    err: ClientError::NoNode,
                } => Ok(Vec::new()),
                MultiReadResult::Error { err } => Err(ZkError::from(err)),
                _ => Err(ZkError::Unexpected("a renewal listing")),
            })
            .collect::<Result<_, _>>()?;
        let mut reads = client.new_multi_reader();
        for path in nodes.iter().flatten() {
            reads.add_get_data(path)?;
        }
        let mut read = if nodes.iter().any(|n| !n.is_empty()) {
            reads.commit().await?.into_iter()
        } else {
            Vec::new().into_iter()
        };
        let mut held = Vec::with_capacity(batch.len());
        for (due, nodes) in batch.iter().zip(&nodes) {
            let mut ours = false;
            for _ in nodes {
                match read.next() {
                    // A hold of its holder (a writer still in line, count 0, is none).
                    Some(MultiReadResult::Data { data, .. }) => {
                        ours |= HoldValue::parse(&data)
                            .is_some_and(|v| v.holder == due.key.1.as_str() && v.count > 0);
                    }
                    Some(MultiReadResult::Error {
                        err: ClientError::NoNode,
                    }) => {}
                    Some(MultiReadResult::Error { err }) => return Err(err.into()),
                    _ => return Err(ZkError::Unexpected("a renewal read")),
                }
            }
            held.push(ours);
        }
        Ok(held)
    }
}

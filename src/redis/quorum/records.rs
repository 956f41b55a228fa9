//! Idempotency records on a quorum: every master keeps the record of a key beside its
//! lock, stored by the hold that ran the handler on every master where it holds; a record
//! counts as stored on a majority.
//!
//! Why any master's copy is the record, and why a master that has it ends an acquisition
//! (acquire.lua's check): the record of a key is written once, by its single holder, so
//! every copy is the same; and a record stored on a majority shares a master with every
//! majority that could grant a later hold, whose attempt there finds it. A master that
//! restarted empty breaks the second (the restart guard keeps it out for one lease; a
//! record lost with it is lost on that master only).

use std::time::Duration;

use bytes::Bytes;

use super::QuorumStore;
use super::error::{MasterFailure, QuorumError};
use crate::error::LockError;
use crate::idempotency::RECORD_CONTEXT;
use crate::redis::keys::LockKey;
use crate::redis::records::Written;

impl QuorumStore {
    /// The record of `key` from any master that has it, read from all at once; none when a
    /// majority answered without it. Fewer answers and none found: the lock service is
    /// down (fail closed: the request might be a retry of a completed one).
    pub(crate) async fn record(&self, key: &LockKey) -> Result<Option<Bytes>, LockError> {
        let replies = self.each(|master| master.record(key)).await;
        Ok(self.copies(replies)?.into_iter().next())
    }

    /// How long the record of `key` still lives: the longest any master that has it says,
    /// read as [`record`](Self::record) reads the record.
    pub(crate) async fn record_ttl(&self, key: &LockKey) -> Result<Option<Duration>, LockError> {
        let replies = self.each(|master| master.record_ttl(key)).await;
        Ok(self.copies(replies)?.into_iter().max())
    }

    /// The masters' copies of a record (any one is the record: it is written once, by its
    /// single holder) from their replies: none when a majority answered without one, an
    /// error when fewer answered and none has one.
    fn copies<T>(
        &self,
        replies: Vec<Result<Option<T>, MasterFailure>>,
    ) -> Result<Vec<T>, LockError> {
        let mut answered = 0;
        let mut copies = Vec::new();
        let mut failures = Vec::new();
        for reply in replies {
            match reply {
                Ok(copy) => {
                    answered += 1;
                    copies.extend(copy);
                }
                Err(failure) => failures.push(failure),
            }
        }
        if !copies.is_empty() || answered >= self.majority() {
            return Ok(copies);
        }
        let error = QuorumError::no_majority(answered, self.masters.len(), failures);
        Err(LockError::backend(RECORD_CONTEXT, error))
    }

    /// Stores `written` on every master at once where its hold still holds `key`: stored
    /// when a majority stored it; not stored when a majority answered and fewer stored it
    /// (the hold is lost); an error when fewer than a majority answered.
    pub(crate) async fn store_record(
        &self,
        key: &LockKey,
        written: &Written,
    ) -> Result<bool, LockError> {
        let replies = self.each(|master| master.store_record(key, written)).await;
        let stored = replies.iter().filter(|r| matches!(r, Ok(true))).count();
        if stored >= self.majority() {
            return Ok(true);
        }
        self.of_majority(replies)
            .map_err(|e| LockError::backend(RECORD_CONTEXT, e))?;
        Ok(false)
    }
}

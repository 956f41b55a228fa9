//! Idempotency records in ZooKeeper: a persistent node per lock,
//! `/<namespace>/records/<bucket>/{<key>}`, its data the record's retention and the record,
//! written by one multi whose first op checks the version of the hold node that ran the
//! handler; deleted once expired by a fetch that meets it and by the backend's janitor.
//!
//! # Where
//!
//! Not under the lock's node: that is a container, which ZooKeeper deletes once it has no
//! children, and a record kept there for its retention (a day by default) would keep every
//! used key's container too. Beside the locks instead, in the namespace's `records` node
//! (no lock's name is `records`: a lock's begins with `{`), spread over [`BUCKETS`] bucket
//! nodes by a hash of the key, so that one sweep of the janitor lists one bucket, a 64th
//! of the records, and never the whole namespace (ZooKeeper has no paged listing).
//!
//! # Whose clock
//!
//! ZooKeeper has no TTL for a node without `extendedTypesEnabled`, so expiry is the
//! crate's: a record expires at its node's `mtime`, the leader's clock when it was written,
//! plus its retention, both on the ensemble's clock. The janitor reads that clock at every
//! sweep (a write to the `records` node, whose new `mtime` is the ensemble's now), deletes
//! what expired by it, and keeps the offset from this host's clock, by which a fetch judges
//! a record it reads (off by the time the answer took, so late rather than early, instead
//! of by this host's skew). Only a backend an `IdempotencyLayer` was made on sweeps.
//!
//! # Size
//!
//! ZooKeeper refuses a request over `jute.maxbuffer` (1 MiB by default) by closing the
//! connection, which would fail every call in flight on the session: a record that would
//! not fit is refused here, before it is sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use zookeeper_client::{
    Acls, Client, CreateMode, Error as ClientError, MultiReadResult, MultiWriteError,
};

use super::ZooKeeperBackend;
use super::error::ZkError;
use super::keys::ZkKey;
use super::line::line;
use super::store::{ROUNDS, ZkStore, child, token};
use crate::core::kit::turn::EntryKind;
use crate::error::LockError;
use crate::idempotency::{IdempotencyBackend, Records, RecordsOf, bounded};
use crate::lock::{BoxFuture, HeldLock};

/// The bucket nodes records are spread over.
const BUCKETS: u32 = 64;

/// ZooKeeper's default `jute.maxbuffer`: the largest request a server takes.
const MAX_REQUEST: usize = 0xfffff;

/// Room kept in a request for what is not the record's data (the multi's headers, the
/// check op, the path twice, the ACL).
const REQUEST_OVERHEAD: usize = 2048;

/// The record's data begins with its retention in milliseconds, big-endian.
const HEADER: usize = 8;

/// Records read by one multi-read of a sweep.
const SWEEP_READS: usize = 16;

/// The records of a namespace: where they live, the ensemble's clock, and when each
/// bucket has a record to delete next, as far as this backend knows.
pub(crate) struct Shelf {
    /// `/<namespace>/records`.
    root: String,
    /// The ensemble's clock minus this host's, in milliseconds, as the last sweep read it.
    offset_ms: AtomicI64,
    /// The bucket the next sweep lists in turn.
    next: AtomicU32,
    /// Per bucket, the earliest expiry (the ensemble's clock) of a record this backend
    /// stored there or its last sweep of it left; `i64::MAX` when none is known.
    due: [AtomicI64; BUCKETS as usize],
    /// Whether an `IdempotencyLayer` was made on the backend: only then does it sweep
    /// (a backend that only locks writes nothing for records).
    used: AtomicBool,
}

impl Shelf {
    /// The records of the namespace whose node is `namespace_root`.
    pub(crate) fn new(namespace_root: &str) -> Self {
        Shelf {
            root: format!("{namespace_root}/records"),
            offset_ms: AtomicI64::new(0),
            next: AtomicU32::new(0),
            due: std::array::from_fn(|_| AtomicI64::new(i64::MAX)),
            used: AtomicBool::new(false),
        }
    }

    /// The node that holds the records' buckets.
    pub(crate) fn root(&self) -> &str {
        &self.root
    }

    fn bucket(&self, n: u32) -> String {
        format!("{}/{n:02x}", self.root)
    }

    /// The record node of the lock at `lock` (its last segment, `{<key>}`, in its bucket),
    /// and its bucket's number.
    fn path(&self, lock: &str) -> (String, u32) {
        let name = lock.rsplit('/').next().unwrap_or(lock);
        // FNV-1a: the same bucket in every process and build.
        let hash = name.bytes().fold(0x811c_9dc5_u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        });
        let n = hash % BUCKETS;
        (format!("{}/{name}", self.bucket(n)), n)
    }

    /// Reads the ensemble's clock (a write to the records' node: its new `mtime`), keeps
    /// its offset from this host's, and answers it.
    pub(crate) async fn tick(&self, client: &Client) -> Result<i64, ZkError> {
        let stat = client.set_data(&self.root, &[], None).await?;
        self.offset_ms
            .store(stat.mtime - local_ms(), Ordering::Relaxed);
        Ok(stat.mtime)
    }

    /// The ensemble's clock, as far as this host can tell.
    fn now_ms(&self) -> i64 {
        local_ms().saturating_add(self.offset_ms.load(Ordering::Relaxed))
    }

    /// A record stored in bucket `n` expires at `expires`.
    fn stored(&self, n: u32, expires: i64) {
        if let Some(due) = self.due.get(n as usize) {
            due.fetch_min(expires, Ordering::Relaxed);
        }
    }

    /// One sweep of the janitor on `client`'s session: reads the ensemble's clock, then
    /// deletes the expired records of the buckets known to have some, and of the next
    /// bucket in turn (those other backends stored); how many it deleted.
    pub(crate) async fn sweep(&self, client: Client) -> Result<i64, ZkError> {
        if !self.used.load(Ordering::Relaxed) {
            return Ok(0);
        }
        let now = self.tick(&client).await?;
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % BUCKETS;
        let mut deleted = 0;
        for n in 0..BUCKETS {
            let due = &self.due[n as usize];
            if n != turn && due.load(Ordering::Relaxed) > now {
                continue;
            }
            // What this sweep leaves decides when the bucket is due again.
            due.store(i64::MAX, Ordering::Relaxed);
            let (gone, next) = self.sweep_bucket(&client, n, now).await?;
            due.fetch_min(next, Ordering::Relaxed);
            deleted += gone;
        }
        Ok(deleted)
    }

    /// Deletes the records of bucket `n` expired by `now`: how many, and the earliest
    /// expiry of those left.
    async fn sweep_bucket(&self, client: &Client, n: u32, now: i64) -> Result<(i64, i64), ZkError> {
        let bucket = self.bucket(n);
        let names = match client.list_children(&bucket).await {
            Ok(names) => names,
            Err(ClientError::NoNode) => return Ok((0, i64::MAX)),
            Err(e) => return Err(e.into()),
        };
        let (mut deleted, mut next) = (0, i64::MAX);
        for names in names.chunks(SWEEP_READS) {
            let mut reads = client.new_multi_reader();
            for name in names {
                reads.add_get_data(&child(&bucket, name))?;
            }
            for (name, read) in names.iter().zip(reads.commit().await?) {
                let MultiReadResult::Data { data, stat } = read else {
                    continue;
                };
                let Some((expires, _)) = split(&data, stat.mtime) else {
                    continue;
                };
                if expires > now {
                    next = next.min(expires);
                    continue;
                }
                // Its version: a record stored again since stays.
                match client
                    .delete(&child(&bucket, name), Some(stat.version))
                    .await
                {
                    Ok(()) => deleted += 1,
                    Err(ClientError::NoNode | ClientError::BadVersion) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok((deleted, next))
    }
}

/// This host's clock, in milliseconds since 1970.
fn local_ms() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

/// When the record `data` of a node last written at `mtime` expires, on the ensemble's
/// clock, and the record; `None` for data this crate never writes.
fn split(data: &[u8], mtime: i64) -> Option<(i64, &[u8])> {
    let (retention, record) = data.split_first_chunk::<HEADER>()?;
    let retention = i64::try_from(u64::from_be_bytes(*retention)).unwrap_or(i64::MAX);
    Some((mtime.saturating_add(retention), record))
}

/// Creates the persistent node `path` if it is missing, with `acls`.
async fn ensure(client: &Client, path: &str, acls: Acls<'static>) -> Result<(), ClientError> {
    let persistent = CreateMode::Persistent.with_acls(acls);
    match client.create(path, &[], &persistent).await {
        Ok(_) | Err(ClientError::NodeExists) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Creates the records' node if it is missing, with `acls` (at build: it proves the
/// right to).
pub(crate) async fn prepare(
    client: &Client,
    shelf: &Shelf,
    acls: Acls<'static>,
) -> Result<(), ClientError> {
    ensure(client, shelf.root(), acls).await
}

impl RecordsOf for ZooKeeperBackend {
    fn records(&self) -> Arc<dyn Records> {
        self.inner.store.shelf.used.store(true, Ordering::Relaxed);
        Arc::new(self.clone())
    }
}

impl IdempotencyBackend for ZooKeeperBackend {}

impl ZooKeeperBackend {
    /// Runs `call` on the store for `key`'s record (the key checked as a lock's, the
    /// janitor running), bounded by the command timeout.
    fn on_record<T, F, Fut>(&self, key: String, call: F) -> BoxFuture<'static, Result<T, LockError>>
    where
        F: FnOnce(Arc<ZkStore>, ZkKey) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, ZkError>> + Send,
        T: Send + 'static,
    {
        let (store, bound) = (
            self.inner.store.clone(),
            self.inner.settings.command_timeout,
        );
        Box::pin(async move {
            store.janitor.ensure_running();
            let key = ZkKey::new(&store.root, key, store.max_key_len, false)?;
            bounded(bound, call(store, key)).await
        })
    }
}

impl Records for ZooKeeperBackend {
    fn fetch(&self, key: String) -> BoxFuture<'static, Result<Option<Bytes>, LockError>> {
        self.on_record(
            key,
            |store, key| async move { store.fetch_record(&key).await },
        )
    }

    fn remaining(&self, key: String) -> BoxFuture<'static, Result<Option<Duration>, LockError>> {
        self.on_record(key, |store, key| async move {
            let found = store.live_record(&key).await?;
            let left = found.map(|(expires, _)| expires.saturating_sub(store.shelf.now_ms()));
            Ok(left.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
        })
    }

    fn store(
        &self,
        key: String,
        held: HeldLock,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<'static, Result<bool, LockError>> {
        self.on_record(key, move |store, key| async move {
            let (holder, token) = (held.owner().as_str(), held.fencing_token());
            let stored = store
                .store_record(&key, holder, token, &record, retention)
                .await;
            match stored {
                // The session that held the hold ended (its holds went with it): nothing
                // is held to store under.
                Err(e) if e.session_ended() => Ok(false),
                stored => stored,
            }
        })
    }
}

impl ZkStore {
    /// The record of `key`'s lock, if any and not expired (an expired one is deleted on
    /// the way, unless it was stored again meanwhile).
    async fn fetch_record(&self, key: &ZkKey) -> Result<Option<Bytes>, ZkError> {
        let found = self.live_record(key).await?;
        Ok(found.map(|(_, data)| Bytes::from(data).slice(HEADER..)))
    }

    /// The node of `key`'s record, if it has one that has not expired: when it expires (on
    /// the ensemble's clock) and its data; an expired one is deleted.
    async fn live_record(&self, key: &ZkKey) -> Result<Option<(i64, Vec<u8>)>, ZkError> {
        let client = self.session.client();
        let (path, _) = self.shelf.path(&key.path);
        let (data, stat) = match client.get_data(&path).await {
            Ok(found) => found,
            Err(ClientError::NoNode) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let (expires, _) = split(&data, stat.mtime).ok_or(ZkError::Foreign)?;
        if expires > self.shelf.now_ms() {
            return Ok(Some((expires, data)));
        }
        match client.delete(&path, Some(stat.version)).await {
            Ok(()) | Err(ClientError::NoNode | ClientError::BadVersion) => {}
            Err(error) => tracing::debug!(%error, "could not delete an expired record"),
        }
        Ok(None)
    }

    /// Stores `record` for `key` for `retention` if `holder`'s hold with the token
    /// `token_of_hold` is still this session's node: one multi, the version of the hold
    /// node just read checked first. (A node deleted and created again under the same
    /// name would pass: its name carries the session and the lock node's sequence, which
    /// repeats only if ZooKeeper deleted the lock's emptied container and it was made
    /// again between the read and the multi.)
    async fn store_record(
        &self,
        key: &ZkKey,
        holder: &str,
        token_of_hold: u64,
        record: &[u8],
        retention: Duration,
    ) -> Result<bool, ZkError> {
        let (path, bucket) = self.shelf.path(&key.path);
        if HEADER + record.len() + 2 * path.len() + REQUEST_OVERHEAD > MAX_REQUEST {
            return Err(ZkError::RecordTooLarge(record.len()));
        }
        let retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
        let mut data = Vec::with_capacity(HEADER + record.len());
        data.extend_from_slice(&retention_ms.to_be_bytes());
        data.extend_from_slice(record);
        let client = self.session.client();
        let acls = self.session.acls();
        let persistent = CreateMode::Persistent.with_acls(acls);
        // An expired record not deleted yet is written over.
        let mut replace = false;
        for _ in 0..ROUNDS {
            let now = line(&client, &key.path, |kind, mine| {
                mine && kind == EntryKind::Write
            })
            .await?;
            let hold = now.find(holder).map(|at| &now.0[at]);
            let Some((entry, (_, stat))) = hold.and_then(|e| Some((e, e.value.as_ref()?))) else {
                return Ok(false);
            };
            if !entry.holds() || token(stat) != token_of_hold {
                return Ok(false);
            }
            let mut multi = client.new_multi_writer();
            multi.add_check_version(&child(&key.path, &entry.name), stat.version)?;
            if replace {
                multi.add_set_data(&path, &data, None)?;
            } else {
                multi.add_create(&path, &data, &persistent)?;
            }
            match multi.commit().await {
                Ok(_) => {
                    let expires = i64::try_from(retention_ms).unwrap_or(i64::MAX);
                    self.shelf
                        .stored(bucket, self.shelf.now_ms().saturating_add(expires));
                    return Ok(true);
                }
                // The hold changed (read again) or went (then none is found).
                Err(MultiWriteError::OperationFailed { index: 0, .. }) => {}
                Err(MultiWriteError::OperationFailed { source, .. }) => match source {
                    ClientError::NodeExists => replace = true,
                    ClientError::NoNode if replace => replace = false,
                    ClientError::NoNode => {
                        ensure(&client, self.shelf.root(), acls).await?;
                        ensure(&client, &parent(&path), acls).await?;
                    }
                    e => return Err(e.into()),
                },
                Err(MultiWriteError::RequestFailed { source }) => return Err(source.into()),
            }
        }
        Err(ZkError::Contended)
    }
}

/// The parent of the node `path`.
fn parent(path: &str) -> String {
    path.rsplit_once('/').map_or("", |(p, _)| p).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_has_one_record_node_in_a_bucket_of_the_records_node() {
        let shelf = Shelf::new("/ns");
        let (path, n) = shelf.path("/ns/{idempotency:4:acme:k1}");
        let (bucket, name) = path.rsplit_once('/').unwrap();
        assert_eq!(name, "{idempotency:4:acme:k1}");
        assert_eq!(
            (parent(bucket).as_str(), bucket),
            ("/ns/records", &*shelf.bucket(n))
        );
        assert_eq!(path, shelf.path("/ns/{idempotency:4:acme:k1}").0);
        let buckets: std::collections::HashSet<_> = (0..256)
            .map(|n| shelf.path(&format!("/ns/{{k{n}}}")).1)
            .collect();
        assert_eq!(buckets.len(), BUCKETS as usize, "every bucket is used");
    }

    #[test]
    fn a_record_expires_its_retention_after_its_nodes_mtime() {
        let mut data = 500_u64.to_be_bytes().to_vec();
        data.extend_from_slice(b"rec");
        assert_eq!(split(&data, 1_000), Some((1_500, &b"rec"[..])));
        assert_eq!(split(b"short", 1_000), None);
    }
}

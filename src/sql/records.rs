//! Idempotency records in a SQL store: a row of the table `{table}_records` per lock name
//! (the lock's own row name), with its expiry on the server's clock; written by the
//! `record_store` routine only while the hold that ran the handler holds the name, and
//! deleted by the janitor once expired.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sqlx::{Decode, Encode, Executor, IntoArguments, Type};

use super::{Calls, SqlError, SqlKey, SqlStore, millis, token};
use crate::error::LockError;
use crate::idempotency::{Records, bounded};
use crate::lock::{BoxFuture, HeldLock};

/// The records of a SQL store, each call bounded by the backend's command timeout.
pub(crate) struct SqlRecords<D: Calls> {
    store: Arc<SqlStore<D>>,
    command_timeout: Duration,
}

impl<D: Calls> SqlRecords<D> {
    /// The records beside `store`'s locks, each call bounded by `command_timeout`.
    pub(crate) fn new(store: Arc<SqlStore<D>>, command_timeout: Duration) -> Arc<Self> {
        Arc::new(SqlRecords {
            store,
            command_timeout,
        })
    }
}

impl<D> Records for SqlRecords<D>
where
    D: Calls,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'r> Vec<u8>: Decode<'r, D> + Type<D>,
    for<'r> i64: Decode<'r, D> + Type<D>,
    usize: sqlx::ColumnIndex<D::Row>,
{
    fn fetch(&self, key: String) -> BoxFuture<'static, Result<Option<Bytes>, LockError>> {
        let (store, bound) = (self.store.clone(), self.command_timeout);
        Box::pin(async move {
            let key = SqlKey::new::<D>(&store.namespace, key, store.max_key_len, false)?;
            let fetch = sqlx::query_scalar::<_, Vec<u8>>(&store.sql.record_fetch)
                .bind(&*key.name)
                .fetch_optional(&store.pool);
            let record = bounded(bound, async { fetch.await.map_err(SqlError::<D>::from) }).await?;
            Ok(record.map(Bytes::from))
        })
    }

    fn remaining(&self, key: String) -> BoxFuture<'static, Result<Option<Duration>, LockError>> {
        let (store, bound) = (self.store.clone(), self.command_timeout);
        Box::pin(async move {
            let key = SqlKey::new::<D>(&store.namespace, key, store.max_key_len, false)?;
            let fetch = sqlx::query_scalar::<_, i64>(&store.sql.record_remaining)
                .bind(&*key.name)
                .fetch_optional(&store.pool);
            let micros = bounded(bound, async { fetch.await.map_err(SqlError::<D>::from) }).await?;
            Ok(micros.map(|micros| Duration::from_micros(u64::try_from(micros).unwrap_or(0))))
        })
    }

    fn store(
        &self,
        key: String,
        held: HeldLock,
        record: Bytes,
        retention: Duration,
    ) -> BoxFuture<'static, Result<bool, LockError>> {
        let (store, bound) = (self.store.clone(), self.command_timeout);
        Box::pin(async move {
            let key = SqlKey::new::<D>(&store.namespace, key, store.max_key_len, false)?;
            let call = D::record_store(
                &store,
                &key.name,
                token(held.fencing_token()),
                millis(retention),
                &record,
            );
            bounded(bound, call).await
        })
    }
}

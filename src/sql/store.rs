//! The SQL stores as the core's [`Store`]: what both do alike (the key names, the remaining
//! lease, withdrawing a waiting writer, the operator calls and their log) is written here
//! once; the calls whose SQL and replies differ (an attempt, a release, a renewal batch, an
//! operator's call, a page of held names, storing an idempotency record) are each server's
//! [`Calls`].

use std::sync::Arc;
use std::time::Duration;

use sqlx::{Decode, Encode, Executor, IntoArguments, Type};

use super::{Dialect, SqlError, SqlKey};
use crate::core::kit::keys::{namespaced_prefix, parse_namespaced};
use crate::core::runtime::Daemon;
use crate::core::store::{
    Attempt, Attempted, HeldPage, Release, Released, Sent, Store, StoreKey, replies,
};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, Kind, LockOwner};

/// How many rows of the lock table one page of a listing reads (see [`Calls::held_page`]).
pub(crate) const HELD_PAGE: usize = 500;

/// A row of a listing's page (see [`Calls::held_page`]).
pub(crate) struct HeldRow {
    /// The row's name in the lock table.
    pub(crate) name: String,
    /// Whether the name is under the listing's prefix and held now.
    pub(crate) held: bool,
}

/// Locks in one SQL database, in the table (and its routines) named `table`.
pub(crate) struct SqlStore<D: Calls> {
    pub(crate) pool: sqlx::Pool<D>,
    pub(crate) sql: Statements,
    /// The connection this backend's waiters are woken through.
    pub(crate) wake: D::Wake,
    /// Deletes the rows of names unused for the fence retention, and expired records.
    pub(crate) janitor: Daemon,
    pub(crate) namespace: String,
    pub(crate) table: String,
    pub(crate) max_key_len: usize,
    /// This backend's instance id: a run of its holders ends by freeing the lock when
    /// another instance waits for it.
    pub(crate) instance: String,
    /// Where force-releases are announced (see [`admin_channel`](super::admin_channel)).
    pub(crate) admin_channel: String,
}

/// The statements of the lock protocol, for the table's routines; each server writes its
/// own (see [`Calls::statements`]).
///
/// The common cases, a free lock taken and a lone hold freed, are single plain statements
/// (`acquire_free`, `release_last`): a routine's call costs several times their server
/// time. When one finds its case does not apply it changes nothing, and the routine that
/// covers every case runs next.
pub(crate) struct Statements {
    pub(crate) acquire_free: String,
    pub(crate) acquire: String,
    pub(crate) release_last: String,
    pub(crate) release: String,
    pub(crate) renew: String,
    pub(crate) shared_acquire: String,
    pub(crate) permit_acquire: String,
    pub(crate) holder_release: String,
    /// Takes the name; answers the lease left in milliseconds, no row when it is free.
    pub(crate) remaining: String,
    /// Takes the name, the holder, the channel and whether to wake the waiters.
    pub(crate) withdraw: String,
    pub(crate) inspect: String,
    /// Reads one page of names for a listing (see [`Calls::held_page`]).
    pub(crate) held_page: String,
    pub(crate) force_release: String,
    pub(crate) sweep: String,
    /// Takes the name; answers the name's unexpired idempotency record, no row when none.
    pub(crate) record_fetch: String,
    /// Takes the name; selects how long its record still lives, in microseconds on the
    /// server's clock, if it has one.
    pub(crate) record_remaining: String,
    /// Takes the name, the hold's token, the retention in milliseconds and the record
    /// (see [`Calls::record_store`]).
    pub(crate) record_store: String,
}

/// What an attempt came back with, and what it went out on (see [`Sent`]): `()`, as a
/// call is one statement or one `CALL`, its transaction committed inside.
pub(crate) type SqlSent<D> = (Result<Attempted, SqlError<D>>, Option<()>);

/// The calls of one server's store whose SQL and replies are its own.
pub(crate) trait Calls: Dialect {
    /// The connection waiters are woken through.
    type Wake: Send + Sync + 'static;

    /// The statements for the lock table `table`.
    fn statements(table: &str) -> Statements;

    /// Registers a waiter on `channel` with the wake connection.
    fn register(wake: &Self::Wake, channel: &str) -> Waiter;

    /// One acquisition attempt (see [`Store::attempt`]).
    fn attempt(
        store: Arc<SqlStore<Self>>,
        key: Arc<SqlKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, SqlSent<Self>>;

    /// One release (see [`Store::release`]).
    fn release<'a>(
        store: &'a SqlStore<Self>,
        key: &'a SqlKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, SqlError<Self>>>;

    /// One renewal batch (see [`Store::renew`]).
    fn renew<'a>(
        store: &'a SqlStore<Self>,
        batch: &'a [Due],
    ) -> BoxFuture<'a, Result<Vec<bool>, SqlError<Self>>>;

    /// One sweep of the janitor: the `sweep` statement with `(keep_ms, limit)`, to how many
    /// names went.
    fn sweep(
        pool: sqlx::Pool<Self>,
        sweep: String,
        keep_ms: i64,
        limit: i32,
    ) -> BoxFuture<'static, Result<i64, sqlx::Error>>;

    /// Stores an idempotency record: the `record_store` statement with the row's `name`, the
    /// `token` of the hold that ran the handler, the retention in milliseconds and the
    /// record; whether it stored it (only while that hold holds the name).
    fn record_store<'a>(
        store: &'a SqlStore<Self>,
        name: &'a str,
        token: i64,
        retention_ms: i64,
        record: &'a [u8],
    ) -> BoxFuture<'a, Result<bool, SqlError<Self>>>;

    /// One page of the lock table for `LockBackend::list_held`, the `held_page` statement:
    /// up to [`HELD_PAGE`] rows after the name `after` (`""`: from the first) in the order
    /// of the table's primary key, each row's name and whether the name starts with the
    /// bytes of `prefix` and is held now (an exclusive lease, or a shared or permit
    /// holder's, still runs). A server whose order keeps the names under `prefix` together
    /// reads only those. Plain reads: nothing is locked, and no acquisition waits for them.
    /// Fewer than [`HELD_PAGE`] rows: the last page.
    fn held_page<'a>(
        store: &'a SqlStore<Self>,
        prefix: &'a str,
        after: &'a str,
    ) -> BoxFuture<'a, Result<Vec<HeldRow>, SqlError<Self>>>;

    /// An operator's `statement` (`inspect`, or `force_release` when `announced`, which
    /// also takes the key's channel and the admin channel) on `key`: its reply's integers.
    fn operator<'a>(
        store: &'a SqlStore<Self>,
        statement: &'a str,
        key: &'a SqlKey,
        semaphore: bool,
        announced: bool,
    ) -> BoxFuture<'a, Result<Vec<i64>, SqlError<Self>>>;
}

impl<D> Store for SqlStore<D>
where
    D: Calls,
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    for<'q> D::Arguments<'q>: IntoArguments<'q, D>,
    for<'q> &'q str: Encode<'q, D> + Type<D>,
    for<'q> bool: Encode<'q, D> + Type<D>,
    for<'r> i64: Decode<'r, D> + Type<D>,
    usize: sqlx::ColumnIndex<D::Row>,
{
    type Key = SqlKey;
    type Error = SqlError<D>;
    // A release after a call of unknown outcome needs no particular connection (see
    // [`SqlSent`]).
    type Sent = ();

    fn key(&self, user: String, kind: Kind) -> Result<SqlKey, LockError> {
        let semaphore = matches!(kind, Kind::Permit(_));
        Ok(SqlKey::new::<D>(
            &self.namespace,
            user,
            self.max_key_len,
            semaphore,
        )?)
    }

    fn attempt(
        self: &Arc<Self>,
        key: &Arc<SqlKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>> {
        // Runs again on this caller's runtime if the one it ran on is gone.
        self.janitor.ensure_running();
        D::attempt(self.clone(), key.clone(), attempt)
    }

    fn release<'a>(
        &'a self,
        key: &'a SqlKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, SqlError<D>>> {
        D::release(self, key, release)
    }

    fn release_after<'a>(
        &'a self,
        key: &'a SqlKey,
        release: &'a Release<'a>,
        (): (),
    ) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.release(key, release).await.is_ok() })
    }

    fn renew<'a>(&'a self, batch: &'a [Due]) -> BoxFuture<'a, Result<Vec<bool>, SqlError<D>>> {
        D::renew(self, batch)
    }

    fn subscribe(&self, key: &SqlKey) -> Waiter {
        D::register(&self.wake, &key.channel)
    }

    fn remaining(self: &Arc<Self>, key: &Arc<SqlKey>) -> BoxFuture<'static, Option<Duration>> {
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            let ms = sqlx::query_scalar::<_, i64>(&store.sql.remaining)
                .bind(&*key.name)
                .fetch_optional(&store.pool)
                .await
                .ok()??;
            u64::try_from(ms).ok().map(Duration::from_millis)
        })
    }

    fn inspect(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let store = self.clone();
        Box::pin(async move { store.operator(&store.sql.inspect, user, of, false).await })
    }

    fn held_page(
        self: &Arc<Self>,
        prefix: Arc<str>,
        from: Option<String>,
    ) -> BoxFuture<'static, Result<HeldPage, LockError>> {
        let store = self.clone();
        Box::pin(async move {
            // No key holds a control character, and PostgreSQL's text holds no NUL.
            if prefix.contains(char::is_control) {
                return Ok(HeldPage::default());
            }
            let under = namespaced_prefix(&store.namespace, &prefix);
            // The cursor is the last name of the page before.
            let after = from.unwrap_or_default();
            let rows = D::held_page(&store, &under, &after)
                .await
                .map_err(|e| LockError::backend("list_held", e))?;
            let next = match rows.last() {
                Some(last) if rows.len() >= HELD_PAGE => Some(last.name.clone()),
                _ => None,
            };
            let keys = rows
                .into_iter()
                .filter(|row| row.held)
                .filter_map(|row| parse_namespaced(&store.namespace, &row.name))
                .collect();
            Ok(HeldPage { keys, next })
        })
    }

    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let store = self.clone();
        Box::pin(async move {
            store
                .operator(&store.sql.force_release, user, of, true)
                .await
        })
    }

    fn withdraw_writer(
        self: &Arc<Self>,
        key: &Arc<SqlKey>,
        holder: LockOwner,
        wake: bool,
    ) -> BoxFuture<'static, ()> {
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            let withdrawn = sqlx::query(&store.sql.withdraw)
                .bind(&*key.name)
                .bind(holder.as_str())
                .bind(key.channel.as_str())
                .bind(wake)
                .execute(&store.pool);
            if let Err(error) = withdrawn.await {
                // Its registration runs out with the wait it was made for.
                tracing::debug!(key = %key.name, %error, "could not withdraw a waiting writer");
            }
        })
    }
}

impl<D: Calls> SqlStore<D> {
    /// Runs an operator's call (`inspect` or `force_release`) on `user`'s lock or semaphore.
    async fn operator(
        &self,
        statement: &str,
        user: String,
        of: Primitive,
        announced: bool,
    ) -> Result<LockInfo, LockError> {
        let semaphore = of == Primitive::Semaphore;
        let key = SqlKey::new::<D>(&self.namespace, user, self.max_key_len, semaphore)?;
        let context = if announced {
            "force_release"
        } else {
            "inspect"
        };
        let reply = D::operator(self, statement, &key, semaphore, announced)
            .await
            .map_err(|e| LockError::backend(context, e))?;
        replies::snapshot(key.user().to_owned(), &reply)
            .ok_or_else(|| LockError::backend(context, SqlError::<D>::unexpected(context)))
    }
}

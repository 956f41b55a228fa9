//! The PostgreSQL store: the core's primitive calls as one statement each, calling the
//! crate's SQL functions (schema.sql), with waiters woken by the listener.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Postgres;
use sqlx::postgres::PgPool;

use super::error::PgError;
use super::listen::Listener;
use crate::core::runtime::Daemon;
use crate::core::store::{Attempt, Attempted, Release, Released, Sent, Store, StoreKey};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::error::{KeyError, LockError};
use crate::lock::inspect::{LockInfo, Primitive};
use crate::lock::{BoxFuture, Kind, LockOwner};
use crate::sql::{SqlKey, millis, token};

/// Locks in one PostgreSQL database, in the table (and its functions) named `table`.
pub(crate) struct PgStore {
    pub(crate) pool: PgPool,
    pub(crate) sql: Statements,
    pub(crate) listener: Listener,
    /// Deletes the rows of names unused for the fence retention.
    pub(crate) janitor: Daemon,
    pub(crate) namespace: String,
    pub(crate) table: String,
    pub(crate) max_key_len: usize,
    /// This backend's instance id: a run of its holders ends by freeing the lock when
    /// another instance waits for it.
    pub(crate) instance: String,
    /// Where force-releases are announced (see [`admin_channel`](crate::sql::admin_channel)).
    pub(crate) admin_channel: String,
}

/// The statements of the lock protocol, for the table's functions.
///
/// The common cases, a free lock taken and a lone hold freed, are single plain statements
/// (`acquire_free`, `release_last`): a PL/pgSQL call costs several times their server
/// time. When one finds its case does not apply it changes nothing, and the function that
/// covers every case runs next.
pub(crate) struct Statements {
    acquire_free: String,
    acquire: String,
    release_last: String,
    release: String,
    renew: String,
    shared_acquire: String,
    permit_acquire: String,
    holder_release: String,
    remaining: String,
    withdraw: String,
    inspect: String,
    force_release: String,
    pub(crate) sweep: String,
}

impl Statements {
    pub(crate) fn new(table: &str) -> Self {
        Statements {
            // A new name, or a free row not left to another waiting instance; as
            // {table}_acquire's path for them.
            acquire_free: format!(
                "INSERT INTO {table} AS l (name, owner, count, expires, token, fence, touched) \
                 VALUES ($1, $2, 1, now() + $3 * interval '1 millisecond', \
                     (extract(epoch FROM now()) * 1000000)::bigint, \
                     (extract(epoch FROM now()) * 1000000)::bigint + $4, now()) \
                 ON CONFLICT (name) DO UPDATE \
                 SET owner = $2, count = 1, expires = now() + $3 * interval '1 millisecond', \
                     token = greatest(l.fence + 1, EXCLUDED.token), \
                     fence = greatest(l.fence + 1, EXCLUDED.token) + $4, undone = '{{}}', \
                     touched = now(), \
                     waiter = CASE WHEN l.waiter = $5 THEN NULL ELSE l.waiter END \
                 WHERE (l.owner IS NULL OR l.expires <= now()) AND l.readers = 0 \
                     AND l.writers = 0 AND NOT ($6 AND l.waiter IS NOT NULL \
                     AND l.waiter <> $5 AND l.waiter_until > now()) \
                 RETURNING token"
            ),
            acquire: format!("SELECT {table}_acquire($1, $2, $3, $4, $5, $6, $7)"),
            // The holder's only hold, no successor, nobody reading: freed, and the waiters
            // told when it commits; as {table}_release's last path.
            release_last: format!(
                "WITH freed AS (UPDATE {table} \
                     SET owner = NULL, count = 0, expires = NULL, undone = '{{}}', \
                         token = coalesce($3, token), \
                         fence = greatest(fence, coalesce($3, token)), touched = now() \
                     WHERE name = $1 AND owner = $2 AND count = 1 AND expires > now() \
                         AND readers = 0 AND NOT ($4 = ANY (undone)) \
                     RETURNING 1) \
                 SELECT count(pg_notify($5, '')) FROM freed"
            ),
            release: format!(
                "SELECT {table}_release($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
            ),
            renew: format!("SELECT {table}_renew($1, $2, $3)"),
            shared_acquire: format!("SELECT {table}_shared_acquire($1, $2, $3, $4)"),
            permit_acquire: format!("SELECT {table}_permit_acquire($1, $2, $3, $4)"),
            holder_release: format!("SELECT {table}_holder_release($1, $2, $3, $4, $5, $6)"),
            remaining: format!(
                "SELECT {table}_ms(clock_timestamp(), expires) FROM {table} \
                 WHERE name = $1 AND owner IS NOT NULL"
            ),
            withdraw: format!("SELECT {table}_withdraw($1, $2, $3, $4)"),
            inspect: format!("SELECT {table}_inspect($1, $2)"),
            force_release: format!("SELECT {table}_force_release($1, $2, $3, $4)"),
            sweep: format!("SELECT {table}_sweep($1, $2)"),
        }
    }
}

impl Store for PgStore {
    type Key = SqlKey;
    type Error = PgError;
    // A call is one autocommitted statement: a release after one of unknown outcome needs
    // no particular connection.
    type Sent = ();

    fn key(&self, user: String, kind: Kind) -> Result<SqlKey, KeyError> {
        let semaphore = matches!(kind, Kind::Permit(_));
        SqlKey::new::<Postgres>(&self.namespace, user, self.max_key_len, semaphore)
    }

    fn attempt(
        self: &Arc<Self>,
        key: &Arc<SqlKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, Sent<Self>> {
        // Runs again on this caller's runtime if the one it ran on is gone.
        self.janitor.ensure_running();
        let (store, key) = (self.clone(), key.clone());
        Box::pin(async move {
            let lease = millis(attempt.lease);
            let holder = attempt.holder.as_str();
            if attempt.kind == Kind::Exclusive {
                let taken = sqlx::query_scalar::<_, i64>(&store.sql.acquire_free)
                    .bind(&*key.name)
                    .bind(holder)
                    .bind(lease)
                    .bind(token(attempt.reserve))
                    .bind(&store.instance)
                    .bind(attempt.yielding.is_some())
                    .fetch_optional(&store.pool)
                    .await;
                match taken {
                    Ok(Some(token)) => {
                        let acquired = Attempted::Acquired {
                            token: token.unsigned_abs(),
                            count: 1,
                        };
                        return (Ok(acquired), Some(()));
                    }
                    Ok(None) => {}
                    Err(e) => return (Err(PgError::from(e)), Some(())),
                }
            }
            let call = match attempt.kind {
                Kind::Exclusive => sqlx::query_scalar::<_, Vec<i64>>(&store.sql.acquire)
                    .bind(&*key.name)
                    .bind(holder)
                    .bind(lease)
                    .bind(attempt.waits.map_or(0, millis))
                    .bind(token(attempt.reserve))
                    .bind(attempt.yielding.is_some())
                    .bind(&store.instance),
                Kind::Shared => sqlx::query_scalar::<_, Vec<i64>>(&store.sql.shared_acquire)
                    .bind(&*key.name)
                    .bind(holder)
                    .bind(attempt.owner.as_str())
                    .bind(lease),
                Kind::Permit(permits) => {
                    sqlx::query_scalar::<_, Vec<i64>>(&store.sql.permit_acquire)
                        .bind(&*key.name)
                        .bind(holder)
                        .bind(lease)
                        .bind(i32::try_from(permits).unwrap_or(i32::MAX))
                }
            };
            let reply = match call.fetch_one(&store.pool).await {
                Ok(reply) => reply,
                Err(e) => return (Err(PgError::from(e)), Some(())),
            };
            let attempted = Attempted::from_reply(&reply).ok_or(PgError::unexpected("acquire"));
            (attempted, Some(()))
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a SqlKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, PgError>> {
        Box::pin(async move {
            if release.kind == Kind::Exclusive
                && release.successor.is_none()
                && release.only_token.is_none()
            {
                let freed = sqlx::query_scalar::<_, i64>(&self.sql.release_last)
                    .bind(&*key.name)
                    .bind(release.holder.as_str())
                    .bind(release.issued.map(token))
                    .bind(release.release_id)
                    .bind(&key.channel)
                    .fetch_one(&self.pool)
                    .await?;
                if freed == 1 {
                    return Ok(Released::Freed);
                }
            }
            let call = match release.kind {
                Kind::Exclusive => sqlx::query_scalar::<_, Vec<i64>>(&self.sql.release)
                    .bind(&*key.name)
                    .bind(release.holder.as_str())
                    .bind(release.release_id)
                    .bind(millis(release.lease))
                    .bind(&key.channel)
                    .bind(release.only_token.map(token))
                    .bind(release.may_have_run)
                    .bind(release.successor.map(|s| s.owner.as_str()))
                    .bind(release.successor.map_or(0, |s| millis(s.lease)))
                    .bind(release.run_spent)
                    .bind(release.issued.map(token))
                    .bind(token(release.reserve))
                    .bind(&self.instance),
                Kind::Shared | Kind::Permit(_) => {
                    sqlx::query_scalar::<_, Vec<i64>>(&self.sql.holder_release)
                        .bind(&*key.name)
                        .bind(release.holder.as_str())
                        .bind(release.release_id)
                        .bind(millis(release.lease))
                        .bind(&key.channel)
                        .bind(release.only_token.map(token))
                }
            };
            let reply = call.fetch_one(&self.pool).await?;
            Released::from_reply(&reply).ok_or(PgError::unexpected("release"))
        })
    }

    fn release_after<'a>(
        &'a self,
        key: &'a SqlKey,
        release: &'a Release<'a>,
        (): (),
    ) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.release(key, release).await.is_ok() })
    }

    fn renew<'a>(&'a self, batch: &'a [Due]) -> BoxFuture<'a, Result<Vec<bool>, PgError>> {
        Box::pin(async move {
            let names: Vec<&str> = batch.iter().map(|d| &*d.key.0).collect();
            let holders: Vec<&str> = batch.iter().map(|d| d.key.1.as_str()).collect();
            // A lease of 0 only checks.
            let leases: Vec<i64> = batch
                .iter()
                .map(|d| if d.renew { millis(d.lease) } else { 0 })
                .collect();
            let held = sqlx::query_scalar::<_, Vec<bool>>(&self.sql.renew)
                .bind(names)
                .bind(holders)
                .bind(leases)
                .fetch_one(&self.pool)
                .await?;
            if held.len() != batch.len() {
                return Err(PgError::unexpected("renew"));
            }
            Ok(held)
        })
    }

    fn subscribe(&self, key: &SqlKey) -> Waiter {
        self.listener.register(&key.channel)
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

    fn force_release(
        self: &Arc<Self>,
        user: String,
        of: Primitive,
    ) -> BoxFuture<'static, Result<LockInfo, LockError>> {
        let store = self.clone();
        Box::pin(async move {
            let freed = store
                .operator(&store.sql.force_release, user, of, true)
                .await?;
            if !freed.is_free() {
                tracing::info!(
                    key = %freed.key,
                    mode = ?freed.mode,
                    holders = freed.holders,
                    "lock force-released"
                );
            }
            Ok(freed)
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
                .bind(&key.channel)
                .bind(wake)
                .execute(&store.pool);
            if let Err(error) = withdrawn.await {
                // Its registration runs out with the wait it was made for.
                tracing::debug!(key = %key.name, %error, "could not withdraw a waiting writer");
            }
        })
    }
}

impl PgStore {
    /// Runs an operator's call (`inspect` or `force_release`) on `user`'s lock or semaphore.
    async fn operator(
        &self,
        statement: &str,
        user: String,
        of: Primitive,
        announced: bool,
    ) -> Result<LockInfo, LockError> {
        let semaphore = of == Primitive::Semaphore;
        let key = SqlKey::new::<Postgres>(&self.namespace, user, self.max_key_len, semaphore)?;
        let context = if announced {
            "force_release"
        } else {
            "inspect"
        };
        let mut call = sqlx::query_scalar::<_, Vec<i64>>(statement)
            .bind(&*key.name)
            .bind(semaphore);
        if announced {
            call = call.bind(&key.channel).bind(&self.admin_channel);
        }
        let reply = call
            .fetch_one(&self.pool)
            .await
            .map_err(|e| LockError::backend(context, PgError::from(e)))?;
        LockInfo::from_reply(key.user().to_owned(), &reply)
            .ok_or_else(|| LockError::backend(context, PgError::unexpected(context)))
    }
}

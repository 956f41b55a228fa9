//! The PostgreSQL store's own calls (see [`Calls`]): one statement each, calling the
//! crate's SQL functions (schema.sql), with waiters woken by the listener.

use std::sync::Arc;

use sqlx::Postgres;
use sqlx::postgres::PgPool;

use super::error::PgError;
use crate::core::kit::listener::Listener;
use crate::core::store::{Attempt, Attempted, Release, Released, replies};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::lock::{BoxFuture, Kind};
use crate::sql::{Calls, HELD_PAGE, HeldRow, SqlKey, SqlSent, SqlStore, Statements, millis, token};

/// Locks in one PostgreSQL database.
pub(crate) type PgStore = SqlStore<Postgres>;

impl Calls for Postgres {
    type Wake = Listener;

    fn statements(table: &str) -> Statements {
        // The plain statements cover the common cases: a PL/pgSQL call costs several times
        // their server time.
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
            // The primary key orders the names by the database's collation, which keeps the
            // names under a prefix together only if it is "C": each page is the next rows in
            // the key's order, whatever their names, and starts_with (bytes) picks the ones
            // under the prefix.
            held_page: format!(
                "SELECT l.name, starts_with(l.name, $2) AND (\
                     (l.owner IS NOT NULL AND l.expires > clock_timestamp()) IS TRUE \
                     OR EXISTS (SELECT 1 FROM {table}_holders h WHERE h.name = l.name \
                         AND h.kind IN ('s', 'p') AND h.expires > clock_timestamp())) \
                 FROM {table} l WHERE l.name > $1 ORDER BY l.name LIMIT {HELD_PAGE}"
            ),
            force_release: format!("SELECT {table}_force_release($1, $2, $3, $4)"),
            sweep: format!("SELECT {table}_sweep($1, $2)"),
            record_fetch: format!(
                "SELECT record FROM {table}_records WHERE name = $1 \
                 AND expires > clock_timestamp()"
            ),
            record_remaining: format!(
                "SELECT (EXTRACT(EPOCH FROM expires - clock_timestamp()) * 1000000)::bigint \
                 FROM {table}_records WHERE name = $1 AND expires > clock_timestamp()"
            ),
            record_store: format!("SELECT {table}_record_store($1, $2, $3, $4)"),
        }
    }

    fn register(wake: &Listener, channel: &str) -> Waiter {
        wake.register(channel)
    }

    fn attempt(
        store: Arc<PgStore>,
        key: Arc<SqlKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, SqlSent<Self>> {
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
            let attempted = replies::attempted(&reply).ok_or(PgError::unexpected("acquire"));
            (attempted, Some(()))
        })
    }

    fn release<'a>(
        store: &'a PgStore,
        key: &'a SqlKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, PgError>> {
        Box::pin(async move {
            if release.kind == Kind::Exclusive
                && release.successor.is_none()
                && release.only_token.is_none()
            {
                let freed = sqlx::query_scalar::<_, i64>(&store.sql.release_last)
                    .bind(&*key.name)
                    .bind(release.holder.as_str())
                    .bind(release.issued.map(token))
                    .bind(release.release_id)
                    .bind(&key.channel)
                    .fetch_one(&store.pool)
                    .await?;
                if freed == 1 {
                    return Ok(Released::Freed);
                }
            }
            let call = match release.kind {
                Kind::Exclusive => sqlx::query_scalar::<_, Vec<i64>>(&store.sql.release)
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
                    .bind(&store.instance),
                Kind::Shared | Kind::Permit(_) => {
                    sqlx::query_scalar::<_, Vec<i64>>(&store.sql.holder_release)
                        .bind(&*key.name)
                        .bind(release.holder.as_str())
                        .bind(release.release_id)
                        .bind(millis(release.lease))
                        .bind(&key.channel)
                        .bind(release.only_token.map(token))
                }
            };
            let reply = call.fetch_one(&store.pool).await?;
            replies::released(&reply).ok_or(PgError::unexpected("release"))
        })
    }

    fn renew<'a>(
        store: &'a PgStore,
        batch: &'a [Due],
    ) -> BoxFuture<'a, Result<Vec<bool>, PgError>> {
        Box::pin(async move {
            let names: Vec<&str> = batch.iter().map(|d| &*d.key.0).collect();
            let holders: Vec<&str> = batch.iter().map(|d| d.key.1.as_str()).collect();
            // A lease of 0 only checks.
            let leases: Vec<i64> = batch
                .iter()
                .map(|d| if d.renew { millis(d.lease) } else { 0 })
                .collect();
            let held = sqlx::query_scalar::<_, Vec<bool>>(&store.sql.renew)
                .bind(names)
                .bind(holders)
                .bind(leases)
                .fetch_one(&store.pool)
                .await?;
            if held.len() != batch.len() {
                return Err(PgError::unexpected("renew"));
            }
            Ok(held)
        })
    }

    fn sweep(
        pool: PgPool,
        sweep: String,
        keep_ms: i64,
        limit: i32,
    ) -> BoxFuture<'static, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query_scalar::<_, i32>(&sweep)
                .bind(keep_ms)
                .bind(limit)
                .fetch_one(&pool)
                .await
                .map(i64::from)
        })
    }

    fn record_store<'a>(
        store: &'a PgStore,
        name: &'a str,
        token: i64,
        retention_ms: i64,
        record: &'a [u8],
    ) -> BoxFuture<'a, Result<bool, PgError>> {
        Box::pin(async move {
            let stored = sqlx::query_scalar::<_, bool>(&store.sql.record_store)
                .bind(name)
                .bind(token)
                .bind(retention_ms)
                .bind(record)
                .fetch_one(&store.pool)
                .await?;
            Ok(stored)
        })
    }

    fn held_page<'a>(
        store: &'a PgStore,
        prefix: &'a str,
        after: &'a str,
    ) -> BoxFuture<'a, Result<Vec<HeldRow>, PgError>> {
        Box::pin(async move {
            let rows = sqlx::query_as::<_, (String, bool)>(&store.sql.held_page)
                .bind(after)
                .bind(prefix)
                .fetch_all(&store.pool)
                .await?;
            let rows = rows.into_iter().map(|(name, held)| HeldRow { name, held });
            Ok(rows.collect())
        })
    }

    fn operator<'a>(
        store: &'a PgStore,
        statement: &'a str,
        key: &'a SqlKey,
        semaphore: bool,
        announced: bool,
    ) -> BoxFuture<'a, Result<Vec<i64>, PgError>> {
        Box::pin(async move {
            let mut call = sqlx::query_scalar::<_, Vec<i64>>(statement)
                .bind(&*key.name)
                .bind(semaphore);
            if announced {
                call = call.bind(&key.channel).bind(&store.admin_channel);
            }
            Ok(call.fetch_one(&store.pool).await?)
        })
    }
}

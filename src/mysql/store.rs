//! The MySQL store's own calls (see [`Calls`]): one `CALL` each of the crate's stored
//! procedures (schema.sql), with waiters woken through the wake connection.

use std::sync::Arc;

use sqlx::mysql::{MySql, MySqlArguments, MySqlPool};
use sqlx::query::QueryScalar;

use super::error::MySqlError;
use crate::core::kit::keys::past_prefix;
use crate::core::kit::listener::Listener;
use crate::core::store::{Attempt, Attempted, Release, Released, replies};
use crate::core::wakeups::Waiter;
use crate::core::watchdog::Due;
use crate::lock::{BoxFuture, Kind};
use crate::sql::{Calls, HELD_PAGE, HeldRow, SqlKey, SqlSent, SqlStore, Statements, millis, token};

/// How many times a call that InnoDB rolled back (a deadlock's victim, a lock wait that
/// timed out) is sent again before its error is returned: it changed nothing.
const ROLLBACK_RETRIES: usize = 3;

/// Locks in one MySQL database.
pub(crate) type MySqlStore = SqlStore<MySql>;

type Call<'q> = QueryScalar<'q, MySql, String, MySqlArguments>;

/// Runs the procedure call `make` builds and reads its reply (integers joined by commas),
/// sending it again when InnoDB rolled it back.
pub(crate) async fn reply<'q>(
    pool: &MySqlPool,
    make: impl Fn() -> Call<'q>,
) -> Result<Vec<i64>, MySqlError> {
    let rows = retried(|| make().fetch_all(pool)).await?;
    parse(rows.first().map(String::as_str))
}

/// Runs the statement `send` sends, sending it again when InnoDB rolled it back.
pub(crate) async fn retried<T, F>(send: impl Fn() -> F) -> Result<T, MySqlError>
where
    F: Future<Output = Result<T, sqlx::Error>>,
{
    let mut retries = 0;
    loop {
        let error = match send().await {
            Ok(done) => return Ok(done),
            Err(e) => MySqlError::from(e),
        };
        if !error.rolled_back() || retries == ROLLBACK_RETRIES {
            return Err(error);
        }
        retries += 1;
        tracing::debug!(%error, "lock call rolled back by InnoDB, sending it again");
    }
}

/// Reads a reply such as `1,1790000000000000,1`.
fn parse(reply: Option<&str>) -> Result<Vec<i64>, MySqlError> {
    reply
        .and_then(|r| r.split(',').map(|n| n.parse().ok()).collect())
        .ok_or(MySqlError::unexpected("lock"))
}

impl Calls for MySql {
    type Wake = Listener;

    fn statements(table: &str) -> Statements {
        // The plain statements cover the common cases (a lone hold freed: with nobody
        // waiting): a `CALL` runs several statements on the server, each with its own
        // overhead.
        // Microseconds since the epoch on the server's clock: the tokens' floor.
        let clock = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))";
        Statements {
            // A new name, or a free row not left to another waiting instance; as
            // {table}_acquire's path for them. The token comes back as the statement's
            // LAST_INSERT_ID; 0 when the lock was not free (nothing changed). `@tl_free`
            // keeps the condition as the row was: later assignments see earlier ones.
            acquire_free: format!(
                "INSERT INTO {table} (name, owner, count, expires, token, fence, touched) \
                 VALUES (?, ?, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, \
                     LAST_INSERT_ID({clock}), {clock} + ?, UTC_TIMESTAMP(6)) \
                 ON DUPLICATE KEY UPDATE \
                 token = IF(@tl_free := ((owner IS NULL OR expires <= UTC_TIMESTAMP(6)) \
                         AND readers = 0 AND writers = 0 AND NOT (? AND waiter IS NOT NULL \
                         AND waiter <> ? AND waiter_until > UTC_TIMESTAMP(6))), \
                     LAST_INSERT_ID(GREATEST(fence + 1, {clock})), \
                     token + LAST_INSERT_ID(0)), \
                 fence = IF(@tl_free, token + ?, fence), \
                 owner = IF(@tl_free, VALUES(owner), owner), \
                 count = IF(@tl_free, 1, count), \
                 expires = IF(@tl_free, VALUES(expires), expires), \
                 undone = IF(@tl_free, NULL, undone), \
                 touched = IF(@tl_free, VALUES(touched), touched), \
                 waiter = IF(@tl_free AND waiter = ?, NULL, waiter)"
            ),
            acquire: format!("CALL {table}_acquire(?, ?, ?, ?, ?, ?, ?)"),
            // The holder's only hold, nobody reading, no instance waiting and no waiter
            // registered anywhere: freed, and nobody to wake; as {table}_release's last
            // path. A waiting instance marks the row itself (`waiter`), which this
            // statement reads under its row lock. The look-up of registered waiters names
            // the row, so that it runs once the row is locked and sees every registration
            // committed before (not at the statement's start, as a constant would).
            release_last: format!(
                "UPDATE {table} \
                 SET token = IFNULL(?, token), fence = GREATEST(fence, token), owner = NULL, \
                     count = 0, expires = NULL, undone = NULL, touched = UTC_TIMESTAMP(6) \
                 WHERE name = ? AND owner = ? AND count = 1 \
                     AND expires > UTC_TIMESTAMP(6) AND readers = 0 \
                     AND (waiter IS NULL OR waiter_until <= UTC_TIMESTAMP(6)) \
                     AND LOCATE(CONCAT(CHAR(10), ?, CHAR(10)), \
                         CONCAT(CHAR(10), IFNULL(undone, ''))) = 0 \
                     AND NOT EXISTS (SELECT 1 FROM {table}_waiters w \
                         WHERE w.channel = ? AND {table}.readers = 0)"
            ),
            release: format!("CALL {table}_release(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"),
            renew: format!("CALL {table}_renew(?)"),
            shared_acquire: format!("CALL {table}_shared_acquire(?, ?, ?, ?)"),
            permit_acquire: format!("CALL {table}_permit_acquire(?, ?, ?, ?)"),
            holder_release: format!("CALL {table}_holder_release(?, ?, ?, ?, ?, ?)"),
            remaining: format!(
                "SELECT CAST(GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), \
                 expires) / 1000)) AS SIGNED) FROM {table} \
                 WHERE name = ? AND owner IS NOT NULL"
            ),
            withdraw: format!("CALL {table}_withdraw(?, ?, ?, ?)"),
            inspect: format!("CALL {table}_inspect(?, ?)"),
            // Names are VARBINARY, in byte order: the names under a prefix are a range of
            // the primary key, from the prefix to the first name past it.
            held_page: format!(
                "SELECT l.name, (l.owner IS NOT NULL AND l.expires > UTC_TIMESTAMP(6)) IS TRUE \
                     OR EXISTS (SELECT 1 FROM {table}_holders h WHERE h.name = l.name \
                         AND h.kind IN ('s', 'p') AND h.expires > UTC_TIMESTAMP(6)) \
                 FROM {table} l WHERE l.name >= ? AND l.name < ? AND l.name > ? \
                 ORDER BY l.name LIMIT {HELD_PAGE}"
            ),
            force_release: format!("CALL {table}_force_release(?, ?, ?, ?)"),
            sweep: format!("CALL {table}_sweep(?, ?)"),
            record_fetch: format!(
                "SELECT record FROM {table}_records WHERE name = ? \
                 AND expires > UTC_TIMESTAMP(6)"
            ),
            record_remaining: format!(
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires) AS SIGNED) \
                 FROM {table}_records WHERE name = ? AND expires > UTC_TIMESTAMP(6)"
            ),
            record_store: format!("CALL {table}_record_store(?, ?, ?, ?)"),
        }
    }

    fn register(wake: &Listener, channel: &str) -> Waiter {
        wake.register(channel)
    }

    fn attempt(
        store: Arc<MySqlStore>,
        key: Arc<SqlKey>,
        attempt: Attempt,
    ) -> BoxFuture<'static, SqlSent<Self>> {
        Box::pin(async move {
            let lease = millis(attempt.lease);
            let holder = attempt.holder.as_str();
            let sql = &store.sql;
            if attempt.kind == Kind::Exclusive {
                let taken = sqlx::query(&sql.acquire_free)
                    .bind(&*key.name)
                    .bind(holder)
                    .bind(lease.saturating_mul(1000))
                    .bind(token(attempt.reserve))
                    .bind(attempt.yielding.is_some())
                    .bind(&store.instance)
                    .bind(token(attempt.reserve))
                    .bind(&store.instance)
                    .execute(&store.pool)
                    .await;
                match taken.map(|done| done.last_insert_id()) {
                    Ok(0) => {}
                    Ok(token) => {
                        let acquired = Attempted::Acquired { token, count: 1 };
                        return (Ok(acquired), Some(()));
                    }
                    Err(e) => {
                        // Rolled back by InnoDB: it changed nothing, and the procedure
                        // below is sent (and retried) instead.
                        let e = MySqlError::from(e);
                        if !e.rolled_back() {
                            return (Err(e), Some(()));
                        }
                    }
                }
            }
            let make = || match attempt.kind {
                Kind::Exclusive => sqlx::query_scalar(&sql.acquire)
                    .bind(&*key.name)
                    .bind(holder)
                    .bind(lease)
                    .bind(attempt.waits.map_or(0, millis))
                    .bind(token(attempt.reserve))
                    .bind(attempt.yielding.is_some())
                    .bind(&store.instance),
                Kind::Shared => sqlx::query_scalar(&sql.shared_acquire)
                    .bind(&*key.name)
                    .bind(holder)
                    .bind(attempt.owner.as_str())
                    .bind(lease),
                Kind::Permit(permits) => sqlx::query_scalar(&sql.permit_acquire)
                    .bind(&*key.name)
                    .bind(holder)
                    .bind(lease)
                    .bind(i32::try_from(permits).unwrap_or(i32::MAX)),
            };
            let attempted = reply(&store.pool, make).await.and_then(|reply| {
                replies::attempted(&reply).ok_or(MySqlError::unexpected("acquire"))
            });
            (attempted, Some(()))
        })
    }

    fn release<'a>(
        store: &'a MySqlStore,
        key: &'a SqlKey,
        release: &'a Release<'a>,
    ) -> BoxFuture<'a, Result<Released, MySqlError>> {
        Box::pin(async move {
            if release.kind == Kind::Exclusive
                && release.successor.is_none()
                && release.only_token.is_none()
            {
                let freed = sqlx::query(&store.sql.release_last)
                    .bind(release.issued.map(token))
                    .bind(&*key.name)
                    .bind(release.holder.as_str())
                    .bind(release.release_id)
                    .bind(&key.channel)
                    .execute(&store.pool)
                    .await;
                match freed {
                    Ok(done) if done.rows_affected() == 1 => return Ok(Released::Freed),
                    Ok(_) => {}
                    Err(e) => {
                        let e = MySqlError::from(e);
                        if !e.rolled_back() {
                            return Err(e);
                        }
                    }
                }
            }
            let make = || match release.kind {
                Kind::Exclusive => sqlx::query_scalar(&store.sql.release)
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
                Kind::Shared | Kind::Permit(_) => sqlx::query_scalar(&store.sql.holder_release)
                    .bind(&*key.name)
                    .bind(release.holder.as_str())
                    .bind(release.release_id)
                    .bind(millis(release.lease))
                    .bind(&key.channel)
                    .bind(release.only_token.map(token)),
            };
            let reply = reply(&store.pool, make).await?;
            replies::released(&reply).ok_or(MySqlError::unexpected("release"))
        })
    }

    fn renew<'a>(
        store: &'a MySqlStore,
        batch: &'a [Due],
    ) -> BoxFuture<'a, Result<Vec<bool>, MySqlError>> {
        Box::pin(async move {
            // [name, holder, lease]; a lease of 0 only checks.
            let holds: Vec<serde_json::Value> = batch
                .iter()
                .map(|d| {
                    let lease = if d.renew { millis(d.lease) } else { 0 };
                    serde_json::json!([&*d.key.0, d.key.1.as_str(), lease])
                })
                .collect();
            let holds = serde_json::Value::Array(holds).to_string();
            let held = sqlx::query_scalar::<_, i64>(&store.sql.renew)
                .bind(holds)
                .fetch_all(&store.pool)
                .await?;
            if held.len() != batch.len() {
                return Err(MySqlError::unexpected("renew"));
            }
            Ok(held.into_iter().map(|h| h == 1).collect())
        })
    }

    fn sweep(
        pool: MySqlPool,
        sweep: String,
        keep_ms: i64,
        limit: i32,
    ) -> BoxFuture<'static, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            let gone = sqlx::query_scalar::<_, i64>(&sweep)
                .bind(keep_ms)
                .bind(limit)
                .fetch_all(&pool)
                .await?;
            Ok(gone.first().copied().unwrap_or(0))
        })
    }

    fn record_store<'a>(
        store: &'a MySqlStore,
        name: &'a str,
        token: i64,
        retention_ms: i64,
        record: &'a [u8],
    ) -> BoxFuture<'a, Result<bool, MySqlError>> {
        Box::pin(async move {
            let make = || {
                sqlx::query_scalar(&store.sql.record_store)
                    .bind(name)
                    .bind(token)
                    .bind(retention_ms)
                    .bind(record)
            };
            match reply(&store.pool, make).await?.as_slice() {
                [1] => Ok(true),
                [0] => Ok(false),
                _ => Err(MySqlError::unexpected("record_store")),
            }
        })
    }

    fn held_page<'a>(
        store: &'a MySqlStore,
        prefix: &'a str,
        after: &'a str,
    ) -> BoxFuture<'a, Result<Vec<HeldRow>, MySqlError>> {
        Box::pin(async move {
            let rows = sqlx::query_as::<_, (Vec<u8>, bool)>(&store.sql.held_page)
                .bind(prefix.as_bytes())
                .bind(past_prefix(prefix))
                .bind(after.as_bytes())
                .fetch_all(&store.pool)
                .await?;
            // The crate writes names from `str`s only: one that is not UTF-8 fails to
            // decode, as sqlx's own decoding of a text column would.
            rows.into_iter()
                .map(|(name, held)| match String::from_utf8(name) {
                    Ok(name) => Ok(HeldRow { name, held }),
                    Err(e) => Err(MySqlError::from(sqlx::Error::Decode(e.into()))),
                })
                .collect()
        })
    }

    fn operator<'a>(
        store: &'a MySqlStore,
        statement: &'a str,
        key: &'a SqlKey,
        semaphore: bool,
        announced: bool,
    ) -> BoxFuture<'a, Result<Vec<i64>, MySqlError>> {
        Box::pin(async move {
            let make = || {
                let call = sqlx::query_scalar(statement)
                    .bind(&*key.name)
                    .bind(semaphore);
                if announced {
                    call.bind(&key.channel).bind(&store.admin_channel)
                } else {
                    call
                }
            };
            reply(&store.pool, make).await
        })
    }
}

//! Records in the SQL stores: a row of `{table}_records` per key, written by the
//! `record_store` routine only under the hold that ran the handler, never replayed once
//! expired, deleted by the janitor; a schema without the table refused at build (naming
//! the shipped SQL) and upgraded by migrate(); a user without rights on it refused at
//! build; a hold lost before its handler returned stores nothing; a failing table answered
//! with 503. Each test has a lock table of its own on the binary's shared PostgreSQL and
//! MariaDB.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;

use tower_lock::idempotency::IdempotencyBackend;
use tower_lock::{BuildError, IdempotencyLayer, LockBackend, MySqlBackend, PostgresBackend};

use super::support::{eventually, mariadb, postgres};
use super::{Payments, app, pay_with, scoped, tenant};

/// A fence TTL whose janitor sweeps only when a backend starts (every 5 minutes after).
const HOUR: Duration = Duration::from_secs(3600);

/// What the tests need of a SQL store on its shared server.
trait Server: 'static {
    type Backend: IdempotencyBackend + std::fmt::Debug;
    /// The shipped SQL that build() names.
    const FILE: &str;

    /// A backend on the lock table `table` in `namespace`, migrating it first.
    fn build(
        table: &str,
        namespace: &str,
        fence_ttl: Duration,
    ) -> impl Future<Output = Result<Self::Backend, BuildError>>;
    /// The suffixes of the lock tables' names but the records'.
    const LOCK_TABLES: &[&str];

    /// A backend on the lock table `table` as an application builds one (no migration),
    /// connecting to `url`, or the shared server as its superuser.
    fn connect(
        url: Option<&str>,
        table: &str,
    ) -> impl Future<Output = Result<Self::Backend, BuildError>>;
    /// Creates the user `user` (with the rights to run the routines): its URL.
    fn create_user(user: &str) -> impl Future<Output = String>;
    /// Lets `user` select, insert, update and delete in `table`.
    fn grant(user: &str, table: &str) -> impl Future<Output = ()>;
    /// Runs `sql` as the superuser.
    fn execute(sql: String) -> impl Future<Output = ()> + Send;
    /// The one integer `sql` answers.
    fn scalar(sql: String) -> impl Future<Output = i64>;
    /// Calls `table`'s record_store routine for the row `name` with the hold's `token`:
    /// whether it stored the record.
    fn record_store(table: &str, name: &str, token: u64) -> impl Future<Output = bool>;
    /// Makes `table`'s schema_version routine answer `version`.
    fn set_version(table: &str, version: i32) -> impl Future<Output = ()>;
    /// The server's clock `seconds` from now, in SQL.
    fn at(seconds: i64) -> String;
}

struct Pg;

impl Server for Pg {
    type Backend = PostgresBackend;
    const FILE: &str = "src/postgres/schema.sql";

    async fn build(
        table: &str,
        namespace: &str,
        fence_ttl: Duration,
    ) -> Result<PostgresBackend, BuildError> {
        let builder = postgres::builder(namespace).table(table);
        builder.fence_ttl(fence_ttl).build().await
    }

    const LOCK_TABLES: &[&str] = &["", "_holders"];

    async fn connect(url: Option<&str>, table: &str) -> Result<PostgresBackend, BuildError> {
        let url = url.map_or_else(|| postgres::shared().url(), str::to_owned);
        PostgresBackend::builder(url).table(table).build().await
    }

    async fn create_user(user: &str) -> String {
        Self::execute(format!("CREATE ROLE {user} LOGIN")).await;
        let url = postgres::shared().url();
        url.replace("postgres@", &format!("{user}@"))
    }

    async fn grant(user: &str, table: &str) {
        let grant = format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {user}");
        Self::execute(grant).await;
    }

    async fn execute(sql: String) {
        use sqlx::Executor;
        let mut conn = postgres::shared().conn().await;
        conn.execute(sqlx::raw_sql(&sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn scalar(sql: String) -> i64 {
        sqlx::query_scalar(&sql)
            .fetch_one(&mut postgres::shared().conn().await)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    async fn record_store(table: &str, name: &str, token: u64) -> bool {
        sqlx::query_scalar(&format!("SELECT {table}_record_store($1, $2, 60000, 'r')"))
            .bind(name)
            .bind(i64::try_from(token).expect("a BIGINT token"))
            .fetch_one(&mut postgres::shared().conn().await)
            .await
            .expect("record_store")
    }

    async fn set_version(table: &str, version: i32) {
        Self::execute(format!(
            "CREATE OR REPLACE FUNCTION {table}_schema_version() RETURNS integer \
             LANGUAGE sql IMMUTABLE AS $$ SELECT {version} $$"
        ))
        .await;
    }

    fn at(seconds: i64) -> String {
        format!("clock_timestamp() + {seconds} * interval '1 second'")
    }
}

struct MariaDb;

impl Server for MariaDb {
    type Backend = MySqlBackend;
    const FILE: &str = "src/mysql/schema.sql";

    async fn build(
        table: &str,
        namespace: &str,
        fence_ttl: Duration,
    ) -> Result<MySqlBackend, BuildError> {
        let builder = mariadb::builder(namespace).table(table);
        builder.fence_ttl(fence_ttl).build().await
    }

    const LOCK_TABLES: &[&str] = &["", "_holders", "_waiters"];

    async fn connect(url: Option<&str>, table: &str) -> Result<MySqlBackend, BuildError> {
        let url = url.map_or_else(|| mariadb::shared().url(), str::to_owned);
        // The connect timeout of mariadb::builder_on, which migrates.
        let builder = MySqlBackend::builder(url).connect_timeout(Duration::from_secs(10));
        builder.table(table).build().await
    }

    async fn create_user(user: &str) -> String {
        Self::execute(format!(
            "CREATE USER {user}@'%' IDENTIFIED BY 'pw'; GRANT EXECUTE ON test.* TO {user}@'%'"
        ))
        .await;
        mariadb::shared().url_as(user, "pw")
    }

    async fn grant(user: &str, table: &str) {
        let grant = format!("GRANT SELECT, INSERT, UPDATE, DELETE ON test.{table} TO {user}@'%'");
        Self::execute(grant).await;
    }

    async fn execute(sql: String) {
        mariadb::shared().execute(&sql).await;
    }

    async fn scalar(sql: String) -> i64 {
        sqlx::query_scalar(&sql)
            .fetch_one(&mut mariadb::shared().conn().await)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    async fn record_store(table: &str, name: &str, token: u64) -> bool {
        let mut conn = mariadb::shared().conn().await;
        let reply: Vec<String> =
            sqlx::query_scalar(&format!("CALL {table}_record_store(?, ?, 60000, 'r')"))
                .bind(name)
                .bind(i64::try_from(token).expect("a BIGINT token"))
                .fetch_all(&mut conn)
                .await
                .expect("record_store");
        reply == ["1"]
    }

    async fn set_version(table: &str, version: i32) {
        Self::execute(format!(
            "DROP PROCEDURE {table}_schema_version; \
             CREATE PROCEDURE {table}_schema_version() SQL SECURITY INVOKER SELECT {version}"
        ))
        .await;
    }

    fn at(seconds: i64) -> String {
        format!("UTC_TIMESTAMP(6) + INTERVAL {seconds} SECOND")
    }
}

/// Runs each named body `async fn NAME<S: Server>()` on PostgreSQL and on MariaDB.
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    crate::needs!(Postgres);
                    super::$name::<super::Pg>().await;
                }
            )*
        }
        mod on_mariadb {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    crate::needs!(MariaDb);
                    super::$name::<super::MariaDb>().await;
                }
            )*
        }
    };
}

on_both!(
    the_record_routine_stores_only_under_the_hold_that_ran_the_handler,
    expired_records_are_not_replayed_and_the_janitor_deletes_them,
    build_refuses_a_schema_without_the_records_table_naming_the_sql_and_migrate_adds_it,
    a_records_table_that_fails_answers_503_and_runs_nothing,
    build_refuses_a_user_without_rights_on_the_records_table_naming_the_table,
    a_hold_lost_before_the_handler_returned_stores_nothing,
);

/// A lock table and a namespace no other test uses.
fn fresh() -> (String, String) {
    let id = uuid::Uuid::new_v4().simple().to_string();
    (format!("tl_{}", &id[..16]), postgres::fresh_namespace())
}

/// How many records `table` keeps, expired or not.
async fn records<S: Server>(table: &str) -> i64 {
    S::scalar(format!("SELECT COUNT(*) FROM {table}_records")).await
}

/// The row name of tenant acme's idempotency key `key`.
fn row(namespace: &str, key: &str) -> String {
    format!("{namespace}:{{{}}}", scoped("acme", key))
}

async fn the_record_routine_stores_only_under_the_hold_that_ran_the_handler<S: Server>() {
    let (table, namespace) = fresh();
    let backend = S::build(&table, &namespace, HOUR).await.expect("backend");
    let name = format!("{namespace}:{{k}}");
    let lost = backend.lock("k").try_once().await.expect("free");
    let old = lost.fencing_token();
    backend.force_release("k").await.expect("force release");
    assert!(
        !S::record_store(&table, &name, old).await,
        "the lock was lost: nothing stored"
    );
    // Another instance takes the key.
    let other = S::build(&table, &namespace, HOUR).await.expect("backend");
    let holder = other.lock("k").try_once().await.expect("free again");
    let token = holder.fencing_token();
    assert!(
        !S::record_store(&table, &name, old).await,
        "another hold has the key"
    );
    assert_eq!(records::<S>(&table).await, 0);
    // The hold itself, and a task it was passed to in memory (a token above the row's),
    // which replaces the record.
    assert!(S::record_store(&table, &name, token).await);
    assert!(S::record_store(&table, &name, token + 1).await);
    assert_eq!(records::<S>(&table).await, 1);
    let within_retention = format!(
        "SELECT COUNT(*) FROM {table}_records WHERE expires > {} AND expires <= {}",
        S::at(0),
        S::at(60)
    );
    assert_eq!(
        S::scalar(within_retention).await,
        1,
        "on the server's clock"
    );
    holder.release().await.expect("release");
    assert!(
        !S::record_store(&table, &name, token).await,
        "released: nothing stored"
    );
    drop(lost);
}

async fn expired_records_are_not_replayed_and_the_janitor_deletes_them<S: Server>() {
    let (table, namespace) = fresh();
    let backend = S::build(&table, &namespace, HOUR).await.expect("backend");
    let payments = Payments::default();
    let app = app(IdempotencyLayer::new(backend), &payments);
    assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 1 for {}");
    assert_eq!(pay_with(&app, "k2", "{}").await.body, "charged 2 for {}");
    assert_eq!(records::<S>(&table).await, 2);
    // k1's retention runs out (its expiry a second ago on the server's clock): it runs
    // again, and its new record replaces the old one.
    let expire_k1 = format!(
        "UPDATE {table}_records SET expires = {} WHERE name = '{}'",
        S::at(-1),
        row(&namespace, "k1")
    );
    S::execute(expire_k1.clone()).await;
    for _ in 0..2 {
        assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 3 for {}");
    }
    assert_eq!(records::<S>(&table).await, 2);

    S::execute(expire_k1).await;
    // Another instance on the table, whose janitor sweeps every second.
    let sweeper = S::build(&table, &namespace, Duration::from_secs(1))
        .await
        .expect("backend");
    drop(sweeper.lock("started").try_once().await.expect("free"));
    eventually("the janitor deletes the expired record", || async {
        records::<S>(&table).await == 1
    })
    .await;
    let k2 = format!(
        "SELECT COUNT(*) FROM {table}_records WHERE name = '{}'",
        row(&namespace, "k2")
    );
    assert_eq!(S::scalar(k2).await, 1, "the unexpired record stays");
    assert_eq!(payments.runs(), 3);
}

async fn build_refuses_a_schema_without_the_records_table_naming_the_sql_and_migrate_adds_it<
    S: Server,
>() {
    let (table, namespace) = fresh();
    drop(
        S::build(&table, &namespace, HOUR)
            .await
            .expect("the schema"),
    );
    // The schema as version 1 left it: the lock tables and routines, no records.
    S::execute(format!("DROP TABLE {table}_records")).await;
    S::set_version(&table, 1).await;
    let refused = S::connect(None, &table).await;
    let Err(
        error @ BuildError::Schema {
            found: Some(1),
            expected: 2,
            ..
        },
    ) = &refused
    else {
        panic!("a schema without the records is refused: {refused:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains(S::FILE) && message.contains("migrate()"),
        "{message}"
    );
    let backend = S::build(&table, &namespace, HOUR)
        .await
        .expect("migrate() upgrades the schema");
    let payments = Payments::default();
    let app = app(IdempotencyLayer::new(backend), &payments);
    assert_eq!(pay_with(&app, "k1", "{}").await.status, 201);
    let replay = pay_with(&app, "k1", "{}").await;
    assert_eq!(replay.headers["idempotency-replayed"], "true");
    assert_eq!(records::<S>(&table).await, 1);
}

async fn a_records_table_that_fails_answers_503_and_runs_nothing<S: Server>() {
    let (table, namespace) = fresh();
    let backend = S::build(&table, &namespace, HOUR).await.expect("backend");
    let payments = Payments::default();
    let app = app(IdempotencyLayer::new(backend), &payments);
    S::execute(format!("DROP TABLE {table}_records")).await;
    pay_with(&app, "k1", "{}").await.problem(503);
    assert_eq!(payments.runs(), 0);
}

async fn build_refuses_a_user_without_rights_on_the_records_table_naming_the_table<S: Server>() {
    let (table, namespace) = fresh();
    drop(
        S::build(&table, &namespace, HOUR)
            .await
            .expect("the schema"),
    );
    let user = format!("u_{}", &table[3..]);
    let url = S::create_user(&user).await;
    for suffix in S::LOCK_TABLES {
        S::grant(&user, &format!("{table}{suffix}")).await;
    }
    let refused = S::connect(Some(&url), &table).await;
    let Err(
        error @ BuildError::Rights {
            user: refused_user, ..
        },
    ) = &refused
    else {
        panic!("a user without rights on the records is refused: {refused:?}");
    };
    assert_eq!(refused_user, &user);
    assert!(error.to_string().contains(&table), "{error}");
    S::grant(&user, &format!("{table}_records")).await;
    let backend = S::connect(Some(&url), &table)
        .await
        .expect("with the rights it builds");
    let payments = Payments::default();
    let app = app(IdempotencyLayer::new(backend), &payments);
    assert_eq!(pay_with(&app, "k1", "{}").await.status, 201);
    assert_eq!(records::<S>(&table).await, 1, "the probe's record is gone");
}

async fn a_hold_lost_before_the_handler_returned_stores_nothing<S: Server>() {
    let (table, namespace) = fresh();
    let backend = S::build(&table, &namespace, HOUR).await.expect("backend");
    // The handler frees its own lock as a force-release does, unannounced: its backend
    // hears of it at its next renewal, a third of the lease later, long after the handler
    // returned and the record was (not) stored. The store call itself finds it lost.
    let lose = format!(
        "UPDATE {table} SET owner = NULL, expires = NULL WHERE name = '{}'",
        row(&namespace, "k1")
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let pay = {
        let runs = runs.clone();
        move || async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            S::execute(lose).await;
            format!("charged {n}")
        }
    };
    let app = Router::new().route("/payments", post(pay)).route_layer(
        IdempotencyLayer::new(backend)
            .lease(Duration::from_secs(900))
            .scope(tenant),
    );
    assert_eq!(pay_with(&app, "k1", "{}").await.body, "charged 1");
    assert_eq!(records::<S>(&table).await, 0, "nothing stored");
    let retry = pay_with(&app, "k1", "{}").await;
    assert_eq!(retry.body, "charged 2");
    assert!(retry.headers.get("idempotency-replayed").is_none());
}

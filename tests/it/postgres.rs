//! PostgreSQL: what `build()` refuses, the table and what it keeps. The semantics every
//! store keeps run in the conformance suite (conformance.rs and the files it names:
//! `on_postgres::*`); faults in postgres_faults.rs.

use crate::support;

use std::time::Duration;

use support::postgres::{self, PostgresServer};
use support::sql;
use tower_lock::{BuildError, PostgresBackend};

async fn exec(server: &PostgresServer, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(&mut server.conn().await)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn rows(server: &PostgresServer, table: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(&mut server.conn().await)
        .await
        .expect("count rows")
}

#[tokio::test]
async fn build_refuses_a_database_without_the_table_naming_the_sql_and_migrate_creates_it() {
    crate::needs!(Postgres);
    let server = PostgresServer::start();
    let refused = PostgresBackend::builder(server.url()).build().await;
    let Err(error @ BuildError::Schema { found: None, .. }) = &refused else {
        panic!("a database without the table is refused: {refused:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains("(or not its functions)")
            && message.contains("src/postgres/schema.sql")
            && message.contains("migrate()"),
        "{message}"
    );
    // migrate() creates it, and running it again (another instance starting) changes
    // nothing; a backend without migrate() then builds.
    for _ in 0..2 {
        PostgresBackend::builder(server.url())
            .migrate()
            .build()
            .await
            .expect("migrate creates the schema");
    }
    PostgresBackend::connect(&server.url())
        .await
        .expect("the schema is there");
    // The shipped SQL is what migrate() runs, for another table name too.
    let sql = PostgresBackend::schema_sql("locks").expect("a plain table name");
    exec(&server, &sql).await;
    PostgresBackend::builder(server.url())
        .table("locks")
        .build()
        .await
        .expect("the schema applied by hand");
    assert!(PostgresBackend::schema_sql("locks; drop table x").is_err());
}

#[tokio::test]
async fn build_refuses_an_older_schema_a_user_without_rights_a_read_only_session_and_a_replica() {
    crate::needs!(Postgres);
    let server = postgres::shared();
    postgres::backend().await; // the schema
    exec(
        server,
        "DROP ROLE IF EXISTS outsider; CREATE ROLE outsider LOGIN; \
         DROP ROLE IF EXISTS reader; CREATE ROLE reader LOGIN; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON tower_lock, tower_lock_holders TO reader; \
         ALTER ROLE reader SET default_transaction_read_only = on",
    )
    .await;
    let url_as = |user: &str| server.url().replace("postgres@", &format!("{user}@"));

    let refused = PostgresBackend::connect(&url_as("outsider")).await;
    let Err(error @ BuildError::Rights { user, .. }) = &refused else {
        panic!("a user without rights on the table is refused: {refused:?}");
    };
    assert_eq!(user, "outsider");
    assert!(error.to_string().contains("tower_lock"), "{error}");

    let refused = PostgresBackend::connect(&url_as("reader")).await;
    assert!(
        matches!(refused, Err(BuildError::ReadOnly { .. })),
        "a read-only session is refused: {refused:?}"
    );
    // A replica's URL given by mistake: it has the schema (replicated), and takes no writes.
    let replica = server.replica();
    let refused = PostgresBackend::connect(&replica.url()).await;
    let Err(error @ BuildError::ReadOnly { .. }) = &refused else {
        panic!("a replica is refused: {refused:?}");
    };
    assert!(error.to_string().contains("replica"), "{error}");

    exec(
        server,
        "CREATE SCHEMA old; CREATE FUNCTION old.tower_lock_schema_version() RETURNS integer \
         LANGUAGE sql AS 'SELECT 0'",
    )
    .await;
    let old = format!("{}?options=-c%20search_path%3Dold", server.url());
    let refused = PostgresBackend::connect(&old).await;
    assert!(
        matches!(
            refused,
            Err(BuildError::Schema {
                found: Some(0),
                expected: 2,
                ..
            })
        ),
        "an older schema is refused: {refused:?}"
    );
}

#[tokio::test]
async fn names_held_and_released_leave_rows_only_until_the_janitor_sweeps_them() {
    crate::needs!(Postgres);
    let server = PostgresServer::start();
    let backend = PostgresBackend::builder(server.url())
        .migrate()
        .fence_ttl(Duration::from_secs(1))
        .build()
        .await
        .expect("backend");
    sql::names_leave_rows_only_until_the_janitor_sweeps_them(backend, async |table| {
        rows(&server, table).await
    })
    .await;
}

#[tokio::test]
async fn build_names_the_address_and_the_kind_of_a_connection_failure() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let refused = PostgresBackend::connect(&format!("postgres://app@127.0.0.1:{port}/app")).await;
    let Err(error @ BuildError::Connect { .. }) = &refused else {
        panic!("nothing listens: {refused:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains(&format!("127.0.0.1:{port}")) && message.contains("refused"),
        "{message}"
    );
    let unknown = PostgresBackend::connect("postgres://app@no-such-host.invalid/app").await;
    let Err(error @ BuildError::Connect { .. }) = &unknown else {
        panic!("an unknown host: {unknown:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains("no-such-host.invalid:5432") && message.contains("does not resolve"),
        "{message}"
    );
}

#[tokio::test]
async fn build_refuses_a_url_of_another_scheme_naming_the_schemes_it_takes() {
    crate::needs!(Postgres);
    // A MySQL URL, or an HTTP one, at a real PostgreSQL: refused before connecting.
    sql::urls_of_other_schemes_are_refused(
        &postgres::shared().url(),
        ("postgres", "postgresql", &["mysql", "http"]),
        "a PostgreSQL URL starts with `postgres://` or `postgresql://`",
        |url| {
            PostgresBackend::builder(url)
                .namespace(postgres::fresh_namespace())
                .migrate()
                .build()
        },
    )
    .await;
}

#[tokio::test]
async fn build_names_an_unknown_database_and_a_migration_the_user_may_not_run() {
    crate::needs!(Postgres);
    let server = postgres::shared();
    let addr = format!("127.0.0.1:{}", server.port());
    let unknown = format!("postgres://postgres@{addr}/no_such_db");
    let refused = PostgresBackend::connect(&unknown).await;
    let Err(error @ BuildError::Connect { .. }) = &refused else {
        panic!("an unknown database is refused: {refused:?}");
    };
    assert_eq!(
        error.to_string(),
        format!(
            "the server at {addr} has no database `no_such_db` (create it, or name one it \
             has in the URL)"
        )
    );
    // A user who may connect but not create (PostgreSQL 15 takes CREATE on `public` from
    // every user but the owner), under migrate() with a table not there yet.
    exec(
        server,
        "DROP ROLE IF EXISTS visitor; CREATE ROLE visitor LOGIN",
    )
    .await;
    let visitor = server.url().replace("postgres@", "visitor@");
    let refused = PostgresBackend::builder(visitor)
        .table("visitor_locks")
        .migrate()
        .build()
        .await;
    let Err(error @ BuildError::Rights { user, .. }) = &refused else {
        panic!("a migration without CREATE is refused: {refused:?}");
    };
    assert_eq!(user, "visitor");
    assert_eq!(
        error.to_string(),
        format!(
            "the user `visitor` of the server at {addr} may not create the lock table \
             `visitor_locks` and its functions (what `migrate()` does: run the SQL of \
             `PostgresBackend::schema_sql` as a user who may, or grant CREATE)"
        )
    );
}

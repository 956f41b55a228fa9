//! MySQL/MariaDB: what `build()` refuses, the tables and what they keep. The semantics
//! every store keeps run in the conformance suite (conformance.rs and the files it names:
//! `on_mariadb::*`); faults in mysql_faults.rs.

use crate::support;

use std::time::Duration;

use support::mariadb::{self, MariaDbServer, fresh_database};
use support::sql;
use tower_lock::{BuildError, MySqlBackend};

async fn rows(url: &str, table: &str) -> i64 {
    use sqlx::Connection;
    let mut conn = sqlx::MySqlConnection::connect(url).await.expect("connect");
    sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
        .fetch_one(&mut conn)
        .await
        .expect("count rows")
}

#[tokio::test]
async fn build_refuses_a_database_without_the_table_naming_the_sql_and_migrate_creates_it() {
    crate::needs!(MariaDb);
    let url = fresh_database().await;
    let refused = MySqlBackend::builder(&url).build().await;
    let Err(error @ BuildError::Schema { found: None, .. }) = &refused else {
        panic!("a database without the table is refused: {refused:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains("(or not its procedures)")
            && message.contains("src/mysql/schema.sql")
            && message.contains("MySqlBackend::schema_sql")
            && message.contains("migrate()"),
        "{message}"
    );
    // migrate() creates it, and running it again (another instance starting) changes
    // nothing; a backend without migrate() then builds.
    for _ in 0..2 {
        mariadb::builder_on(&url)
            .build()
            .await
            .expect("migrate creates the schema");
    }
    MySqlBackend::connect(&url)
        .await
        .expect("the schema is there");
    // The shipped SQL is what migrate() runs, for another table name too: through the
    // client, as an operator would run it.
    let sql = MySqlBackend::schema_sql("locks").expect("a plain table name");
    let server = mariadb::shared();
    let database = url.rsplit('/').next().expect("a database");
    let mut client = std::process::Command::new("mariadb")
        .args(["--no-defaults", "-uroot", "-h127.0.0.1"])
        .arg(format!("-P{}", server.port()))
        .arg(database)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("the mariadb client runs");
    std::io::Write::write_all(&mut client.stdin.take().expect("stdin"), sql.as_bytes())
        .expect("the SQL is sent");
    assert!(client.wait().expect("the client ends").success());
    let backend = MySqlBackend::builder(&url)
        .table("locks")
        .connect_timeout(Duration::from_secs(10))
        .build()
        .await
        .expect("the schema applied by hand");
    let guard = backend
        .lock("k")
        .try_once()
        .await
        .expect("a lock in `locks`");
    assert_eq!(rows(&url, "locks").await, 1);
    guard.release().await.expect("release");
    assert!(MySqlBackend::schema_sql("locks; drop table x").is_err());
}

#[tokio::test]
async fn build_refuses_an_older_schema_a_user_without_rights_and_a_read_only_server() {
    crate::needs!(MariaDb);
    let server = MariaDbServer::start();
    server
        .execute(
            "CREATE DATABASE old; \
             CREATE USER reader@'%' IDENTIFIED BY 'pw'; \
             GRANT SELECT ON test.* TO reader@'%'; \
             CREATE PROCEDURE old.tower_lock_schema_version() SELECT 0",
        )
        .await;
    mariadb::builder_on(&server.url())
        .build()
        .await
        .expect("the schema");

    let refused = MySqlBackend::connect(&server.url_as("reader", "pw")).await;
    let Err(error @ BuildError::Rights { user, .. }) = &refused else {
        panic!("a user without rights on the procedures is refused: {refused:?}");
    };
    assert_eq!(user, "reader");
    assert!(error.to_string().contains("tower_lock"), "{error}");

    let refused = MySqlBackend::connect(&server.url().replace("/test", "/old")).await;
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

    // A replica's URL given by mistake (replicas run with read_only): refused even for a
    // user whose privileges would let it write there.
    server.execute("SET GLOBAL read_only = 1").await;
    let refused = MySqlBackend::connect(&server.url()).await;
    let Err(error @ BuildError::ReadOnly { .. }) = &refused else {
        panic!("a read-only server is refused: {refused:?}");
    };
    assert!(error.to_string().contains("replica"), "{error}");
}

#[tokio::test]
async fn names_held_and_released_leave_rows_only_until_the_janitor_sweeps_them() {
    crate::needs!(MariaDb);
    let url = fresh_database().await;
    let backend = mariadb::builder_on(&url)
        .fence_ttl(Duration::from_secs(1))
        .build()
        .await
        .expect("backend");
    sql::names_leave_rows_only_until_the_janitor_sweeps_them(backend, async |table| {
        rows(&url, table).await
    })
    .await;
}

#[tokio::test]
async fn build_names_the_address_and_the_kind_of_a_connection_failure() {
    crate::needs!(MariaDb);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let refused = MySqlBackend::connect(&format!("mysql://app@127.0.0.1:{port}/app")).await;
    let Err(error @ BuildError::Connect { .. }) = &refused else {
        panic!("nothing listens: {refused:?}");
    };
    let message = error.to_string();
    assert!(
        message.contains(&format!("127.0.0.1:{port}")) && message.contains("refused"),
        "{message}"
    );
    let server = mariadb::shared();
    let refused = MySqlBackend::connect(&server.url_as("nobody", "wrong")).await;
    let Err(error @ BuildError::Auth { user, .. }) = &refused else {
        panic!("unknown credentials: {refused:?}");
    };
    assert_eq!(user, "nobody");
    assert!(error.to_string().contains(&server.port().to_string()));
}

#[tokio::test]
async fn build_refuses_a_url_of_another_scheme_naming_the_schemes_it_takes() {
    crate::needs!(MariaDb);
    // A PostgreSQL URL, or an HTTP one, at a real MariaDB: refused before connecting.
    sql::urls_of_other_schemes_are_refused(
        &mariadb::shared().url(),
        ("mysql", "mariadb", &["postgres", "http"]),
        "a MySQL URL starts with `mysql://` or `mariadb://`",
        |url| {
            mariadb::builder_on(&url)
                .namespace(mariadb::fresh_namespace())
                .build()
        },
    )
    .await;
}

#[tokio::test]
async fn build_names_an_unknown_database_a_database_denied_and_a_migration_the_user_may_not_run() {
    crate::needs!(MariaDb);
    let server = mariadb::shared();
    let addr = format!("127.0.0.1:{}", server.port());
    let user = format!("u{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let db = format!("db_{user}");
    server
        .execute(&format!(
            "CREATE DATABASE {db}; CREATE USER {user}@'%' IDENTIFIED BY 'pw'; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON {db}.* TO {user}@'%'"
        ))
        .await;
    let refused = MySqlBackend::connect(&server.url().replace("/test", "/no_such_db")).await;
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
    // The right password, a database the user has no rights on.
    let refused = MySqlBackend::connect(&server.url_as(&user, "pw")).await;
    let Err(error @ BuildError::Rights { .. }) = &refused else {
        panic!("a database the user may not use is refused: {refused:?}");
    };
    assert_eq!(
        error.to_string(),
        format!(
            "the user `{user}` of the server at {addr} may not use the database `test` (or it \
             does not exist)"
        )
    );
    // Its own database, under migrate() without CREATE.
    let own = server
        .url_as(&user, "pw")
        .replace("/test", &format!("/{db}"));
    let refused = mariadb::builder_on(&own).build().await;
    let Err(error @ BuildError::Rights { .. }) = &refused else {
        panic!("a migration without CREATE is refused: {refused:?}");
    };
    assert_eq!(
        error.to_string(),
        format!(
            "the user `{user}` of the server at {addr} may not create the lock table \
             `tower_lock` and its procedures (what `migrate()` does: run the SQL of \
             `MySqlBackend::schema_sql` as a user who may, or grant CREATE)"
        )
    );
    // Without migrate(), in a database without the schema: MySQL answers a user who may
    // not EXECUTE as it answers a missing procedure.
    let refused = MySqlBackend::connect(&own).await;
    let Err(error @ BuildError::Rights { .. }) = &refused else {
        panic!("no EXECUTE, or no schema: {refused:?}");
    };
    assert_eq!(
        error.to_string(),
        format!(
            "the user `{user}` of the server at {addr} may not execute the procedures of the \
             lock table `tower_lock` (or they are not in this database: see \
             `MySqlBackend::schema_sql` and `migrate()`)"
        )
    );
}

#[test]
fn the_wake_connections_park_is_not_logged_as_a_slow_statement() {
    crate::needs!(MariaDb);
    // sqlx logs each statement when it ends, at WARN "slow statement" past a second (a
    // park lasts its whole interval when nothing wakes it), else at DEBUG.
    let log = support::logged_on_this_thread("sqlx::query=debug", async |log| {
        let backend = mariadb::builder(&mariadb::fresh_namespace())
            .wake_ping_interval(Duration::from_secs(1))
            .build()
            .await
            .expect("backend");
        // One park ran to its end (1 s, nothing woke it).
        log.until("woken = 1), 0, GET_LOCK", 1).await;
        drop(backend);
    });
    let text = log.text();
    assert!(!text.contains("slow statement"), "{text}");
}

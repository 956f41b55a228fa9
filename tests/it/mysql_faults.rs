//! MySQL/MariaDB faults: a holder process killed with -9, the wake connection killed
//! (`KILL CONNECTION`) while requests wait, the server restarted mid-run, the pool
//! exhausted. The bodies are shared with postgres_faults.rs (tests/support/sql.rs).

use crate::support;

use std::time::Duration;

use sqlx::Connection;
use support::child;
use support::mariadb::{self, MariaDbServer, fresh_database};
use support::sql;
use tower_lock::MySqlBackend;

const URL: &str = "TOWER_LOCK_TEST_MYSQL_URL";

#[tokio::test]
#[ignore = "entry point of the child processes that the tests spawn"]
async fn child_process() {
    if child::role().as_deref() == Some("holder") {
        sql::hold_until_killed::<MariaDbServer>(URL).await;
    }
}

/// One integer that `sql` selects, on a connection to `url`.
async fn scalar(url: &str, sql: &str) -> i64 {
    let mut conn = sqlx::MySqlConnection::connect(url).await.expect("connect");
    sqlx::query_scalar(sql)
        .fetch_one(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test]
async fn a_holder_killed_with_sigkill_loses_its_lock_at_its_expiry_and_no_sooner() {
    crate::needs!(MariaDb);
    let url = fresh_database().await;
    sql::holder_killed_loses_its_lock_at_its_expiry_and_no_sooner::<MariaDbServer>(
        "mysql_faults::child_process",
        url,
        URL,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wake_connection_killed_while_requests_wait_all_are_served_after_the_release() {
    crate::needs!(MariaDb);
    // A database of its own: every waiter row in it is one of this test's backends'.
    let url = fresh_database().await;
    let instance = || async {
        mariadb::builder_on(&url)
            // Parks longer than the test: only a wake-up or a reconnect ends one.
            .wake_ping_interval(Duration::from_secs(120))
            .build()
            .await
            .expect("backend")
    };
    let holders = instance().await;
    let waiting = instance().await;
    let kill = async || {
        // The waiting backend's wake connection: the one registered for more than the
        // admin channel.
        let wake = scalar(
            &url,
            "SELECT CAST(conn AS SIGNED) FROM tower_lock_waiters GROUP BY conn HAVING COUNT(*) > 1",
        )
        .await;
        mariadb::shared()
            .execute(&format!("KILL CONNECTION {wake}"))
            .await;
    };
    sql::wake_connection_cut_while_requests_wait_all_are_served_after_the_release::<MariaDbServer>(
        holders, waiting, kill,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_restarted_mid_run_answers_503_then_serves_with_no_double_hold() {
    crate::needs!(MariaDb);
    sql::server_restarted_mid_run_answers_503_then_serves_with_no_double_hold::<MariaDbServer>()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_answers_503_within_the_wait_and_recovers() {
    crate::needs!(MariaDb);
    mariadb::backend().await; // the schema
    let url = mariadb::shared().url();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("pool");
    let backend = MySqlBackend::from_pool(pool.clone())
        .namespace(mariadb::fresh_namespace())
        .build()
        .await
        .expect("backend on the application's pool");
    sql::exhausted_pool_answers_503_within_the_wait_and_recovers(backend, pool).await;
}

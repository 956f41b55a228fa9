//! PostgreSQL faults: a holder process killed with -9, the listening connection
//! terminated while requests wait, the server restarted mid-run, the pool exhausted. The
//! bodies are shared with mysql_faults.rs (tests/support/sql.rs).

use crate::support;

use support::child;
use support::postgres::{self, PostgresServer};
use support::sql;
use tower_lock::PostgresBackend;

const URL: &str = "TOWER_LOCK_TEST_POSTGRES_URL";

#[tokio::test]
#[ignore = "entry point of the child processes that the tests spawn"]
async fn child_process() {
    if child::role().as_deref() == Some("holder") {
        sql::hold_until_killed::<PostgresServer>(URL).await;
    }
}

#[tokio::test]
async fn a_holder_killed_with_sigkill_loses_its_lock_at_its_expiry_and_no_sooner() {
    crate::needs!(Postgres);
    let server = PostgresServer::start();
    sql::holder_killed_loses_its_lock_at_its_expiry_and_no_sooner::<PostgresServer>(
        "postgres_faults::child_process",
        server.url(),
        URL,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_terminated_while_requests_wait_all_are_served_after_the_release() {
    crate::needs!(Postgres);
    let server = postgres::shared();
    let namespace = postgres::fresh_namespace();
    let holders = postgres::backend_in(&namespace).await;
    let waiting = postgres::backend_in(&namespace).await;
    let terminate = async || assert!(server.terminate("tower-lock listener").await >= 1);
    sql::wake_connection_cut_while_requests_wait_all_are_served_after_the_release::<
        PostgresServer,
    >(holders, waiting, terminate)
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_restarted_mid_run_answers_503_then_serves_with_no_double_hold() {
    crate::needs!(Postgres);
    sql::server_restarted_mid_run_answers_503_then_serves_with_no_double_hold::<PostgresServer>()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_answers_503_within_the_wait_and_recovers() {
    crate::needs!(Postgres);
    let server = postgres::shared();
    postgres::backend().await; // the schema
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&server.url())
        .await
        .expect("pool");
    let backend = PostgresBackend::from_pool(pool.clone())
        .namespace(postgres::fresh_namespace())
        .build()
        .await
        .expect("backend on the application's pool");
    sql::exhausted_pool_answers_503_within_the_wait_and_recovers(backend, pool).await;
}

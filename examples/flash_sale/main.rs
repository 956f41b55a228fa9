//! The flash-sale oversell, and the one-line fix, in one table and one picture.
//!
//! A stock of 50 is shared by three app instances (each with its own lock backend and
//! port, as three pods would have), and a few hundred buyers hit them round-robin, all at
//! once. The buy handler reads the stock, awaits (the payment call), then writes stock - 1:
//! without a lock, buyers on different instances read the same stock and sell the same item
//! twice.
//!
//! - `/unsafe/buy`: the handler alone. Oversells.
//! - `/buy`: the same handler under `LockLayer` (waits for the lock).
//! - `/try-buy`: under `LockLayer::fail_fast()` (409 while someone else is buying).
//!
//! Sold out is 410 Gone. Exits non-zero if a locked route oversells.
//!
//! ```text
//! cargo run --release --example flash_sale                     # picture: $CARGO_TARGET_DIR/flash_sale.svg
//! cargo run --release --example flash_sale -- docs/flash_sale.svg
//! cargo run --release --example flash_sale -- --raw-metrics    # and the metrics' own lines
//! cargo run --release --example flash_sale -- --help
//! ```
//!
//! The picture goes to the path given as the argument, else to `flash_sale.svg` in
//! `CARGO_TARGET_DIR` when that is set, else in the crate's `target`; the run prints where.
//!
//! Where the stock and the locks live:
//!
//! - `REDIS_URL` set: that Redis. Every key the demo writes lives under a namespace of the
//!   run's own (a random suffix, claimed with `SETNX` before anything is written), and is
//!   deleted at the end.
//! - otherwise, with `redis-server` on `PATH`: a throwaway `redis-server` started here on a
//!   free loopback port, killed when the demo ends; the namespace is `flash-sale`.
//! - otherwise: one in-process `MemoryBackend` shared by the three apps, and the stock in
//!   process memory (with the same await between read and write, so `/unsafe/buy` still
//!   oversells).
//!
//! Every instance serves `/metrics` (the crate's `metrics` feature through a Prometheus
//! exporter); after the run the demo scrapes it and prints, per locked route, the
//! acquisitions by outcome and the wait and hold times (p50, p99). `--raw-metrics` prints
//! the scraped lines of the locked routes too.
//!
//! The picture (see `timeline/`) shows who held the lock when on `/buy`, one lane per
//! instance, and the sales of `/unsafe/buy` against the stock line crossing zero, both on
//! one time axis, with a mark for every request.

mod cli;
mod load;
mod scrape;
mod shop;
mod summary;
mod throwaway;
mod timeline;

use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;

use metrics_exporter_prometheus::PrometheusHandle;
use tower_lock::{MemoryBackend, RedisBackend};

use crate::cli::{Command, Options};
use crate::load::Row;
use crate::shop::{LOCKED_ROUTES, Recorders, Store};
use crate::throwaway::ThrowawayRedis;
use crate::timeline::Timeline;

const STOCK: i64 = 50;
const BUYERS: usize = 300;
const INSTANCES: usize = 3;
const ROUTES: [&str; 3] = ["/unsafe/buy", LOCKED_ROUTES[0].1, LOCKED_ROUTES[1].1];

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Where the stock and the locks live.
enum Place {
    /// The Redis at `REDIS_URL`, which others may use too.
    SharedRedis(String),
    /// A `redis-server` this run started: nothing else writes there.
    OwnRedis(String),
    Memory,
}

/// The namespace on a Redis nothing else writes to.
const NAMESPACE: &str = "flash-sale";

#[tokio::main]
async fn main() -> ExitCode {
    let args = std::env::args_os().skip(1);
    let options = match cli::parse(args, std::env::var_os("CARGO_TARGET_DIR")) {
        Ok(Command::Run(options)) => options,
        Ok(Command::Help) => {
            println!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(usage) => {
            eprintln!("{usage}");
            return ExitCode::from(2);
        }
    };
    match demo(&options).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("FAIL: a locked route oversold");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("flash_sale: {}", chain(&*e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its sources, joined by ": ".
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut levels = vec![error.to_string()];
    let mut source = error.source();
    while let Some(e) = source {
        // Some errors print their source in their own message too.
        let level = e.to_string();
        if !levels.iter().any(|l| l.contains(&level)) {
            levels.push(level);
        }
        source = e.source();
    }
    levels.join(": ")
}

/// Runs the sale on every route, prints the table and writes the picture; whether the
/// locked routes sold no more than the stock.
async fn demo(options: &Options) -> Result<bool, Error> {
    let svg = options.svg.as_path();
    // Lives until the end of this function: the server is killed on every way out.
    let mut throwaway = None;
    let (place, shared) = if let Some(url) =
        std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty())
    {
        // The version is for the reader only: a Redis that refuses INFO still runs the demo.
        match throwaway::server_info(&url).await {
            Ok(info) => println!("Redis from REDIS_URL (redis-server {})", info.version),
            Err(_) => println!("Redis from REDIS_URL"),
        }
        (Place::SharedRedis(url), "one Redis")
    } else if let Some(server) = ThrowawayRedis::start().await? {
        println!(
            "throwaway redis-server {} on {} (REDIS_URL is unset; stopped when the demo ends)",
            server.version(),
            server.url()
        );
        let url = server.url().to_owned();
        throwaway = Some(server);
        (Place::OwnRedis(url), "one Redis")
    } else {
        println!(
            "no redis-server on PATH and REDIS_URL unset: running on the in-process MemoryBackend \
             (install redis-server or set REDIS_URL to run across a real Redis)"
        );
        (Place::Memory, "one in-process MemoryBackend")
    };
    let recorders = Recorders::default();
    let prometheus = scrape::install()?;
    let (rows, exposition) = run(&place, &recorders, &prometheus).await?;
    drop(throwaway);

    println!(
        "Stock {STOCK}, {BUYERS} concurrent buyers, round-robin over {INSTANCES} instances sharing {shared}.\n"
    );
    println!("{}", Row::HEADER);
    rows.iter().for_each(Row::print);
    println!();
    let others: usize = rows.iter().map(Row::others).sum();
    if others > 0 {
        println!("({others} requests ended with another status or a transport error.)");
    }
    if let [unsafe_row, wait_row, fail_fast_row] = rows.as_slice() {
        println!(
            "Without a lock the three instances sold {} items that did not exist. Under LockLayer \
             nothing was oversold: `/buy` queued buyers and sold exactly the stock ({}), then said 410; \
             `/try-buy` sold {} and answered 409 to the {} buyers who came while someone was buying.",
            unsafe_row.oversold(),
            wait_row.sold,
            fail_fast_row.sold,
            fail_fast_row.count(409),
        );
    }

    println!(
        "\nThe lock's metrics, scraped from GET /metrics (one scrape covers the three instances: \
         they share this process's recorder). Wait: from asking for the lock to holding it or \
         giving up; hold: until its release. Each p50 and p99 is the histogram bucket it falls \
         in. `--raw-metrics` prints the lines.\n"
    );
    print!("{}", summary::table(&exposition, &LOCKED_ROUTES));
    if options.raw_metrics {
        let labels = LOCKED_ROUTES.map(|(label, _)| label);
        println!("\nThe lines behind it (--raw-metrics):\n");
        for line in summary::raw_lines(&exposition, &labels) {
            println!("{line}");
        }
    }

    let title = format!(
        "Flash sale: stock {STOCK}, {BUYERS} buyers at once, {INSTANCES} instances sharing {shared}"
    );
    let (locked, unlocked) = (recorders.locked.runs(), recorders.unlocked.runs());
    let timeline = Timeline {
        title: &title,
        stock: STOCK,
        instances: INSTANCES,
        locked: &locked,
        unlocked: &unlocked,
    };
    timeline::write(svg, &timeline)
        .map_err(|e| format!("could not write the picture to {}: {e}", svg.display()))?;
    let shown = std::env::current_dir()
        .ok()
        .and_then(|dir| svg.strip_prefix(dir).ok().map(Path::to_path_buf))
        .unwrap_or_else(|| svg.to_path_buf());
    println!("\nTimeline of /buy and /unsafe/buy: {}", shown.display());

    let locked_oversold: i64 = rows.iter().skip(1).map(Row::oversold).sum();
    Ok(locked_oversold == 0)
}

/// Starts the instances on `place`, sells on every route in turn, then scrapes the first
/// instance's `/metrics`.
async fn run(
    place: &Place,
    recorders: &Recorders,
    prometheus: &PrometheusHandle,
) -> Result<(Vec<Row>, String), Error> {
    match place {
        Place::Memory => {
            let mut instances = Vec::new();
            let backend = MemoryBackend::new();
            let store = Store::memory();
            for instance in 1..=INSTANCES {
                let app = shop::app(backend.clone(), store.clone(), instance, recorders);
                let metrics = scrape::route(prometheus.clone());
                instances.push(shop::serve(app.merge(metrics)).await?);
            }
            sell(&store, &instances).await
        }
        Place::SharedRedis(url) => {
            let namespace = shop::claim_namespace(url)
                .await?
                .ok_or("could not claim a namespace of the demo's own on REDIS_URL")?;
            on_redis(url, &namespace, recorders, prometheus).await
        }
        Place::OwnRedis(url) => on_redis(url, NAMESPACE, recorders, prometheus).await,
    }
}

/// Starts the instances on the Redis at `url`, sells, and deletes what the run wrote
/// (whether it sold or failed).
async fn on_redis(
    url: &str,
    namespace: &str,
    recorders: &Recorders,
    prometheus: &PrometheusHandle,
) -> Result<(Vec<Row>, String), Error> {
    let store = Store::redis(url, namespace).await?;
    let sold = async {
        let mut instances = Vec::new();
        for instance in 1..=INSTANCES {
            let backend = RedisBackend::builder(url)
                .namespace(namespace)
                .build()
                .await?;
            let store = Store::redis(url, namespace).await?;
            let app = shop::app(backend, store, instance, recorders);
            let metrics = scrape::route(prometheus.clone());
            instances.push(shop::serve(app.merge(metrics)).await?);
        }
        sell(&store, &instances).await
    }
    .await;
    store.clean_up().await?;
    sold
}

async fn sell(store: &Store, instances: &[SocketAddr]) -> Result<(Vec<Row>, String), Error> {
    let client = load::http_client();
    let mut rows = Vec::new();
    for route in ROUTES {
        rows.push(load::run_route(store, &client, instances, route, (STOCK, BUYERS)).await?);
    }
    let first = instances.first().ok_or("no instance started")?;
    Ok((rows, scrape::fetch(&client, *first).await?))
}

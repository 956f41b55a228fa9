//! The demo's command line and its metrics summary: where the picture goes (the argument,
//! else `CARGO_TARGET_DIR`, else the crate's `target`), and what the summary reads from a
//! scrape of `/metrics`.

#[path = "../../examples/flash_sale/cli.rs"]
mod cli;
#[path = "../../examples/flash_sale/summary.rs"]
mod summary;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use cli::{Command, Options};

fn parse(args: &[&str], target_dir: Option<&str>) -> Result<Command, String> {
    cli::parse(
        args.iter().map(OsString::from),
        target_dir.map(OsString::from),
    )
}

fn run(svg: impl Into<PathBuf>, raw_metrics: bool) -> Result<Command, String> {
    Ok(Command::Run(Options {
        svg: svg.into(),
        raw_metrics,
    }))
}

#[test]
fn the_picture_goes_to_cargo_target_dir_else_the_crates_target() {
    let crate_target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/flash_sale.svg");
    assert_eq!(parse(&[], None), run(&crate_target, false));
    assert_eq!(
        parse(&[], Some("/elsewhere/build")),
        run("/elsewhere/build/flash_sale.svg", false)
    );
    // Relative, as cargo reads it: from the working directory.
    assert_eq!(
        parse(&[], Some("build")),
        run("build/flash_sale.svg", false)
    );
    assert_eq!(
        parse(&[], Some("")),
        run(&crate_target, false),
        "empty is unset"
    );
}

#[test]
fn an_argument_names_the_picture_and_flags_go_anywhere() {
    let elsewhere = Some("/elsewhere/build");
    assert_eq!(
        parse(&["docs/flash_sale.svg"], elsewhere),
        run("docs/flash_sale.svg", false)
    );
    assert_eq!(parse(&["--raw-metrics", "a.svg"], None), run("a.svg", true));
    assert_eq!(parse(&["a.svg", "--raw-metrics"], None), run("a.svg", true));
    assert_eq!(
        parse(&["--raw-metrics"], elsewhere),
        run("/elsewhere/build/flash_sale.svg", true)
    );
    assert_eq!(parse(&["--", "-odd.svg"], None), run("-odd.svg", false));
    assert_eq!(parse(&["a.svg", "--help"], None), Ok(Command::Help));
    assert_eq!(parse(&["-h"], None), Ok(Command::Help));
    for wrong in [&["--raw"][..], &["a.svg", "b.svg"]] {
        let usage = parse(wrong, None).expect_err("refused");
        assert!(usage.contains(cli::USAGE), "{wrong:?} shows the usage");
    }
}

/// A scrape as the demo's instances serve it (one recorder, histograms with buckets),
/// trimmed to a few buckets, with a route the summary is not asked about and a `mode`
/// label splitting `/buy`'s series.
const SCRAPE: &str = r#"# HELP tower_lock_acquisitions_total Lock acquisitions by outcome
# TYPE tower_lock_acquisitions_total counter
tower_lock_acquisitions_total{namespace="flash-sale",route="try-buy",outcome="contended"} 299
tower_lock_acquisitions_total{namespace="flash-sale",route="buy",outcome="acquired",mode="exclusive"} 280
tower_lock_acquisitions_total{namespace="flash-sale",route="buy",outcome="acquired",mode="shared"} 20
tower_lock_acquisitions_total{namespace="flash-sale",route="try-buy",outcome="acquired"} 1
tower_lock_acquisitions_total{namespace="flash-sale",route="try-buy",outcome="timed_out"} 0
tower_lock_acquisitions_total{namespace="flash-sale",route="other \"quoted\"",outcome="acquired"} 7
# TYPE tower_lock_held gauge
tower_lock_held{namespace="flash-sale",route="buy"} 0
# TYPE tower_lock_hold_seconds histogram
tower_lock_hold_seconds_bucket{namespace="flash-sale",route="buy",mode="exclusive",le="0.0001"} 230
tower_lock_hold_seconds_bucket{namespace="flash-sale",route="buy",mode="exclusive",le="0.005"} 230
tower_lock_hold_seconds_bucket{namespace="flash-sale",route="buy",mode="exclusive",le="0.01"} 280
tower_lock_hold_seconds_bucket{namespace="flash-sale",route="buy",mode="exclusive",le="+Inf"} 280
tower_lock_hold_seconds_sum{namespace="flash-sale",route="buy",mode="exclusive"} 0.36
tower_lock_hold_seconds_count{namespace="flash-sale",route="buy",mode="exclusive"} 280
tower_lock_hold_seconds_bucket{namespace="flash-sale",route="buy",mode="shared",le="0.0001"} 20
tower_lock_hold_seconds_bucket{namespace="flash-sale",route="buy",mode="shared",le="0.005"} 20
tower_lock_hold_seconds_bucket{namespace="flash-sale",route="buy",mode="shared",le="0.01"} 20
tower_lock_hold_seconds_bucket{namespace="flash-sale",route="buy",mode="shared",le="+Inf"} 20
tower_lock_wait_seconds_bucket{namespace="flash-sale",route="buy",le="0.1"} 30
tower_lock_wait_seconds_bucket{namespace="flash-sale",route="buy",le="0.5"} 300
tower_lock_wait_seconds_bucket{namespace="flash-sale",route="buy",le="+Inf"} 300
tower_lock_wait_seconds_bucket{namespace="flash-sale",route="try-buy",le="0.01"} 0
tower_lock_wait_seconds_bucket{namespace="flash-sale",route="try-buy",le="0.02"} 250
tower_lock_wait_seconds_bucket{namespace="flash-sale",route="try-buy",le="10"} 299
tower_lock_wait_seconds_bucket{namespace="flash-sale",route="try-buy",le="+Inf"} 300
"#;

#[test]
fn the_summary_reads_outcomes_and_quantile_buckets_from_the_scrape() {
    let buy = summary::route(SCRAPE, "buy");
    assert_eq!(buy.outcomes, [("acquired".to_owned(), 300)], "modes add up");
    // 250 holds at or below 0.1 ms (the two modes' buckets added up), 50 in (5, 10] ms.
    assert_eq!(buy.hold.quantile(0.5), Some((0.0, 0.0001)));
    assert_eq!(buy.hold.quantile(0.99), Some((0.005, 0.01)));
    assert_eq!(buy.wait.quantile(0.5), Some((0.1, 0.5)));

    let try_buy = summary::route(SCRAPE, "try-buy");
    assert_eq!(
        try_buy.outcomes,
        [("acquired".to_owned(), 1), ("contended".to_owned(), 299)],
        "acquired first, zeros left out"
    );
    assert_eq!(try_buy.wait.quantile(0.5), Some((0.01, 0.02)));
    assert_eq!(try_buy.wait.quantile(0.999), Some((10.0, f64::INFINITY)));
    assert_eq!(try_buy.hold.quantile(0.5), None, "no hold recorded");

    let table = summary::table(SCRAPE, &[("buy", "/buy"), ("try-buy", "/try-buy")]);
    assert!(
        table.contains("| `/buy` | 300 acquired | 100-500 ms | 100-500 ms | 0-100 µs | 5-10 ms |"),
        "{table}"
    );
    assert!(
        table.contains("| `/try-buy` | 1 acquired, 299 contended | 10-20 ms | 0.02-10 s | - | - |"),
        "{table}"
    );
    assert!(!table.contains("other"), "only the routes asked about");
}

#[test]
fn raw_lines_are_the_locked_routes_samples() {
    let lines = summary::raw_lines(SCRAPE, &["try-buy"]);
    assert_eq!(lines.len(), 7, "{lines:#?}");
    assert!(lines.iter().all(|l| l.contains(r#"route="try-buy""#)));
    assert!(
        summary::raw_lines(SCRAPE, &[r#"other "quoted""#]).len() == 1,
        "escaped quotes in a label are read"
    );
}

#[test]
fn ranges_read_as_a_person_would() {
    let shown = [
        None,
        Some((0.0, 1e-5)),
        Some((50e-6, 63e-6)),
        Some((0.0008, 0.001)),
        Some((0.0032, 0.004)),
        Some((0.4, 0.5)),
        Some((10.0, f64::INFINITY)),
    ]
    .map(summary::range);
    assert_eq!(
        shown,
        [
            "-",
            "0-10 µs",
            "50-63 µs",
            "0.8-1 ms",
            "3.2-4 ms",
            "400-500 ms",
            "> 10 s"
        ]
    );
}

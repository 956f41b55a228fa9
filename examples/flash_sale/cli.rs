//! The demo's command line: where the picture goes, and whether to print the raw metrics.
//!
//! `tests/it/flash_sale_cli.rs` includes this file with `#[path]`; it depends on nothing else
//! in the example.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Command {
    /// Run the demo.
    Run(Options),
    /// Print [`USAGE`] and stop.
    Help,
}

/// How to run the demo.
#[derive(Debug, PartialEq, Eq)]
pub struct Options {
    /// Where to write the picture.
    pub svg: PathBuf,
    /// Whether to print the locked routes' Prometheus lines after the summary.
    pub raw_metrics: bool,
}

pub const USAGE: &str = "\
usage: cargo run --release --example flash_sale [-- [--raw-metrics] [PICTURE.svg]]

Sells a stock of 50 to 300 buyers at once on three shop instances, without a lock and
under LockLayer, then prints what each route sold, a summary of the lock's metrics, and
where the timeline picture went.

  PICTURE.svg    where to write the picture (default: $CARGO_TARGET_DIR/flash_sale.svg,
                 or target/flash_sale.svg in the crate when CARGO_TARGET_DIR is unset)
  --raw-metrics  also print the lock's Prometheus lines for the locked routes
  -h, --help     print this text

With REDIS_URL set, the sale runs on that Redis, under a namespace of the run's own that
is deleted at the end; otherwise on a throwaway redis-server (when one is on PATH), else
on the in-process MemoryBackend.";

/// Reads the arguments (without the program's name); `target_dir` is `CARGO_TARGET_DIR`.
pub fn parse(
    args: impl IntoIterator<Item = OsString>,
    target_dir: Option<OsString>,
) -> Result<Command, String> {
    let mut svg = None;
    let mut raw_metrics = false;
    let mut options_ended = false;
    for arg in args {
        if !options_ended {
            match arg.to_str() {
                Some("--") => {
                    options_ended = true;
                    continue;
                }
                Some("-h" | "--help") => return Ok(Command::Help),
                Some("--raw-metrics") => {
                    raw_metrics = true;
                    continue;
                }
                Some(flag) if flag.starts_with('-') => {
                    return Err(format!("unknown option {flag}\n\n{USAGE}"));
                }
                _ => {}
            }
        }
        if svg.replace(PathBuf::from(arg)).is_some() {
            return Err(format!("one picture path at most\n\n{USAGE}"));
        }
    }
    Ok(Command::Run(Options {
        svg: svg.unwrap_or_else(|| default_svg(target_dir)),
        raw_metrics,
    }))
}

/// `flash_sale.svg` in the build's target directory: `CARGO_TARGET_DIR` when set (relative
/// to the working directory, as cargo reads it), else the crate's `target`.
pub fn default_svg(target_dir: Option<OsString>) -> PathBuf {
    let target = match target_dir.filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target"),
    };
    target.join("flash_sale.svg")
}

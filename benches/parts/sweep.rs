//! The hot key over a sweep of critical sections: one table, and the same figures as an
//! SVG chart (throughput and wait p99 per lock against the section length), written to
//! `target/contention_sweep.svg` (or `BENCH_SVG`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use crate::{HotRun, INSTANCES, Percentiles, TASKS};

/// The critical sections of the sweep.
pub const SECTIONS: [Duration; 4] = [
    Duration::ZERO,
    Duration::from_micros(100),
    Duration::from_millis(1),
    Duration::from_millis(10),
];

/// One lock at one section length.
pub struct Point {
    lock: &'static str,
    section: Duration,
    rate: f64,
    wait_p50: Duration,
    wait_p99: Duration,
    /// The largest deviation of an instance's share of acquisitions from a fair share.
    unfairness: f64,
    lost: u64,
}

impl Point {
    pub fn of(section: Duration, run: &HotRun) -> Self {
        let waits = Percentiles::of(run.waits.clone());
        let fair = run.acquisitions as f64 / INSTANCES as f64;
        let unfairness = run
            .per_instance
            .iter()
            .map(|&n| (n as f64 / fair.max(1.0) - 1.0).abs())
            .fold(0.0, f64::max);
        Point {
            lock: run.name,
            section,
            rate: run.acquisitions as f64 / run.elapsed.as_secs_f64(),
            wait_p50: waits.p50,
            wait_p99: waits.p99,
            unfairness,
            lost: run.lost,
        }
    }
}

fn section_label(section: Duration) -> String {
    let ms = section.as_secs_f64() * 1e3;
    if ms == 0.0 || ms >= 1.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{ms:.1} ms")
    }
}

/// The sweep's table, and the chart written beside it.
pub fn report(points: &[Point]) -> String {
    let mut out = format!(
        "### Sweep of critical sections, one hot key, {TASKS} tasks over {INSTANCES} instances\n\n"
    );
    out += "| lock | section | acq/s | vs mutex | wait p50 | wait p99 | wait p99 vs mutex | p99/p50 | largest deviation of one instance from a fair share | lost updates |\n";
    out += "|---|---|---|---|---|---|---|---|---|---|\n";
    for point in points {
        // The mutex is the first lock of each section.
        let mutex = points.iter().find(|p| p.section == point.section);
        let (mutex_rate, mutex_p99) = mutex.map_or((1.0, 1e-9), |p| {
            (p.rate, p.wait_p99.as_secs_f64().max(1e-9))
        });
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.0}% | {:.2} ms | {:.2} ms | {:.1}x | {:.1} | {:.0}% | {} |",
            point.lock,
            section_label(point.section),
            point.rate,
            100.0 * point.rate / mutex_rate,
            point.wait_p50.as_secs_f64() * 1e3,
            point.wait_p99.as_secs_f64() * 1e3,
            point.wait_p99.as_secs_f64() / mutex_p99,
            point.wait_p99.as_secs_f64() / point.wait_p50.as_secs_f64().max(1e-9),
            100.0 * point.unfairness,
            point.lost,
        );
    }
    let path = std::env::var_os("BENCH_SVG").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/contention_sweep.svg"),
        PathBuf::from,
    );
    match std::fs::write(&path, chart(points)) {
        Ok(()) => {
            let _ = writeln!(out, "\n(chart: {})\n", path.display());
        }
        Err(e) => {
            let _ = writeln!(
                out,
                "\n(could not write the chart to {}: {e})\n",
                path.display()
            );
        }
    }
    out
}

const COLORS: [&str; 5] = ["#555555", "#2563eb", "#60a5fa", "#dc2626", "#d97706"];
const WIDTH: f64 = 940.0;
const PANEL_W: f64 = 360.0;
const PANEL_H: f64 = 260.0;

/// Two log-scale panels: acquisitions per second, and wait p99, against the section.
fn chart(points: &[Point]) -> String {
    let mut locks: Vec<&str> = Vec::new();
    for point in points {
        if !locks.contains(&point.lock) {
            locks.push(point.lock);
        }
    }
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"420\" \
         font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"20\" y=\"24\" font-size=\"15\" font-weight=\"bold\">One hot key, {TASKS} tasks over \
         {INSTANCES} instances: throughput and wait p99 by critical section</text>\n"
    );
    let rate = |p: &Point| p.rate;
    let wait = |p: &Point| p.wait_p99.as_secs_f64() * 1e3;
    panel(
        &mut svg,
        points,
        &locks,
        (60.0, 50.0),
        "acquisitions per second",
        &rate,
    );
    panel(
        &mut svg,
        points,
        &locks,
        (510.0, 50.0),
        "wait p99 (ms)",
        &wait,
    );
    for (i, lock) in locks.iter().enumerate() {
        let (x, y) = (70.0 + (i % 3) as f64 * 290.0, 360.0 + (i / 3) as f64 * 20.0);
        let _ = writeln!(
            svg,
            "<g class=\"legend\"><line x1=\"{x}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{}\" \
             stroke-width=\"3\"/><text x=\"{}\" y=\"{}\">{}</text></g>",
            x + 24.0,
            COLORS[i % COLORS.len()],
            x + 30.0,
            y + 4.0,
            escape(lock)
        );
    }
    svg += "</svg>\n";
    svg
}

/// One panel at `origin`: a log-scale y axis of `value`, the sections as even steps on x.
fn panel(
    svg: &mut String,
    points: &[Point],
    locks: &[&str],
    (left, top): (f64, f64),
    title: &str,
    value: &dyn Fn(&Point) -> f64,
) {
    let values: Vec<f64> = points.iter().map(value).filter(|v| *v > 0.0).collect();
    let lo = values.iter().copied().fold(f64::MAX, f64::min).max(1e-3);
    let hi = values.iter().copied().fold(0.0, f64::max).max(lo * 10.0);
    let (lo, hi) = (
        10f64.powf(lo.log10().floor()),
        10f64.powf(hi.log10().ceil()),
    );
    let y = |v: f64| {
        top + PANEL_H - PANEL_H * (v.max(lo).log10() - lo.log10()) / (hi.log10() - lo.log10())
    };
    let step = PANEL_W / (SECTIONS.len() - 1) as f64;
    let _ = writeln!(
        svg,
        "<g class=\"panel\"><text x=\"{left}\" y=\"{}\" font-weight=\"bold\">{title}</text>\n\
         <rect x=\"{left}\" y=\"{top}\" width=\"{PANEL_W}\" height=\"{PANEL_H}\" fill=\"#f8fafc\" stroke=\"#cbd5e1\"/>",
        top - 8.0
    );
    let mut decade = lo;
    while decade <= hi * 1.001 {
        let _ = writeln!(
            svg,
            "<line x1=\"{left}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"#e2e8f0\"/>\
             <text x=\"{2}\" y=\"{3:.1}\" text-anchor=\"end\">{4}</text>",
            y(decade),
            left + PANEL_W,
            left - 6.0,
            y(decade) + 4.0,
            tick(decade)
        );
        decade *= 10.0;
    }
    for (i, section) in SECTIONS.iter().enumerate() {
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            left + step * i as f64,
            top + PANEL_H + 18.0,
            section_label(*section)
        );
    }
    for (i, lock) in locks.iter().enumerate() {
        let line: Vec<String> = SECTIONS
            .iter()
            .enumerate()
            .filter_map(|(s, section)| {
                let point = points
                    .iter()
                    .find(|p| p.lock == *lock && p.section == *section)?;
                Some(format!(
                    "{:.1},{:.1}",
                    left + step * s as f64,
                    y(value(point))
                ))
            })
            .collect();
        let _ = writeln!(
            svg,
            "<polyline class=\"lock\" data-lock=\"{}\" points=\"{}\" fill=\"none\" stroke=\"{}\" \
             stroke-width=\"2.5\"/>",
            escape(lock),
            line.join(" "),
            COLORS[i % COLORS.len()]
        );
    }
    svg.push_str("</g>\n");
}

/// A decade as a short label: 0.01, 0.1, 1, 10, 100, 1k, 10k, 100k, 1M.
fn tick(decade: f64) -> String {
    match decade {
        d if d >= 1e6 => format!("{:.0}M", d / 1e6),
        d if d >= 1e3 => format!("{:.0}k", d / 1e3),
        d if d >= 1.0 => format!("{d:.0}"),
        d => format!("{d}"),
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

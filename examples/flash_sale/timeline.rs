//! The flash sale as a picture: an SVG timeline, written as text (no plotting crate).
//!
//! Two panels:
//!
//! - `/buy`: one lane per instance (`<g class="lane" data-instance="N">`), and in it a bar
//!   for each run of that instance's handler (`<rect class="hold" data-instance="N"
//!   data-start="ms" data-end="ms" data-sold="true|false">`). The handler runs inside the
//!   lock, so no two bars overlap in time.
//! - `/unsafe/buy`: the items sold so far (a step line, `<path class="sold">`) against the
//!   stock left (`<path class="stock">`), which crosses the zero line (`<line
//!   class="zero">`) when the route oversells. Each sale is a `<circle class="sale"
//!   data-at="ms" data-sold="k" data-stock="stock - k">`; each path's `data-last` is its
//!   final value.
//!
//! Times are milliseconds since the route's first request reached a handler. The figures
//! are attributes so that a test can parse the picture instead of comparing bytes.
//!
//! This file depends on nothing else in the example: `tests/flash_sale_svg.rs` includes it
//! with `#[path]`.

use std::fmt::{self, Write as _};
use std::io;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

/// One run of a handler: on which instance (from 1), when, and whether it sold an item.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub instance: usize,
    pub start: Instant,
    pub end: Instant,
    pub sold: bool,
}

/// Where the handlers of one route, on every instance, record their runs.
#[derive(Debug, Default)]
pub struct Recorder {
    runs: Mutex<Vec<Run>>,
}

impl Recorder {
    /// Records a run of `instance`'s handler that began at `start` and ends now.
    pub fn record(&self, instance: usize, start: Instant, sold: bool) {
        let run = Run {
            instance,
            start,
            end: Instant::now(),
            sold,
        };
        // A panicking handler cannot leave the list half-written: keep recording.
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        runs.push(run);
    }

    /// Every run recorded so far.
    pub fn runs(&self) -> Vec<Run> {
        self.runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// What the picture shows.
pub struct Timeline<'a> {
    /// The first line of the picture.
    pub title: &'a str,
    /// The stock at the start of each route.
    pub stock: i64,
    /// How many instances served the sale (one lane each).
    pub instances: usize,
    /// The `/buy` handler's runs: each one held the lock throughout.
    pub locked: &'a [Run],
    /// The `/unsafe/buy` handler's runs: those that sold are the sales.
    pub unlocked: &'a [Run],
}

/// Writes the picture to `path`, creating its directory.
pub fn write(path: &Path, timeline: &Timeline) -> io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let svg = render(timeline).map_err(io::Error::other)?;
    std::fs::write(path, svg)
}

const WIDTH: f64 = 960.0;
const LEFT: f64 = 100.0;
const RIGHT: f64 = 30.0;
const PLOT: f64 = WIDTH - LEFT - RIGHT;
const LANE: f64 = 34.0;
const CHART: f64 = 240.0;

const STYLE: &str = "\
text { font-family: sans-serif; font-size: 12px; fill: #222 }
.title { font-size: 15px; font-weight: bold }
.heading { font-size: 13px; font-weight: bold }
.lane-bg { fill: #f3f4f6 }
.hold { fill: #2563eb }
.hold[data-sold=\"false\"] { fill: #9ca3af }
.tick { stroke: #d1d5db }
.axis { stroke: #6b7280 }
.zero { stroke: #111; stroke-dasharray: 4 3 }
.start-stock { stroke: #9ca3af; stroke-dasharray: 2 3 }
.sold { fill: none; stroke: #2563eb; stroke-width: 2 }
.stock { fill: none; stroke: #dc2626; stroke-width: 2 }
.sale { fill: #2563eb }
";

fn render(t: &Timeline) -> Result<String, fmt::Error> {
    let buy_top = 64.0;
    let buy_height = LANE * t.instances as f64 + 40.0;
    let sale_top = buy_top + buy_height + 50.0;
    let height = sale_top + CHART + 70.0;
    let mut out = String::new();
    writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">"#
    )?;
    writeln!(out, "<style>\n{STYLE}</style>")?;
    writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#)?;
    writeln!(
        out,
        r#"<text class="title" x="10" y="22">{}</text>"#,
        t.title
    )?;
    buy_panel(&mut out, t, buy_top)?;
    sale_panel(&mut out, t, sale_top)?;
    writeln!(out, "</svg>")?;
    Ok(out)
}

/// `/buy`: one lane per instance, a bar per handler run.
fn buy_panel(out: &mut String, t: &Timeline, top: f64) -> fmt::Result {
    let origin = first_start(t.locked);
    let ms = |at: Instant| millis(origin, at);
    let last = t.locked.iter().map(|r| ms(r.end)).fold(0.0, f64::max);
    let x = Scale::new(last, LEFT, PLOT);
    let lanes_bottom = top + LANE * t.instances as f64;
    writeln!(out, r#"<g class="panel" data-route="/buy">"#)?;
    writeln!(
        out,
        r#"<text class="heading" x="10" y="{}">/buy under LockLayer: who held the lock, when (blue: sold one, grey: found it sold out)</text>"#,
        top - 12.0
    )?;
    for instance in 1..=t.instances {
        let y = top + LANE * (instance - 1) as f64;
        writeln!(out, r#"<g class="lane" data-instance="{instance}">"#)?;
        writeln!(
            out,
            r#"<rect class="lane-bg" x="{LEFT}" y="{:.1}" width="{PLOT}" height="{:.1}"/>"#,
            y + 2.0,
            LANE - 4.0
        )?;
        writeln!(
            out,
            r#"<text x="10" y="{:.1}">instance {instance}</text>"#,
            y + LANE / 2.0 + 4.0
        )?;
        for run in t.locked.iter().filter(|r| r.instance == instance) {
            let (start, end) = (ms(run.start), ms(run.end));
            writeln!(
                out,
                r#"<rect class="hold" data-instance="{instance}" data-start="{start:.3}" data-end="{end:.3}" data-sold="{}" x="{:.2}" y="{:.1}" width="{:.2}" height="{:.1}"/>"#,
                run.sold,
                x.at(start),
                y + 5.0,
                // Sold-out runs last a fraction of a millisecond: keep them visible.
                (x.at(end) - x.at(start)).max(0.6),
                LANE - 10.0
            )?;
        }
        writeln!(out, "</g>")?;
    }
    time_axis(out, &x, top, lanes_bottom)?;
    writeln!(out, "</g>")
}

/// `/unsafe/buy`: items sold so far against the stock left, over time.
fn sale_panel(out: &mut String, t: &Timeline, top: f64) -> fmt::Result {
    let origin = first_start(t.unlocked);
    let mut sales: Vec<f64> = t
        .unlocked
        .iter()
        .filter(|r| r.sold)
        .map(|r| millis(origin, r.end))
        .collect();
    sales.sort_by(f64::total_cmp);
    let sold = sales.len() as i64;
    let last = sales.last().copied().unwrap_or(0.0);
    let x = Scale::new(last, LEFT, PLOT);
    let (low, high) = (
        (t.stock - sold).min(0) as f64,
        sold.max(t.stock).max(1) as f64,
    );
    // Whole items only.
    let step = tick_step(high - low).max(1.0);
    let (low, high) = ((low / step).floor() * step, (high / step).ceil() * step);
    // Items grow upwards.
    let y = |items: f64| top + CHART - (items - low) / (high - low) * CHART;
    let bottom = top + CHART;

    writeln!(out, r#"<g class="panel" data-route="/unsafe/buy">"#)?;
    writeln!(
        out,
        r#"<text class="heading" x="10" y="{}">/unsafe/buy, no lock: items sold (blue) against stock left (red)</text>"#,
        top - 12.0
    )?;
    for i in 0..=((high - low) / step).round() as usize {
        let level = low + i as f64 * step;
        writeln!(
            out,
            r#"<line class="tick" x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}"/><text x="{2}" y="{3:.1}" text-anchor="end">{level}</text>"#,
            y(level),
            LEFT + PLOT,
            LEFT - 6.0,
            y(level) + 4.0
        )?;
    }
    writeln!(
        out,
        r#"<line class="start-stock" x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}"/><text x="{1}" y="{2}" text-anchor="end">dotted: the stock at the start ({3}); sales above it were oversold</text>"#,
        y(t.stock as f64),
        LEFT + PLOT,
        top - 12.0,
        t.stock
    )?;
    writeln!(
        out,
        r#"<line class="zero" x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}"/>"#,
        y(0.0),
        LEFT + PLOT
    )?;
    step_line(out, "sold", sold, &sales, &x, |k| y(k as f64))?;
    step_line(out, "stock", t.stock - sold, &sales, &x, |k| {
        y((t.stock - k) as f64)
    })?;
    for (i, at) in sales.iter().enumerate() {
        let k = i as i64 + 1;
        writeln!(
            out,
            r#"<circle class="sale" data-at="{at:.3}" data-sold="{k}" data-stock="{}" cx="{:.2}" cy="{:.1}" r="1.8"/>"#,
            t.stock - k,
            x.at(*at),
            y(k as f64)
        )?;
    }
    time_axis(out, &x, top, bottom)?;
    writeln!(out, "</g>")
}

/// A step line that starts at 0 sales and steps at each sale; `value(k)` places `k` sales.
fn step_line(
    out: &mut String,
    class: &str,
    last: i64,
    sales: &[f64],
    x: &Scale,
    value: impl Fn(i64) -> f64,
) -> fmt::Result {
    write!(
        out,
        r#"<path class="{class}" data-last="{last}" d="M{:.2} {:.1}"#,
        x.at(0.0),
        value(0)
    )?;
    for (i, at) in sales.iter().enumerate() {
        write!(out, " H{:.2} V{:.1}", x.at(*at), value(i as i64 + 1))?;
    }
    writeln!(out, r#" H{:.2}"/>"#, x.at(x.max))
}

/// The time axis under a panel whose plot spans `top..bottom`, with vertical grid lines.
fn time_axis(out: &mut String, x: &Scale, top: f64, bottom: f64) -> fmt::Result {
    for i in 0..=(x.max / x.step).round() as usize {
        // Rounded so that sums of tenths print as tenths.
        let ms = (i as f64 * x.step * 1e6).round() / 1e6;
        writeln!(
            out,
            r#"<line class="tick" x1="{0:.2}" y1="{top}" x2="{0:.2}" y2="{bottom}"/><text x="{0:.2}" y="{1}" text-anchor="middle">{ms}</text>"#,
            x.at(ms),
            bottom + 16.0
        )?;
    }
    writeln!(
        out,
        r#"<line class="axis" x1="{LEFT}" y1="{bottom}" x2="{0}" y2="{bottom}"/><text x="{0}" y="{1}" text-anchor="end">ms since the route's first request</text>"#,
        LEFT + PLOT,
        bottom + 32.0
    )
}

/// Milliseconds from 0 to `max` (rounded up to a whole tick) onto `width` pixels.
struct Scale {
    max: f64,
    step: f64,
    left: f64,
    width: f64,
}

impl Scale {
    fn new(last: f64, left: f64, width: f64) -> Self {
        let step = tick_step(last.max(1.0));
        Scale {
            max: (last / step).ceil().max(1.0) * step,
            step,
            left,
            width,
        }
    }

    fn at(&self, ms: f64) -> f64 {
        self.left + ms / self.max * self.width
    }
}

/// A round step (1, 2 or 5 times a power of ten) that cuts `span` into at most 10 ticks.
fn tick_step(span: f64) -> f64 {
    let raw = span / 10.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .find(|m| m * magnitude >= raw)
        .unwrap_or(10.0);
    step * magnitude
}

fn first_start(runs: &[Run]) -> Option<Instant> {
    runs.iter().map(|r| r.start).min()
}

fn millis(origin: Option<Instant>, at: Instant) -> f64 {
    origin.map_or(0.0, |o| at.duration_since(o).as_secs_f64() * 1e3)
}

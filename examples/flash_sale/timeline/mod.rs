//! The flash sale as a picture: an SVG timeline, written as text (no plotting crate, no
//! external assets).
//!
//! Two panels on one time axis (`<line class="grid" data-ms="..">` under each, the same
//! in both), each route's time counted from its own first request, so that the two sales
//! compare at a glance: the unlocked one is over (and oversold) long before the locked one
//! has served its queue.
//!
//! - `/buy`: one lane per instance (`<g class="lane" data-instance="N">`), and in it a mark
//!   for each run of that instance's handler (`<rect class="hold" data-instance="N"
//!   data-start="ms" data-end="ms" data-sold="true|false">`). The handler runs inside the
//!   lock, so no two runs overlap in time. A run that sold is a bar as long as the hold;
//!   a run that found the stock gone is a tick.
//! - `/unsafe/buy`: the items sold so far (a step line, `<path class="sold">`) against the
//!   stock left (`<path class="stock">`), which crosses the zero line (`<line
//!   class="zero">`) when the route oversells; each path's `data-last` is its final value.
//!   Under it, a tick per answer (`<rect class="answer" data-at="ms" data-sold="..">`).
//!
//! Ticks that crowd stack up in their strip and move right when it is full (see `pack.rs`),
//! so every request keeps a visible mark; bars stay where their holds were. The figures
//! are attributes so that a test can parse the picture instead of comparing bytes.
//!
//! This module depends on nothing else in the example: `tests/it/flash_sale_svg.rs` includes
//! it with `#[path]`.

mod axis;
mod buy;
mod pack;
mod sale;

use std::fmt::{self, Write as _};
use std::io;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use self::axis::Scale;

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
const LEFT: f64 = 110.0;
const RIGHT: f64 = 30.0;
const PLOT: f64 = WIDTH - LEFT - RIGHT;
/// The thinnest mark, in pixels: a request's mark never gets thinner than this.
const THIN: f64 = 2.0;
/// How tall a tick is, and how far apart its rows are.
const TICK: f64 = 4.0;
const ROW: f64 = 5.0;
/// Longer scales tried when crowded ticks move past the right end.
const FITS: usize = 8;

const SOLD: &str = "#2563eb";
const SOLD_OUT: &str = "#6b7280";

fn style() -> String {
    format!(
        "\
text {{ font-family: sans-serif; font-size: 12px; fill: #222 }}
.title {{ font-size: 15px; font-weight: bold }}
.heading {{ font-size: 13px; font-weight: bold }}
.strip {{ fill: #f3f4f6 }}
rect[data-sold=\"true\"] {{ fill: {SOLD} }}
rect[data-sold=\"false\"] {{ fill: {SOLD_OUT} }}
.hold[data-sold=\"true\"] {{ stroke: white; stroke-width: 0.75 }}
.grid, .level {{ stroke: #d1d5db }}
.axis {{ stroke: #6b7280 }}
.zero {{ stroke: #111; stroke-dasharray: 4 3 }}
.start-stock {{ stroke: #9ca3af; stroke-dasharray: 2 3 }}
.sold {{ fill: none; stroke: {SOLD}; stroke-width: 2 }}
.stock {{ fill: none; stroke: #dc2626; stroke-width: 2 }}
"
    )
}

fn render(t: &Timeline) -> Result<String, fmt::Error> {
    let buy_top = 100.0;
    let sale_top = buy_top + buy::height(t) + 70.0;
    let height = sale_top + sale::height() + 10.0;

    // Both panels on one scale: the longer route's span, longer still if crowded ticks
    // would run past the right end.
    let (locked, unlocked) = (Times::of(t.locked), Times::of(t.unlocked));
    let last = locked.last().max(unlocked.last());
    let mut scale = Scale::new(last, LEFT, PLOT);
    let (mut holds, mut answers) = (Vec::new(), Vec::new());
    for _ in 0..FITS {
        holds = buy::lay_out(t, &locked, &scale, buy_top);
        answers = sale::lay_out(&unlocked, &scale, sale_top);
        let right = holds
            .iter()
            .chain(&answers)
            .map(Mark::right)
            .fold(0.0, f64::max);
        if right <= scale.right() {
            break;
        }
        scale = scale.longer();
    }

    let mut out = String::new();
    writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">"#
    )?;
    writeln!(out, "<style>\n{}</style>", style())?;
    writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#)?;
    writeln!(
        out,
        r#"<text class="title" x="10" y="22">{}</text>"#,
        t.title
    )?;
    legend(
        &mut out,
        48.0,
        &[
            (Key::Mark(true), "sold one item"),
            (Key::Mark(false), "found it sold out"),
            (
                Key::Note,
                "one mark per request: crowded marks stack up, then move right",
            ),
        ],
    )?;
    buy::draw(&mut out, t, &holds, &scale, buy_top)?;
    sale::draw(&mut out, t, &unlocked, &answers, &scale, sale_top)?;
    writeln!(out, "</svg>")?;
    Ok(out)
}

/// A route's runs in milliseconds since its first run began.
struct Times<'a> {
    runs: Vec<(&'a Run, f64, f64)>,
}

impl<'a> Times<'a> {
    fn of(runs: &'a [Run]) -> Self {
        let origin = runs.iter().map(|r| r.start).min();
        let ms = |at: Instant| origin.map_or(0.0, |o| at.duration_since(o).as_secs_f64() * 1e3);
        Times {
            runs: runs.iter().map(|r| (r, ms(r.start), ms(r.end))).collect(),
        }
    }

    fn last(&self) -> f64 {
        self.runs.iter().map(|(_, _, end)| *end).fold(0.0, f64::max)
    }
}

/// A request's mark as placed, with the run it stands for (times in ms).
struct Mark<'a> {
    run: &'a Run,
    start: f64,
    end: f64,
    x: f64,
    y: f64,
    width: f64,
    height: f64,
}

impl Mark<'_> {
    fn right(&self) -> f64 {
        self.x + self.width
    }

    /// `<rect class="CLASS" data-...="..." x y width height/>`, `data` being the attributes
    /// before the geometry.
    fn write(&self, out: &mut String, class: &str, data: fmt::Arguments) -> fmt::Result {
        writeln!(
            out,
            r#"<rect class="{class}" {data} data-sold="{}" x="{:.2}" y="{:.1}" width="{:.2}" height="{:.1}"/>"#,
            self.run.sold, self.x, self.y, self.width, self.height
        )
    }
}

/// What a legend entry shows beside its text.
enum Key {
    /// A request's mark, sold or not (the same colour rule as the marks themselves).
    Mark(bool),
    /// A line of the given class.
    Line(&'static str),
    /// No key: a note.
    Note,
}

/// One row of legend entries at `y`, from the plot's left edge.
fn legend(out: &mut String, y: f64, items: &[(Key, &str)]) -> fmt::Result {
    let mut x = LEFT;
    for (key, text) in items {
        write!(out, r#"<g class="legend">"#)?;
        let swatch = match key {
            Key::Mark(sold) => {
                write!(
                    out,
                    r#"<rect class="key" data-sold="{sold}" x="{x}" y="{}" width="10" height="10"/>"#,
                    y - 9.0
                )?;
                22.0
            }
            Key::Line(class) => {
                write!(
                    out,
                    r#"<line class="{class}" x1="{x}" y1="{0}" x2="{1}" y2="{0}"/>"#,
                    y - 4.0,
                    x + 18.0
                )?;
                22.0
            }
            Key::Note => 0.0,
        };
        writeln!(out, r#"<text x="{}" y="{y}">{text}</text></g>"#, x + swatch)?;
        // About the width of a 12 px sans-serif character.
        x += swatch + 6.6 * text.chars().count() as f64 + 18.0;
    }
    Ok(())
}

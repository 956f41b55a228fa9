//! The `/unsafe/buy` panel: items sold against the stock left, and a tick per answer.

use std::fmt::{self, Write as _};

use super::axis::{Scale, tick_step};
use super::pack::Strip;
use super::{Key, LEFT, Mark, ROW, THIN, TICK, Timeline, Times, legend};

const CHART: f64 = 180.0;
/// The answers' strip under the chart: its rows, and the room around them.
const ROWS: usize = 16;
const PAD: f64 = 4.0;
const STRIP: f64 = ROWS as f64 * ROW + 2.0 * PAD;
const STRIP_GAP: f64 = 10.0;

pub fn height() -> f64 {
    CHART + STRIP_GAP + STRIP + 40.0
}

fn strip_top(top: f64) -> f64 {
    top + CHART + STRIP_GAP
}

/// Places a tick per run, at the time it answered (a sale is counted then).
pub fn lay_out<'a>(times: &Times<'a>, x: &Scale, top: f64) -> Vec<Mark<'a>> {
    let mut runs = times.runs.clone();
    runs.sort_by(|a, b| a.2.total_cmp(&b.2));
    let bottom = strip_top(top) + STRIP - PAD;
    let mut strip = Strip::new(ROWS);
    runs.into_iter()
        .map(|(run, start, end)| {
            let (at, row) = strip.tick(x.at(end), THIN);
            Mark {
                run,
                start,
                end,
                x: at,
                y: bottom - row as f64 * ROW - TICK,
                width: THIN,
                height: TICK,
            }
        })
        .collect()
}

pub fn draw(
    out: &mut String,
    t: &Timeline,
    times: &Times,
    marks: &[Mark],
    x: &Scale,
    top: f64,
) -> fmt::Result {
    let mut sales: Vec<f64> = times
        .runs
        .iter()
        .filter(|(run, ..)| run.sold)
        .map(|(.., end)| *end)
        .collect();
    sales.sort_by(f64::total_cmp);
    let sold = sales.len() as i64;
    let (low, high) = (
        (t.stock - sold).min(0) as f64,
        sold.max(t.stock).max(1) as f64,
    );
    // Whole items only.
    let step = tick_step(high - low).max(1.0);
    let (low, high) = ((low / step).floor() * step, (high / step).ceil() * step);
    // Items grow upwards.
    let y = |items: f64| top + CHART - (items - low) / (high - low) * CHART;

    writeln!(out, r#"<g class="panel" data-route="/unsafe/buy">"#)?;
    writeln!(
        out,
        r#"<text class="heading" x="10" y="{}">/unsafe/buy, no lock: items sold against the stock left, and each answer as it came</text>"#,
        top - 32.0
    )?;
    let start_stock = format!("the stock at the start ({})", t.stock);
    legend(
        out,
        top - 12.0,
        &[
            (Key::Line("sold"), "items sold"),
            (Key::Line("stock"), "stock left"),
            (Key::Line("start-stock"), &start_stock),
            (Key::Line("zero"), "zero"),
        ],
    )?;
    for i in 0..=((high - low) / step).round() as usize {
        let level = low + i as f64 * step;
        writeln!(
            out,
            r#"<line class="level" x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}"/><text x="{2}" y="{3:.1}" text-anchor="end">{level}</text>"#,
            y(level),
            x.right(),
            LEFT - 6.0,
            y(level) + 4.0
        )?;
    }
    let strip = strip_top(top);
    writeln!(
        out,
        r#"<rect class="strip" x="{LEFT}" y="{strip}" width="{}" height="{STRIP}"/><text x="10" y="{:.1}">answers</text>"#,
        x.width,
        strip + STRIP / 2.0 + 4.0
    )?;
    x.draw(out, top, strip + STRIP)?;
    for (class, level) in [("start-stock", t.stock as f64), ("zero", 0.0)] {
        writeln!(
            out,
            r#"<line class="{class}" x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}"/>"#,
            y(level),
            x.right()
        )?;
    }
    step_line(out, "sold", sold, &sales, x, |k| y(k as f64))?;
    step_line(out, "stock", t.stock - sold, &sales, x, |k| {
        y((t.stock - k) as f64)
    })?;
    for mark in marks {
        mark.write(out, "answer", format_args!(r#"data-at="{:.3}""#, mark.end))?;
    }
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

//! The time axis both panels share: one scale, drawn under each panel.

use std::fmt::{self, Write as _};

/// Milliseconds from 0 to `max` (a whole number of ticks) onto `width` pixels from `left`.
#[derive(Clone, Copy)]
pub struct Scale {
    pub max: f64,
    step: f64,
    pub left: f64,
    pub width: f64,
}

impl Scale {
    /// A scale that reaches at least `last` ms.
    pub fn new(last: f64, left: f64, width: f64) -> Self {
        let step = tick_step(last.max(1.0));
        Scale {
            max: (last / step).ceil().max(1.0) * step,
            step,
            left,
            width,
        }
    }

    /// The next scale out: at least one tick longer.
    pub fn longer(&self) -> Self {
        Scale::new(self.max + self.step, self.left, self.width)
    }

    pub fn at(&self, ms: f64) -> f64 {
        self.left + ms / self.max * self.width
    }

    pub fn right(&self) -> f64 {
        self.left + self.width
    }

    /// The axis under a plot that spans `top..bottom`, with a grid line per tick
    /// (`<line class="grid" data-ms="..">`, the same in every panel).
    pub fn draw(&self, out: &mut String, top: f64, bottom: f64) -> fmt::Result {
        for i in 0..=(self.max / self.step).round() as usize {
            // Rounded so that sums of tenths print as tenths.
            let ms = (i as f64 * self.step * 1e6).round() / 1e6;
            writeln!(
                out,
                r#"<line class="grid" data-ms="{ms}" x1="{0:.2}" y1="{top}" x2="{0:.2}" y2="{bottom}"/><text x="{0:.2}" y="{1}" text-anchor="middle">{ms}</text>"#,
                self.at(ms),
                bottom + 16.0
            )?;
        }
        writeln!(
            out,
            r#"<line class="axis" x1="{0}" y1="{bottom}" x2="{1}" y2="{bottom}"/><text x="{1}" y="{2}" text-anchor="end">ms since the route's first request reached a handler</text>"#,
            self.left,
            self.right(),
            bottom + 32.0
        )
    }
}

/// A round step (1, 2 or 5 times a power of ten) that cuts `span` into at most 10 ticks.
pub fn tick_step(span: f64) -> f64 {
    let raw = span / 10.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .find(|m| m * magnitude >= raw)
        .unwrap_or(10.0);
    step * magnitude
}

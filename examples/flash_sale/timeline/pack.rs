//! Places marks in a strip of rows so that every request keeps a visible mark of its own.
//!
//! A sold-out hold lasts a fraction of a millisecond, and dozens of them come within a
//! pixel or two of each other: drawn at their times alone they merge into a few slivers.
//! Here each mark goes into the lowest row where it fits at its time; when every row is
//! taken there, it moves right (never left: a mark never shows before its request did).

/// Pixels between two marks of one row, so that neighbours stay apart.
const GAP: f64 = 1.0;

/// The rows of one strip (a `/buy` lane, or the `/unsafe/buy` answers), as they fill up.
pub struct Strip {
    /// Per row, from the bottom: the x from which the row is free.
    free: Vec<f64>,
}

impl Strip {
    pub fn new(rows: usize) -> Self {
        Strip {
            free: vec![f64::NEG_INFINITY; rows.max(1)],
        }
    }

    /// A mark as tall as the strip, wanted at `x`: where it goes. It may touch the mark
    /// before it (a hold handed on at once ends where the next begins).
    pub fn block(&mut self, x: f64, width: f64) -> f64 {
        let at = self.free.iter().copied().fold(x, f64::max);
        self.free.fill(at + width);
        at
    }

    /// A mark one row tall, wanted at `x`: where it goes and in which row (0 at the
    /// bottom). The leftmost place wins, the lower row on a tie.
    pub fn tick(&mut self, x: f64, width: f64) -> (f64, usize) {
        let mut best = (f64::INFINITY, 0);
        for (row, free) in self.free.iter().enumerate() {
            let at = x.max(free + GAP);
            if at < best.0 {
                best = (at, row);
            }
        }
        let (at, row) = best;
        self.free[row] = at + width;
        (at, row)
    }
}

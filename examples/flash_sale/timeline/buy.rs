//! The `/buy` panel: who held the lock, when; one lane per instance.

use std::fmt::{self, Write as _};

use super::axis::Scale;
use super::pack::Strip;
use super::{LEFT, Mark, ROW, THIN, TICK, Timeline, Times};

/// A lane's height, and the room above and below its marks.
const LANE: f64 = 46.0;
const PAD: f64 = 5.0;
const BAR: f64 = LANE - 2.0 * PAD;

pub fn height(t: &Timeline) -> f64 {
    LANE * t.instances as f64 + 40.0
}

/// Places a mark per run: a run that sold is a bar over its hold, as tall as the lane;
/// one that found the stock gone is a tick in the lane's rows.
pub fn lay_out<'a>(t: &Timeline, times: &Times<'a>, x: &Scale, top: f64) -> Vec<Mark<'a>> {
    let rows = ((BAR - TICK) / ROW) as usize + 1;
    let mut lanes: Vec<Strip> = (0..t.instances).map(|_| Strip::new(rows)).collect();
    let mut runs = times.runs.clone();
    runs.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut marks = Vec::new();
    for (run, start, end) in runs {
        // Instances count from 1; a run of an instance without a lane is not drawn.
        let Some(lane) = run.instance.checked_sub(1).and_then(|i| lanes.get_mut(i)) else {
            continue;
        };
        let lane_top = lane_top(top, run.instance);
        let width = (x.at(end) - x.at(start)).max(THIN);
        let (x, y, height) = if run.sold {
            (lane.block(x.at(start), width), lane_top, BAR)
        } else {
            let (at, row) = lane.tick(x.at(start), width);
            (at, lane_top + BAR - row as f64 * ROW - TICK, TICK)
        };
        marks.push(Mark {
            run,
            start,
            end,
            x,
            y,
            width,
            height,
        });
    }
    marks
}

pub fn draw(out: &mut String, t: &Timeline, marks: &[Mark], x: &Scale, top: f64) -> fmt::Result {
    writeln!(out, r#"<g class="panel" data-route="/buy">"#)?;
    writeln!(
        out,
        r#"<text class="heading" x="10" y="{}">/buy under LockLayer: who held the lock, when (one lane per instance; a bar is a hold that sold)</text>"#,
        top - 14.0
    )?;
    // The lanes' backgrounds under the grid, the marks over it.
    for instance in 1..=t.instances {
        writeln!(
            out,
            r#"<rect class="strip" x="{LEFT}" y="{:.1}" width="{}" height="{:.1}"/>"#,
            lane_top(top, instance) - PAD + 2.0,
            x.width,
            LANE - 4.0
        )?;
    }
    x.draw(out, top, top + LANE * t.instances as f64)?;
    for instance in 1..=t.instances {
        writeln!(out, r#"<g class="lane" data-instance="{instance}">"#)?;
        writeln!(
            out,
            r#"<text x="10" y="{:.1}">instance {instance}</text>"#,
            lane_top(top, instance) - PAD + LANE / 2.0 + 4.0
        )?;
        for mark in marks.iter().filter(|m| m.run.instance == instance) {
            mark.write(
                out,
                "hold",
                format_args!(
                    r#"data-instance="{instance}" data-start="{:.3}" data-end="{:.3}""#,
                    mark.start, mark.end
                ),
            )?;
        }
        writeln!(out, "</g>")?;
    }
    writeln!(out, "</g>")
}

/// Where instance `instance`'s marks begin, from the panel's top.
fn lane_top(top: f64, instance: usize) -> f64 {
    top + LANE * instance.saturating_sub(1) as f64 + PAD
}

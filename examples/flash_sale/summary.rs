//! The lock's metrics for the locked routes, read back from a scrape of `/metrics`: a
//! table a person reads at a glance, or the raw lines.
//!
//! `tests/it/flash_sale_cli.rs` includes this file with `#[path]`; it depends on nothing else
//! in the example.

use std::fmt::Write as _;

/// The exposition's samples of the crate's metrics for the routes labelled `labels` (the
/// layers' `metrics_label`), as they were scraped; comment lines left out.
pub fn raw_lines<'a>(exposition: &'a str, labels: &[&str]) -> Vec<&'a str> {
    exposition
        .lines()
        .filter(|line| {
            Sample::parse(line).is_some_and(|s| {
                s.name.starts_with("tower_lock_")
                    && s.label("route").is_some_and(|r| labels.contains(&r))
            })
        })
        .collect()
}

/// One route's figures.
#[derive(Debug, Default, PartialEq)]
pub struct RouteSummary {
    /// Acquisitions by outcome, `acquired` first, then by name; zeros left out.
    pub outcomes: Vec<(String, u64)>,
    /// Seconds from asking for the lock to holding it (or giving up).
    pub wait: Buckets,
    /// Seconds from holding the lock to its release.
    pub hold: Buckets,
}

/// The figures of the route labelled `label`. Series split by another label (the lock's
/// mode, say) are added up, as `sum by (le)` would.
pub fn route(exposition: &str, label: &str) -> RouteSummary {
    let mut summary = RouteSummary::default();
    let samples = exposition
        .lines()
        .filter_map(Sample::parse)
        .filter(|s| s.label("route") == Some(label));
    for sample in samples {
        let le = sample.label("le").and_then(|le| le.parse::<f64>().ok());
        match (sample.name, le) {
            ("tower_lock_acquisitions_total", _) => {
                let outcome = sample.label("outcome").unwrap_or("(none)");
                let count = sample.value.max(0.0).round() as u64;
                match summary.outcomes.iter_mut().find(|(o, _)| o == outcome) {
                    Some((_, total)) => *total += count,
                    None => summary.outcomes.push((outcome.to_owned(), count)),
                }
            }
            ("tower_lock_wait_seconds_bucket", Some(le)) => summary.wait.add(le, sample.value),
            ("tower_lock_hold_seconds_bucket", Some(le)) => summary.hold.add(le, sample.value),
            _ => {}
        }
    }
    summary.outcomes.retain(|(_, count)| *count > 0);
    summary
        .outcomes
        .sort_by(|a, b| (a.0 != "acquired", &a.0).cmp(&(b.0 != "acquired", &b.0)));
    summary
}

/// A histogram as scraped: per upper bound (`le`), the samples at or below it.
#[derive(Debug, Default, PartialEq)]
pub struct Buckets {
    cumulative: Vec<(f64, f64)>,
}

impl Buckets {
    fn add(&mut self, le: f64, count: f64) {
        match self.cumulative.iter_mut().find(|(l, _)| *l == le) {
            Some((_, total)) => *total += count,
            None => {
                self.cumulative.push((le, count));
                self.cumulative.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
        }
    }

    /// The bucket the `q` quantile falls in: its lower and upper bound (0 below the first
    /// bucket, infinite for `+Inf`); `None` without samples.
    ///
    /// A range, not `histogram_quantile`'s point inside it: that point assumes the samples
    /// spread evenly over the bucket, and when they crowd its low end (the longest waits of
    /// a burst, say) it lands well above every sample, above the requests' own latency.
    pub fn quantile(&self, q: f64) -> Option<(f64, f64)> {
        let total = self.cumulative.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let mut lower = 0.0;
        for &(le, count) in &self.cumulative {
            if count >= q * total {
                return Some((lower, le));
            }
            lower = le;
        }
        Some((lower, f64::INFINITY))
    }
}

/// A markdown table, a row per `(label, route)`.
pub fn table(exposition: &str, routes: &[(&str, &str)]) -> String {
    let mut out = String::from(
        "| locked route | acquisitions | wait p50 | wait p99 | hold p50 | hold p99 |\n\
         |---|---|---:|---:|---:|---:|\n",
    );
    for (label, shown) in routes {
        let s = route(exposition, label);
        let outcomes: Vec<String> = s.outcomes.iter().map(|(o, n)| format!("{n} {o}")).collect();
        let [wait50, wait99, hold50, hold99] = [
            s.wait.quantile(0.5),
            s.wait.quantile(0.99),
            s.hold.quantile(0.5),
            s.hold.quantile(0.99),
        ]
        .map(range);
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "| `{shown}` | {} | {} | {} | {} | {} |",
            if outcomes.is_empty() {
                "none".to_owned()
            } else {
                outcomes.join(", ")
            },
            wait50,
            wait99,
            hold50,
            hold99,
        );
    }
    out
}

/// A range of seconds as a person reads it, in the upper bound's unit: `50-63 µs`,
/// `3.2-4 ms`, `400-500 ms`, `> 10 s`; `-` for none.
pub fn range(bounds: Option<(f64, f64)>) -> String {
    let Some((lower, upper)) = bounds else {
        return "-".to_owned();
    };
    if upper.is_infinite() {
        let (per_second, unit) = unit(lower);
        return format!("> {} {unit}", figure(lower * per_second));
    }
    let (per_second, unit) = unit(upper);
    let [lower, upper] = [lower, upper].map(|s| figure(s * per_second));
    format!("{lower}-{upper} {unit}")
}

/// The unit that reads best for `seconds`, and how many of it make a second.
fn unit(seconds: f64) -> (f64, &'static str) {
    match seconds {
        s if s < 1e-3 => (1e6, "µs"),
        s if s < 1.0 => (1e3, "ms"),
        _ => (1.0, "s"),
    }
}

/// Three significant figures at most, without trailing zeros.
fn figure(value: f64) -> String {
    let decimals = match value.abs() {
        v if v >= 100.0 => 0,
        v if v >= 10.0 => 1,
        _ => 2,
    };
    let text = format!("{value:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    }
}

/// One line of the text exposition: `name{label="value",...} value`.
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

impl<'a> Sample<'a> {
    /// The sample on `line`; `None` for a comment, a blank or a line it cannot read.
    fn parse(line: &'a str) -> Option<Self> {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let name_end = line.find(['{', ' '])?;
        let (name, mut rest) = line.split_at(name_end);
        let mut labels = Vec::new();
        if let Some(inner) = rest.strip_prefix('{') {
            rest = inner;
            loop {
                rest = rest.trim_start_matches(',');
                if let Some(after) = rest.strip_prefix('}') {
                    rest = after;
                    break;
                }
                let (key, after) = rest.split_once("=\"")?;
                let (value, after) = unescape(after)?;
                labels.push((key.trim(), value));
                rest = after;
            }
        }
        let value = rest.split_whitespace().next()?.parse().ok()?;
        Some(Sample {
            name,
            labels,
            value,
        })
    }

    fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// A label value up to its closing quote (`\\`, `\"` and `\n` unescaped), and what follows.
fn unescape(text: &str) -> Option<(String, &str)> {
    let mut value = String::new();
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((value, &text[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => value.push('\n'),
                escaped => value.push(escaped),
            },
            c => value.push(c),
        }
    }
    None
}

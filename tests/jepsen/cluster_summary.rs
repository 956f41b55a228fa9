//! The cluster Jepsen test's summary and verdict: faults per kind; holds and violations
//! per namespace and per fault kind they ran through; the probes' margins per namespace
//! and fault kind. Every violation in "s" fails the test, as does a negative margin but
//! in "a" after a failover; what "a" loses to asynchronous replication is printed apart.

use support::history::{self, Hold, Registers, Violation};

use super::cluster_faults::{ClusterFault, ClusterMargin, Cut, KINDS, Window, margins};
use super::*;

fn ns_of(key: &str) -> &str {
    key.split_once('-').map_or(key, |(ns, _)| ns)
}

/// The kind of the first fault whose window `hold` ran through, if any.
fn fault_of(hold: &Hold, windows: &[Window]) -> Option<ClusterFault> {
    windows
        .iter()
        .find(|w| hold.start < w.ended && hold.end > w.began)
        .map(|w| w.kind)
}

/// Why a violation in "a" is allowed: a failover that one of its holds ran through (the
/// primary's writes that its replica missed are lost), or the instance of one of its holds
/// frozen past the grant lease (250 ms: a grantee frozen before it claimed its grant is
/// overtaken, as any holder paused past its lease; fencing's case). `None` in "s".
fn allowance(v: &Violation, windows: &[Window]) -> Option<&'static str> {
    if v.holds.first().is_none_or(|h| ns_of(&h.key) != "a") {
        return None;
    }
    let through = |h: &Hold, w: &Window| h.start < w.ended && h.end > w.began;
    let failover = windows
        .iter()
        .any(|w| w.kind.failover() && v.holds.iter().any(|h| through(h, w)));
    let frozen = windows.iter().any(|w| {
        w.kind == ClusterFault::InstancePause
            && v.holds
                .iter()
                .any(|h| through(h, w) && w.instance == Some(h.instance))
    });
    if failover {
        Some("allowed by asynchronous replication")
    } else if frozen {
        Some("a grantee frozen past its grant lease")
    } else {
        None
    }
}

/// The fault a violation happened in: that of the first of its holds that ran through one.
fn violation_fault(v: &Violation, windows: &[Window]) -> Option<ClusterFault> {
    v.holds.iter().find_map(|h| fault_of(h, windows))
}

pub(super) fn report(log: &Log, registers: &Registers, windows: &[Window], cuts: &[Cut]) {
    let violations = history::check(&log.holds, registers);
    let margins = margins(cuts, log);
    for kind in KINDS {
        let n = windows.iter().filter(|w| w.kind == kind).count();
        println!("  faults {kind:?}: {n}");
    }
    let mut kinds: Vec<Option<ClusterFault>> = KINDS.iter().copied().map(Some).collect();
    kinds.push(None);
    for ns in NAMESPACES {
        let holds: Vec<&Hold> = log.holds.iter().filter(|h| ns_of(&h.key) == ns).collect();
        let of_ns: Vec<&Violation> = violations
            .iter()
            .filter(|v| v.holds.first().is_some_and(|h| ns_of(&h.key) == ns))
            .collect();
        let written = holds
            .iter()
            .filter(|h| matches!(h.write, Write::Written(_)))
            .count();
        println!(
            "  \"{ns}\": {} holds checked ({written} acknowledged writes), {} violations",
            holds.len(),
            of_ns.len()
        );
        for kind in &kinds {
            let during = holds
                .iter()
                .filter(|h| fault_of(h, windows) == *kind)
                .count();
            let broken = of_ns
                .iter()
                .filter(|v| violation_fault(v, windows) == *kind)
                .count();
            let name = kind.map_or("no fault".to_owned(), |k| format!("{k:?}"));
            println!("    through {name}: {during} holds, {broken} violations");
        }
        for kind in KINDS {
            print_margins(ns, kind, &margins, cuts, log);
        }
    }
    for m in &margins {
        let (kind, ns, probe) = (m.kind, &m.ns, &m.probe);
        let (margin, proven) = (ms(m.margin), ms(m.proven));
        let read = ms(m.read_before.map(|us| us as i64));
        println!(
            "  margin {kind:?} \"{ns}\" {probe:?}: {margin} (at least {proven}), expiry read \
             {read} before the stop"
        );
    }
    for w in windows {
        let (began, ended) = (w.began, w.ended);
        println!("  fault {:?} on {}: {began}..{ended} µs", w.kind, w.target);
    }
    let mut allowed: HashMap<(&str, &str), usize> = HashMap::new();
    let mut unexplained = 0;
    for v in &violations {
        match allowance(v, windows) {
            Some(why) => {
                *allowed.entry((why, v.rule)).or_default() += 1;
                println!("  \"a\", {why}: {v}");
            }
            None => {
                unexplained += 1;
                println!("  VIOLATION: {v}");
            }
        }
    }
    println!("  \"a\", allowed: {allowed:?}");
    assert_eq!(
        unexplained, 0,
        "{unexplained} checker violations in \"s\", or in \"a\" without a failover"
    );
    for m in margins.iter().filter(|m| m.measured()) {
        if m.ns == "s" || !m.kind.failover() {
            assert!(
                m.margin.is_some_and(|margin| margin >= 0),
                "a cut-off holder ran past the server-side expiry (or its lock was gone): {m:?}"
            );
        }
    }
    assert!(
        margins.iter().any(ClusterMargin::measured),
        "no cut-off holder was stopped: the promise was not exercised"
    );
    let written = log
        .holds
        .iter()
        .filter(|h| ns_of(&h.key) == "s" && matches!(h.write, Write::Written(_)))
        .count();
    assert!(written > 0, "the workload made progress in \"s\"");
}

/// One line: how the probes of `ns` cut off by faults of `kind` ended.
fn print_margins(ns: &str, kind: ClusterFault, margins: &[ClusterMargin], cuts: &[Cut], log: &Log) {
    let cut: Vec<&Cut> = cuts
        .iter()
        .filter(|c| c.kind == kind && ns_of(&c.probe.1) == ns)
        .collect();
    if cut.is_empty() {
        return;
    }
    let stopped = cut
        .iter()
        .filter(|c| log.probe_ends.get(&c.probe).is_some_and(|end| !end.1))
        .count();
    let of: Vec<&ClusterMargin> = margins
        .iter()
        .filter(|m| m.kind == kind && m.ns == ns)
        .collect();
    let measured = || of.iter().filter(|m| m.measured());
    let min = measured().filter_map(|m| m.margin).min();
    let proven = measured().filter_map(|m| m.proven).min();
    let gone = of.iter().filter(|m| m.margin.is_none()).count();
    let stale = of
        .iter()
        .filter(|m| m.margin.is_some() && !m.measured())
        .count();
    println!(
        "    {kind:?}: {} probes, {stopped} stopped, min margin {} (at least {}), {gone} \
         stopped after their lock was gone from the serving node, {stale} with the expiry \
         read too long before the stop",
        cut.len(),
        ms(min),
        ms(proven)
    );
}

fn ms(us: Option<i64>) -> String {
    us.map_or("-".to_owned(), |us| format!("{:.1} ms", us as f64 / 1000.0))
}

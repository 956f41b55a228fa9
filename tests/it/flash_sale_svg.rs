//! The demo's picture matches the sale it pictures: the example's own shop runs a small
//! flash sale on three axum apps (on a real redis-server, and on one `MemoryBackend`), the
//! example's timeline writer draws it, and the test parses the SVG back. A drawn crowd
//! (hundreds of runs within a millisecond or two) checks that every request keeps a mark
//! of its own where the sale's requests are too few to crowd.

#[path = "../../examples/flash_sale/shop.rs"]
mod shop;
use crate::support;
#[path = "flash_sale_svg/svg.rs"]
mod svg;
#[path = "../../examples/flash_sale/timeline/mod.rs"]
mod timeline;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use shop::{Recorders, Store};
use support::RedisServer;
use svg::{Rect, Tag};
use timeline::{Run, Timeline};
use tower_lock::{MemoryBackend, RedisBackend};

const STOCK: i64 = 8;
const BUYERS: usize = 24;
const INSTANCES: usize = 3;

/// The smallest mark the picture promises, in pixels.
const THIN: f64 = 2.0;
const TICK: f64 = 4.0;
/// How far a figure read back from the file may be off: it rounds to hundredths.
const SLACK: f64 = 0.05;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn svg_timeline_matches_a_flash_sale_on_redis() {
    crate::needs!(Redis);
    let server = RedisServer::start();
    // As on a Redis the demo shares (REDIS_URL): a namespace of its own, claimed.
    let namespace = shop::claim_namespace(&server.url())
        .await
        .expect("claim")
        .expect("a free namespace");
    let recorders = Recorders::default();
    let mut instances = Vec::new();
    for instance in 1..=INSTANCES {
        let backend = RedisBackend::builder(server.url())
            .namespace(&namespace)
            .build()
            .await
            .expect("lock backend");
        let store = Store::redis(&server.url(), &namespace)
            .await
            .expect("store connects");
        instances.push(serve(shop::app(backend, store, instance, &recorders)).await);
    }
    let store = Store::redis(&server.url(), &namespace)
        .await
        .expect("store connects");
    sell_and_check_picture(&store, &instances, &recorders).await;
    store.clean_up().await.expect("clean up");
    assert_eq!(
        server.keys().await,
        Vec::<String>::new(),
        "the demo cleans up, its claim included"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn svg_timeline_matches_a_flash_sale_on_memory() {
    crate::needs!(Redis);
    let backend = MemoryBackend::new();
    let store = Store::memory();
    let recorders = Recorders::default();
    let mut instances = Vec::new();
    for instance in 1..=INSTANCES {
        let app = shop::app(backend.clone(), store.clone(), instance, &recorders);
        instances.push(serve(app).await);
    }
    sell_and_check_picture(&store, &instances, &recorders).await;
    assert_eq!(backend.held(), 0, "every lock was released");
}

/// 50 sales of 5 ms handed between the instances four at a time, then 250 sold-out holds
/// of 20 us in bursts of 100 on one instance; without a lock, 280 sales and 20 sold-outs
/// answered within 2 ms.
#[test]
fn every_request_keeps_a_visible_mark_when_hundreds_end_within_a_millisecond() {
    let origin = Instant::now();
    let at = |us: u64| origin + Duration::from_micros(us);
    let run = |instance: usize, start: u64, end: u64, sold: bool| Run {
        instance,
        start: at(start),
        end: at(end),
        sold,
    };
    let mut locked: Vec<Run> = (0..50u64)
        .map(|i| {
            run(
                i as usize / 4 % INSTANCES + 1,
                i * 5_000,
                i * 5_000 + 5_000,
                true,
            )
        })
        .collect();
    let sold_out_from = 50 * 5_000;
    locked.extend((0..250u64).map(|i| {
        let start = sold_out_from + i * 20;
        run(i as usize / 100 + 1, start, start + 20, false)
    }));
    let unlocked: Vec<Run> = (0..300u64)
        .map(|i| run(i as usize % INSTANCES + 1, 0, 60_000 + i * 7, i < 280))
        .collect();
    let timeline = Timeline {
        title: "crowd",
        stock: 50,
        instances: INSTANCES,
        locked: &locked,
        unlocked: &unlocked,
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("crowd.svg");
    timeline::write(&path, &timeline).expect("write the SVG");
    let svg = std::fs::read_to_string(&path).expect("read the SVG back");
    let picture = check_picture(&svg, &locked, &unlocked);

    // The crowd is drawn, not merged: marks stacked and moved right of their times.
    let moved = picture
        .holds
        .iter()
        .filter(|h| h.rect.x > picture.axis.at(h.start) + 1.0);
    assert!(moved.count() > 100, "the sold-out burst is spread out");
    let stacked = picture.answers.iter().map(|a| a.rect.y as i64);
    assert!(
        stacked.collect::<std::collections::BTreeSet<_>>().len() > 4,
        "the answers stack in rows"
    );
    // Bars that sold are where their holds were.
    for hold in picture.holds.iter().filter(|h| h.sold) {
        let x = picture.axis.at(hold.start);
        assert!((hold.rect.x - x).abs() < SLACK, "a sold bar at its start");
        let width = picture.axis.at(hold.end) - x;
        assert!(
            (hold.rect.width - width).abs() < SLACK,
            "as long as its hold"
        );
    }
}

async fn serve(app: axum::Router) -> SocketAddr {
    shop::serve(app).await.expect("serve an instance")
}

/// Sells on `/unsafe/buy`, then on `/buy`; draws both; parses the picture and checks it
/// against what the handlers recorded and the store counted.
async fn sell_and_check_picture(store: &Store, instances: &[SocketAddr], recorders: &Recorders) {
    let unsafe_statuses = sale(store, instances, "/unsafe/buy").await;
    let unsafe_sold = store.sold().await.expect("sold");
    let statuses = sale(store, instances, "/buy").await;
    let sold = store.sold().await.expect("sold");
    assert_eq!(sold, STOCK, "the lock sells exactly the stock");
    assert_eq!(count(&statuses, 200), STOCK as usize);
    assert_eq!(count(&statuses, 410), BUYERS - STOCK as usize);
    assert_eq!(count(&unsafe_statuses, 200) as i64, unsafe_sold);

    let (locked, unlocked) = (recorders.locked.runs(), recorders.unlocked.runs());
    assert_eq!(locked.len(), BUYERS, "every /buy buyer reached the handler");
    assert_eq!(unlocked.len(), BUYERS, "every /unsafe/buy buyer too");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("pictures/flash_sale.svg");
    let timeline = Timeline {
        title: "test sale",
        stock: STOCK,
        instances: INSTANCES,
        locked: &locked,
        unlocked: &unlocked,
    };
    timeline::write(&path, &timeline).expect("write the SVG");
    let svg = std::fs::read_to_string(&path).expect("read the SVG back");
    let picture = check_picture(&svg, &locked, &unlocked);

    let sold_bars = picture.holds.iter().filter(|h| h.sold).count();
    assert_eq!(sold_bars as i64, sold, "sold bars = sold = stock");
    let sold_answers = picture.answers.iter().filter(|a| a.sold).count();
    assert_eq!(
        sold_answers as i64, unsafe_sold,
        "a blue answer per unsafe sale"
    );
    let tags = svg::tags(&svg);
    let path_end = |class: &str| {
        let path = tags.iter().find(|t| t.is("path", class)).expect("a line");
        let steps = path.attr("d").expect("a path").matches('V').count() as i64;
        assert_eq!(steps, unsafe_sold, "the {class} line steps once per sale");
        path.num("data-last") as i64
    };
    assert_eq!(path_end("sold"), unsafe_sold);
    assert_eq!(path_end("stock"), STOCK - unsafe_sold);
    if unsafe_sold > STOCK {
        assert!(path_end("stock") < 0, "the stock line ends below zero");
    }
    assert!(tags.iter().any(|t| t.is("line", "zero")), "a zero line");
    eprintln!(
        "unsafe: {unsafe_sold} sold of {STOCK}; locked: {sold} sold, {} marks, {sold_bars} bars",
        picture.holds.len(),
    );
}

/// A request's mark as read back: its times (ms), whether it sold, and where it is drawn.
struct Drawn {
    instance: usize,
    start: f64,
    end: f64,
    sold: bool,
    rect: Rect,
}

/// The picture as read back.
struct Picture {
    axis: Axis,
    holds: Vec<Drawn>,
    answers: Vec<Drawn>,
}

/// The time axis, read from the grid: `at(ms)` is where `ms` is drawn.
struct Axis {
    ticks: Vec<(f64, f64)>,
}

impl Axis {
    fn of(panel: &[Tag]) -> Self {
        let ticks: Vec<(f64, f64)> = panel
            .iter()
            .filter(|t| t.is("line", "grid"))
            .map(|t| (t.num("data-ms"), t.num("x1")))
            .collect();
        assert!(ticks.len() >= 2, "a time axis with ticks");
        Axis { ticks }
    }

    fn at(&self, ms: f64) -> f64 {
        let ((ms0, x0), (ms1, x1)) = (self.ticks[0], self.ticks[self.ticks.len() - 1]);
        x0 + (ms - ms0) * (x1 - x0) / (ms1 - ms0)
    }

    fn right(&self) -> f64 {
        self.ticks[self.ticks.len() - 1].1
    }
}

/// What holds for any picture of `locked` and `unlocked`: a visible mark per run, in its
/// instance's lane, none over another, none before its time; holds that never overlap;
/// one time axis for both panels; a legend for sold and sold out.
fn check_picture(svg: &str, locked: &[Run], unlocked: &[Run]) -> Picture {
    let tags = svg::tags(svg);
    let panel = |route: &str| svg::group(&tags, |t| t.attr("data-route") == Some(route));
    let (buy, sale) = (panel("/buy"), panel("/unsafe/buy"));
    let axis = Axis::of(buy);
    assert_eq!(
        axis.ticks,
        Axis::of(sale).ticks,
        "both panels on one time axis"
    );

    let mut holds = Vec::new();
    for instance in 1..=INSTANCES {
        let lane = svg::group(buy, |t| {
            t.is("g", "lane") && t.num("data-instance") as usize == instance
        });
        let marks: Vec<Drawn> = lane
            .iter()
            .filter(|t| t.is("rect", "hold"))
            .map(|t| Drawn {
                instance: t.num("data-instance") as usize,
                start: t.num("data-start"),
                end: t.num("data-end"),
                sold: t.attr("data-sold") == Some("true"),
                rect: Rect::of(t),
            })
            .collect();
        let runs = locked.iter().filter(|r| r.instance == instance);
        assert_eq!(
            marks.len(),
            runs.count(),
            "a mark per run of instance {instance}"
        );
        assert!(
            marks.iter().all(|m| m.instance == instance),
            "in its own lane"
        );
        apart(&marks, &format!("lane {instance}"));
        holds.extend(marks);
    }
    assert_eq!(holds.len(), locked.len(), "a mark per /buy request");
    let sold_runs = |runs: &[Run]| runs.iter().filter(|r| r.sold).count();
    assert_eq!(holds.iter().filter(|h| h.sold).count(), sold_runs(locked));
    let mut by_time: Vec<&Drawn> = holds.iter().collect();
    by_time.sort_by(|a, b| a.start.total_cmp(&b.start));
    for pair in by_time.windows(2) {
        assert!(
            pair[0].end <= pair[1].start,
            "two holds overlap: instance {} {:?} and instance {} {:?}",
            pair[0].instance,
            (pair[0].start, pair[0].end),
            pair[1].instance,
            (pair[1].start, pair[1].end),
        );
    }

    let answers: Vec<Drawn> = sale
        .iter()
        .filter(|t| t.is("rect", "answer"))
        .map(|t| Drawn {
            instance: 0,
            start: t.num("data-at"),
            end: t.num("data-at"),
            sold: t.attr("data-sold") == Some("true"),
            rect: Rect::of(t),
        })
        .collect();
    assert_eq!(
        answers.len(),
        unlocked.len(),
        "a mark per /unsafe/buy request"
    );
    assert_eq!(
        answers.iter().filter(|a| a.sold).count(),
        sold_runs(unlocked)
    );
    apart(&answers, "answers");

    for mark in holds.iter().chain(&answers) {
        let (rect, at) = (mark.rect, axis.at(mark.start));
        assert!(rect.x >= at - SLACK, "a mark never before its time");
        assert!(
            rect.x + rect.width <= axis.right() + SLACK,
            "inside the axis"
        );
    }
    for sold in ["true", "false"] {
        let key = tags
            .iter()
            .find(|t| t.is("rect", "key") && t.attr("data-sold") == Some(sold));
        assert!(key.is_some(), "a legend key for data-sold={sold}");
    }
    Picture {
        axis,
        holds,
        answers,
    }
}

/// Every mark visible on its own: at least `THIN` by `TICK` pixels, none over another.
fn apart(marks: &[Drawn], strip: &str) {
    for (i, a) in marks.iter().enumerate() {
        assert!(
            a.rect.width >= THIN - SLACK && a.rect.height >= TICK - SLACK,
            "a visible mark in {strip}: {:?}",
            a.rect
        );
        for b in &marks[i + 1..] {
            assert!(
                !a.rect.overlaps(&b.rect, SLACK),
                "two marks in {strip} overlap: {:?} and {:?}",
                a.rect,
                b.rect
            );
        }
    }
}

/// Restocks and sends every buyer at once, round-robin over the instances.
async fn sale(store: &Store, instances: &[SocketAddr], route: &'static str) -> Vec<u16> {
    store.restock(STOCK).await.expect("restock");
    let client = support::http_client();
    let buyers = instances.iter().cycle().take(BUYERS).map(|addr| {
        let client = client.clone();
        let addr = *addr;
        tokio::spawn(async move { support::post(&client, addr, route).await.status })
    });
    let mut statuses = Vec::new();
    for buyer in buyers.collect::<Vec<_>>() {
        statuses.push(buyer.await.expect("buyer"));
    }
    statuses
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

//! The demo's picture matches the sale it pictures: the example's own shop runs a small
//! flash sale on three axum apps (on a real redis-server, and on one `MemoryBackend`), the
//! example's timeline writer draws it, and the test parses the SVG back.

#[path = "../examples/flash_sale/shop.rs"]
mod shop;
mod support;
#[path = "../examples/flash_sale/timeline.rs"]
mod timeline;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use shop::{Recorders, Store};
use support::RedisServer;
use timeline::Timeline;
use tower_lock::{MemoryBackend, RedisBackend};

const STOCK: i64 = 8;
const BUYERS: usize = 24;
const INSTANCES: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn svg_timeline_matches_a_flash_sale_on_redis() {
    let server = RedisServer::start();
    let namespace = "flash-sale-svg";
    let recorders = Recorders::default();
    let mut instances = Vec::new();
    for instance in 1..=INSTANCES {
        let backend = RedisBackend::builder(server.url())
            .namespace(namespace)
            .build()
            .await
            .expect("lock backend");
        let store = Store::redis(&server.url(), namespace)
            .await
            .expect("store connects");
        instances.push(serve(shop::app(backend, store, instance, &recorders)).await);
    }
    let store = Store::redis(&server.url(), namespace)
        .await
        .expect("store connects");
    sell_and_check_picture(&store, &instances, &recorders).await;
    store.clean_up().await.expect("clean up");
    assert_eq!(
        server.keys().await,
        Vec::<String>::new(),
        "the demo cleans up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn svg_timeline_matches_a_flash_sale_on_memory() {
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
    let tags = tags(&svg);

    // `/buy`: three lanes, each with a bar per run its instance recorded.
    let lanes = lanes(&tags);
    assert_eq!(
        lanes.keys().copied().collect::<Vec<_>>(),
        (1..=INSTANCES).collect::<Vec<_>>(),
        "one lane per instance"
    );
    let mut recorded = BTreeMap::<usize, usize>::new();
    for run in &locked {
        *recorded.entry(run.instance).or_default() += 1;
    }
    let drawn: BTreeMap<usize, usize> = lanes.iter().map(|(i, bars)| (*i, bars.len())).collect();
    assert_eq!(drawn, recorded, "bars per lane = runs per instance");
    let bars: Vec<&Bar> = lanes.values().flatten().collect();
    assert_eq!(
        bars.len(),
        BUYERS,
        "a bar per buyer served (sold or sold out)"
    );
    let sold_bars = bars.iter().filter(|b| b.sold).count();
    assert_eq!(sold_bars as i64, sold, "sold bars = sold = stock");
    for (i, a) in bars.iter().enumerate() {
        for b in &bars[i + 1..] {
            assert!(
                a.end <= b.start || b.end <= a.start,
                "two holds overlap: instance {} {:?} and instance {} {:?}",
                a.instance,
                (a.start, a.end),
                b.instance,
                (b.start, b.end),
            );
        }
    }

    // `/unsafe/buy`: a point per sale, the lines end where the sale did.
    let sales: Vec<(f64, i64, i64)> = tags
        .iter()
        .filter(|t| t.is("circle", "sale"))
        .map(|t| {
            (
                t.num("data-at"),
                t.num("data-sold") as i64,
                t.num("data-stock") as i64,
            )
        })
        .collect();
    assert_eq!(sales.len() as i64, unsafe_sold, "a point per unsafe sale");
    assert!(
        sales.windows(2).all(|w| w[0].0 <= w[1].0),
        "points in time order"
    );
    let (_, last_sold, last_stock) = sales.last().copied().expect("the unsafe route sold");
    assert_eq!(
        last_sold, unsafe_sold,
        "the cumulative sales end at the run's sold"
    );
    assert_eq!(last_stock, STOCK - unsafe_sold);
    let path_end = |class: &str| {
        let path = tags.iter().find(|t| t.is("path", class));
        path.expect("a line").num("data-last") as i64
    };
    assert_eq!(path_end("sold"), unsafe_sold);
    assert_eq!(path_end("stock"), STOCK - unsafe_sold);
    if unsafe_sold > STOCK {
        assert!(path_end("stock") < 0, "the stock line ends below zero");
    }
    assert!(tags.iter().any(|t| t.is("line", "zero")), "a zero line");
    eprintln!(
        "unsafe: {unsafe_sold} sold of {STOCK}; locked: {sold} sold, bars per lane {drawn:?}, \
         {} bars, {} sold",
        bars.len(),
        sold_bars
    );
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

/// A hold bar as drawn: instance, start and end (ms), whether the run sold.
struct Bar {
    instance: usize,
    start: f64,
    end: f64,
    sold: bool,
}

/// The hold bars inside each `<g class="lane">`, by the lane's instance; a bar whose own
/// instance differs from its lane's fails the test.
fn lanes(tags: &[Tag]) -> BTreeMap<usize, Vec<Bar>> {
    let mut lanes = BTreeMap::<usize, Vec<Bar>>::new();
    // The open `<g>` elements: the instance of each lane among them.
    let mut open: Vec<Option<usize>> = Vec::new();
    for tag in tags {
        match tag.name.as_str() {
            "g" if tag.closing => {
                open.pop().expect("balanced <g>");
            }
            "g" if !tag.self_closing => {
                let lane = tag
                    .is("g", "lane")
                    .then(|| tag.num("data-instance") as usize);
                if let Some(instance) = lane {
                    assert!(lanes.insert(instance, Vec::new()).is_none(), "lane twice");
                }
                open.push(lane);
            }
            "rect" if tag.is("rect", "hold") => {
                let lane = open.iter().rev().find_map(|l| *l);
                let lane = lane.expect("a hold bar inside a lane");
                let bar = Bar {
                    instance: tag.num("data-instance") as usize,
                    start: tag.num("data-start"),
                    end: tag.num("data-end"),
                    sold: tag.attr("data-sold") == Some("true"),
                };
                assert_eq!(bar.instance, lane, "a bar in its instance's lane");
                assert!(bar.start <= bar.end, "a bar ends after it starts");
                lanes.entry(lane).or_default().push(bar);
            }
            _ => {}
        }
    }
    assert!(open.is_empty(), "balanced <g>");
    lanes
}

/// A start, end or empty-element tag with its attributes.
struct Tag {
    name: String,
    attrs: Vec<(String, String)>,
    closing: bool,
    self_closing: bool,
}

impl Tag {
    fn attr(&self, name: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether this is a `<name>` whose `class` is `class`.
    fn is(&self, name: &str, class: &str) -> bool {
        !self.closing && self.name == name && self.attr("class") == Some(class)
    }

    fn num(&self, name: &str) -> f64 {
        let value = self
            .attr(name)
            .unwrap_or_else(|| panic!("{name} on <{}>", self.name));
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is a number"))
    }
}

/// Every tag of `svg`, in order (text, comments and declarations skipped). Enough XML for
/// a file whose attribute values contain no `>`.
fn tags(svg: &str) -> Vec<Tag> {
    let mut tags = Vec::new();
    let mut rest = svg;
    while let Some(open) = rest.find('<') {
        let close = rest[open..].find('>').expect("tag closed") + open;
        let inner = &rest[open + 1..close];
        rest = &rest[close + 1..];
        if inner.starts_with('?') || inner.starts_with('!') {
            continue;
        }
        let closing = inner.starts_with('/');
        let self_closing = inner.ends_with('/');
        let inner = inner.trim_start_matches('/').trim_end_matches('/');
        let (name, mut attrs_text) = inner.split_once(char::is_whitespace).unwrap_or((inner, ""));
        let mut attrs = Vec::new();
        while let Some((key, value_and_rest)) = attrs_text.split_once("=\"") {
            let (value, after) = value_and_rest.split_once('"').expect("attribute quoted");
            attrs.push((key.trim().to_owned(), value.to_owned()));
            attrs_text = after;
        }
        tags.push(Tag {
            name: name.to_owned(),
            attrs,
            closing,
            self_closing,
        });
    }
    tags
}

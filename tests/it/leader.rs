//! Leader election, written once and run on every store with three instances: leaderships
//! never overlap and their epochs increase, a campaign dropped resigns and the next
//! candidate leads at once, a leadership lost stops the leader's work, and `acquire`
//! waits to lead.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, mpsc};
use tokio::time::timeout;
use tower_lock::{Leadership, LockBackend};

/// Generous bound on anything that should happen at once: catches hangs only. The leases
/// below are far longer, so whatever happens within it was not a lease running out.
const HANG: Duration = Duration::from_secs(10);
const LEASE: Duration = Duration::from_secs(60);
/// A leader renews every third of [`LEASE`]: learning of a loss within this bound is not a
/// renewal's doing.
const LOST_BY: Duration = Duration::from_secs(15);

/// How many instances run `work` at once: entered when `work` starts, left when its
/// future ends (returned or dropped), before its leadership is released.
#[derive(Default)]
struct Leading {
    now: AtomicUsize,
    most: AtomicUsize,
}

struct Entered(Arc<Leading>);

impl Leading {
    fn enter(self: &Arc<Self>) -> Entered {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        Entered(self.clone())
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Three candidates that each lead for a moment and resign, 30 leaderships in all: never
/// two at once, each epoch above the one before.
async fn leaderships_never_overlap_and_their_epochs_increase<B: LockBackend>(b: [B; 3]) {
    const TERMS: usize = 30;
    let leading = Arc::new(Leading::default());
    let epochs = Arc::new(Mutex::new(Vec::new()));
    let (done, mut all_done) = mpsc::channel::<()>(1);
    let campaigns: Vec<_> = b
        .iter()
        .map(|backend| {
            let (leading, epochs, done) = (leading.clone(), epochs.clone(), done.clone());
            let run = backend
                .leader("relay")
                .lease(LEASE)
                .run(move |leadership: Leadership| {
                    let (leading, epochs, done) = (leading.clone(), epochs.clone(), done.clone());
                    async move {
                        let _entered = leading.enter();
                        let mut epochs = epochs.lock().await;
                        epochs.push(leadership.fencing_token());
                        if epochs.len() == TERMS {
                            let _ = done.try_send(());
                        }
                        drop(epochs);
                        tokio::task::yield_now().await;
                    }
                });
            tokio::spawn(run)
        })
        .collect();
    timeout(HANG * 3, all_done.recv()).await.expect("30 terms");
    for campaign in &campaigns {
        campaign.abort();
    }
    let epochs = epochs.lock().await.clone();
    assert_eq!(
        leading.most.load(Ordering::SeqCst),
        1,
        "two leaders at once"
    );
    assert!(
        epochs.windows(2).all(|pair| pair[0] < pair[1]),
        "epochs not increasing: {epochs:?}"
    );
}

/// A leader whose campaign is dropped resigns: the waiting candidate leads at once (well
/// within the lease), under a higher epoch.
async fn a_dropped_campaign_resigns_and_the_next_candidate_leads<B: LockBackend>(b: [B; 3]) {
    let (led, mut leads) = mpsc::unbounded_channel::<(usize, u64)>();
    let campaign = |n: usize| {
        let led = led.clone();
        b[n].leader("scheduler")
            .lease(LEASE)
            .run(move |leadership: Leadership| {
                let led = led.clone();
                async move {
                    let _ = led.send((n, leadership.fencing_token()));
                    std::future::pending::<()>().await;
                }
            })
    };
    let first = tokio::spawn(campaign(0));
    let (leader, epoch) = timeout(HANG, leads.recv())
        .await
        .expect("a leader")
        .expect("led");
    assert_eq!(leader, 0);
    let second = tokio::spawn(campaign(1));
    tokio::task::yield_now().await;
    first.abort();
    let (next, next_epoch) = timeout(HANG, leads.recv())
        .await
        .expect("the next candidate leads before the lease could run out")
        .expect("led");
    assert_eq!(next, 1);
    assert!(next_epoch > epoch, "{next_epoch} after {epoch}");
    second.abort();
}

/// A leadership lost (an operator deposes the leader with `force_release`) stops the
/// leader's work as soon as it learns of it (well before a renewal would tell it), and
/// another candidate leads under a higher epoch.
async fn a_lost_leadership_stops_the_work_and_another_leads<B: LockBackend>(b: [B; 3]) {
    /// Says when the leader's work was dropped.
    struct Stopped(mpsc::UnboundedSender<()>);
    impl Drop for Stopped {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }
    let (led, mut leads) = mpsc::unbounded_channel::<u64>();
    let (stop, mut stops) = mpsc::unbounded_channel::<()>();
    let leader = b[0]
        .leader("warmer")
        .lease(LEASE)
        .run(move |leadership: Leadership| {
            let (led, stop) = (led.clone(), stop.clone());
            async move {
                let _stopped = Stopped(stop);
                let _ = led.send(leadership.fencing_token());
                std::future::pending::<()>().await;
            }
        });
    let leader = tokio::spawn(leader);
    let epoch = timeout(HANG, leads.recv())
        .await
        .expect("a leader")
        .expect("led");
    let candidate = b[1].leader("warmer").lease(LEASE);
    let candidate = tokio::spawn(async move { candidate.acquire().await });

    let deposed = b[2]
        .force_release("leader:warmer")
        .await
        .expect("force_release");
    assert!(!deposed.is_free(), "the leader held its key: {deposed:?}");
    timeout(LOST_BY, stops.recv())
        .await
        .expect("the deposed leader's work is stopped before a renewal could tell it")
        .expect("stopped");
    // Whoever leads next (the candidate, or the deposed leader campaigning again) leads
    // under a higher epoch.
    let next = tokio::select! {
        again = leads.recv() => again.expect("led"),
        acquired = candidate => {
            acquired.expect("task").expect("acquire").fencing_token()
        }
    };
    assert!(next > epoch, "{next} after {epoch}");
    leader.abort();
}

/// `acquire` waits to lead; dropping the leadership resigns and the waiting candidate
/// leads under a higher epoch; `resign` awaits the release.
async fn acquire_waits_to_lead_and_dropping_the_leadership_resigns<B: LockBackend>(b: [B; 3]) {
    let first = timeout(HANG, b[0].leader("cleanup").lease(LEASE).acquire())
        .await
        .expect("leads at once")
        .expect("acquire");
    assert_eq!(first.name(), "cleanup");
    assert!(!first.is_lost());
    let candidate = b[1].leader("cleanup").lease(LEASE);
    let waiting = tokio::spawn(async move { candidate.acquire().await });
    tokio::task::yield_now().await;
    assert!(!waiting.is_finished(), "two leaders");
    let epoch = first.fencing_token();
    drop(first);
    let second = timeout(HANG, waiting)
        .await
        .expect("the candidate leads once the first resigned")
        .expect("task")
        .expect("acquire");
    assert!(second.fencing_token() > epoch);
    let info = b[2].inspect("leader:cleanup").await.expect("inspect");
    // Operators see the leadership as its key's lock (its token, or one set aside above it).
    assert_eq!(info.holders, 1, "{info:?}");
    assert!(
        info.fencing_token >= Some(second.fencing_token()),
        "{info:?}"
    );
    second.resign().await.expect("resign");
    assert!(
        b[2].inspect("leader:cleanup")
            .await
            .expect("inspect")
            .is_free()
    );
}

crate::for_each_store_and_consensus!(
    leaderships_never_overlap_and_their_epochs_increase,
    a_dropped_campaign_resigns_and_the_next_candidate_leads,
    a_lost_leadership_stops_the_work_and_another_leads,
    acquire_waits_to_lead_and_dropping_the_leadership_resigns;
    not on etcd or zookeeper:
);

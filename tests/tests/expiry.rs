//! Counters that expire, end to end, with a short window (`expire_after = "6s"`) under SIGKILLs:
//!
//! 1. 300 `campaign:` counters, 20 `poll:` counters (which count one like per actor) and 100
//!    `views:` counters (a namespace that never expires) take 50,000 events while the
//!    aggregator is SIGKILLed twice.
//! 2. Then only 50 of the campaign counters keep getting events (for 12 s at least, and until
//!    the other 250 read 0). The aggregator running as the idle ones' expiry records are
//!    decided aborts right after its first decision that a counter expired, before writing any
//!    group (a failpoint); the next one replays that flush from the recorded decision and is
//!    SIGKILLed once more. Right after the last send, the 50 busy ones hold every event sent
//!    to them, the 250 idle ones and the polls have no key left, and the views are whole.
//! 3. Once the 50 have gone idle too and read 0, 20 campaign counters (10 of each kind) get
//!    events again: each counts from zero; a poll liked again by one of its earlier likers
//!    counts 1, and its other earlier likers have not liked it. The partitions' idle index
//!    holds exactly those 21, and `tally audit` (which decides each expiry record from the log)
//!    finds no drift.
//!
//! Grouped by partition with scripts, and by actor with WATCH/MULTI/EXEC transactions, so an
//! expired counter's shares are cleared in every group, by both implementations (polls are
//! grouped by actor in both).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tally_common::{CounterEvent, Keyspace, Reader};
use tally_producer::{Producer, ProducerConfig};
use tally_tests::{
    NamespacedSetup, PacedSender, brokers, connect, counters_in_redis, kill_repeatedly, reader,
    seed, wait_for_totals,
};

const EXPIRE_AFTER: &str = "6s";
const FIRST_EVENTS: u64 = 50_000;
const RATE: u64 = 10_000;
const CAMPAIGNS: u32 = 300;
const BUSY: u32 = 50;
const VIEWS: u32 = 100;
const POLLS: u32 = 20;

fn campaign(i: u32) -> String {
    format!("campaign:c:{i}")
}

fn poll(i: u32) -> String {
    format!("poll:p:{i}")
}

/// What the sender sent: each counter's total as the log defines it when it stops.
struct Sent {
    truth: HashMap<String, i64>,
    /// Who liked each poll.
    likers: HashMap<String, HashSet<String>>,
    events: u64,
}

/// Sends a like of a poll by one of 30 actors and records it.
async fn like_one(sender: &mut PacedSender, rng: &mut rand::rngs::StdRng, sent: &mut Sent) {
    let (counter, actor) = (
        poll(rng.random_range(0..POLLS)),
        format!("u{}", rng.random_range(0..30)),
    );
    let likers = sent.likers.entry(counter.clone()).or_default();
    likers.insert(actor.clone());
    sent.truth.insert(counter.clone(), likers.len() as i64);
    sent.events += 1;
    let event = CounterEvent::new(counter, 1)
        .and_then(|e| e.with_actor(actor))
        .expect("valid");
    sender.send(&event).await;
}

/// Sends one event to `counter` and records it.
async fn send_one(
    sender: &mut PacedSender,
    rng: &mut rand::rngs::StdRng,
    sent: &mut Sent,
    counter: String,
) {
    let delta = rng.random_range(1..=5);
    *sent.truth.entry(counter.clone()).or_default() += delta;
    sent.events += 1;
    let event = CounterEvent::new(counter, delta)
        .and_then(|e| e.with_actor(format!("u{}", rng.random_range(0..5_000))))
        .expect("valid");
    sender.send(&event).await;
}

/// Phases 1 and 2 of the module docs, from one task, routed by counter; says when phase 1 is
/// sent; returns the truth with the idle campaign counters at 0.
async fn send(
    topic: String,
    url: String,
    keyspace: Keyspace,
    seed: u64,
    first_sent: tokio::sync::oneshot::Sender<()>,
) -> Sent {
    let mut sender = PacedSender::new(&topic, RATE);
    let counts = reader(&url, keyspace).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut sent = Sent {
        truth: HashMap::new(),
        likers: HashMap::new(),
        events: 0,
    };
    for _ in 0..FIRST_EVENTS {
        if rng.random_bool(0.05) {
            like_one(&mut sender, &mut rng, &mut sent).await;
            continue;
        }
        let counter = if rng.random_bool(0.8) {
            campaign(rng.random_range(0..CAMPAIGNS))
        } else {
            format!("views:v:{}", rng.random_range(0..VIEWS))
        };
        send_one(&mut sender, &mut rng, &mut sent, counter).await;
    }
    assert_eq!(
        (0..CAMPAIGNS)
            .filter(|i| sent.truth.contains_key(&campaign(*i)))
            .count(),
        CAMPAIGNS as usize,
        "every campaign counter got events"
    );
    assert_eq!(sent.likers.len(), POLLS as usize, "every poll got likes");
    let _ = first_sent.send(());
    let idle: Vec<String> = (BUSY..CAMPAIGNS)
        .map(campaign)
        .chain((0..POLLS).map(poll))
        .collect();
    // The busy ones: about 10 events a second each, for 12 rounds (of about a second) at least
    // and until the idle ones read 0.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    for round in 0.. {
        for _ in 0..5 {
            for _ in 0..100 {
                let counter = if rng.random_bool(0.8) {
                    campaign(rng.random_range(0..BUSY))
                } else {
                    format!("views:v:{}", rng.random_range(0..VIEWS))
                };
                send_one(&mut sender, &mut rng, &mut sent, counter).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let totals = counts.get_many(&idle).await.expect("read totals");
        if round >= 12 && totals.iter().all(|t| *t == 0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "idle counters still counted after 2 minutes: {:?}",
            &totals[..10]
        );
    }
    sender.finish().await;
    for counter in &idle {
        sent.truth.insert(counter.clone(), 0);
    }
    sent
}

/// Every idle index of the keyspace: counter → partitions whose index holds it.
async fn idle_index(url: &str, keyspace: &Keyspace) -> HashMap<String, usize> {
    let mut conn = connect(url).await;
    let pattern = format!("{}:{{g*}}:idle:*", keyspace.prefix());
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    let mut found: HashMap<String, usize> = HashMap::new();
    for key in keys {
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(&key)
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .expect("ZRANGE");
        for member in members {
            *found.entry(member).or_default() += 1;
        }
    }
    found
}

async fn assert_idle_gone(counts: &Reader, url: &str, keyspace: &Keyspace, idle: &[String]) {
    let left = counters_in_redis(url, keyspace).await;
    let kept: Vec<&String> = idle.iter().filter(|c| left.contains(*c)).collect();
    assert!(kept.is_empty(), "expired counters kept keys: {kept:?}");
    let totals = counts.get_many(idle).await.expect("read totals");
    assert!(totals.iter().all(|t| *t == 0), "expired counters read 0");
}

async fn counters_expire(name: &str, flags: &[&str]) {
    let seed = seed();
    let file = format!(
        "[namespaces.campaign]\nexpire_after = \"{EXPIRE_AFTER}\"\n\
         [namespaces.poll]\ndedup = true\nexpire_after = \"{EXPIRE_AFTER}\"\n"
    );
    let run = NamespacedSetup::start(name, &file).await;
    let (redis, dir, setup) = (&run.redis, &run.dir, &run.setup);
    let keyspace = setup.keyspace();
    let all = run.flags(flags);
    let first = setup.spawn(dir.path(), &all);
    let (first_sent, phase_two) = tokio::sync::oneshot::channel();
    let load = tokio::spawn(send(
        setup.topic.clone(),
        redis.url(),
        keyspace.clone(),
        seed,
        first_sent,
    ));
    let aggregator = kill_repeatedly(setup, dir.path(), &all, first, 2, seed, &load).await;
    phase_two.await.expect("phase 1 sent");
    let mut aggregator = aggregator;
    aggregator.kill();
    let failpoint = [("TALLY_FAILPOINT_ABORT_AFTER_EXPIRY", "1")];
    let mut aborting = setup.spawn_with_env(dir.path(), &all, &failpoint);
    let status = aborting.wait_exit(Duration::from_secs(60)).await;
    assert!(!status.success(), "the failpoint aborted it");
    assert!(
        aborting
            .log()
            .contains("failpoint: aborting after an expiry decision"),
        "it aborted at the failpoint"
    );
    eprintln!("aborted right after an expiry decision");
    let next = setup.spawn(dir.path(), &all);
    let aggregator = kill_repeatedly(setup, dir.path(), &all, next, 1, !seed, &load).await;
    let sent = load.await.expect("load task");
    let mut truth = sent.truth;
    eprintln!("{} events; the idle campaign counters read 0", sent.events);

    // Phase 2's check, right after the last send: well within the busy ones' 6 s.
    let counts = reader(&redis.url(), keyspace.clone()).await;
    wait_for_totals(&counts, &truth, Duration::from_secs(4)).await;
    let idle: Vec<String> = (BUSY..CAMPAIGNS)
        .map(campaign)
        .chain((0..POLLS).map(poll))
        .collect();
    assert_idle_gone(&counts, &redis.url(), &keyspace, &idle).await;
    let busy_total: i64 = (0..BUSY).map(|i| truth[&campaign(i)]).sum();
    eprintln!("busy counters kept {busy_total} in all, every idle one is gone");

    // Phase 3: everything in the campaign namespace goes idle, then 20 counters start again.
    let every: Vec<String> = (0..CAMPAIGNS).map(campaign).collect();
    for counter in &every {
        truth.insert(counter.clone(), 0);
    }
    wait_for_totals(&counts, &truth, Duration::from_secs(60)).await;
    assert_idle_gone(&counts, &redis.url(), &keyspace, &every).await;
    let producer = Producer::new(&ProducerConfig::new(brokers(), &setup.topic)).expect("producer");
    let again: Vec<String> = (0..10).chain(BUSY..BUSY + 10).map(campaign).collect();
    for (i, counter) in again.iter().enumerate() {
        let delta = i as i64 + 1;
        (producer
            .send(&CounterEvent::new(counter.clone(), delta).expect("valid"))
            .await)
            .expect("sent");
        truth.insert(counter.clone(), delta);
    }
    // A poll liked again by one of its earlier likers: its member set went with it.
    let mut earlier = sent.likers[&poll(0)].iter();
    let (again_liker, other) = (earlier.next().expect("a liker"), earlier.next());
    producer.like(&poll(0), again_liker).await.expect("sent");
    truth.insert(poll(0), 1);
    wait_for_totals(&counts, &truth, Duration::from_secs(4)).await;
    assert!(counts.has_liked(&poll(0), again_liker).await.expect("read"));
    if let Some(other) = other {
        assert!(
            !counts.has_liked(&poll(0), other).await.expect("read"),
            "an expired poll's earlier likers are gone"
        );
    }
    let indexed = idle_index(&redis.url(), &keyspace).await;
    let mut expected: HashMap<String, usize> = again.iter().map(|c| (c.clone(), 1)).collect();
    expected.insert(poll(0), 1);
    assert_eq!(
        indexed, expected,
        "the idle index holds the live counters, once"
    );
    let mut aggregator = aggregator;
    let expired = aggregator
        .metric("tally_counters_expired_total")
        .await
        .unwrap_or(0.0);
    eprintln!("the last aggregator expired {expired} counters");
    aggregator.stop_gracefully().await;

    let audit = setup.audit(&["--namespaces", &run.namespaces]);
    eprintln!("{}", audit.stdout);
    assert!(audit.clean, "no drift: {}", audit.stdout);
    assert_eq!(audit.checked, truth.len(), "every counter checked");
    let views: HashSet<&String> = truth.keys().filter(|c| c.starts_with("views:")).collect();
    assert_eq!(
        views.len(),
        VIEWS as usize,
        "every views counter got events"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_expire_under_sigkills_grouped_by_partition_with_scripts() {
    let _serial = tally_tests::serial().await;
    counters_expire("expiry", &["--grouping", "partition"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_expire_under_sigkills_grouped_by_actor_with_transactions() {
    let _serial = tally_tests::serial().await;
    let flags = ["--grouping", "actor", "--redis-atomicity", "transactions"];
    counters_expire("expiry-actor", &flags).await;
}

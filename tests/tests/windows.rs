//! Windowed counts end to end: up to 120,000 events of a namespace keeping 1-minute and 1-hour
//! windows (grace 30 s), produced with explicit Kafka timestamps spread over the last 20 minutes and
//! event times that are on time, late for the minute (a client that held them 2 to 5 minutes),
//! missing (the Kafka timestamp is their time) or from the future, while the aggregator is
//! SIGKILLed 5 times (the stream runs until the last kill is over and flushed). Every total and every bucket ends exactly at what the rules say, computed
//! here from what was sent; sliding sums read through the reader and `tally get --window`; a
//! bucket kept 20 s is seen, then expires by itself; `tally audit` recounts totals and buckets
//! with no drift (from the start, and from ten minutes ago: the buckets wholly after that), and
//! names exactly one bucket changed behind tally's back. Run with Lua scripts
//! and again as a Redis user that may not run scripts (`WATCH`/`MULTI`/`EXEC`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tally_common::codec::encode;
use tally_common::window::Window;
use tally_common::window::cells::Cells;
use tally_common::{CachedReader, CounterEvent, Namespaces};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, binary, brokers, connect, eventually, kill_repeatedly,
    reader, seed, unique, wait_for_totals,
};

const EVENTS: u64 = 120_000;
const RATE: u64 = 8_000;
const COUNTERS: u64 = 300;
const MINUTE: i64 = 60_000;
const HOUR: i64 = 60 * MINUTE;
const GRACE: i64 = 30_000;
const WIDTHS: [i64; 2] = [MINUTE, HOUR];

const NAMESPACES: &str = r#"
[namespaces.views]
windows = ["1m", "1h"]
window_grace = "30s"

[namespaces.flash]
windows = [{ width = "1s", retention = "20s" }]
"#;

/// What the rules say, computed independently of tally's code: totals, and per (counter,
/// width, bucket start) the sum of the deltas counted there.
#[derive(Default)]
struct Truth {
    totals: HashMap<String, i64>,
    buckets: HashMap<(String, i64, i64), i64>,
    late: u64,
    future: u64,
}

impl Truth {
    fn record(&mut self, counter: &str, delta: i64, ts: i64, kafka: i64) {
        *self.totals.entry(counter.to_owned()).or_default() += delta;
        let t = if ts > 0 { ts } else { kafka };
        if t > kafka + GRACE {
            self.future += 1;
            return;
        }
        for width in WIDTHS {
            let start = t - t.rem_euclid(width);
            if start + width + GRACE < kafka {
                self.late += 1;
                continue;
            }
            *(self.buckets)
                .entry((counter.to_owned(), width, start))
                .or_default() += delta;
        }
    }
}

/// Sends the events, each with an explicit Kafka timestamp, and records those acknowledged.
async fn send(topic: String, seed: u64, now: i64, stop: Arc<AtomicBool>) -> Truth {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut truth = Truth::default();
    let started = tokio::time::Instant::now();
    let mut pending = Vec::new();
    for i in 0..EVENTS {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let counter = format!("views:video:{}", rng.random_range(0..COUNTERS));
        let delta = if rng.random_bool(0.2) {
            -1
        } else {
            rng.random_range(1..=5)
        };
        let kafka = now - rng.random_range(0..20 * MINUTE);
        let ts = match rng.random_range(0..100) {
            0..80 => kafka - rng.random_range(0..10_000),
            80..90 => kafka - rng.random_range(2 * MINUTE..5 * MINUTE),
            90..95 => 0,
            _ => kafka + 10 * MINUTE,
        };
        // 0: no event time on the wire (`new` stamps the current time).
        let event = CounterEvent::new(counter.clone(), delta)
            .expect("valid")
            .with_ts_ms(ts);
        let payload = encode(&event);
        let record = FutureRecord::to(&topic)
            .key(counter.as_str())
            .payload(&payload)
            .timestamp(kafka);
        let delivery = producer
            .send_result(record)
            .map_err(|(e, _)| e)
            .expect("enqueued");
        pending.push((delivery, counter, delta, ts, kafka));
        if pending.len() >= 1_000 {
            settle(&mut pending, &mut truth).await;
        }
        if i % 100 == 0 {
            let due = started + Duration::from_secs_f64(i as f64 / RATE as f64);
            tokio::time::sleep_until(due).await;
        }
    }
    settle(&mut pending, &mut truth).await;
    truth
}

/// The sum of `counter`'s last `n` buckets of `width` at `at` (the current one included).
fn sliding(
    buckets: &HashMap<(String, i64, i64), i64>,
    width: i64,
    n: i64,
    counter: &str,
    at: i64,
) -> i64 {
    let current = at - at.rem_euclid(width);
    (buckets.iter())
        .filter(|((c, w, s), _)| {
            c == counter && *w == width && *s <= current && *s > current - n * width
        })
        .map(|(_, v)| v)
        .sum()
}

type Pending = (rdkafka::producer::DeliveryFuture, String, i64, i64, i64);

async fn settle(pending: &mut Vec<Pending>, truth: &mut Truth) {
    for (delivery, counter, delta, ts, kafka) in pending.drain(..) {
        delivery
            .await
            .expect("delivery report")
            .expect("Kafka acknowledged the event");
        truth.record(&counter, delta, ts, kafka);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_are_exact_under_sigkills_expire_and_pass_the_audit() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    windows_scenario("windows", &redis, &redis.url()).await;
}

/// The same through `WATCH`/`MULTI`/`EXEC`, as a Redis user that may not run scripts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_without_scripts_are_exact_under_sigkills() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let url = redis.user_without_scripts().await;
    windows_scenario("windows-noscripts", &redis, &url).await;
}

async fn windows_scenario(name: &str, redis: &RedisServer, redis_url: &str) {
    let seed = seed();
    let dir = TempDir::new("tally-windows");
    let setup = AggregatorSetup::create(name, redis_url, 8).await;
    let namespaces = dir.path().join("namespaces.toml");
    std::fs::write(&namespaces, NAMESPACES).expect("namespace file");
    let ns_path = namespaces.to_str().expect("utf-8 path");
    let member = format!("group.instance.id={}", unique("member"));
    let flags = ["--namespaces", ns_path, "--kafka-option", &member];
    let first = setup.spawn(dir.path(), &flags);
    let now = tally_common::event::now_ms();
    // At most EVENTS: the stream runs until the last kill is over and flushed.
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(send(setup.topic.clone(), seed, now, stop.clone()));
    let last = kill_repeatedly(&setup, dir.path(), &flags, first, 5, seed, &load).await;
    stop.store(true, Ordering::Relaxed);
    let truth = load.await.expect("load task");
    eprintln!(
        "{} counters, {} buckets; {} windows missed as late, {} events from the future",
        truth.totals.len(),
        truth.buckets.len(),
        truth.late,
        truth.future
    );
    assert!(
        truth.late > 0 && truth.future > 0,
        "late and future events were sent"
    );

    let counts = reader(&redis.url(), setup.keyspace()).await;
    wait_for_totals(&counts, &truth.totals, Duration::from_secs(90)).await;
    let mut cells: Vec<(String, i64, i64)> = truth.buckets.keys().cloned().collect();
    cells.sort();
    let asked: Vec<(&str, i64, i64)> = (cells.iter())
        .map(|(c, w, s)| (c.as_str(), *w, *s))
        .collect();
    let stored = counts.bucket_values(&asked).await.expect("bucket reads");
    let wrong: Vec<String> = (cells.iter().zip(&stored))
        .filter(|(cell, got)| truth.buckets[*cell] != **got)
        .map(|(cell, got)| format!("{cell:?}: redis {got}, truth {}", truth.buckets[cell]))
        .take(10)
        .collect();
    assert!(wrong.is_empty(), "buckets differ: {wrong:?}");
    let ms = |width: i64| if width == MINUTE { "1m" } else { "1h" };
    eprintln!(
        "{} buckets exact ({} minute, {} hour)",
        cells.len(),
        cells.iter().filter(|c| ms(c.1) == "1m").count(),
        cells.iter().filter(|c| ms(c.1) == "1h").count()
    );

    // Sliding sums: the last 30 minutes from minute buckets, the last 2 hours from hour buckets.
    let counter = "views:video:7";
    let at = tally_common::event::now_ms();
    for (width, n) in [(MINUTE, 30), (HOUR, 2)] {
        let window = Window {
            width_ms: width,
            retention_ms: 48 * width,
        };
        let got = counts
            .window_sums(&[counter], window, n, at)
            .await
            .expect("window read");
        assert_eq!(
            got[0],
            sliding(&truth.buckets, width, n, counter, at),
            "last {n} x {width} ms"
        );
    }
    let cached = CachedReader::new(
        reader(&redis.url(), setup.keyspace()).await,
        std::sync::Arc::new(Namespaces::from_toml(NAMESPACES).expect("valid")),
    );
    let refused = cached.get_window(&[counter], 7 * MINUTE + 1_000).await;
    assert!(
        matches!(refused, Err(tally_common::ReadError::Window { .. })),
        "a span no window divides is refused: {refused:?}"
    );
    // The command line, for the same 2 hours (read again if an hour turned meanwhile).
    loop {
        let before = tally_common::event::now_ms();
        let out = std::process::Command::new(binary("tally"))
            .args(["get", "--window", "2h", counter, "--namespaces", ns_path])
            .env("TALLY_REDIS_URL", redis.url())
            .args(["--key-prefix", &setup.key_prefix])
            .output()
            .expect("tally get runs");
        let after = tally_common::event::now_ms();
        if before / HOUR != after / HOUR {
            continue;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "tally get: {text}");
        assert_eq!(
            text.trim(),
            format!(
                "{counter} {}",
                sliding(&truth.buckets, HOUR, 2, counter, after)
            )
        );
        break;
    }

    // Trending in a windowed namespace: the heavy hitters, ranked by their window sums.
    let hot = "views:video:hot";
    let producer = tally_producer::Producer::new(&tally_producer::ProducerConfig::new(
        brokers(),
        &setup.topic,
    ))
    .expect("producer");
    let mut acks = Vec::new();
    for _ in 0..1_000 {
        let event = CounterEvent::new(hot, 5).expect("valid");
        let ts = event.ts_ms();
        acks.push((producer.enqueue(&event).await.expect("enqueued"), ts));
    }
    let mut truth = truth;
    for (ack, ts) in acks {
        ack.acked().await.expect("acknowledged");
        // The producer stamps the Kafka timestamp after the event time: within the grace.
        truth.record(hot, 5, ts, ts);
    }
    eventually(Duration::from_secs(30), "the hot counter on top", || {
        let cached = &cached;
        let truth = &truth;
        async move {
            let top = cached.top("views", 3).await.ok()?;
            let want = sliding(
                &truth.buckets,
                MINUTE,
                2,
                hot,
                tally_common::event::now_ms(),
            );
            (top.first() == Some(&(hot.to_owned(), want as f64))).then_some(())
        }
    })
    .await;

    // A bucket kept 20 s: seen with its sum, then gone by itself; the total stays.
    let flash = "flash:sale:1";
    let sent_at = tally_common::event::now_ms();
    for _ in 0..10 {
        let event = CounterEvent::new(flash, 3)
            .expect("valid")
            .with_ts_ms(sent_at);
        producer.send(&event).await.expect("sent");
    }
    let bucket = [(flash, 1_000, sent_at - sent_at % 1_000)];
    eventually(Duration::from_secs(20), "the 1 s bucket to hold 30", || {
        let counts = &counts;
        async move { (counts.bucket_values(&bucket).await.ok()? == [30]).then_some(()) }
    })
    .await;
    // Once its retention has passed, the next write of the counter drops it from the cells.
    let keyspace = setup.keyspace();
    let mut conn = connect(&redis.url()).await;
    let expired_at = bucket[0].2 + 1_000 + 20_000;
    eventually(
        Duration::from_secs(60),
        "the bucket's retention to pass",
        || async { (tally_common::event::now_ms() > expired_at).then_some(()) },
    )
    .await;
    let later = CounterEvent::new(flash, 3).expect("valid");
    producer.send(&later).await.expect("sent");
    eventually(
        Duration::from_secs(30),
        "the expired bucket dropped",
        || {
            let (keyspace, counts) = (&keyspace, &counts);
            let mut conn = conn.clone();
            async move {
                if counts.get(flash).await.ok()? != 33 {
                    return None;
                }
                let mut held = 0;
                for g in 0..16 {
                    let value: Option<String> = redis::cmd("HGET")
                        .arg(keyspace.cells_key(g, flash))
                        .arg(flash)
                        .query_async(&mut conn)
                        .await
                        .ok()?;
                    let cells = Cells::parse(value.as_deref().unwrap_or("")).expect("cells");
                    held += cells.get(1_000, bucket[0].2);
                }
                (held == 0).then_some(())
            }
        },
    )
    .await;
    assert_eq!(counts.get(flash).await.expect("total"), 33);

    // The audit recounts totals and buckets; then exactly one damaged bucket.
    let audit = setup.audit(&["--namespaces", ns_path]);
    eprintln!("{}", audit.stdout);
    assert!(audit.clean, "no drift: {}", audit.stdout);
    assert_eq!(audit.checked, truth.totals.len() + 1);
    assert!(
        audit
            .stdout
            .contains(&format!("window buckets checked: {},", truth.buckets.len())),
        "every bucket checked: {}",
        audit.stdout
    );
    // From a time: only the buckets whose events were all produced after it (their start minus
    // the largest grace, flash's default 1 minute, at or after it), read from the first offsets
    // stamped after it.
    let since = now - 10 * MINUTE;
    let whole = (truth.buckets.keys())
        .filter(|(_, _, start)| *start >= since + MINUTE)
        .count();
    let recent = setup.audit(&["--namespaces", ns_path, "--since", &since.to_string()]);
    eprintln!("{}", recent.stdout);
    assert!(recent.clean, "no drift: {}", recent.stdout);
    assert!(
        whole > 0
            && recent
                .stdout
                .contains(&format!("window buckets checked: {whole},")),
        "{whole} buckets checked: {}",
        recent.stdout
    );
    assert_eq!(recent.checked, 0, "no totals compared from a time");

    let (c, w, s) = &cells[0];
    let hash = keyspace.cells_key(5, c);
    let held: Option<String> = redis::cmd("HGET")
        .arg(&hash)
        .arg(c)
        .query_async(&mut conn)
        .await
        .expect("HGET");
    let mut damaged = Cells::parse(held.as_deref().unwrap_or("")).expect("cells");
    damaged.add(*w, *s, 3).expect("no overflow");
    let _: i64 = redis::cmd("HSET")
        .arg(&hash)
        .arg(c)
        .arg(damaged.to_string())
        .query_async(&mut conn)
        .await
        .expect("HSET");
    let damaged = setup.audit(&["--namespaces", ns_path]);
    eprintln!("{}", damaged.stdout);
    let label = if *w == MINUTE { "1m" } else { "1h" };
    let value = truth.buckets[&cells[0]];
    assert_eq!(
        damaged.drift,
        [(format!("{c}@{label}:{s}"), value + 3, value)],
        "exactly the damaged bucket"
    );
    let mut last = last;
    last.stop_gracefully().await;
}

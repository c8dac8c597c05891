//! Decode + aggregate on one core: the work the consume loop does per message (decode the
//! payload, look up its namespace's policy, pick its shard group, add it to the partition's
//! batch), over 100,000 pre-encoded events on 10,000 Zipf-like counters, in both wire formats
//! (JSON in the four shapes the bench's JSON catch-up reads).
//!
//! `windowed`: the same in a namespace keeping `1m`, `1h` and `1d` windows (each event placed
//! in its buckets too). `cells_plan`: what a flush of one group does with those buckets before
//! it writes (the fields read, parsed, added to and written back), for the 10,000 counters'
//! fields already holding every bucket their windows keep (48 each), and for fields never
//! written (`one_group_fresh`).
//!
//! `likes`: one catch-up batch of likes in a namespace that counts one per actor (`dedup`),
//! shaped as the bench's dedup scenario: 400,000 likes over 100,000 Zipf-like counters by
//! 10,000 actors, added to the batch (the last action per counter and actor, per shard group)
//! and sealed into runs.
//!
//! `recent_ids`: deciding 5,000,000 new event ids (every one recorded, the table growing to
//! 112 MB, as in the bench's idempotency scenario), one after another, and as the consume loop
//! does: their home slots read 16 at a time first (`RecentIds::touch`).
//!
//! `cargo bench -p tally-aggregator --bench decode_aggregate` (the benchmark command runs it).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use redis::Value;
use tally_aggregator::consume::idempotency::{RecentIds, id_key};
use tally_aggregator::machine::batch::Batch;
use tally_aggregator::store::cells::{Read, Reads, plan};
use tally_common::window::Placer;
use tally_common::window::cells::Cells;
use tally_common::{CounterEvent, Keyspace, Namespaces, codec};

const EVENTS: usize = 100_000;

/// `n` (counter, actor) pairs of a fixed pseudo-random sequence from `seed`: counter ranks
/// among `counters` skewed towards the head, like Zipf, and 10,000 actors.
fn zipf_likes(n: usize, counters: f64, seed: u64) -> impl Iterator<Item = (String, String)> {
    let mut state = seed;
    (0..n).map(move |_| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        let r = (state >> 33) as f64 / (1u64 << 31) as f64;
        let rank = (counters.powf(r * r) as u64).max(1);
        (format!("likes:post:{rank}"), format!("u{}", state % 10_000))
    })
}

fn events() -> Vec<CounterEvent> {
    zipf_likes(EVENTS, 10_000.0, 0x9e37_79b9_7f4a_7c15)
        .map(|(counter, actor)| {
            CounterEvent::new(counter, 1)
                .and_then(|e| e.with_actor(actor))
                .expect("valid event")
        })
        .collect()
}

fn decode_aggregate(c: &mut Criterion) {
    let events = events();
    let bincode: Vec<Vec<u8>> = events.iter().map(codec::encode).collect();
    // JSON as other languages' clients write it (the bench's JSON catch-up writes the same
    // four shapes): every field, an actor only, a delta and a time, the counter alone.
    let json: Vec<Vec<u8>> = (events.iter().enumerate())
        .map(|(i, e)| {
            let (counter, actor) = (e.counter(), e.actor().unwrap_or_default());
            let ts = 1_764_460_800_000 + i;
            match i % 4 {
                0 => {
                    format!(r#"{{"counter":"{counter}","delta":1,"actor":"{actor}","ts_ms":{ts}}}"#)
                }
                1 => format!(r#"{{"counter":"{counter}","actor":"{actor}"}}"#),
                2 => format!(r#"{{"counter":"{counter}","delta":2,"ts_ms":{ts}}}"#),
                _ => format!(r#"{{"counter":"{counter}"}}"#),
            }
            .into_bytes()
        })
        .collect();
    let keyspace = Keyspace::default();
    let namespaces = Namespaces::default();
    let mut group = c.benchmark_group("decode_aggregate");
    group.throughput(Throughput::Elements(EVENTS as u64));
    for (name, payloads) in [("bincode", &bincode), ("json", &json)] {
        group.bench_function(name, |b| {
            b.iter(|| black_box(aggregate(&namespaces, &keyspace, payloads).seal()));
        });
    }
    group.finish();
}

/// The payloads decoded and added to a batch, as the consume loop does: placed in their buckets
/// when their namespace keeps windows.
fn aggregate(namespaces: &Namespaces, keyspace: &Keyspace, payloads: &[Vec<u8>]) -> Batch {
    let mut batch = Batch::default();
    let mut placer = Placer::default();
    for (offset, payload) in payloads.iter().enumerate() {
        let event = codec::decode(payload, 16_384).expect("decodes");
        let policy = namespaces.policy(&event.counter);
        let shard = keyspace.group_for_event(
            policy.grouping,
            3,
            event.actor.as_deref(),
            &event.counter,
            tally_common::keyspace::Fan::of(tally_common::keyspace::DEFAULT_SPREAD),
        );
        let buckets = if policy.windows.is_empty() {
            &[][..]
        } else {
            placer
                .place(&policy.windows, event.ts_ms, Some(event.ts_ms))
                .buckets()
        };
        batch.add_windowed(shard, &event.counter, event.delta, buckets, offset as i64);
    }
    batch
}

/// 2025-11-30T00:00Z, in ms.
const T0: i64 = 1_764_460_800_000;

fn windowed_namespaces() -> Namespaces {
    Namespaces::from_toml("[namespaces.likes]\nwindows = [\"1m\", \"1h\", \"1d\"]\n")
        .expect("valid namespaces")
}

fn windowed(c: &mut Criterion) {
    // Times 1 ms apart (100,000 events span two minutes): every event is placed afresh.
    let payloads: Vec<Vec<u8>> = (events().into_iter().enumerate())
        .map(|(i, e)| codec::encode(&e.with_ts_ms(T0 + i as i64)))
        .collect();
    let keyspace = Keyspace::default();
    let namespaces = windowed_namespaces();
    let mut group = c.benchmark_group("decode_aggregate");
    group.throughput(Throughput::Elements(EVENTS as u64));
    group.bench_function("bincode_windowed", |b| {
        b.iter(|| black_box(aggregate(&namespaces, &keyspace, &payloads).seal()));
    });
    group.finish();

    // One group's window deltas, and what its fields held: every bucket each window keeps.
    let mut sealed = (aggregate(&namespaces, &keyspace, &payloads).seal()).expect("events");
    let batch = sealed.groups.swap_remove(0);
    let reads = Reads::new(&keyspace, batch.group, &batch.windows);
    let windows = namespaces.policy("likes:").windows.list().to_vec();
    let replies: Vec<Value> = (reads.stripes.iter())
        .map(|(_, fields)| {
            let values = fields.iter().map(|_| {
                let mut cells = Cells::default();
                for w in &windows {
                    let kept = w.retention_ms / w.width_ms;
                    for i in 1..=kept {
                        cells
                            .add(w.width_ms, T0 - i * w.width_ms, 1)
                            .expect("small");
                    }
                }
                Value::BulkString(cells.to_value().into_bytes())
            });
            Value::Array(values.collect())
        })
        .collect();
    // The same fields before their counters were ever written.
    let fresh: Vec<Value> = (reads.stripes.iter())
        .map(|(_, fields)| Value::Array(vec![Value::Nil; fields.len()]))
        .collect();
    let mut group = c.benchmark_group("cells_plan");
    group.throughput(Throughput::Elements(batch.windows.len() as u64));
    for (name, replies) in [("one_group", &replies), ("one_group_fresh", &fresh)] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let reads = Reads::new(&keyspace, batch.group, &batch.windows);
                let got: Vec<Read> = (replies.iter().cloned())
                    .map(|r| Read::from_reply(r).expect("fields"))
                    .collect();
                black_box(plan(&reads, got, &batch.windows, T0 + 120_000))
            });
        });
    }
    group.finish();
}

fn likes(c: &mut Criterion) {
    const LIKES: usize = 400_000;
    let likes: Vec<(String, String)> =
        zipf_likes(LIKES, 100_000.0, 0x2545_f491_4f6c_dd1d).collect();
    let keyspace = Keyspace::default();
    let namespaces = Namespaces::from_toml("[namespaces.likes]\ndedup = true\n").expect("valid");
    let grouping = namespaces.policy("likes:").grouping;
    let fan = tally_common::keyspace::Fan::of(tally_common::keyspace::DEFAULT_SPREAD);
    let mut group = c.benchmark_group("decode_aggregate");
    group.throughput(Throughput::Elements(LIKES as u64));
    group.bench_function("likes", |b| {
        b.iter(|| {
            let mut batch = Batch::default();
            for (offset, (counter, actor)) in likes.iter().enumerate() {
                let shard = keyspace.group_for_event(grouping, 3, Some(actor), counter, fan);
                batch.add_member(shard, counter, actor, true, offset as i64);
            }
            black_box(batch.seal())
        });
    });
    group.finish();
}

fn recent_ids(c: &mut Criterion) {
    const IDS: usize = 5_000_000;
    const WINDOW_MS: i64 = 600_000;
    let keys: Vec<u64> = (0..IDS)
        .map(|n| id_key(&format!("likes:post:{}", n % 10_000), &format!("e{n}")))
        .collect();
    let mut group = c.benchmark_group("recent_ids");
    group.sample_size(10);
    group.throughput(Throughput::Elements(IDS as u64));
    for ahead in [1, 16] {
        group.bench_function(format!("new_ids_read_ahead_{ahead}"), |b| {
            b.iter(|| {
                let mut ids = RecentIds::new(WINDOW_MS);
                let mut repeats = 0;
                for (c, chunk) in keys.chunks(ahead).enumerate() {
                    if ahead > 1 {
                        ids.touch(chunk.iter().copied());
                    }
                    for (i, &key) in chunk.iter().enumerate() {
                        let offset = (c * ahead + i) as i64;
                        repeats += u64::from(ids.is_repeat(key, offset, offset / 10, WINDOW_MS));
                    }
                }
                black_box((repeats, ids.len()))
            });
        });
    }
    group.finish();
}

criterion_group!(benches, decode_aggregate, windowed, likes, recent_ids);
criterion_main!(benches);

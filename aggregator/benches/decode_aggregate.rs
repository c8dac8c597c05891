//! Decode + aggregate on one core: the work the consume loop does per message (decode the
//! payload, look up its namespace's policy, pick its shard group, add it to the partition's
//! batch), over 100,000 pre-encoded events on 10,000 Zipf-like counters, in both wire formats
//! (JSON in the four shapes the bench's JSON catch-up reads).
//!
//! `cargo bench -p tally-aggregator --bench decode_aggregate` (the benchmark command runs it).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tally_aggregator::machine::batch::Batch;
use tally_common::{CounterEvent, Keyspace, Namespaces, codec};

const EVENTS: usize = 100_000;

fn events() -> Vec<CounterEvent> {
    // A fixed pseudo-random sequence: counter ranks skewed towards the head, like Zipf.
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..EVENTS)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            let r = (state >> 33) as f64 / (1u64 << 31) as f64;
            let rank = (10_000f64.powf(r * r) as u64).max(1);
            CounterEvent::new(format!("likes:post:{rank}"), 1)
                .and_then(|e| e.with_actor(format!("u{}", state % 10_000)))
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
            b.iter(|| {
                let mut batch = Batch::default();
                for (offset, payload) in payloads.iter().enumerate() {
                    let event = codec::decode(payload, 16_384).expect("decodes");
                    let policy = namespaces.policy(&event.counter);
                    let shard = keyspace.group_for_event(
                        policy.grouping,
                        3,
                        event.actor.as_deref(),
                        &event.counter,
                        tally_common::keyspace::DEFAULT_SPREAD,
                    );
                    batch.add(shard, &event.counter, event.delta, offset as i64);
                }
                black_box(batch.seal())
            });
        });
    }
    group.finish();
}

criterion_group!(benches, decode_aggregate);
criterion_main!(benches);

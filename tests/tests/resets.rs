//! Resets through the stream, end to end: 150,000 increments over 200 counters with about 1,500
//! resets interleaved (routed by counter, so each reset is ordered with its counter's
//! increments), while the aggregator is SIGKILLed 5 times, grouped by partition and by actor.
//! Every total equals what was sent after its counter's last reset; `tally audit` agrees. In a
//! namespace that counts one per actor, a reset also clears the member set: a like sent before it
//! by an actor who likes again after it counts once, and one not repeated is gone.

use std::collections::HashMap;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tally_common::CounterEvent;
use tally_producer::{Producer, ProducerConfig};
use tally_tests::{
    NamespacedSetup, PacedSender, brokers, kill_repeatedly, reader, seed, wait_for_totals,
};

const EVENTS: u64 = 150_000;
const RATE: u64 = 10_000;

/// Sends the storm in order from one task; returns each counter's total since its last reset.
async fn send(topic: String, seed: u64) -> (HashMap<String, i64>, u64) {
    let mut sender = PacedSender::new(&topic, RATE);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut truth: HashMap<String, i64> = HashMap::new();
    let mut resets = 0;
    for _ in 0..EVENTS {
        let counter = format!("views:video:{}", rng.random_range(0..200));
        let event = if rng.random_bool(0.01) {
            resets += 1;
            truth.insert(counter.clone(), 0);
            CounterEvent::reset(counter).expect("valid")
        } else {
            let delta = if rng.random_bool(0.2) {
                -2
            } else {
                rng.random_range(1..=5)
            };
            *truth.entry(counter.clone()).or_default() += delta;
            CounterEvent::new(counter, delta)
                .and_then(|e| e.with_actor(format!("u{}", rng.random_range(0..5_000))))
                .expect("valid")
        };
        sender.send(&event).await;
    }
    sender.finish().await;
    (truth, resets)
}

async fn resets_clear_what_came_before(name: &str, grouping: &str) {
    let seed = seed();
    let run = NamespacedSetup::start(name, "[namespaces.likes]\ndedup = true\n").await;
    let (redis, dir, setup) = (&run.redis, &run.dir, &run.setup);
    let flags = run.flags(&["--grouping", grouping]);
    let first = setup.spawn(dir.path(), &flags);
    let load = tokio::spawn(send(setup.topic.clone(), seed));
    let mut last = kill_repeatedly(setup, dir.path(), &flags, first, 5, seed, &load).await;
    let (mut truth, resets) = load.await.expect("load task");
    eprintln!("{EVENTS} events, {resets} of them resets");

    // Likes: u1 and u2 like, a reset, u1 likes again.
    let producer = Producer::new(&ProducerConfig::new(brokers(), &setup.topic)).expect("producer");
    let post = "likes:post:1";
    producer.like(post, "u1").await.expect("sent");
    producer.like(post, "u2").await.expect("sent");
    producer.reset(post).await.expect("sent");
    producer.like(post, "u1").await.expect("sent");
    truth.insert(post.to_owned(), 1);

    let counts = reader(&redis.url(), setup.keyspace()).await;
    wait_for_totals(&counts, &truth, Duration::from_secs(90)).await;
    assert!(counts.has_liked(post, "u1").await.expect("read"));
    assert!(
        !counts.has_liked(post, "u2").await.expect("read"),
        "the reset cleared u2's like"
    );
    last.stop_gracefully().await;

    setup.assert_audit_clean(&["--namespaces", &run.namespaces], truth.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_under_sigkills_grouped_by_partition_leave_what_came_after() {
    let _serial = tally_tests::serial().await;
    resets_clear_what_came_before("resets", "partition").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_under_sigkills_grouped_by_actor_leave_what_came_after() {
    let _serial = tally_tests::serial().await;
    resets_clear_what_came_before("resets-actor", "actor").await;
}

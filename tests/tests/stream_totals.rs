//! End to end: 200,000 Zipf-skewed events with positive and negative deltas, sent with the
//! producer crate, consumed by the real aggregator binary; every total read back is exact.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, NamespacedSetup, RedisServer, TempDir, assert_committed_to_end,
    counters_in_redis, finish_load, start_load, wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zipf_stream_with_negative_deltas_sums_exactly() {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("stream", &redis.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);

    let spec = LoadSpec {
        events: 200_000,
        counters: 10_000,
        zipf: 1.1,
        max_delta: 5,
        negative_share: 0.3,
        seed: 7,
        ..LoadSpec::default()
    };
    let sent = finish_load(start_load(&setup.topic, spec), 200_000).await;
    assert!(
        sent.totals.values().any(|t| *t < 0),
        "some totals are negative"
    );

    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;

    // Nothing was written that was not sent.
    let stray: Vec<String> = counters_in_redis(&redis.url(), &setup.keyspace())
        .await
        .into_iter()
        .filter(|c| !sent.totals.contains_key(c))
        .collect();
    assert!(stray.is_empty(), "counters never sent: {stray:?}");
    assert_eq!(
        aggregator.metric("tally_events_consumed_total").await,
        Some(200_000.0)
    );

    aggregator.stop_gracefully().await;
    assert_committed_to_end(&setup.group, &setup.topic, 8);
}

/// A catch-up whose batches fill while their partition's previous flush is in flight, over and
/// over (a tiny catch-up batch): each time the partition is held, and what was fetched for it
/// is read once it resumes, from where it stopped: every event read once, none fetched twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_held_at_every_flush_reads_each_event_once() {
    held_catch_up("held", "", false).await;
}

/// The same with an idempotency window on every counter, each event with an id of its own:
/// records decoded ahead of their turn are read again from where the hold stopped them, and
/// an event read twice would count twice (its id is not a repeat of itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_with_ids_held_at_every_flush_counts_each_event_once() {
    held_catch_up(
        "held-ids",
        "[defaults]\nidempotency_window = \"10m\"\n",
        true,
    )
    .await;
}

async fn held_catch_up(name: &str, namespaces: &str, event_ids: bool) {
    let run = NamespacedSetup::start(name, namespaces).await;
    let (redis, dir, setup) = (&run.redis, &run.dir, &run.setup);
    let spec = LoadSpec {
        events: 100_000,
        counters: 20_000,
        zipf: 0.8,
        max_delta: 5,
        negative_share: 0.3,
        seed: 11,
        event_ids,
        ..LoadSpec::default()
    };
    // Written first: the aggregator starts behind and catches up.
    let sent = finish_load(start_load(&setup.topic, spec), 100_000).await;
    let flags = run.flags(&["--catch-up-max-batch-counters", "100"]);
    let mut aggregator = setup.spawn(dir.path(), &flags);
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;

    assert_eq!(
        aggregator.metric("tally_events_consumed_total").await,
        Some(100_000.0),
        "every event read once"
    );
    assert_eq!(
        aggregator
            .metric("tally_fetched_records_dropped_total")
            .await,
        Some(0.0),
        "nothing fetched was dropped to be fetched again"
    );
    let flushes = aggregator
        .metric("tally_flushes_total")
        .await
        .unwrap_or(0.0);
    assert!(
        flushes > 100.0,
        "the catch-up flushed in small batches: {flushes}"
    );
    aggregator.stop_gracefully().await;
    assert_committed_to_end(&setup.group, &setup.topic, 8);
}

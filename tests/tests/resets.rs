//! Resets through the stream, end to end: up to 150,000 increments over 200 counters with 1% of
//! resets interleaved (routed by counter, so each reset is ordered with its counter's
//! increments), while the aggregator is SIGKILLed 5 times (the stream runs until the last kill
//! is over and flushed), grouped by partition and by actor.
//! Every total equals what was sent after its counter's last reset; `tally audit` agrees. In a
//! namespace that counts one per actor, a reset also clears the member set: a like sent before it
//! by an actor who likes again after it counts once, and one not repeated is gone. The same with
//! PostgreSQL as the store of record, over 4 shard groups, where each group's transaction clears
//! only the members whose likes its share holds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tally_producer::{Producer, ProducerConfig};
use tally_tests::postgres::PgServer;
use tally_tests::scenarios::Store;
use tally_tests::{
    NamespacedSetup, brokers, end_offsets, kill_repeatedly, seed, send_with_resets, wait_for_totals,
};

async fn resets_clear_what_came_before(name: &str, grouping: &str, postgres: Option<&str>) {
    let seed = seed();
    let events = if postgres.is_some() { 100_000 } else { 150_000 };
    let run = NamespacedSetup::start(name, "[namespaces.likes]\ndedup = true\n").await;
    let (redis, dir, setup) = (&run.redis, &run.dir, &run.setup);
    let redis_url = redis.url();
    let store = match postgres {
        Some(url) => Store::postgres(&redis_url, url),
        None => Store::from(&redis_url),
    };
    let mut extra = vec!["--grouping", grouping];
    if postgres.is_some() {
        extra.extend(["--shard-groups", "4"]);
    }
    extra.extend(store.flags());
    let flags = run.flags(&extra);
    let first = setup.spawn(dir.path(), &flags);
    let stop = Arc::new(AtomicBool::new(false));
    let topic = setup.topic.clone();
    let load = tokio::spawn(send_with_resets(
        topic,
        events,
        ("views:video:", 200),
        seed,
        stop.clone(),
    ));
    let mut last = kill_repeatedly(setup, dir.path(), &flags, first, 5, seed, &load).await;
    stop.store(true, Ordering::Relaxed);
    let (mut truth, resets) = load.await.expect("load task");
    eprintln!("up to {events} events, {resets} of them resets");

    // Likes: u0..u7 like (their member sets spread over the groups), u0 and u1 unlike, a
    // reset, then u2 and u3 like again and u4 unlikes (no longer a member: nothing).
    let producer = Producer::new(&ProducerConfig::new(brokers(), &setup.topic)).expect("producer");
    let post = "likes:post:1";
    for actor in 0..8 {
        producer
            .like(post, &format!("u{actor}"))
            .await
            .expect("sent");
    }
    producer.unlike(post, "u0").await.expect("sent");
    producer.unlike(post, "u1").await.expect("sent");
    producer.reset(post).await.expect("sent");
    producer.like(post, "u2").await.expect("sent");
    producer.like(post, "u3").await.expect("sent");
    producer.unlike(post, "u4").await.expect("sent");
    truth.insert(post.to_owned(), 2);

    // Durable to the log's end first: the totals alone pass through the expected values on the
    // way (2 after the first two likes), while a membership read then would see u0 still in.
    let ends = end_offsets(&setup.topic, 8).await;
    last.wait_durable(&ends, Duration::from_secs(90)).await;
    let counts = store.reader(setup.keyspace()).await;
    wait_for_totals(&counts, &truth, Duration::from_secs(90)).await;
    for actor in 0..8 {
        let actor = format!("u{actor}");
        let liked = counts.has_liked(post, &actor).await.expect("read");
        assert_eq!(
            liked,
            actor == "u2" || actor == "u3",
            "{actor}: only the likes after the reset count"
        );
    }
    assert!(last.is_running());
    last.stop_gracefully().await;
    if postgres.is_none() {
        // The audit reads watermarks from Redis: it does not audit the PostgreSQL store yet.
        setup.assert_audit_clean(&["--namespaces", &run.namespaces], truth.len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_under_sigkills_grouped_by_partition_leave_what_came_after() {
    let _serial = tally_tests::serial().await;
    resets_clear_what_came_before("resets", "partition", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_under_sigkills_grouped_by_actor_leave_what_came_after() {
    let _serial = tally_tests::serial().await;
    resets_clear_what_came_before("resets-actor", "actor", None).await;
}

/// With PostgreSQL, exactly once over 4 shard groups: a reset clears every group's share row
/// and member rows, each in its group's transaction, and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_under_sigkills_into_postgres_leave_what_came_after() {
    let _serial = tally_tests::serial().await;
    let pg = PgServer::start().await;
    resets_clear_what_came_before("resets-pg", "actor", Some(&pg.url())).await;
}

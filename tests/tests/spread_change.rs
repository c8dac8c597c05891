//! Fault: a partition's spread (`--partition-spread`, how many shard groups its counters go to)
//! changes between owners while flushes are cut in the middle. Four aggregators in a row, at
//! spreads 4, 2, 1 and 3, die during a load of 150,000 events on four partitions: three abort
//! right after a group write lands while other groups of its flush have not (a test-only
//! failpoint; the flush's watermark never moves), one is SIGKILLed. A fifth, at spread 4,
//! finishes. Every counter ends at the ground truth and `tally audit` finds no drift. (Had a new
//! owner spread the cut flush's messages its own way, the groups that took them before the cut
//! would take them again.)

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_common::keyspace::{Watermark, partition_field};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, connect, finish_load, seed, start_load, unique,
    wait_for_totals,
};

const PARTITIONS: i32 = 4;
const EVENTS: u64 = 150_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_spread_across_crashes_mid_flush_counts_every_event_once() {
    let _serial = tally_tests::serial().await;
    let seed = seed();
    let dir = TempDir::new("tally-spread");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("spread", &redis.url(), PARTITIONS).await;
    let member = format!("group.instance.id={}", unique("member"));
    let spec = LoadSpec {
        events: EVENTS,
        counters: 3_000,
        rate: 10_000,
        max_delta: 5,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    // (spread, the mid-flush group write to abort after; none: SIGKILL after a durable flush).
    let plan = [
        ("4", Some(1 + seed % 3)),
        ("2", Some(1 + (seed >> 8) % 3)),
        ("1", None),
        ("3", Some(1 + (seed >> 16) % 3)),
    ];
    for (spread, abort_after) in plan {
        let flags = ["--partition-spread", spread, "--kafka-option", &member];
        let Some(after) = abort_after else {
            let mut doomed = setup.spawn(dir.path(), &flags);
            doomed
                .wait_metric("tally_flushes_total", 1.0, Duration::from_secs(60))
                .await;
            doomed.kill();
            eprintln!("spread {spread}: SIGKILL after its first durable flush");
            continue;
        };
        let after = after.to_string();
        let env = [("TALLY_FAILPOINT_ABORT_MID_FLUSH", after.as_str())];
        let mut doomed = setup.spawn_with_env(dir.path(), &flags, &env);
        let status = doomed.wait_exit(Duration::from_secs(60)).await;
        assert!(!status.success(), "spread {spread} must abort mid-flush");
        assert!(
            doomed
                .log()
                .contains("failpoint: aborting in the middle of a flush"),
            "{}",
            doomed.log()
        );
        eprintln!("spread {spread}: aborted after mid-flush group write {after}");
    }
    let flags = ["--partition-spread", "4", "--kafka-option", &member];
    let mut last = setup.spawn(dir.path(), &flags);
    let sent = finish_load(load, EVENTS).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(90)).await;
    last.stop_gracefully().await;
    setup.assert_audit_clean(&[], sent.totals.len());

    // Every partition's watermark ends at the last owner's spread.
    let ks = setup.keyspace();
    let mut conn = connect(&redis.url()).await;
    for partition in 0..PARTITIONS {
        let stored: String = redis::cmd("HGET")
            .arg(ks.watermark_key(ks.group_for_partition(partition)))
            .arg(partition_field(&setup.topic, partition))
            .query_async(&mut conn)
            .await
            .expect("a watermark");
        let watermark = Watermark::parse(&stored).expect("parses");
        assert_eq!(watermark.spread.current(), 4, "{stored}");
        eprintln!("partition {partition}: {stored}");
    }
}

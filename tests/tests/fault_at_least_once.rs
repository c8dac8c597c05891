//! Fault, at-least-once mode: the SIGKILL storm of `fault_sigkill.rs` with `--delivery
//! at-least-once`. No counter may end below the ground truth; the test reports how many ended
//! above it, to show the difference the delivery mode makes.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, StoppableLoad, TempDir, below_and_above, kill_repeatedly, seed,
    unique, wait_committed_to_end,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_under_sigkills_never_loses_a_count() {
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("sigkill-alo", &redis.url(), 8).await;
    let member = format!("group.instance.id={}", unique("member"));
    let flags = ["--delivery", "at-least-once", "--kafka-option", &member];
    let first = setup.spawn(dir.path(), &flags);

    let spec = LoadSpec {
        events: 500_000,
        counters: 20_000,
        rate: 20_000,
        max_delta: 5,
        seed,
        ..LoadSpec::default()
    };
    // At most 500,000 events: the load runs until the last incarnation made flushes durable.
    let load = StoppableLoad::start(&setup.topic, spec);
    let mut last = kill_repeatedly(&setup, dir.path(), &flags, first, 10, seed, &load.task).await;
    let sent = load.stop().await;
    wait_committed_to_end(&setup.group, &setup.topic, 8, Duration::from_secs(120)).await;
    last.stop_gracefully().await;

    let reader = redis.reader(setup.keyspace()).await;
    let (below, above) = below_and_above(&reader, &sent.totals).await;
    eprintln!(
        "at-least-once after 10 SIGKILLs: {above} of {} counters above the truth, {below} below",
        sent.totals.len()
    );
    assert_eq!(below, 0, "at-least-once must never lose a count");
}

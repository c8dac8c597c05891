//! End to end, at the aggregator's default group settings (incremental rebalancing, a 10 s
//! session, 1 s heartbeats), three members with stable identities counting a steady stream of
//! 12 partitions, each partition's durable offset sampled every 100 ms:
//!
//! 1. one member is SIGKILLed: the survivors revoke nothing, the partitions they keep go at
//!    most 3 s without a durable flush, and the dead member's are counted again within 15 s;
//! 2. a fourth member joins: only the partitions it takes move, and those that stay put go at
//!    most 5 s without a durable flush;
//! 3. a member is SIGKILLed and restarted at once under the same `group.instance.id`: it takes
//!    its own partitions back within 5 s of starting, and the others see no rebalance;
//!
//! and every total ends exact.

use std::time::{Duration, Instant};

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, Group, RedisServer, StoppableLoad, TempDir, assignments_seen, revokes_seen,
};

const PARTITIONS: i32 = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_and_scale_out_stop_only_the_partitions_that_move() {
    let dir = TempDir::new("tally-failover");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup {
        session_timeout_ms: None,
        ..AggregatorSetup::create("failover", &redis.url(), PARTITIONS).await
    };
    let mut group = Group::new(&setup, dir.path(), &[]);
    let mut a = group.spawn("a");
    let b = group.spawn("b");
    let mut c = group.spawn("c");
    let spec = LoadSpec {
        events: 50_000_000,
        counters: 2_000,
        rate: 6_000,
        seed: 28,
        ..LoadSpec::default()
    };
    let load = StoppableLoad::start(&setup.topic, spec);
    let before = group.wait_owned(&["a", "b", "c"], PARTITIONS, 4).await;
    eprintln!("three members: {before:?}");

    // 1. A member dies.
    let revokes = [revokes_seen(&a), revokes_seen(&b)];
    group.kill("c", &mut c);
    let died = group
        .rebalanced(Instant::now(), before, &["a", "b"], PARTITIONS, 1)
        .await;
    let (partition, pause) = died.pause;
    eprintln!(
        "SIGKILL: partitions moved in {:?}, counted again in {:?}; the {} that stayed put \
         paused at most {pause:?} (partition {partition})",
        died.moved,
        died.settled,
        died.kept.len()
    );
    assert_eq!(
        [revokes_seen(&a), revokes_seen(&b)],
        revokes,
        "the survivors revoked partitions when a member died"
    );
    assert_eq!(died.kept.len(), PARTITIONS as usize - 4, "{died:?}");
    assert!(
        died.settled <= Duration::from_secs(15),
        "a dead member's partitions were counted again only after {:?}",
        died.settled
    );
    assert!(
        pause <= Duration::from_secs(3),
        "partition {partition} stayed with a survivor yet went {pause:?} without a durable flush"
    );

    // 2. A fourth member joins.
    let d = group.spawn("d");
    let joined = group
        .rebalanced(Instant::now(), died.after, &["a", "b", "d"], PARTITIONS, 4)
        .await;
    let (partition, pause) = joined.pause;
    eprintln!(
        "join: {:?} settled in {:?}; the {} that stayed put paused at most {pause:?} \
         (partition {partition})",
        joined.after,
        joined.settled,
        joined.kept.len()
    );
    assert_eq!(
        joined.kept.len(),
        PARTITIONS as usize - 4,
        "only the partitions the new member takes move: {joined:?}"
    );
    assert!(
        pause <= Duration::from_secs(5),
        "partition {partition} stayed put yet went {pause:?} without a durable flush during a join"
    );

    // 3. A member restarted in place, with its stable identity.
    let others = [(&b, assignments_seen(&b)), (&d, assignments_seen(&d))];
    let own = group.watch.owned_by("a");
    group.kill("a", &mut a);
    let restarted = Instant::now();
    a = group.spawn("a");
    let back = group
        .rebalanced(restarted, joined.after, &["a", "b", "d"], PARTITIONS, 4)
        .await;
    eprintln!(
        "static restart: its own {own:?} back in {:?}, durable at {:?}",
        back.moved, back.settled
    );
    assert_eq!(back.before, back.after, "nothing moved");
    assert!(
        back.moved <= Duration::from_secs(5),
        "a restarted static member took its partitions back only after {:?}",
        back.moved
    );
    for (member, seen) in others {
        assert_eq!(
            assignments_seen(member),
            seen,
            "the others saw no rebalance; log tail:\n{}",
            member.log_tail(20)
        );
    }

    load.stop_and_wait_totals(
        &redis.reader(setup.keyspace()).await,
        Duration::from_secs(60),
    )
    .await;
    for mut member in [a, b, d] {
        member.stop_gracefully().await;
    }
}

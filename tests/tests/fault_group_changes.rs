//! Faults in the consumer group, exactly-once mode, standalone Redis: scaling 1 → 3 → 1 members
//! during a load; and a member SIGSTOPped past `max.poll.interval.ms` and the session timeout,
//! then SIGCONTed, whose late writes must be refused by the fences of the partitions' new owner.
//! The same scenarios run on a Redis Cluster in `cluster.rs`.

use tally_tests::RedisServer;
use tally_tests::scenarios::{scale_one_three_one, zombie_is_fenced_off};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_one_to_three_to_one_members_counts_exactly() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    scale_one_three_one("scale", &redis.url(), "partition").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_woken_after_losing_its_partitions_is_fenced_off() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    zombie_is_fenced_off("zombie", &redis.url(), "partition").await;
}

//! Fault: the aggregator SIGKILLed at random moments, ten times, during a load (at most 500,000
//! events, on until the last incarnation has flushed), in exactly-once mode, with deltas grouped by partition (a partition's counters spread over 4
//! groups) and by actor (over all 16): flushes span several shard groups, so a crash can fall
//! between two groups' writes of one flush.
//! Every counter ends exactly at the ground truth: nothing lost, nothing applied twice, and
//! `tally audit`, recounting the log, finds no drift.

use tally_tests::RedisServer;
use tally_tests::scenarios::sigkill_storm;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_sigkills_during_half_a_million_events_count_every_event_once() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let (setup, totals) = sigkill_storm("sigkill", &redis.url(), "partition", 500_000, 10).await;
    setup.assert_audit_clean(&[], totals.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_sigkills_with_actor_grouping_count_every_event_once() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let (setup, totals) = sigkill_storm("sigkill-actor", &redis.url(), "actor", 500_000, 10).await;
    setup.assert_audit_clean(&[], totals.len());
}

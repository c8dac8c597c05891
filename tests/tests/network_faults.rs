//! Fault: the network between the aggregators and Redis, under a live stream. Three aggregators
//! reach Redis through a TCP proxy that, in turn, loses replies after Redis ran the command
//! (the write landed, the aggregator never hears of it), stalls every connection both ways for
//! longer than the 5 s command timeout, refuses new connections, and delays every chunk; one
//! aggregator is SIGKILLed and restarted in the middle of it. A retried write whose first
//! attempt landed is recognised by its ledger entry, so every counter ends exact, nothing is
//! dead-lettered, and `tally audit` finds no drift.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tally_tests::proxy::{Fault, FaultyProxy};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, end_offsets, seed, stream_until, wait_for_totals,
};

const PARTITIONS: i32 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_replies_stalls_refusals_and_slow_links_cost_no_event() {
    let dir = TempDir::new("tally-network");
    let redis = RedisServer::start().await;
    let upstream = redis.url().replace("redis://", "");
    let proxy = FaultyProxy::start(&upstream).await;
    let through = format!("redis://127.0.0.1:{}", proxy.port());
    let setup = AggregatorSetup::create("network", &through, PARTITIONS).await;
    let mut aggregators: Vec<_> = (0..3).map(|_| setup.spawn(dir.path(), &[])).collect();
    let sending = Arc::new(AtomicBool::new(true));
    let (topic, flag) = (setup.topic.clone(), sending.clone());
    let sent = tokio::spawn(async move { stream_until(&topic, 2_000, 2_000, seed(), flag).await });
    for a in &aggregators {
        a.wait_metric("tally_group_member", 1.0, Duration::from_secs(60))
            .await;
    }
    let flushes = |aggregators: &[tally_tests::AggregatorProcess]| {
        let ports: Vec<_> = aggregators.iter().map(|a| a.metrics_port()).collect();
        async move {
            let mut total = 0.0;
            for port in ports {
                let text = tally_tests::http_get(port, "/metrics")
                    .await
                    .unwrap_or_default();
                total += (text.lines())
                    .filter_map(|l| l.strip_prefix("tally_flushes_total "))
                    .filter_map(|v| v.parse::<f64>().ok())
                    .sum::<f64>();
            }
            total
        }
    };

    let steps = [
        (Fault::LoseReplies, Duration::from_secs(3)),
        (Fault::Stall, Duration::from_secs(8)),
        (Fault::Refuse, Duration::from_secs(3)),
        (Fault::Slow, Duration::from_secs(4)),
        (Fault::LoseReplies, Duration::from_secs(2)),
    ];
    for (i, (fault, lasts)) in steps.into_iter().enumerate() {
        // Some durable flushes between faults, so that each one meets a running pipeline.
        let before = flushes(&aggregators).await;
        tally_tests::eventually(
            Duration::from_secs(60),
            "flushes between faults",
            || async { (flushes(&aggregators).await >= before + 8.0).then_some(()) },
        )
        .await;
        eprintln!("{fault:?} for {lasts:?}");
        proxy.set(fault);
        if i == 2 {
            // One aggregator SIGKILLed while Redis is out of reach, and started again.
            aggregators[0].kill();
            aggregators[0] = setup.spawn(dir.path(), &[]);
        }
        tokio::time::sleep(lasts).await;
        proxy.set(Fault::None);
    }
    sending.store(false, Ordering::Relaxed);
    let totals = sent.await.expect("stream");

    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &totals, Duration::from_secs(90)).await;
    // The faults bit: writes failed and were retried, and some whose reply was lost had landed.
    let (mut errors, mut repeated) = (0.0, 0.0);
    for a in aggregators.iter_mut() {
        errors += (a.metric("tally_redis_errors_total").await).unwrap_or(0.0);
        repeated += (a.metric("tally_repeated_writes_total").await).unwrap_or(0.0);
        assert!(a.is_running(), "an aggregator died: {}", a.log_tail(30));
        let dead = (a.metric("tally_events_dead_lettered_total").await).unwrap_or(0.0);
        assert_eq!(dead, 0.0, "valid events were dead-lettered");
    }
    eprintln!("failed attempts: {errors}; retried writes found already applied: {repeated}");
    assert!(errors > 0.0, "no write failed");
    assert!(repeated > 0.0, "no lost reply hid a landed write");
    assert_eq!(end_offsets(&setup.dead_letter_topic, 1).await, vec![0]);
    let direct = AggregatorSetup {
        redis_url: redis.url(),
        ..setup.clone()
    };
    direct.assert_audit_clean(&[], totals.len());
}

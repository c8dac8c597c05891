//! `tally audit` against the real stack: run while the pipeline counts a steady load, it finds no
//! drift (counters with events not yet durable are left out, the rest are exact); run once the
//! load is counted, it checks every counter; and after two keys are changed behind tally's back
//! (one share raised by 7, one share deleted) it reports exactly those two counters with exactly
//! those differences, and exits 1.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, connect, eventually, finish_load, reader, seed,
    start_load, wait_for_totals,
};

const EVENTS: u64 = 200_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_finds_no_drift_live_and_exactly_the_damage_done_behind_tallys_back() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let dir = TempDir::new("tally-audit");
    let setup = AggregatorSetup::create("audit", &redis.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);
    let spec = LoadSpec {
        events: EVENTS,
        counters: 50_000,
        zipf: 0.8,
        rate: 10_000,
        max_delta: 5,
        negative_share: 0.3,
        seed: seed(),
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    let counts = reader(&redis.url(), setup.keyspace()).await;

    // Live: a third of the load is durable, and the rest is still coming.
    eventually(
        Duration::from_secs(60),
        "a third of the load durable",
        || {
            let counts = &counts;
            let topic = &setup.topic;
            async move {
                let durable = counts.durable_offsets(topic, 8).await.ok()?;
                let sum: i64 = durable.iter().map(|d| d.unwrap_or(0)).sum();
                (sum >= EVENTS as i64 / 3).then_some(())
            }
        },
    )
    .await;
    let live = setup.audit(&[]);
    eprintln!("live audit:\n{}", live.stdout);
    assert!(live.clean, "no drift while counting: {}", live.stdout);
    assert!(
        live.checked > 1_000,
        "most counters checked: {}",
        live.stdout
    );
    assert!(!load.is_finished(), "the audit ran against a live pipeline");

    let sent = finish_load(load, EVENTS).await;
    wait_for_totals(&counts, &sent.totals, Duration::from_secs(60)).await;
    let quiet = setup.audit(&[]);
    eprintln!("audit once counted:\n{}", quiet.stdout);
    assert!(quiet.clean, "{}", quiet.stdout);
    assert_eq!(
        (quiet.checked, quiet.moving),
        (sent.totals.len(), 0),
        "every counter checked"
    );

    // Damage: one counter gains 7 in a group it may never have written; another loses its share
    // in one group.
    let mut names: Vec<&String> = sent.totals.keys().collect();
    names.sort();
    let ks = setup.keyspace();
    let mut conn = connect(&redis.url()).await;
    let raised = names[0].clone();
    let _: i64 = redis::cmd("INCRBY")
        .arg(ks.counter_key(3, &raised))
        .arg(7)
        .query_async(&mut conn)
        .await
        .expect("INCRBY");
    let mut found = None;
    for counter in &names[1..] {
        let shares = counts.shares(counter).await.expect("shares");
        let share = shares
            .iter()
            .enumerate()
            .find_map(|(g, s)| s.filter(|v| *v != 0).map(|v| (g as u32, v)));
        if let Some((group, share)) = share {
            found = Some(((*counter).clone(), group, share));
            break;
        }
    }
    let (lost, group, share) = found.expect("a counter with a non-zero share");
    let _: i64 = redis::cmd("DEL")
        .arg(ks.counter_key(group, &lost))
        .query_async(&mut conn)
        .await
        .expect("DEL");

    let damaged = setup.audit(&[]);
    eprintln!("audit after the damage:\n{}", damaged.stdout);
    assert!(!damaged.clean, "drift exits 1");
    let mut want = vec![
        (
            raised.clone(),
            sent.totals[&raised] + 7,
            sent.totals[&raised],
        ),
        (lost.clone(), sent.totals[&lost] - share, sent.totals[&lost]),
    ];
    want.sort_by_key(|(c, stored, recounted)| {
        (std::cmp::Reverse(stored.abs_diff(*recounted)), c.clone())
    });
    assert_eq!(damaged.drift, want, "exactly the damage");
    assert_eq!(damaged.checked, sent.totals.len());
    aggregator.stop_gracefully().await;
}

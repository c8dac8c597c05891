//! Exactly-once on a real 3-master Redis Cluster (started on loopback ports by the test), for
//! both grouping rules: SIGKILLs of the aggregator during a load, scaling 1 → 3 → 1, a zombie
//! fenced off, and a cluster node SIGKILLed and restarted from its append-only file. Every counter
//! ends exact, and no operation ever hits CROSSSLOT. A connection that only times out is replaced.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::scenarios::{scale_one_three_one, sigkill_storm, zombie_is_fenced_off};
use tally_tests::{
    AggregatorSetup, RedisCluster, TempDir, assert_no_crossslot, finish_load, seed, start_load,
    wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_sigkills_grouped_by_partition() {
    let _serial = tally_tests::serial().await;
    let cluster = RedisCluster::start().await;
    sigkill_storm("cluster-kill-p", &cluster.url(), "partition", 500_000, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_sigkills_grouped_by_actor() {
    let _serial = tally_tests::serial().await;
    let cluster = RedisCluster::start().await;
    sigkill_storm("cluster-kill-a", &cluster.url(), "actor", 500_000, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_scaling_and_zombie_grouped_by_partition() {
    let _serial = tally_tests::serial().await;
    let cluster = RedisCluster::start().await;
    scale_one_three_one("cluster-scale-p", &cluster.url(), "partition").await;
    zombie_is_fenced_off("cluster-zombie-p", &cluster.url(), "partition").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_scaling_and_zombie_grouped_by_actor() {
    let _serial = tally_tests::serial().await;
    let cluster = RedisCluster::start().await;
    scale_one_three_one("cluster-scale-a", &cluster.url(), "actor").await;
    zombie_is_fenced_off("cluster-zombie-a", &cluster.url(), "actor").await;
}

async fn node_restart(grouping: &str) {
    let seed = seed();
    let dir = TempDir::new("tally-cluster-fault");
    let mut cluster = RedisCluster::start().await;
    let setup =
        AggregatorSetup::create(&format!("cluster-node-{grouping}"), &cluster.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &["--grouping", grouping]);
    let spec = LoadSpec {
        events: 150_000,
        counters: 3_000,
        rate: 10_000,
        max_delta: 5,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    aggregator
        .wait_metric("tally_flushes_total", 10.0, Duration::from_secs(60))
        .await;
    cluster.kill_and_restart_node(1).await;
    assert!(
        !load.is_finished(),
        "the load ended before the node came back"
    );
    let sent = finish_load(load, 150_000).await;
    let reader = cluster.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(90)).await;
    aggregator.stop_gracefully().await;
    assert_no_crossslot(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_node_killed_and_restarted_grouped_by_partition() {
    let _serial = tally_tests::serial().await;
    node_restart("partition").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_node_killed_and_restarted_grouped_by_actor() {
    let _serial = tally_tests::serial().await;
    node_restart("actor").await;
}

/// At-least-once mode on a cluster: each group's `MULTI`/`EXEC` is single-slot, so a clean run
/// (no faults: nothing to replay) ends exact, for both grouping rules, without CROSSSLOT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_at_least_once_counts_a_clean_stream_exactly() {
    let _serial = tally_tests::serial().await;
    let cluster = RedisCluster::start().await;
    for grouping in ["partition", "actor"] {
        let dir = TempDir::new("tally-cluster-alo");
        let setup =
            AggregatorSetup::create(&format!("cluster-alo-{grouping}"), &cluster.url(), 8).await;
        let mut aggregator = setup.spawn(
            dir.path(),
            &["--delivery", "at-least-once", "--grouping", grouping],
        );
        let spec = LoadSpec {
            events: 100_000,
            counters: 3_000,
            max_delta: 5,
            negative_share: 0.3,
            actors: 10_000,
            seed: seed(),
            ..LoadSpec::default()
        };
        let sent = finish_load(start_load(&setup.topic, spec), 100_000).await;
        wait_for_totals(
            &cluster.reader(setup.keyspace()).await,
            &sent.totals,
            Duration::from_secs(60),
        )
        .await;
        aggregator.stop_gracefully().await;
        assert_no_crossslot(dir.path());
    }
}

/// What happens to a shard group's hash slot while the group is written.
#[derive(Debug, Clone, Copy)]
enum SlotFault {
    /// Moved to another master, a few keys at a time (`ASK`, `TRYAGAIN`, then `MOVED`).
    Migrate,
    /// Its master failed over to its replica (`MOVED`, and `READONLY` from the demoted one).
    FailOver,
}

/// Streams into a cluster, does `fault` to group 0's slot, and checks that every counter ends
/// exact, with nothing dead-lettered and no CROSSSLOT.
async fn group_slot_fault(name: &str, cluster: &RedisCluster, fault: SlotFault) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = TempDir::new("tally-cluster-slot");
    let setup = AggregatorSetup::create(name, &cluster.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);
    let sending = Arc::new(AtomicBool::new(true));
    let (topic, flag) = (setup.topic.clone(), sending.clone());
    let sent =
        tokio::spawn(
            async move { tally_tests::stream_until(&topic, 3_000, 2_000, seed(), flag).await },
        );
    aggregator
        .wait_metric("tally_flushes_total", 10.0, Duration::from_secs(60))
        .await;
    // Group 0's slot: every key of the group shares it (hash tag).
    let mut conn = tally_tests::connect(&cluster.node_url(0)).await;
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(setup.keyspace().fence_key(0))
        .query_async(&mut conn)
        .await
        .expect("KEYSLOT");
    let (from, to) = match fault {
        SlotFault::Migrate => (cluster.migrate_slot(slot, 2, Duration::from_millis(50))).await,
        SlotFault::FailOver => cluster.fail_over(slot).await,
    };
    eprintln!("{fault:?}: slot {slot} of group 0 moved from {from} to {to}");
    // Some flushes after it, then the end of the stream.
    aggregator
        .wait_more_flushes(10.0, Duration::from_secs(60))
        .await;
    sending.store(false, Ordering::Relaxed);
    let totals = sent.await.expect("stream");
    wait_for_totals(
        &cluster.reader(setup.keyspace()).await,
        &totals,
        Duration::from_secs(90),
    )
    .await;
    let dead = (aggregator.metric("tally_events_dead_lettered_total").await).unwrap_or(0.0);
    assert_eq!(dead, 0.0, "valid events were dead-lettered");
    let failed = (aggregator.metric("tally_redis_errors_total").await).unwrap_or(0.0);
    eprintln!("{fault:?}: flush attempts failed and retried: {failed}");
    assert!(aggregator.is_running(), "the aggregator died");
    aggregator.stop_gracefully().await;
    assert_no_crossslot(dir.path());
}

/// A shard group's hash slot moved to another master while the group is written, then (on a
/// cluster with a replica per master) its master failed over to its replica, each under a live
/// stream: the flushes meet `ASK`, `TRYAGAIN`, `MOVED` and `READONLY`, none of them the events'
/// fault, and every counter ends exact with nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_slot_migrated_or_failed_over_while_written_costs_no_event() {
    let _serial = tally_tests::serial().await;
    let cluster = RedisCluster::start().await;
    group_slot_fault("cluster-migrate", &cluster, SlotFault::Migrate).await;
    drop(cluster);
    let cluster = RedisCluster::start_with_replicas(1).await;
    group_slot_fault("cluster-failover", &cluster, SlotFault::FailOver).await;
}

/// A cluster connection whose every request times out for longer than its healing delay
/// connects afresh, and commands go on over the new connection: every master pauses writes
/// (`CLIENT PAUSE WRITE`) for 3 s, so each SET times out while a new connection can still read
/// the topology. redis-rs's cluster client was seen to wedge for good during a slot migration
/// (every command timing out until the process restarted); this is the way out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_connection_that_only_times_out_is_replaced() {
    use tally_common::connection::{HealingCluster, RedisTarget};
    let _serial = tally_tests::serial().await;
    let cluster = RedisCluster::start().await;
    let target = RedisTarget::parse(&cluster.url()).expect("a cluster URL");
    let client = redis::cluster::ClusterClient::builder(target.node_urls())
        .response_timeout(Duration::from_millis(300))
        .retries(0)
        .build()
        .expect("a client");
    let heal_after = Duration::from_secs(1);
    let mut conn = HealingCluster::connect(client, heal_after)
        .await
        .expect("connects");
    let set = |n: u32| {
        let mut cmd = redis::cmd("SET");
        cmd.arg(format!("healing:{n}")).arg(n);
        cmd
    };
    set(0)
        .exec_async(&mut conn)
        .await
        .expect("SET before the pause");
    assert_eq!(conn.replacements(), 0);

    // Paused until unpaused below (a minute at most, should the test die first).
    let mut masters = Vec::new();
    for i in 0..3 {
        let mut node = tally_tests::store::connect(&cluster.node_url(i)).await;
        redis::cmd("CLIENT")
            .arg(&["PAUSE", "60000", "WRITE"])
            .exec_async(&mut node)
            .await
            .expect("CLIENT PAUSE");
        masters.push(node);
    }
    let paused = std::time::Instant::now();
    let (mut timeouts, mut n) = (0, 1);
    while paused.elapsed() < Duration::from_secs(3) {
        match set(n).exec_async(&mut conn).await {
            Err(e) if e.is_timeout() => timeouts += 1,
            other => panic!("a write while every master pauses writes: {other:?}"),
        }
        n += 1;
    }
    assert!(timeouts >= 5, "{timeouts} writes timed out");
    // One fresh connection per second of nothing but timeouts, at most.
    let replaced = conn.replacements();
    assert!(
        (1..=3).contains(&replaced),
        "{replaced} fresh connections in 3 s of timeouts, healing after {heal_after:?}"
    );

    // Once the pause ends, writes land over the fresh connection.
    for node in &mut masters {
        redis::cmd("CLIENT")
            .arg("UNPAUSE")
            .exec_async(node)
            .await
            .expect("CLIENT UNPAUSE");
    }
    set(n)
        .exec_async(&mut conn)
        .await
        .expect("SET after the pause");
    let stored: u32 = redis::cmd("GET")
        .arg(format!("healing:{n}"))
        .query_async(&mut conn)
        .await
        .expect("GET");
    assert_eq!(stored, n);
}

/// `tally likes-to-sets` on a Redis Cluster: a deployment that counted likes in the shares
/// (member sets and shares written as its writers wrote them, in 16 groups over the 3 masters)
/// is moved to count sets, its member sets found by `SCAN` on every master. Every total reads
/// the same after, no member set is left on any node, every partition's fence moved one epoch
/// on beside the mark, and a second run finds nothing to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn likes_counted_in_the_shares_move_to_count_sets_on_a_cluster() {
    use redis::AsyncCommands as _;
    let cluster = RedisCluster::start().await;
    let dir = TempDir::new("likes-move-cluster");
    let namespaces = dir.path().join("ns.toml");
    std::fs::write(&namespaces, "[namespaces.likes]\ndedup = true\n").expect("namespaces file");
    let prefix = tally_tests::unique("moved");
    let ks = tally_common::Keyspace::new(prefix.clone(), 16).expect("keyspace");
    let conn = tally_common::RedisConn::connect(&cluster.url())
        .await
        .expect("cluster");
    let mut writes = conn.clone();
    let _: () = writes
        .hset_multiple(
            ks.layout_key(),
            &[("likes", "shares"), ("dedup:likes", "counter")],
        )
        .await
        .expect("HSET layout");
    for group in 0..16 {
        let _: () = writes
            .hset(ks.fence_key(group), "likes.events/0", 5)
            .await
            .expect("HSET fence");
    }
    // 400 counters, each liked by 1 to 9 actors; some with an extra share in another group (a
    // share moved by a regroup, or written before a spread change).
    let (mut expected, mut likes) = (std::collections::HashMap::new(), 0);
    for i in 0..400u32 {
        let counter = format!("likes:post:{i}");
        let group = ks.group_for_counter(&counter);
        let actors: Vec<String> = (0..=i % 9).map(|a| format!("u{a}")).collect();
        let _: () = writes
            .sadd(ks.member_key(group, &counter), &actors)
            .await
            .expect("SADD");
        let mut total = actors.len() as i64;
        likes += total;
        let _: () = writes
            .set(ks.counter_key(group, &counter), total)
            .await
            .expect("SET share");
        if i.is_multiple_of(5) {
            let other = (group + 1) % 16;
            let _: () = writes
                .set(ks.counter_key(other, &counter), 3)
                .await
                .expect("SET share");
            total += 3;
        }
        expected.insert(counter, total);
    }
    let reader = tally_common::Reader::new(conn.clone(), ks.clone());
    let totals = |reader: &tally_common::Reader| {
        let reader = reader.clone();
        let counters: Vec<String> = expected.keys().cloned().collect();
        async move {
            let mut read = std::collections::HashMap::new();
            for counter in counters {
                let total = reader.get(&counter).await.expect("read");
                read.insert(counter, total);
            }
            read
        }
    };
    assert_eq!(totals(&reader).await, expected, "read before the move");

    // Whether it succeeded, and what it said.
    let run = |extra: &[&str]| {
        let (succeeded, stdout, stderr) =
            tally_tests::process::likes_to_sets(&cluster.url(), &namespaces, &prefix, 16, extra);
        (succeeded, format!("{stdout}{stderr}"))
    };
    let tally = |extra: &[&str]| {
        let (succeeded, said) = run(extra);
        assert!(succeeded, "{said}");
        said
    };
    // A dry run: what would move, with nothing changed; a set the move would stop at (its count
    // set exists already) is named, and stops the dry run too.
    let said = tally(&["--dry-run"]);
    assert!(
        said.contains(&format!("would move (dry run, nothing changed) to count sets: namespaces likes, sets 400, likes {likes}")),
        "{said}"
    );
    let blocking = ks.count_set_key(ks.group_for_counter("likes:post:7"), "likes:post:7");
    let _: () = writes.sadd(&blocking, "u0").await.expect("SADD");
    let (succeeded, said) = run(&["--dry-run"]);
    assert!(
        !succeeded
            && said.contains("its count set exists already")
            && said.contains(":m:likes:post:7"),
        "{said}"
    );
    let _: () = writes.del(&blocking).await.expect("DEL");
    // A record that groups the namespace otherwise than the file: refused by the dry run as by
    // the move.
    let _: () = writes
        .hset(ks.layout_key(), "dedup:likes", "actor")
        .await
        .expect("HSET");
    let (succeeded, said) = run(&["--dry-run"]);
    assert!(
        !succeeded && said.contains("groups that namespace's likes by counter"),
        "{said}"
    );
    let _: () = writes
        .hset(ks.layout_key(), "dedup:likes", "counter")
        .await
        .expect("HSET");
    let record: std::collections::HashMap<String, String> =
        writes.hgetall(ks.layout_key()).await.expect("HGETALL");
    assert_eq!(record.get("likes").map(String::as_str), Some("shares"));
    let fence: Option<String> = writes.hget(ks.fence_key(0), "~likes").await.expect("HGET");
    assert_eq!(fence, None, "a dry run marks nothing");
    assert_eq!(totals(&reader).await, expected, "read after the dry runs");

    let said = tally(&[]);
    assert!(
        said.contains(&format!("sets 400, likes {likes}")) && said.ends_with(" 0\n"),
        "{said}"
    );
    assert_eq!(totals(&reader).await, expected, "read after the move");
    for node in 0..3 {
        let mut node_conn = tally_tests::connect(&cluster.node_url(node)).await;
        let members: Vec<String> = node_conn
            .keys(format!("{prefix}:*:m:*"))
            .await
            .expect("KEYS");
        assert_eq!(
            members,
            Vec::<String>::new(),
            "node {node}: no member set left"
        );
    }
    for (counter, total) in &expected {
        let group = ks.group_for_counter(counter);
        let size: i64 = writes
            .scard(ks.count_set_key(group, counter))
            .await
            .expect("SCARD");
        let share: i64 = writes
            .get(ks.counter_key(group, counter))
            .await
            .expect("GET");
        // The likes in the count set, none left in the share; the other group's share kept.
        let id: u32 = counter["likes:post:".len()..].parse().expect("id");
        assert_eq!(size, i64::from(id % 9 + 1), "{counter}");
        assert_eq!(share, 0, "{counter}");
        assert_eq!(
            *total - size,
            if id.is_multiple_of(5) { 3 } else { 0 },
            "{counter}"
        );
    }
    for group in 0..16 {
        let fence: std::collections::HashMap<String, String> =
            writes.hgetall(ks.fence_key(group)).await.expect("HGETALL");
        assert_eq!(fence.get("likes.events/0").map(String::as_str), Some("6"));
        assert_eq!(fence.get("~likes").map(String::as_str), Some("sets"));
    }
    let record: std::collections::HashMap<String, String> =
        writes.hgetall(ks.layout_key()).await.expect("HGETALL");
    assert_eq!(record.get("likes").map(String::as_str), Some("sets"));
    assert_eq!(record.get("dedup:likes").map(String::as_str), Some("sets"));
    assert!(tally(&[]).contains("already"));
}

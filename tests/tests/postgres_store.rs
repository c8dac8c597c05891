//! PostgreSQL as the store of record (`--store postgres`), against a real private PostgreSQL
//! server, a real Kafka and real aggregator processes: the schema is created and migrated by the
//! aggregator, and every counter's rows sum exactly to what Kafka acknowledged, through SIGKILLs
//! of the aggregator mid-stream and a zombie that keeps writing after it lost its partitions.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tally_aggregator::pg_schema::{self, Schema};
use tally_cli::load::LoadSpec;
use tally_tests::postgres::PgServer;
use tally_tests::scenarios::{Store, sigkill_storm, zombie_is_fenced_off};
use tally_tests::{
    AggregatorSetup, ApiServer, RedisServer, TempDir, binary, finish_load, seed, serial,
    start_load, stream_until, unique, wait_for_totals,
};

/// Waits until the rows in PostgreSQL sum to `expected` for every counter of `setup`'s
/// deployment; panics with the largest differences otherwise.
async fn wait_for_postgres_totals(
    redis_url: &str,
    url: &str,
    setup: &AggregatorSetup,
    expected: &HashMap<String, i64>,
) {
    let reader = Store::postgres(redis_url, url)
        .reader(setup.keyspace())
        .await;
    wait_for_totals(&reader, expected, Duration::from_secs(120)).await;
}

fn spec(events: u64, rate: u64, seed: u64) -> LoadSpec {
    LoadSpec {
        events,
        counters: 5_000,
        rate,
        max_delta: 5,
        negative_share: 0.3,
        seed,
        ..LoadSpec::default()
    }
}

#[tokio::test]
async fn exactly_once_into_postgres_through_sigkills() {
    let _serial = serial().await;
    let dir = TempDir::new("tally-pg-store");
    let redis = RedisServer::start().await;
    let pg = PgServer::start().await;
    let (url, redis_url) = (pg.url(), redis.url());
    let store = Store::postgres(&redis_url, &url);
    let (setup, totals) = sigkill_storm("pg-kills", store, "partition", 500_000, 10).await;

    // The schema is the aggregator's own, at its latest version.
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connects");
    tokio::spawn(connection);
    let versions: Vec<i32> = client
        .query(
            &format!(
                "SELECT version FROM \"{}\".tally_migrations ORDER BY version",
                setup.key_prefix
            ),
            &[],
        )
        .await
        .expect("migrations table")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let latest = pg_schema::MIGRATIONS.len() as i32;
    assert_eq!(versions, (1..=latest).collect::<Vec<_>>());

    // `tally get --store postgres` prints the same totals. Counters whose total is not 0: a
    // cached read stores no entry for a 0 it finds with nothing cached (`common::cache`), and
    // deltas of -5 to +5 leave some counters at 0 (one did in a CI rehearsal).
    let mut sample: Vec<(&String, &i64)> =
        (totals.iter()).filter(|(_, t)| **t != 0).take(3).collect();
    sample.sort();
    let out = std::process::Command::new(binary("tally"))
        .args([
            "get",
            "--store",
            "postgres",
            "--postgres-url",
            &url,
            "--key-prefix",
            &setup.key_prefix,
        ])
        .args(sample.iter().map(|(c, _)| c.as_str()))
        .output()
        .expect("tally get runs");
    let want: String = sample.iter().map(|(c, t)| format!("{c} {t}\n")).collect();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        want,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Through Redis as the cache of totals: `tally get --cached` reads the rows on a miss and
    // leaves the shared cache entries in Redis.
    let cached = std::process::Command::new(binary("tally"))
        .args([
            "get",
            "--cached",
            "--store",
            "postgres",
            "--postgres-url",
            &url,
        ])
        .args([
            "--key-prefix",
            &setup.key_prefix,
            "--redis-url",
            &redis.url(),
        ])
        .args(sample.iter().map(|(c, _)| c.as_str()))
        .output()
        .expect("tally get runs");
    assert_eq!(
        String::from_utf8_lossy(&cached.stdout),
        want,
        "{}",
        String::from_utf8_lossy(&cached.stderr)
    );
    let mut conn = tally_tests::connect(&redis.url()).await;
    for (counter, total) in &sample {
        let entry: Option<String> = redis::cmd("GET")
            .arg(setup.keyspace().cache_key(counter))
            .query_async(&mut conn)
            .await
            .expect("GET");
        let entry = entry.unwrap_or_else(|| panic!("{counter} cached in Redis"));
        assert!(
            entry.starts_with(&format!("{total}:")),
            "{counter}: {entry}"
        );
    }

    // And the HTTP API reads the same through it.
    let server = ApiServer::start(
        &[
            "--store",
            "postgres",
            "--postgres-url",
            &url,
            "--key-prefix",
            &setup.key_prefix,
        ],
        &[("TALLY_REDIS_URL", &redis.url())],
        &dir.path().join("server.log"),
    )
    .await;
    for (counter, total) in &sample {
        for query in ["", "?exact=true"] {
            let (status, body) = server
                .call("GET", &format!("/v1/counters/{counter}{query}"), None)
                .await;
            assert_eq!(
                (status, body["total"].as_i64()),
                (200, Some(**total)),
                "{counter}{query}: {body}"
            );
        }
        let (_, inspected) = server
            .call("GET", &format!("/v1/counters/{counter}/shares"), None)
            .await;
        let shares: i64 = (inspected["shares"].as_array().expect("shares").iter())
            .filter_map(|s| s["value"].as_i64())
            .sum();
        assert_eq!(shares, **total, "{inspected}");
    }
    assert!(!pg.log().contains("deadlock detected"), "{}", pg.log());
}

/// An aggregator stopped (SIGSTOP) while it holds buffered events, its partitions taken over by
/// another member, then woken: its late transactions must be refused by the fences.
#[tokio::test]
async fn a_zombie_is_fenced_off_in_postgres() {
    let _serial = serial().await;
    let redis = RedisServer::start().await;
    let pg = PgServer::start().await;
    let url = pg.url();
    zombie_is_fenced_off(
        "pg-zombie",
        Store::postgres(&redis.url(), &url),
        "partition",
    )
    .await;
}

/// Waits until `aggregator` has made 8 more flushes durable.
async fn progress(aggregator: &tally_tests::AggregatorProcess) {
    aggregator
        .wait_more_flushes(8.0, Duration::from_secs(60))
        .await;
}

/// Opens connections named `hog` until PostgreSQL refuses one for want of slots; returns them.
async fn take_free_connections(url: &str) -> Vec<tokio_postgres::Client> {
    let hog_url = format!("{url}?application_name=hog");
    let mut hogs = Vec::new();
    loop {
        let attempt = tokio_postgres::connect(&hog_url, tokio_postgres::NoTls).await;
        match attempt {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                hogs.push(client);
            }
            Err(e) => {
                let code = e.code();
                let full = code == Some(&tokio_postgres::error::SqlState::TOO_MANY_CONNECTIONS);
                assert!(full, "a connection refused for another reason: {e}");
                return hogs;
            }
        }
    }
}

/// Takes every connection slot for other clients: keeps the aggregator's role (`agg`) from
/// connecting, ends its sessions, fills every slot, and lets the role connect again, so that
/// its next connection is refused for want of slots ("sorry, too many clients already").
/// `admin` is the test's own session.
async fn take_every_connection(
    url: &str,
    admin: &tokio_postgres::Client,
) -> Vec<tokio_postgres::Client> {
    let run = |sql: &'static str| async move { admin.batch_execute(sql).await.expect(sql) };
    run("ALTER ROLE agg CONNECTION LIMIT 0").await;
    run("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'agg'").await;
    let hogs = take_free_connections(url).await;
    run("ALTER ROLE agg CONNECTION LIMIT -1").await;
    hogs
}

/// PostgreSQL itself failing under a live stream, with a pool of two connections for eight
/// partitions: the database read-only for 6 s, every connection slot held by other clients for
/// 6 s, a fast shutdown and restart, statements cancelled by the statement timeout while
/// another session holds a lock on the shares, and a SIGKILL of the postmaster (crash recovery on
/// restart). Every failed flush is retried, no event is dead-lettered, and the totals end
/// exact.
#[tokio::test]
async fn postgres_restarts_statement_timeouts_and_a_small_pool_lose_nothing() {
    let _serial = serial().await;
    let seed = seed();
    let dir = TempDir::new("tally-pg-faults");
    let redis = RedisServer::start().await;
    // Few sessions, so that other clients can take them all in no time.
    let mut pg = PgServer::start_with_max_connections(16).await;
    let mut setup = AggregatorSetup::create("pg-faults", &redis.url(), 8).await;
    // The default cap on retry delays, whose recovery time the test measures.
    setup.retry_max_backoff_ms = 2_000;
    // The aggregator logs in as a role of its own (not a superuser), so that the test can keep
    // it out for a moment.
    let (admin, connection) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .expect("connects");
    tokio::spawn(connection);
    admin
        .batch_execute("CREATE ROLE agg LOGIN; GRANT CREATE ON DATABASE postgres TO agg")
        .await
        .expect("role");
    let url = pg.url().replace("tally@", "agg@");
    let flags = [
        "--store",
        "postgres",
        "--postgres-url",
        &url,
        "--postgres-pool-size",
        "2",
        "--postgres-statement-timeout-ms",
        "500",
    ];
    let mut aggregator = setup.spawn(dir.path(), &flags);
    let sending = Arc::new(AtomicBool::new(true));
    let (topic, flag) = (setup.topic.clone(), sending.clone());
    let sent = tokio::spawn(async move { stream_until(&topic, 8_000, 5_000, seed, flag).await });
    progress(&aggregator).await;
    let refused = |what: &'static str| {
        let aggregator = &aggregator;
        async move {
            let errors = aggregator.metric("tally_redis_errors_total").await;
            tokio::time::sleep(Duration::from_secs(6)).await;
            let after = aggregator.metric("tally_redis_errors_total").await;
            assert!(
                after > errors,
                "{what}: no flush failed ({errors:?} -> {after:?})"
            );
        }
    };

    // 1. Read-only for 6 s (the retries' backoff reaches its 2 s cap after about 4): every
    // session's next transaction is read-only (25006).
    // One statement per call: ALTER SYSTEM runs outside a transaction block.
    let run = |sql: &'static str| {
        let admin = &admin;
        async move { admin.batch_execute(sql).await.expect(sql) }
    };
    run("SET default_transaction_read_only = off").await;
    run("ALTER SYSTEM SET default_transaction_read_only = on").await;
    run("SELECT pg_reload_conf()").await;
    refused("read-only").await;
    run("ALTER SYSTEM RESET default_transaction_read_only").await;
    run("SELECT pg_reload_conf()").await;
    let mut slow = Vec::new();
    slow.extend(recovered("read-only", &aggregator, &setup.topic).await);

    // 2. Every connection slot held by other clients for 6 s (53300), the aggregator's
    // sessions ended.
    let hogs = take_every_connection(&pg.url(), &admin).await;
    eprintln!("{} connections held by other clients", hogs.len());
    refused("no connection slot").await;
    drop(hogs);
    slow.extend(recovered("no connection slot", &aggregator, &setup.topic).await);

    // 3. A fast shutdown: every session is disconnected; then the server comes back.
    pg.stop_fast();
    eprintln!("PostgreSQL stopped (fast shutdown)");
    aggregator
        .wait_metric("tally_redis_errors_total", 1.0, Duration::from_secs(30))
        .await;
    pg.start_again().await;
    progress(&aggregator).await;

    // 4. Statements cancelled by the timeout: another session locks the shares table until a
    // flush has failed on it.
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connects");
    tokio::spawn(connection);
    let errors = aggregator
        .metric("tally_redis_errors_total")
        .await
        .unwrap_or(0.0);
    client
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE \"{}\".shares IN ACCESS EXCLUSIVE MODE",
            setup.key_prefix
        ))
        .await
        .expect("lock taken");
    aggregator
        .wait_metric(
            "tally_redis_errors_total",
            errors + 1.0,
            Duration::from_secs(30),
        )
        .await;
    client.batch_execute("COMMIT").await.expect("lock released");
    assert!(
        pg.log()
            .contains("canceling statement due to statement timeout"),
        "a statement was cancelled by the timeout"
    );
    progress(&aggregator).await;

    // 5. The postmaster SIGKILLed: crash recovery on restart.
    pg.kill();
    eprintln!("PostgreSQL postmaster SIGKILLed");
    pg.start_again().await;
    progress(&aggregator).await;

    sending.store(false, Ordering::Relaxed);
    let sent = sent.await.expect("stream");
    wait_for_postgres_totals(&redis.url(), &url, &setup, &sent).await;
    let failed = aggregator
        .metric("tally_redis_errors_total")
        .await
        .unwrap_or(0.0);
    eprintln!("flush attempts failed and retried: {failed}");
    let dead = (aggregator.metric("tally_events_dead_lettered_total").await).unwrap_or(0.0);
    assert_eq!(dead, 0.0, "valid events were dead-lettered");
    assert!(
        slow.is_empty(),
        "not durable within 5 s of PostgreSQL taking writes again: {slow:?}"
    );
    aggregator.stop_gracefully().await;
}

/// How long after `fault` ended everything sent before was durable, if longer than 5 s.
async fn recovered(
    fault: &'static str,
    aggregator: &tally_tests::AggregatorProcess,
    topic: &str,
) -> Option<(&'static str, Duration)> {
    let lifted = std::time::Instant::now();
    let ends = tally_tests::end_offsets(topic, 8).await;
    aggregator
        .wait_durable(&ends, Duration::from_secs(60))
        .await;
    let took = lifted.elapsed();
    eprintln!("{fault}: everything sent before it ended was durable {took:?} after");
    (took > Duration::from_secs(5)).then_some((fault, took))
}

/// Direct writes into the rows: a hot counter written by 16 tasks as fast as they can, with the
/// shard monitor raising its shard count, spreads over several shard rows and sums exactly to the
/// writes made; likes in a deduplicating direct namespace count once per actor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_writes_go_to_random_shard_rows_and_likes_count_once() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use tally_aggregator::tasks::shard_monitor::ShardMonitor;
    use tally_common::{Keyspace, Namespaces, Reader, RedisConn, pg};
    use tally_producer::DirectWriter;

    let _serial = serial().await;
    let redis = RedisServer::start().await;
    let pg_server = PgServer::start().await;
    let url = pg_server.url();
    let prefix = unique("pg-direct");
    let keyspace = Keyspace::new(prefix.clone(), 16).expect("keyspace");
    let options = pg::PoolOptions {
        password: None,
        size: 8,
        statement_timeout: None,
    };
    let pool = pg::pool(&url, options).expect("pool");
    let schema = Schema::new(&prefix).expect("schema");
    pg::migrate(&pool, &schema).await.expect("migrated");
    let store = pg::PgStore::new(pool, schema);
    let namespaces = Arc::new(
        Namespaces::from_toml(
            "[namespaces.views]\nwrite_path = \"direct\"\n\n[namespaces.hearts]\nwrite_path = \"direct\"\ndedup = true\n",
        )
        .expect("namespaces"),
    );
    let conn = RedisConn::connect(&redis.url()).await.expect("redis");
    let cancel = tokio_util::sync::CancellationToken::new();
    let monitor = ShardMonitor {
        conn: conn.clone(),
        keyspace: keyspace.clone(),
        threshold: 200,
        metrics: None,
    };
    let monitor_task = tokio::spawn(monitor.run(cancel.clone()));
    let writer = DirectWriter::new(conn.clone(), keyspace.clone(), namespaces.clone())
        .with_store(store.clone());

    let counter = "views:video:hot";
    let written = Arc::new(AtomicU64::new(0));
    let stop = std::time::Instant::now() + Duration::from_secs(5);
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (writer, written) = (writer.clone(), written.clone());
            tokio::spawn(async move {
                while std::time::Instant::now() < stop {
                    writer.add(counter, 1).await.expect("direct write");
                    written.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("writer task");
    }
    let written = written.load(Ordering::Relaxed) as i64;
    let raised = writer.shard_count(counter).await;
    cancel.cancel();
    let _ = monitor_task.await;

    let reader = Reader::new(conn, keyspace).with_store(Arc::new(store));
    assert_eq!(reader.get(counter).await.expect("total"), written);
    let rows = reader.shares(counter).await.expect("shares");
    let used = rows.iter().flatten().count();
    eprintln!("{written} direct writes; shard count raised to {raised}; {used} shard rows written");
    assert!(
        raised > 1,
        "the shard monitor raised the count ({written} writes in 5 s)"
    );
    assert!(used > 1, "writes spread over several shard rows: {rows:?}");

    // Likes in a direct namespace that deduplicates.
    for (actor, like, counted) in [
        ("u1", true, true),
        ("u1", true, false),
        ("u2", true, true),
        ("u2", false, true),
        ("u3", false, false),
    ] {
        let changed = if like {
            writer.like("hearts:post:1", actor).await
        } else {
            writer.unlike("hearts:post:1", actor).await
        }
        .expect("direct like");
        assert_eq!(changed, counted, "{actor} like={like}");
    }
    assert_eq!(reader.get("hearts:post:1").await.expect("total"), 1);
    assert!(
        reader
            .has_liked("hearts:post:1", "u1")
            .await
            .expect("liked")
    );
    assert!(
        !reader
            .has_liked("hearts:post:1", "u2")
            .await
            .expect("liked")
    );
}

/// A client of the PostgreSQL at `url`, and the value it gave `big:1`'s share in group 0 of
/// the deployment `prefix`: 10 below `i64::MAX`, so that +100 would overflow it.
async fn near_full_share(url: &str, prefix: &str) -> (tokio_postgres::Client, i64) {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connects");
    tokio::spawn(connection);
    let near_max = i64::MAX - 10;
    client
        .execute(
            &format!("INSERT INTO \"{prefix}\".shares VALUES ('big:1', 0, $1)"),
            &[&near_max],
        )
        .await
        .expect("near-full share");
    (client, near_max)
}

/// Bad input with this store, as with Redis: a share that would pass 64 bits is refused, not
/// wrapped (its deltas dead-lettered as `overflow`), an undecodable message is dead-lettered,
/// and every other total is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflow_is_refused_and_bad_messages_dead_lettered_with_postgres() {
    use rdkafka::ClientConfig;
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let dir = TempDir::new("tally-pg-poison");
    let redis = RedisServer::start().await;
    let pg = PgServer::start().await;
    let url = pg.url();
    // One partition: its shard group is 0, where the near-full share is put.
    let setup = AggregatorSetup::create("pg-poison", &redis.url(), 1).await;
    let mut aggregator = setup.spawn(dir.path(), &["--store", "postgres", "--postgres-url", &url]);
    aggregator
        .wait_metric("tally_assigned_partitions", 1.0, Duration::from_secs(60))
        .await;
    let (client, near_max) = near_full_share(&url, &setup.key_prefix).await;

    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", tally_tests::brokers())
        .create()
        .expect("producer");
    let mut expected: HashMap<String, i64> = HashMap::new();
    let mut deliveries = Vec::new();
    for i in 0..2_000i64 {
        let payload = match i % 50 {
            0 => r#"{"counter":"big:1","delta":100}"#.to_owned(),
            1 => r#"{"counter": not json"#.to_owned(),
            _ => {
                let (counter, delta) = (format!("ok:{}", i % 20), 1 + i % 3);
                *expected.entry(counter.clone()).or_default() += delta;
                format!(r#"{{"counter":"{counter}","delta":{delta}}}"#)
            }
        };
        let record = FutureRecord::<(), String>::to(&setup.topic).payload(&payload);
        deliveries.push(tally_tests::enqueue_raw(&plain, record));
    }
    tally_tests::assert_delivered(deliveries).await;
    wait_for_postgres_totals(&redis.url(), &url, &setup, &expected).await;
    let big: i64 = client
        .query_one(
            &format!(
                "SELECT value FROM \"{}\".shares WHERE counter = 'big:1'",
                setup.key_prefix
            ),
            &[],
        )
        .await
        .expect("big:1")
        .get(0);
    assert_eq!(big, near_max, "the overflowing deltas were not applied");
    // The 40 undecodable messages one by one; the refused deltas of big:1 as each flush summed
    // them (one dead letter per refused delta, at least one).
    let letters = tally_tests::read_dead_letters(&setup.dead_letter_topic, 41);
    let count = |reason: &str| letters.iter().filter(|l| l.reason == reason).count();
    assert_eq!(
        count("undecodable"),
        40,
        "undecodable messages dead-lettered"
    );
    assert!(count("overflow") >= 1, "the overflow dead-lettered");
    assert!(
        (letters.iter())
            .filter(|l| l.reason == "overflow")
            .all(|l| String::from_utf8_lossy(&l.payload).contains("big:1")),
        "only big:1 overflowed"
    );
    assert!(aggregator.is_running());
    aggregator.stop_gracefully().await;
}

/// At-least-once into PostgreSQL: without faults, every event counts once, and a delta that
/// would take a share past 64 bits is refused (dead-lettered as `overflow`) while the rest of
/// its batch is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_into_postgres_counts_every_event() {
    use rdkafka::ClientConfig;
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let _serial = serial().await;
    let dir = TempDir::new("tally-pg-alo");
    let redis = RedisServer::start().await;
    let pg = PgServer::start().await;
    let url = pg.url();
    let setup = AggregatorSetup::create("pg-alo", &redis.url(), 4).await;
    let flags = [
        "--store",
        "postgres",
        "--postgres-url",
        &url,
        "--delivery",
        "at-least-once",
    ];
    let mut aggregator = setup.spawn(dir.path(), &flags);
    aggregator
        .wait_metric("tally_assigned_partitions", 4.0, Duration::from_secs(60))
        .await;
    // Partition 0 writes to shard group 0, where the near-full share is put.
    let (client, near_max) = near_full_share(&url, &setup.key_prefix).await;
    let shares = format!("\"{}\".shares", setup.key_prefix);

    let load = start_load(&setup.topic, spec(50_000, 0, seed()));
    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", tally_tests::brokers())
        .create()
        .expect("producer");
    let record = FutureRecord::<str, str>::to(&setup.topic)
        .payload(r#"{"counter":"big:1","delta":100}"#)
        .key("big:1")
        .partition(0);
    tally_tests::assert_delivered(vec![tally_tests::enqueue_raw(&plain, record)]).await;
    let sent = finish_load(load, 50_000).await;
    wait_for_postgres_totals(&redis.url(), &url, &setup, &sent.totals).await;
    let letters = tally_tests::read_dead_letters(&setup.dead_letter_topic, 1);
    assert_eq!(letters[0].reason, "overflow");
    assert!(String::from_utf8_lossy(&letters[0].payload).contains("big:1"));
    let big: i64 = client
        .query_one(
            &format!("SELECT value FROM {shares} WHERE counter = 'big:1'"),
            &[],
        )
        .await
        .expect("big:1")
        .get(0);
    assert_eq!(big, near_max, "the overflowing delta was not applied");
    assert!(aggregator.is_running());
    aggregator.stop_gracefully().await;
    let dead = tally_tests::end_offsets(&setup.dead_letter_topic, 1).await;
    assert_eq!(dead, vec![1], "one dead letter: the refused delta");
}

//! Fault: a Redis that refuses writes for a while, under a live stream, at default settings
//! (exactly-once). Two aggregators, one making its writes atomic with the Lua scripts (the
//! default) and one with `WATCH`/`MULTI`/`EXEC`, each counting its own stream into the same
//! Redis, live through five refusals in turn: out of memory
//! (`maxmemory` reached, `noeviction`) for 6 s, read-only (a replica of an unreachable primary,
//! as during a failover) for 6 s, a script busy for 5 s (`BUSY`), writes paused for 5 s, and an
//! ACL that takes `INCRBY` away for 6 s. Each outlasts the retries' backoff, which reaches its
//! 2 s cap after about 4 s. None of it is the events' fault: each refused flush is
//! retried whole until Redis takes it, no valid event is dead-lettered, the aggregator stays up,
//! everything sent before a refusal ends is durable within 5 s of its end, and every counter
//! ends exact. A `tally compact --loop` folds shares throughout, and outlives the refusals.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tally_tests::{
    AggregatorProcess, AggregatorSetup, RedisServer, TempDir, binary, connect_patient, end_offsets,
    free_port, seed, stream_until, wait_for_totals,
};

const PARTITIONS: i32 = 8;
const COUNTERS: u64 = 2_000;
const RATE: u64 = 2_000;
/// How soon after Redis takes writes again everything sent before must be durable.
const RECOVERY: Duration = Duration::from_secs(5);

/// One way for Redis to refuse writes: what starts it, what ends it, and for how long.
struct Refusal {
    name: &'static str,
    lasts: Duration,
    /// Whether the aggregator's writes fail with an error (rather than wait) meanwhile.
    errors: bool,
}

async fn run(conn: &mut redis::aio::MultiplexedConnection, args: &[&str]) {
    redis::cmd(args[0])
        .arg(&args[1..])
        .query_async::<redis::Value>(conn)
        .await
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
}

/// One aggregator counting its own stream.
struct Pipeline {
    setup: AggregatorSetup,
    aggregator: AggregatorProcess,
    sending: Arc<AtomicBool>,
    sent: tokio::task::JoinHandle<HashMap<String, i64>>,
}

impl Pipeline {
    async fn start(name: &str, redis: &RedisServer, dir: &TempDir, atomicity: &str) -> Self {
        let mut setup = AggregatorSetup::create(name, &redis.url(), PARTITIONS).await;
        // The default cap on retry delays, whose recovery time the test measures.
        setup.retry_max_backoff_ms = 2_000;
        let aggregator = setup.spawn(dir.path(), &["--redis-atomicity", atomicity]);
        let sending = Arc::new(AtomicBool::new(true));
        let (topic, flag) = (setup.topic.clone(), sending.clone());
        let sent =
            tokio::spawn(async move { stream_until(&topic, RATE, COUNTERS, seed(), flag).await });
        Self {
            setup,
            aggregator,
            sending,
            sent,
        }
    }

    /// Stops the stream, waits until every counter is exact, and checks that nothing was
    /// dead-lettered and the aggregator is still up.
    async fn finish(mut self, redis: &RedisServer) -> AggregatorProcess {
        self.sending.store(false, Ordering::Relaxed);
        let totals = self.sent.await.expect("stream");
        let reader = redis.reader(self.setup.keyspace()).await;
        wait_for_totals(&reader, &totals, Duration::from_secs(60)).await;
        assert!(self.aggregator.is_running(), "the aggregator died");
        let dead = (self.aggregator)
            .metric("tally_events_dead_lettered_total")
            .await
            .unwrap_or(0.0);
        assert_eq!(dead, 0.0, "valid events were dead-lettered");
        assert_eq!(
            end_offsets(&self.setup.dead_letter_topic, 1).await,
            vec![0],
            "the dead-letter topic is empty"
        );
        self.aggregator
    }
}

/// Lives through `refusal` under the streams: starts it, waits it out, ends it, and returns how
/// long after its end everything each pipeline sent before was durable.
async fn endure(refusal: &Refusal, redis: &RedisServer, pipelines: &[Pipeline]) -> Vec<Duration> {
    let mut conn = tally_tests::connect(&redis.url()).await;
    let mut errors_before = Vec::new();
    for p in pipelines {
        errors_before.push(p.aggregator.metric("tally_redis_errors_total").await);
    }
    let busy = match refusal.name {
        "out of memory" => {
            run(&mut conn, &["CONFIG", "SET", "maxmemory", "1"]).await;
            None
        }
        "read-only" => {
            let nowhere = free_port().to_string();
            run(&mut conn, &["REPLICAOF", "127.0.0.1", &nowhere]).await;
            None
        }
        "busy script" => {
            // A script that spins for `lasts`: past `busy-reply-threshold` (1 s, set by the
            // test) every other client is answered BUSY until it ends.
            let mut spinner =
                connect_patient(&redis.url(), refusal.lasts + Duration::from_secs(10)).await;
            let ms = refusal.lasts.as_millis().to_string();
            Some(tokio::spawn(async move {
                let script = "local t0 = redis.call('TIME') \
                    local deadline = t0[1] * 1000 + math.floor(t0[2] / 1000) + tonumber(ARGV[1]) \
                    while true do \
                      local t = redis.call('TIME') \
                      if t[1] * 1000 + math.floor(t[2] / 1000) >= deadline then return 'done' end \
                    end";
                redis::cmd("EVAL")
                    .arg(script)
                    .arg(0)
                    .arg(ms)
                    .query_async::<String>(&mut spinner)
                    .await
                    .expect("the busy script ran")
            }))
        }
        "paused writes" => {
            let ms = refusal.lasts.as_millis().to_string();
            run(&mut conn, &["CLIENT", "PAUSE", &ms, "WRITE"]).await;
            None
        }
        "no INCRBY" => {
            run(&mut conn, &["ACL", "SETUSER", "default", "-incrby"]).await;
            None
        }
        other => unreachable!("{other}"),
    };
    tokio::time::sleep(refusal.lasts).await;
    if refusal.errors {
        for (p, before) in pipelines.iter().zip(errors_before) {
            let errors = p.aggregator.metric("tally_redis_errors_total").await;
            assert!(
                errors > before,
                "{}: {} met no refusal ({before:?} -> {errors:?})",
                refusal.name,
                p.setup.topic
            );
        }
    }
    match refusal.name {
        "out of memory" => run(&mut conn, &["CONFIG", "SET", "maxmemory", "0"]).await,
        "read-only" => run(&mut conn, &["REPLICAOF", "NO", "ONE"]).await,
        "no INCRBY" => run(&mut conn, &["ACL", "SETUSER", "default", "+incrby"]).await,
        _ => {}
    }
    if let Some(busy) = busy {
        assert_eq!(busy.await.expect("join"), "done");
    }
    let lifted = std::time::Instant::now();
    let mut ends = Vec::new();
    for p in pipelines {
        ends.push(end_offsets(&p.setup.topic, PARTITIONS).await);
    }
    let mut took = Vec::new();
    for (p, ends) in pipelines.iter().zip(ends) {
        p.aggregator
            .wait_durable(&ends, Duration::from_secs(60))
            .await;
        let after = lifted.elapsed();
        eprintln!(
            "{}: everything {} sent before it ended was durable {after:?} after",
            refusal.name, p.setup.topic
        );
        took.push(after);
    }
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_refuses_writes_for_a_while_costs_no_event() {
    let dir = TempDir::new("tally-refusals");
    let redis = RedisServer::start().await;
    // A busy script is answered BUSY after 1 s (5 s by default), so a short one is a refusal.
    let mut conn = tally_tests::connect(&redis.url()).await;
    run(
        &mut conn,
        &["CONFIG", "SET", "busy-reply-threshold", "1000"],
    )
    .await;
    let mut pipelines = [
        Pipeline::start("refusals-scripts", &redis, &dir, "scripts").await,
        Pipeline::start("refusals-transactions", &redis, &dir, "transactions").await,
    ];
    for p in &pipelines {
        (p.aggregator)
            .wait_metric("tally_flushes_total", 8.0, Duration::from_secs(60))
            .await;
    }
    // A compactor folding the scripts pipeline's shares the whole time: a pass the store
    // refuses is retried, not the end of `--loop`.
    let ks = pipelines[0].setup.keyspace();
    let mut compactor = std::process::Command::new(binary("tally"))
        .args(["compact", "--loop", "--cold-after-ms", "0"])
        .args(["--interval-ms", "200"])
        .args(["--redis-url", &redis.url(), "--key-prefix", ks.prefix()])
        .stdout(std::fs::File::create(dir.path().join("compact.out")).expect("log file"))
        .stderr(std::fs::File::create(dir.path().join("compact.log")).expect("log file"))
        .spawn()
        .expect("tally compact starts");

    let refusals = [
        Refusal {
            name: "out of memory",
            lasts: Duration::from_secs(6),
            errors: true,
        },
        Refusal {
            name: "read-only",
            lasts: Duration::from_secs(6),
            errors: true,
        },
        Refusal {
            name: "busy script",
            lasts: Duration::from_secs(5),
            errors: true,
        },
        Refusal {
            name: "paused writes",
            lasts: Duration::from_secs(5),
            errors: false,
        },
        Refusal {
            name: "no INCRBY",
            lasts: Duration::from_secs(6),
            errors: true,
        },
    ];
    let mut slow = Vec::new();
    for refusal in &refusals {
        let took = endure(refusal, &redis, &pipelines).await;
        slow.extend(
            (took.into_iter())
                .filter(|t| *t > RECOVERY)
                .map(|t| (refusal.name, t)),
        );
        for p in pipelines.iter_mut() {
            let alive = p.aggregator.is_running();
            assert!(alive, "an aggregator died: {}", p.aggregator.log_tail(30));
        }
    }
    let compacting = compactor.try_wait().expect("try_wait");
    assert!(
        compacting.is_none(),
        "tally compact --loop ended: {compacting:?}"
    );
    let _ = compactor.kill();
    let _ = compactor.wait();
    let [scripts, transactions] = pipelines;
    let scripts = scripts.finish(&redis).await;
    let transactions = transactions.finish(&redis).await;
    assert!(
        scripts.log().contains("may not run INCRBY"),
        "the scripts' log names the missing permission"
    );
    assert!(
        transactions.log().contains("'incrby'"),
        "the transactions' log names the missing permission"
    );
    assert!(
        slow.is_empty(),
        "not durable within {RECOVERY:?} of Redis taking writes again: {slow:?}"
    );
}

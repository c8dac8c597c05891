//! The aggregator and a reader under exactly the least-privilege Redis ACL users of
//! `deploy/redis/users.acl`, with their passwords from the environment and a file, never flags:
//! every total exact, likes deduplicated, reads through the shared cache and `top`, no
//! permission error in the aggregator's log, and neither password in its log or metrics. The
//! users can do nothing else: the reader cannot write a counter, the aggregator cannot touch
//! another prefix's keys or run admin commands.

use std::sync::Arc;
use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_common::window::Window;
use tally_common::{CachedReader, Namespaces, Reader, RedisConn};
use tally_producer::{Producer, ProducerConfig};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, brokers, connect, eventually, finish_load, serial,
    start_load, wait_for_totals,
};

const AGGREGATOR_PASSWORD: &str = "aggregator-Pa55:word/with@signs";
const READER_PASSWORD: &str = "reader-pa55word";

/// Creates the users of `deploy/redis/users.acl` on `redis`, for keys under `prefix`.
async fn create_users(redis: &RedisServer, prefix: &str) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/redis/users.acl");
    let text = std::fs::read_to_string(path).expect("users.acl");
    let mut admin = connect(&redis.url()).await;
    let mut created = 0;
    for line in text.lines().filter(|l| l.starts_with("user ")) {
        let mut words = line.split_whitespace().skip(1);
        let name = words.next().expect("user name");
        let password = match name {
            "tally-aggregator" => AGGREGATOR_PASSWORD,
            "tally-reader" => READER_PASSWORD,
            other => panic!("unexpected user {other}"),
        };
        let mut command = redis::cmd("ACL");
        command.arg("SETUSER").arg(name);
        for rule in words {
            let rule = rule
                .replace(">CHANGE-ME", &format!(">{password}"))
                .replace("~tally:", &format!("~{prefix}:"));
            command.arg(rule);
        }
        command
            .query_async::<()>(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("ACL SETUSER {name}: {e}"));
        created += 1;
    }
    assert_eq!(
        created, 2,
        "users.acl defines the aggregator and the reader"
    );
}

/// Whether Redis refused the command for lack of permission (NOPERM).
fn is_noperm(result: redis::RedisResult<redis::Value>) -> bool {
    match result {
        Err(e) => e.to_string().to_ascii_uppercase().contains("NOPERM"),
        Ok(v) => panic!("allowed, answered {v:?}"),
    }
}

/// Runs an aggregator in `atomicity` mode as the documented aggregator user, without
/// `+sinterstore` if `without_sinterstore` (the ACL before likes' sets were written outside the script).
async fn run_under_acl(atomicity: &str, without_sinterstore: bool) {
    let _serial = serial().await;
    let dir = TempDir::new("tally-acl");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("acl", &redis.url(), 4).await;
    create_users(&redis, &setup.key_prefix).await;
    if without_sinterstore {
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("tally-aggregator")
            .arg("-sinterstore")
            .exec_async(&mut connect(&redis.url()).await)
            .await
            .expect("ACL SETUSER -sinterstore");
    }
    let password_file = dir.path().join("redis-password");
    std::fs::write(&password_file, format!("{AGGREGATOR_PASSWORD}\n")).expect("written");
    let namespaces = dir.path().join("namespaces.toml");
    std::fs::write(
        &namespaces,
        "[namespaces.likes]\ndedup = true\n\
         [namespaces.clips]\nwindows = [\"1h\"]\n\
         [namespaces.polls]\nexpire_after = \"2s\"\n",
    )
    .expect("written");
    let aggregator = setup.spawn_with_env(
        dir.path(),
        &[
            "--namespaces",
            namespaces.to_str().expect("utf-8"),
            "--redis-atomicity",
            atomicity,
            "--trending-interval-ms",
            "500",
        ],
        &[
            ("TALLY_REDIS_USERNAME", "tally-aggregator"),
            (
                "TALLY_REDIS_PASSWORD_FILE",
                password_file.to_str().expect("utf-8"),
            ),
        ],
    );

    // Plain counts, and likes that deduplicate (SADD/SREM in the flush).
    let spec = LoadSpec {
        events: 30_000,
        counters: 300,
        counter_prefix: "views:video:".to_owned(),
        ..LoadSpec::default()
    };
    let report = finish_load(start_load(&setup.topic, spec), 30_000).await;
    let producer = Producer::new(&ProducerConfig::new(brokers(), &setup.topic)).expect("producer");
    for (like, actor) in [
        (true, "u1"),
        (true, "u1"),
        (true, "u2"),
        (false, "u2"),
        (true, "u3"),
    ] {
        if like {
            producer.like("likes:post:1", actor).await.expect("sent");
        } else {
            producer.unlike("likes:post:1", actor).await.expect("sent");
        }
    }

    // A windowed namespace (its buckets get their expiry in the flush) and one whose counters
    // expire (the idle index and the expirer's records).
    for counter in [
        "clips:video:1",
        "clips:video:1",
        "clips:video:2",
        "polls:q:1",
    ] {
        producer.add(counter, 1).await.expect("sent");
    }
    let sent_at = tally_common::event::now_ms();

    // Reads as the reader user.
    let reader_url = redis.url().replace(
        "redis://",
        &format!("redis://tally-reader:{READER_PASSWORD}@"),
    );
    let reader = Reader::new(
        RedisConn::connect(&reader_url)
            .await
            .expect("reader connects"),
        setup.keyspace(),
    );
    let mut expected = report.totals.clone();
    expected.insert("likes:post:1".to_owned(), 2);
    expected.insert("clips:video:1".to_owned(), 2);
    expected.insert("clips:video:2".to_owned(), 1);
    wait_for_totals(&reader, &expected, Duration::from_secs(60)).await;
    // A reader user of the ACL before snapshot reads (no `+multi +exec`) still reads exactly,
    // one pipeline at a time, once it may run `SCARD`.
    let mut admin = connect(&redis.url()).await;
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("older-reader")
        .arg("on")
        .arg(">older-pa55word")
        .arg(format!("%R~{}:*", setup.key_prefix))
        .arg(&["-@all", "+ping", "+get", "+mget", "+cluster|slots"])
        .exec_async(&mut admin)
        .await
        .expect("ACL SETUSER older-reader");
    let older = Reader::new(
        RedisConn::connect(
            &redis
                .url()
                .replace("redis://", "redis://older-reader:older-pa55word@"),
        )
        .await
        .expect("the older reader connects"),
        setup.keyspace(),
    );
    // It may not read the likes this deployment counts by their sets without `+scard`, and
    // says so rather than count them as none.
    let refused = older.get("likes:post:1").await;
    assert!(
        matches!(&refused, Err(e) if e.to_string().contains("grant it +scard")),
        "{refused:?}"
    );
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("older-reader")
        .arg("+scard")
        .exec_async(&mut admin)
        .await
        .expect("ACL SETUSER older-reader +scard");
    wait_for_totals(&older, &expected, Duration::from_secs(10)).await;
    let hour = Window {
        width_ms: 3_600_000,
        retention_ms: 3_600_000,
    };
    let in_the_hour = reader
        .window_sums(&["clips:video:1", "clips:video:2"], hour, 1, sent_at)
        .await
        .expect("window sums");
    assert_eq!(in_the_hour, vec![2, 1]);
    // The poll's counter is counted, then cleared once idle for 2 s.
    eventually(Duration::from_secs(30), "the idle poll cleared", || async {
        let expired = aggregator.metric("tally_counters_expired_total").await?;
        let shares = reader.shares("polls:q:1").await.ok()?;
        (expired == 1.0 && shares.iter().all(Option::is_none)).then_some(())
    })
    .await;
    // The likes land in several flushes (each was acknowledged before the next was sent), so a
    // total of 2 can be seen before the last ones (u1 and u2 counted, u2's unlike and u3's like
    // not yet): wait for the whole final state, which a wrong count never reaches.
    eventually(
        Duration::from_secs(30),
        "the likes' final state",
        || async {
            let liked = |actor| reader.has_liked("likes:post:1", actor);
            let state = (
                reader.get("likes:post:1").await.ok()?,
                liked("u1").await.ok()?,
                liked("u2").await.ok()?,
                liked("u3").await.ok()?,
            );
            (state == (2, true, false, true)).then_some(())
        },
    )
    .await;
    let cached = CachedReader::new(reader.clone(), Arc::new(Namespaces::default()));
    let (hot, _) = report.top(1)[0];
    assert_eq!(
        cached.get(hot).await.expect("cached get"),
        report.totals[hot]
    );
    let counters: Vec<&String> = report.totals.keys().collect();
    let many = cached.get_many(&counters).await.expect("get_many");
    assert_eq!(
        many.iter().sum::<i64>(),
        report.totals.values().sum::<i64>()
    );
    eventually(
        Duration::from_secs(30),
        "a trending top for views",
        || async {
            let top = reader.top("views", 3).await.expect("top");
            (!top.is_empty()).then_some(())
        },
    )
    .await;

    // Nothing else is allowed.
    let mut as_reader = connect(&reader_url).await;
    let counter_key = format!("{}:{{g0}}:c:views:video:1", setup.key_prefix);
    assert!(is_noperm(
        redis::cmd("INCRBY")
            .arg(&counter_key)
            .arg(1)
            .query_async(&mut as_reader)
            .await
    ));
    let aggregator_url = redis.url().replace(
        "redis://",
        "redis://tally-aggregator:aggregator-Pa55%3Aword%2Fwith%40signs@",
    );
    let mut as_aggregator = connect(&aggregator_url).await;
    assert!(is_noperm(
        redis::cmd("SET")
            .arg("someone-else:key")
            .arg(1)
            .query_async(&mut as_aggregator)
            .await
    ));
    assert!(is_noperm(
        redis::cmd("FLUSHALL").query_async(&mut as_aggregator).await
    ));
    assert!(is_noperm(
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("*")
            .query_async(&mut as_aggregator)
            .await
    ));

    // The aggregator never hit a permission error but the one that made it write the likes'
    // sets by the script alone, and never showed its password.
    let log = aggregator.log();
    let fell_back = log.contains("grant +sinterstore");
    assert_eq!(fell_back, without_sinterstore, "{log}");
    if !without_sinterstore {
        assert!(
            !log.contains("NOPERM"),
            "a permission error in the log:\n{log}"
        );
    }
    assert_eq!(
        aggregator.metric("tally_redis_errors_total").await,
        Some(0.0)
    );
    let metrics = tally_tests::http_get(aggregator.metrics_port(), "/metrics")
        .await
        .expect("metrics");
    for secret in [AGGREGATOR_PASSWORD, "aggregator-Pa55", "Pa55%3Aword"] {
        assert!(!log.contains(secret), "the password is in the log");
        assert!(!metrics.contains(secret), "the password is in /metrics");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_is_enough_for_scripts_and_nothing_more() {
    run_under_acl("scripts", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_is_enough_for_transactions_and_nothing_more() {
    run_under_acl("transactions", false).await;
}

/// The default: scripts, with the likes' sets written before the flush script in one
/// `MULTI`/`EXEC` (which takes `+sinterstore`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_is_enough_by_default_and_nothing_more() {
    run_under_acl("auto", false).await;
}

/// An ACL granted before the likes' sets were written outside the script: the first such write
/// is refused whole, and the script alone writes them from then on, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_without_sinterstore_has_the_script_write_the_likes() {
    run_under_acl("auto", true).await;
}

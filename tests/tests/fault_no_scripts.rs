//! Exactly-once on a Redis that refuses scripts. The aggregator connects as an ACL user without
//! `@scripting` and the default `redis_atomicity = auto`: its first script is refused (`NOPERM`)
//! and it switches to optimistic `WATCH`/`MULTI`/`EXEC` transactions. The fault scenarios then
//! run unchanged, and every counter ends exactly at the ground truth. Redis's own command
//! statistics show which path did the work: no script ran, and transactions did. A server that
//! stops running scripts while the aggregator runs has the batches after the switch cut for
//! transactions, as a start on such a server does.

use std::time::Duration;

use tally_aggregator::store::transactions::TRANSACTION_GROUP_ENTRIES;
use tally_cli::load::LoadSpec;
use tally_producer::{Producer, ProducerConfig};
use tally_tests::scenarios::{sigkill_storm, zombie_is_fenced_off};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, brokers, connect, connect_patient, finish_load, reader,
    start_load, wait_for_totals,
};

/// `(calls, rejected_calls)` of `command` from `INFO commandstats`.
async fn command_stats(redis: &RedisServer, command: &str) -> (u64, u64) {
    let mut conn = connect(&redis.url()).await;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .expect("INFO commandstats");
    let prefix = format!("cmdstat_{command}:");
    let Some(line) = info.lines().find(|l| l.starts_with(&prefix)) else {
        return (0, 0);
    };
    let field = |name: &str| {
        line[prefix.len()..]
            .split(',')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("calls"), field("rejected_calls"))
}

/// Asserts that scripts were tried and refused, and that transactions did the writing.
async fn assert_transactions_did_the_work(redis: &RedisServer) {
    let (evalsha, evalsha_refused) = command_stats(redis, "evalsha").await;
    let (eval, _) = command_stats(redis, "eval").await;
    let (exec, _) = command_stats(redis, "exec").await;
    let (watch, _) = command_stats(redis, "watch").await;
    eprintln!(
        "evalsha: {evalsha} run, {evalsha_refused} refused; eval: {eval} run; watch: {watch}; exec: {exec}"
    );
    assert_eq!(
        evalsha + eval,
        0,
        "a script ran on a server that refuses them"
    );
    assert!(evalsha_refused > 0, "auto mode never tried a script");
    assert!(watch > 0 && exec > 0, "no transaction ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_sigkills_without_scripts_count_every_event_once() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let url = redis.user_without_scripts().await;
    sigkill_storm("noscripts-sigkill", &url, "actor", 500_000, 10).await;
    assert_transactions_did_the_work(&redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_is_fenced_off_without_scripts() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let url = redis.user_without_scripts().await;
    zombie_is_fenced_off("noscripts-zombie", &url, "actor").await;
    assert_transactions_did_the_work(&redis).await;
}

/// Keys of each `WATCH` Redis logged (`SLOWLOG`, which keeps 31 arguments of a command and
/// counts the rest in a last "... (N more arguments)").
async fn watched_keys(redis: &RedisServer) -> Vec<usize> {
    // Every command of a catch-up is logged: the reply runs to tens of MB, longer to send on a
    // busy machine than a connection's default response timeout (it timed out once in CI).
    let mut conn = connect_patient(&redis.url(), Duration::from_secs(120)).await;
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(&mut conn)
        .await
        .expect("SLOWLOG GET");
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        other => format!("{other:?}"),
    };
    let mut watches = Vec::new();
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let Some(redis::Value::Array(args)) = fields.get(3) else {
            continue;
        };
        if args
            .first()
            .map(text)
            .is_none_or(|c| !c.eq_ignore_ascii_case("watch"))
        {
            continue;
        }
        let last = args.last().map(text).unwrap_or_default();
        let more = (last
            .strip_prefix("... (")
            .and_then(|r| r.strip_suffix(" more arguments)")))
        .and_then(|n| n.parse::<usize>().ok());
        watches.push(match more {
            Some(more) => args.len() - 2 + more,
            None => args.len() - 1,
        });
    }
    watches
}

/// What the aggregator logs when it switches from scripts to transactions.
const SWITCHED: &str = "switch to WATCH/MULTI/EXEC";

/// A server that stops running scripts while the aggregator runs (its ACL loses `@scripting`):
/// the next flush switches to transactions, and the batches after it are cut per group as a
/// start on such a server cuts them, rather than watching every counter of a batch in one
/// `WATCH` (whose cost grows with the square of its keys). Every total stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_refused_at_runtime_cut_the_next_batches_for_transactions() {
    let _serial = tally_tests::serial().await;
    let dir = TempDir::new("tally-flip");
    let redis = RedisServer::start().await;
    let mut admin = connect(&redis.url()).await;
    let user = |rule: &str| {
        let mut cmd = redis::cmd("ACL");
        cmd.arg(&[
            "SETUSER", "flip", "on", ">secret", "~*", "&*", "+@all", rule,
        ]);
        cmd
    };
    user("+@scripting")
        .exec_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    let url = redis.url().replace("redis://", "redis://flip:secret@");
    let setup = AggregatorSetup::create("flip", &url, 1).await;
    // Batches as large as the load, so that only the cut for transactions splits them.
    let aggregator = setup.spawn(
        dir.path(),
        &[
            "--max-batch-counters",
            "40000",
            "--catch-up-max-batch-counters",
            "40000",
        ],
    );
    let reader = reader(&redis.url(), setup.keyspace()).await;
    let producer = Producer::new(&ProducerConfig::new(brokers(), &setup.topic)).expect("producer");
    let mut expected = std::collections::HashMap::new();
    producer.add("views:warm:0", 1).await.expect("sent");
    expected.insert("views:warm:0".to_owned(), 1);
    wait_for_totals(&reader, &expected, Duration::from_secs(60)).await;
    // (Not `EVALSHA`'s calls: the start-up probe's `NOSCRIPT` reply counts as one too.)
    assert!(
        !aggregator.log().contains(SWITCHED),
        "the aggregator started on scripts"
    );

    // Scripts refused from now on: the next flush switches.
    user("-@scripting")
        .exec_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    producer.add("views:warm:1", 1).await.expect("sent");
    expected.insert("views:warm:1".to_owned(), 1);
    wait_for_totals(&reader, &expected, Duration::from_secs(60)).await;
    let (_, refused) = command_stats(&redis, "evalsha").await;
    assert!(refused > 0, "no script was refused");
    assert!(aggregator.log().contains(SWITCHED), "no switch was logged");

    // Every command logged from here on, with its arguments.
    for (name, value) in [
        ("slowlog-log-slower-than", "0"),
        ("slowlog-max-len", "1000000"),
    ] {
        redis::cmd("CONFIG")
            .arg(&["SET", name, value])
            .exec_async(&mut admin)
            .await
            .expect("CONFIG SET");
    }
    redis::cmd("SLOWLOG")
        .arg("RESET")
        .exec_async(&mut admin)
        .await
        .expect("SLOWLOG RESET");
    const EVENTS: u64 = 40_000;
    let spec = LoadSpec {
        events: EVENTS,
        distinct: true,
        actors: 0,
        counter_prefix: "views:flip:".to_owned(),
        ..LoadSpec::default()
    };
    let report = finish_load(start_load(&setup.topic, spec), EVENTS).await;
    expected.extend(report.totals.clone());
    wait_for_totals(&reader, &expected, Duration::from_secs(120)).await;
    redis::cmd("CONFIG")
        .arg(&["SET", "slowlog-log-slower-than", "10000"])
        .exec_async(&mut admin)
        .await
        .expect("CONFIG SET");

    let watches = watched_keys(&redis).await;
    let most = watches.iter().copied().max().unwrap_or(0);
    eprintln!(
        "{} WATCHes after the switch, the largest of {most} keys",
        watches.len()
    );
    // A group's write watches its fence, its ledger and a key per counter; a batch is cut once
    // one group holds TRANSACTION_GROUP_ENTRIES counters (the batch uncut held 40,000 counters,
    // 10,000 to a group of the default 4).
    assert!(
        (1..=TRANSACTION_GROUP_ENTRIES + 2).contains(&most),
        "a WATCH of {most} keys"
    );
    assert!(
        watches.len() * TRANSACTION_GROUP_ENTRIES >= EVENTS as usize,
        "{} WATCHes cannot have covered {EVENTS} counters",
        watches.len()
    );
}

//! Exactly-once on a Redis that refuses scripts. The aggregator connects as an ACL user without
//! `@scripting` and the default `redis_atomicity = auto`: its first script is refused (`NOPERM`)
//! and it switches to optimistic `WATCH`/`MULTI`/`EXEC` transactions. The fault scenarios then
//! run unchanged, and every counter ends exactly at the ground truth. Redis's own command
//! statistics show which path did the work: no script ran, and transactions did.

use tally_tests::scenarios::{sigkill_storm, zombie_is_fenced_off};
use tally_tests::{RedisServer, connect};

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

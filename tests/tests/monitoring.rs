//! tally's monitoring, checked for real: the alert rules pass `promtool check` and their unit
//! tests; a real Prometheus scrapes a running aggregator, sees exact counts, loads the rules
//! and fires the dead-letter alert; every query of the Grafana dashboard runs and returns data;
//! `/healthz` and `/readyz` answer as documented.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::Value;
use tally_cli::load::LoadSpec;
use tally_tests::prometheus::{Prometheus, promtool};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, eventually, finish_load, http_get_status, serial,
    start_load,
};

const EVENTS: u64 = 20_000;
const MALFORMED: usize = 3;

/// How many alerts `deploy/prometheus/alerts.yml` declares.
fn alerts_declared() -> usize {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/prometheus/alerts.yml"
    );
    let rules = std::fs::read_to_string(path).expect("alerts.yml");
    rules
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count()
}

#[test]
fn the_alert_rules_pass_promtool_check_and_their_unit_tests() {
    let checked = promtool(&["check", "rules", "alerts.yml"]);
    let found = format!("SUCCESS: {} rules found", alerts_declared());
    assert!(checked.contains(&found), "{checked}");
    let tested = promtool(&["test", "rules", "alerts.test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// Every query of `deploy/grafana/dashboards/tally.json`, with its variables filled in.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/dashboards/tally.json"
    );
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("expr");
            let expr = expr
                .replace("$__rate_interval", "30s")
                .replace("$job", ".*");
            queries.push((panel["title"].as_str().unwrap_or("").to_owned(), expr));
        }
    }
    queries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_exact_counts_and_runs_the_rules_and_the_dashboard() {
    let _serial = serial().await;
    let dir = TempDir::new("tally-monitoring");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("monitoring", &redis.url(), 4).await;
    let aggregator = setup.spawn(dir.path(), &["--trending-interval-ms", "1000"]);
    let prometheus = Prometheus::start(
        "tally-aggregator",
        &[format!("127.0.0.1:{}", aggregator.metrics_port())],
    )
    .await;

    // Prometheus has seen the dead-letter series at 0 (they exist from the start), so the
    // malformed messages below are an increase it can alert on.
    eventually(Duration::from_secs(30), "a first scrape", || async {
        let zero = prometheus
            .query(r#"tally_events_dead_lettered_total{reason="undecodable"} == 0"#)
            .await
            .ok()?;
        (!zero.is_empty()).then_some(())
    })
    .await;
    let spec = LoadSpec {
        events: EVENTS,
        counters: 500,
        ..LoadSpec::default()
    };
    finish_load(start_load(&setup.topic, spec), EVENTS).await;
    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", tally_tests::brokers())
        .create()
        .expect("plain producer");
    for i in 0..MALFORMED {
        plain
            .send(
                FutureRecord::<(), [u8]>::to(&setup.topic)
                    .payload(format!("not an event {i}").as_bytes()),
                Duration::from_secs(10),
            )
            .await
            .expect("malformed message sent");
    }

    // The counts, as Prometheus scraped them: exact.
    let total = EVENTS as f64 + MALFORMED as f64;
    eventually(
        Duration::from_secs(60),
        "Prometheus to see every event flushed",
        || async {
            let flushed = prometheus
                .value("sum(tally_events_flushed_total)")
                .await
                .ok()?;
            (flushed == total).then_some(())
        },
    )
    .await;
    assert_eq!(
        prometheus.value("sum(tally_events_consumed_total)").await,
        Ok(total)
    );
    assert_eq!(
        prometheus
            .value(r#"sum(tally_events_dead_lettered_total{reason="undecodable"})"#)
            .await,
        Ok(MALFORMED as f64)
    );
    assert_eq!(
        prometheus.value(r#"up{job="tally-aggregator"}"#).await,
        Ok(1.0)
    );
    assert_eq!(prometheus.value("tally_group_member").await, Ok(1.0));
    let info = prometheus.query("tally_build_info").await.expect("query");
    assert_eq!(info.len(), 1, "{info:?}");
    assert_eq!(info[0]["metric"]["delivery"], "exactly-once");

    // The rules: all loaded and evaluating, and the dead letters fired their alert.
    eventually(
        Duration::from_secs(30),
        "every rule to evaluate healthily",
        || async {
            let rules = prometheus.api("rules").await.ok()?;
            let rules: Vec<&Value> = rules["groups"]
                .as_array()?
                .iter()
                .flat_map(|g| g["rules"].as_array().into_iter().flatten())
                .collect();
            let all = rules.len() == alerts_declared();
            (all && rules.iter().all(|r| r["health"] == "ok")).then_some(())
        },
    )
    .await;
    eventually(
        Duration::from_secs(30),
        "the dead-letter alert to fire",
        || async {
            let firing = prometheus
                .query(r#"ALERTS{alertname="TallyDeadLettersAppearing", alertstate="firing"}"#)
                .await
                .ok()?;
            (firing.len() == 1 && firing[0]["metric"]["reason"] == "undecodable").then_some(())
        },
    )
    .await;
    // Pages are firing alerts. A pending one is not a page: TallyPartitionStuck is briefly
    // pending while a partition catches up with a durable-offset series only one sample old
    // (`changes` over one sample is 0), and its `for: 5m` is what keeps that from paging.
    let pages = prometheus
        .query(r#"ALERTS{severity="page", alertstate="firing"}"#)
        .await
        .expect("query");
    assert!(pages.is_empty(), "a healthy pipeline pages: {pages:?}");

    // The dashboard: every query is valid PromQL and has data from the live aggregator.
    for (title, expr) in dashboard_queries() {
        eventually(
            Duration::from_secs(30),
            &format!("data for {title:?}: {expr}"),
            || async {
                match prometheus.query(&expr).await {
                    Ok(result) => (!result.is_empty()).then_some(()),
                    Err(e) => panic!("dashboard panel {title:?} has a broken query {expr}: {e}"),
                }
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_group_membership_and_redis() {
    let _serial = serial().await;
    let dir = TempDir::new("tally-readyz");
    let mut redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("readyz", &redis.url(), 2).await;

    // No broker at all: alive, never a group member, so never ready.
    let lonely = setup.spawn(
        dir.path(),
        &["--kafka-option", "bootstrap.servers=127.0.0.1:1"],
    );
    let port = lonely.metrics_port();
    eventually(Duration::from_secs(20), "/healthz to answer", || async {
        matches!(http_get_status(port, "/healthz").await, Some((200, _))).then_some(())
    })
    .await;
    let watched = std::time::Instant::now();
    while watched.elapsed() < Duration::from_secs(3) {
        let (status, body) = http_get_status(port, "/readyz").await.expect("answers");
        assert_eq!(
            (status, body.trim()),
            (503, "not a member of the consumer group")
        );
    }
    drop(lonely);

    // A member whose Redis answers is ready; without Redis it is not; with Redis back it is.
    let aggregator = setup.spawn(dir.path(), &[]);
    let port = aggregator.metrics_port();
    let ready = |want: u16| async move {
        eventually(
            Duration::from_secs(30),
            &format!("/readyz to answer {want}"),
            || async {
                let (status, body) = http_get_status(port, "/readyz").await?;
                (status == want).then_some(body)
            },
        )
        .await
    };
    assert_eq!(ready(200).await.trim(), "ready");
    redis.kill().await;
    let why = ready(503).await;
    assert!(why.starts_with("redis:"), "{why}");
    eventually(
        Duration::from_secs(15),
        "tally_redis_up to drop to 0",
        || async { (aggregator.metric("tally_redis_up").await? == 0.0).then_some(()) },
    )
    .await;
    redis.start_again().await;
    ready(200).await;
    assert_eq!(
        aggregator
            .wait_metric("tally_redis_up", 1.0, Duration::from_secs(15))
            .await,
        1.0
    );
    assert_eq!(
        http_get_status(port, "/healthz").await,
        Some((200, "ok\n".to_owned()))
    );
}

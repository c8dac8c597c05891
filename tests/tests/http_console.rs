//! The operator console at `/`, in a real headless Chromium against the real stack (Kafka, an
//! aggregator, redis-server, tally-server): a person opens the page, looks a counter up, and
//! sees its total, its cache and shards, whether an actor liked it, the namespaces' top counters
//! and the pipeline caught up. The test saves a screenshot (`target/console.png`; also to the path
//! in `TALLY_SCREENSHOT_TO`, which is how `docs/console.png` is made).

use std::time::Duration;

use serde_json::json;
use tally_tests::browser::Browser;
use tally_tests::{Stack, eventually, serial};

/// A valid counter id (no whitespace, braces or control characters) that is also HTML.
const HTML_ID: &str = "views:<img/src=x/onerror=document.title='pwned'>";

const NAMESPACES: &str =
    "[namespaces.likes]\ndedup = true\n\n[namespaces.views]\ncache_ttl_ms = 60000\n";

#[tokio::test]
async fn a_person_looks_a_counter_up_in_the_console() {
    let _serial = serial().await;
    let stack = Stack::start("console", 2, NAMESPACES).await;
    let (setup, server) = (&stack.setup, &stack.server);

    // views:video:7 gets 1,234 over 13 events; video 8 a little; likes:post:7 two likes.
    let mut events: Vec<_> = (0..12)
        .map(|_| json!({"counter": "views:video:7", "delta": 100}))
        .collect();
    events.push(json!({"counter": "views:video:7", "delta": 34}));
    events.push(json!({"counter": "views:video:8", "delta": 5}));
    // A counter id made of HTML: shown as text, never run.
    events.push(json!({"counter": HTML_ID, "delta": 3}));
    let (status, body) = server
        .call("POST", "/v1/events", Some(&json!(events).to_string()))
        .await;
    assert_eq!(status, 200, "{body}");
    for actor in ["u7", "u8"] {
        let (status, body) = server
            .call(
                "PUT",
                &format!("/v1/counters/likes:post:7/likes/{actor}"),
                None,
            )
            .await;
        assert_eq!(status, 202, "{body}");
    }
    let exact = stack.reader().await;
    eventually(Duration::from_secs(60), "totals flushed", || async {
        let totals = exact
            .get_many(&["views:video:7", "likes:post:7", HTML_ID])
            .await
            .ok()?;
        (totals == [1234, 2, 3]).then_some(())
    })
    .await;
    // A reader has cached the total, as a feed would.
    let (_, cached) = server.call("GET", "/v1/counters/views:video:7", None).await;
    assert_eq!(cached["total"], 1234);
    eventually(
        Duration::from_secs(30),
        "pipeline caught up and top published",
        || async {
            let (_, pipeline) = server.call("GET", "/v1/pipeline", None).await;
            let (_, top) = server.call("GET", "/v1/namespaces/views/top", None).await;
            (pipeline["lag_events"] == 0 && top["top"][0]["counter"] == "views:video:7")
                .then_some(())
        },
    )
    .await;

    let browser = Browser::start().await;
    browser.open(&format!("{}/", server.url())).await;
    browser.type_into("#counter", "views:video:7").await;
    browser.click("#lookup").await;
    assert_eq!(
        browser.text("#result[data-state='done'] #total").await,
        "1,234"
    );
    let cache = browser.text("#cache").await;
    assert!(
        cache.starts_with("1,234, refreshed") && cache.contains("TTL 1 min"),
        "{cache}"
    );
    let shards = browser.text("#shard-count").await;
    assert!(
        shards.contains("shard group(s) hold a share") && shards.contains("use 1 shard(s)"),
        "{shards}"
    );

    browser.clear("#counter").await;
    browser.type_into("#counter", "likes:post:7").await;
    browser.type_into("#actor", "u7").await;
    browser.click("#lookup").await;
    assert_eq!(browser.text("#result[data-state='done'] #total").await, "2");
    assert_eq!(browser.text("#liked").await, "u7 has liked it");

    browser.clear("#counter").await;
    browser.clear("#actor").await;
    browser.type_into("#counter", HTML_ID).await;
    browser.click("#lookup").await;
    assert_eq!(browser.text("#result[data-state='done'] #total").await, "3");
    let shown = browser.text("#result").await;
    assert!(shown.contains(HTML_ID), "the id shown as text: {shown}");
    let ran = browser
        .script("return [document.querySelectorAll('img').length, document.title];")
        .await;
    assert_eq!(ran[0], 0, "no element made from the id: {ran}");
    assert_ne!(ran[1], "pwned", "no script run from the id: {ran}");

    // The top counters and the pipeline, as the page refreshes them.
    let seen = eventually(
        Duration::from_secs(20),
        "top counters and pipeline shown",
        || async {
            let top = browser.text("#top").await;
            let pipeline = browser.text("#pipeline-summary").await;
            (top.contains("views:video:7")
                && top.contains("likes:post:7")
                && pipeline.contains("0 events behind"))
            .then_some((top, pipeline))
        },
    )
    .await;
    assert!(seen.1.contains(&setup.topic), "{}", seen.1);
    let rows = browser.text("#pipeline table tbody").await;
    assert_eq!(rows.lines().count(), 2, "one row per partition: {rows}");

    let png = browser.screenshot().await;
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    // In the build's target directory (`target/`, or CARGO_TARGET_DIR).
    let profile = tally_tests::profile_dir();
    let target = profile.parent().expect("a target dir").join("console.png");
    std::fs::write(&target, &png).expect("screenshot written");
    if let Ok(path) = std::env::var("TALLY_SCREENSHOT_TO") {
        std::fs::write(&path, &png).expect("screenshot written");
    }
    let mut aggregator = stack.aggregator;
    aggregator.stop_gracefully().await;
}

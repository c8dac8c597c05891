//! `tally-server`'s write side and operations routes on the real stack: events posted over HTTP
//! and likes taken over HTTP reach Redis through Kafka and a real aggregator, exactly; a body with
//! a bad event sends nothing; the top counters, the pipeline's lag, `/metrics` and the generated
//! `/openapi.json` answer; bearer tokens are enforced by scope; and with Kafka unreachable, events
//! are answered 503 with nothing reported as accepted.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use tally_tests::{
    ApiServer, RedisServer, Stack, TempDir, binary, error_code, eventually, free_port, json,
    serial, unique, wait_committed_to_end,
};

/// Namespaces: likes count once per actor; views are plain sums.
const NAMESPACES: &str = "[namespaces.likes]\ndedup = true\ncache_ttl_ms = 1000\n\n[namespaces.views]\ncache_ttl_ms = 1000\nwindows = [\"1m\", \"1d\"]\n";

fn sha256_hex(token: &str) -> String {
    let out = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(token.as_bytes())?;
            child.wait_with_output()
        })
        .expect("sha256sum runs");
    String::from_utf8(out.stdout).expect("utf-8")[..64].to_owned()
}

#[tokio::test]
async fn events_and_likes_over_http_are_counted_exactly_and_every_route_answers() {
    let _serial = serial().await;
    let Stack {
        redis,
        setup,
        mut aggregator,
        server,
        ..
    } = Stack::start("http-api", 4, NAMESPACES).await;

    // A body with bad events is refused whole, each bad one named, and sends nothing.
    let bad = json!([
        {"counter": "views:video:1", "delta": 1000},
        {"counter": "views:video 2"},
        {"counter": "views:video:3", "delta": 0},
        "not an event",
    ]);
    let (status, body) = server
        .call("POST", "/v1/events", Some(&bad.to_string()))
        .await;
    assert_eq!(
        (status, error_code(&body)),
        (400, "invalid_events"),
        "{body}"
    );
    let indexes: Vec<u64> = (body["error"]["details"]["invalid"].as_array())
        .expect("the bad events")
        .iter()
        .filter_map(|p| p["index"].as_u64())
        .collect();
    assert_eq!(indexes, [1, 2, 3], "{body}");

    // Events: one alone, then batches; views:video:1 is busiest.
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let (status, body) = server
        .call(
            "POST",
            "/v1/events",
            Some(r#"{"counter": "views:video:1", "delta": 5}"#),
        )
        .await;
    assert_eq!((status, &body), (200, &json!({"accepted": 1})));
    *expected.entry("views:video:1".to_owned()).or_default() += 5;
    let mut sent = 1;
    for batch in 0..4 {
        let events: Vec<Value> = (0..250)
            .map(|i| {
                let video = if i % 2 == 0 { 1 } else { 2 + (i + batch) % 7 };
                let delta = 1 + (i % 3);
                *expected.entry(format!("views:video:{video}")).or_default() += delta;
                json!({"counter": format!("views:video:{video}"), "delta": delta, "event_id": format!("e{batch}-{i}")})
            })
            .collect();
        let (status, body) = server
            .call(
                "POST",
                "/v1/events",
                Some(&Value::Array(events).to_string()),
            )
            .await;
        assert_eq!((status, &body), (200, &json!({"accepted": 250})));
        sent += 250;
    }
    // A reset through the API: views:video:8 counts from zero, then 3 more.
    for body in [
        r#"{"counter": "views:video:8", "reset": true}"#,
        r#"{"counter": "views:video:8", "delta": 3}"#,
    ] {
        let (status, body) = server.call("POST", "/v1/events", Some(body)).await;
        assert_eq!((status, &body), (200, &json!({"accepted": 1})));
        sent += 1;
    }
    expected.insert("views:video:8".to_owned(), 3);

    // Likes: u1 twice, u2 then taken back, u3: two likes counted.
    for (method, actor) in [
        ("PUT", "u1"),
        ("PUT", "u2"),
        ("PUT", "u1"),
        ("DELETE", "u2"),
        ("PUT", "u3"),
    ] {
        let (status, body) = server
            .call(
                method,
                &format!("/v1/counters/likes:post:9/likes/{actor}"),
                None,
            )
            .await;
        assert_eq!(status, 202, "{method} {actor}: {body}");
        assert_eq!(body["path"], "stream");
    }
    expected.insert("likes:post:9".to_owned(), 2);
    let (status, body) = server
        .call("PUT", "/v1/counters/views:video:1/likes/u1", None)
        .await;
    assert_eq!(
        (status, error_code(&body)),
        (400, "not_deduplicated"),
        "{body}"
    );

    // Everything reaches Redis exactly.
    let exact = tally_tests::reader(&redis.url(), setup.keyspace()).await;
    let counters: Vec<String> = expected.keys().cloned().collect();
    eventually(Duration::from_secs(60), "totals flushed", || async {
        let totals = exact.get_many(&counters).await.ok()?;
        (totals == expected.values().copied().collect::<Vec<_>>()).then_some(())
    })
    .await;
    // The totals alone can match early: likes:post:9 is 2 already after u1 and u2, before u2's
    // unlike and u3's like are flushed. Offsets committed to the end mean every event is.
    wait_committed_to_end(&setup.group, &setup.topic, 4, Duration::from_secs(60)).await;
    let batch = json!({"counters": counters}).to_string();
    let (status, body) = server
        .call("POST", "/v1/counters/batch-get", Some(&batch))
        .await;
    assert_eq!(status, 200, "{body}");
    for (row, (counter, total)) in body["totals"]
        .as_array()
        .expect("totals")
        .iter()
        .zip(&expected)
    {
        assert_eq!(
            (row["counter"].as_str(), row["total"].as_i64()),
            (Some(counter.as_str()), Some(*total))
        );
    }
    for (actor, liked) in [("u1", true), ("u2", false), ("u3", true), ("u4", false)] {
        let (status, body) = server
            .call(
                "GET",
                &format!("/v1/counters/likes:post:9/likes/{actor}"),
                None,
            )
            .await;
        assert_eq!(
            (status, body["liked"].as_bool()),
            (200, Some(liked)),
            "{actor}: {body}"
        );
    }
    let (_, shares) = server
        .call("GET", "/v1/counters/views:video:1/shares", None)
        .await;
    let share_sum: i64 = (shares["shares"].as_array().expect("shares").iter())
        .filter_map(|s| s["value"].as_i64())
        .sum();
    assert_eq!(
        (shares["total"].as_i64(), share_sum),
        (Some(expected["views:video:1"]), expected["views:video:1"])
    );

    // The top counters of views, as the aggregator publishes them.
    let top = eventually(
        Duration::from_secs(30),
        "views:video:1 published as views' busiest",
        || async {
            // Each partition's heavy hitters arrive with its own report: wait for all of them.
            let (status, body) = server
                .call("GET", "/v1/namespaces/views/top?k=3", None)
                .await;
            (status == 200 && body["top"][0]["counter"] == "views:video:1").then_some(body)
        },
    )
    .await;
    assert!(top["top"].as_array().expect("top").len() <= 3);
    // views keeps windows: its top counters are ranked by their last minute's window sums,
    // which here hold every event sent.
    eventually(
        Duration::from_secs(30),
        "the window sum as activity",
        || async {
            let (_, body) = server
                .call("GET", "/v1/namespaces/views/top?k=3", None)
                .await;
            let activity = body["top"][0]["activity"].as_f64()?;
            (activity == expected["views:video:1"] as f64).then_some(())
        },
    )
    .await;

    // Windowed reads: the last 2 days of day buckets hold every event (sent without a time,
    // so stamped with the time the server received it); spans no window divides, and namespaces
    // without windows, are refused.
    for counter in ["views:video:1", "views:video:2"] {
        let (status, body) = server
            .call("GET", &format!("/v1/counters/{counter}?window=2d"), None)
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            (body["total"].as_i64(), body["window"].as_str()),
            (Some(expected[counter]), Some("2d")),
            "{body}"
        );
    }
    let batch = json!({"counters": ["views:video:1"], "window": "2d"}).to_string();
    let (status, body) = server
        .call("POST", "/v1/counters/batch-get", Some(&batch))
        .await;
    assert_eq!(
        (status, body["totals"][0]["total"].as_i64()),
        (200, Some(expected["views:video:1"])),
        "{body}"
    );
    for (path, code) in [
        ("/v1/counters/views:video:1?window=7m30s", "invalid_window"),
        ("/v1/counters/views:video:1?window=90s", "no_such_window"),
        ("/v1/counters/likes:post:9?window=1h", "no_such_window"),
    ] {
        let (status, body) = server.call("GET", path, None).await;
        assert_eq!((status, error_code(&body)), (400, code), "{path}: {body}");
    }
    let (status, body) = server
        .call("GET", "/v1/namespaces/views/top?k=0", None)
        .await;
    assert_eq!((status, error_code(&body)), (400, "bad_query"));

    // The pipeline: caught up on every partition.
    let pipeline = eventually(
        Duration::from_secs(30),
        "the pipeline caught up",
        || async {
            let (status, body) = server.call("GET", "/v1/pipeline", None).await;
            (status == 200 && body["lag_events"] == 0).then_some(body)
        },
    )
    .await;
    let partitions = pipeline["partitions"].as_array().expect("partitions");
    assert_eq!(partitions.len(), 4);
    let logged: i64 = partitions
        .iter()
        .filter_map(|p| p["log_end"].as_i64())
        .sum();
    assert_eq!(logged, sent + 5, "{pipeline}");
    assert!(
        partitions
            .iter()
            .all(|p| p["source"] == "watermark" && p["durable"] == p["log_end"])
    );

    // Metrics and the generated OpenAPI document.
    let metrics = server.request("GET", "/metrics", &[], None).await.body;
    assert!(
        metrics.contains(&format!("tally_http_events_accepted_total {sent}")),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "tally_http_requests_total{method=\"POST\",route=\"/v1/events\",status=\"400\"} 1"
        ),
        "{metrics}"
    );
    let (status, openapi) = server.call("GET", "/openapi.json", None).await;
    assert_eq!(status, 200);
    assert!(
        openapi["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3."))
    );
    for (path, method) in [
        ("/v1/counters/{id}", "get"),
        ("/v1/counters/batch-get", "post"),
        ("/v1/counters/{id}/shares", "get"),
        ("/v1/counters/{id}/likes/{actor}", "get"),
        ("/v1/counters/{id}/likes/{actor}", "put"),
        ("/v1/counters/{id}/likes/{actor}", "delete"),
        ("/v1/namespaces", "get"),
        ("/v1/namespaces/{ns}/top", "get"),
        ("/v1/events", "post"),
        ("/v1/pipeline", "get"),
        ("/metrics", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
    ] {
        assert!(
            openapi["paths"][path][method].is_object(),
            "{method} {path} missing from /openapi.json"
        );
    }
    aggregator.stop_gracefully().await;
}

/// A request (method, path, authorization, body) and the status and code it must get.
type Case<'a> = (
    &'a str,
    &'a str,
    Option<&'a str>,
    Option<&'a str>,
    u16,
    &'a str,
);

#[tokio::test]
async fn tokens_are_enforced_by_scope_and_loopback_is_required_without_them() {
    let dir = TempDir::new("tally-http-tokens");
    let redis = RedisServer::start().await;
    let topic = unique("http-tokens");
    tally_tests::create_topic(&topic, 1).await;
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        format!(
            "[[token]]\nname = \"reader\"\nsha256 = \"{}\"\nscopes = [\"read\"]\n\n[[token]]\nname = \"writer\"\nsha256 = \"{}\"\nscopes = [\"read\", \"write\"]\n\n[[token]]\nname = \"admin\"\nsha256 = \"{}\"\nscopes = [\"write\", \"reset\"]\n",
            sha256_hex("read-secret"),
            sha256_hex("write-secret"),
            sha256_hex("admin-secret")
        ),
    )
    .expect("written");
    let brokers = tally_tests::brokers();
    let server = ApiServer::start(
        &[
            "--brokers",
            &brokers,
            "--topic",
            &topic,
            "--tokens",
            tokens.to_str().expect("utf-8"),
        ],
        &[("TALLY_REDIS_URL", &redis.url())],
        &dir.path().join("server.log"),
    )
    .await;
    let event = r#"{"counter": "views:video:1"}"#;
    // A reset needs the reset scope: write alone may count, not clear.
    let reset = r#"[{"counter": "views:video:1"}, {"counter": "views:video:1", "reset": true}]"#;
    let cases: [Case; 9] = [
        (
            "GET",
            "/v1/counters/views:video:1",
            None,
            None,
            401,
            "unauthorized",
        ),
        (
            "GET",
            "/v1/counters/views:video:1",
            Some("Bearer wrong"),
            None,
            401,
            "unauthorized",
        ),
        (
            "GET",
            "/v1/counters/views:video:1",
            Some("Bearer read-secret"),
            None,
            200,
            "",
        ),
        ("POST", "/v1/events", None, Some(event), 401, "unauthorized"),
        (
            "POST",
            "/v1/events",
            Some("Bearer read-secret"),
            Some(event),
            403,
            "forbidden",
        ),
        (
            "POST",
            "/v1/events",
            Some("Bearer write-secret"),
            Some(event),
            200,
            "",
        ),
        (
            "DELETE",
            "/v1/counters/likes:post:1/likes/u1",
            Some("Bearer read-secret"),
            None,
            403,
            "forbidden",
        ),
        (
            "POST",
            "/v1/events",
            Some("Bearer write-secret"),
            Some(reset),
            403,
            "forbidden",
        ),
        (
            "POST",
            "/v1/events",
            Some("Bearer admin-secret"),
            Some(reset),
            200,
            "",
        ),
    ];
    for (method, path, auth, body, want_status, want_code) in cases {
        let mut headers = vec![("content-type", "application/json")];
        if let Some(auth) = auth {
            headers.push(("authorization", auth));
        }
        let answer = server.request(method, path, &headers, body).await;
        let answer_json = json(&answer.body);
        assert_eq!(
            (answer.status, error_code(&answer_json)),
            (want_status, want_code),
            "{method} {path} with {auth:?}: {}",
            answer.body
        );
        if want_status == 401 {
            assert!(
                answer.head.contains("www-authenticate: bearer"),
                "{}",
                answer.head
            );
        }
    }
    // Every /v1 route the document lists: 401 without a token, 403 with a token lacking the
    // scope its document names.
    let document = json(&server.request("GET", "/openapi.json", &[], None).await.body);
    let paths = document["paths"].as_object().expect("paths");
    let mut checked = 0;
    for (path, operations) in paths.iter().filter(|(p, _)| p.starts_with("/v1/")) {
        let concrete = path
            .replace("{id}", "likes:post:1")
            .replace("{actor}", "u1")
            .replace("{ns}", "likes");
        for (method, operation) in operations.as_object().expect("operations") {
            let method = method.to_uppercase();
            let scopes: Vec<&str> = operation["security"][0]["bearer"]
                .as_array()
                .unwrap_or_else(|| panic!("{method} {path} names its scope"))
                .iter()
                .filter_map(|s| s.as_str())
                .collect();
            // The reader lacks write; the admin (write, reset) lacks read.
            let lacking = if scopes.contains(&"read") {
                "Bearer admin-secret"
            } else {
                "Bearer read-secret"
            };
            let body = (method == "POST" || method == "PUT").then_some("{}");
            let json_type = [("content-type", "application/json")];
            for (auth, want) in [(None, 401), (Some(lacking), 403)] {
                let mut headers = json_type.to_vec();
                headers.extend(auth.map(|a| ("authorization", a)));
                let answer = server.request(&method, &concrete, &headers, body).await;
                assert_eq!(
                    answer.status, want,
                    "{method} {path} with {auth:?} (scopes {scopes:?}): {}",
                    answer.body
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 10, "{checked} routes checked");

    // Health, readiness, metrics and the document need no token.
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json", "/"] {
        assert_eq!(
            server.request("GET", path, &[], None).await.status,
            200,
            "{path}"
        );
    }

    // No token file: the server refuses to listen beyond loopback.
    let refused = std::process::Command::new(binary("tally-server"))
        .args(["--listen", &format!("0.0.0.0:{}", free_port())])
        .env("TALLY_REDIS_URL", redis.url())
        .output()
        .expect("tally-server runs");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(stderr.contains("without a token file"), "{stderr}");
}

#[tokio::test]
async fn events_kafka_does_not_acknowledge_are_answered_503_and_not_reported_accepted() {
    let dir = TempDir::new("tally-http-no-kafka");
    let redis = RedisServer::start().await;
    // Nothing listens there: librdkafka cannot deliver within the produce timeout.
    let nowhere = format!("127.0.0.1:{}", free_port());
    let server = ApiServer::start(
        &["--brokers", &nowhere, "--produce-timeout-ms", "1500"],
        &[("TALLY_REDIS_URL", &redis.url())],
        &dir.path().join("server.log"),
    )
    .await;
    let events = r#"[{"counter": "views:video:1"}, {"counter": "views:video:2", "delta": 3}]"#;
    let (status, body) = server.call("POST", "/v1/events", Some(events)).await;
    assert_eq!(
        (status, error_code(&body)),
        (503, "kafka_unavailable"),
        "{body}"
    );
    assert_eq!(
        body["error"]["details"],
        json!({"accepted": 0, "not_acknowledged": [0, 1]})
    );
    let (status, body) = server.call("GET", "/v1/pipeline", None).await;
    assert_eq!(
        (status, error_code(&body)),
        (503, "kafka_unavailable"),
        "{body}"
    );
    let metrics = server.request("GET", "/metrics", &[], None).await.body;
    assert!(
        metrics.contains("tally_http_events_unacknowledged_total 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tally_http_events_accepted_total 0"),
        "{metrics}"
    );
}

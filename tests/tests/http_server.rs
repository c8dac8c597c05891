//! `tally-server` against a real `redis-server`, through a real HTTP/1.1 connection: totals
//! (cached and exact) equal the sum of a counter's shares, batches answer in order, and bad
//! input of every kind gets a JSON error with its stable code, never a 500 or a dropped
//! connection; with Redis gone, reads answer 503 (in general terms, with a request id the log
//! has the detail under) and readiness fails. With a certificate and key it serves HTTPS, to
//! curl verifying it.

use serde_json::json;
use tally_common::Keyspace;
use tally_tests::{ApiServer, RedisServer, TempDir, connect, error_code as code, json, unique};

#[tokio::test]
async fn totals_batches_and_every_bad_input_answer_json() {
    let mut redis = RedisServer::start().await;
    let prefix = unique("http");
    let keyspace = Keyspace::new(prefix.clone(), 4).expect("keyspace");
    let mut conn = connect(&redis.url()).await;
    // likes:post:1 holds shares in two groups; views:video:2 in one.
    for (group, counter, value) in [
        (0, "likes:post:1", 5),
        (3, "likes:post:1", 2),
        (1, "views:video:2", 40),
    ] {
        let _: () = redis::cmd("SET")
            .arg(keyspace.counter_key(group, counter))
            .arg(value)
            .query_async(&mut conn)
            .await
            .expect("SET");
    }
    let dir = TempDir::new("tally-http-server");
    let server = ApiServer::start(
        &["--key-prefix", &prefix, "--shard-groups", "4"],
        &[("TALLY_REDIS_URL", &redis.url())],
        &dir.path().join("server.log"),
    )
    .await;

    let (status, body) = server
        .call("GET", "/v1/counters/likes:post:1?exact=true", None)
        .await;
    assert_eq!(
        (status, body),
        (200, json!({"counter": "likes:post:1", "total": 7}))
    );
    let (status, body) = server.call("GET", "/v1/counters/likes:post:1", None).await;
    assert_eq!(
        (status, body),
        (200, json!({"counter": "likes:post:1", "total": 7}))
    );

    let batch = r#"{"counters": ["views:video:2", "likes:post:404", "likes:post:1"]}"#;
    let (status, body) = server
        .call("POST", "/v1/counters/batch-get", Some(batch))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"totals": [
            {"counter": "views:video:2", "total": 40},
            {"counter": "likes:post:404", "total": 0},
            {"counter": "likes:post:1", "total": 7},
        ]})
    );

    // Bad input of every kind: a JSON error with a stable code.
    let too_many = serde_json::to_string(&json!({
        "counters": (0..1_001).map(|i| format!("c:{i}")).collect::<Vec<_>>()
    }))
    .expect("json");
    let oversized = format!(r#"{{"counters": ["{}"]}}"#, "x".repeat(1100 * 1024));
    let long_actor = format!("/v1/counters/likes:post:1/likes/{}", "u".repeat(1_000));
    let cases: [(&str, &str, Option<&str>, u16, &str); 10] = [
        ("GET", &long_actor, None, 400, "invalid_actor"),
        (
            "GET",
            "/v1/namespaces/likes/top?k=many",
            None,
            400,
            "bad_query",
        ),
        ("GET", "/v1/counters/bad%20id", None, 400, "invalid_counter"),
        (
            "GET",
            "/v1/counters/likes:post:1?exact=maybe",
            None,
            400,
            "bad_query",
        ),
        (
            "POST",
            "/v1/counters/batch-get",
            Some("{not json"),
            400,
            "bad_json",
        ),
        (
            "POST",
            "/v1/counters/batch-get",
            Some(r#"{"ids": []}"#),
            400,
            "bad_json",
        ),
        (
            "POST",
            "/v1/counters/batch-get",
            Some(&too_many),
            400,
            "too_many_counters",
        ),
        (
            "POST",
            "/v1/counters/batch-get",
            Some(&oversized),
            413,
            "body_too_large",
        ),
        ("GET", "/v2/nothing", None, 404, "not_found"),
        (
            "DELETE",
            "/v1/counters/batch-get",
            None,
            405,
            "method_not_allowed",
        ),
    ];
    for (method, path, body, want_status, want_code) in cases {
        let (status, answer) = server.call(method, path, body).await;
        assert_eq!(
            (status, code(&answer)),
            (want_status, want_code),
            "{method} {path}: {answer}"
        );
    }
    let answer = server
        .request("POST", "/v1/counters/batch-get", &[], Some(batch))
        .await;
    assert_eq!(
        (answer.status, code(&json(&answer.body))),
        (415, "unsupported_media_type"),
        "a body without content-type: {}",
        answer.body
    );
    let (status, _) = server.call("GET", "/readyz", None).await;
    assert_eq!(status, 200);

    // Redis gone: exact reads and readiness say so, with 503.
    redis.kill().await;
    let (status, answer) = server
        .call("GET", "/v1/counters/likes:post:1?exact=true", None)
        .await;
    assert_eq!(
        (status, code(&answer)),
        (503, "redis_unavailable"),
        "{answer}"
    );
    // In general terms, with the id under which the log has Redis's own words.
    let id = answer["error"]["request_id"]
        .as_str()
        .expect("a request id");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(id) && !message.contains("127.0.0.1"),
        "{answer}"
    );
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default();
    assert!(log.contains(id), "the log names request {id}");
    let (status, answer) = server.call("GET", "/readyz", None).await;
    assert_eq!(
        (status, code(&answer)),
        (503, "redis_unavailable"),
        "{answer}"
    );
}

/// `curl` over HTTPS to `port` trusting `ca`: its exit code and what it printed.
fn curl_https(ca: &std::path::Path, port: u16, path: &str) -> (i32, String) {
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(ca)
        .arg(format!("https://localhost:{port}{path}"))
        .output()
        .expect("curl runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// With a certificate and key, `tally-server` speaks HTTPS itself, to a real client (curl,
/// verifying the certificate): reads answer as over HTTP; a plain HTTP request gets no answer;
/// a client that does not trust the certificate refuses it.
#[tokio::test]
async fn https_with_a_certificate_and_key() {
    let redis = RedisServer::start().await;
    let dir = TempDir::new("tally-https");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let made = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl runs");
    assert!(made.status.success(), "{made:?}");
    let port = tally_tests::free_port();
    let log = std::fs::File::create(dir.path().join("server.log")).expect("log");
    let mut server = std::process::Command::new(tally_tests::binary("tally-server"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .env("TALLY_REDIS_URL", redis.url())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("tally-server starts");
    let ready = tally_tests::eventually(
        std::time::Duration::from_secs(20),
        "tally-server answers over HTTPS",
        || async {
            let (status, text) = curl_https(&cert, port, "/healthz");
            (status == 0).then_some(text)
        },
    )
    .await;
    assert!(ready.contains("ok"), "{ready}");
    let (status, text) = curl_https(&cert, port, "/v1/counters/likes:post:1");
    assert_eq!(status, 0, "{text}");
    assert_eq!(json(&text), json!({"counter": "likes:post:1", "total": 0}));

    // Plain HTTP to the HTTPS port: no HTTP answer.
    let plain = tally_tests::http_call(port, "GET", "/healthz", &[], None).await;
    assert!(plain.as_ref().is_none_or(|a| a.status != 200), "{plain:?}");
    // A client that does not trust the certificate refuses it (curl: 60, cannot verify).
    let untrusted = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("https://localhost:{port}/healthz"))
        .output()
        .expect("curl runs");
    assert_eq!(untrusted.status.code(), Some(60), "{untrusted:?}");
    let _ = server.kill();
    let _ = server.wait();
}

//! Hostile clients at both HTTP endpoints, the aggregator's (`/metrics`, `/healthz`, `/readyz`)
//! and `tally-server`'s (without tokens, on loopback, its default), through real connections to
//! the real binaries: each attack, bounded in count and time, leaves the process's memory and
//! its `/metrics` bounded, and a normal request is answered within a second meanwhile.
//!
//! | attack | what must happen |
//! |---|---|
//! | 64 MiB without a newline | the connection is closed after the header limit (16 KiB) |
//! | 300 connections sending a header byte every 2 s, at each endpoint | each closed by the header timeout (10 s) |
//! | a kept-alive connection left idle after an answer | closed by the same timeout |
//! | 520 idle connections at once | those past the cap (512) answered 503 at once |
//! | 3,000 requests with made-up methods | one `other` series, not 3,000 |
//! | a 64 KiB header | 431 |
//! | `Host: attacker.example` without tokens | 403 `forbidden_host` |
//! | the console | a strict Content-Security-Policy, `nosniff`, no framing, no referrer |

use std::time::{Duration, Instant};

use tally_tests::{
    AggregatorSetup, ApiServer, RedisServer, TempDir, brokers, error_code, eventually, http_call,
    json,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The servers' header timeout (`tally_ops::http::Limits`), and what a close may take past it.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
const SLACK: Duration = Duration::from_secs(3);

/// Resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    (status.lines())
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// A normal request answered within a second.
async fn answered_promptly(port: u16, path: &str) {
    let started = Instant::now();
    let answer = tokio::time::timeout(
        Duration::from_secs(1),
        http_call(port, "GET", path, &[], None),
    )
    .await
    .unwrap_or_else(|_| panic!("GET {path} on :{port} took over 1 s under attack"))
    .unwrap_or_else(|| panic!("GET {path} on :{port}: no answer under attack"));
    assert_eq!(answer.status, 200, "GET {path} on :{port}: {}", answer.body);
    eprintln!(
        "GET {path} on :{port} under attack: {:?}",
        started.elapsed()
    );
}

/// Sends up to 64 MiB of a request line that never ends; returns how many bytes went out
/// before the server closed the connection (it must, within 10 s).
async fn endless_request_line(port: u16) -> u64 {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connects");
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0_u64;
    stream.write_all(b"GET /").await.expect("first bytes");
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        while sent < 64 * 1024 * 1024 {
            match stream.write_all(&chunk).await {
                Ok(()) => sent += chunk.len() as u64,
                Err(_) => return true,
            }
        }
        false
    })
    .await;
    assert_eq!(
        closed,
        Ok(true),
        ":{port} kept reading a request line without end ({sent} bytes)"
    );
    sent
}

/// Opens `count` connections that send a header one byte every 2 s; returns the longest any
/// stayed open (the server must close each).
async fn slow_headers(port: u16, count: usize) -> Duration {
    let mut tasks = Vec::new();
    for _ in 0..count {
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let mut stream = TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connects");
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-slow: ")
                .await
                .expect("first bytes");
            let mut buf = [0_u8; 1024];
            loop {
                tokio::select! {
                    // End of stream, an error, or an answer (408): the server let go.
                    _ = stream.read(&mut buf) => return started.elapsed(),
                    () = tokio::time::sleep(Duration::from_secs(2)) => {
                        if stream.write_all(b"a").await.is_err() {
                            return started.elapsed();
                        }
                    }
                }
                assert!(
                    started.elapsed() < HEADER_TIMEOUT * 3,
                    ":{port} held a slow header for 30 s"
                );
            }
        }));
    }
    let mut longest = Duration::ZERO;
    for task in tasks {
        longest = longest.max(task.await.expect("slow client"));
    }
    longest
}

/// Sends one whole request on a kept-alive connection, reads the answer, then sends nothing:
/// returns how long the server kept the idle connection open after answering.
async fn idle_after_an_answer(port: u16) -> Duration {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connects");
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .expect("request sent");
    let mut answer = Vec::new();
    let mut buf = [0_u8; 4096];
    while !String::from_utf8_lossy(&answer).contains("\r\n\r\n") {
        let n = stream.read(&mut buf).await.expect("an answer");
        assert!(n > 0, ":{port} closed before answering");
        answer.extend_from_slice(&buf[..n]);
    }
    let answered = Instant::now();
    let closed = tokio::time::timeout(HEADER_TIMEOUT * 3, async {
        // The rest of the body, then the end of the stream.
        while stream.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    })
    .await;
    assert!(closed.is_ok(), ":{port} kept an idle connection for 30 s");
    answered.elapsed()
}

/// Opens `count` connections at once, sending nothing, and holds them for a second: returns
/// how many were answered 503 (past the server's cap) meanwhile. All are closed on return.
async fn idle_connections(port: u16, count: usize) -> usize {
    let mut open = Vec::new();
    for _ in 0..count {
        open.push(
            TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connects"),
        );
    }
    // Every connection is open before any is read: the reads run together, each until its
    // answer or the second is over.
    let reads = open.into_iter().map(|mut stream| {
        tokio::spawn(async move {
            let mut buf = [0_u8; 256];
            let read = tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buf)).await;
            matches!(read, Ok(Ok(n)) if String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 503"))
        })
    });
    let mut refused = 0;
    for read in reads.collect::<Vec<_>>() {
        refused += usize::from(read.await.expect("reader"));
    }
    refused
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_endpoints_stay_up_and_bounded_under_hostile_clients() {
    let dir = TempDir::new("tally-hostile");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("hostile", &redis.url(), 2).await;
    let aggregator = setup.spawn(dir.path(), &[]);
    let server = ApiServer::start(
        &["--brokers", &brokers(), "--topic", &setup.topic],
        &[("TALLY_REDIS_URL", &redis.url())],
        &dir.path().join("server.log"),
    )
    .await;
    let (agg_port, api_port) = (aggregator.metrics_port(), server.port);
    answered_promptly(agg_port, "/healthz").await;
    let rss_before = (rss_kib(aggregator.pid()), rss_kib(server.pid()));

    // A request line without end, at both.
    for port in [agg_port, api_port] {
        let sent = endless_request_line(port).await;
        eprintln!(":{port} closed an endless request line after {sent} bytes sent");
        answered_promptly(port, "/healthz").await;
    }

    // A header too large: 431.
    let big = "b".repeat(64 * 1024);
    for port in [agg_port, api_port] {
        let answer = http_call(port, "GET", "/healthz", &[("x-big", &big)], None).await;
        assert_eq!(answer.map(|a| a.status), Some(431), ":{port}");
    }

    // Past the connection cap: 503 at once, and the server is itself again once they go.
    let refused = idle_connections(agg_port, 520).await;
    assert!(
        (8..=10).contains(&refused),
        "520 idle connections against a cap of 512: {refused} answered 503"
    );
    // Once the server has seen them close, it answers again.
    eventually(
        Duration::from_secs(5),
        "an answer after the idle connections",
        || async {
            let answer = http_call(agg_port, "GET", "/healthz", &[], None).await?;
            (answer.status == 200).then_some(())
        },
    )
    .await;
    answered_promptly(agg_port, "/metrics").await;

    // 300 slow headers at each endpoint, with normal requests answered meanwhile.
    let slow_agg = tokio::spawn(slow_headers(agg_port, 300));
    let slow_api = tokio::spawn(slow_headers(api_port, 300));
    let idle_agg = tokio::spawn(idle_after_an_answer(agg_port));
    let idle_api = tokio::spawn(idle_after_an_answer(api_port));
    tokio::time::sleep(Duration::from_secs(3)).await;
    answered_promptly(agg_port, "/metrics").await;
    answered_promptly(api_port, "/v1/counters/likes:post:1").await;
    for (port, slow) in [(agg_port, slow_agg), (api_port, slow_api)] {
        let longest = slow.await.expect("slow clients");
        eprintln!(":{port} held a slow header at most {longest:?}");
        assert!(
            longest <= HEADER_TIMEOUT + SLACK,
            ":{port} held a slow header for {longest:?}"
        );
    }

    for (port, idle) in [(agg_port, idle_agg), (api_port, idle_api)] {
        let held = idle.await.expect("idle client");
        eprintln!(":{port} closed an idle kept-alive connection after {held:?}");
        assert!(
            held <= HEADER_TIMEOUT + SLACK,
            ":{port} kept an idle connection {held:?}"
        );
    }

    // Made-up methods: one `other` series.
    let metrics_before = http_call(api_port, "GET", "/metrics", &[], None)
        .await
        .expect("metrics")
        .body;
    let mut senders = Vec::new();
    for t in 0..6 {
        senders.push(tokio::spawn(async move {
            for i in 0..500 {
                let method = format!("M{t}X{i}");
                http_call(api_port, &method, "/v1/counters/likes:post:1", &[], None).await;
            }
        }));
    }
    for sender in senders {
        sender.await.expect("sender");
    }
    let metrics_after = http_call(api_port, "GET", "/metrics", &[], None)
        .await
        .expect("metrics")
        .body;
    assert!(
        metrics_after.contains("method=\"other\""),
        "{metrics_after}"
    );
    assert!(
        metrics_after.len() < metrics_before.len() + 2_048,
        "3,000 made-up methods grew /metrics from {} to {} bytes",
        metrics_before.len(),
        metrics_after.len()
    );

    // Without tokens, only loopback names are served.
    let foreign = http_call(
        api_port,
        "GET",
        "/v1/counters/likes:post:1",
        &[("host", "attacker.example")],
        None,
    )
    .await;
    let foreign = foreign.expect("an answer");
    assert_eq!(
        (foreign.status, error_code(&json(&foreign.body))),
        (403, "forbidden_host"),
        "{}",
        foreign.body
    );

    // The console's headers.
    let console = http_call(api_port, "GET", "/", &[], None)
        .await
        .expect("console");
    assert_eq!(console.status, 200);
    for header in [
        "content-security-policy: default-src 'none'; script-src 'sha256-",
        "frame-ancestors 'none'",
        "x-content-type-options: nosniff",
        "referrer-policy: no-referrer",
    ] {
        assert!(console.head.contains(header), "{header}: {}", console.head);
    }

    // Memory stayed bounded through it all.
    let rss_after = (rss_kib(aggregator.pid()), rss_kib(server.pid()));
    eprintln!("resident KiB (aggregator, server): {rss_before:?} before, {rss_after:?} after");
    for (name, before, after) in [
        ("the aggregator", rss_before.0, rss_after.0),
        ("tally-server", rss_before.1, rss_after.1),
    ] {
        assert!(
            after < before + 32 * 1024,
            "{name} grew from {before} KiB to {after} KiB under attack"
        );
    }
    answered_promptly(agg_port, "/readyz").await;
    answered_promptly(api_port, "/healthz").await;
}

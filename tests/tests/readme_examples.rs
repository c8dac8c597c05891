//! The README's HTTP examples, run verbatim against the real stack (Kafka, an aggregator,
//! redis-server, tally-server): the curl and Python (standard library) examples that write, then,
//! once the aggregator flushed, the ones that read, each checked for the numbers it prints.

use std::time::Duration;

use tally_tests::{Stack, eventually, serial};

/// The fenced block after `<!-- example: name -->` in the README.
fn example(readme: &str, name: &str) -> String {
    let marker = format!("<!-- example: {name} -->");
    let after = &readme[readme
        .find(&marker)
        .unwrap_or_else(|| panic!("{marker} in README.md"))..];
    let fence = after.find("```").expect("a code block");
    let body = &after[fence..];
    let body = &body[body.find('\n').expect("fence line") + 1..];
    body[..body.find("```").expect("closing fence")].to_owned()
}

/// Runs `program` with `code` as its script, `TALLY_URL` pointing at the server: its stdout.
fn run(program: &str, flag: &str, code: &str, url: &str) -> String {
    let out = std::process::Command::new(program)
        .args([flag, code])
        .env("TALLY_URL", url)
        .output()
        .unwrap_or_else(|e| panic!("{program} runs: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{program} failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[tokio::test]
async fn the_readme_http_examples_run_verbatim_and_print_the_right_numbers() {
    let _serial = serial().await;
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    let stack = Stack::start("readme", 2, "[namespaces.likes]\ndedup = true\n").await;
    let server = &stack.server;
    let url = server.url();

    let curl_write = run("bash", "-c", &example(&readme, "curl-write"), &url);
    assert_eq!(curl_write.trim(), r#"{"accepted":2}"#);
    let python_write = run("python3", "-c", &example(&readme, "python-write"), &url);
    assert_eq!(python_write.trim(), "2");

    let exact = stack.reader().await;
    eventually(
        Duration::from_secs(60),
        "the examples' events counted",
        || async {
            let totals = exact
                .get_many(&["views:video:9", "likes:post:42"])
                .await
                .ok()?;
            (totals == [14, 1]).then_some(())
        },
    )
    .await;

    let curl_read = run("bash", "-c", &example(&readme, "curl-read"), &url);
    assert_eq!(
        curl_read,
        concat!(
            r#"{"counter":"views:video:9","total":14}"#,
            r#"{"counter":"likes:post:42","actor":"u7","liked":true}"#
        )
    );
    let python_read = run("python3", "-c", &example(&readme, "python-read"), &url);
    assert_eq!(python_read, "likes:post:42 1\nviews:video:9 14\n");
    let mut aggregator = stack.aggregator;
    aggregator.stop_gracefully().await;
}

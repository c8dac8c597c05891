//! Captures a real broker's answers as fixtures for tally-kafka's tests: `ApiVersions`,
//! `Metadata`, `ListOffsets` (the log's start and end) and a `Fetch` from offset 0 in every
//! version both tally and the broker implement (`fetch-v<N>.bin`), for partition 0 of a topic,
//! each response's body written to `<out>/<name>.bin` as the broker sent it. `kafka/tests/fixtures/capture.sh` fills a topic and runs this.
//!
//! Usage: `capture_fixtures <bootstrap> <topic> <out dir>`.

use std::time::Duration;

use tally_kafka::FetchConfig;
use tally_kafka::connection::Connection;
use tally_kafka::protocol::{self, Isolation, LogEnd};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [bootstrap, topic, out] = args.as_slice() else {
        return Err("usage: capture_fixtures <bootstrap> <topic> <out dir>".into());
    };
    std::fs::create_dir_all(out)?;
    let config = FetchConfig::from_options(topic, [("bootstrap.servers", bootstrap.as_str())])?;
    let mut connection = Connection::open(&config.client.bootstrap[0], &config.client).await?;
    let mut body = Vec::new();
    let save = |name: &str, body: &[u8]| {
        let path = std::path::Path::new(out).join(format!("{name}.bin"));
        std::fs::write(&path, body).map(|()| println!("{} ({} bytes)", path.display(), body.len()))
    };

    connection
        .request(protocol::API_VERSIONS, |_| {}, &mut body)
        .await?;
    save("api_versions", &body)?;
    connection
        .request(
            protocol::METADATA,
            |w| protocol::metadata_request(w, topic, false),
            &mut body,
        )
        .await?;
    save("metadata", &body)?;
    for (name, end) in [
        ("list_offsets_earliest", LogEnd::Earliest),
        ("list_offsets_latest", LogEnd::Latest),
    ] {
        connection
            .request(
                protocol::LIST_OFFSETS,
                |w| protocol::list_offsets_request(w, topic, &[0], end),
                &mut body,
            )
            .await?;
        save(name, &body)?;
    }
    let limits = tally_kafka::config::DEFAULT_LIMITS;
    let from = protocol::FetchPosition {
        partition: 0,
        offset: 0,
        current_leader_epoch: -1,
        last_fetched_epoch: -1,
    };
    for version in protocol::FETCH.oldest..=connection.version(protocol::FETCH) {
        connection.speak(protocol::FETCH, version);
        connection
            .request_waiting(
                protocol::FETCH,
                |w| {
                    let isolation = Isolation::ReadCommitted;
                    protocol::fetch_request(w, version, topic, &[from], limits, isolation)
                },
                &mut body,
                Duration::from_millis(limits.max_wait_ms as u64),
            )
            .await?;
        save(&format!("fetch-v{version}"), &body)?;
    }
    Ok(())
}

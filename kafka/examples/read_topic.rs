//! Reads a whole topic with the fetcher and reports records/s and CPU: a quick way to see what
//! the fetch path costs on its own.
//!
//!     cargo run --release -p tally-kafka --example read_topic -- 127.0.0.1:9092 TOPIC

use std::collections::HashMap;
use std::time::Instant;

use tally_kafka::protocol::LogEnd;
use tally_kafka::{FetchConfig, Fetched, Fetcher, Item, Start};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (brokers, topic) = (args[1].as_str(), args[2].as_str());
    let config = FetchConfig::from_options(topic, [("bootstrap.servers", brokers)])?;
    let mut c = tally_kafka::connection::Connection::open(brokers, &config.client).await?;
    let metadata = c.metadata(topic, false).await?;
    let ids: Vec<i32> = metadata.partitions.iter().map(|p| p.partition).collect();
    let starts = c.list_offsets(topic, &ids, LogEnd::Earliest).await?;
    let ends: HashMap<i32, i64> = c
        .list_offsets(topic, &ids, LogEnd::Latest)
        .await?
        .into_iter()
        .map(|(p, _, o)| (p, o))
        .collect();
    let began = Instant::now();
    let (fetcher, mut rx) = Fetcher::start(config);
    let mut epochs = HashMap::new();
    let mut next = HashMap::new();
    for (p, _, start) in starts {
        epochs.insert(p, fetcher.seek(p, Start::At(start), false));
        next.insert(p, start);
    }
    let (mut records, mut bytes) = (0u64, 0u64);
    while next.iter().any(|(p, o)| o < &ends[p]) {
        match rx.recv().await {
            Some(Fetched::Chunk(chunk)) => {
                for item in chunk.items() {
                    match item {
                        Item::Record(r) => {
                            records += 1;
                            bytes += r.value.map_or(0, |v| v.len() as u64);
                            next.insert(chunk.partition, r.offset + 1);
                        }
                        Item::Undecodable {
                            last_offset,
                            reason,
                            ..
                        } => {
                            eprintln!(
                                "partition {} to offset {last_offset}: {reason}",
                                chunk.partition
                            );
                            next.insert(chunk.partition, last_offset + 1);
                        }
                    }
                }
            }
            Some(other) => eprintln!("{other:?}"),
            None => break,
        }
    }
    let wall = began.elapsed().as_secs_f64();
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let cpu = (fields[11].parse::<f64>()? + fields[12].parse::<f64>()?) / 100.0;
    println!(
        "{records} records ({bytes} value bytes) in {wall:.2} s: {:.0} records/s, {cpu:.2} CPU s, {:.3} CPU s per M",
        records as f64 / wall,
        cpu * 1e6 / records as f64
    );
    Ok(())
}

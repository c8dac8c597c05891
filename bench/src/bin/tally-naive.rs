//! The naive design from the articles, as a benchmark baseline: a Kafka consumer that, for every
//! event, issues one `INCRBY` on the counter's key and commits the message's offset after it.
//! Written to be as fast as that design allows (release build, one multiplexed connection, an
//! asynchronous commit that does not wait for the broker), not to lose: it is the yardstick tally's
//! micro-batches are compared with.
//!
//! It runs until `--seconds` pass or `--events` are processed, printing one line per second
//! (`processed <n>`) and a last one, `done <n> <seconds from the first message to the last>`
//! (joining the group is not counted).

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use rdkafka::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::Message;
use tally_common::{codec, defaults};

#[derive(Debug, Parser)]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, default_value = defaults::BROKERS)]
    brokers: String,
    /// Topic to consume from the beginning.
    #[arg(long)]
    topic: String,
    /// Consumer group.
    #[arg(long)]
    group: String,
    /// Redis URL.
    #[arg(long, default_value = defaults::REDIS_URL)]
    redis_url: String,
    /// Key prefix: each event increments `<prefix>:<counter>`.
    #[arg(long)]
    key_prefix: String,
    /// Stop after this many events...
    #[arg(long)]
    events: u64,
    /// ... or after this many seconds.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("group.id", &args.group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .context("consumer")?;
    consumer.subscribe(&[&args.topic])?;
    let client = redis::Client::open(args.redis_url.as_str())?;
    let mut redis = client.get_multiplexed_async_connection().await?;
    let mut deadline = Instant::now() + Duration::from_secs(60);
    let mut first = None;
    let mut processed = 0u64;
    let mut next_report = Instant::now() + Duration::from_secs(1);
    while processed < args.events && Instant::now() < deadline {
        let message = match tokio::time::timeout_at(deadline.into(), consumer.recv()).await {
            Ok(received) => received?,
            Err(_) => break,
        };
        if first.is_none() {
            let now = Instant::now();
            first = Some(now);
            deadline = now + Duration::from_secs(args.seconds);
        }
        if let Ok(event) = codec::decode(message.payload().unwrap_or_default(), 16_384) {
            redis::cmd("INCRBY")
                .arg(format!("{}:{}", args.key_prefix, event.counter))
                .arg(event.delta)
                .exec_async(&mut redis)
                .await?;
        }
        consumer.commit_message(&message, CommitMode::Async)?;
        processed += 1;
        if Instant::now() >= next_report {
            println!("processed {processed}");
            next_report += Duration::from_secs(1);
        }
    }
    let elapsed = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
    println!("done {processed} {elapsed:.3}");
    // Exit without closing the consumer: its close can block for minutes on this
    // single-threaded runtime, and the measurement is over.
    std::io::Write::flush(&mut std::io::stdout())?;
    std::process::exit(0)
}

//! `tally`: the command line for people. `tally get` reads totals (exact, or through the cache,
//! or as displayed); `tally like`/`unlike`/`liked` act on one like per user; `tally load`
//! generates traffic through the producer crate; `tally verify` waits for known totals.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tally_aggregator::compact::Compactor;
use tally_aggregator::load::{self, LoadSpec};
use tally_aggregator::verify;
use tally_common::{CachedReader, Keyspace, Namespaces, Reader, RedisConn};
use tally_producer::{Producer, ProducerConfig, Routing};

#[derive(Debug, Parser)]
#[command(name = "tally", version, about = "Read and generate tally counters")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print `<counter> <total>` for each counter: the exact sum of its shards, or with
    /// `--cached` the total readers are served (cached for the namespace's TTL).
    Get {
        /// Counter ids.
        #[arg(required = true)]
        counters: Vec<String>,
        /// Read through the cache, as a service does.
        #[arg(long)]
        cached: bool,
        /// Print the count as displayed to people (`10.2K`), in the namespace's style.
        #[arg(long)]
        display: bool,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Like a counter as an actor (through Kafka): counted once in a namespace that deduplicates.
    Like {
        /// The counter.
        counter: String,
        /// Who likes it.
        actor: String,
        #[command(flatten)]
        kafka: KafkaArgs,
    },
    /// Take back an actor's like of a counter (through Kafka).
    Unlike {
        /// The counter.
        counter: String,
        /// Whose like.
        actor: String,
        #[command(flatten)]
        kafka: KafkaArgs,
    },
    /// Collapse the shares of cold counters into one key each, crash-safe; once, or in a loop.
    Compact {
        /// Keep compacting, one pass every --interval-ms, until SIGTERM/SIGINT.
        #[arg(long = "loop")]
        repeat: bool,
        /// A counter is cold once its shares have not changed for this long, in ms (0: compact
        /// every counter now).
        #[arg(long, default_value_t = 60_000)]
        cold_after_ms: u64,
        /// Time between passes with --loop, in ms.
        #[arg(long, default_value_t = 5_000)]
        interval_ms: u64,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Show a counter's shard count, its share in each group, and each share's writes per
    /// second over one second.
    Shards {
        /// The counter.
        counter: String,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Print a namespace's fastest-moving counters over the last minute, busiest first.
    Top {
        /// The namespace (`likes` for `likes:post:42`).
        namespace: String,
        /// How many.
        #[arg(short, default_value_t = 10)]
        k: usize,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Print whether an actor's like of a counter is counted (exit 1 if not).
    Liked {
        /// The counter.
        counter: String,
        /// Who.
        actor: String,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Send generated counter events through the producer crate and print what was acknowledged.
    Load {
        /// Kafka bootstrap servers.
        #[arg(long, env = "TALLY_BROKERS", default_value = "127.0.0.1:9092")]
        brokers: String,
        /// Topic to send to.
        #[arg(long, env = "TALLY_TOPIC", default_value = "tally.events")]
        topic: String,
        /// Events to send.
        #[arg(long, default_value_t = 100_000)]
        events: u64,
        /// Distinct counters.
        #[arg(long, default_value_t = 1_000)]
        counters: u64,
        /// Zipf exponent of counter popularity (0 = uniform).
        #[arg(long, default_value_t = 1.1)]
        zipf: f64,
        /// Events per second (0 = as fast as possible).
        #[arg(long, default_value_t = 0)]
        rate: u64,
        /// Partitioning: counter, actor or random.
        #[arg(long, default_value = "counter")]
        routing: Routing,
        /// Counter ids are `<prefix><n>`.
        #[arg(long, default_value = "likes:post:")]
        counter_prefix: String,
        /// Deltas are drawn from 1..=max-delta.
        #[arg(long, default_value_t = 1)]
        max_delta: i64,
        /// Share of events whose delta is negated (0..1).
        #[arg(long, default_value_t = 0.0)]
        negative_share: f64,
        /// Distinct actors (0 = events carry no actor).
        #[arg(long, default_value_t = 10_000)]
        actors: u64,
        /// Random seed.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Share of events sent to one hot counter, `<prefix>hot` (0..1).
        #[arg(long, default_value_t = 0.0)]
        hot_share: f64,
        /// One event per counter (`<prefix><i>` for event i): a stream of distinct counters.
        #[arg(long)]
        distinct: bool,
        /// How many top counters to print.
        #[arg(long, default_value_t = 10)]
        top: usize,
        /// Write every `<counter> <total>` sent to this file.
        #[arg(long)]
        totals_out: Option<PathBuf>,
    },
    /// Wait until Redis holds exactly the totals in a file of `<counter> <total>` lines (as
    /// written by `tally load --totals-out`), then print the largest; exit 1 on a mismatch.
    Verify {
        /// The totals file.
        #[arg(long)]
        totals: PathBuf,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 60)]
        timeout_s: u64,
        /// How many top counters to print.
        #[arg(long, default_value_t = 10)]
        top: usize,
        #[command(flatten)]
        redis: RedisArgs,
    },
}

#[derive(Debug, clap::Args)]
struct KafkaArgs {
    /// Kafka bootstrap servers.
    #[arg(long, env = "TALLY_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Topic to send to.
    #[arg(long, env = "TALLY_TOPIC", default_value = "tally.events")]
    topic: String,
}

#[derive(Debug, clap::Args)]
struct RedisArgs {
    /// Namespace policies (cache TTL, display style), as given to the aggregator.
    #[arg(long, env = "TALLY_NAMESPACES")]
    namespaces: Option<PathBuf>,
    /// Redis URL.
    #[arg(
        long,
        env = "TALLY_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: String,
    /// Key prefix.
    #[arg(long, env = "TALLY_KEY_PREFIX", default_value = "tally")]
    key_prefix: String,
    /// Shard groups.
    #[arg(long, env = "TALLY_SHARD_GROUPS", default_value_t = 16)]
    shard_groups: u32,
}

#[tokio::main]
async fn main() -> anyhow::Result<std::process::ExitCode> {
    match Cli::parse().command {
        Command::Get {
            counters,
            cached,
            display,
            redis,
        } => {
            let namespaces = redis.namespaces()?;
            let reader = CachedReader::new(redis.reader().await?, Arc::new(namespaces));
            let totals = if cached {
                reader.get_many(&counters).await?
            } else {
                let mut exact = Vec::with_capacity(counters.len());
                for counter in &counters {
                    exact.push(reader.get_exact(counter).await?);
                }
                exact
            };
            let mut out = std::io::stdout().lock();
            for (counter, total) in counters.iter().zip(totals) {
                if display {
                    let style = reader.namespaces().policy(counter).display;
                    writeln!(out, "{counter} {}", tally_common::display(total, style))?;
                } else {
                    writeln!(out, "{counter} {total}")?;
                }
            }
        }
        Command::Like {
            counter,
            actor,
            kafka,
        } => {
            let producer = Producer::new(&ProducerConfig::new(kafka.brokers, kafka.topic))?;
            producer.like(&counter, &actor).await?;
        }
        Command::Unlike {
            counter,
            actor,
            kafka,
        } => {
            let producer = Producer::new(&ProducerConfig::new(kafka.brokers, kafka.topic))?;
            producer.unlike(&counter, &actor).await?;
        }
        Command::Compact {
            repeat,
            cold_after_ms,
            interval_ms,
            redis,
        } => {
            let namespaces = Arc::new(redis.namespaces()?);
            let reader = redis.reader().await?;
            let compactor = Compactor::start(
                reader.conn().clone(),
                reader.keyspace().clone(),
                namespaces,
                Duration::from_millis(cold_after_ms),
            )
            .await?;
            let cancel = tally_aggregator::shutdown::on_signals()?;
            loop {
                let r = compactor.pass().await?;
                if !repeat || r.compacted + r.recovered + r.markers_dropped > 0 {
                    println!(
                        "{} candidates: {} compacted in {} moves, {} interrupted moves finished, {} markers dropped",
                        r.candidates, r.compacted, r.moves, r.recovered, r.markers_dropped
                    );
                }
                if !repeat {
                    break;
                }
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(interval_ms)) => {}
                }
            }
        }
        Command::Shards { counter, redis } => {
            let reader = redis.reader().await?;
            let ks = reader.keyspace().clone();
            let mut conn = reader.conn().clone();
            let shards: Option<f64> = redis::cmd("ZSCORE")
                .arg(ks.shards_key())
                .arg(&counter)
                .query_async(&mut conn)
                .await?;
            let read = |mut conn: RedisConn| {
                let ks = ks.clone();
                let counter = counter.clone();
                async move {
                    let mut values = Vec::new();
                    for group in 0..ks.groups() {
                        let v: Option<i64> = redis::cmd("GET")
                            .arg(ks.counter_key(group, &counter))
                            .query_async(&mut conn)
                            .await?;
                        values.push(v);
                    }
                    anyhow::Ok(values)
                }
            };
            let before = read(conn.clone()).await?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let after = read(conn).await?;
            println!(
                "{counter}: {} direct-write shard(s); total {}",
                shards.map_or(1, |s| s as u32),
                reader.get(&counter).await?
            );
            println!(
                "{:>6} {:>6} {:>20} {:>10}",
                "group", "shard", "value", "writes/s"
            );
            for group in 0..ks.groups() {
                let Some(value) = after[group as usize] else {
                    continue;
                };
                let shard = (0..ks.groups()).find(|s| ks.shard_group(&counter, *s) == group);
                let rate = value - before[group as usize].unwrap_or(0);
                println!(
                    "{group:>6} {:>6} {value:>20} {rate:>10}",
                    shard.map_or("-".to_owned(), |s| s.to_string())
                );
            }
        }
        Command::Top {
            namespace,
            k,
            redis,
        } => {
            for (counter, activity) in redis.reader().await?.top(&namespace, k).await? {
                println!("{counter} {activity}");
            }
        }
        Command::Liked {
            counter,
            actor,
            redis,
        } => {
            let liked = redis.reader().await?.has_liked(&counter, &actor).await?;
            println!("{liked}");
            if !liked {
                return Ok(std::process::ExitCode::FAILURE);
            }
        }
        Command::Load {
            brokers,
            topic,
            events,
            counters,
            zipf,
            rate,
            routing,
            counter_prefix,
            max_delta,
            negative_share,
            actors,
            seed,
            hot_share,
            distinct,
            top,
            totals_out,
        } => {
            let config = ProducerConfig::new(brokers, &topic).routing(routing);
            let spec = LoadSpec {
                events,
                counters,
                zipf,
                rate,
                counter_prefix,
                max_delta,
                negative_share,
                actors,
                seed,
                hot_share,
                distinct,
                ..LoadSpec::default()
            };
            let report = load::run(&config, &spec).await?;
            println!(
                "sent {} events ({} failed) over {} counters to {topic} in {:.2}s: {:.0} events/s",
                report.acked,
                report.failed,
                report.totals.len(),
                report.elapsed.as_secs_f64(),
                report.events_per_second()
            );
            if top > 0 {
                println!("top counters (as sent):");
                for (counter, total) in report.top(top) {
                    println!("  {counter} {total}");
                }
            }
            if let Some(path) = totals_out {
                let mut lines: Vec<String> = report
                    .totals
                    .iter()
                    .map(|(c, t)| format!("{c} {t}\n"))
                    .collect();
                lines.sort();
                std::fs::write(&path, lines.concat())
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(error) = report.first_error {
                eprintln!("{} events failed; first error: {error}", report.failed);
                return Ok(std::process::ExitCode::FAILURE);
            }
        }
        Command::Verify {
            totals,
            timeout_s,
            top,
            redis,
        } => {
            let text = std::fs::read_to_string(&totals)
                .with_context(|| format!("reading {}", totals.display()))?;
            let expected = verify::parse_totals(&text).map_err(anyhow::Error::msg)?;
            let reader = redis.reader().await?;
            match verify::wait_for_totals(&reader, &expected, Duration::from_secs(timeout_s)).await
            {
                Ok(waited) => {
                    println!(
                        "all {} counters match what was sent (waited {:.2}s)",
                        expected.len(),
                        waited.as_secs_f64()
                    );
                    let mut largest: Vec<(&String, &i64)> = expected.iter().collect();
                    largest.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
                    largest.truncate(top);
                    let names: Vec<&String> = largest.iter().map(|(c, _)| *c).collect();
                    let read = reader.get_many(&names).await?;
                    println!("{:<28} {:>12} {:>12}", "counter", "sent", "in redis");
                    for ((counter, sent), got) in largest.iter().zip(read) {
                        println!("{counter:<28} {sent:>12} {got:>12}");
                    }
                }
                Err(mismatch) => {
                    eprintln!("{mismatch}");
                    return Ok(std::process::ExitCode::FAILURE);
                }
            }
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

impl RedisArgs {
    fn namespaces(&self) -> anyhow::Result<Namespaces> {
        Ok(match &self.namespaces {
            Some(path) => Namespaces::from_file(path)?,
            None => Namespaces::default(),
        })
    }

    async fn reader(&self) -> anyhow::Result<Reader> {
        let conn = RedisConn::connect(&self.redis_url).await?;
        Ok(Reader::new(
            conn,
            Keyspace::new(self.key_prefix.clone(), self.shard_groups)?,
        ))
    }
}

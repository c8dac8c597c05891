//! The command line's grammar: every subcommand and its flags (clap derives), and the few helpers
//! that turn shared flags into clients. What each subcommand does is in `main.rs`.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use tally_cli::dead_letters;
use tally_common::{Keyspace, Namespaces, Reader, RedisConn, defaults};
use tally_ops::config::Store;
use tally_producer::{Producer, ProducerConfig, Routing};

#[derive(Debug, Parser)]
#[command(name = "tally", version, about = "Read and generate tally counters")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Print `<counter> <total>` for each counter: the exact sum of its shards, or with
    /// `--cached` the total readers are served (cached for the namespace's TTL).
    Get(GetArgs),
    /// Like a counter as an actor (through Kafka): counted once in a namespace that deduplicates.
    Like(LikeArgs),
    /// Take back an actor's like of a counter (through Kafka).
    Unlike(LikeArgs),
    /// Reset counters to zero through Kafka: ordered with their increments, everything before
    /// is cleared (every share, member set and pending compaction journal), everything after
    /// counts.
    Reset(ResetArgs),
    /// Collapse the shares of cold counters into one key each, crash-safe; once, or in a loop.
    Compact(CompactArgs),
    /// Show a counter's shard count, its share in each group, and each share's writes per
    /// second over one second.
    Shards(CounterArgs),
    /// Print a namespace's fastest-moving counters over the last minute, busiest first.
    Top(TopArgs),
    /// Print whether an actor's like of a counter is counted (exit 1 if not).
    Liked(LikedArgs),
    /// Send generated counter events through the producer crate and print what was acknowledged.
    Load(LoadArgs),
    /// Wait until Redis holds exactly the totals in a file of `<counter> <total>` lines (as
    /// written by `tally load --totals-out`), then print the largest; exit 1 on a mismatch.
    Verify(VerifyArgs),
    /// Recount the log up to the durable offsets and compare every counter with the store:
    /// print the counters checked, those off and the largest differences; exit 1 on any drift.
    Audit(AuditArgs),
    /// List the dead-letter topic's messages, or put them back on the topic they came from.
    #[command(subcommand)]
    DeadLetters(DeadLettersCommand),
    /// Move a deployment's likes from the shares to count sets (about half of Redis's work per
    /// like): stop every writer (aggregators, services writing likes directly) first, run this
    /// with their namespaces file, then start writers of this version. Run it again to finish
    /// an interrupted move; print what it moved. With --dry-run, change nothing and print what
    /// it would move, or the set it would stop at.
    LikesToSets(LikesToSetsArgs),
    /// Upkeep of the window buckets: drop expired ones, or migrate the keys of the old layout.
    #[command(subcommand)]
    Windows(WindowsCommand),
    /// Change a running deployment's number of shard groups, without a restart. Growing (more
    /// Redis Cluster masters can then take its writes): readers sum the new groups first, then
    /// aggregators place new offsets in them. Shrinking, down to the original count: writers
    /// first, then the retired groups' shares are folded into the groups left (on a Redis
    /// Cluster, each move's steps 2 s apart), then readers; their window buckets are read where
    /// they are until they expire. At the count in use: folds stray shares (standalone Redis
    /// only) and sets the groups windowed reads sum.
    /// Prints each step and waits for every partition's owner to move; exit 1 if some did not
    /// within --wait (run it again: it picks up where it stopped).
    Regroup(RegroupArgs),
    /// Pack the counters' shares into small hashes, a field per counter (about a third of
    /// Redis's memory per counter, for some more CPU per write), without a restart: readers
    /// sum the fields first, then each group's writers pack, then the keys already written are
    /// moved into their fields. Every reader and writer must be of this version. Set once; run
    /// it again to pack keys written since by writers that keep to keys, or groups grown into.
    Pack(PackArgs),
}

#[derive(Debug, clap::Args)]
pub(crate) struct PackArgs {
    /// Packed hashes per shard group, a power of two: about the counters a group will hold
    /// over 30-60 (Redis keeps a hash of up to `hash-max-listpack-entries` compact, 512 without
    /// a config file, and scans it on every write).
    #[arg(long)]
    pub(crate) buckets: u32,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct RegroupArgs {
    /// The new number of shard groups (at least the original count; --shard-groups stays the
    /// deployment's original count).
    #[arg(long)]
    pub(crate) to: u32,
    /// Seconds to wait for every partition's owner to move (0: do not wait).
    #[arg(long, default_value_t = 60)]
    pub(crate) wait: u64,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

#[derive(Debug, Subcommand)]
pub(crate) enum WindowsCommand {
    /// Drop every expired bucket (by the namespaces' windows as given with --namespaces: a
    /// window no longer listed has expired) and the fields left empty; print what it did.
    Sweep(RedisArgs),
    /// Fold the keys of the layout before cells (a key per bucket) into the cells, deleting
    /// each as it is folded; print what it did. Run once after upgrading every aggregator.
    Migrate(RedisArgs),
}

#[derive(Debug, Subcommand)]
pub(crate) enum DeadLettersCommand {
    /// Print one line per dead letter that passes the filter: where it is, when, why, where it
    /// came from, its key and the error.
    List(DeadLetterArgs),
    /// Put the original key and bytes of each dead letter that passes the filter back on its
    /// source topic, each at most once per --group even when killed and run again (Kafka
    /// transactions carry the replay's progress). Fix the cause first.
    Replay(ReplayArgs),
}

#[derive(Debug, clap::Args)]
pub(crate) struct DeadLetterArgs {
    /// Kafka bootstrap servers.
    #[arg(long, env = "TALLY_BROKERS", default_value = defaults::BROKERS)]
    pub(crate) brokers: String,
    /// The dead-letter topic.
    #[arg(long, env = "TALLY_DEAD_LETTER_TOPIC", default_value = defaults::DEAD_LETTER_TOPIC)]
    pub(crate) dead_letter_topic: String,
    /// Only dead letters with this reason (`overflow`, `undecodable`...); repeat for more.
    #[arg(long = "reason")]
    pub(crate) reasons: Vec<String>,
    /// Only those read from this partition of the source topic.
    #[arg(long)]
    pub(crate) partition: Option<i32>,
    /// Only those dead-lettered since: a duration ago (`2h`) or Unix ms.
    #[arg(long, value_parser = parse_since)]
    pub(crate) since: Option<i64>,
    /// Only those dead-lettered before: a duration ago or Unix ms.
    #[arg(long, value_parser = parse_since)]
    pub(crate) until: Option<i64>,
    /// A librdkafka setting (security settings, say), as `key=value`.
    #[arg(long = "kafka-option", value_parser = tally_ops::config::parse_key_value)]
    pub(crate) kafka_options: Vec<(String, String)>,
}

impl DeadLetterArgs {
    pub(crate) fn kafka(&self) -> rdkafka::ClientConfig {
        let mut kafka = rdkafka::ClientConfig::new();
        kafka.set("bootstrap.servers", &self.brokers);
        for (key, value) in &self.kafka_options {
            kafka.set(key, value);
        }
        kafka
    }

    pub(crate) fn filter(&self) -> dead_letters::Filter {
        dead_letters::Filter {
            reasons: self.reasons.clone(),
            source_partition: self.partition,
            since_ms: self.since,
            until_ms: self.until,
        }
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct ReplayArgs {
    #[command(flatten)]
    pub(crate) letters: DeadLetterArgs,
    /// The replay's consumer group: what it replayed (or passed over) it never takes again. A
    /// replay with another filter over the same letters takes another group.
    #[arg(long, default_value = "tally-dead-letter-replay")]
    pub(crate) group: String,
    /// Put them on this topic instead of each one's source topic.
    #[arg(long)]
    pub(crate) to: Option<String>,
    /// Dead letters per transaction.
    #[arg(long, default_value_t = 500)]
    pub(crate) chunk: usize,
}

#[derive(Debug, clap::Args)]
pub(crate) struct GetArgs {
    /// Counter ids.
    #[arg(required = true)]
    pub(crate) counters: Vec<String>,
    /// Read through the cache, as a service does.
    #[arg(long)]
    pub(crate) cached: bool,
    /// Print the count as displayed to people (`10.2K`), in the namespace's style.
    #[arg(long)]
    pub(crate) display: bool,
    /// Print the sum over the last span instead (`24h`, `7d`, `90m`), from the namespace's
    /// windows (the current bucket and those before it).
    #[arg(long, value_parser = tally_common::window::parse_duration)]
    pub(crate) window: Option<i64>,
    /// Where the aggregator stores counts: redis, or postgres (the share rows, with Redis as
    /// the cache of totals).
    #[arg(long, env = "TALLY_STORE", value_enum, default_value = "redis")]
    pub(crate) store: Store,
    /// PostgreSQL, with --store postgres (a password only through TALLY_POSTGRES_PASSWORD or
    /// TALLY_POSTGRES_URL).
    #[arg(long, env = "TALLY_POSTGRES_URL", hide_env_values = true)]
    pub(crate) postgres_url: Option<String>,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct LikeArgs {
    /// The counter.
    pub(crate) counter: String,
    /// Whose like.
    pub(crate) actor: String,
    #[command(flatten)]
    pub(crate) kafka: KafkaArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ResetArgs {
    /// The counters.
    #[arg(required = true)]
    pub(crate) counters: Vec<String>,
    #[command(flatten)]
    pub(crate) kafka: KafkaArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct LikesToSetsArgs {
    /// Change nothing: check the record and every member set as the move would, and print what
    /// it would move (writers may keep running meanwhile).
    #[arg(long)]
    pub(crate) dry_run: bool,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct CompactArgs {
    /// Keep compacting, one pass every --interval-ms, until SIGTERM/SIGINT.
    #[arg(long = "loop")]
    pub(crate) repeat: bool,
    /// A counter is cold once its shares have not changed for this long, in ms (0: compact
    /// every counter now).
    #[arg(long, default_value_t = 60_000)]
    pub(crate) cold_after_ms: u64,
    /// Time between passes with --loop, in ms.
    #[arg(long, default_value_t = 5_000)]
    pub(crate) interval_ms: u64,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct CounterArgs {
    /// The counter.
    pub(crate) counter: String,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct TopArgs {
    /// The namespace (`likes` for `likes:post:42`).
    pub(crate) namespace: String,
    /// How many.
    #[arg(short, default_value_t = 10)]
    pub(crate) k: usize,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct LikedArgs {
    /// The counter.
    pub(crate) counter: String,
    /// Who.
    pub(crate) actor: String,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct LoadArgs {
    #[command(flatten)]
    pub(crate) kafka: KafkaArgs,
    /// Events to send.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) events: u64,
    /// Distinct counters.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) counters: u64,
    /// Zipf exponent of counter popularity (0 = uniform).
    #[arg(long, default_value_t = 1.1)]
    pub(crate) zipf: f64,
    /// Events per second (0 = as fast as possible).
    #[arg(long, default_value_t = 0)]
    pub(crate) rate: u64,
    /// Partitioning: counter, actor or random.
    #[arg(long, default_value = "counter")]
    pub(crate) routing: Routing,
    /// Counter ids are `<prefix><n>`.
    #[arg(long, default_value = "likes:post:")]
    pub(crate) counter_prefix: String,
    /// Deltas are drawn from 1..=max-delta.
    #[arg(long, default_value_t = 1)]
    pub(crate) max_delta: i64,
    /// Share of events whose delta is negated (0..1).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) negative_share: f64,
    /// Distinct actors (0 = events carry no actor).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) actors: u64,
    /// Random seed.
    #[arg(long, default_value_t = 42)]
    pub(crate) seed: u64,
    /// Share of events sent to one hot counter, `<prefix>hot` (0..1).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) hot_share: f64,
    /// One event per counter (`<prefix><i>` for event i): a stream of distinct counters.
    #[arg(long)]
    pub(crate) distinct: bool,
    /// How many top counters to print.
    #[arg(long, default_value_t = 10)]
    pub(crate) top: usize,
    /// Write every `<counter> <total>` sent to this file.
    #[arg(long)]
    pub(crate) totals_out: Option<PathBuf>,
    /// Give each event an id, `e<i>` (namespaces with idempotency keys).
    #[arg(long)]
    pub(crate) event_ids: bool,
    /// Sending threads, each with its own producer. 0: one per core (up to 4) for an unpaced
    /// load, one for a paced load. With more than one, a paced load's draws are no longer in
    /// the same order for the same seed.
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
    /// Who sends: direct (tally's own appender), librdkafka, or auto (direct unless an option
    /// needs librdkafka).
    #[arg(long, default_value = "auto")]
    pub(crate) producer: tally_producer::BulkPath,
}

#[derive(Debug, clap::Args)]
pub(crate) struct VerifyArgs {
    /// The totals file.
    #[arg(long)]
    pub(crate) totals: PathBuf,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 60)]
    pub(crate) timeout_s: u64,
    /// How many top counters to print.
    #[arg(long, default_value_t = 10)]
    pub(crate) top: usize,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct AuditArgs {
    #[command(flatten)]
    pub(crate) kafka: KafkaArgs,
    /// The aggregators' consumer group (its committed offsets are the durable ones where no
    /// exactly-once watermark is stored).
    #[arg(long, env = "TALLY_GROUP", default_value = defaults::GROUP)]
    pub(crate) group: String,
    /// A librdkafka setting for the audit's consumer (security settings, say), as `key=value`.
    #[arg(long = "kafka-option", value_parser = tally_ops::config::parse_key_value)]
    pub(crate) kafka_options: Vec<(String, String)>,
    /// Messages larger than this are dead letters, as the aggregator's max_message_bytes.
    #[arg(long, env = "TALLY_MAX_MESSAGE_BYTES", default_value_t = tally_common::codec::DEFAULT_MAX_MESSAGE_BYTES)]
    pub(crate) max_message_bytes: usize,
    /// How many of the largest differences to print.
    #[arg(long, default_value_t = 10)]
    pub(crate) top: usize,
    /// Audit only the log from this time: a duration ago (`2h`) or Unix ms. Totals include
    /// older events, so only the window buckets wholly inside the range are compared.
    #[arg(long, value_parser = parse_since)]
    pub(crate) since: Option<i64>,
    #[command(flatten)]
    pub(crate) redis: RedisArgs,
}

/// `--since`: Unix ms, or a duration ago.
pub(crate) fn parse_since(text: &str) -> Result<i64, String> {
    if let Ok(ms) = text.parse::<i64>() {
        return Ok(ms);
    }
    let ago = tally_common::window::parse_duration(text)?;
    Ok(tally_common::event::now_ms() - ago)
}

#[derive(Debug, clap::Args)]
pub(crate) struct KafkaArgs {
    /// Kafka bootstrap servers.
    #[arg(long, env = "TALLY_BROKERS", default_value = defaults::BROKERS)]
    pub(crate) brokers: String,
    /// Topic to send to.
    #[arg(long, env = "TALLY_TOPIC", default_value = defaults::TOPIC)]
    pub(crate) topic: String,
}

#[derive(Debug, clap::Args)]
pub(crate) struct RedisArgs {
    /// Namespace policies (cache TTL, display style), as given to the aggregator.
    #[arg(long, env = "TALLY_NAMESPACES")]
    pub(crate) namespaces: Option<PathBuf>,
    /// Redis URL.
    #[arg(long, env = "TALLY_REDIS_URL", default_value = defaults::REDIS_URL)]
    pub(crate) redis_url: String,
    /// Key prefix.
    #[arg(long, env = "TALLY_KEY_PREFIX", default_value = defaults::KEY_PREFIX)]
    pub(crate) key_prefix: String,
    /// Shard groups.
    #[arg(long, env = "TALLY_SHARD_GROUPS", default_value_t = defaults::SHARD_GROUPS)]
    pub(crate) shard_groups: u32,
}

impl RedisArgs {
    pub(crate) fn namespaces(&self) -> anyhow::Result<Namespaces> {
        Ok(match &self.namespaces {
            Some(path) => Namespaces::from_file(path)?,
            None => Namespaces::default(),
        })
    }

    pub(crate) async fn reader(&self) -> anyhow::Result<Reader> {
        let conn = RedisConn::connect(&self.redis_url).await?;
        Ok(Reader::new(
            conn,
            Keyspace::new(self.key_prefix.clone(), self.shard_groups)?,
        ))
    }
}

impl KafkaArgs {
    pub(crate) fn producer(&self) -> anyhow::Result<Producer> {
        Ok(Producer::new(&ProducerConfig::new(
            &self.brokers,
            &self.topic,
        ))?)
    }
}

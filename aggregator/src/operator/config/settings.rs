//! Every setting of the aggregator, declared once with `tally_ops::settings!` (as
//! `tally-server`'s are): [`Settings`] (what a file, the environment or flags gave), their merge
//! ([`Settings::overridden_by`]), [`Values`] (every default filled in), the `[default: ...]` of
//! each flag's help ([`with_defaults_in_help`]), and [`Settings::defaults`] (with
//! `Settings::names` in tests), which a test holds `deploy/aggregator.example.toml` and the
//! Kubernetes config to.

use std::net::SocketAddr;
use std::path::PathBuf;

use tally_common::{GroupingRule, defaults};
use tally_ops::config::Store;
use tally_ops::settings::{Shown, value_enum_name};

use super::choices::{Atomicity, Delivery, Fetch, LogFormat};

macro_rules! shown_by_value_enum {
    ($($t:ty),*) => {
        $( impl Shown for $t { fn shown(&self) -> String { value_enum_name(self) } } )*
    };
}
shown_by_value_enum!(LogFormat, Delivery, Atomicity, Fetch);

tally_ops::settings! {
    defaulted {
        /// Kafka bootstrap servers
        brokers: String = defaults::BROKERS.to_owned(), "TALLY_BROKERS", [];
        /// Topic holding counter events
        topic: String = defaults::TOPIC.to_owned(), "TALLY_TOPIC", [];
        /// Kafka consumer group
        group: String = defaults::GROUP.to_owned(), "TALLY_GROUP", [];
        /// Redis URL: redis://host:port/db, or redis+cluster://host:port,host:port for a cluster
        redis_url: String = defaults::REDIS_URL.to_owned(), "TALLY_REDIS_URL", [hide_env_values = true];
        /// Flush each partition's buffer every this many ms (partitions at staggered moments), so no event waits longer
        flush_interval_ms: u64 = 1_000, "TALLY_FLUSH_INTERVAL_MS", [];
        /// Flush a partition's buffer once it holds this many events
        max_batch_events: usize = 200_000, "TALLY_MAX_BATCH_EVENTS", [];
        /// Flush a partition's buffer once it holds this many distinct (group, counter) pairs (a counter's likes are one, and every 8 of its memberships one more, every 32 where the Redis sink writes every deduplicating namespace's sets before its flush script; and a flush is cut sooner if one group's memberships reach this many times that weight over 24, one viral counter's likes being one transaction; with WATCH/MULTI/EXEC transactions, also once one group holds 512 entries); bounds how long one flush script blocks Redis: a flush holds at most twice this, as the buffer keeps filling while the previous flush lands
        max_batch_counters: usize = 5_000, "TALLY_MAX_BATCH_COUNTERS", [];
        /// While a partition catches up (its log holds at least 1,000 events more than it has read), flush its buffer once it holds this many events, not by the clock
        catch_up_max_batch_events: usize = 1_000_000, "TALLY_CATCH_UP_MAX_BATCH_EVENTS", [];
        /// While a partition catches up, flush its buffer once it holds this many distinct (group, counter) pairs; bounds a catch-up flush script as --max-batch-counters bounds a live one
        catch_up_max_batch_counters: usize = 15_000, "TALLY_CATCH_UP_MAX_BATCH_COUNTERS", [];
        /// While a partition catches up, flush its buffer at least this often, in ms, so its offsets move and its counts show
        catch_up_flush_interval_ms: u64 = 10_000, "TALLY_CATCH_UP_FLUSH_INTERVAL_MS", [];
        /// Address serving /metrics and /healthz
        metrics_addr: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 9464)), "TALLY_METRICS_ADDR", [];
        /// Topic receiving malformed messages
        dead_letter_topic: String = defaults::DEAD_LETTER_TOPIC.to_owned(), "TALLY_DEAD_LETTER_TOPIC", [];
        /// Prefix of every Redis key
        key_prefix: String = defaults::KEY_PREFIX.to_owned(), "TALLY_KEY_PREFIX", [];
        /// Number of shard groups a counter is spread over; fixed for a deployment
        shard_groups: u32 = defaults::SHARD_GROUPS, "TALLY_SHARD_GROUPS", [];
        /// Largest message accepted; larger ones are dead-lettered, in bytes
        max_message_bytes: usize = 16_384, "TALLY_MAX_MESSAGE_BYTES", [];
        /// Longest a graceful shutdown may spend flushing, in ms
        shutdown_timeout_ms: u64 = 30_000, "TALLY_SHUTDOWN_TIMEOUT_MS", [];
        /// Longest a rebalance may spend flushing revoked partitions, in ms
        revoke_timeout_ms: u64 = 20_000, "TALLY_REVOKE_TIMEOUT_MS", [];
        /// How often a partition with nothing to flush checks that Redis still holds its writes (exactly-once), in ms
        check_idle_interval_ms: u64 = 5_000, "TALLY_CHECK_IDLE_INTERVAL_MS", [];
        /// Longest wait between two retries of a failed flush, in ms
        retry_max_backoff_ms: u64 = 2_000, "TALLY_RETRY_MAX_BACKOFF_MS", [];
        /// Delivery guarantee
        delivery: Delivery = Delivery::default(), "TALLY_DELIVERY", [value_enum];
        /// Which shard group an event's delta goes to: its partition's (partition), its actor's (actor) or its counter's (counter)
        grouping: GroupingRule = GroupingRule::default(), "TALLY_GROUPING", [];
        /// Raise a directly written counter's shard count when one shard takes more than this many writes per second; 0 turns the shard monitor off
        shard_threshold: u64 = 1_000, "TALLY_SHARD_THRESHOLD", [];
        /// How often the trending counters seen are published and the hot set (kept warm in the read cache) renewed, in ms; 0 turns trending off
        trending_interval_ms: u64 = 5_000, "TALLY_TRENDING_INTERVAL_MS", [];
        /// How exactly-once writes are made atomic: Lua scripts, WATCH/MULTI/EXEC transactions (for servers that refuse scripts; standalone Redis only), or scripts with a fallback
        redis_atomicity: Atomicity = Atomicity::default(), "TALLY_REDIS_ATOMICITY", [value_enum];
        /// Log format
        log_format: LogFormat = LogFormat::default(), "TALLY_LOG_FORMAT", [value_enum];
        /// Where counts are stored: redis, or postgres (share rows in PostgreSQL, the store of record; Redis keeps the cache of totals)
        store: Store = Store::default(), "TALLY_STORE", [value_enum];
        /// Most PostgreSQL connections held with --store postgres
        postgres_pool_size: usize = 16, "TALLY_POSTGRES_POOL_SIZE", [];
        /// Longest one PostgreSQL statement may run before the server cancels it (the flush is then retried), in ms
        postgres_statement_timeout_ms: u64 = 10_000, "TALLY_POSTGRES_STATEMENT_TIMEOUT_MS", [];
        /// How partitions are read: direct (tally's own fetcher, straight from the leaders), librdkafka, or auto (direct unless a Kafka option needs librdkafka)
        fetch: Fetch = Fetch::default(), "TALLY_FETCH", [value_enum];
    }
    optional {
        /// Shard groups one partition's counters are spread over (by a hash of the counter), so that a catch-up flush is that many short Redis scripts rather than one long one [default: 4, or 1 with --store postgres]
        partition_spread: u32, "TALLY_PARTITION_SPREAD", [];
        /// TOML file of namespace policies (docs/namespaces.md): dedup, cache TTL, grouping per namespace [default: none, every namespace gets the defaults]
        namespaces: PathBuf, "TALLY_NAMESPACES", [];
        /// PostgreSQL for --store postgres: postgres://user@host:port/db; a password only through TALLY_POSTGRES_PASSWORD, TALLY_POSTGRES_URL or the file [default: none]
        postgres_url: String, "TALLY_POSTGRES_URL", [hide_env_values = true];
    }
}

/// `command` with `[default: ...]` added to the help of each setting that has a default.
pub fn with_defaults_in_help(command: clap::Command) -> clap::Command {
    tally_ops::settings::with_defaults_in_help(command, &Settings::defaults())
}

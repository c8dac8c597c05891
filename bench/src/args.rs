//! The benchmark's command line.

use std::path::PathBuf;

use clap::Parser;
use tally_common::defaults;

/// Scenario sizes and where things are. Defaults finish in a few minutes on 2 cores.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "tally-bench",
    about = "Measure tally against the machine's limits and the naive design"
)]
pub struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, env = "TALLY_BROKERS", default_value = defaults::BROKERS)]
    pub brokers: String,
    /// Redis URL (the local standalone server).
    #[arg(long, env = "TALLY_REDIS_URL", default_value = defaults::REDIS_URL)]
    pub redis_url: String,
    /// Where the release binaries are.
    #[arg(long, default_value = "target/release")]
    pub bin_dir: PathBuf,
    /// Where results.json, results.md and the plots go.
    #[arg(long, default_value = "bench-results")]
    pub out: PathBuf,
    /// Events preloaded for the catch-up and producer scenarios.
    #[arg(long, default_value_t = 5_000_000)]
    pub events: u64,
    /// Distinct counters they are spread over (Zipf).
    #[arg(long, default_value_t = 100_000)]
    pub counters: u64,
    /// Zipf exponent of counter popularity.
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    /// Partitions of every benchmark topic.
    #[arg(long, default_value_t = 8)]
    pub partitions: i32,
    /// How long the naive consumer runs (it is far too slow to catch up with all events).
    #[arg(long, default_value_t = 20)]
    pub naive_seconds: u64,
    /// How long the steady-state scenario runs.
    #[arg(long, default_value_t = 20)]
    pub steady_seconds: u64,
    /// Background rate of the steady-state scenario, events/s; by default half of what the
    /// producer and the exactly-once catch-up measured in this run sustain together,
    /// 1 / (1/producer + 1/catch-up) (400,000 when neither ran)
    #[arg(long)]
    pub steady_rate: Option<f64>,
    /// Rounds of the windows scenario: each runs the catch-up with 0, 1 and 3 windows, in
    /// alternating order (0, 1, 3, then 3, 1, 0), so that the machine's drift falls on every
    /// variant alike; ratios are taken within a round.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub windows_rounds: u32,
    /// Rounds of the dedup and idempotency scenarios (each runs the catch-up without and with
    /// the feature, in alternating order; ratios are taken within a round) and of the
    /// cardinality scenario (each its catch-up, then Redis's own floor for the same writes).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Events of the hot-counter scenario (90% on one counter).
    #[arg(long, default_value_t = 2_000_000)]
    pub hot_events: u64,
    /// Events of the regroup scenario's topic: enough for its catch-up to outlast the
    /// re-grouping (3 s of it are the readers' leases).
    #[arg(long, default_value_t = 30_000_000)]
    pub regroup_events: u64,
    /// Distinct counters of the cardinality scenario (one event each).
    #[arg(long, default_value_t = 1_000_000)]
    pub distinct: u64,
    /// Packed hashes per group of the cardinality scenario's packed catch-up (`tally pack
    /// --buckets`): about 61 counters each at the default 1,000,000 counters over 16 groups.
    #[arg(long, default_value_t = 1_024)]
    pub packed_buckets: u32,
    /// Operations per read measurement.
    #[arg(long, default_value_t = 2_000)]
    pub reads: usize,
    /// An extra argument for every tally-aggregator the scenarios start (repeat it), e.g.
    /// `--aggregator-arg=--max-batch-counters=20000`: to see what a setting does to the figures.
    #[arg(long = "aggregator-arg", allow_hyphen_values = true)]
    pub aggregator_args: Vec<String>,
    /// PostgreSQL for the postgres scenario (`deploy/local/start.sh` starts this one).
    #[arg(long, default_value = "postgres://tally@127.0.0.1:5433/postgres")]
    pub postgres_url: String,
    /// Run only these scenarios (producer, catch-up, json, postgres, windows, dedup, members,
    /// expiry, idempotency, partitions, rebalance, regroup, naive, yardsticks, steady,
    /// steady-windows, steady-likes, hot, hot-likes, cardinality, reads, micro); all when empty.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Run nothing: read this `results.json` and write its report again into `--out`
    /// (`results.json`, `results.md`, `capacity.md`, the sizing guide, and the plots), taking
    /// `--events`, `--counters`, `--zipf` and `--partitions` as the run's.
    #[arg(long)]
    pub capacity_from: Option<PathBuf>,
}

impl Args {
    /// Whether `scenario` is to run.
    pub fn runs(&self, scenario: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|s| s == scenario)
    }
}

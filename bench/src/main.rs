//! `tally-bench`: measures tally against this machine's own limits and against the naive
//! design, in one run, on the local Kafka and Redis (`deploy/local/start.sh`); it starts nothing
//! else but the processes it measures.
//!
//! Yardsticks, measured in the same run: `kcat` consuming and producing the same number of
//! same-sized messages (librdkafka's own ceilings here), `redis-benchmark` with pipelined
//! `INCRBY`s over random keys, and `tally-naive` (one `INCRBY` and one commit per event).
//! Scenarios: catch-up (both delivery modes, and the naive consumer), catch-up of JSON written
//! by an independent producer (`kcat -P -K`), producer (each routing),
//! steady state with end-to-end latency, a hot counter, a million distinct counters, reads.
//! Every figure comes with its ratio to a yardstick where one applies. Output: `results.json`,
//! `results.md` and SVG plots in `--out`.
//!
//! Run it through `deploy/local/bench.sh`, which builds the release binaries first.
//!
//! # Layout
//! - [`probe`]: CPU time and peak RSS from `/proc`, Prometheus metrics, Redis command counts.
//! - [`scenarios`]: each scenario and yardstick.
//! - [`report`]: `results.json`, `results.md` and the plots ([`svg`]).

mod probe;
mod report;
mod scenarios;
mod svg;

use std::path::PathBuf;

use clap::Parser;

/// Scenario sizes and where things are. Defaults finish in a few minutes on 2 cores.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "tally-bench",
    about = "Measure tally against the machine's limits and the naive design"
)]
pub struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, env = "TALLY_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,
    /// Redis URL (the local standalone server).
    #[arg(
        long,
        env = "TALLY_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
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
    /// Background rate of the steady-state scenario, events/s; by default half of the slower of
    /// the producer and the exactly-once catch-up measured in the same run (200,000 when
    /// neither ran).
    #[arg(long)]
    pub steady_rate: Option<f64>,
    /// Events of the hot-counter scenario (90% on one counter).
    #[arg(long, default_value_t = 2_000_000)]
    pub hot_events: u64,
    /// Distinct counters of the cardinality scenario (one event each).
    #[arg(long, default_value_t = 1_000_000)]
    pub distinct: u64,
    /// Operations per read measurement.
    #[arg(long, default_value_t = 2_000)]
    pub reads: usize,
    /// An extra argument for every tally-aggregator the scenarios start (repeat it), e.g.
    /// `--aggregator-arg=--max-batch-counters=20000`: to see what a setting does to the figures.
    #[arg(long = "aggregator-arg", allow_hyphen_values = true)]
    pub aggregator_args: Vec<String>,
    /// Run only these scenarios (producer, catch-up, json, naive, yardsticks, steady, hot,
    /// cardinality, reads, micro); all when empty.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
}

impl Args {
    /// Whether `scenario` is to run.
    pub fn runs(&self, scenario: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|s| s == scenario)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out)?;
    let results = scenarios::run_all(&args).await?;
    report::write(&args, &results)?;
    println!(
        "wrote {} and {}",
        args.out.join("results.json").display(),
        args.out.join("results.md").display()
    );
    Ok(())
}

//! `tally-bench`: measures tally against this machine's own limits and against the naive
//! design, in one run, on the local Kafka and Redis (`deploy/local/start.sh`); it starts nothing
//! else but the processes it measures.
//!
//! Yardsticks, measured in the same run: `kcat` consuming and producing the same number of
//! same-sized messages (librdkafka's own ceilings here), `redis-benchmark` with pipelined
//! `INCRBY`s over random keys, and `tally-naive` (one `INCRBY` and one commit per event).
//! Scenarios: catch-up (both delivery modes, and the naive consumer), catch-up of JSON written
//! by an independent producer (`kcat -P -K`), producer (each routing),
//! steady state with end-to-end latency, rebalances under a steady stream (a member SIGKILLed,
//! one joining, a rolling restart), a hot counter, a million distinct counters, reads.
//! Every figure comes with its ratio to a yardstick where one applies. Output: `results.json`,
//! `results.md` and SVG plots in `--out`.
//!
//! Run it through `deploy/local/bench.sh`, which builds the release binaries first.
//!
//! # Layout
//! - [`args`]: the command line.
//! - [`probe`]: CPU time and peak RSS from `/proc`, Prometheus metrics, Redis command counts.
//! - [`env`](mod@env): the run's names, topics and Redis, and starting the release binaries.
//! - [`scenarios`]: each scenario and yardstick, one module per kind.
//! - [`results`]: what was measured.
//! - [`report`]: `results.json`, `results.md` and the plots ([`svg`]).
//! - [`capacity`]: `capacity.md`, the sizing guide computed from the results.

mod args;
mod capacity;
mod env;
mod probe;
mod report;
mod results;
mod scenarios;
mod svg;

use clap::Parser;

use crate::args::Args;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out)?;
    if let Some(path) = &args.capacity_from {
        let results: results::Results = serde_json::from_slice(&std::fs::read(path)?)?;
        report::write(&args, &results)?;
        println!(
            "wrote the report of {} again into {}",
            path.display(),
            args.out.display()
        );
        return Ok(());
    }
    let results = scenarios::run_all(&args).await?;
    report::write(&args, &results)?;
    println!(
        "wrote {} and {}",
        args.out.join("results.json").display(),
        args.out.join("results.md").display()
    );
    Ok(())
}

//! The JSON catch-up: events written by an independent producer (`kcat -P -K` from a generated
//! file of JSON lines), read by the aggregator and by `kcat -C`.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::yardsticks::{kcat_consume, kcat_produce_file};
use crate::args::Args;
use crate::env::Env;
use crate::results::Results;

/// Writes `events` JSON events in the documented wire format as `key<TAB>value` lines, keyed by
/// counter id (Zipf over `counters`), a quarter each with every field, an actor only, a delta
/// and a time, and the counter alone; returns how many distinct counters they name.
pub(crate) fn write_json_events(path: &Path, args: &Args) -> anyhow::Result<u64> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut rng = StdRng::seed_from_u64(7);
    let zipf = rand_distr::Zipf::new(args.counters as f64, args.zipf)?;
    let mut seen = vec![false; args.counters as usize + 1];
    let ts = 1_764_460_800_000u64;
    for i in 0..args.events {
        let n = rng.sample(zipf) as usize;
        seen[n.min(args.counters as usize)] = true;
        let actor = i % 9_973;
        let counter = format!("likes:post:{n}");
        match i % 4 {
            0 => writeln!(
                out,
                r#"{counter}	{{"counter":"{counter}","delta":1,"actor":"u{actor}","ts_ms":{}}}"#,
                ts + i
            )?,
            1 => writeln!(
                out,
                r#"{counter}	{{"counter":"{counter}","actor":"u{actor}"}}"#
            )?,
            2 => writeln!(
                out,
                r#"{counter}	{{"counter":"{counter}","delta":2,"ts_ms":{}}}"#,
                ts + i
            )?,
            _ => writeln!(out, r#"{counter}	{{"counter":"{counter}"}}"#)?,
        }
    }
    out.flush()?;
    Ok(seen.iter().filter(|s| **s).count() as u64)
}

/// JSON from an independent producer: `kcat -P -K` writes a topic of JSON events, `kcat -C`
/// reads it (the yardstick), then the aggregator (exactly-once, default settings) catches up,
/// and again through librdkafka's consumer (the baseline of its CPU per event).
pub(crate) async fn json_catch_up(env: &mut Env<'_>, results: &mut Results) -> anyhow::Result<()> {
    let topic = env.name("events-json");
    env.create_topic(&topic, env.args.partitions).await?;
    let file = env.args.out.join("json-events.txt");
    let distinct = write_json_events(&file, env.args)?;
    println!(
        "JSON: kcat -P -K writing {} JSON events over {distinct} counters",
        env.args.events
    );
    let produced = kcat_produce_file(env, "kcat -P, JSON keyed", &topic, &file, true).await;
    let _ = std::fs::remove_file(&file);
    results.kcat_produce_json = Some(produced?);
    results.kcat_consume_json = Some(kcat_consume(env, &topic, "kcat -C, JSON").await?);
    let fetches = [
        ("its own fetch path (the default)", "auto"),
        ("librdkafka's consumer", "librdkafka"),
    ];
    let mut runs = Vec::new();
    for (path, fetch) in fetches {
        println!(
            "catch-up: the aggregator, exactly-once, over {} JSON events, through {path}",
            env.args.events
        );
        let flags = ["--delivery", "exactly-once", "--fetch", fetch];
        let mut run = env.catch_up(&topic, env.args.events, &flags).await?;
        run.distinct_counters = distinct;
        println!(
            "  {:.0} events/s from launch",
            run.events_per_second_from_launch
        );
        runs.push(run);
    }
    results.catch_up_json_librdkafka = runs.pop();
    results.catch_up_json = runs.pop();
    Ok(())
}

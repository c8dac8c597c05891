//! What idempotency keys cost: a topic of events that each carry an id (`tally load
//! --event-ids`), caught up exactly-once without and with a 10-minute idempotency window on
//! their namespace. Every id of the run falls in the window, so the aggregator holds them all:
//! the difference of peak RSS over the events is the memory per id held.

use anyhow::Context;

use crate::env::Env;
use crate::results::IdempotencyRun;

/// The two catch-ups.
pub(crate) async fn idempotency(env: &mut Env<'_>) -> anyhow::Result<Vec<IdempotencyRun>> {
    let args = env.args;
    let topic = env.name("events-ids");
    env.create_topic(&topic, args.partitions).await?;
    println!("idempotency: {} events with ids", args.events);
    let (counters, zipf) = (args.counters.to_string(), args.zipf.to_string());
    env.load(
        &topic,
        "tally load, with event ids",
        args.events,
        &["--counters", &counters, "--zipf", &zipf, "--event-ids"],
    )
    .await?;
    let dir = std::env::temp_dir().join(env.name("idempotency"));
    std::fs::create_dir_all(&dir)?;
    let mut runs = Vec::new();
    for (window, entry) in [("none", ""), ("10m", "idempotency_window = \"10m\"\n")] {
        let file = dir.join(format!("namespaces-{window}.toml"));
        std::fs::write(&file, format!("[namespaces.likes]\n{entry}"))?;
        let path = file.to_str().context("a UTF-8 temp path")?;
        println!("idempotency: the aggregator, idempotency window {window}");
        let run = env
            .catch_up(&topic, args.events, &["--namespaces", path])
            .await?;
        println!(
            "  {:.0} events/s from launch, peak RSS {:.0} MiB",
            run.events_per_second_from_launch, run.run.peak_rss_mib
        );
        runs.push(IdempotencyRun {
            window: window.to_owned(),
            catch_up: run,
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(runs)
}

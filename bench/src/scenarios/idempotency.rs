//! What idempotency keys cost: a topic of events that each carry an id (`tally load
//! --event-ids`), caught up exactly-once without and with a 10-minute idempotency window on
//! their namespace. Every id of the run falls in the window, so the aggregator holds them all:
//! the difference of peak RSS over the events is the memory per id held.

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
    let mut runs = Vec::new();
    for (window, entry) in [("none", ""), ("10m", "idempotency_window = \"10m\"\n")] {
        println!("idempotency: the aggregator, idempotency window {window}");
        let namespaces = format!("[namespaces.likes]\n{entry}");
        let run = env
            .catch_up_with_namespaces(&topic, args.events, &namespaces)
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
    Ok(runs)
}

//! What idempotency keys cost: a topic of events that each carry an id (`tally load
//! --event-ids`), caught up exactly-once without and with a 10-minute idempotency window on
//! their namespace. Every id of the run falls in the window, so the aggregator holds them all:
//! the difference of peak RSS over the events is the memory per id held. In alternated rounds
//! (`--rounds`), the round with the median ratio reported.

use crate::env::{Env, delete_matching};
use crate::results::{CatchUp, IdempotencyRun};

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
    let variants = [("none", ""), ("10m", "idempotency_window = \"10m\"\n")];
    let mut rounds: Vec<[CatchUp; 2]> = Vec::new();
    for round in 1..=args.rounds {
        let mut order = [0, 1];
        if round % 2 == 0 {
            order.reverse();
        }
        let mut got: [Option<CatchUp>; 2] = [None, None];
        for v in order {
            let (window, entry) = variants[v];
            println!(
                "idempotency: round {round} of {}, the aggregator, idempotency window {window}",
                args.rounds
            );
            let namespaces = format!("[namespaces.likes]\n{entry}");
            let run = env
                .catch_up_with_namespaces(&topic, args.events, &namespaces)
                .await?;
            println!(
                "  {:.0} events/s from launch, peak RSS {:.0} MiB",
                run.events_per_second_from_launch, run.run.peak_rss_mib
            );
            delete_matching(&mut env.redis, &format!("{}*", run.key_prefix)).await;
            got[v] = Some(run);
        }
        let [Some(none), Some(window)] = got else {
            unreachable!("both variants ran");
        };
        rounds.push([none, window]);
    }
    let rate = |c: &CatchUp| c.events_per_second_from_launch;
    let ratios: Vec<f64> = rounds.iter().map(|[a, b]| rate(b) / rate(a)).collect();
    let median = super::rounds::median_round(&ratios, "window over none");
    let runs = (rounds.swap_remove(median).into_iter().zip(variants))
        .map(|(catch_up, (window, _))| IdempotencyRun {
            window: window.to_owned(),
            catch_up,
            ratios: if window == "none" {
                Vec::new()
            } else {
                ratios.clone()
            },
        })
        .collect();
    Ok(runs)
}

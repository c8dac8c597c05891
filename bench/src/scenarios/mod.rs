//! Every scenario and yardstick of the benchmark, each measured on the local Kafka and Redis
//! with the release binaries, on topics and key prefixes of its own; [`run_all`] runs those
//! the arguments ask for, in an order where each can use the figures before it.

mod cardinality;
mod dedup;
mod expiry;
mod idempotency;
mod json;
mod members;
mod naive;
mod partitions;
mod postgres;
mod reads;
mod rebalance;
mod regroup;
mod rounds;
mod steady;
mod windows;
mod yardsticks;

use anyhow::Context;

use crate::args::Args;
use crate::env::{Env, cleanup, machine, payload_bytes};
use crate::results::Results;
use cardinality::cardinality;
use dedup::dedup;
use expiry::expiry;
use idempotency::idempotency;
use json::json_catch_up;
use members::members;
use naive::naive;
use partitions::new_partitions;
use postgres::{postgres_catch_up, postgres_reads};
use reads::reads;
use rebalance::rebalance;
use regroup::regroup;
use steady::steady;
use windows::{window_reads, windows};
use yardsticks::{kcat_consume, kcat_produce, micro, redis_benchmark};

/// Runs every scenario the arguments ask for.
pub async fn run_all(args: &Args) -> anyhow::Result<Results> {
    let client = redis::Client::open(args.redis_url.as_str())?;
    let redis = client
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("Redis at {} (deploy/local/start.sh)", args.redis_url))?;
    let mut env = Env {
        args,
        run_id: format!(
            "bench-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs()
        ),
        redis,
    };
    let mut results = Results {
        machine: machine(),
        payload_bytes: payload_bytes(args.counters)?,
        ..Results::default()
    };
    let zipf = args.zipf.to_string();
    let counters = args.counters.to_string();
    let preloaded = env.name("events");
    let needs_preload = [
        "producer",
        "catch-up",
        "postgres",
        "windows",
        "dedup",
        "naive",
        "yardsticks",
    ]
    .iter()
    .any(|s| args.runs(s));
    if needs_preload {
        for routing in ["counter", "actor", "random"] {
            if routing != "counter" && !args.runs("producer") {
                continue;
            }
            let topic = if routing == "counter" {
                preloaded.clone()
            } else {
                env.name(&format!("events-{routing}"))
            };
            env.create_topic(&topic, args.partitions).await?;
            println!("producer: {} events, routing by {routing}", args.events);
            let run = env
                .load(
                    &topic,
                    &format!("tally load, routing by {routing}"),
                    args.events,
                    &[
                        "--counters",
                        &counters,
                        "--zipf",
                        &zipf,
                        "--routing",
                        routing,
                    ],
                )
                .await?;
            println!("  {:.0} events/s", run.events_per_second);
            results.producer.push(run);
        }
    }
    if args.runs("yardsticks") {
        results.kcat_consume = Some(kcat_consume(&env, &preloaded, "kcat -C").await?);
        results.kcat_produce = Some(kcat_produce(&env, results.payload_bytes, false).await?);
        results.kcat_produce_keyed = Some(kcat_produce(&env, results.payload_bytes, true).await?);
        results.redis_incrby_per_second = Some(redis_benchmark(&env)?);
    }
    if args.runs("catch-up") {
        for mode in ["exactly-once", "at-least-once"] {
            println!(
                "catch-up: the aggregator, {mode}, over {} events",
                args.events
            );
            let mut run = env
                .catch_up(&preloaded, args.events, &["--delivery", mode])
                .await?;
            // The preload is the producer run routing by counter (same seed, same counters).
            run.distinct_counters = results.producer.first().map_or(0, |p| p.distinct_counters);
            println!(
                "  {:.0} events/s from launch",
                run.events_per_second_from_launch
            );
            results.catch_up.push((mode.to_owned(), run));
        }
    }
    if args.runs("postgres") {
        println!(
            "catch-up into PostgreSQL: the aggregator, exactly-once, over {} events",
            args.events
        );
        let mut run = postgres_catch_up(&mut env, &preloaded, args.events).await?;
        run.catch_up.distinct_counters =
            results.producer.first().map_or(0, |p| p.distinct_counters);
        println!(
            "  {:.0} events/s from launch, {:.1} WAL bytes and {:.4} commits per event",
            run.catch_up.events_per_second_from_launch,
            run.wal_bytes_per_event,
            run.commits_per_event
        );
        results.postgres = Some(run);
    }
    if args.runs("windows") {
        let distinct = results.producer.first().map_or(0, |p| p.distinct_counters);
        let scope = (preloaded.as_str(), args.events, distinct);
        let (runs, prefix) = windows(&mut env, scope, args.windows_rounds).await?;
        results.windows = runs;
        println!("windows: window sums read back (the last 3-window run's keys), timed");
        results.window_reads = window_reads(&env.args.redis_url, &prefix).await?;
    }
    if args.runs("expiry") {
        let distinct = results.producer.first().map_or(0, |p| p.distinct_counters);
        results.expiry = expiry(&mut env, &preloaded, args.events, distinct).await?;
    }
    if args.runs("dedup") {
        let distinct = results.producer.first().map_or(0, |p| p.distinct_counters);
        let scope = (preloaded.as_str(), args.events, distinct);
        results.dedup = dedup(&mut env, scope, args.rounds).await?;
    }
    if args.runs("members") {
        results.members = members(&mut env).await?;
    }
    if args.runs("idempotency") {
        results.idempotency = idempotency(&mut env).await?;
    }
    if args.runs("json") {
        json_catch_up(&mut env, &mut results).await?;
    }
    if args.runs("partitions") {
        results.new_partitions = Some(new_partitions(&mut env).await?);
    }
    if args.runs("rebalance") {
        results.rebalance = rebalance(&mut env).await?;
    }
    if args.runs("regroup") {
        let topic = env.name("regroup");
        env.create_topic(&topic, args.partitions).await?;
        println!("regroup: {} events", args.regroup_events);
        let extra = ["--counters", &counters, "--zipf", &zipf];
        env.load(&topic, "regroup", args.regroup_events, &extra)
            .await?;
        let scope = (topic.as_str(), args.regroup_events);
        results.regroup = regroup(&mut env, scope, args.rounds).await?;
    }
    if args.runs("naive") {
        println!("catch-up: the naive consumer, for {} s", args.naive_seconds);
        results.naive = Some(naive(&mut env, &preloaded).await?);
    }
    if args.runs("steady") {
        // Half of what the pipeline sustains on this machine, its producer and its aggregator
        // sharing the cores: each measured alone above, they run together here, so together
        // they reach 1 / (1/producer + 1/aggregator). (Half of the slower stage alone, the rule
        // until session 10, asked 1.5 M events/s of two cores once both stages ran at 3-4 M/s:
        // more than they sustain together, so it measured a saturated machine.)
        let producer = results.producer.first().map(|p| p.events_per_second);
        let aggregator = results.exactly_once().map(|c| c.run.events_per_second);
        let together = match (producer, aggregator) {
            (Some(p), Some(a)) => 1.0 / (1.0 / p + 1.0 / a),
            (Some(one), None) | (None, Some(one)) => one,
            (None, None) => 400_000.0,
        };
        let rate = args.steady_rate.unwrap_or(together / 2.0);
        println!("steady state at {rate:.0} events/s, with latency probes");
        results.steady = Some(steady(&mut env, "steady", rate, None, false).await?);
    }
    if args.runs("steady-windows") {
        // Issue 31's live target: three windows at 50,000 events/s, p99 within the flush
        // interval plus 250 ms.
        let rate = args.steady_rate.unwrap_or(50_000.0);
        println!("steady state with 3 windows at {rate:.0} events/s, with latency probes");
        let windows = "windows = [\"1m\", \"1h\", \"1d\"]\n";
        let namespaces = format!("[namespaces.likes]\n{windows}[namespaces.probe]\n{windows}");
        results.steady_windows =
            Some(steady(&mut env, "steady-windows", rate, Some(&namespaces), false).await?);
    }
    if args.runs("steady-likes") {
        // Issue 42's live target: likes counted once per user at 50,000 events/s, p99 within
        // the flush interval plus 250 ms.
        let rate = args.steady_rate.unwrap_or(50_000.0);
        println!("steady state of likes (dedup) at {rate:.0} events/s, with latency probes");
        let namespaces = "[namespaces.likes]\ndedup = true\n[namespaces.probe]\ndedup = true\n";
        results.steady_likes =
            Some(steady(&mut env, "steady-likes", rate, Some(namespaces), true).await?);
    }
    if args.runs("hot") {
        let topic = env.name("hot");
        env.create_topic(&topic, args.partitions).await?;
        println!(
            "hot counter: {} events, 90% on one counter",
            args.hot_events
        );
        let load = env
            .load(
                &topic,
                "hot",
                args.hot_events,
                &[
                    "--counters",
                    &counters,
                    "--zipf",
                    &zipf,
                    "--hot-share",
                    "0.9",
                ],
            )
            .await?;
        let mut hot = env.catch_up(&topic, args.hot_events, &[]).await?;
        hot.distinct_counters = load.distinct_counters;
        results.hot = Some(hot);
    }
    if args.runs("hot-likes") {
        // One viral counter's likes, nearly every one by a new actor, all in its group: the
        // largest transactions a likes catch-up writes (each a `SADD` of its members).
        let topic = env.name("hot-likes");
        env.create_topic(&topic, args.partitions).await?;
        println!("hot likes: {} likes of one counter", args.hot_events);
        let actors = args.hot_events.to_string();
        let extra = ["--counters", "1", "--zipf", "0", "--actors", &actors];
        env.load(&topic, "hot-likes", args.hot_events, &extra)
            .await?;
        let namespaces = "[namespaces.likes]\ndedup = true\n";
        let mut run = (env.catch_up_with_namespaces(&topic, args.hot_events, namespaces)).await?;
        run.distinct_counters = 1;
        results.hot_likes = Some(run);
    }
    if args.runs("cardinality") {
        let topic = env.name("distinct");
        env.create_topic(&topic, args.partitions).await?;
        println!("cardinality: {} distinct counters", args.distinct);
        env.load(
            &topic,
            "distinct",
            args.distinct,
            &["--distinct", "--actors", "0"],
        )
        .await?;
        let buckets = args.packed_buckets;
        let c = cardinality(&mut env, &topic, args.distinct, args.rounds, buckets).await?;
        results.cardinality = Some(c.run);
        results.cardinality_bytes_per_counter = Some(c.bytes_per_counter);
        results.cardinality_packed = Some(c.packed);
        results.cardinality_packed_bytes_per_counter = Some(c.packed_bytes_per_counter);
        results.cardinality_packed_buckets = buckets;
        results.cardinality_floor = Some(c.floor);
        results.cardinality_floor_ratios = c.ratios;
    }
    if args.runs("reads") {
        println!("reads");
        results.reads = reads(&env).await?;
        if args.runs("postgres") {
            results.reads.extend(postgres_reads(&env).await?);
        }
    }
    if args.runs("micro") {
        results.micro = micro(&args.out);
    }
    cleanup(&mut env).await;
    Ok(results)
}

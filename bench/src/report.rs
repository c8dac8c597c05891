//! Writing the results: `results.json` (everything), `results.md` (the table, with each target
//! and whether it is met) and SVG plots.

use std::fmt::Write;

use crate::args::Args;
use crate::results::{CatchUp, Results, Steady, Throughput};
use crate::svg;

mod long_tail;
mod regroup;

/// One target of the performance issue: its name, the measured value, the bound, and whether
/// it is met.
struct Target {
    name: &'static str,
    value: Option<f64>,
    bound: f64,
    at_least: bool,
}

impl Target {
    fn met(&self) -> Option<bool> {
        self.value.map(|v| {
            if self.at_least {
                v >= self.bound
            } else {
                v <= self.bound
            }
        })
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? / b.filter(|b| *b > 0.0)?)
}

fn targets(r: &Results) -> Vec<Target> {
    let eo = r.exactly_once();
    let json = r.catch_up_json.as_ref();
    let from_launch = |c: Option<&CatchUp>| c.map(|c| c.events_per_second_from_launch);
    let rate = |t: &Option<Throughput>| t.as_ref().map(|t| t.events_per_second);
    let producer = |routing: &str| {
        r.producer
            .iter()
            .find(|p| p.name.ends_with(routing))
            .map(|p| p.events_per_second)
    };
    let writes_over_floor = |c: Option<&CatchUp>| {
        let c = c.filter(|c| c.distinct_counters > 0)?;
        Some(c.counter_writes_per_event / (c.distinct_counters as f64 / c.run.events as f64))
    };
    let micro = r
        .micro
        .iter()
        .find(|(f, _)| f == "bincode")
        .map(|(_, v)| *v);
    vec![
        Target {
            name: "catch-up JSON (exactly-once, from launch) / kcat -C on the same topic",
            value: ratio(from_launch(json), rate(&r.kcat_consume_json)),
            bound: 1.0,
            at_least: true,
        },
        Target {
            name: "catch-up bincode (exactly-once, from launch) / kcat -C on the same topic",
            value: ratio(from_launch(eo), rate(&r.kcat_consume)),
            bound: 1.3,
            at_least: true,
        },
        Target {
            name: "aggregator CPU s per million JSON events (catch-up; bound: half of 0.93 s, measured on a faster day; README compares on one day)",
            value: json.map(|c| c.run.cpu_seconds_per_million),
            bound: 0.46,
            at_least: false,
        },
        Target {
            name: "the same / through librdkafka's consumer, stall fixed (--fetch librdkafka, same run)",
            value: ratio(
                json.map(|c| c.run.cpu_seconds_per_million),
                (r.catch_up_json_librdkafka.as_ref()).map(|c| c.run.cpu_seconds_per_million),
            ),
            bound: 0.5,
            at_least: false,
        },
        Target {
            name: "counter writes per event / floor, JSON catch-up",
            value: writes_over_floor(json),
            bound: 1.5,
            at_least: false,
        },
        Target {
            name: "counter writes per event / floor, bincode catch-up",
            value: writes_over_floor(eo),
            bound: 1.5,
            at_least: false,
        },
        Target {
            name: "longest script or transaction of the exactly-once catch-ups (ms, Redis SLOWLOG and LATENCY)",
            value: [eo, json, r.hot_likes.as_ref()]
                .into_iter()
                .flatten()
                .map(|c| c.script_max_ms)
                .reduce(f64::max),
            bound: 50.0,
            at_least: false,
        },
        Target {
            name: "partitions added to a live topic: longest delay to their first durable flush (s)",
            value: r.new_partitions.as_ref().map(|n| n.longest_s),
            bound: 15.0,
            at_least: false,
        },
        Target {
            name: "catch-up (exactly-once) / naive consumer",
            value: ratio(
                eo.map(|c| c.run.events_per_second),
                r.naive.as_ref().map(|c| c.run.events_per_second),
            ),
            bound: 30.0,
            at_least: true,
        },
        Target {
            name: "decode + aggregate, bincode, events/s on one core",
            value: micro,
            bound: 10e6,
            at_least: true,
        },
        Target {
            name: "producer (routing by counter) / kcat produce keyed",
            value: ratio(producer("counter"), rate(&r.kcat_produce_keyed)),
            bound: 0.8,
            at_least: true,
        },
        Target {
            name: "producer (routing at random) / kcat produce",
            value: ratio(producer("random"), rate(&r.kcat_produce)),
            bound: 0.8,
            at_least: true,
        },
        Target {
            name: "catch-up into PostgreSQL / into Redis (exactly-once, from launch)",
            value: ratio(
                r.postgres
                    .as_ref()
                    .map(|p| p.catch_up.events_per_second_from_launch),
                from_launch(eo),
            ),
            bound: 0.5,
            at_least: true,
        },
        Target {
            name: "Redis commands per event, hot counter",
            value: r.hot.as_ref().map(|c| c.redis_commands_per_event),
            bound: 0.001,
            at_least: false,
        },
        Target {
            name: "peak RSS of the aggregator, cardinality (MiB)",
            value: r.cardinality.as_ref().map(|c| c.run.peak_rss_mib),
            bound: 300.0,
            at_least: false,
        },
        Target {
            name: "end-to-end latency p99 (ms), steady state",
            value: r.steady.as_ref().map(|s| s.p99_ms),
            bound: r
                .steady
                .as_ref()
                .map_or(1250.0, |s| s.flush_interval_ms + 250.0),
            at_least: false,
        },
    ]
}

/// One row of the throughput table, with its ratio to each yardstick in `vs`.
fn throughput_row(out: &mut String, t: &Throughput, vs: &[(&str, f64)]) {
    let ratio = vs
        .iter()
        .map(|(name, base)| format!("{:.2} × {name}", t.events_per_second / base.max(1e-9)))
        .collect::<Vec<_>>()
        .join("; ");
    let _ = writeln!(
        out,
        "| {} | {} | {:.2} | {:.0} | {:.2} | {:.0} | {ratio} |",
        t.name, t.events, t.seconds, t.events_per_second, t.cpu_seconds_per_million, t.peak_rss_mib
    );
}

fn catch_up_rows(out: &mut String, name: &str, c: &CatchUp) {
    let floor = if c.distinct_counters > 0 {
        format!(
            "{:.4} ({:.2} × floor)",
            c.counter_writes_per_event,
            c.counter_writes_per_event * c.run.events as f64 / c.distinct_counters as f64
        )
    } else {
        format!("{:.4}", c.counter_writes_per_event)
    };
    let _ = writeln!(
        out,
        "| {name} | {:.0} | {:.0} | {:.1} | {:.2} / {:.2} / {:.2} | {:.0}% | {:.0} | {floor} | {:.4} | {:.5} | {:.0} / {:.0} | {} · {:.0} / {:.0} |",
        c.events_per_second_from_launch,
        c.run.events_per_second,
        c.seconds_from_start,
        c.run.cpu_seconds_per_million,
        c.broker_cpu_seconds_per_million,
        c.redis_cpu_seconds_per_million,
        c.idle_share * 100.0,
        c.run.peak_rss_mib,
        c.redis_commands_per_event,
        c.redis_requests_per_event,
        c.flush_p50_ms,
        c.flush_p99_ms,
        c.scripts_over_1ms,
        c.script_p50_ms,
        c.script_max_ms,
    );
}

/// A catch-up as a throughput row: from launch to the last flush, like the kcat yardsticks
/// (which are timed from their launch too).
fn from_launch(name: &str, c: &CatchUp) -> Throughput {
    Throughput {
        name: name.to_owned(),
        seconds: c.seconds_from_start,
        events_per_second: c.events_per_second_from_launch,
        ..c.run.clone()
    }
}

/// Where the Redis commands per event come from: calls per command, per event, in the catch-up
/// (exactly-once) and hot-counter runs. Commands run inside a script count in `INFO
/// commandstats` like any other.
fn command_breakdown(out: &mut String, r: &Results) {
    let runs: Vec<(&str, &CatchUp)> = [
        ("catch-up, exactly-once", r.exactly_once()),
        ("catch-up, JSON", r.catch_up_json.as_ref()),
        ("hot counter", r.hot.as_ref()),
    ]
    .into_iter()
    .filter_map(|(name, c)| Some((name, c?)))
    .filter(|(_, c)| !c.redis_commands.is_empty())
    .collect();
    if runs.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\n## Redis commands by kind\n\nCalls per event (`INFO commandstats`, whose counts include the commands scripts run); top-level requests are `evalsha`, `eval` and `exec`.\n"
    );
    for (name, c) in runs {
        let events = c.run.events.max(1) as f64;
        let parts: Vec<String> = c
            .redis_commands
            .iter()
            .take(8)
            .map(|(command, n)| format!("{command} {:.5}", *n as f64 / events))
            .collect();
        let floor = if c.distinct_counters > 0 {
            format!(
                " (floor: {} distinct counters / {} events = {:.4} counter writes per event, each counter needing at least one write)",
                c.distinct_counters,
                c.run.events,
                c.distinct_counters as f64 / events
            )
        } else {
            String::new()
        };
        let _ = writeln!(out, "- {name}: {}{floor}", parts.join(", "));
    }
}

/// The markdown report.
pub fn markdown(args: &Args, r: &Results) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# tally benchmark\n");
    let _ = writeln!(
        out,
        "Machine: {}. Events: {} over {} counters (Zipf {}), {} partitions, {}-byte payloads.\n",
        r.machine, args.events, args.counters, args.zipf, args.partitions, r.payload_bytes
    );
    let _ = writeln!(
        out,
        "## Targets\n\n| target | measured | bound | met |\n|---|---|---|---|"
    );
    for t in targets(r) {
        let (value, met) = match (t.value, t.met()) {
            (Some(v), Some(m)) => (format!("{v:.4}"), if m { "yes" } else { "**no**" }),
            _ => ("not run".to_owned(), "-"),
        };
        let cmp = if t.at_least { "≥" } else { "≤" };
        let _ = writeln!(out, "| {} | {value} | {cmp} {} | {met} |", t.name, t.bound);
    }
    let _ = writeln!(
        out,
        "\n## Throughput\n\n| run | events | seconds | events/s | CPU s per M events | peak RSS MiB | ratio |\n|---|---|---|---|---|---|---|"
    );
    let kcat_p = r.kcat_produce.as_ref().map(|t| t.events_per_second);
    let vs_kcat_c: Vec<(&str, f64)> = r
        .kcat_consume
        .iter()
        .map(|t| ("kcat -C", t.events_per_second))
        .collect();
    if let Some(k) = &r.kcat_produce {
        throughput_row(&mut out, k, &[]);
    }
    let kcat_keyed = r.kcat_produce_keyed.as_ref();
    if let Some(k) = kcat_keyed {
        throughput_row(&mut out, k, &[]);
    }
    for p in &r.producer {
        let mut vs: Vec<(&str, f64)> = kcat_p.map(|b| ("kcat -P", b)).into_iter().collect();
        // Routing by key is compared with keyed kcat too: librdkafka's own cost of such traffic.
        if !p.name.ends_with("random") {
            vs.extend(kcat_keyed.map(|k| (k.name.as_str(), k.events_per_second)));
        }
        throughput_row(&mut out, p, &vs);
    }
    if let Some(k) = &r.kcat_consume {
        throughput_row(&mut out, k, &[]);
    }
    for (mode, c) in &r.catch_up {
        throughput_row(
            &mut out,
            &from_launch(&format!("tally-aggregator, {mode}"), c),
            &vs_kcat_c,
        );
    }
    for k in [&r.kcat_produce_json, &r.kcat_consume_json]
        .into_iter()
        .flatten()
    {
        throughput_row(&mut out, k, &[]);
    }
    if let Some(k) = &r.kcat_consume_json {
        for (name, c) in [
            ("tally-aggregator, exactly-once, JSON", &r.catch_up_json),
            (
                "tally-aggregator, exactly-once, JSON, --fetch librdkafka",
                &r.catch_up_json_librdkafka,
            ),
        ] {
            if let Some(c) = c {
                let t = from_launch(name, c);
                throughput_row(&mut out, &t, &[(k.name.as_str(), k.events_per_second)]);
            }
        }
    }
    if let Some(n) = &r.naive {
        throughput_row(&mut out, &n.run, &vs_kcat_c);
    }
    if let Some(ops) = r.redis_incrby_per_second {
        let _ = writeln!(
            out,
            "| redis-benchmark, pipelined INCRBY | | | {ops:.0} | | | |"
        );
    }
    let _ = writeln!(
        out,
        "\n## Aggregator scenarios\n\nEvents/s from launch (joining the group included) to the last flush, and from the first event consumed; CPU seconds per million events of the aggregator / the Kafka broker / redis-server, and the machine's idle share, from launch to the last flush; counter writes per event against their floor (distinct counters / events).\n\n| scenario | events/s from launch | events/s | s from launch | CPU s per M: aggregator / broker / redis | idle | peak RSS MiB | counter writes/event | Redis commands/event | requests/event | flush p50/p99 ms | scripts over 1 ms · p50 / max ms (Redis SLOWLOG; the max with transactions, LATENCY) |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (mode, c) in &r.catch_up {
        catch_up_rows(&mut out, &format!("catch-up, {mode}"), c);
    }
    if let Some(c) = &r.catch_up_json {
        catch_up_rows(&mut out, "catch-up, JSON from kcat, exactly-once", c);
    }
    if let Some(c) = &r.catch_up_json_librdkafka {
        catch_up_rows(
            &mut out,
            "catch-up, JSON from kcat, exactly-once, --fetch librdkafka",
            c,
        );
    }
    if let Some(p) = &r.postgres {
        catch_up_rows(
            &mut out,
            "catch-up into PostgreSQL, exactly-once",
            &p.catch_up,
        );
    }
    if let Some(n) = &r.naive {
        catch_up_rows(&mut out, "naive consumer (time-boxed)", n);
    }
    if let Some(h) = &r.hot {
        catch_up_rows(&mut out, "hot counter (90% on one)", h);
    }
    if let Some(h) = &r.hot_likes {
        catch_up_rows(&mut out, "hot likes (one counter, dedup)", h);
    }
    if let Some(c) = &r.cardinality {
        catch_up_rows(&mut out, "cardinality (1 event per counter)", c);
    }
    command_breakdown(&mut out, r);
    long_tail::section(&mut out, r);
    if !r.rebalance.is_empty() {
        let _ = writeln!(
            out,
            "\n## Rebalances under a steady stream\n\nThree aggregators (default group settings: `cooperative-sticky`, 10 s session, 1 s heartbeats; each with a stable `group.instance.id`) count 6,000 events/s in 12 partitions; every partition's `tally_durable_offset` sampled every 100 ms. Gaps are the longest time a partition went without a durable flush, from the event on (the flush interval, 1 s by default, is the floor: a gap of about 1 s is no pause at all); a restart's moved partitions are the restarted member's own.\n\n| event | kept | longest gap, kept (s) | moved | longest gap, moved (s) | all owned again (s) | all durable again (s) |\n|---|---|---|---|---|---|---|"
        );
        for e in &r.rebalance {
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} | {} | {:.2} | {:.2} | {:.2} |",
                e.event,
                e.kept,
                e.kept_longest_gap_s,
                e.moved,
                e.moved_longest_gap_s,
                e.owned_again_s,
                e.durable_again_s
            );
        }
    }
    if let Some(n) = &r.new_partitions {
        let delays: Vec<String> = (n.delays_s.iter())
            .map(|(p, d)| format!("{p}: {d:.1} s"))
            .collect();
        let _ = writeln!(
            out,
            "\n## Partitions added to a live topic\n\n{} events at a steady rate through the producer crate (metadata refreshed every second) into {} partitions, raised to {} mid-stream with `CreatePartitions`: each new partition's first durable flush came {} after (longest {:.1} s); every total exact afterwards: {}.",
            n.events,
            n.from,
            n.to,
            delays.join(", "),
            n.longest_s,
            if n.exact { "yes" } else { "**no**" }
        );
    }
    if let Some(p) = &r.postgres {
        let redis = r.exactly_once().map(|c| c.events_per_second_from_launch);
        let _ = writeln!(
            out,
            "\n## PostgreSQL store\n\nThe exactly-once catch-up over the same topic into share rows (`--store postgres`): {:.0} events/s from launch{}; {:.1} WAL bytes, {:.5} commits and {} statements per event; the PostgreSQL server's CPU {:.2} s per million events.",
            p.catch_up.events_per_second_from_launch,
            redis.map_or(String::new(), |x| format!(
                ", {:.2} x the Redis store's {x:.0} in this run",
                p.catch_up.events_per_second_from_launch / x
            )),
            p.wal_bytes_per_event,
            p.commits_per_event,
            p.statements_per_event
                .map_or("(pg_stat_statements not loaded)".to_owned(), |s| format!(
                    "{s:.5}"
                )),
            p.postgres_cpu_seconds_per_million,
        );
    }
    if !r.windows.is_empty() {
        let base = r
            .windows
            .first()
            .map(|w| w.catch_up.events_per_second_from_launch);
        let _ = writeln!(
            out,
            "\n## Windows\n\nThe exactly-once catch-up over the same topic, its namespace keeping 0, 1 (`1h`) and 3 (`1m`, `1h`, `1d`) windows; each counter has one live bucket per window (the events are minutes old). Memory is Redis's `used_memory` added per distinct counter.\n\n| windows | events/s from launch | vs 0 windows | Redis commands/event | requests/event | aggregator CPU s per M | memory bytes/counter |\n|---|---|---|---|---|---|---|"
        );
        for w in &r.windows {
            let c = &w.catch_up;
            let _ = writeln!(
                out,
                "| {} | {:.0} | {} | {:.3} | {:.4} | {:.2} | {:.0} |",
                w.windows,
                c.events_per_second_from_launch,
                base.map_or("".to_owned(), |b| format!(
                    "{:.2}",
                    c.events_per_second_from_launch / b
                )),
                c.redis_commands_per_event,
                c.redis_requests_per_event,
                c.run.cpu_seconds_per_million,
                w.memory_bytes_per_counter,
            );
        }
        if let Some(line) = crate::results::window_rounds(&r.windows) {
            let _ = writeln!(out, "\n{line}");
        }
    }
    if !r.window_reads.is_empty() {
        let _ = writeln!(
            out,
            "\nWindow sums read back after the last 3-window run: 1,000 counters per read, each window over its usual span, each counter one cells field in every shard group (one `HMGET` per cells hash, all in one pipeline: one round trip).\n\n| window × buckets | fields per group | groups | reads | p50 ms | p99 ms | sums equal the totals |\n|---|---|---|---|---|---|---|"
        );
        for w in &r.window_reads {
            let _ = writeln!(
                out,
                "| {} × {} | {} | {} | {} | {:.1} | {:.1} | {} |",
                w.width,
                w.buckets,
                w.keys_per_group,
                w.groups,
                w.reads,
                w.p50_ms,
                w.p99_ms,
                if w.matches_totals { "yes" } else { "no" },
            );
        }
    }
    if let [without, with, ..] = r.expiry.as_slice() {
        let (a, b) = (&without.catch_up, &with.catch_up);
        let _ = writeln!(
            out,
            "\n## Expiring counters\n\nThe exactly-once catch-up over the same topic, its namespace never expiring and with `expire_after = \"30d\"` (nothing expires during the run; each flush keeps the partition's idle index, one `ZADD GT` per counter written): {:.0} and {:.0} events/s from launch ({:.2} x); Redis commands per event {:.3} and {:.3}; memory per distinct counter {:.0} and {:.0} bytes; aggregator CPU {:.2} and {:.2} s per million events.",
            a.events_per_second_from_launch,
            b.events_per_second_from_launch,
            b.events_per_second_from_launch / a.events_per_second_from_launch.max(1.0),
            a.redis_commands_per_event,
            b.redis_commands_per_event,
            without.memory_bytes_per_counter,
            with.memory_bytes_per_counter,
            a.run.cpu_seconds_per_million,
            b.run.cpu_seconds_per_million,
        );
    }
    if let [without, with, ..] = r.idempotency.as_slice() {
        let (a, b) = (&without.catch_up, &with.catch_up);
        let events = b.run.events.max(1) as f64;
        let _ = writeln!(
            out,
            "\n## Idempotency keys\n\nThe exactly-once catch-up of {} events that each carry an id, without and with a 10-minute idempotency window (every id of the run is held): {:.0} and {:.0} events/s from launch ({:.2} x); aggregator CPU {:.2} and {:.2} s per million events; peak RSS {:.0} and {:.0} MiB, {:.0} bytes per id held (its tables: {:.0} ids in {:.1} bytes each); Redis commands per event {:.3} and {:.3} (ids cost Redis nothing).",
            b.run.events,
            a.events_per_second_from_launch,
            b.events_per_second_from_launch,
            b.events_per_second_from_launch / a.events_per_second_from_launch.max(1.0),
            a.run.cpu_seconds_per_million,
            b.run.cpu_seconds_per_million,
            a.run.peak_rss_mib,
            b.run.peak_rss_mib,
            (b.run.peak_rss_mib - a.run.peak_rss_mib) * 1_048_576.0 / events,
            b.idempotency_ids_held,
            b.idempotency_table_bytes / b.idempotency_ids_held.max(1.0),
            a.redis_commands_per_event,
            b.redis_commands_per_event,
        );
        if !with.ratios.is_empty() {
            let mut sorted = with.ratios.clone();
            sorted.sort_by(f64::total_cmp);
            let _ = writeln!(
                out,
                "\nOver {} alternated rounds, the rate with the window over the same round's without: {} (median {:.2}, from {:.2} to {:.2}); the figures above are the median round's.",
                sorted.len(),
                (with.ratios.iter())
                    .map(|r| format!("{r:.2}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                crate::probe::quantile(&mut sorted.clone(), 0.5),
                sorted[0],
                sorted[sorted.len() - 1]
            );
        }
    }
    regroup::section(&mut out, r);
    if let Some(s) = &r.steady {
        let _ = writeln!(
            out,
            "\n## Steady state\n\nBackground load {} (unless `--steady-rate` is given, the load asked is half of what the producer and the exactly-once catch-up of this run sustain together on the machine, 1 / (1/producer + 1/catch-up)); probes from `send` returning to `get_exact` seeing the count.",
            steady_figures(s)
        );
    }
    // The live targets (issues 31 and 42): p99 within the flush interval plus 250 ms.
    let live = [
        (
            &r.steady_windows,
            "Steady state with windows",
            "Three windows (`1m`, `1h`, `1d`) on the load's counters and the probes",
        ),
        (
            &r.steady_likes,
            "Steady state of likes",
            "Likes and unlikes (15%) of 50,000 users, `dedup = true` on the load's counters and the probes (each probe a like)",
        ),
    ];
    for (steady, title, what) in live {
        if let Some(s) = steady {
            let _ = writeln!(
                out,
                "\n## {title}\n\n{what}: {} (the target: p99 within the flush interval plus 250 ms, {:.0} ms).",
                steady_figures(s),
                s.flush_interval_ms + 250.0
            );
        }
    }
    if !r.reads.is_empty() {
        let _ = writeln!(
            out,
            "\n## Reads\n\n| read | p50 µs | p99 µs |\n|---|---|---|"
        );
        for read in &r.reads {
            let _ = writeln!(
                out,
                "| {} | {:.1} | {:.1} |",
                read.name, read.p50_us, read.p99_us
            );
        }
    }
    if !r.micro.is_empty() {
        let _ = writeln!(
            out,
            "\n## Decode + aggregate, one core (criterion)\n\n| format | events/s |\n|---|---|"
        );
        for (format, rate) in &r.micro {
            let _ = writeln!(out, "| {format} | {rate:.0} |");
        }
    }
    let _ = writeln!(
        out,
        "\nPlots: `throughput.svg`, `flush-latency.svg`, `e2e-latency.svg`. Everything: `results.json`."
    );
    out
}

/// Writes `results.json`, `results.md` and the plots into `args.out`.
pub fn write(args: &Args, r: &Results) -> anyhow::Result<()> {
    std::fs::write(
        args.out.join("results.json"),
        serde_json::to_string_pretty(r)?,
    )?;
    let md = markdown(args, r);
    std::fs::write(args.out.join("results.md"), &md)?;
    std::fs::write(args.out.join("capacity.md"), crate::capacity::markdown(r))?;
    println!("{md}");
    let mut series: Vec<(String, Vec<(f64, f64)>)> = r
        .catch_up
        .iter()
        .map(|(m, c)| (format!("catch-up, {m}"), c.series.clone()))
        .chain(
            r.catch_up_json
                .iter()
                .map(|c| ("catch-up, JSON".to_owned(), c.series.clone())),
        )
        .collect();
    for (name, c) in [("hot counter", &r.hot), ("cardinality", &r.cardinality)] {
        if let Some(c) = c {
            series.push((name.to_owned(), c.series.clone()));
        }
    }
    if !series.is_empty() {
        std::fs::write(
            args.out.join("throughput.svg"),
            svg::line_chart(
                "Aggregator throughput over time",
                "seconds since start",
                "events flushed per second",
                &series,
            ),
        )?;
    }
    if let Some((_, c)) = r.catch_up.first() {
        let bars: Vec<(String, f64)> = c
            .flush_histogram
            .iter()
            .map(|(le, n)| (format!("≤{}ms", le * 1000.0), *n))
            .collect();
        std::fs::write(
            args.out.join("flush-latency.svg"),
            svg::bar_chart(
                "Flush duration, catch-up (exactly-once)",
                "flush took",
                "flushes",
                &bars,
            ),
        )?;
    }
    if let Some(s) = &r.steady {
        let bounds = [
            100.0, 250.0, 500.0, 750.0, 1000.0, 1100.0, 1250.0, 1500.0, 2000.0, 5000.0,
        ];
        let mut bars: Vec<(String, f64)> = Vec::new();
        let mut below = 0.0;
        for b in bounds {
            let n = s.latencies_ms.iter().filter(|l| **l <= b).count() as f64;
            bars.push((format!("≤{b}ms"), n - below));
            below = n;
        }
        bars.push((">5000ms".to_owned(), s.latencies_ms.len() as f64 - below));
        std::fs::write(
            args.out.join("e2e-latency.svg"),
            svg::bar_chart(
                "End-to-end latency, steady state",
                "send returned → visible in get_exact",
                "probes",
                &bars,
            ),
        )?;
    }
    Ok(())
}

/// A steady run's load and latencies, as the report words them.
fn steady_figures(s: &Steady) -> String {
    format!(
        "{:.0} events/s asked, {:.0} reached; flush interval {} ms; {} probes: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        s.target_rate, s.achieved_rate, s.flush_interval_ms, s.probes, s.p50_ms, s.p99_ms, s.max_ms
    )
}

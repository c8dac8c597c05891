//! `tally`: the command line for people. `tally get` reads totals (exact, or through the cache,
//! or as displayed); `tally like`/`unlike`/`liked` act on one like per user; `tally shards` and
//! `tally top` inspect; `tally compact` collapses cold counters; `tally load` generates traffic
//! through the producer crate; `tally verify` waits for known totals. Each subcommand is one
//! function below, reading and writing through the library types.

use std::io::{self, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tally_aggregator::tasks::compact::{CompactError, Compactor};
use tally_aggregator::tasks::regroup::RegroupFailure;
use tally_cli::load::{self, LoadSpec};
use tally_cli::{audit, dead_letters, verify};
use tally_common::{CachedReader, Reader, pg};
use tally_kafka::backoff::Backoff;
use tally_ops::config::Store;
use tally_producer::ProducerConfig;

mod args;

use args::{
    AuditArgs, Cli, Command, CompactArgs, CounterArgs, DeadLetterArgs, DeadLettersCommand, GetArgs,
    LikeArgs, LikedArgs, LikesToSetsArgs, LoadArgs, PackArgs, RedisArgs, RegroupArgs, ReplayArgs,
    ResetArgs, TopArgs, VerifyArgs, WindowsCommand,
};

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let run = match Cli::parse().command {
        Command::Get(args) => get(args).await,
        Command::Like(args) => like(args, true).await,
        Command::Unlike(args) => like(args, false).await,
        Command::Reset(args) => reset(args).await,
        Command::Compact(args) => compact(args).await,
        Command::Shards(args) => shards(args).await,
        Command::Top(args) => top(args).await,
        Command::Liked(args) => liked(args).await,
        Command::Load(args) => run_load(args).await,
        Command::Verify(args) => run_verify(args).await,
        Command::Audit(args) => run_audit(args).await,
        Command::DeadLetters(DeadLettersCommand::List(args)) => list_dead_letters(&args),
        Command::DeadLetters(DeadLettersCommand::Replay(args)) => replay_dead_letters(&args),
        Command::Windows(WindowsCommand::Sweep(args)) => sweep_windows(args).await,
        Command::Windows(WindowsCommand::Migrate(args)) => migrate_windows(args).await,
        Command::LikesToSets(args) => likes_to_sets(args).await,
        Command::Regroup(args) => regroup(args).await,
        Command::Pack(args) => pack(args).await,
    };
    // Output piped into a reader that stops early (`tally load | head`): what was asked for is
    // done, so end quietly, as the reader intended, instead of reporting an error.
    match run {
        Err(e) if closed_stdout(&e) => Ok(ExitCode::SUCCESS),
        run => run,
    }
}

/// Whether `e` is a write to standard output (through [`out`]) whose reader has gone. A broken
/// pipe anywhere else (a Redis or Kafka connection) stays an error.
fn closed_stdout(e: &anyhow::Error) -> bool {
    (e.chain()).any(|cause| {
        (cause.downcast_ref::<io::Error>())
            .and_then(io::Error::get_ref)
            .is_some_and(|inner| inner.is::<StdoutClosed>())
    })
}

/// Standard output for the subcommands' reports.
fn out() -> Out {
    Out(io::stdout())
}

/// Standard output whose broken-pipe errors carry [`StdoutClosed`], so that `main` can tell them
/// from any other.
struct Out(io::Stdout);

impl Write for Out {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf).map_err(closed)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush().map_err(closed)
    }
}

fn closed(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::BrokenPipe => io::Error::new(e.kind(), StdoutClosed),
        _ => e,
    }
}

/// The reader of standard output has gone.
#[derive(Debug, thiserror::Error)]
#[error("standard output closed")]
struct StdoutClosed;

async fn get(args: GetArgs) -> anyhow::Result<ExitCode> {
    let namespaces = args.redis.namespaces()?;
    let reader = CachedReader::new(get_reader(&args).await?, Arc::new(namespaces));
    let totals = if let Some(span) = args.window {
        reader.get_window(&args.counters, span).await?
    } else if args.cached {
        reader.get_many(&args.counters).await?
    } else {
        let mut exact = Vec::with_capacity(args.counters.len());
        for counter in &args.counters {
            exact.push(reader.get_exact(counter).await?);
        }
        exact
    };
    let mut out = out();
    for (counter, total) in args.counters.iter().zip(totals) {
        if args.display {
            let style = reader.namespaces().policy(counter).display;
            writeln!(out, "{counter} {}", tally_common::display(total, style))?;
        } else {
            writeln!(out, "{counter} {total}")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `tally get`'s reader: Redis's keys, or with `--store postgres` the share rows (Redis then
/// holds only the cache of totals).
async fn get_reader(args: &GetArgs) -> anyhow::Result<Reader> {
    let reader = args.redis.reader().await?;
    if args.store == Store::Redis {
        return Ok(reader);
    }
    let url = (args.postgres_url.as_deref())
        .context("--store postgres needs --postgres-url (or TALLY_POSTGRES_URL)")?;
    let password = std::env::var("TALLY_POSTGRES_PASSWORD").ok();
    let store = pg::PgStore::connect(
        url,
        pg::PoolOptions {
            password: password.as_deref(),
            size: 2,
            statement_timeout: None,
        },
        &args.redis.key_prefix,
    )?;
    Ok(reader.with_store(Arc::new(store)))
}

/// `tally like` (`add`) and `tally unlike`.
async fn like(args: LikeArgs, add: bool) -> anyhow::Result<ExitCode> {
    let producer = args.kafka.producer()?;
    if add {
        producer.like(&args.counter, &args.actor).await?;
    } else {
        producer.unlike(&args.counter, &args.actor).await?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `tally reset`.
async fn reset(args: ResetArgs) -> anyhow::Result<ExitCode> {
    let producer = args.kafka.producer()?;
    for counter in &args.counters {
        let delivered = producer.reset(counter).await?;
        writeln!(
            out(),
            "{counter} reset at partition {} offset {}",
            delivered.partition,
            delivered.offset
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn sweep_windows(args: RedisArgs) -> anyhow::Result<ExitCode> {
    let namespaces = args.namespaces()?;
    let reader = args.reader().await?;
    let r = tally_aggregator::tasks::cells::sweep(reader.conn(), reader.keyspace(), &namespaces)
        .await?;
    writeln!(
        out(),
        "fields read: {}, trimmed: {}, deleted: {}, not cells (left alone): {}",
        r.fields,
        r.trimmed,
        r.deleted,
        r.corrupt
    )?;
    Ok(ExitCode::SUCCESS)
}

async fn migrate_windows(args: RedisArgs) -> anyhow::Result<ExitCode> {
    let reader = args.reader().await?;
    let r = tally_aggregator::tasks::cells::migrate(reader.conn(), reader.keyspace()).await?;
    writeln!(
        out(),
        "bucket keys folded: {}, fields written: {}, keys left (not integers): {}",
        r.keys,
        r.fields,
        r.corrupt
    )?;
    Ok(ExitCode::SUCCESS)
}

async fn likes_to_sets(args: LikesToSetsArgs) -> anyhow::Result<ExitCode> {
    use tally_aggregator::tasks::likes_move;
    let namespaces = args.redis.namespaces()?;
    let reader = args.redis.reader().await?;
    let (conn, keyspace) = (reader.conn(), reader.keyspace());
    let moved = if args.dry_run {
        likes_move::plan_likes_to_sets(conn, keyspace, &namespaces).await?
    } else {
        likes_move::likes_to_sets(conn, keyspace, &namespaces).await?
    };
    if moved.already {
        writeln!(
            out(),
            "likes are counted by their sets already: nothing to move"
        )?;
    } else {
        writeln!(
            out(),
            "likes {} to count sets: namespaces {}, sets {}, likes {}, member sets left \
             (of namespaces not moved, or outside their counter's group) {}",
            if args.dry_run {
                "would move (dry run, nothing changed)"
            } else {
                "moved"
            },
            moved.namespaces.join(","),
            moved.sets,
            moved.likes,
            moved.left
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn compact(args: CompactArgs) -> anyhow::Result<ExitCode> {
    let namespaces = Arc::new(args.redis.namespaces()?);
    let reader = args.redis.reader().await?;
    let cancel = tally_ops::shutdown::on_signals()?;
    let fresh = || {
        let cap = Duration::from_millis(args.interval_ms.max(100));
        Backoff::new(Duration::from_millis(100), cap)
    };
    let mut backoff = fresh();
    let mut compactor: Option<Compactor> = None;
    let outcome = async {
        loop {
            // Taking the compactor's epoch first, then a pass each round.
            let attempt = if let Some(running) = &compactor {
                running.pass().await.map(Some)
            } else {
                let started = Compactor::start(
                    reader.conn().clone(),
                    reader.keyspace().clone(),
                    namespaces.clone(),
                    Duration::from_millis(args.cold_after_ms),
                )
                .await;
                started.map(|started| {
                    compactor = Some(started);
                    None
                })
            };
            let r = match attempt {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                // A store that refuses or fails (out of memory, read-only, unreachable: anything but
                // a newer compactor or a cluster) is retried in a loop: each pass starts by finishing
                // the moves an interrupted one journaled.
                Err(error)
                    if args.repeat
                        && !matches!(error, CompactError::Fenced | CompactError::Cluster) =>
                {
                    eprintln!("compaction failed, retrying: {error}");
                    if matches!(error, CompactError::Lapsed) {
                        // Its marks lapsed: a new compactor marks and settles again.
                        compactor = None;
                    }
                    tokio::select! {
                        () = cancel.cancelled() => return Ok(ExitCode::SUCCESS),
                        () = tokio::time::sleep(backoff.next_delay()) => continue,
                    }
                }
                Err(error) => return Err(error.into()),
            };
            backoff = fresh();
            if !args.repeat || r.compacted + r.recovered + r.markers_dropped > 0 {
                writeln!(
                    out(),
                    "{} candidates: {} compacted in {} moves, {} interrupted moves finished, {} markers dropped, {} moves dropped (their counters were reset meanwhile)",
                    r.candidates,
                    r.compacted,
                    r.moves,
                    r.recovered,
                    r.markers_dropped,
                    r.dropped
                )?;
            }
            if !args.repeat {
                return Ok(ExitCode::SUCCESS);
            }
            tokio::select! {
                () = cancel.cancelled() => return Ok(ExitCode::SUCCESS),
                () = tokio::time::sleep(Duration::from_millis(args.interval_ms)) => {}
            }
        }
    }
    .await;
    // The compactor's moving marks and what they recorded go with it.
    if let Some(compactor) = &compactor
        && let Err(error) = compactor.close().await
    {
        eprintln!("leaving the compactor's marks in place: {error}");
    }
    outcome
}

async fn shards(args: CounterArgs) -> anyhow::Result<ExitCode> {
    let counter = &args.counter;
    let reader = args.redis.reader().await?;
    let ks = reader.keyspace();
    let before = reader.shares(counter).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = reader.shares(counter).await?;
    writeln!(
        out(),
        "{counter}: {} direct-write shard(s); total {}",
        reader.direct_shards(counter).await?,
        reader.get(counter).await?
    )?;
    writeln!(
        out(),
        "{:>6} {:>6} {:>20} {:>10}",
        "group",
        "shard",
        "value",
        "writes/s"
    )?;
    for (group, (value, earlier)) in after.iter().zip(&before).enumerate() {
        let Some(value) = value else {
            continue;
        };
        let group = group as u32;
        let shard = (0..ks.groups()).find(|s| ks.shard_group(counter, *s) == group);
        let rate = value - earlier.unwrap_or(0);
        writeln!(
            out(),
            "{group:>6} {:>6} {value:>20} {rate:>10}",
            shard.map_or("-".to_owned(), |s| s.to_string())
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn regroup(args: RegroupArgs) -> anyhow::Result<ExitCode> {
    let reader = args.redis.reader().await?;
    let say = |step: &str| {
        let _ = writeln!(out(), "{step}");
    };
    let wait = Duration::from_secs(args.wait);
    match tally_aggregator::tasks::regroup::regroup(
        reader.conn(),
        reader.keyspace(),
        args.to,
        wait,
        say,
    )
    .await
    {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(RegroupFailure::NotMoved { .. }) if args.wait == 0 => {
            writeln!(
                out(),
                "not waiting for the partitions to move (--wait 0): run the command again to finish"
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => Err(error.into()),
    }
}

async fn pack(args: PackArgs) -> anyhow::Result<ExitCode> {
    let reader = args.redis.reader().await?;
    let say = |step: &str| {
        let _ = writeln!(out(), "{step}");
    };
    let (conn, keyspace) = (reader.conn(), reader.keyspace());
    tally_aggregator::tasks::pack::pack(conn, keyspace, args.buckets, say).await?;
    Ok(ExitCode::SUCCESS)
}

async fn top(args: TopArgs) -> anyhow::Result<ExitCode> {
    let reader = args.redis.reader().await?;
    for (counter, activity) in reader.top(&args.namespace, args.k).await? {
        writeln!(out(), "{counter} {activity}")?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn liked(args: LikedArgs) -> anyhow::Result<ExitCode> {
    let reader = args.redis.reader().await?;
    let liked = reader.has_liked(&args.counter, &args.actor).await?;
    writeln!(out(), "{liked}")?;
    Ok(if liked {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

async fn run_load(args: LoadArgs) -> anyhow::Result<ExitCode> {
    let topic = &args.kafka.topic;
    let config = ProducerConfig::new(&args.kafka.brokers, topic)
        .routing(args.routing)
        .bulk_path(args.producer);
    let spec = LoadSpec {
        events: args.events,
        counters: args.counters,
        zipf: args.zipf,
        rate: args.rate,
        counter_prefix: args.counter_prefix,
        max_delta: args.max_delta,
        negative_share: args.negative_share,
        actors: args.actors,
        seed: args.seed,
        hot_share: args.hot_share,
        distinct: args.distinct,
        event_ids: args.event_ids,
        threads: args.threads,
        ..LoadSpec::default()
    };
    let report = load::run(&config, &spec).await?;
    // The file first: it is what `tally verify` needs, whatever becomes of standard output.
    if let Some(path) = args.totals_out {
        let mut lines: Vec<String> = (report.totals.iter())
            .map(|(c, t)| format!("{c} {t}\n"))
            .collect();
        lines.sort();
        std::fs::write(&path, lines.concat())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    writeln!(
        out(),
        "sent {} events ({} failed) over {} counters to {topic} in {:.2}s: {:.0} events/s",
        report.acked,
        report.failed,
        report.totals.len(),
        report.elapsed.as_secs_f64(),
        report.events_per_second()
    )?;
    if args.top > 0 {
        writeln!(out(), "top counters (as sent):")?;
        for (counter, total) in report.top(args.top) {
            writeln!(out(), "  {counter} {total}")?;
        }
    }
    if let Some(error) = report.first_error {
        eprintln!("{} events failed; first error: {error}", report.failed);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

async fn run_verify(args: VerifyArgs) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(&args.totals)
        .with_context(|| format!("reading {}", args.totals.display()))?;
    let expected = verify::parse_totals(&text).map_err(anyhow::Error::msg)?;
    let reader = args.redis.reader().await?;
    let timeout = Duration::from_secs(args.timeout_s);
    let waited = match verify::wait_for_totals(&reader, &expected, timeout).await {
        Ok(waited) => waited,
        Err(mismatch) => {
            eprintln!("{mismatch}");
            return Ok(ExitCode::FAILURE);
        }
    };
    writeln!(
        out(),
        "all {} counters match what was sent (waited {:.2}s)",
        expected.len(),
        waited.as_secs_f64()
    )?;
    let mut largest: Vec<(&String, &i64)> = expected.iter().collect();
    largest.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    largest.truncate(args.top);
    let names: Vec<&String> = largest.iter().map(|(c, _)| *c).collect();
    let read = reader.get_many(&names).await?;
    writeln!(out(), "{:<28} {:>12} {:>12}", "counter", "sent", "in redis")?;
    for ((counter, sent), got) in largest.iter().zip(read) {
        writeln!(out(), "{counter:<28} {sent:>12} {got:>12}")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `tally dead-letters list`.
fn list_dead_letters(args: &DeadLetterArgs) -> anyhow::Result<ExitCode> {
    let mut out = out();
    let listed = dead_letters::list(
        &args.kafka(),
        &args.dead_letter_topic,
        &args.filter(),
        |l| {
            let key = l.key.as_deref().map(String::from_utf8_lossy);
            writeln!(
                out,
                "{}/{} at {} {} from {}/{}@{} key {:?}: {}",
                l.partition,
                l.offset,
                l.timestamp_ms.unwrap_or(-1),
                l.reason,
                l.source_topic.as_deref().unwrap_or("?"),
                l.source_partition.unwrap_or(-1),
                l.source_offset.unwrap_or(-1),
                key.unwrap_or_default(),
                l.error
            )
        },
    )?;
    writeln!(out, "{listed} dead letters")?;
    Ok(ExitCode::SUCCESS)
}

/// `tally dead-letters replay`.
fn replay_dead_letters(args: &ReplayArgs) -> anyhow::Result<ExitCode> {
    let spec = dead_letters::ReplaySpec {
        kafka: args.letters.kafka(),
        topic: args.letters.dead_letter_topic.clone(),
        group: args.group.clone(),
        to: args.to.clone(),
        chunk: args.chunk,
    };
    let done = dead_letters::replay(&spec, &args.letters.filter())?;
    writeln!(
        out(),
        "replayed {}; passed over {} the filter left out and {} refused window buckets",
        done.replayed,
        done.passed_over,
        done.window_buckets
    )?;
    Ok(ExitCode::SUCCESS)
}

/// `tally audit`: recounts the log and prints the drift.
async fn run_audit(args: AuditArgs) -> anyhow::Result<ExitCode> {
    let namespaces = args.redis.namespaces()?;
    let reader = args.redis.reader().await?;
    let mut kafka = rdkafka::ClientConfig::new();
    kafka.set("bootstrap.servers", &args.kafka.brokers);
    for (key, value) in &args.kafka_options {
        kafka.set(key, value);
    }
    let spec = audit::AuditSpec {
        kafka,
        topic: args.kafka.topic.clone(),
        group: args.group.clone(),
        max_message_bytes: args.max_message_bytes,
        since_ms: args.since,
    };
    let report = audit::audit(&spec, &namespaces, &reader).await?;
    let mut out = out();
    let range = match spec.since_ms {
        Some(since) => format!("from {since} ms (window buckets only)"),
        None => "from the start".to_owned(),
    };
    writeln!(
        out,
        "recounted {} events of {} ({} partitions, {range} up to the durable offsets) in {:.1} s; {} dead letters and {} repeated ids not counted, {} expiries",
        report.events,
        spec.topic,
        report.partitions,
        report.elapsed.as_secs_f64(),
        report.dead_letters,
        report.repeats,
        report.expired,
    )?;
    writeln!(
        out,
        "counters checked: {}, off: {}, left out: {} moving (events not yet durable), {} direct, {} ambiguous",
        report.checked,
        report.drift.len(),
        report.moving,
        report.direct,
        report.ambiguous,
    )?;
    if report.buckets_checked + report.buckets_expiring > 0 {
        writeln!(
            out,
            "window buckets checked: {}, left out: {} expiring within a minute",
            report.buckets_checked, report.buckets_expiring,
        )?;
    }
    for d in report.drift.iter().take(args.top) {
        writeln!(
            out,
            "drift {} stored {} recounted {} difference {:+}",
            d.counter,
            d.stored,
            d.recounted,
            i128::from(d.stored) - i128::from(d.recounted),
        )?;
    }
    Ok(if report.drift.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

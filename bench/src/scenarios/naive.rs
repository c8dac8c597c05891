//! The naive consumer: one `INCRBY` and one commit per event, time-boxed.

use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};

use crate::env::{Env, run_capturing};
use crate::probe::CommandStats;
use crate::results::{CatchUp, Throughput};

pub(crate) async fn naive(env: &mut Env<'_>, topic: &str) -> anyhow::Result<CatchUp> {
    let id = env.name("naive");
    let before = CommandStats::read(&mut env.redis).await?;
    let started = Instant::now();
    let child = Command::new(env.bin("tally-naive"))
        .args([
            "--brokers",
            &env.args.brokers,
            "--topic",
            topic,
            "--group",
            &id,
        ])
        .args(["--redis-url", &env.args.redis_url, "--key-prefix", &id])
        .args(["--events", &env.args.events.to_string()])
        .args(["--seconds", &env.args.naive_seconds.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .context("tally-naive")?;
    let (stats, _, ok, stdout) = run_capturing(child).await?;
    if !ok {
        bail!("tally-naive failed: {stdout}");
    }
    let after = CommandStats::read(&mut env.redis).await?;
    let done = stdout.lines().last().unwrap_or_default();
    let mut parts = done.split(' ').skip(1);
    let events: u64 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .context("naive summary")?;
    let seconds: f64 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .context("naive summary")?;
    println!("  {:.0} events/s", events as f64 / seconds.max(1e-9));
    Ok(CatchUp {
        run: Throughput::new("tally-naive", events, seconds, stats),
        seconds_from_start: started.elapsed().as_secs_f64(),
        redis_commands_per_event: after.since(&before) as f64 / events.max(1) as f64,
        redis_requests_per_event: after.since(&before) as f64 / events.max(1) as f64,
        ..CatchUp::default()
    })
}

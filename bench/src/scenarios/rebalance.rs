//! Rebalances under a steady stream: three aggregators (release binaries, default group
//! settings, each with a stable `group.instance.id`) count `tally load` at 6,000 events/s into
//! 12 partitions, and every partition's `tally_durable_offset` is sampled every 100 ms. In
//! turn: one member is SIGKILLed; a fourth joins; then a rolling restart of the three live
//! members (SIGTERM, which drains; started again at once under the same identity). Per event:
//! the longest gap between durable flushes of the partitions that stayed with their member, and
//! of those that moved (in a restart, the member's own), and how long until everything sent
//! before the event was durable again.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use tally_aggregator::operator::pauses::{Owned, Watch, stayed_put};

use crate::env::{Env, free_port, stop};
use crate::probe;
use crate::results::RebalanceEvent;

const PARTITIONS: i32 = 12;
const RATE: u64 = 6_000;
const TIMEOUT: Duration = Duration::from_secs(90);

/// A member: its name and process.
struct Member {
    name: String,
    child: Child,
}

struct Run<'e, 'a> {
    env: &'e Env<'a>,
    topic: String,
    group: String,
    dlq: String,
    watch: Watch,
}

impl Run<'_, '_> {
    fn spawn(&self, name: &str) -> anyhow::Result<Member> {
        let port = free_port()?;
        let id = format!("group.instance.id={}-{name}", self.group);
        let log = format!("{}-{name}", self.group);
        let child = (self.env).aggregator_logged(
            &self.topic,
            &self.group,
            &self.dlq,
            port,
            &["--kafka-option", &id],
            &log,
        )?;
        self.watch.add(name, port);
        Ok(Member {
            name: name.to_owned(),
            child,
        })
    }

    async fn end_offsets(&self) -> anyhow::Result<Vec<i64>> {
        let (brokers, topic) = (self.env.args.brokers.clone(), self.topic.clone());
        tokio::task::spawn_blocking(move || {
            use rdkafka::consumer::{BaseConsumer, Consumer};
            let consumer: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .create()?;
            (0..PARTITIONS)
                .map(|p| {
                    let (_, end) = consumer.fetch_watermarks(&topic, p, Duration::from_secs(10))?;
                    Ok(end)
                })
                .collect::<anyhow::Result<Vec<i64>>>()
        })
        .await?
    }

    /// After `event` at `at`: waits until `members` own every partition (each at least
    /// `each`) and everything sent before it is durable; what it cost. The partitions of
    /// `restarted` count as moved even when it takes them back.
    async fn measure(
        &self,
        event: &str,
        at: Instant,
        before: &Owned,
        members: &[&str],
        each: usize,
        restarted: Option<&str>,
    ) -> anyhow::Result<(RebalanceEvent, Owned)> {
        let sent = self.end_offsets().await?;
        let (after, owned_again, durable_again) = (self.watch)
            .settle(at, members, each, &sent, TIMEOUT)
            .await
            .map_err(|missing| anyhow!("{event}: {missing}"))?;
        let (kept, moved) = stayed_put(before, &after, restarted);
        let gap = |partitions: &[i32]| self.watch.longest_pause(partitions, at).1.as_secs_f64();
        let result = RebalanceEvent {
            event: event.to_owned(),
            kept: kept.len(),
            kept_longest_gap_s: gap(&kept),
            moved: moved.len(),
            moved_longest_gap_s: gap(&moved),
            owned_again_s: owned_again.as_secs_f64(),
            durable_again_s: durable_again.as_secs_f64(),
        };
        println!(
            "  {event}: {} kept (longest gap {:.2} s), {} moved (longest gap {:.2} s), durable again at {:.2} s",
            result.kept,
            result.kept_longest_gap_s,
            result.moved,
            result.moved_longest_gap_s,
            result.durable_again_s
        );
        Ok((result, after))
    }
}

pub(crate) async fn rebalance(env: &mut Env<'_>) -> anyhow::Result<Vec<RebalanceEvent>> {
    let topic = env.name("rebalance");
    env.create_topic(&topic, PARTITIONS).await?;
    let group = env.name("rebalance-agg");
    let dlq = format!("{group}.dlq");
    env.create_topic(&dlq, 1).await?;
    let run = Run {
        env,
        topic,
        group,
        dlq,
        watch: Watch::start(|port| async move { probe::metrics_text(port).await.ok() }),
    };
    println!("rebalance: 3 aggregators, {RATE} events/s into {PARTITIONS} partitions");
    // Long enough for every event below; stopped at the end.
    let mut load = Command::new(env.bin("tally"))
        .args([
            "load",
            "--brokers",
            &env.args.brokers,
            "--topic",
            &run.topic,
        ])
        .args(["--events", &(RATE * 600).to_string()])
        .args([
            "--rate",
            &RATE.to_string(),
            "--counters",
            "5000",
            "--top",
            "0",
        ])
        .stdout(Stdio::null())
        .spawn()
        .context("tally load")?;
    let result = events(&run).await;
    let _ = stop(&mut load);
    result
}

async fn events(run: &Run<'_, '_>) -> anyhow::Result<Vec<RebalanceEvent>> {
    let mut members = Vec::new();
    for name in ["a", "b", "c"] {
        members.push(run.spawn(name)?);
    }
    let result = async {
        let mut results = Vec::new();
        let names = |members: &[Member]| -> Vec<String> {
            members.iter().map(|m| m.name.clone()).collect()
        };
        let mut owned = (run
            .watch
            .wait_owned(&["a", "b", "c"], PARTITIONS as usize, 4, TIMEOUT))
        .await
        .map_err(|owned| anyhow!("three members never shared the partitions: {owned:?}"))?;

        let mut victim = members.remove(2);
        victim.child.kill()?;
        victim.child.wait()?;
        run.watch.remove(&victim.name);
        let alive = names(&members);
        let alive: Vec<&str> = alive.iter().map(String::as_str).collect();
        let (event, after) = (run.measure(
            "a member SIGKILLed",
            Instant::now(),
            &owned,
            &alive,
            1,
            None,
        ))
        .await?;
        results.push(event);
        owned = after;

        members.push(run.spawn("d")?);
        let alive = names(&members);
        let alive: Vec<&str> = alive.iter().map(String::as_str).collect();
        let (event, after) =
            (run.measure("a member joins", Instant::now(), &owned, &alive, 3, None)).await?;
        results.push(event);
        owned = after;

        for i in 0..members.len() {
            let name = members[i].name.clone();
            let at = Instant::now();
            stop(&mut members[i].child)?;
            run.watch.remove(&name);
            members[i] = run.spawn(&name)?;
            let alive = names(&members);
            let alive: Vec<&str> = alive.iter().map(String::as_str).collect();
            let event = format!("rolling restart {}/{}", i + 1, members.len());
            let (event, after) = (run.measure(&event, at, &owned, &alive, 3, Some(&name))).await?;
            results.push(event);
            owned = after;
        }
        Ok(results)
    }
    .await;
    for member in &mut members {
        let _ = stop(&mut member.child);
    }
    result
}

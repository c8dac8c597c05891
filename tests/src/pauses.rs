//! Watching what a rebalance costs: every member's `tally_durable_offset` sampled every 100 ms
//! in the background, into a [`DurableHistory`] that tells each partition's longest pause; and
//! a [`Group`] of members with stable identities, whose rebalances it measures.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tally_aggregator::operator::pauses::{DurableHistory, durable_offsets};
use tokio::task::JoinHandle;

use crate::{AggregatorProcess, AggregatorSetup, end_offsets_on, http_get, unique};

/// Samples the members' durable offsets until dropped.
#[derive(Debug)]
pub struct PauseWatch {
    members: Arc<Mutex<Vec<(String, u16)>>>,
    history: Arc<Mutex<DurableHistory>>,
    task: JoinHandle<()>,
}

impl PauseWatch {
    /// Starts sampling; members are added with [`PauseWatch::add`].
    pub fn start() -> Self {
        let members: Arc<Mutex<Vec<(String, u16)>>> = Arc::default();
        let history: Arc<Mutex<DurableHistory>> = Arc::default();
        let task = tokio::spawn({
            let (members, history) = (members.clone(), history.clone());
            async move {
                loop {
                    let now: Vec<(String, u16)> = lock(&members).clone();
                    for (name, port) in now {
                        // A member that does not answer (killed, not up yet) reports nothing.
                        if let Some(text) = http_get(port, "/metrics").await {
                            let offsets = durable_offsets(&text);
                            lock(&history).record(&name, Instant::now(), &offsets);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        Self {
            members,
            history,
            task,
        }
    }

    /// Samples `member` from now on, under `name`; a name given again replaces its process
    /// (a restart).
    pub fn add(&self, name: &str, member: &AggregatorProcess) {
        let mut members = lock(&self.members);
        members.retain(|(n, _)| n != name);
        members.push((name.to_owned(), member.metrics_port()));
    }

    /// Stops sampling `name` (killed), so its last sample no longer claims its partitions.
    pub fn remove(&self, name: &str) {
        lock(&self.members).retain(|(n, _)| n != name);
        lock(&self.history).record(name, Instant::now(), &[]);
    }

    /// The partitions `name` reported in its latest sample.
    pub fn owned_by(&self, name: &str) -> Vec<i32> {
        lock(&self.history).owned_by(name)
    }

    /// The longest pause among `partitions` between `from` and now, and whose it was.
    pub fn longest_pause(&self, partitions: &[i32], from: Instant) -> (i32, Duration) {
        (lock(&self.history).longest_among(partitions, from, Instant::now()))
            .unwrap_or((-1, Duration::ZERO))
    }

    /// Waits until the members named report `partitions` partitions between them, each at
    /// least `each`, and returns what each owns.
    pub async fn wait_owned(
        &self,
        names: &[&str],
        partitions: usize,
        each: usize,
        timeout: Duration,
    ) -> Vec<(String, Vec<i32>)> {
        let deadline = Instant::now() + timeout;
        loop {
            let owned: Vec<(String, Vec<i32>)> = (names.iter())
                .map(|n| ((*n).to_owned(), self.owned_by(n)))
                .collect();
            let total: usize = owned.iter().map(|(_, o)| o.len()).sum();
            if total == partitions && owned.iter().all(|(_, o)| o.len() >= each) {
                return owned;
            }
            assert!(
                Instant::now() < deadline,
                "after {timeout:?}, no {partitions} partitions spread over {names:?}: {owned:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every partition `p` is durable up to `ends[p]`, whoever owns it, and returns
    /// how long that took.
    pub async fn wait_durable(&self, ends: &[i64], timeout: Duration) -> Duration {
        let started = Instant::now();
        loop {
            let behind: Vec<(usize, i64, Option<i64>)> = {
                let history = lock(&self.history);
                (ends.iter().enumerate())
                    .map(|(p, end)| (p, *end, history.durable(p as i32)))
                    .filter(|(_, end, durable)| durable.is_none_or(|d| d < *end))
                    .collect()
            };
            if behind.is_empty() {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < timeout,
                "after {timeout:?}, partitions not yet durable to the end (partition, end, durable): {behind:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for PauseWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Aggregators of one group, each with a stable `group.instance.id` and a name, watched by a
/// [`PauseWatch`].
#[derive(Debug)]
pub struct Group<'a> {
    setup: &'a AggregatorSetup,
    dir: &'a Path,
    extra: Vec<String>,
    /// Every member's durable offsets.
    pub watch: PauseWatch,
    ids: Vec<(String, String)>,
}

/// What one rebalance cost: the partitions that stayed with the same member, and the longest
/// any of them went without a durable flush from the fault until everything sent before it was
/// durable.
#[derive(Debug)]
pub struct Rebalanced {
    /// Who owned what before.
    pub before: Vec<(String, Vec<i32>)>,
    /// Who owns what after.
    pub after: Vec<(String, Vec<i32>)>,
    /// The partitions that stayed put.
    pub kept: Vec<i32>,
    /// The longest pause among them, and whose.
    pub pause: (i32, Duration),
    /// From the fault until every partition is owned again.
    pub moved: Duration,
    /// From the fault until everything sent before it is durable.
    pub settled: Duration,
}

impl<'a> Group<'a> {
    /// A group of `setup`'s aggregators, each started with `extra` flags.
    pub fn new(setup: &'a AggregatorSetup, dir: &'a Path, extra: &[&str]) -> Self {
        Self {
            setup,
            dir,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            watch: PauseWatch::start(),
            ids: Vec::new(),
        }
    }

    /// Starts member `name`: under the `group.instance.id` it had, if it ran before.
    pub fn spawn(&mut self, name: &str) -> AggregatorProcess {
        let id = match self.ids.iter().find(|(n, _)| n == name) {
            Some((_, id)) => id.clone(),
            None => {
                let id = unique(&format!("member-{name}"));
                self.ids.push((name.to_owned(), id.clone()));
                id
            }
        };
        let option = format!("group.instance.id={id}");
        let mut flags: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        flags.extend(["--kafka-option", &option]);
        let member = self.setup.spawn(self.dir, &flags);
        self.watch.add(name, &member);
        member
    }

    /// SIGKILLs member `name`.
    pub fn kill(&self, name: &str, member: &mut AggregatorProcess) {
        member.kill();
        self.watch.remove(name);
    }

    /// What each of `names` owns now.
    pub fn owned(&self, names: &[&str]) -> Vec<(String, Vec<i32>)> {
        (names.iter())
            .map(|n| ((*n).to_owned(), self.watch.owned_by(n)))
            .collect()
    }

    /// After a fault at `fault` (a kill, a join): waits until `members` own all `partitions`,
    /// each at least `each`, and everything sent before the fault is durable; what it cost.
    pub async fn rebalanced(
        &self,
        fault: Instant,
        before: Vec<(String, Vec<i32>)>,
        members: &[&str],
        partitions: i32,
        each: usize,
    ) -> Rebalanced {
        let sent = end_offsets_on(&self.setup.brokers, &self.setup.topic, partitions).await;
        let timeout = Duration::from_secs(60);
        let after = (self.watch)
            .wait_owned(members, partitions as usize, each, timeout)
            .await;
        let moved = fault.elapsed();
        self.watch.wait_durable(&sent, timeout).await;
        let settled = fault.elapsed();
        let kept: Vec<i32> = (before.iter())
            .flat_map(|(name, owned)| {
                let now = after.iter().find(|(n, _)| n == name).map(|(_, o)| o);
                owned
                    .iter()
                    .filter(move |p| now.is_some_and(|o| o.contains(p)))
            })
            .copied()
            .collect();
        let pause = self.watch.longest_pause(&kept, fault);
        Rebalanced {
            before,
            after,
            kept,
            pause,
            moved,
            settled,
        }
    }
}

/// How many times `member` logged that it revoked partitions.
pub fn revokes_seen(member: &AggregatorProcess) -> usize {
    member.log().matches("partitions revoked").count()
}

/// How many times `member` logged an assignment (every rebalance it took part in).
pub fn assignments_seen(member: &AggregatorProcess) -> usize {
    member.log().matches("partitions assigned").count()
}

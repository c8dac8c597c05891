//! What a rebalance costs, measured on a [`Group`] of members with stable identities: every
//! member's `tally_durable_offset` sampled every 100 ms in the background
//! (`tally_aggregator::operator::pauses::Watch`), and each partition's longest pause read from it.

use std::path::Path;
use std::time::{Duration, Instant};

use tally_aggregator::operator::pauses::{Owned, Watch, stayed_put};

use crate::http::http_get;
use crate::kafka::end_offsets_on;
use crate::process::{AggregatorProcess, AggregatorSetup};
use crate::support::unique;

/// Aggregators of one group, each with a stable `group.instance.id` and a name, watched by a
/// [`Watch`].
#[derive(Debug)]
pub struct Group<'a> {
    setup: &'a AggregatorSetup,
    dir: &'a Path,
    extra: Vec<String>,
    /// Every member's durable offsets.
    pub watch: Watch,
    ids: Vec<(String, String)>,
}

/// What one rebalance cost: the partitions that stayed with the same member, and the longest
/// any of them went without a durable flush from the fault until everything sent before it was
/// durable.
#[derive(Debug)]
pub struct Rebalanced {
    /// Who owned what before.
    pub before: Owned,
    /// Who owns what after.
    pub after: Owned,
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
            watch: Watch::start(|port| http_get(port, "/metrics")),
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
        self.watch.add(name, member.metrics_port());
        member
    }

    /// SIGKILLs member `name`.
    pub fn kill(&self, name: &str, member: &mut AggregatorProcess) {
        member.kill();
        self.watch.remove(name);
    }

    /// Waits until `members` own all `partitions`, each at least `each`; what each owns.
    pub async fn wait_owned(&self, members: &[&str], partitions: i32, each: usize) -> Owned {
        let timeout = Duration::from_secs(60);
        (self.watch.wait_owned(members, partitions as usize, each, timeout).await)
            .unwrap_or_else(|owned| {
                panic!("after {timeout:?}, no {partitions} partitions spread over {members:?}: {owned:?}")
            })
    }

    /// After a fault at `fault` (a kill, a join, a restart): waits until `members` own all
    /// `partitions`, each at least `each`, and everything sent before the fault is durable;
    /// what it cost.
    pub async fn rebalanced(
        &self,
        fault: Instant,
        before: Owned,
        members: &[&str],
        partitions: i32,
        each: usize,
    ) -> Rebalanced {
        let sent = end_offsets_on(&self.setup.brokers, &self.setup.topic, partitions).await;
        let (after, moved, settled) = (self.watch)
            .settle(fault, members, each, &sent, Duration::from_secs(60))
            .await
            .unwrap_or_else(|missing| panic!("after 60 s, {missing}"));
        let (kept, _) = stayed_put(&before, &after, None);
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

//! How long each partition went without a durable flush, from samples of the aggregators'
//! `tally_durable_offset`: what a rebalance costs, as the bench's rebalance scenario and the
//! failover tests measure it. [`DurableHistory`] is the arithmetic, pure; [`Watch`] samples
//! every member every 100 ms into one, through the caller's scrape of `/metrics`.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

/// Every `tally_durable_offset` series in a Prometheus text exposition: (partition, offset).
pub fn durable_offsets(exposition: &str) -> Vec<(i32, i64)> {
    (exposition.lines())
        .filter_map(|line| line.strip_prefix("tally_durable_offset{partition=\""))
        .filter_map(|rest| {
            let (partition, value) = rest.split_once("\"} ")?;
            Some((
                partition.parse().ok()?,
                value.trim().parse::<f64>().ok()? as i64,
            ))
        })
        .collect()
}

/// Each partition's durable offset over time, and who owned it: member names are the
/// caller's (a port, a pod name).
#[derive(Debug, Default)]
pub struct DurableHistory {
    /// Per partition: the highest durable offset seen, and the moments it rose.
    advances: BTreeMap<i32, (i64, Vec<Instant>)>,
    /// Per partition: the member that reported it in the latest sample of each member.
    owners: HashMap<i32, String>,
}

impl DurableHistory {
    /// One member's sample at `at`: the partitions it reports, with their durable offsets.
    pub fn record(&mut self, member: &str, at: Instant, offsets: &[(i32, i64)]) {
        self.owners.retain(|_, owner| owner != member);
        for &(partition, offset) in offsets {
            self.owners.insert(partition, member.to_owned());
            let (highest, rises) = self.advances.entry(partition).or_insert((offset, vec![at]));
            if offset > *highest {
                *highest = offset;
                rises.push(at);
            }
        }
    }

    /// The partitions `member` reports now.
    pub fn owned_by(&self, member: &str) -> Vec<i32> {
        let mut owned: Vec<i32> = (self.owners.iter())
            .filter(|(_, owner)| *owner == member)
            .map(|(partition, _)| *partition)
            .collect();
        owned.sort_unstable();
        owned
    }

    /// The highest durable offset any member reported for `partition`.
    pub fn durable(&self, partition: i32) -> Option<i64> {
        self.advances.get(&partition).map(|(highest, _)| *highest)
    }

    /// The longest time `partition` went without its durable offset rising between `from` and
    /// `to`, counting from its last rise before `from` (or `from`, if it had none) and up to
    /// `to` after its last rise.
    pub fn longest_pause(&self, partition: i32, from: Instant, to: Instant) -> Duration {
        let rises = self.advances.get(&partition).map_or(&[][..], |(_, r)| r);
        let before = rises.iter().rev().find(|t| **t <= from).copied();
        let mut last = before.unwrap_or(from);
        let mut longest = Duration::ZERO;
        for &rise in rises.iter().filter(|t| **t > from && **t <= to) {
            longest = longest.max(rise - last);
            last = rise;
        }
        longest.max(to.saturating_duration_since(last))
    }

    /// The longest pause among `partitions` between `from` and `to`, and whose it was.
    pub fn longest_among(
        &self,
        partitions: &[i32],
        from: Instant,
        to: Instant,
    ) -> Option<(i32, Duration)> {
        (partitions.iter())
            .map(|p| (*p, self.longest_pause(*p, from, to)))
            .max_by_key(|(_, pause)| *pause)
    }
}

/// Who owns which partitions: (member, its partitions), per member.
pub type Owned = Vec<(String, Vec<i32>)>;

/// The partitions of `before` still with the same member in `after` (kept), and the others
/// (moved). `restarted`'s partitions count as moved even if it took them back: they stopped.
pub fn stayed_put(before: &Owned, after: &Owned, restarted: Option<&str>) -> (Vec<i32>, Vec<i32>) {
    let (mut kept, mut moved) = (Vec::new(), Vec::new());
    for (name, owned) in before {
        let now = (after.iter()).find(|(n, _)| n == name && restarted != Some(name.as_str()));
        for &partition in owned {
            match now {
                Some((_, o)) if o.contains(&partition) => kept.push(partition),
                _ => moved.push(partition),
            }
        }
    }
    (kept, moved)
}

/// Samples the members' durable offsets every 100 ms until dropped.
#[derive(Debug)]
pub struct Watch {
    members: Arc<Mutex<Vec<(String, u16)>>>,
    history: Arc<Mutex<DurableHistory>>,
    task: JoinHandle<()>,
}

impl Watch {
    /// Starts sampling through `scrape` (a member's metrics port to its `/metrics` text, or
    /// `None` if it does not answer); members are added with [`Watch::add`].
    pub fn start<F, Fut>(scrape: F) -> Self
    where
        F: Fn(u16) -> Fut + Send + 'static,
        Fut: Future<Output = Option<String>> + Send,
    {
        let members: Arc<Mutex<Vec<(String, u16)>>> = Arc::default();
        let history: Arc<Mutex<DurableHistory>> = Arc::default();
        let task = tokio::spawn({
            let (members, history) = (members.clone(), history.clone());
            async move {
                loop {
                    let now: Vec<(String, u16)> = lock(&members).clone();
                    for (name, port) in now {
                        // A member that does not answer (killed, not up yet) reports nothing.
                        if let Some(text) = scrape(port).await {
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

    /// Samples the member serving metrics on `port` from now on, under `name`; a name given
    /// again replaces its process (a restart).
    pub fn add(&self, name: &str, port: u16) {
        let mut members = lock(&self.members);
        members.retain(|(n, _)| n != name);
        members.push((name.to_owned(), port));
    }

    /// Stops sampling `name` (killed, stopped), so its last sample no longer claims partitions.
    pub fn remove(&self, name: &str) {
        lock(&self.members).retain(|(n, _)| n != name);
        lock(&self.history).record(name, Instant::now(), &[]);
    }

    /// The partitions `name` reported in its latest sample.
    pub fn owned_by(&self, name: &str) -> Vec<i32> {
        lock(&self.history).owned_by(name)
    }

    /// What each of `names` owns now.
    pub fn owned(&self, names: &[&str]) -> Owned {
        (names.iter())
            .map(|n| ((*n).to_owned(), self.owned_by(n)))
            .collect()
    }

    /// The longest pause among `partitions` between `from` and now, and whose it was.
    pub fn longest_pause(&self, partitions: &[i32], from: Instant) -> (i32, Duration) {
        (lock(&self.history).longest_among(partitions, from, Instant::now()))
            .unwrap_or((-1, Duration::ZERO))
    }

    /// Waits until `names` report `partitions` partitions between them, each at least `each`:
    /// what each owns then, or on timeout what each owned last.
    pub async fn wait_owned(
        &self,
        names: &[&str],
        partitions: usize,
        each: usize,
        timeout: Duration,
    ) -> Result<Owned, Owned> {
        let deadline = Instant::now() + timeout;
        loop {
            let owned = self.owned(names);
            let total: usize = owned.iter().map(|(_, o)| o.len()).sum();
            if total == partitions && owned.iter().all(|(_, o)| o.len() >= each) {
                return Ok(owned);
            }
            if Instant::now() >= deadline {
                return Err(owned);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// After a fault at `fault` (a kill, a join, a restart): waits until `members` own every
    /// partition of `sent`, each at least `each`, then until everything sent before the fault
    /// is durable (`sent[p]`: partition `p`'s end, read once the fault was made). What each owns
    /// then, and how long after the fault each wait ended; on timeout, what was missing.
    pub async fn settle(
        &self,
        fault: Instant,
        members: &[&str],
        each: usize,
        sent: &[i64],
        timeout: Duration,
    ) -> Result<(Owned, Duration, Duration), String> {
        let after = (self.wait_owned(members, sent.len(), each, timeout).await)
            .map_err(|owned| format!("not all {} partitions owned again: {owned:?}", sent.len()))?;
        let owned_again = fault.elapsed();
        (self.wait_durable(sent, timeout).await)
            .map_err(|behind| format!("not durable again (partition, end, durable): {behind:?}"))?;
        Ok((after, owned_again, fault.elapsed()))
    }

    /// Waits until every partition `p` is durable up to `ends[p]`, whoever owns it: how long
    /// that took, or on timeout those behind (partition, end, durable).
    pub async fn wait_durable(
        &self,
        ends: &[i64],
        timeout: Duration,
    ) -> Result<Duration, Vec<(usize, i64, Option<i64>)>> {
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
                return Ok(started.elapsed());
            }
            if started.elapsed() >= timeout {
                return Err(behind);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_read_from_the_exposition() {
        let text = "# HELP tally_durable_offset x\n# TYPE tally_durable_offset gauge\n\
                    tally_durable_offset{partition=\"3\"} 42\n\
                    tally_durable_offset{partition=\"11\"} 7\n\
                    tally_durable_offsets_other{partition=\"1\"} 9\n";
        assert_eq!(durable_offsets(text), vec![(3, 42), (11, 7)]);
    }

    #[test]
    fn the_longest_pause_counts_from_the_last_rise_and_to_the_end() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut history = DurableHistory::default();
        for (ms, offset) in [(0, 10), (100, 20), (200, 20), (900, 30), (1000, 31)] {
            history.record("a", at(ms), &[(0, offset)]);
        }
        // 100 → 900 is the longest within [150, 1000].
        assert_eq!(
            history.longest_pause(0, at(150), at(1000)),
            Duration::from_millis(800)
        );
        // Nothing rose after 1000: the pause runs to the window's end.
        assert_eq!(
            history.longest_pause(0, at(950), at(2500)),
            Duration::from_millis(1500)
        );
        // A partition never seen paused for the whole window.
        assert_eq!(
            history.longest_pause(9, at(0), at(500)),
            Duration::from_millis(500)
        );
    }

    #[test]
    fn what_stayed_put_is_what_the_same_member_still_owns() {
        let owned = |pairs: &[(&str, &[i32])]| -> Owned {
            (pairs.iter())
                .map(|(n, p)| ((*n).to_owned(), p.to_vec()))
                .collect()
        };
        let before = owned(&[("a", &[0, 1]), ("b", &[2, 3])]);
        let after = owned(&[("a", &[0, 1, 3]), ("c", &[2])]);
        assert_eq!(stayed_put(&before, &after, None), (vec![0, 1], vec![2, 3]));
        // A member restarted in place stopped, even though it has its partitions back.
        let back = owned(&[("a", &[0, 1]), ("b", &[2, 3])]);
        assert_eq!(
            stayed_put(&before, &back, Some("a")),
            (vec![2, 3], vec![0, 1])
        );
    }

    #[test]
    fn owners_follow_the_latest_sample_of_each_member() {
        let t0 = Instant::now();
        let mut history = DurableHistory::default();
        history.record("a", t0, &[(0, 1), (1, 1)]);
        history.record("b", t0, &[(2, 1)]);
        history.record("a", t0, &[(0, 2)]);
        history.record("b", t0, &[(1, 5), (2, 2)]);
        assert_eq!(history.owned_by("a"), vec![0]);
        assert_eq!(history.owned_by("b"), vec![1, 2]);
        assert_eq!(
            (history.longest_among(&[0, 1, 2], t0, t0 + Duration::from_secs(1)))
                .map(|(_, pause)| pause),
            Some(Duration::from_secs(1))
        );
    }
}

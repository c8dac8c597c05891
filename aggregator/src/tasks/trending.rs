//! Trending counters and the cache warmer.
//!
//! The aggregator sees which counters move fastest. Each flush's counters feed a **Space-Saving**
//! heavy-hitters sketch per namespace ([`SpaceSaving`]: a fixed number of entries, not one per
//! counter; any counter whose activity exceeds 1/capacity of the namespace's total is in it). The
//! activity of a counter is the sum of |delta| of its events (a like or unlike counts 1).
//!
//! Every publish interval the sketches are taken and reset, and each namespace's top entries are
//! added (`ZINCRBY`) to a shared per-bucket sorted set, `<prefix>:top:<namespace>:<bucket>` (10 s
//! buckets, kept 2 minutes), which every aggregator adds to: `Reader::top` merges the last
//! minute's buckets. The same top entries become the process's **hot set**: after each durable
//! flush, the hot counters it wrote get their cached totals refreshed (`cache::warm`), so readers
//! of trending content find a fresh entry instead of reading shards.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tally_common::namespace::namespace_of;
use tally_common::reader::TOP_BUCKET_S;
use tally_common::{Namespaces, Reader};
use tokio_util::sync::CancellationToken;

use crate::machine::batch::SealedBatch;
use crate::operator::metrics::Metrics;

/// The trending maps' hasher: a batch's every counter is looked up in them (its namespace's
/// sketch, the hot set), so foldhash rather than SipHash, as the batch's own maps.
type Hasher = foldhash::fast::RandomState;

/// Entries per namespace sketch.
pub const SKETCH_CAPACITY: usize = 64;
/// Top counters per namespace published and kept hot.
pub const TOP_K: usize = 20;
/// How long a bucket is kept.
const BUCKET_TTL_S: i64 = 120;

/// The Space-Saving sketch (Metwally et al.): `capacity` counters with their estimated activity.
/// A new counter arriving when it is full replaces the smallest entry and inherits its count, so
/// estimates never undercount and every heavy hitter stays in.
///
/// On a long tail nearly every counter is new, so the replacement is the common case: it scans
/// the entries' counts (one array) and reuses the replaced entry's strings. Scanning a map with
/// ties broken by name, and allocating a key per replacement, was a quarter of the
/// aggregator's CPU on a catch-up where every event is a distinct counter (perf, session 28).
#[derive(Debug, Clone)]
pub struct SpaceSaving {
    capacity: usize,
    /// Each entry's estimated activity.
    counts: Vec<u64>,
    /// Each entry's counter.
    names: Vec<String>,
    /// Where each counter's entry is.
    slots: HashMap<String, usize, Hasher>,
}

impl SpaceSaving {
    /// An empty sketch of `capacity` entries.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            capacity,
            counts: Vec::with_capacity(capacity),
            names: Vec::with_capacity(capacity),
            slots: HashMap::with_capacity_and_hasher(capacity, Default::default()),
        }
    }

    /// Adds `weight` of activity to `counter`.
    pub fn add(&mut self, counter: &str, weight: u64) {
        if let Some(&i) = self.slots.get(counter) {
            self.counts[i] += weight;
            return;
        }
        if self.counts.len() < self.capacity {
            self.slots.insert(counter.to_owned(), self.counts.len());
            self.counts.push(weight);
            self.names.push(counter.to_owned());
            return;
        }
        // The smallest entry (the first of equals) makes room, and its count is inherited.
        let Some(i) = (0..self.counts.len()).min_by_key(|&i| self.counts[i]) else {
            return;
        };
        let name = &mut self.names[i];
        let (mut key, _) = (self.slots)
            .remove_entry(name.as_str())
            .expect("every entry has a slot");
        key.clear();
        key.push_str(counter);
        name.clear();
        name.push_str(counter);
        self.slots.insert(key, i);
        self.counts[i] += weight;
    }

    /// The `k` largest entries, largest first.
    pub fn top(&self, k: usize) -> Vec<(String, u64)> {
        let mut all: Vec<(String, u64)> = (self.names.iter().cloned())
            .zip(self.counts.iter().copied())
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        all.truncate(k);
        all
    }
}

/// The trending sketches, the hot set, and what warming needs.
#[derive(Debug)]
pub struct Trending {
    /// Per namespace, the sketch since the last publish.
    sketches: Mutex<HashMap<String, SpaceSaving, Hasher>>,
    /// The counters kept warm: the last published top of every namespace.
    hot: RwLock<Arc<HashSet<String, Hasher>>>,
    /// Exact reads for warming, and where to publish.
    reader: Reader,
    /// Cache TTLs.
    namespaces: Arc<Namespaces>,
    /// Where the hottest counters' activity is exported (never their ids).
    metrics: Option<Arc<Metrics>>,
}

impl Trending {
    /// Trending state publishing through `reader`'s connection and keyspace.
    pub fn new(reader: Reader, namespaces: Arc<Namespaces>) -> Self {
        Self {
            sketches: Mutex::new(HashMap::default()),
            hot: RwLock::new(Arc::new(HashSet::default())),
            reader,
            namespaces,
            metrics: None,
        }
    }

    /// Also exports the activity of the hottest counters to `metrics` at each publish.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Feeds a sealed batch's counters to the sketches, and returns those of them that are hot
    /// now (to warm once the batch is durable).
    pub fn observe(&self, batch: &SealedBatch) -> Vec<String> {
        let hot = self
            .hot
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut warm = Vec::new();
        let mut sketches = self.sketches.lock().unwrap_or_else(PoisonError::into_inner);
        let mut feed = |counter: &str, weight: u64| {
            let ns = namespace_of(counter);
            match sketches.get_mut(ns) {
                Some(sketch) => sketch.add(counter, weight),
                None => {
                    let mut sketch = SpaceSaving::new(SKETCH_CAPACITY);
                    sketch.add(counter, weight);
                    sketches.insert(ns.to_owned(), sketch);
                }
            }
            if hot.contains(counter) {
                warm.push(counter.to_owned());
            }
        };
        for group in &batch.groups {
            for (counter, delta) in &group.deltas {
                feed(counter, delta.unsigned_abs());
            }
            // One feed per counter's run of likes, weighted by how many there are.
            for run in group.members.each_run() {
                feed(run.counter, run.members().len() as u64);
            }
        }
        warm.sort_unstable();
        warm.dedup();
        warm
    }

    /// Refreshes the cached totals of `counters` (hot counters a durable flush just wrote).
    pub async fn warm(&self, counters: &[String]) {
        let names: Vec<&str> = counters.iter().map(String::as_str).collect();
        if let Err(error) = tally_common::cache::warm(&self.reader, &self.namespaces, &names).await
        {
            tracing::debug!(%error, "warming hot counters failed");
        }
    }

    /// Takes the sketches, adds each namespace's top to the current bucket, and makes it the
    /// hot set.
    pub async fn publish(&self) -> redis::RedisResult<()> {
        let sketches =
            std::mem::take(&mut *self.sketches.lock().unwrap_or_else(PoisonError::into_inner));
        let bucket = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            / TOP_BUCKET_S;
        let mut hot = HashSet::default();
        let mut activity = Vec::new();
        let ks = self.reader.keyspace();
        for (namespace, sketch) in &sketches {
            let top = sketch.top(TOP_K);
            if top.is_empty() {
                continue;
            }
            let key = ks.top_key(namespace, bucket);
            let mut pipe = redis::pipe();
            for (counter, weight) in &top {
                pipe.zincr(&key, counter, *weight).ignore();
                hot.insert(counter.clone());
                activity.push(*weight);
            }
            pipe.expire(&key, BUCKET_TTL_S).ignore();
            // One key per pipeline: single-slot on a cluster too.
            pipe.query_async::<()>(&mut self.reader.conn().clone())
                .await?;
        }
        *self.hot.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(hot);
        if let Some(metrics) = &self.metrics {
            activity.sort_unstable_by(|a, b| b.cmp(a));
            metrics.trending(&activity);
        }
        Ok(())
    }

    /// Publishes every `interval` until `cancel` fires.
    pub async fn run(self: Arc<Self>, interval: Duration, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        tick.tick().await;
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(error) = self.publish().await {
                tracing::warn!(%error, "publishing trending counters failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sketch_keeps_every_heavy_hitter_within_its_capacity() {
        let mut sketch = SpaceSaving::new(8);
        // Three heavy counters among a thousand light ones.
        for i in 0..1_000u64 {
            sketch.add(&format!("likes:light:{i}"), 1);
            if i % 4 == 0 {
                sketch.add("likes:hot:a", 5);
                sketch.add("likes:hot:b", 3);
                sketch.add("likes:hot:c", 2);
            }
        }
        let top: Vec<String> = sketch.top(3).into_iter().map(|(c, _)| c).collect();
        assert_eq!(top, ["likes:hot:a", "likes:hot:b", "likes:hot:c"]);
        assert!(sketch.counts.len() <= 8 && sketch.slots.len() == sketch.counts.len());
        // Estimates never undercount, and they add up to all the activity fed.
        assert!(sketch.top(1)[0].1 >= 1_250);
        assert_eq!(sketch.counts.iter().sum::<u64>(), 1_000 + 250 * 10);
        for (i, name) in sketch.names.iter().enumerate() {
            assert_eq!(sketch.slots[name], i, "{name}");
        }
    }
}

//! Cached reads that survive a stampede.
//!
//! Summing a counter's shards on every page view would move the write load onto the read path,
//! so readers serve a cached total for the namespace's TTL ([`crate::Policy::cache_ttl_ms`]).
//! The cache has two levels:
//!
//! - **in the process** ([`CachedReader`]'s map): a fresh entry is answered without any I/O.
//!   When it expires, the first caller refreshes it and every other concurrent caller in the
//!   process is answered with the last value (stale-while-revalidate), or, if there is no value
//!   yet, waits for that one refresh;
//! - **in Redis** (`<prefix>:t:<counter>`, `"<total>:<refreshed at ms>"`), shared by every
//!   reader process: a refresh first looks there, and sums the shards only when that entry is
//!   older than the TTL too. Then it takes the counter's refresh lock (`SET NX PX`); a process
//!   that finds the lock taken serves the shared entry's last value instead of reading shards.
//!
//! So when a hot counter's cached total expires under thousands of readers in many processes,
//! about one shard read per counter happens per TTL. A counter with nothing cached anywhere is
//! read without the lock, and a total of 0 is not stored unless an entry existed: reading
//! counters that were never written writes nothing to Redis (each process still keeps their
//! zeros in its own map for the TTL). [`CacheStats`] counts what each level did.
//! [`CachedReader::get_exact`] bypasses both levels.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::Cmd;
use tokio::sync::watch;

use crate::connection::query_each;
use crate::display::display;
use crate::event::validate_counter;
use crate::namespace::Namespaces;
use crate::reader::{ReadError, Reader};
use crate::window::{Window, Windows, format_duration};

/// How long a process may hold a counter's refresh lock.
const REFRESH_LOCK_MS: u64 = 2_000;
/// A shared entry is kept this many TTLs (at least [`MIN_SHARED_KEEP_MS`]), to be served while
/// another process refreshes it.
const SHARED_KEEP_TTLS: u64 = 20;
const MIN_SHARED_KEEP_MS: u64 = 60_000;
/// What trending ranks by in a namespace with windows: the last minute.
const TRENDING_SPAN_MS: i64 = 60_000;
/// Most entries kept in the process: past it, expired ones are swept out, then others until
/// half are left. A counter id is at most 256 bytes, so the map holds at most about 35 MB.
const MAX_LOCAL_ENTRIES: usize = 100_000;

/// Brings the process's map from past [`MAX_LOCAL_ENTRIES`] down to half of it at most: expired
/// entries go first, then any not being refreshed (their counters are read again when asked;
/// a namespace that keeps its display from going down may then show a smaller count once).
/// Each sweep is linear, and the next comes only after half the bound of new counters, so
/// reads stay fast at the bound.
fn shrink(local: &mut HashMap<String, Entry>, now: Instant) {
    local.retain(|_, e| e.fresh_until > now || e.is_refreshing());
    let mut excess = local.len().saturating_sub(MAX_LOCAL_ENTRIES / 2);
    if excess > 0 {
        local.retain(|_, e| {
            if excess > 0 && !e.is_refreshing() {
                excess -= 1;
                return false;
            }
            true
        });
    }
}

/// What the cache did, since the reader was created. Shared by clones of the reader.
#[derive(Debug, Default)]
pub struct CacheStats {
    /// Answered from the process's own fresh entry.
    pub local_hits: AtomicU64,
    /// Answered with the last value while a refresh was under way (here or in another process).
    pub stale_served: AtomicU64,
    /// Refreshed from another process's fresh entry in Redis, without reading shards.
    pub shared_hits: AtomicU64,
    /// Counters whose shards were read and summed to refresh the cache.
    pub shard_reads: AtomicU64,
}

impl CacheStats {
    fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// One counter's entry in the process.
#[derive(Debug)]
struct Entry {
    /// The last total read, if any.
    value: Option<i64>,
    /// Until when `value` may be served as fresh.
    fresh_until: Instant,
    /// While a refresh runs in this process: where its result will appear.
    refreshing: Option<watch::Receiver<Option<i64>>>,
    /// The largest count displayed so far (for namespaces whose display never decreases).
    shown: i64,
}

impl Entry {
    fn is_refreshing(&self) -> bool {
        // A refresh whose caller was cancelled drops its sender: no longer refreshing.
        self.refreshing
            .as_ref()
            .is_some_and(|rx| rx.has_changed().is_ok())
    }
}

/// A refreshed total, and until when it is fresh.
#[derive(Debug, Clone, Copy)]
struct Refreshed {
    value: i64,
    fresh_until: Instant,
}

/// Reads counter totals through the two-level cache. Cheap to clone; clones share the cache.
#[derive(Debug, Clone)]
pub struct CachedReader {
    /// Exact reads of the shards.
    reader: Reader,
    /// TTLs and display styles.
    namespaces: Arc<Namespaces>,
    /// The process's entries.
    local: Arc<Mutex<HashMap<String, Entry>>>,
    /// What the cache did.
    stats: Arc<CacheStats>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The command storing `counter`'s shared entry, refreshed at `wall` (unix ms), kept
/// [`SHARED_KEEP_TTLS`] TTLs so that it can be served while another process refreshes it.
fn store_shared(
    ks: &crate::keyspace::Keyspace,
    counter: &str,
    total: i64,
    wall: u64,
    ttl_ms: u64,
) -> Cmd {
    let mut set = Cmd::new();
    set.arg("SET")
        .arg(ks.cache_key(counter))
        .arg(format!("{total}:{wall}"))
        .arg("PX")
        .arg((ttl_ms * SHARED_KEEP_TTLS).max(MIN_SHARED_KEEP_MS));
    set
}

/// Parses a shared entry: `"<total>:<refreshed at ms>"`.
fn parse_shared(text: &str) -> Option<(i64, u64)> {
    let (total, at) = text.split_once(':')?;
    Some((total.parse().ok()?, at.parse().ok()?))
}

impl CachedReader {
    /// A cached reader over `reader`, with the namespaces' TTLs.
    pub fn new(reader: Reader, namespaces: Arc<Namespaces>) -> Self {
        Self {
            reader,
            namespaces,
            local: Arc::new(Mutex::new(HashMap::new())),
            stats: Arc::new(CacheStats::default()),
        }
    }

    /// What the cache did so far.
    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// The namespaces' policies.
    pub fn namespaces(&self) -> &Namespaces {
        &self.namespaces
    }

    /// The exact total, bypassing the cache.
    pub async fn get_exact(&self, counter: &str) -> Result<i64, ReadError> {
        self.reader.get(counter).await
    }

    /// Whether `actor`'s like of `counter` is counted (never cached: a user must see their own
    /// like at once).
    pub async fn has_liked(&self, counter: &str, actor: &str) -> Result<bool, ReadError> {
        self.reader.has_liked(counter, actor).await
    }

    /// The `k` fastest-moving counters of `namespace` over the last minute (never cached). In a
    /// namespace that keeps windows, the aggregators' heavy hitters are only the candidates:
    /// they are ranked by their exact sums in the narrowest window's current bucket and the
    /// buckets before it that reach back a full minute.
    pub async fn top(&self, namespace: &str, k: usize) -> Result<Vec<(String, f64)>, ReadError> {
        let windows = &self.namespaces.policy(namespace).windows;
        let Some(narrowest) = windows.list().first().copied() else {
            return self.reader.top(namespace, k).await;
        };
        let candidates = self.reader.top(namespace, 4 * k.max(1)).await?;
        let names: Vec<&str> = candidates.iter().map(|(c, _)| c.as_str()).collect();
        let buckets = (TRENDING_SPAN_MS + narrowest.width_ms - 1) / narrowest.width_ms + 1;
        let sums = (self.reader)
            .window_sums(&names, narrowest, buckets, crate::event::now_ms())
            .await?;
        let mut top: Vec<(String, f64)> = (names.into_iter().zip(sums))
            .filter(|(_, sum)| *sum != 0)
            .map(|(c, sum)| (c.to_owned(), sum as f64))
            .collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        top.truncate(k);
        Ok(top)
    }

    /// The entry every reader process shares for `counter`: the cached total and when it was
    /// refreshed (unix ms), or `None` if no reader has cached it (or it was dropped).
    pub async fn shared_entry(&self, counter: &str) -> Result<Option<(i64, u64)>, ReadError> {
        validate_counter(counter)?;
        let text: Option<String> = redis::cmd("GET")
            .arg(self.reader.keyspace().cache_key(counter))
            .query_async(&mut self.reader.conn().clone())
            .await?;
        Ok(text.as_deref().and_then(parse_shared))
    }

    /// The sums of `counters` over the last `span_ms`, in the same order: each read from the
    /// widest window of its namespace that divides the span (the bucket holding now and those
    /// before it, see `crate::window`). Read on every call, not cached: one `MGET` per shard
    /// group for the counters that share a window.
    pub async fn get_window<S: AsRef<str>>(
        &self,
        counters: &[S],
        span_ms: i64,
    ) -> Result<Vec<i64>, ReadError> {
        let now_ms = crate::event::now_ms();
        let mut plans: Vec<((Window, i64), Vec<usize>)> = Vec::new();
        for (i, counter) in counters.iter().enumerate() {
            let counter = counter.as_ref();
            validate_counter(counter)?;
            let windows = &self.namespaces.policy(counter).windows;
            let plan = windows.plan(span_ms).ok_or_else(|| ReadError::Window {
                counter: counter.to_owned(),
                why: no_plan(windows, span_ms),
            })?;
            match plans.iter_mut().find(|(p, _)| *p == plan) {
                Some((_, indexes)) => indexes.push(i),
                None => plans.push((plan, vec![i])),
            }
        }
        let cells: i64 = (plans.iter())
            .map(|((_, buckets), indexes)| buckets.saturating_mul(indexes.len() as i64))
            .fold(0, i64::saturating_add);
        if cells > crate::window::MAX_WINDOW_CELLS {
            return Err(ReadError::WindowTooLarge { cells });
        }
        let mut sums = vec![0; counters.len()];
        for ((window, buckets), indexes) in plans {
            let names: Vec<&str> = indexes.iter().map(|i| counters[*i].as_ref()).collect();
            let got = (self.reader)
                .window_sums(&names, window, buckets, now_ms)
                .await?;
            for (i, sum) in indexes.into_iter().zip(got) {
                sums[i] = sum;
            }
        }
        Ok(sums)
    }

    /// The exact reader under the cache.
    pub fn reader(&self) -> &Reader {
        &self.reader
    }

    /// The total of `counter`, fresh within its namespace's TTL.
    pub async fn get(&self, counter: &str) -> Result<i64, ReadError> {
        Ok(self.get_many(&[counter]).await?[0])
    }

    /// `counter`'s total rendered for people in its namespace's style; in a namespace whose
    /// display never decreases, never below what this process displayed before.
    pub async fn display(&self, counter: &str) -> Result<String, ReadError> {
        let value = self.get(counter).await?;
        let policy = self.namespaces.policy(counter);
        let shown = if policy.display_never_decreases {
            let mut local = self.lock();
            match local.get_mut(counter) {
                Some(entry) => {
                    entry.shown = entry.shown.max(value);
                    entry.shown
                }
                None => value,
            }
        } else {
            value
        };
        Ok(display(shown, policy.display))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.local.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The totals of `counters`, in order, each fresh within its namespace's TTL: answered from
    /// the process's entries where fresh, and otherwise refreshed together (shared entries in
    /// one pipeline, shard reads in another).
    pub async fn get_many<S: AsRef<str>>(&self, counters: &[S]) -> Result<Vec<i64>, ReadError> {
        for counter in counters {
            validate_counter(counter.as_ref())?;
        }
        let now = Instant::now();
        let mut out: Vec<Option<i64>> = vec![None; counters.len()];
        let mut mine: Vec<(usize, watch::Sender<Option<i64>>)> = Vec::new();
        let mut waits: Vec<(usize, watch::Receiver<Option<i64>>)> = Vec::new();
        {
            let mut local = self.lock();
            if local.len() > MAX_LOCAL_ENTRIES {
                shrink(&mut local, now);
            }
            for (i, counter) in counters.iter().enumerate() {
                let counter = counter.as_ref();
                let entry = local.entry(counter.to_owned()).or_insert_with(|| Entry {
                    value: None,
                    fresh_until: now,
                    refreshing: None,
                    shown: i64::MIN,
                });
                match (entry.value, entry.is_refreshing()) {
                    (Some(v), _) if now < entry.fresh_until => {
                        out[i] = Some(v);
                        CacheStats::add(&self.stats.local_hits, 1);
                    }
                    (Some(v), true) => {
                        out[i] = Some(v);
                        CacheStats::add(&self.stats.stale_served, 1);
                    }
                    (None, true) => {
                        if let Some(rx) = &entry.refreshing {
                            waits.push((i, rx.clone()));
                        }
                    }
                    (_, false) => {
                        let (tx, rx) = watch::channel(None);
                        entry.refreshing = Some(rx);
                        mine.push((i, tx));
                    }
                }
            }
        }
        if !mine.is_empty() {
            let names: Vec<&str> = mine.iter().map(|(i, _)| counters[*i].as_ref()).collect();
            let refreshed = self.refresh(&names).await;
            let mut local = self.lock();
            match refreshed {
                Ok(refreshed) => {
                    for ((i, tx), r) in mine.into_iter().zip(refreshed) {
                        if let Some(entry) = local.get_mut(counters[i].as_ref()) {
                            entry.value = Some(r.value);
                            entry.fresh_until = r.fresh_until;
                            entry.refreshing = None;
                        }
                        let _ = tx.send(Some(r.value));
                        out[i] = Some(r.value);
                    }
                }
                Err(error) => {
                    for (i, _) in &mine {
                        if let Some(entry) = local.get_mut(counters[*i].as_ref()) {
                            entry.refreshing = None;
                        }
                    }
                    return Err(error);
                }
            }
        }
        let mut orphans = Vec::new();
        for (i, mut rx) in waits {
            let value = match rx.wait_for(Option::is_some).await {
                Ok(v) => *v,
                Err(_) => None,
            };
            match value {
                Some(v) => out[i] = Some(v),
                // The refreshing caller failed or was cancelled: read for ourselves.
                None => orphans.push(i),
            }
        }
        if !orphans.is_empty() {
            let names: Vec<&str> = orphans.iter().map(|i| counters[*i].as_ref()).collect();
            for (i, r) in orphans.iter().zip(self.refresh(&names).await?) {
                out[*i] = Some(r.value);
            }
        }
        Ok(out.into_iter().map(|v| v.unwrap_or(0)).collect())
    }

    /// Refreshes `counters` from the shared entries, or from their shards where the shared
    /// entries are stale and this process takes the refresh lock; the steps are [`Refresh`]'s.
    async fn refresh(&self, counters: &[&str]) -> Result<Vec<Refreshed>, ReadError> {
        let mut refresh = Refresh {
            cache: self,
            counters,
            ttls: (counters.iter())
                .map(|c| self.namespaces.policy(c).cache_ttl_ms)
                .collect(),
            now: Instant::now(),
            wall: now_ms(),
            out: vec![None; counters.len()],
        };
        let all: Vec<usize> = (0..counters.len()).collect();
        let shared = refresh.read_shared(&all).await?;
        let stale = refresh.serve_fresh(all.into_iter().zip(shared));
        if !stale.is_empty() {
            let (ours, mut to_read) = refresh.take_locks(stale).await?;
            to_read.extend(refresh.look_again(ours).await?);
            refresh.read_shards(to_read).await?;
        }
        let now = refresh.now;
        Ok((refresh.out.into_iter())
            .map(|r| {
                r.unwrap_or(Refreshed {
                    value: 0,
                    fresh_until: now,
                })
            })
            .collect())
    }
}

/// One [`CachedReader::refresh`] of a batch of counters, step by step: read the shared entries,
/// serve the fresh ones, take the refresh locks of the stale ones (or serve their last value
/// while another process refreshes them), look again under the lock, and read the shards of
/// what is left, storing the totals for every process.
struct Refresh<'a> {
    cache: &'a CachedReader,
    counters: &'a [&'a str],
    /// Each counter's cache TTL, ms.
    ttls: Vec<u64>,
    now: Instant,
    /// Wall-clock ms, as stored in the shared entries.
    wall: u64,
    /// Each counter's result, once known.
    out: Vec<Option<Refreshed>>,
}

impl Refresh<'_> {
    /// The shared entries of counters `indexes`.
    async fn read_shared(&self, indexes: &[usize]) -> Result<Vec<Option<String>>, ReadError> {
        let ks = self.cache.reader.keyspace();
        let gets = (indexes.iter())
            .map(|i| {
                let mut cmd = Cmd::new();
                cmd.arg("GET").arg(ks.cache_key(self.counters[*i]));
                cmd
            })
            .collect();
        Ok(query_each(self.cache.reader.conn(), gets).await?)
    }

    /// A shared entry younger than its TTL: its value and until when it is fresh.
    fn fresh(&self, i: usize, entry: Option<&str>) -> Option<Refreshed> {
        let ttl = self.ttls[i];
        let (value, at) = entry.and_then(parse_shared)?;
        let age = self.wall.saturating_sub(at);
        (age < ttl).then(|| Refreshed {
            value,
            fresh_until: self.now + Duration::from_millis(ttl - age),
        })
    }

    /// Serves the fresh entries; returns the stale ones, with their last value if any.
    fn serve_fresh(
        &mut self,
        entries: impl Iterator<Item = (usize, Option<String>)>,
    ) -> Vec<(usize, Option<i64>)> {
        let mut stale = Vec::new();
        for (i, entry) in entries {
            match self.fresh(i, entry.as_deref()) {
                Some(r) => {
                    self.out[i] = Some(r);
                    CacheStats::add(&self.cache.stats.shared_hits, 1);
                }
                None => stale.push((i, entry.as_deref().and_then(parse_shared).map(|(v, _)| v))),
            }
        }
        stale
    }

    /// Takes the refresh locks of the stale entries. Where another process holds one, serves
    /// the last value and looks again soon. Returns the counters whose lock this process took,
    /// and those with nothing cached anywhere yet (to read from the shards, unlocked).
    async fn take_locks(
        &mut self,
        stale: Vec<(usize, Option<i64>)>,
    ) -> Result<(Vec<usize>, Vec<(usize, bool)>), ReadError> {
        let ks = self.cache.reader.keyspace();
        // Nothing cached anywhere: read unlocked, so that a counter never written costs no
        // write (a lock would be one); a hot new counter costs one shard read per process.
        let mut unlocked = Vec::new();
        let mut cached = Vec::new();
        for (i, last) in stale {
            match last {
                Some(value) => cached.push((i, value)),
                None => unlocked.push((i, false)),
            }
        }
        let locks = (cached.iter())
            .map(|(i, _)| {
                let mut cmd = Cmd::new();
                cmd.arg("SET")
                    .arg(ks.refresh_lock_key(self.counters[*i]))
                    .arg(1)
                    .arg("NX")
                    .arg("PX")
                    .arg(REFRESH_LOCK_MS);
                cmd
            })
            .collect();
        let taken: Vec<Option<String>> = query_each(self.cache.reader.conn(), locks).await?;
        let mut ours = Vec::new();
        for ((i, value), lock) in cached.into_iter().zip(taken) {
            if lock.is_some() {
                ours.push(i);
                continue;
            }
            // Another process refreshes it: serve the last value meanwhile.
            let again = (self.ttls[i] / 10).clamp(10, 250);
            self.out[i] = Some(Refreshed {
                value,
                fresh_until: self.now + Duration::from_millis(again),
            });
            CacheStats::add(&self.cache.stats.stale_served, 1);
        }
        Ok((ours, unlocked))
    }

    /// Another process may have refreshed and released the lock between the first look and
    /// this process taking it: looks again, serving (and unlocking) what is fresh now. Returns
    /// the counters still to read, locked.
    async fn look_again(&mut self, ours: Vec<usize>) -> Result<Vec<(usize, bool)>, ReadError> {
        if ours.is_empty() {
            return Ok(Vec::new());
        }
        let ks = self.cache.reader.keyspace();
        let again = self.read_shared(&ours).await?;
        let (mut release, mut to_read) = (Vec::new(), Vec::new());
        for (i, entry) in ours.into_iter().zip(again) {
            match self.fresh(i, entry.as_deref()) {
                Some(r) => {
                    self.out[i] = Some(r);
                    CacheStats::add(&self.cache.stats.shared_hits, 1);
                    let mut del = Cmd::new();
                    del.arg("DEL").arg(ks.refresh_lock_key(self.counters[i]));
                    release.push(del);
                }
                None => to_read.push((i, true)),
            }
        }
        query_each::<redis::Value>(self.cache.reader.conn(), release).await?;
        Ok(to_read)
    }

    /// Reads the shards of `to_read` (`(index, whether this process holds its lock)`), stores
    /// the totals as shared entries and releases the locks held.
    async fn read_shards(&mut self, to_read: Vec<(usize, bool)>) -> Result<(), ReadError> {
        if to_read.is_empty() {
            return Ok(());
        }
        let ks = self.cache.reader.keyspace();
        let names: Vec<&str> = to_read.iter().map(|(i, _)| self.counters[*i]).collect();
        let totals = self.cache.reader.get_many(&names).await?;
        CacheStats::add(&self.cache.stats.shard_reads, names.len());
        let wall = now_ms();
        let mut writes = Vec::new();
        for ((i, locked), total) in to_read.iter().zip(&totals) {
            // A zero with nothing cached before is most likely a counter never written: no
            // entry is created for it (a locked one had an entry, which is brought up to date).
            if *total != 0 || *locked {
                writes.push(store_shared(
                    ks,
                    self.counters[*i],
                    *total,
                    wall,
                    self.ttls[*i],
                ));
            }
            if *locked {
                let mut del = Cmd::new();
                del.arg("DEL").arg(ks.refresh_lock_key(self.counters[*i]));
                writes.push(del);
            }
            self.out[*i] = Some(Refreshed {
                value: *total,
                fresh_until: self.now + Duration::from_millis(self.ttls[*i]),
            });
        }
        query_each::<redis::Value>(self.cache.reader.conn(), writes).await?;
        Ok(())
    }
}

/// Refreshes the shared cache entries of `counters` from their shards now (the aggregator's
/// cache warmer: after a flush it warms the trending counters it just wrote, so their readers
/// keep finding a fresh entry instead of reading shards).
pub async fn warm(
    reader: &Reader,
    namespaces: &Namespaces,
    counters: &[&str],
) -> Result<(), ReadError> {
    if counters.is_empty() {
        return Ok(());
    }
    let totals = reader.get_many(counters).await?;
    let wall = now_ms();
    let ks = reader.keyspace();
    let writes = counters
        .iter()
        .zip(totals)
        .map(|(counter, total)| {
            store_shared(
                ks,
                counter,
                total,
                wall,
                namespaces.policy(counter).cache_ttl_ms,
            )
        })
        .collect();
    query_each::<redis::Value>(reader.conn(), writes).await?;
    Ok(())
}

/// Why no window of `windows` can sum `span_ms`.
fn no_plan(windows: &Windows, span_ms: i64) -> String {
    let span = format_duration(span_ms);
    if windows.is_empty() {
        return format!("its namespace keeps no windows, so it has no count over the last {span}");
    }
    let kept: Vec<String> = (windows.list().iter())
        .map(|w| format!("{} kept {}", w.label(), format_duration(w.retention_ms)))
        .collect();
    format!(
        "no window of its namespace sums the last {span}: a span must be a multiple of a window's width that the window keeps ({})",
        kept.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_map_is_bounded_and_keeps_refreshes_in_flight() {
        let now = Instant::now();
        let entry = |fresh: bool, refreshing: Option<watch::Receiver<Option<i64>>>| Entry {
            value: Some(1),
            fresh_until: if fresh {
                now + Duration::from_secs(60)
            } else {
                now
            },
            refreshing,
            shown: 0,
        };
        let mut local = HashMap::new();
        let (_refresh, rx) = watch::channel(None);
        local.insert("in-flight".to_owned(), entry(false, Some(rx)));
        for i in 0..MAX_LOCAL_ENTRIES {
            local.insert(format!("fresh{i}"), entry(true, None));
        }
        assert!(local.len() > MAX_LOCAL_ENTRIES);
        shrink(&mut local, now);
        assert!(local.len() <= MAX_LOCAL_ENTRIES / 2, "{}", local.len());
        assert!(local.contains_key("in-flight"));
        // Expired ones go first.
        let mut local: HashMap<String, Entry> = (0..MAX_LOCAL_ENTRIES + 1)
            .map(|i| (format!("c{i}"), entry(i % 4 != 0, None)))
            .collect();
        shrink(&mut local, now);
        assert!(local.values().all(|e| e.fresh_until > now));
        assert!(local.len() <= MAX_LOCAL_ENTRIES / 2);
    }

    #[test]
    fn shared_entries_hold_a_total_and_a_time() {
        assert_eq!(
            parse_shared("-12:1700000000000"),
            Some((-12, 1_700_000_000_000))
        );
        assert_eq!(parse_shared("12"), None);
        assert_eq!(parse_shared("x:1"), None);
    }
}

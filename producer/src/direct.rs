//! Direct writes: the articles' first tier. For a namespace whose write path is `direct`, the
//! service writes straight to Redis, so a count is visible at once and no Kafka is needed; the
//! keyspace and the readers are the same as for streamed counters.
//!
//! - An increment goes to one **shard** of the counter chosen at random (no coordination
//!   between writers). Shard `s` of a counter is its share in group `(base + s) mod N`, where
//!   `base` is a stable hash of the counter id ([`Keyspace::shard_group`]), so readers, which
//!   sum every group, need not know how many shards a counter has.
//! - A counter starts with **one shard**. Each writer counts its writes per counter and reports
//!   them every second (`ZINCRBY <prefix>:rates:<unix second>`); the shard monitor (in the
//!   aggregator) raises a counter's shard count (`ZADD <prefix>:shards GT`) when its per-shard
//!   rate passes a threshold. Writers re-read a counter's shard count at most once a second, so
//!   they pick a raised count up by themselves. Counts only grow here; compaction shrinks them.
//! - In a namespace that deduplicates, a like is `SADD` of the actor to the counter's member set
//!   in the actor's group and an `INCRBY 1` there only if the actor was not in it, in one script
//!   (an unlike: `SREM`, and `INCRBY -1` only if it was). These shard by actor, not at random.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::Rng;
use tally_common::event::{validate_counter, validate_delta};
use tally_common::keyspace::{Fan, GroupingRule};
use tally_common::{EventError, Keyspace, Namespaces, RedisConn};
use tokio::task::JoinHandle;

/// How often writers report their write rates, and re-read shard counts.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// How long a per-second rate bucket is kept.
const RATE_BUCKET_TTL_S: u64 = 60;

/// Why a direct write failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DirectError {
    /// The counter id, actor or delta broke a rule; nothing was written.
    #[error("invalid write: {0}")]
    Invalid(#[from] EventError),
    /// `add` on a namespace that counts one per actor: use `like`/`unlike`.
    #[error("{counter} is in a namespace that counts one per actor: use like/unlike")]
    NeedsActor {
        /// The counter.
        counter: String,
    },
    /// Redis failed or timed out; the write may or may not have landed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// This writer's grouping of a deduplicating namespace is not the deployment's; nothing
    /// was written (`tally_common::layout`).
    #[error("{0}")]
    Layout(#[from] tally_common::layout::LayoutError),
    /// This writer counted likes in the shares, the group's were moved to count sets
    /// (`tally likes-to-sets`), and the layout read again still counts them in the shares;
    /// nothing was written.
    #[error("{0}")]
    Moved(String),
    /// The PostgreSQL store failed.
    #[cfg(feature = "postgres")]
    #[error("postgres: {0}")]
    Postgres(#[from] tally_common::pg::PgError),
}

/// A cached shard count.
#[derive(Debug, Clone, Copy)]
struct Shards {
    count: u32,
    read_at: Instant,
}

#[derive(Debug)]
struct Inner {
    conn: RedisConn,
    keyspace: Keyspace,
    namespaces: Arc<Namespaces>,
    /// Shard counts as last read, per counter.
    shards: Mutex<HashMap<String, Shards>>,
    /// Writes per counter since the last report.
    writes: Mutex<HashMap<String, u64>>,
    like: redis::Script,
    unlike: redis::Script,
    /// Set once the deployment's record of where likes are kept agrees with the namespaces
    /// (checked before the first like or unlike): the namespaces whose likes are counted by
    /// their count sets.
    layout_checked: tokio::sync::OnceCell<tally_common::keyspace::LikesBySet>,
    /// The layout read again once a like found its group's likes moved to count sets
    /// (`tally likes-to-sets`): it replaces `layout_checked` from then on.
    relaid: tokio::sync::OnceCell<tally_common::keyspace::LikesBySet>,
    /// The task reporting write rates every second.
    reporter: Mutex<Option<JoinHandle<()>>>,
    /// The store of record the increments go to instead of Redis's keys, if any.
    #[cfg(feature = "postgres")]
    store: std::sync::OnceLock<tally_common::pg::PgStore>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self
            .reporter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

/// Writes counts straight to Redis. Cheap to clone; clones share their caches and reporter.
#[derive(Debug, Clone)]
pub struct DirectWriter {
    inner: Arc<Inner>,
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl DirectWriter {
    /// A writer over `conn` into `keyspace`. Must be created inside a Tokio runtime: it starts a
    /// task that reports write rates to the shard monitor every second.
    pub fn new(conn: RedisConn, keyspace: Keyspace, namespaces: Arc<Namespaces>) -> Self {
        let inner = Arc::new(Inner {
            conn,
            keyspace,
            namespaces,
            shards: Mutex::new(HashMap::new()),
            writes: Mutex::new(HashMap::new()),
            like: redis::Script::new(include_str!("scripts/like.lua")),
            unlike: redis::Script::new(include_str!("scripts/unlike.lua")),
            layout_checked: tokio::sync::OnceCell::new(),
            relaid: tokio::sync::OnceCell::new(),
            reporter: Mutex::new(None),
            #[cfg(feature = "postgres")]
            store: std::sync::OnceLock::new(),
        });
        let weak = Arc::downgrade(&inner);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(REPORT_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                inner.report().await;
            }
        });
        *inner
            .reporter
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(task);
        Self { inner }
    }

    /// Adds `delta` to `counter` on one of its shards, chosen at random.
    /// The same writer, writing increments and likes to the PostgreSQL store's rows (`shard`
    /// is then the row's shard) instead of Redis's keys; the shard counts and the write rates
    /// stay in Redis. A writer's store is set once: a second call changes nothing.
    #[cfg(feature = "postgres")]
    pub fn with_store(self, store: tally_common::pg::PgStore) -> Self {
        let _ = self.inner.store.set(store);
        self
    }

    pub async fn add(&self, counter: &str, delta: i64) -> Result<(), DirectError> {
        validate_counter(counter)?;
        validate_delta(delta)?;
        let inner = &self.inner;
        if inner.namespaces.policy(counter).dedup {
            return Err(DirectError::NeedsActor {
                counter: counter.to_owned(),
            });
        }
        let shards = inner.shard_count(counter).await;
        let shard = rand::rng().random_range(0..shards);
        #[cfg(feature = "postgres")]
        if let Some(store) = inner.store.get() {
            let group = inner.keyspace.shard_group(counter, shard);
            store.add(counter, group, delta).await?;
            inner.wrote(counter);
            return Ok(());
        }
        let key = inner
            .keyspace
            .counter_key(inner.keyspace.shard_group(counter, shard), counter);
        let mut conn = inner.conn.clone();
        redis::cmd("INCRBY")
            .arg(key)
            .arg(delta)
            .exec_async(&mut conn)
            .await?;
        inner.wrote(counter);
        Ok(())
    }

    /// `actor` likes `counter`: counted once in a namespace that deduplicates (returns whether
    /// this like counted), a plain +1 elsewhere (returns true).
    pub async fn like(&self, counter: &str, actor: &str) -> Result<bool, DirectError> {
        self.member(counter, actor, true).await
    }

    /// `actor` takes back a like of `counter`: in a namespace that deduplicates only a counted
    /// like is taken back (returns whether one was), elsewhere a plain -1 (returns true).
    pub async fn unlike(&self, counter: &str, actor: &str) -> Result<bool, DirectError> {
        self.member(counter, actor, false).await
    }

    async fn member(&self, counter: &str, actor: &str, like: bool) -> Result<bool, DirectError> {
        validate_counter(counter)?;
        tally_common::event::validate_actor(actor)?;
        let inner = &self.inner;
        if !inner.namespaces.policy(counter).dedup {
            self.add(counter, if like { 1 } else { -1 }).await?;
            return Ok(true);
        }
        let ks = &inner.keyspace;
        let rule = inner.namespaces.policy(counter).grouping;
        let group = ks.group_for_event(rule, 0, Some(actor), counter, Fan::of(1));
        #[cfg(feature = "postgres")]
        if let Some(store) = inner.store.get() {
            let changed = store.member(counter, actor, group, like).await?;
            inner.wrote(counter);
            return Ok(changed);
        }
        let layout = || async {
            let ns = &inner.namespaces;
            let count = tally_common::layout::record_dedup_groupings(&inner.conn, ks, ns);
            Ok::<_, tally_common::layout::LayoutError>(tally_common::layout::likes_by_set(
                ns,
                count.await?,
            ))
        };
        let by_set = match inner.relaid.get() {
            Some(relaid) => relaid.counts(counter),
            None => (inner.layout_checked.get_or_try_init(layout).await?).counts(counter),
        };
        let at = (group, rule);
        if let Some(changed) = self.write_member(counter, actor, like, at, by_set).await? {
            return Ok(changed);
        }
        // The likes were moved to count sets since this writer read the layout: read it again
        // (refused while the move runs), and write by the sets from now on.
        let relaid = inner.relaid.get_or_try_init(layout).await?;
        let by_set = relaid.counts(counter);
        let moved = || DirectError::Moved(tally_common::layout::moved_message(group));
        (self.write_member(counter, actor, like, at, by_set).await?).ok_or_else(moved)
    }

    /// Writes `actor`'s like (`like`) or unlike of `counter` by the direct like scripts, in
    /// `group` (its namespace grouped by `rule`): into its count set if `by_set`, else into its
    /// member set and share. Whether it changed the count, or `None` if the group's likes were
    /// moved to count sets meanwhile (nothing written).
    async fn write_member(
        &self,
        counter: &str,
        actor: &str,
        like: bool,
        (group, rule): (u32, GroupingRule),
        by_set: bool,
    ) -> Result<Option<bool>, DirectError> {
        let inner = &self.inner;
        let ks = &inner.keyspace;
        let script = if like { &inner.like } else { &inner.unlike };
        // Counted by its set, a like adds to no share (`tally_common::layout`).
        let mut set = String::new();
        ks.write_set_key(&mut set, group, counter, by_set);
        let mut invocation = script.key(set);
        if !by_set {
            invocation.key(ks.counter_key(group, counter));
            // Grouped by counter, its likes may have been moved to count sets since.
            if rule == GroupingRule::ByCounter {
                invocation.key(ks.fence_key(group));
            }
        }
        let changed: redis::Value = invocation
            .arg(actor)
            .invoke_async(&mut inner.conn.clone())
            .await?;
        match changed {
            redis::Value::Int(changed) => {
                inner.wrote(counter);
                Ok(Some(changed == 1))
            }
            redis::Value::BulkString(reply) if reply == b"moved" => Ok(None),
            other => Err(DirectError::Redis(redis::RedisError::from((
                redis::ErrorKind::Client,
                "unexpected reply to a direct like",
                format!("{other:?}"),
            )))),
        }
    }

    /// The shard count this writer uses for `counter` now.
    pub async fn shard_count(&self, counter: &str) -> u32 {
        self.inner.shard_count(counter).await
    }

    /// Reports the writes counted so far at once (they are otherwise reported every second).
    pub async fn report(&self) {
        self.inner.report().await;
    }
}

impl Inner {
    fn wrote(&self, counter: &str) {
        let mut writes = self.writes.lock().unwrap_or_else(PoisonError::into_inner);
        match writes.get_mut(counter) {
            Some(n) => *n += 1,
            None => {
                writes.insert(counter.to_owned(), 1);
            }
        }
    }

    /// The counter's shard count, re-read from Redis when the cached one is a second old. A
    /// failed read keeps the last count (1 if none): a write never waits for the monitor.
    async fn shard_count(&self, counter: &str) -> u32 {
        let cached = self
            .shards
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(counter)
            .copied();
        if let Some(s) = cached
            && s.read_at.elapsed() < REPORT_INTERVAL
        {
            return s.count;
        }
        let mut conn = self.conn.clone();
        let read: Result<Option<f64>, _> = redis::cmd("ZSCORE")
            .arg(self.keyspace.shards_key())
            .arg(counter)
            .query_async(&mut conn)
            .await;
        let count = match read {
            Ok(score) => (score.unwrap_or(1.0) as u32).clamp(1, self.keyspace.groups()),
            Err(_) => cached.map_or(1, |s| s.count),
        };
        self.shards
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                counter.to_owned(),
                Shards {
                    count,
                    read_at: Instant::now(),
                },
            );
        count
    }

    /// Adds the writes counted since the last report to this second's rate bucket.
    async fn report(&self) {
        let writes =
            std::mem::take(&mut *self.writes.lock().unwrap_or_else(PoisonError::into_inner));
        if writes.is_empty() {
            return;
        }
        let key = self.keyspace.rates_key(unix_seconds());
        let mut pipe = redis::pipe();
        for (counter, n) in &writes {
            pipe.zincr(&key, counter, *n).ignore();
        }
        pipe.expire(&key, RATE_BUCKET_TTL_S as i64).ignore();
        let mut conn = self.conn.clone();
        if let Err(error) = pipe.query_async::<()>(&mut conn).await {
            // Rates are advisory: a lost report only delays a shard raise.
            tracing::debug!(%error, "reporting direct write rates failed");
        }
    }
}

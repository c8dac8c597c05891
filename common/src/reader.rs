//! Reading counts: a counter's value is the sum of its keys over every shard group.
//!
//! [`Reader::get_many`] reads a batch of counters with one `MGET` per shard group, each holding
//! that group's keys of every counter in the batch, so each `MGET` stays inside one Redis Cluster
//! slot; the `MGET`s go out as one pipeline (one round trip on a standalone server, one per node
//! on a cluster, where redis-rs refuses pipelines that span slots, so the `MGET`s go out as
//! concurrent requests instead) and each counter's shares are summed. [`Reader::get`] is the same for one
//! counter. These are exact reads of what has been flushed so far; nothing is cached here.
//! Amounts that compaction is moving between groups are counted from their journals (see
//! `aggregator/src/compact.rs`), so a compactor killed mid-move hides nothing. Where likes are
//! counted by their sets (`crate::layout`), each counter's count set's `SCARD` is read with the
//! `MGET`s and added to its total.

use crate::connection::{RedisConn, query_each};
use crate::event::validate_counter;
use crate::keyspace::{Keyspace, Watermark, partition_field};
use crate::regroup::{FOLD_READ_BOUND, GroupPlan, PlanLease};

mod error;
mod packed;
mod sets;
mod windows;
pub use error::ReadError;
use packed::PackedReads;

/// Trending counters are reported into buckets of this many seconds...
pub const TOP_BUCKET_S: u64 = 10;
/// ... and `top` reads this many of the latest buckets (the current one included).
pub const TOP_BUCKETS: u64 = 6;

/// What a store of record answers with.
pub type StoreFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, ReadError>> + Send + 'a>>;

/// A store of record other than Redis's keys (the PostgreSQL store's rows): where a [`Reader`]
/// reads totals and shares, Redis keeping only the cache of totals in front of it.
pub trait StoreOfRecord: Send + Sync + std::fmt::Debug {
    /// The exact totals of `counters`, in order (0 for a counter never written).
    fn totals<'a>(&'a self, counters: &'a [&'a str]) -> StoreFuture<'a, Vec<i64>>;

    /// Whether `actor`'s like of `counter` counts.
    fn has_liked<'a>(&'a self, counter: &'a str, actor: &'a str) -> StoreFuture<'a, bool>;

    /// `counter`'s share in each of `groups` shard groups (`None` where it has none).
    fn shares<'a>(&'a self, counter: &'a str, groups: u32) -> StoreFuture<'a, Vec<Option<i64>>>;
}

/// Reads counter totals from Redis, or from a store of record behind it.
#[derive(Debug, Clone)]
pub struct Reader {
    /// Where to read from.
    conn: RedisConn,
    /// Which keys make up a counter.
    keyspace: Keyspace,
    /// Where totals and shares are read instead of Redis's keys, if the counts live elsewhere.
    store: Option<std::sync::Arc<dyn StoreOfRecord>>,
    /// How many groups to sum (`crate::regroup`), asked for once a lease.
    plan: PlanLease,
    /// Whether exact reads on a standalone Redis are snapshots (`MULTI`/`EXEC`): unknown until
    /// the first, which asks the server ([`SNAPSHOTS_UNKNOWN`] and the two answers).
    snapshots: std::sync::Arc<std::sync::atomic::AtomicU8>,
    /// The deployment's cells stripes (`crate::layout`), once a read finds them recorded: a
    /// record never changes, and until there is one, every windowed read asks again.
    cells_stripes: std::sync::Arc<std::sync::OnceLock<u64>>,
    /// Whether reads add count sets' sizes: unknown until the first, which asks the server
    /// whether this reader may run `SCARD` (`sets::SETS_UNKNOWN` and the two answers).
    count_sets: std::sync::Arc<std::sync::atomic::AtomicU8>,
}

impl Reader {
    /// A reader over `conn` for the given keyspace.
    pub fn new(conn: RedisConn, keyspace: Keyspace) -> Self {
        Self {
            conn,
            keyspace,
            store: None,
            plan: PlanLease::default(),
            snapshots: std::sync::Arc::new(std::sync::atomic::AtomicU8::new(SNAPSHOTS_UNKNOWN)),
            cells_stripes: std::sync::Arc::default(),
            count_sets: std::sync::Arc::new(std::sync::atomic::AtomicU8::new(sets::SETS_UNKNOWN)),
        }
    }

    /// How many shard groups a read sums now: every group that may hold shares
    /// (`crate::regroup`).
    pub async fn groups(&self) -> Result<u32, ReadError> {
        if self.store.is_some() {
            return Ok(self.keyspace.groups());
        }
        Ok(self.plan.current(&self.conn, &self.keyspace).await?.read)
    }

    /// How many shard groups a windowed read sums now: [`Reader::groups`], and after a shrink
    /// the retired groups whose window buckets have not expired yet (`crate::regroup`).
    pub async fn cell_groups(&self) -> Result<u32, ReadError> {
        if self.store.is_some() {
            return Ok(self.keyspace.groups());
        }
        Ok(self.plan.current(&self.conn, &self.keyspace).await?.cells)
    }

    /// The same reader, reading totals and shares from `store` (Redis then keeps only the
    /// caches: [`crate::CachedReader`]'s shared entries, trending, likes).
    pub fn with_store(mut self, store: std::sync::Arc<dyn StoreOfRecord>) -> Self {
        self.store = Some(store);
        self
    }

    /// The connection this reader reads through.
    pub fn conn(&self) -> &RedisConn {
        &self.conn
    }

    /// The keyspace this reader reads.
    pub fn keyspace(&self) -> &Keyspace {
        &self.keyspace
    }

    /// Whether `actor`'s like of `counter` is counted, in a namespace that deduplicates: a
    /// `SISMEMBER` of the count set in the counter's group (where likes are counted by their
    /// sets), and at the same time of the member set there and of the one in the actor's group
    /// (where namespaces grouped by actor keep it; `crate::layout`), whatever the topic's
    /// partition count. A namespace keeps each like in one of the three.
    pub async fn has_liked(&self, counter: &str, actor: &str) -> Result<bool, ReadError> {
        validate_counter(counter)?;
        if let Some(store) = &self.store {
            return store.has_liked(counter, actor).await;
        }
        let ks = &self.keyspace;
        let is_member = |key: String| {
            let mut conn = self.conn.clone();
            async move {
                redis::cmd("SISMEMBER")
                    .arg(key)
                    .arg(actor)
                    .query_async::<bool>(&mut conn)
                    .await
            }
        };
        let (by_counter, by_actor) = (ks.group_for_counter(counter), ks.group_for_actor(actor));
        if by_counter == by_actor {
            let (counted, grouped) = tokio::try_join!(
                is_member(ks.count_set_key(by_counter, counter)),
                is_member(ks.member_key(by_counter, counter)),
            )?;
            return Ok(counted || grouped);
        }
        let (counted, grouped, of_actor) = tokio::try_join!(
            is_member(ks.count_set_key(by_counter, counter)),
            is_member(ks.member_key(by_counter, counter)),
            is_member(ks.member_key(by_actor, counter)),
        )?;
        Ok(counted || grouped || of_actor)
    }

    /// The `k` fastest-moving counters of `namespace` over the last minute, with their activity
    /// (sum of |delta| seen by the aggregators), busiest first. Approximate: each aggregator
    /// reports the heavy hitters of its own partitions every few seconds.
    pub async fn top(&self, namespace: &str, k: usize) -> Result<Vec<(String, f64)>, ReadError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            / TOP_BUCKET_S;
        let reads = (0..TOP_BUCKETS)
            .map(|back| {
                let mut cmd = redis::cmd("ZRANGE");
                cmd.arg(self.keyspace.top_key(namespace, now.saturating_sub(back)))
                    .arg(0)
                    .arg(4 * k.max(1) as i64 - 1)
                    .arg("REV")
                    .arg("WITHSCORES");
                cmd
            })
            .collect();
        let buckets: Vec<Vec<(String, f64)>> = query_each(&self.conn, reads).await?;
        let mut merged: std::collections::HashMap<String, f64> = std::collections::HashMap::new();
        for (counter, score) in buckets.into_iter().flatten() {
            *merged.entry(counter).or_default() += score;
        }
        let mut top: Vec<(String, f64)> = merged.into_iter().collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        top.truncate(k);
        Ok(top)
    }

    /// `counter`'s share in each shard group, by group (`None` where it has no key), as
    /// flushed so far; amounts in a compaction journal are not included.
    pub async fn shares(&self, counter: &str) -> Result<Vec<Option<i64>>, ReadError> {
        validate_counter(counter)?;
        let ks = &self.keyspace;
        if let Some(store) = &self.store {
            return store.shares(counter, ks.groups()).await;
        }
        let plan = self.plan.current(&self.conn, ks).await?;
        let mut gets: Vec<redis::Cmd> = (0..plan.read)
            .map(|group| {
                let mut get = redis::cmd("GET");
                get.arg(ks.counter_key(group, counter));
                get
            })
            .collect();
        // And, where shares are packed, its field in each group's hash of its bucket.
        if plan.buckets > 0 {
            let bucket = Keyspace::bucket_of(counter, plan.buckets);
            gets.extend((0..plan.read).map(|group| {
                let mut hget = redis::cmd("HGET");
                hget.arg(ks.packed_key(group, bucket)).arg(counter);
                hget
            }));
        }
        let values: Vec<Option<String>> = query_each(&self.conn, gets).await?;
        let (keys, fields) = values.split_at(values.len().min(plan.read as usize));
        let mut shares: Vec<Option<i64>> = (keys.iter())
            .map(|v| v.as_deref().map(|v| parse_integer(counter, v)).transpose())
            .collect::<Result<_, _>>()?;
        for (share, field) in shares.iter_mut().zip(fields) {
            if let Some(value) = field {
                let packed = parse_integer(counter, value)?;
                let overflow = || ReadError::Overflow {
                    counter: counter.to_owned(),
                };
                *share = Some(
                    share
                        .unwrap_or(0)
                        .checked_add(packed)
                        .ok_or_else(overflow)?,
                );
            }
        }
        // Likes counted by their set: its size is part of the counter's group's share.
        let group = ks.group_for_counter(counter);
        if !self.count_sets().await? {
            return Ok(shares);
        }
        let size: i64 = redis::cmd("SCARD")
            .arg(ks.count_set_key(group, counter))
            .query_async(&mut self.conn.clone())
            .await?;
        if size > 0
            && let Some(share) = shares.get_mut(group as usize)
        {
            let overflow = || ReadError::Overflow {
                counter: counter.to_owned(),
            };
            *share = Some(share.unwrap_or(0).checked_add(size).ok_or_else(overflow)?);
        }
        Ok(shares)
    }

    /// How many shards a directly written counter is spread over (1 unless the shard monitor
    /// raised it).
    pub async fn direct_shards(&self, counter: &str) -> Result<u32, ReadError> {
        validate_counter(counter)?;
        let score: Option<f64> = redis::cmd("ZSCORE")
            .arg(self.keyspace.shards_key())
            .arg(counter)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok((score.unwrap_or(1.0) as u32).clamp(1, self.keyspace.groups()))
    }

    /// Where each of `partitions` partitions of `topic` is durable to in exactly-once mode: the
    /// offset its watermark says everything before is applied in every group (`None` where no
    /// flush has stored one yet). One `HGET` per partition, sent together.
    pub async fn durable_offsets(
        &self,
        topic: &str,
        partitions: i32,
    ) -> Result<Vec<Option<i64>>, ReadError> {
        let ks = &self.keyspace;
        let reads = (0..partitions)
            .map(|partition| {
                let mut hget = redis::cmd("HGET");
                hget.arg(ks.watermark_key(ks.group_for_partition(partition)))
                    .arg(partition_field(topic, partition));
                hget
            })
            .collect();
        let stored: Vec<Option<String>> = query_each(&self.conn, reads).await?;
        Ok(stored
            .iter()
            .map(|w| Some(Watermark::parse(w.as_deref()?)?.next_offset).filter(|o| *o >= 0))
            .collect())
    }

    /// The exact total of `counter` (0 if it was never written).
    pub async fn get(&self, counter: &str) -> Result<i64, ReadError> {
        Ok(self.get_many(&[counter]).await?[0])
    }

    /// The exact totals of `counters`, in the same order: one single-slot `MGET` per shard
    /// group (each counter's share and compaction journal there). A journal found is counted
    /// unless its move already reached the base share, which the move's marker there tells.
    ///
    /// On a standalone Redis, where compaction and the folds of a re-grouping move amounts
    /// between groups, the `MGET`s run as one `MULTI`/`EXEC`, a snapshot, with the markers of
    /// the journals it may find: a read that finds a journal whose marker it did not read reads
    /// again with it, so that no read counts a moving amount twice or not at all.
    ///
    /// On a Redis Cluster they are concurrent requests, and a counter with a journal has its base
    /// share read again with the journal's marker. Only a shrink's fold moves amounts there, its
    /// steps spaced by [`crate::regroup::FOLD_STEP_GAP`]; a read that took [`FOLD_READ_BOUND`]
    /// or longer is read again (five tries, then [`ReadError::Slow`]) unless the plan, asked
    /// again, is unchanged and says no shrink is under way: so no read overlaps two steps of a
    /// move, and each step is counted once. For an ACL user without `+multi +exec` on a
    /// standalone Redis they are one pipeline read the same way, but compaction's steps follow
    /// one another unspaced: a read that overlaps a move may be off by the moved amount for that
    /// instant.
    pub async fn get_many<S: AsRef<str>>(&self, counters: &[S]) -> Result<Vec<i64>, ReadError> {
        if counters.is_empty() {
            return Ok(Vec::new());
        }
        for counter in counters {
            validate_counter(counter.as_ref())?;
        }
        if let Some(store) = &self.store {
            let counters: Vec<&str> = counters.iter().map(AsRef::as_ref).collect();
            return store.totals(&counters).await;
        }
        let sets = self.count_sets().await?;
        let mut plan = self.plan.current(&self.conn, &self.keyspace).await?;
        let groups = plan.read;
        if self.conn.is_cluster() {
            // A shrink's fold may move amounts between groups under a read: see `read_spread`.
            for _ in 0..SLOW_READ_ATTEMPTS {
                let asked = std::time::Instant::now();
                let totals = self.read_spread(counters, &plan, sets).await?;
                if asked.elapsed() < FOLD_READ_BOUND {
                    return Ok(totals);
                }
                // A slower read stands only if no fold can have run under it: the plan is the
                // one it read by (a fold starts at least `PHASE_WAIT` after the plan says a
                // shrink is under way, and ends before the plan changes again), and says none is.
                let now = crate::regroup::read_plan(&self.conn, &self.keyspace).await?;
                if now == plan && now.write == now.read {
                    return Ok(totals);
                }
                plan = now;
            }
            return Err(ReadError::Slow {
                attempts: SLOW_READ_ATTEMPTS,
                bound: FOLD_READ_BOUND,
            });
        }
        if !self.snapshots_allowed().await? {
            return self.read_spread(counters, &plan, sets).await;
        }
        // The markers read with the shares: `(counter index, source group)`, sorted.
        let mut markers: Vec<(usize, u32)> = Vec::new();
        let mut attempt = 0;
        loop {
            let Snapshot { totals, journals } =
                self.read_snapshot(counters, &plan, &markers, sets).await?;
            let missing: Vec<(usize, u32)> = (journals.iter())
                .map(|j| (j.counter, j.from))
                .filter(|k| markers.binary_search(k).is_err())
                .collect();
            if missing.is_empty() {
                return Ok(totals);
            }
            // Moves seen for the first time: read their markers too. After a few rounds, every
            // group's marker of each counter with a move, so that the next snapshot settles.
            markers.extend(missing.iter().copied());
            if attempt >= 2 {
                for &(counter, _) in &missing {
                    markers.extend((0..groups).map(|from| (counter, from)));
                }
            }
            markers.sort_unstable();
            markers.dedup();
            attempt += 1;
        }
    }

    /// Whether this reader may read snapshots, asked once: an empty `MULTI`/`EXEC`, sent as
    /// plain commands of one request (so that nothing else on the shared connection comes
    /// between them). A refused `MULTI` inside a transaction pipeline is not an answer to ask
    /// for: redis-rs 1.8's multiplexed connection miscounts the replies that follow it.
    async fn snapshots_allowed(&self) -> Result<bool, ReadError> {
        use std::sync::atomic::Ordering;
        match self.snapshots.load(Ordering::Relaxed) {
            SNAPSHOTS_ALLOWED => return Ok(true),
            SNAPSHOTS_REFUSED => return Ok(false),
            _ => {}
        }
        // A `DISCARD` last, in case `EXEC` was refused after `MULTI` was not (it then ends the
        // transaction; after an `EXEC` that ran, its error is of no interest).
        let mut probe = redis::pipe();
        probe
            .ignore_errors()
            .cmd("MULTI")
            .cmd("EXEC")
            .cmd("DISCARD");
        let replies: Vec<redis::Value> = probe.query_async(&mut self.conn.clone()).await?;
        let allowed = matches!(
            replies.as_slice(),
            [redis::Value::Okay, redis::Value::Array(_), ..]
        );
        let answer = if allowed {
            SNAPSHOTS_ALLOWED
        } else {
            SNAPSHOTS_REFUSED
        };
        self.snapshots.store(answer, Ordering::Relaxed);
        Ok(allowed)
    }

    /// One `MULTI`/`EXEC` of every group's `MGET`, of each counter's count set's `SCARD`, and
    /// of `markers`' applied-move markers: the totals with each journal whose marker was read
    /// counted unless applied, and every journal found.
    async fn read_snapshot<S: AsRef<str>>(
        &self,
        counters: &[S],
        plan: &GroupPlan,
        markers: &[(usize, u32)],
        sets: bool,
    ) -> Result<Snapshot, ReadError> {
        let ks = &self.keyspace;
        let groups = plan.read;
        let packed = PackedReads::new(ks, counters, groups, plan.buckets);
        let mut pipe = redis::pipe();
        pipe.atomic();
        for group in 0..groups {
            pipe.add_command(self.group_mget(counters, group));
        }
        if sets {
            for scard in self.set_sizes(counters) {
                pipe.add_command(scard);
            }
        }
        for hmget in &packed.commands {
            pipe.add_command(hmget.clone());
        }
        if !markers.is_empty() {
            let mut mget = redis::cmd("MGET");
            for &(i, from) in markers {
                let counter = counters[i].as_ref();
                mget.arg(ks.moved_key(ks.shard_group(counter, 0), counter, from));
            }
            pipe.add_command(mget);
        }
        let mut replies: Vec<redis::Value> = pipe.query_async(&mut self.conn.clone()).await?;
        let applied: Vec<Option<String>> = match markers.is_empty() {
            true => Vec::new(),
            false => value_as(replies.pop().unwrap_or(redis::Value::Nil))?,
        };
        let fields = replies.split_off(replies.len().saturating_sub(packed.len()));
        let (_, mut snapshot) = self.sum_replies(counters, groups, replies)?;
        packed.add(counters, fields, &mut snapshot)?;
        let journals = std::mem::take(&mut snapshot.journals);
        for journal in &journals {
            let Ok(at) = markers.binary_search(&(journal.counter, journal.from)) else {
                continue;
            };
            if applied.get(at).cloned().flatten().as_deref() != Some(journal.id.as_str()) {
                snapshot.add(counters, journal.counter, journal.amount)?;
            }
        }
        snapshot.journals = journals;
        Ok(snapshot)
    }

    /// The read on a cluster: every group's `MGET` at once; then, for each counter with a
    /// journal, its base share again with the journals' markers, in one `MGET` of the base slot,
    /// so that the base share and the markers agree: a journal counts unless its marker says
    /// the base share holds it.
    ///
    /// Read within [`FOLD_READ_BOUND`], this overlaps at most one step of any move of a shrink's
    /// fold (spaced by twice that), and each step is counted once: a take (the share, or the
    /// journal and no marker), a give (the journal, checked against the base share read with
    /// the marker), the journal's deletion (the base share holds it either way), the marker's.
    ///
    /// Each counter's count set's `SCARD` goes out with the `MGET`s (not a snapshot either: a
    /// flush landing between them is seen in part).
    async fn read_spread<S: AsRef<str>>(
        &self,
        counters: &[S],
        plan: &GroupPlan,
        sets: bool,
    ) -> Result<Vec<i64>, ReadError> {
        let ks = &self.keyspace;
        let groups = plan.read;
        let packed = PackedReads::new(ks, counters, groups, plan.buckets);
        let (replies, fields) = if packed.is_empty() || !self.conn.is_cluster() {
            let mut reads: Vec<redis::Cmd> =
                (0..groups).map(|g| self.group_mget(counters, g)).collect();
            if sets {
                reads.extend(self.set_sizes(counters));
            }
            reads.extend(packed.commands.iter().cloned());
            let mut replies: Vec<redis::Value> = query_each(&self.conn, reads).await?;
            let fields = replies.split_off(replies.len().saturating_sub(packed.len()));
            (replies, fields)
        } else {
            self.read_groups_whole(counters, groups, &packed, sets)
                .await?
        };
        let (rows, mut snapshot) = self.sum_replies(counters, groups, replies)?;
        packed.add(counters, fields, &mut snapshot)?;
        let mut journals = std::mem::take(&mut snapshot.journals);
        if journals.is_empty() {
            return Ok(snapshot.totals);
        }
        journals.sort_by_key(|j| j.counter);
        let moving: Vec<&[Journal]> = journals.chunk_by(|a, b| a.counter == b.counter).collect();
        let checks = (moving.iter())
            .map(|js| {
                let counter = counters[js[0].counter].as_ref();
                let base = ks.shard_group(counter, 0);
                let mut mget = redis::cmd("MGET");
                mget.arg(ks.counter_key(base, counter));
                for j in js.iter() {
                    mget.arg(ks.moved_key(base, counter, j.from));
                }
                mget
            })
            .collect();
        let checked: Vec<Vec<Option<String>>> = query_each(&self.conn, checks).await?;
        for (js, reply) in moving.iter().zip(checked) {
            let i = js[0].counter;
            let counter = counters[i].as_ref();
            let share = |row: Option<&Option<String>>| match row.and_then(Option::as_deref) {
                Some(v) => parse_integer(counter, v),
                None => Ok(0),
            };
            let base = ks.shard_group(counter, 0) as usize;
            let before = share(rows.get(base).and_then(|row| row.get(2 * i)))?;
            let now = share(reply.first())?;
            let grown = now.checked_sub(before).ok_or_else(|| ReadError::Overflow {
                counter: counter.to_owned(),
            })?;
            snapshot.add(counters, i, grown)?;
            for (journal, marker) in js.iter().zip(reply.iter().skip(1)) {
                if marker.as_deref() != Some(journal.id.as_str()) {
                    snapshot.add(counters, i, journal.amount)?;
                }
            }
        }
        Ok(snapshot.totals)
    }

    /// The `MGET` of `counters`' shares and journals in `group`.
    fn group_mget<S: AsRef<str>>(&self, counters: &[S], group: u32) -> redis::Cmd {
        let ks = &self.keyspace;
        let mut mget = redis::cmd("MGET");
        for c in counters {
            mget.arg(ks.counter_key(group, c.as_ref()))
                .arg(ks.journal_key(group, c.as_ref()));
        }
        mget
    }

    /// The replies of every group's `MGET` (`groups` of them) and then, if read, of each
    /// counter's count set's `SCARD`: the rows, and each counter's shares and set size summed.
    fn sum_replies<S: AsRef<str>>(
        &self,
        counters: &[S],
        groups: u32,
        mut replies: Vec<redis::Value>,
    ) -> Result<(Rows, Snapshot), ReadError> {
        let sizes: Vec<i64> = (replies.drain(groups as usize..))
            .map(value_as)
            .collect::<Result<_, _>>()?;
        let rows: Vec<Vec<Option<String>>> = (replies.into_iter())
            .map(value_as)
            .collect::<Result<_, _>>()?;
        let mut snapshot = self.sum_rows(counters, &rows)?;
        for (i, size) in sizes.into_iter().enumerate() {
            snapshot.add(counters, i, size)?;
        }
        Ok((rows, snapshot))
    }

    /// Each counter's shares summed from `rows` (per group: share, journal, share, journal...),
    /// and the journals found, not counted.
    fn sum_rows<S: AsRef<str>>(
        &self,
        counters: &[S],
        rows: &[Vec<Option<String>>],
    ) -> Result<Snapshot, ReadError> {
        let mut snapshot = Snapshot {
            totals: Vec::with_capacity(counters.len()),
            journals: Vec::new(),
        };
        for (i, counter) in counters.iter().enumerate() {
            let counter = counter.as_ref();
            let mut shares = Vec::with_capacity(rows.len());
            for (group, row) in rows.iter().enumerate() {
                shares.push(match row.get(2 * i).and_then(Option::as_deref) {
                    Some(v) => Some(parse_integer(counter, v)?),
                    None => None,
                });
                if let Some(journal) = row.get(2 * i + 1).and_then(Option::as_deref) {
                    let (id, amount) = parse_journal(counter, journal)?;
                    snapshot.journals.push(Journal {
                        counter: i,
                        from: group as u32,
                        id: id.to_owned(),
                        amount,
                    });
                }
            }
            snapshot.totals.push(sum(counter, &shares)?);
        }
        Ok(snapshot)
    }
}

/// A reply of a read's pipeline as the type it answers with.
fn value_as<T: redis::FromRedisValue>(value: redis::Value) -> Result<T, ReadError> {
    redis::from_redis_value(value).map_err(|e| ReadError::from(redis::RedisError::from(e)))
}

/// How many times a read on a cluster during a shrink is tried within [`FOLD_READ_BOUND`].
const SLOW_READ_ATTEMPTS: u32 = 5;

/// Not yet known whether the server lets this reader run `MULTI`/`EXEC`.
const SNAPSHOTS_UNKNOWN: u8 = 0;
/// It does: exact reads are snapshots.
const SNAPSHOTS_ALLOWED: u8 = 1;
/// It does not (an ACL user without `+multi +exec`): exact reads are pipelines.
const SNAPSHOTS_REFUSED: u8 = 2;

/// Per group read, each counter's share and journal there, in turn.
type Rows = Vec<Vec<Option<String>>>;

/// Totals read, and the compaction journals found on the way.
struct Snapshot {
    totals: Vec<i64>,
    journals: Vec<Journal>,
}

/// A compaction journal: an amount on its way from group `from` to the counter's base share.
struct Journal {
    /// The counter's index in the read.
    counter: usize,
    from: u32,
    id: String,
    amount: i64,
}

impl Snapshot {
    /// Adds a journal's `amount` to counter `i`'s total.
    fn add<S: AsRef<str>>(
        &mut self,
        counters: &[S],
        i: usize,
        amount: i64,
    ) -> Result<(), ReadError> {
        self.totals[i] = self.totals[i]
            .checked_add(amount)
            .ok_or_else(|| ReadError::Overflow {
                counter: counters[i].as_ref().to_owned(),
            })?;
        Ok(())
    }
}

fn parse_integer(counter: &str, value: &str) -> Result<i64, ReadError> {
    value.parse().map_err(|_| ReadError::Corrupt {
        counter: counter.to_owned(),
        value: value.to_owned(),
    })
}

/// A compaction journal: `"<move id>:<amount>"`.
fn parse_journal<'v>(counter: &str, value: &'v str) -> Result<(&'v str, i64), ReadError> {
    value
        .split_once(':')
        .and_then(|(id, amount)| Some((id, amount.parse().ok()?)))
        .ok_or_else(|| ReadError::Corrupt {
            counter: counter.to_owned(),
            value: value.to_owned(),
        })
}

fn sum(counter: &str, values: &[Option<i64>]) -> Result<i64, ReadError> {
    values
        .iter()
        .flatten()
        .try_fold(0i64, |acc, v| acc.checked_add(*v))
        .ok_or_else(|| ReadError::Overflow {
            counter: counter.to_owned(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_skips_missing_keys_and_reports_overflow() {
        assert_eq!(sum("c", &[None, Some(3), Some(-1), None]).ok(), Some(2));
        assert_eq!(sum("c", &[]).ok(), Some(0));
        assert!(matches!(
            sum("c", &[Some(i64::MAX), Some(1)]),
            Err(ReadError::Overflow { .. })
        ));
    }
}

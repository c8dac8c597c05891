//! The Redis keyspace: every key tally reads or writes is built here and nowhere else.
//!
//! A counter's value is spread over a fixed number of **shard groups** `N` (default 16). In group
//! `g` it lives at
//!
//! ```text
//! <prefix>:{g<g>}:c:<counter>        e.g. tally:{g7}:c:likes:post:42
//! ```
//!
//! and its value is the sum of its keys over the `N` groups (a missing key counts as 0). The part
//! in braces is a Redis Cluster *hash tag*: every key of one group hashes to the same slot, so
//! everything one flush writes for a group can later become one atomic single-slot script, while
//! the `N` groups still spread over the cluster's nodes. Counter ids never contain braces (see
//! [`crate::event::validate_counter`]), so a counter id cannot move its key to another slot.
//!
//! Which group an event's delta goes to is the [`GroupingRule`]: by default the Kafka partition
//! it came from, spread by a stable hash of the counter id over `k` groups from the partition's
//! *home group* (`partition mod N`, then every `N/k`th), so that a flush of one partition's
//! buffer is `k` scripts of a `k`th of its counters each (see [`Spread`]); or its actor (a stable hash of the
//! actor id), so that per-actor state and the increment it guards share a slot.
//!
//! Beside the counters, each group holds the exactly-once bookkeeping of every partition that
//! writes into it, as hash fields named `<topic>/<partition>` (see [`partition_field`]):
//!
//! ```text
//! <prefix>:{g<g>}:ledger     the offset after the last message of that partition applied here
//! <prefix>:{g<g>}:fence      the epoch of that partition's current owner
//! <prefix>:{g<h>}:epoch      the partition's epoch counter (h = its home group)
//! <prefix>:{g<h>}:watermark  where the partition resumes, with the ledgers it had then
//! ```
//!
//! The layout is documented in `docs/keyspace.md`.

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "tally";
/// Default number of shard groups.
pub const DEFAULT_GROUPS: u32 = 16;
/// Default spread of a partition's counters over groups (Redis; see [`Spread`]).
pub const DEFAULT_SPREAD: u32 = 4;

/// Which shard group an event's delta is written to. Spelled `partition`, `actor` or `counter`
/// everywhere:
/// the aggregator's `--grouping`, the namespace file, the `tally_build_info` label.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
pub enum GroupingRule {
    /// A group of the Kafka partition the event came from, picked by the counter among the
    /// partition's spread ([`Spread`]): one flush, at most that many groups, one slot each.
    #[default]
    #[serde(rename = "partition")]
    ByPartition,
    /// A stable hash of the event's actor (events without one fall back to their partition's
    /// group): everything about one actor lives in one slot.
    #[serde(rename = "actor")]
    ByActor,
    /// A stable hash of the counter id: everything about one counter (its share, and in a
    /// namespace that deduplicates its one member set) lives in one slot, whatever the partition
    /// or the actor. A flush then writes one run of likes per counter, not one per actor's group.
    #[serde(rename = "counter")]
    ByCounter,
}

impl GroupingRule {
    /// Every rule.
    pub const ALL: [GroupingRule; 3] = [
        GroupingRule::ByPartition,
        GroupingRule::ByActor,
        GroupingRule::ByCounter,
    ];

    /// Its spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            GroupingRule::ByPartition => "partition",
            GroupingRule::ByActor => "actor",
            GroupingRule::ByCounter => "counter",
        }
    }
}

impl std::fmt::Display for GroupingRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for GroupingRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        (Self::ALL.into_iter())
            .find(|rule| rule.as_str() == s)
            .ok_or_else(|| {
                format!("unknown grouping rule {s:?}: expected partition, actor or counter")
            })
    }
}

/// The hash field naming one partition of one topic in the ledger, fence, epoch and watermark
/// hashes: `<topic>/<partition>` (Kafka topic names cannot contain `/`).
pub fn partition_field(topic: &str, partition: i32) -> String {
    format!("{topic}/{partition}")
}

mod spread;
pub use spread::{Fan, MAX_GROUPS, Spread, Watermark};

use crate::window::cells::{DEFAULT_STRIPES, valid_stripes};

/// FNV-1a, 64 bits: a hash that never changes across processes, platforms or Rust versions,
/// because the group an actor maps to must never change.
fn stable_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A key compaction deals with (see [`Keyspace::parse_compaction_key`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompactionKey {
    /// A counter's share in a group.
    Share,
    /// An amount on its way from this group to the counter's base group.
    Journal,
    /// In the base group, the last move applied from group `from`.
    Moved {
        /// The source group.
        from: u32,
    },
}

/// Why a keyspace could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyspaceError {
    /// The prefix was empty, too long, or held braces, whitespace or control characters.
    #[error(
        "key prefix {prefix:?} is invalid: it must be 1 to 64 printable characters without braces or whitespace"
    )]
    Prefix {
        /// The rejected prefix.
        prefix: String,
    },
    /// The number of groups was 0 or above [`MAX_GROUPS`].
    #[error("shard group count {groups} is invalid: it must be 1 to {MAX_GROUPS}")]
    Groups {
        /// The rejected count.
        groups: u32,
    },
}

/// The key layout: a prefix and a number of shard groups. Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyspace {
    /// Prepended to every key, so that several deployments (or tests) can share one Redis.
    prefix: String,
    /// How many shard groups a counter is spread over. Fixed for the life of a deployment:
    /// changing it would hide the values written under the old groups.
    groups: u32,
    /// How many cells hashes each group keeps (windowed namespaces): the deployment's record
    /// (`crate::layout::record_cells_stripes`), [`DEFAULT_STRIPES`] until one is read.
    cells_stripes: u64,
    /// Which namespaces' likes are counted by their count sets ([`Keyspace::count_set_key`])
    /// rather than in their shares: from the deployment's record (`crate::layout`), none until
    /// a writer reads it.
    likes_by_set: std::sync::Arc<LikesBySet>,
}

/// The namespaces whose likes a writer counts by their count sets: those it deduplicates
/// grouped by counter, in a deployment that records likes counted by sets (`crate::layout`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LikesBySet {
    /// Listed namespaces, sorted, and whether each is counted by sets.
    pub listed: Vec<(String, bool)>,
    /// Whether the namespaces not listed are.
    pub others: bool,
    /// Whether every namespace that deduplicates counts its likes by sets (false if none
    /// deduplicates).
    pub every_dedup: bool,
    /// Whether some namespace that deduplicates grouped by counter counts its likes in the
    /// shares (a deployment that records likes counted in the shares): such a writer may not
    /// write a group whose likes were moved to count sets (`crate::layout::MOVED_FIELD`).
    pub in_shares: bool,
}

impl LikesBySet {
    /// Whether `counter`'s likes are counted by its count set.
    pub fn counts(&self, counter: &str) -> bool {
        let namespace = namespace_of(counter);
        match (self.listed).binary_search_by(|(name, _)| name.as_str().cmp(namespace)) {
            Ok(i) => self.listed[i].1,
            Err(_) => self.others,
        }
    }
}

/// The namespace of a counter id: everything before the first `:` (the whole id if none).
pub fn namespace_of(counter: &str) -> &str {
    // A byte scan: this runs once per event where namespaces are listed, and `split_once`'s
    // generic char search was 1.5% of a likes catch-up's CPU (perf). `:` is ASCII, so where it
    // is found is a char boundary.
    let end = (counter.bytes().position(|b| b == b':')).unwrap_or(counter.len());
    &counter[..end]
}

impl Default for Keyspace {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            groups: DEFAULT_GROUPS,
            cells_stripes: DEFAULT_STRIPES,
            likes_by_set: std::sync::Arc::default(),
        }
    }
}

impl Keyspace {
    /// A keyspace with the given prefix and number of shard groups.
    pub fn new(prefix: impl Into<String>, groups: u32) -> Result<Self, KeyspaceError> {
        let prefix = prefix.into();
        let prefix_ok = !prefix.is_empty()
            && prefix.len() <= 64
            && prefix
                .chars()
                .all(|c| !c.is_control() && !c.is_whitespace() && c != '{' && c != '}');
        if !prefix_ok {
            return Err(KeyspaceError::Prefix { prefix });
        }
        if groups == 0 || groups > MAX_GROUPS {
            return Err(KeyspaceError::Groups { groups });
        }
        Ok(Self {
            prefix,
            groups,
            cells_stripes: DEFAULT_STRIPES,
            likes_by_set: std::sync::Arc::default(),
        })
    }

    /// This keyspace with `stripes` cells hashes per group, as a deployment records them
    /// (`crate::layout`). Panics unless `stripes` is valid
    /// ([`crate::window::cells::valid_stripes`]): the record is checked when read.
    pub fn with_cells_stripes(mut self, stripes: u64) -> Self {
        assert!(valid_stripes(stripes), "{stripes} cells stripes");
        self.cells_stripes = stripes;
        self
    }

    /// This keyspace with the likes of `by_set`'s namespaces counted by their count sets
    /// (`crate::layout::likes_by_set`).
    pub fn with_likes_by_set(mut self, by_set: LikesBySet) -> Self {
        self.likes_by_set = std::sync::Arc::new(by_set);
        self
    }

    /// Whether this writer counts `counter`'s likes by its count set
    /// ([`Keyspace::count_set_key`]): its total is its shares plus the set's size, and a like
    /// adds to no share.
    pub fn likes_by_set(&self, counter: &str) -> bool {
        self.likes_by_set.counts(counter)
    }

    /// Whether every namespace that deduplicates counts its likes by sets.
    pub fn every_dedup_by_set(&self) -> bool {
        self.likes_by_set.every_dedup
    }

    /// Whether this writer counts some namespace's likes, grouped by counter, in the shares
    /// ([`LikesBySet::in_shares`]).
    pub fn likes_in_shares(&self) -> bool {
        self.likes_by_set.in_shares
    }

    /// How many cells hashes each group keeps (see [`Keyspace::cells_key`]).
    pub fn cells_stripes(&self) -> u64 {
        self.cells_stripes
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The number of shard groups.
    pub fn groups(&self) -> u32 {
        self.groups
    }

    /// The shard group that a Kafka partition's flushes write to.
    pub fn group_for_partition(&self, partition: i32) -> u32 {
        partition.unsigned_abs() % self.groups
    }

    /// The group of `actor` (a stable hash): where its memberships and the increments they guard
    /// live.
    pub fn group_for_actor(&self, actor: &str) -> u32 {
        (stable_hash(actor.as_bytes()) % u64::from(self.groups)) as u32
    }

    /// The group of `counter` (a stable hash): where it lives when grouped by counter.
    pub fn group_for_counter(&self, counter: &str) -> u32 {
        (stable_hash(counter.as_bytes()) % u64::from(self.groups)) as u32
    }

    /// The group `counter`'s delta is written to under `rule`, from `partition` whose fan at
    /// the event is `fan` ([`Spread::fan_at`]). Grouped by actor or by counter, a delta stays in
    /// its group of the original count whatever the fan: likes and the increments they guard
    /// share a slot, and a re-grouping moves only what partitions place.
    pub fn group_for_event(
        &self,
        rule: GroupingRule,
        partition: i32,
        actor: Option<&str>,
        counter: &str,
        fan: Fan,
    ) -> u32 {
        let groups = fan.groups_of(self.groups);
        match (rule, actor) {
            (GroupingRule::ByActor, Some(actor)) => self.group_for_actor(actor),
            (GroupingRule::ByCounter, _) => self.group_for_counter(counter),
            _ if fan.k <= 1 => partition.unsigned_abs() % groups,
            _ => {
                let home = partition.unsigned_abs() % groups;
                // `(home + part · (groups div spread)) mod groups` with one 64-bit division
                // (this runs once per event): both terms are below `groups` (a spread is at
                // most the groups), so their sum is below twice it.
                let part = (stable_hash(counter.as_bytes()) % u64::from(fan.k)) as u32;
                let group = home + part * (groups / fan.k);
                if group >= groups {
                    group - groups
                } else {
                    group
                }
            }
        }
    }

    /// The key of the deployment's group plan (`crate::regroup`): how many groups writers use
    /// and readers sum, when a re-grouping changed them.
    pub fn plan_key(&self) -> String {
        format!("{}:groups", self.prefix)
    }

    /// The hash recording where each deduplicating namespace keeps its member sets
    /// (`crate::layout`): field `dedup:<namespace>`, value its grouping.
    pub fn layout_key(&self) -> String {
        format!("{}:layout", self.prefix)
    }

    /// The hash of ledger entries in `group`: per partition, the offset after the last message
    /// whose delta for this group has been applied.
    pub fn ledger_key(&self, group: u32) -> String {
        format!("{}:{{g{group}}}:ledger", self.prefix)
    }

    /// The hash of fences in `group`: per partition, the epoch of its current owner.
    pub fn fence_key(&self, group: u32) -> String {
        format!("{}:{{g{group}}}:fence", self.prefix)
    }

    /// The hash of the resets `group` applied while a compactor moves shares
    /// (`crate::layout::MOVING_FIELD`): per counter (the field is its share key in the group),
    /// `"<partition field> <offset>"` of its last reset there.
    pub fn resets_key(&self, group: u32) -> String {
        format!("{}:{{g{group}}}:resets", self.prefix)
    }

    /// The key a flush that writes runs of likes before its script leaves if one of their sets
    /// holds another type (`SET`, then `SINTERSTORE` into it of [`Keyspace::none_key`] and the
    /// sets, which deletes it unless Redis refuses one of them); the script deletes it. Never
    /// seen outside that `MULTI`/`EXEC` but for a moment after a failure.
    pub fn set_check_key(&self, group: u32) -> String {
        format!("{}:{{g{group}}}:setcheck", self.prefix)
    }

    /// A key no tally code writes, deleted before each [`Keyspace::set_check_key`] check: the
    /// empty set that makes its `SINTERSTORE` stop after checking every set's type.
    pub fn none_key(&self, group: u32) -> String {
        format!("{}:{{g{group}}}:none", self.prefix)
    }

    /// The hash of epoch counters in `group` (a partition's counter lives in its home group).
    pub fn epoch_key(&self, group: u32) -> String {
        format!("{}:{{g{group}}}:epoch", self.prefix)
    }

    /// The hash of watermarks in `group` (a partition's watermark lives in its home group).
    pub fn watermark_key(&self, group: u32) -> String {
        format!("{}:{{g{group}}}:watermark", self.prefix)
    }

    /// The key holding `counter`'s share in `group`.
    pub fn counter_key(&self, group: u32, counter: &str) -> String {
        let mut key = String::new();
        self.write_counter_key(&mut key, group, counter);
        key
    }

    /// Writes the key holding `counter`'s share in `group` into `out` (cleared first), so that a
    /// flush can reuse one buffer for all its keys.
    pub fn write_counter_key(&self, out: &mut String, group: u32, counter: &str) {
        self.write_group_key(out, group, "c", counter);
    }

    /// The packed hash of `group` holding the shares of the counters of bucket `bucket` as
    /// fields (the counter id is the field): `<prefix>:{g<group>}:p:<bucket>`, beside the
    /// counters' keys in the same slot ([`Keyspace::bucket_of`] picks the bucket).
    pub fn packed_key(&self, group: u32, bucket: u32) -> String {
        let mut key = String::new();
        self.write_packed_key(&mut key, group, bucket);
        key
    }

    /// A pattern matching every packed hash of `group`, for `SCAN ... MATCH`.
    pub fn packed_pattern(&self, group: u32) -> String {
        format!("{}:{{g{group}}}:p:*", self.prefix)
    }

    /// Writes [`Keyspace::packed_key`] into `out` (cleared first).
    pub fn write_packed_key(&self, out: &mut String, group: u32, bucket: u32) {
        self.write_group_key(out, group, "p", itoa::Buffer::new().format(bucket));
    }

    /// The bucket of `counter` among `buckets` packed hashes per group (a power of two): the
    /// stable hash mixed again (MurmurHash3's finalizer), whose high bits do not follow the low
    /// bits that pick the counter's group. FNV-1a's own high bits do: the counters of one group
    /// filled 77 of 256 buckets.
    pub fn bucket_of(counter: &str, buckets: u32) -> u32 {
        let mut h = stable_hash(counter.as_bytes());
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^= h >> 33;
        ((h >> 32) % u64::from(buckets.max(1))) as u32
    }

    /// `<prefix>:{g<group>}:<kind>:<counter>` into `out` (cleared first), piece by piece: one
    /// is written per delta and per run of likes of a flush, and `write!` took a quarter of the
    /// time of a long-tail flush's keys in formatting machinery.
    fn write_group_key(&self, out: &mut String, group: u32, kind: &str, counter: &str) {
        out.clear();
        out.reserve(self.prefix.len() + kind.len() + counter.len() + 16);
        out.push_str(&self.prefix);
        out.push_str(":{g");
        out.push_str(itoa::Buffer::new().format(group));
        out.push_str("}:");
        out.push_str(kind);
        out.push(':');
        out.push_str(counter);
    }

    /// The key holding `counter`'s share in `group` of the bucket of width `width_ms` starting at
    /// `start_ms` (windowed namespaces, see `crate::window`): beside its total's share, in the
    /// same slot, so the flush writes both in one operation.
    pub fn window_key(&self, group: u32, counter: &str, width_ms: i64, start_ms: i64) -> String {
        format!(
            "{}:{{g{group}}}:w:{width_ms}:{start_ms}:{counter}",
            self.prefix
        )
    }

    /// The hash holding, in field `counter`, its buckets in `group` (windowed namespaces; the
    /// field's value is `crate::window::cells::Cells`): one of the group's
    /// [`Keyspace::cells_stripes`] hashes, in the group's slot, so the flush writes it with the
    /// counter's total.
    pub fn cells_key(&self, group: u32, counter: &str) -> String {
        self.cells_key_of_stripe(group, self.cells_stripe(counter))
    }

    /// The stripe of `counter`'s cells hash in every group (see [`Keyspace::cells_key`]).
    pub fn cells_stripe(&self, counter: &str) -> u64 {
        crate::window::cells::stripe(stable_hash(counter.as_bytes()), self.cells_stripes)
    }

    /// Cells hash number `stripe` of `group` (see [`Keyspace::cells_key`]).
    pub fn cells_key_of_stripe(&self, group: u32, stripe: u64) -> String {
        format!("{}:{{g{group}}}:W:{stripe}", self.prefix)
    }

    /// The group of a key [`Keyspace::cells_key_of_stripe`] names, or `None` for any other key.
    pub fn parse_cells_key(&self, key: &str) -> Option<u32> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix(":{g")?;
        let (group, rest) = rest.split_once('}')?;
        rest.strip_prefix(":W:")?.parse::<u64>().ok()?;
        group.parse().ok()
    }

    /// The set of actors whose like of `counter` is counted in `group` (deduplicating
    /// namespaces): the counter's group when grouped by counter, each actor's group when grouped
    /// by actor. It shares the group's slot with the counter's share there, so the membership
    /// change and the increment it guards are one atomic operation.
    pub fn member_key(&self, group: u32, counter: &str) -> String {
        let mut key = String::new();
        self.write_member_key(&mut key, group, counter);
        key
    }

    /// [`Keyspace::member_key`] into `out` (cleared first), reusing its allocation.
    pub fn write_member_key(&self, out: &mut String, group: u32, counter: &str) {
        self.write_group_key(out, group, "m", counter);
    }

    /// The set of actors whose like of `counter` is counted, where likes are counted by their
    /// sets (`crate::layout`): in the counter's group, beside its share there, and its size is
    /// the likes' part of the counter's total (no share holds them).
    pub fn count_set_key(&self, group: u32, counter: &str) -> String {
        let mut key = String::new();
        self.write_group_key(&mut key, group, "s", counter);
        key
    }

    /// The set this writer keeps `counter`'s likes in, in `group`, written into `out`: its
    /// count set where it counts them by sets ([`Keyspace::likes_by_set`]), else its member
    /// set.
    pub fn write_likes_key(&self, out: &mut String, group: u32, counter: &str) {
        self.write_set_key(out, group, counter, self.likes_by_set(counter));
    }

    /// `counter`'s count set (`by_set`) or member set in `group`, written into `out`: for a
    /// writer that has asked [`Keyspace::likes_by_set`] already.
    pub fn write_set_key(&self, out: &mut String, group: u32, counter: &str, by_set: bool) {
        let kind = if by_set { "s" } else { "m" };
        self.write_group_key(out, group, kind, counter);
    }

    /// [`Keyspace::write_likes_key`] as a new string.
    pub fn likes_key(&self, group: u32, counter: &str) -> String {
        let mut key = String::new();
        self.write_likes_key(&mut key, group, counter);
        key
    }

    /// The group holding shard `shard` of a directly written counter: `(base + shard) mod N`,
    /// where `base` is a stable hash of the counter id. Shard 0 is the counter's base group.
    pub fn shard_group(&self, counter: &str, shard: u32) -> u32 {
        let base = u64::from(self.group_for_counter(counter));
        ((base + u64::from(shard)) % u64::from(self.groups)) as u32
    }

    /// The sorted set of shard counts of directly written counters (member: counter id, score:
    /// shard count; a counter not in it has one shard). Raised with `ZADD GT`.
    pub fn shards_key(&self) -> String {
        format!("{}:shards", self.prefix)
    }

    /// The sorted set of direct writes per counter reported during one unix second.
    pub fn rates_key(&self, unix_second: u64) -> String {
        format!("{}:rates:{unix_second}", self.prefix)
    }

    /// The compaction journal of `counter` in `group`: `"<move id>:<amount>"` while an amount
    /// taken from the counter's share there is on its way to the base group. Readers count it.
    pub fn journal_key(&self, group: u32, counter: &str) -> String {
        format!("{}:{{g{group}}}:j:{counter}", self.prefix)
    }

    /// In the counter's base group `base`, the id of the last move from group `from` that was
    /// applied there: a journal holding that id is already counted in the base share.
    pub fn moved_key(&self, base: u32, counter: &str, from: u32) -> String {
        format!("{}:{{g{base}}}:a{from}:{counter}", self.prefix)
    }

    /// The sorted set of counters a partition has written in a namespace that expires
    /// counters (`field` is the partition's, [`partition_field`]), in its home group: member the
    /// counter id, score when it expires if nothing touches it again (its last event's Kafka
    /// timestamp plus its namespace's `expire_after`, ms since the epoch).
    pub fn idle_key(&self, home: u32, field: &str) -> String {
        format!("{}:{{g{home}}}:idle:{field}", self.prefix)
    }

    /// The hash of a partition's expiry decisions not yet behind its watermark, in its home
    /// group: field the offset of the expiry record, value `1` (expired) or `0` (kept), so that a
    /// flush replayed after a crash decides every group's part the same way.
    pub fn expired_key(&self, home: u32, field: &str) -> String {
        format!("{}:{{g{home}}}:expired:{field}", self.prefix)
    }

    /// Every key compaction looks at, for `SCAN ... MATCH`: counter shares (`c`), compaction
    /// journals (`j`) and applied-move markers (`a<from>`).
    pub fn compaction_pattern(&self) -> String {
        format!("{}:{{g*}}:[cja]*", self.prefix)
    }

    /// What a key matched by [`Keyspace::compaction_pattern`] is, or `None` for any other key.
    pub fn parse_compaction_key<'k>(&self, key: &'k str) -> Option<(u32, CompactionKey, &'k str)> {
        let (group, rest) = self.split_group_key(key)?;
        if let Some(counter) = rest.strip_prefix("c:") {
            return Some((group, CompactionKey::Share, counter));
        }
        if let Some(counter) = rest.strip_prefix("j:") {
            return Some((group, CompactionKey::Journal, counter));
        }
        let (from, counter) = rest.strip_prefix('a')?.split_once(':')?;
        Some((
            group,
            CompactionKey::Moved {
                from: from.parse().ok()?,
            },
            counter,
        ))
    }

    /// The sorted set of a namespace's trending counters during one time bucket (member:
    /// counter id, score: its activity, summed over the aggregators that saw it).
    pub fn top_key(&self, namespace: &str, bucket: u64) -> String {
        format!("{}:top:{namespace}:{bucket}", self.prefix)
    }

    /// The key caching `counter`'s total for readers: `"<total>:<refreshed at, unix ms>"`. No
    /// hash tag: cache entries spread over a cluster's slots by counter.
    pub fn cache_key(&self, counter: &str) -> String {
        format!("{}:t:{counter}", self.prefix)
    }

    /// The key a reader process holds (`SET NX PX`) while it refreshes `counter`'s cached
    /// total, so that one refresh per counter is in flight across processes.
    pub fn refresh_lock_key(&self, counter: &str) -> String {
        format!("{}:r:{counter}", self.prefix)
    }

    /// A pattern matching every counter key of this keyspace, for `SCAN ... MATCH`.
    pub fn counter_key_pattern(&self) -> String {
        format!("{}:{{g*}}:c:*", self.prefix)
    }

    /// The counter id inside a counter key of this keyspace, or `None` for any other key.
    pub fn counter_of_key<'k>(&self, key: &'k str) -> Option<&'k str> {
        Some(self.share_of_key(key)?.1)
    }

    /// The group and counter of a counter key of this keyspace ([`Keyspace::counter_key`]), or
    /// `None` for any other key.
    pub fn share_of_key<'k>(&self, key: &'k str) -> Option<(u32, &'k str)> {
        let (group, rest) = self.split_group_key(key)?;
        Some((group, rest.strip_prefix("c:")?))
    }

    /// The group and counter of a member set key of this keyspace
    /// ([`Keyspace::member_key`]), or `None` for any other key.
    pub fn member_set_of_key<'k>(&self, key: &'k str) -> Option<(u32, &'k str)> {
        let (group, rest) = self.split_group_key(key)?;
        Some((group, rest.strip_prefix("m:")?))
    }

    /// A group key of this keyspace (`<prefix>:{g<group>}:<rest>`) split into its group and
    /// its rest.
    fn split_group_key<'k>(&self, key: &'k str) -> Option<(u32, &'k str)> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix(":{g")?;
        let close = rest.find('}')?;
        let group = rest[..close].parse::<u32>().ok()?;
        Some((group, rest[close..].strip_prefix("}:")?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::connection::cluster_slot as slot;

    #[test]
    fn compaction_keys_parse_back_and_share_their_groups_slot() {
        let ks = Keyspace::default();
        let journal = ks.journal_key(5, "views:v:1");
        assert_eq!(
            ks.parse_compaction_key(&journal),
            Some((5, CompactionKey::Journal, "views:v:1"))
        );
        assert_eq!(
            ks.parse_compaction_key(&ks.counter_key(3, "a:b")),
            Some((3, CompactionKey::Share, "a:b"))
        );
        assert_eq!(
            ks.parse_compaction_key(&ks.moved_key(3, "a:b", 11)),
            Some((3, CompactionKey::Moved { from: 11 }, "a:b"))
        );
        assert_eq!(ks.parse_compaction_key(&ks.member_key(3, "a:b")), None);
        assert_eq!(slot(&journal), slot(&ks.counter_key(5, "x")));
        assert_eq!(
            slot(&ks.moved_key(2, "x", 9)),
            slot(&ks.counter_key(2, "y"))
        );
    }

    #[test]
    fn key_layout_is_prefix_group_tag_and_counter() {
        let ks = Keyspace::default();
        assert_eq!(
            ks.counter_key(7, "likes:post:42"),
            "tally:{g7}:c:likes:post:42"
        );
    }

    #[test]
    fn every_key_of_a_group_shares_one_slot_and_groups_spread() {
        let ks = Keyspace::default();
        let mut slots = std::collections::BTreeSet::new();
        for g in 0..ks.groups() {
            let s = slot(&ks.counter_key(g, "likes:post:1"));
            for counter in ["likes:post:2", "views:video:9", "a", "ünï:cödé"] {
                assert_eq!(slot(&ks.counter_key(g, counter)), s);
            }
            slots.insert(s);
        }
        assert_eq!(slots.len(), 16, "each group must have its own slot");
    }

    #[test]
    fn partitions_map_onto_groups_round_robin() {
        let ks = Keyspace::new("t", 4).expect("valid");
        let groups: Vec<u32> = (0..8).map(|p| ks.group_for_partition(p)).collect();
        assert_eq!(groups, [0, 1, 2, 3, 0, 1, 2, 3]);
    }

    #[test]
    fn bookkeeping_keys_share_their_group_slot() {
        let ks = Keyspace::default();
        for g in 0..ks.groups() {
            let s = slot(&ks.counter_key(g, "x"));
            for key in [
                ks.ledger_key(g),
                ks.fence_key(g),
                ks.epoch_key(g),
                ks.watermark_key(g),
            ] {
                assert_eq!(slot(&key), s, "{key}");
                assert_eq!(ks.counter_of_key(&key), None, "{key} is not a counter key");
            }
        }
        assert_eq!(partition_field("tally.events", 3), "tally.events/3");
    }

    #[test]
    fn grouping_by_actor_is_stable_and_spreads() {
        let ks = Keyspace::default();
        // Pinned values: changing the hash would move every actor's state to another group.
        let event = |rule, partition, actor: Option<&str>| {
            ks.group_for_event(rule, partition, actor, "c", Fan::of(4))
        };
        assert_eq!(event(GroupingRule::ByActor, 0, Some("u7")), 5);
        assert_eq!(event(GroupingRule::ByActor, 3, Some("u7")), 5);
        assert_eq!(event(GroupingRule::ByActor, 3, None), 3 + 2 * 4);
        assert_eq!(event(GroupingRule::ByPartition, 3, Some("u7")), 3 + 2 * 4);
        let groups: std::collections::BTreeSet<u32> = (0..1000)
            .map(|i| event(GroupingRule::ByActor, 0, Some(&format!("u{i}"))))
            .collect();
        assert_eq!(groups.len(), 16);
        assert_eq!("actor".parse(), Ok(GroupingRule::ByActor));
        assert!("user".parse::<GroupingRule>().is_err());
    }

    #[test]
    fn grouping_by_counter_ignores_the_partition_and_the_actor() {
        let ks = Keyspace::default();
        let rule = GroupingRule::ByCounter;
        // Pinned: changing the hash would move every deduplicated counter's member set.
        let group = ks.group_for_counter("likes:post:1");
        assert_eq!(group, 0);
        assert_eq!(ks.group_for_counter("likes:post:2"), 9);
        for (partition, actor) in [(0, Some("u7")), (5, Some("u8")), (3, None)] {
            let got = ks.group_for_event(rule, partition, actor, "likes:post:1", Fan::of(4));
            assert_eq!(got, group, "partition {partition}, actor {actor:?}");
        }
        let groups: std::collections::BTreeSet<u32> = (0..1000)
            .map(|i| ks.group_for_counter(&format!("likes:post:{i}")))
            .collect();
        assert_eq!(groups.len(), 16);
        assert_eq!("counter".parse(), Ok(GroupingRule::ByCounter));
    }

    #[test]
    fn a_spread_partition_writes_each_counter_into_one_of_k_groups_from_its_home() {
        let ks = Keyspace::default();
        let rule = GroupingRule::ByPartition;
        // Pinned: changing the hash would move counters between groups under a running log.
        assert_eq!(ks.group_for_event(rule, 3, None, "c", Fan::of(4)), 11);
        assert_eq!(
            ks.group_for_event(rule, 3, None, "likes:post:1", Fan::of(4)),
            3
        );
        assert_eq!(ks.group_for_event(rule, 3, None, "c", Fan::of(1)), 3);
        let mut seen = std::collections::BTreeMap::<u32, usize>::new();
        for i in 0..4000 {
            let counter = format!("likes:post:{i}");
            let group = ks.group_for_event(rule, 14, None, &counter, Fan::of(4));
            assert_eq!(
                group,
                ks.group_for_event(rule, 14, None, &counter, Fan::of(4))
            );
            *seen.entry(group).or_default() += 1;
        }
        // From home group 14, every 4th, wrapping past the last group.
        assert_eq!(seen.keys().copied().collect::<Vec<_>>(), [2, 6, 10, 14]);
        // With 8 partitions, every group takes two partitions' counters.
        let mut partitions: Vec<std::collections::BTreeSet<i32>> = vec![Default::default(); 16];
        for p in 0..8 {
            for i in 0..400 {
                let group =
                    ks.group_for_event(rule, p, None, &format!("likes:post:{i}"), Fan::of(4));
                partitions[group as usize].insert(p);
            }
        }
        assert!(partitions.iter().all(|p| p.len() == 2), "{partitions:?}");
        assert!(seen.values().all(|n| (850..1150).contains(n)), "{seen:?}");
    }

    #[test]
    fn a_spread_keeps_the_stretches_that_groups_may_have_applied() {
        let legacy = Spread::uniform(1);
        assert_eq!(legacy.at(0), 1);
        // A new owner at spread 4, with offsets up to 100 applied somewhere under spread 1.
        let four = legacy.then(4, 100);
        assert_eq!((four.at(0), four.at(99), four.at(100)), (1, 1, 4));
        assert_eq!(four.then(4, 500), four, "the same spread adds no step");
        // Back to 1 at 300: three stretches, and 1 again from 300.
        let back = four.then(1, 300);
        assert_eq!(
            (back.at(99), back.at(100), back.at(299), back.at(300)),
            (1, 4, 4, 1)
        );
        // A change at an offset inside the last step cuts it there.
        let cut = back.then(2, 200);
        assert_eq!(
            (cut.at(99), cut.at(199), cut.at(200), cut.at(299)),
            (1, 4, 2, 2)
        );
        // Nothing applied yet: the new spread from the start.
        assert_eq!(legacy.then(4, -1), Spread::uniform(4));
        assert_eq!(legacy.then(4, 0), Spread::uniform(4));
        assert_eq!(legacy.then(1, 100), legacy);
    }

    #[test]
    fn watermarks_carry_their_spread_and_legacy_ones_read_as_spread_one() {
        let spread = Spread::uniform(1).then(4, 100).then(2, 300);
        let w = Watermark::new(350, &[-1, 300, -1, 350], spread.clone());
        assert_eq!(w.encode(), "350;1=300;3=350;s=1@100;s=4@300;s=2");
        assert_eq!(Watermark::parse(&w.encode()), Some(w));
        let legacy = Watermark::parse("120;3=120").expect("parses");
        assert_eq!(legacy.spread, Spread::uniform(1));
        assert_eq!(
            Watermark::new(120, &[-1, -1, -1, 120], Spread::uniform(1)).encode(),
            "120;3=120"
        );
        assert_eq!(Watermark::parse("-1;s=4").map(|w| w.next_offset), Some(-1));
        let bad = [
            "1;s=0",
            "1;s=4@10",
            "1;s=4;s=2",
            "1;s=x",
            "1;s=2@y;s=1",
            "1;s=2@300;s=4@100;s=1",
            "1;s=2@100;s=4@100;s=1",
        ];
        for bad in bad {
            assert_eq!(Watermark::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_regrouped_stretch_records_its_count_and_places_over_it() {
        let ks = Keyspace::new("t", 4).expect("valid");
        let rule = GroupingRule::ByPartition;
        // Grown to 8 at offset 100, spread 2: the stretch before stays over the original 4.
        let spread = Spread::uniform(2).then_fan(Fan::over(2, 8, 4), 100);
        assert_eq!(spread.fan_at(99), Fan::of(2));
        assert_eq!(
            spread.fan_at(100),
            Fan {
                k: 2,
                groups: Some(8)
            }
        );
        let w = Watermark::new(120, &[100, -1, 80, -1, 120], spread.clone());
        assert_eq!(w.encode(), "120;0=100;2=80;4=120;s=2@100;s=2/8");
        assert_eq!(Watermark::parse(&w.encode()), Some(w));
        for bad in ["1;s=2/0", "1;s=2/x", "1;s=2/2000", "1;s=/8"] {
            assert_eq!(Watermark::parse(bad), None, "{bad}");
        }
        // Partition 5's home is 5 mod 8 = 5 over 8 groups, 5 mod 4 = 1 over the original 4.
        let mut before = std::collections::BTreeSet::new();
        let mut after = std::collections::BTreeSet::new();
        for i in 0..400 {
            let counter = format!("c{i}");
            before.insert(ks.group_for_event(rule, 5, None, &counter, spread.fan_at(0)));
            after.insert(ks.group_for_event(rule, 5, None, &counter, spread.fan_at(100)));
        }
        assert_eq!(before.into_iter().collect::<Vec<_>>(), [1, 3]);
        assert_eq!(after.into_iter().collect::<Vec<_>>(), [1, 5]);
        // Likes stay beside their sets, in the original groups, whatever the fan.
        let wide = Fan::over(2, 8, 4);
        let by_counter = ks.group_for_event(GroupingRule::ByCounter, 5, None, "c", wide);
        assert_eq!(by_counter, ks.group_for_counter("c"));
        assert!(by_counter < 4);
        // Everything past offset 100 stays within 8 groups; nothing ever went beyond 8.
        assert_eq!(spread.within_from(4, 4), None);
        assert_eq!(spread.within_from(8, 4), Some(0));
        let back = spread.then_fan(Fan::of(2), 300);
        assert_eq!(back.within_from(4, 4), Some(300));
        // A spread wider than the new count is cut to it.
        assert_eq!(
            Fan::over(8, 2, 16),
            Fan {
                k: 2,
                groups: Some(2)
            }
        );
        assert_eq!(Fan::over(4, 16, 16), Fan::of(4));
    }

    #[test]
    fn the_counters_of_one_group_fill_every_bucket_of_it() {
        let ks = Keyspace::new("t", 16).expect("valid");
        assert_eq!(ks.packed_key(7, 1023), "t:{g7}:p:1023");
        assert_eq!(ks.packed_pattern(7), "t:{g7}:p:*");
        let mut used = std::collections::BTreeMap::<u32, usize>::new();
        for i in 0..64_000 {
            let counter = format!("views:item:{i}");
            if ks.group_for_counter(&counter) == 5 {
                *used.entry(Keyspace::bucket_of(&counter, 256)).or_default() += 1;
            }
        }
        // About 4,000 counters over 256 buckets: every bucket, none far from 16.
        assert_eq!(used.len(), 256);
        assert!(used.values().all(|&n| (2..=40).contains(&n)), "{used:?}");
        assert_eq!(Keyspace::bucket_of("anything", 1), 0);
    }

    #[test]
    fn counter_of_key_inverts_counter_key() {
        let ks = Keyspace::new("test-1", 16).expect("valid");
        let key = ks.counter_key(11, "likes:post:42");
        assert_eq!(key, "test-1:{g11}:c:likes:post:42");
        assert_eq!(ks.member_key(0, "a"), "test-1:{g0}:m:a");
        assert_eq!(ks.counter_of_key(&key), Some("likes:post:42"));
        assert_eq!(ks.share_of_key(&key), Some((11, "likes:post:42")));
        assert_eq!(ks.share_of_key(&ks.packed_key(11, 3)), None);
        assert_eq!(ks.counter_of_key("test-1:{gx}:c:a"), None);
        assert_eq!(ks.counter_of_key("other:{g1}:c:a"), None);
        let member = ks.member_key(3, "likes:post:7");
        assert_eq!(ks.member_set_of_key(&member), Some((3, "likes:post:7")));
        assert_eq!(
            ks.member_set_of_key(&ks.count_set_key(3, "likes:post:7")),
            None
        );
        assert_eq!(ks.member_set_of_key(&key), None, "a counter key");
    }

    #[test]
    fn rejects_bad_prefixes_and_group_counts() {
        for prefix in ["", "a{b", "a b", &"p".repeat(65)] {
            assert!(matches!(
                Keyspace::new(prefix, 16),
                Err(KeyspaceError::Prefix { .. })
            ));
        }
        assert_eq!(
            Keyspace::new("t", 0),
            Err(KeyspaceError::Groups { groups: 0 })
        );
        assert_eq!(
            Keyspace::new("t", MAX_GROUPS + 1),
            Err(KeyspaceError::Groups {
                groups: MAX_GROUPS + 1
            })
        );
    }

    #[test]
    fn a_cells_key_names_its_group_and_no_other_key_does() {
        let ks = Keyspace::new("tally", 16).expect("valid");
        assert_eq!(ks.parse_cells_key(&ks.cells_key_of_stripe(20, 7)), Some(20));
        assert_eq!(ks.parse_cells_key(&ks.counter_key(20, "views:a")), None);
        let other = Keyspace::new("other", 16).expect("valid");
        assert_eq!(other.parse_cells_key(&ks.cells_key_of_stripe(20, 7)), None);
        assert_eq!(ks.parse_cells_key("tally:{gx}:W:1"), None);
        assert_eq!(ks.parse_cells_key("tally:{g3}:W:x"), None);
    }

    #[test]
    fn more_stripes_split_each_legacy_stripe_and_move_no_counter_across_them() {
        use crate::window::cells::{DEFAULT_STRIPES, LEGACY_STRIPES, MAX_STRIPES};
        let new = Keyspace::new("tally", 16).expect("valid");
        assert_eq!(new.cells_stripes(), DEFAULT_STRIPES);
        let legacy = new.clone().with_cells_stripes(LEGACY_STRIPES);
        let mut used = std::collections::BTreeSet::new();
        for i in 0..20_000 {
            let counter = format!("views:video:{i}");
            let (s, l) = (new.cells_stripe(&counter), legacy.cells_stripe(&counter));
            assert!(s < DEFAULT_STRIPES && l < LEGACY_STRIPES);
            assert_eq!(s % LEGACY_STRIPES, l, "{counter}");
            used.insert(s);
            assert_eq!(
                new.cells_key(3, &counter),
                format!("tally:{{g3}}:W:{s}"),
                "{counter}"
            );
        }
        assert_eq!(used.len() as u64, DEFAULT_STRIPES, "every stripe is used");
        for valid in [1, 2, 64, 512, MAX_STRIPES] {
            assert!(crate::window::cells::valid_stripes(valid), "{valid}");
        }
        for invalid in [0, 3, 100, 2 * MAX_STRIPES] {
            assert!(!crate::window::cells::valid_stripes(invalid), "{invalid}");
        }
    }
}

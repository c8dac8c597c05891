//! One partition's buffer: deltas summed per shard group and counter, the last like or unlike of
//! each (counter, actor) in deduplicating namespaces, plus the malformed messages to dead-letter,
//! up to the offset of the last message added.
//!
//! A [`Batch`] grows as messages arrive and is *sealed* into a [`SealedBatch`] when a flush
//! starts, which is when it is full or due by the triggers of [`super::pace`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tally_common::window::Bucket;

use super::letter::DeadLetter;
use super::likes::{LikeTable, Likes};
#[cfg(test)]
use super::pace::MEMBERSHIPS_PER_ENTRY;
use super::pace::{FlushClock, GROUP_MEMBERSHIPS_SHARE, Limits, Pace, Size};

/// A delta for one time bucket of a counter in a windowed namespace (`tally_common::window`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct WindowDelta {
    /// The counter: shared by its buckets' deltas (a counter has one per window at least).
    pub counter: Arc<str>,
    /// The window's width, in ms.
    pub width_ms: i64,
    /// Where the bucket starts, in ms since the epoch.
    pub start_ms: i64,
    /// When the bucket expires (its end plus the window's retention), in ms since the epoch.
    pub expire_at_ms: i64,
    /// The summed delta.
    pub delta: i64,
}

/// An expiry record met in a batch (see `crate::tasks::expiry`), waiting for the decision the flush
/// takes in the partition's home group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingExpiry {
    /// Where it is in the log (the decision is recorded under it).
    pub offset: i64,
    /// The counter.
    pub counter: String,
    /// Idle deadlines at or before this have passed.
    pub deadline_ms: i64,
    /// The latest idle deadline of the counter's events earlier in this batch (since its
    /// previous expiry record in the batch), if there were any.
    pub held_deadline: Option<i64>,
    /// Those events' summed deltas per group: dropped if the counter expires, kept if not.
    pub held: Vec<(u32, i64)>,
    /// Their likes and unlikes (one-per-actor namespaces), per group: `(group, actor, like)`.
    pub held_members: Vec<(u32, String, bool)>,
    /// The groups that clear the counter if it expires (those that have not applied the record).
    pub groups: Vec<u32>,
}

/// The batch maps' hasher: foldhash, seeded at random per map; with it decode + aggregate runs
/// 15% fewer instructions per event than with the standard library's SipHash. Its DoS resistance is "minimal"; a batch map
/// lives for one flush interval and holds at most twice `max_counters` entries, so colliding ids
/// crafted against a seed would slow one flush, not grow without bound.
type Hasher = foldhash::fast::RandomState;

/// What a batch holds for one counter in one group: its summed delta, and in a windowed
/// namespace its summed deltas per placement (one map entry for both: one lookup per event).
///
/// A placement is the set of buckets an event counts in (`Batch::placements`): the events of
/// one batch share few (one per minute of their times with a `1m` window), so a counter sums
/// its deltas per placement, mostly just one, kept inline; they become bucket deltas when the
/// batch is sealed. 32 bytes, as small as a total and a `Vec`.
#[derive(Debug)]
struct Sums {
    total: i64,
    /// The delta summed in the placement `first` ([`NO_PLACEMENT`]: none yet).
    first_delta: i64,
    first: u32,
    /// Deltas summed in other placements.
    #[expect(
        clippy::box_collection,
        reason = "the box keeps every counter's entry at 32 bytes; only counters whose events \
                  span placements allocate it"
    )]
    more: Option<Box<Vec<(u32, i64)>>>,
}

const _: () = assert!(std::mem::size_of::<Sums>() == 32);

/// `Sums::first` of a counter no windowed event has reached.
const NO_PLACEMENT: u32 = u32::MAX;

impl Default for Sums {
    fn default() -> Self {
        Self {
            total: 0,
            first_delta: 0,
            first: NO_PLACEMENT,
            more: None,
        }
    }
}

impl Sums {
    /// Adds `delta` in the placement `placement`.
    fn add_placed(&mut self, placement: u32, delta: i64) {
        if self.first == placement || self.first == NO_PLACEMENT {
            self.first = placement;
            self.first_delta += delta;
            return;
        }
        let more = self.more.get_or_insert_with(Box::default);
        match more.iter_mut().find(|(p, _)| *p == placement) {
            Some((_, sum)) => *sum += delta,
            None => more.push((placement, delta)),
        }
    }

    /// The deltas per placement.
    fn placed(&self) -> impl Iterator<Item = (u32, i64)> + '_ {
        let first = (self.first != NO_PLACEMENT).then_some((self.first, self.first_delta));
        first
            .into_iter()
            .chain(self.more.iter().flat_map(|more| more.iter().copied()))
    }
}

/// What one shard group receives from a batch.
#[derive(Debug, Default)]
struct GroupBuffer {
    /// Summed delta (and bucket deltas) per counter id.
    deltas: HashMap<String, Sums, Hasher>,
    /// The last action per counter and actor: only the last one matters, since membership is
    /// a state, not a sum.
    members: LikeTable,
    /// Counters to clear before this batch's writes, each at its last reset's offset.
    resets: Vec<Reset>,
    /// Its entries: counters with deltas, runs of likes and resets.
    entries: usize,
}

/// A counter cleared in a group's write (a reset, or an expiry), and the offset of its last
/// reset or expiry in the batch: while a compactor moves shares, the group records it
/// (`crate::tasks::compact`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reset {
    /// The counter.
    pub counter: String,
    /// Where its last reset (or expiry record) in the batch is in the log.
    pub offset: i64,
}

impl Reset {
    /// `counter`, reset at `offset`.
    pub fn new(counter: impl Into<String>, offset: i64) -> Self {
        Self {
            counter: counter.into(),
            offset,
        }
    }
}

/// One shard group's part of a sealed batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupBatch {
    /// The group.
    pub group: u32,
    /// Non-zero summed deltas per counter.
    pub deltas: Vec<(String, i64)>,
    /// Non-zero summed deltas per counter and time bucket.
    pub windows: Vec<WindowDelta>,
    /// Counters whose share (and member set, and compaction journal) here is cleared before
    /// the deltas and memberships are applied, one per counter.
    pub resets: Vec<Reset>,
    /// Likes and unlikes, one per (counter, actor), in a run per counter.
    pub members: Likes,
}

impl GroupBatch {
    /// Distinct writes: counters with a delta, buckets with a delta, and memberships.
    pub fn writes(&self) -> usize {
        self.deltas.len() + self.windows.len() + self.members.len() + self.resets.len()
    }
}

/// The buffer of one partition.
#[derive(Debug, Default)]
pub struct Batch {
    /// Per shard group (one entry per group that has anything; a partition grouped by
    /// partition has at most its spread's).
    groups: Vec<(u32, GroupBuffer)>,
    /// Distinct (group, counter) entries over all groups: counters with deltas, counters with
    /// likes (a run each), resets and expiry records.
    entries: usize,
    /// Distinct (group, counter, actor) memberships over all groups; every
    /// [`Size::memberships_per_entry`] of them count as one more entry.
    memberships: usize,
    /// The most (counter, actor) pairs any one group's likes hold (`LikeTable::held`): a
    /// group's write is one transaction, bounded by [`GROUP_MEMBERSHIPS_SHARE`].
    largest_group: usize,
    /// The most entries any one group holds: a group's write is one transaction, bounded by
    /// [`Size::max_group_entries`].
    largest_group_entries: usize,
    /// Malformed messages waiting to be copied to the dead-letter topic.
    dead_letters: Vec<DeadLetter>,
    /// In namespaces that expire counters: the latest idle deadline per counter written since
    /// its last expiry record in the batch.
    touched: HashMap<String, i64, Hasher>,
    /// Expiry records, in log order.
    expiries: Vec<PendingExpiry>,
    /// The placements of the windowed events added, each once (`Sums`), and where each is.
    placements: Vec<Box<[Bucket]>>,
    placement_index: HashMap<Box<[Bucket]>, u32, Hasher>,
    /// Messages added (valid and malformed).
    events: usize,
    /// The offset after the last message added: where the partition resumes once this is durable.
    next_offset: Option<i64>,
    /// When the first message was added.
    started: Option<Instant>,
}

/// A batch taken for flushing: everything a flush needs, detached from the live buffer.
#[derive(Debug)]
pub struct SealedBatch {
    /// Per shard group, the non-zero summed deltas per counter (deltas that cancelled out are
    /// left out, and so are groups left with nothing) and the memberships.
    pub groups: Vec<GroupBatch>,
    /// Malformed messages to copy to the dead-letter topic before the offset moves.
    pub dead_letters: Vec<DeadLetter>,
    /// Counters written in namespaces that expire, with their latest idle deadline since their
    /// last expiry record in the batch: the partition's idle index moves to these.
    pub touched: Vec<(String, i64)>,
    /// Expiry records to decide before the groups are written (then [`SealedBatch::settle`]).
    pub expiries: Vec<PendingExpiry>,
    /// Messages in the batch.
    pub events: usize,
    /// The offset to commit once the batch is durable.
    pub next_offset: i64,
}

impl SealedBatch {
    /// Distinct (group, counter) writes and memberships in the batch.
    pub fn writes(&self) -> usize {
        self.groups.iter().map(GroupBatch::writes).sum()
    }

    /// Applies the decisions on [`SealedBatch::expiries`] (`true`: expired), in log order: an
    /// expired counter is cleared in its groups and what the batch held for it before the
    /// record is dropped; a kept one gets its held deltas back. Returns how many expired.
    pub fn settle(&mut self, expired: &[bool]) -> usize {
        let mut carried: HashMap<&str, Vec<(u32, i64)>> = HashMap::new();
        // Likes and unlikes carried per counter: the last action per (group, actor) wins.
        let mut carried_members: HashMap<&str, HashMap<(u32, &str), bool>> = HashMap::new();
        let mut count = 0;
        for (expiry, &expired) in self.expiries.iter().zip(expired) {
            let carry = carried.entry(&expiry.counter).or_default();
            carry.extend(&expiry.held);
            let members = carried_members.entry(&expiry.counter).or_default();
            for (group, actor, like) in &expiry.held_members {
                members.insert((*group, actor), *like);
            }
            if !expired {
                continue;
            }
            count += 1;
            carry.clear();
            members.clear();
            for &group in &expiry.groups {
                let g = group_batch(&mut self.groups, group);
                g.resets
                    .push(Reset::new(expiry.counter.clone(), expiry.offset));
            }
        }
        for (counter, carry) in carried {
            for (group, delta) in carry {
                let deltas = &mut group_batch(&mut self.groups, group).deltas;
                match deltas.iter_mut().find(|(c, _)| c == counter) {
                    Some((_, sum)) => *sum += delta,
                    None => deltas.push((counter.to_owned(), delta)),
                }
            }
        }
        let mut carried_likes: HashMap<u32, Vec<(&str, &str, bool)>> = HashMap::new();
        for (counter, members) in &carried_members {
            for (&(group, actor), &like) in members {
                carried_likes
                    .entry(group)
                    .or_default()
                    .push((counter, actor, like));
            }
        }
        for (group, carried) in carried_likes {
            // A later action of the same actor on the counter (after its last expiry record)
            // is in the batch already, and wins.
            let members = &mut group_batch(&mut self.groups, group).members;
            *members = std::mem::take(members).with_absent(carried);
        }
        for g in &mut self.groups {
            g.deltas.retain(|(_, d)| *d != 0);
            // A counter expired twice in the batch, or reset too, is cleared once, at its last.
            (g.resets)
                .sort_unstable_by(|a, b| a.counter.cmp(&b.counter).then(b.offset.cmp(&a.offset)));
            (g.resets).dedup_by(|later, first| later.counter == first.counter);
        }
        self.groups.retain(|g| g.writes() > 0);
        count
    }
}

/// The non-zero bucket deltas of `deltas` (one group's), a counter's one after another.
fn window_deltas(
    placements: &[Box<[Bucket]>],
    deltas: &HashMap<String, Sums, Hasher>,
) -> Vec<WindowDelta> {
    let mut windows = Vec::new();
    // One counter's bucket deltas, summed over its placements.
    let mut buckets: Vec<(Bucket, i64)> = Vec::new();
    for (counter, sums) in deltas {
        buckets.clear();
        for (placement, delta) in sums.placed() {
            buckets.extend(placements[placement as usize].iter().map(|b| (*b, delta)));
        }
        if sums.more.is_some() {
            // Placements share buckets (two minutes of one hour): sum each bucket once.
            buckets.sort_unstable_by_key(|(b, _)| (b.width_ms, b.start_ms));
            buckets.dedup_by(|(b, delta), (kept, sum)| {
                let same = b == kept;
                if same {
                    *sum += *delta;
                }
                same
            });
        }
        buckets.retain(|(_, delta)| *delta != 0);
        if buckets.is_empty() {
            continue;
        }
        let counter: Arc<str> = Arc::from(counter.as_str());
        windows.extend(buckets.iter().map(|(b, delta)| WindowDelta {
            counter: Arc::clone(&counter),
            width_ms: b.width_ms,
            start_ms: b.start_ms,
            expire_at_ms: b.expire_at_ms,
            delta: *delta,
        }));
    }
    windows
}

/// `group`'s part of `groups`, added empty if it has none.
fn group_batch(groups: &mut Vec<GroupBatch>, group: u32) -> &mut GroupBatch {
    let i = match groups.iter().position(|g| g.group == group) {
        Some(i) => i,
        None => {
            groups.push(GroupBatch {
                group,
                ..GroupBatch::default()
            });
            groups.len() - 1
        }
    };
    &mut groups[i]
}

impl Batch {
    /// Adds a valid event at `offset`, bound for shard group `group`.
    pub fn add(&mut self, group: u32, counter: &str, delta: i64, offset: i64) {
        self.add_windowed(group, counter, delta, &[], offset);
    }

    /// Runs `f` on the sums of `counter` in `group`, made (and counted as an entry) if new.
    fn with_sums(&mut self, group: u32, counter: &str, f: impl FnOnce(&mut Sums)) {
        let i = self.group_index(group);
        // Look up by &str first: the common case (a counter already in the batch) allocates nothing.
        let sums = match self.groups[i].1.deltas.get_mut(counter) {
            Some(sums) => sums,
            None => {
                self.count_entry(i);
                (self.groups[i].1.deltas)
                    .entry(counter.to_owned())
                    .or_default()
            }
        };
        f(sums);
    }

    /// [`Batch::add`] in a windowed namespace: `delta` to `counter`'s total and to its
    /// `buckets` in `group`, in one lookup, and the batch past the message at `offset`. The
    /// buckets add no entry: the store rewrites them as one field beside the total.
    pub fn add_windowed(
        &mut self,
        group: u32,
        counter: &str,
        delta: i64,
        buckets: &[Bucket],
        offset: i64,
    ) {
        let placement = (!buckets.is_empty()).then(|| self.placement(buckets));
        self.with_sums(group, counter, |sums| {
            if let Some(placement) = placement {
                sums.add_placed(placement, delta);
            }
            // Cannot overflow: |delta| <= 10^12 and a batch holds far fewer than 9.2 million
            // events.
            sums.total += delta;
        });
        self.advance(offset);
    }

    /// The number of the placement `buckets`, added if new.
    fn placement(&mut self, buckets: &[Bucket]) -> u32 {
        // Events come roughly in time order: the last placement is the usual answer.
        if let Some(last) = self.placements.last()
            && **last == *buckets
        {
            return (self.placements.len() - 1) as u32;
        }
        if let Some(&at) = self.placement_index.get(buckets) {
            return at;
        }
        // A batch holds fewer than 4 billion events.
        let at = self.placements.len() as u32;
        self.placements.push(buckets.into());
        self.placement_index.insert(buckets.into(), at);
        at
    }

    /// Notes that `counter`, in a namespace that expires counters, was written by an event whose
    /// idle deadline is `deadline_ms`.
    pub fn touch(&mut self, counter: &str, deadline_ms: i64) {
        match self.touched.get_mut(counter) {
            Some(latest) => *latest = (*latest).max(deadline_ms),
            None => {
                self.touched.insert(counter.to_owned(), deadline_ms);
            }
        }
    }

    /// Adds an expiry record of `counter` at `offset`. If an event of it earlier in the batch
    /// is still within its idle time, the counter is kept and that is all; otherwise the record
    /// waits for the flush's decision, holding aside what the batch has for the counter so far.
    pub fn expire(
        &mut self,
        counter: &str,
        deadline_ms: i64,
        groups: impl Iterator<Item = u32>,
        offset: i64,
    ) {
        let held_deadline = self.touched.remove(counter);
        match held_deadline {
            Some(latest) if latest > deadline_ms => {
                self.touched.insert(counter.to_owned(), latest);
            }
            _ => {
                let held = (self.groups.iter_mut())
                    .filter_map(|(g, buffer)| {
                        // The total is held; bucket deltas stay (windows are not expired).
                        let sums = buffer.deltas.get_mut(counter)?;
                        Some((*g, std::mem::take(&mut sums.total)))
                    })
                    .collect();
                // Every event since the counter's last expiry in the batch touched it: with no
                // touch there is nothing to hold, and the member maps need no scan.
                let mut held_members = Vec::new();
                if held_deadline.is_some() {
                    for (g, buffer) in &mut self.groups {
                        let actors = buffer.members.remove(counter);
                        held_members.extend(actors.into_iter().map(|(a, like)| (*g, a, like)));
                    }
                }
                self.expiries.push(PendingExpiry {
                    offset,
                    counter: counter.to_owned(),
                    deadline_ms,
                    held_deadline,
                    held,
                    held_members,
                    groups: groups.collect(),
                });
                self.entries += 1;
            }
        }
        self.advance(offset);
    }

    /// Adds a reset of `counter` at `offset`: what the batch holds for it (deltas, likes and
    /// unlikes; bucket deltas stay, windows are not reset) is dropped, and each of `groups` will
    /// clear the counter before applying what comes after.
    pub fn reset(&mut self, counter: &str, groups: impl Iterator<Item = u32>, offset: i64) {
        for (_, buffer) in &mut self.groups {
            if let Some(sums) = buffer.deltas.get_mut(counter) {
                sums.total = 0;
            }
            buffer.members.remove(counter);
        }
        for expiry in &mut self.expiries {
            if expiry.counter == counter {
                expiry.held.clear();
                expiry.held_members.clear();
            }
        }
        for group in groups {
            let i = self.group_index(group);
            let resets = &mut self.groups[i].1.resets;
            match resets.iter_mut().find(|r| r.counter == counter) {
                Some(reset) => reset.offset = offset,
                None => {
                    resets.push(Reset::new(counter, offset));
                    self.count_entry(i);
                }
            }
        }
        self.advance(offset);
    }

    /// Adds a like (or unlike) of `counter` by `actor` at `offset`, bound for `group` (the
    /// actor's). A later action of the same actor on the same counter replaces it.
    pub fn add_member(&mut self, group: u32, counter: &str, actor: &str, like: bool, offset: i64) {
        let i = self.group_index(group);
        let buffer = &mut self.groups[i].1;
        let added = buffer.members.set(counter, actor, like);
        if added.membership {
            self.largest_group = self.largest_group.max(buffer.members.held());
        }
        if added.run {
            self.count_entry(i);
        }
        self.memberships += usize::from(added.membership);
        self.advance(offset);
    }

    /// Counts a new entry (a counter with deltas, a run of likes, a reset) in the group at `i`
    /// of `groups`.
    fn count_entry(&mut self, i: usize) {
        let buffer = &mut self.groups[i].1;
        buffer.entries += 1;
        self.entries += 1;
        self.largest_group_entries = self.largest_group_entries.max(buffer.entries);
    }

    /// Where `group`'s buffer is in `groups`, made if new.
    fn group_index(&mut self, group: u32) -> usize {
        match self.groups.iter().position(|(g, _)| *g == group) {
            Some(i) => i,
            None => {
                self.groups.push((group, GroupBuffer::default()));
                self.groups.len() - 1
            }
        }
    }

    /// Records that the message at `offset` needs nothing from this batch (its delta was already
    /// applied before a restart), so that the batch still moves the partition past it.
    pub fn skip(&mut self, offset: i64) {
        self.advance(offset);
    }

    /// Adds a malformed message at `offset`, to be dead-lettered by the flush.
    pub fn add_dead_letter(&mut self, dead_letter: DeadLetter, offset: i64) {
        self.dead_letters.push(dead_letter);
        self.advance(offset);
    }

    fn advance(&mut self, offset: i64) {
        self.events += 1;
        self.next_offset = Some(offset + 1);
        self.started.get_or_insert_with(Instant::now);
    }

    /// Whether no message has been added since the last seal.
    pub fn is_empty(&self) -> bool {
        self.events == 0
    }

    /// Messages buffered.
    pub fn events(&self) -> usize {
        self.events
    }

    /// Whether the batch hit a size limit and must be flushed now.
    pub fn is_full(&self, size: &Size) -> bool {
        // entries + memberships / per_entry >= max_counters, and one group's memberships >=
        // max_counters * per_entry / GROUP_MEMBERSHIPS_SHARE, without a division per event; or
        // one group's entries >= max_group_entries.
        let per_entry = size.memberships_per_entry.max(1);
        let weight = size.max_counters.saturating_mul(per_entry);
        self.events >= size.max_events
            || self.entries * per_entry + self.memberships >= weight
            || self.largest_group.saturating_mul(GROUP_MEMBERSHIPS_SHARE) >= weight
            || self.largest_group_entries >= size.max_group_entries
    }

    /// Whether the batch must be flushed at `now`. Live: full, or its partition's flush time
    /// came since its oldest message arrived. Catching up: full at the catch-up size, or its
    /// oldest message arrived a catch-up interval ago.
    pub fn is_due(&self, limits: &Limits, pace: Pace, clock: &FlushClock, now: Instant) -> bool {
        if self.is_full(limits.size(pace)) {
            return true;
        }
        let Some(started) = self.started else {
            return false;
        };
        match pace {
            Pace::Live => clock.passed(started, now),
            Pace::CatchingUp => now.saturating_duration_since(started) >= limits.catch_up_interval,
        }
    }

    /// Takes the contents for flushing, leaving an empty batch. `None` if there is nothing.
    pub fn seal(&mut self) -> Option<SealedBatch> {
        let next_offset = self.next_offset?;
        let taken = std::mem::take(self);
        Some(SealedBatch {
            groups: taken
                .groups
                .into_iter()
                .map(|(group, buffer)| GroupBatch {
                    group,
                    windows: window_deltas(&taken.placements, &buffer.deltas),
                    deltas: (buffer.deltas.into_iter())
                        .filter(|(_, sums)| sums.total != 0)
                        .map(|(counter, sums)| (counter, sums.total))
                        .collect(),
                    resets: buffer.resets,
                    members: buffer.members.seal(),
                })
                .filter(|g| g.writes() > 0)
                .collect(),
            dead_letters: taken.dead_letters,
            touched: taken.touched.into_iter().collect(),
            expiries: taken.expiries,
            events: taken.events,
            next_offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::super::likes::Like;
    use super::*;

    fn deltas(group: u32, deltas: &[(&str, i64)]) -> GroupBatch {
        GroupBatch {
            group,
            deltas: deltas.iter().map(|(c, d)| ((*c).to_owned(), *d)).collect(),
            windows: Vec::new(),
            resets: Vec::new(),
            members: Likes::default(),
        }
    }

    fn sorted_deltas(sealed: &SealedBatch, group: u32) -> Vec<(String, i64)> {
        let mut deltas = (sealed.groups.iter())
            .find(|g| g.group == group)
            .map(|g| g.deltas.clone())
            .unwrap_or_default();
        deltas.sort();
        deltas
    }

    #[test]
    fn an_expiry_holds_what_came_before_it_until_the_flush_decides() {
        for expired in [true, false] {
            let mut b = Batch::default();
            b.touch("c:1", 100);
            b.add(1, "c:1", 5, 0);
            b.touch("c:2", 100);
            b.add(1, "c:2", 2, 1);
            b.expire("c:1", 150, 0..2, 2);
            b.touch("c:1", 300);
            b.add(1, "c:1", 7, 3);
            let mut sealed = b.seal().expect("sealed");
            assert_eq!(sealed.expiries.len(), 1);
            let e = &sealed.expiries[0];
            assert_eq!(
                (e.offset, e.held_deadline, e.held.clone()),
                (2, Some(100), vec![(1, 5)])
            );
            let mut touched = sealed.touched.clone();
            touched.sort();
            assert_eq!(touched, [("c:1".to_owned(), 300), ("c:2".to_owned(), 100)]);
            assert_eq!(sealed.settle(&[expired]), usize::from(expired));
            let c1 = if expired { 7 } else { 12 };
            assert_eq!(
                sorted_deltas(&sealed, 1),
                [("c:1".to_owned(), c1), ("c:2".to_owned(), 2)]
            );
            let resets: Vec<(u32, Vec<Reset>)> = (sealed.groups.iter())
                .filter(|g| !g.resets.is_empty())
                .map(|g| (g.group, g.resets.clone()))
                .collect();
            if expired {
                assert_eq!(resets.len(), 2, "both groups clear it: {resets:?}");
            } else {
                assert!(resets.is_empty(), "{resets:?}");
            }
        }
    }

    #[test]
    fn an_expiry_after_a_recent_event_in_the_batch_keeps_the_counter_without_asking() {
        let mut b = Batch::default();
        b.touch("c:1", 500);
        b.add(0, "c:1", 5, 0);
        b.expire("c:1", 150, 0..1, 1);
        let sealed = b.seal().expect("sealed");
        assert!(sealed.expiries.is_empty());
        assert_eq!(sealed.touched, [("c:1".to_owned(), 500)]);
        assert_eq!(sorted_deltas(&sealed, 0), [("c:1".to_owned(), 5)]);
        assert_eq!(sealed.next_offset, 2);
    }

    #[test]
    fn an_expiry_holds_likes_too_and_a_later_action_of_the_same_actor_wins() {
        for expired in [true, false] {
            let mut b = Batch::default();
            b.touch("p:1", 100);
            b.add_member(2, "p:1", "u1", true, 0);
            b.touch("p:1", 100);
            b.add_member(3, "p:1", "u2", true, 1);
            b.expire("p:1", 150, 0..4, 2);
            b.touch("p:1", 300);
            b.add_member(2, "p:1", "u1", false, 3);
            let mut sealed = b.seal().expect("sealed");
            assert_eq!(sealed.expiries[0].held_members.len(), 2);
            sealed.settle(&[expired]);
            let mut members: Vec<(u32, String, bool)> = (sealed.groups.iter())
                .flat_map(|g| (g.members.iter()).map(|m| (g.group, m.actor.to_owned(), m.like)))
                .collect();
            members.sort();
            if expired {
                assert_eq!(members, [(2, "u1".to_owned(), false)]);
            } else {
                let both = [(2, "u1".to_owned(), false), (3, "u2".to_owned(), true)];
                assert_eq!(members, both);
            }
        }
    }

    #[test]
    fn two_expiries_of_one_counter_settle_in_log_order() {
        // +1 | expire | +2 | expire | +4, settled with each pair of decisions.
        for (decisions, expired, total) in [
            ([false, true], 1, 4),
            ([false, false], 0, 7),
            ([true, false], 1, 6),
            ([true, true], 2, 4),
        ] {
            let mut b = Batch::default();
            b.add(0, "c", 1, 0);
            b.expire("c", 10, 0..1, 1);
            b.add(0, "c", 2, 2);
            b.expire("c", 10, 0..1, 3);
            b.add(0, "c", 4, 4);
            let mut sealed = b.seal().expect("sealed");
            assert_eq!(sealed.settle(&decisions), expired, "{decisions:?}");
            assert_eq!(sorted_deltas(&sealed, 0), [("c".to_owned(), total)]);
            let resets = (sealed.groups.iter().find(|g| g.group == 0)).map(|g| g.resets.len());
            assert_eq!(
                resets,
                Some(usize::from(expired > 0)),
                "cleared once at most"
            );
            // At the last expiry that expired (records at offsets 1 and 3).
            let last = decisions.iter().rposition(|&d| d).map(|i| 1 + 2 * i as i64);
            let offsets: Vec<i64> = (sealed.groups.iter().find(|g| g.group == 0))
                .map(|g| g.resets.iter().map(|r| r.offset).collect())
                .unwrap_or_default();
            assert_eq!(offsets, Vec::from_iter(last), "{decisions:?}");
        }
    }

    #[test]
    fn a_counter_reset_twice_is_cleared_once_at_its_last_reset() {
        let mut b = Batch::default();
        b.reset("v:1", 0..2, 3);
        b.add(0, "v:2", 1, 4);
        b.reset("v:1", 0..2, 5);
        b.reset("v:2", 1..2, 6);
        let sealed = b.seal().expect("sealed");
        let mut cleared: Vec<(u32, Vec<Reset>)> = (sealed.groups.iter())
            .map(|g| (g.group, g.resets.clone()))
            .collect();
        cleared.sort_by_key(|(group, _)| *group);
        assert_eq!(
            cleared,
            [
                (0, vec![Reset::new("v:1", 5)]),
                (1, vec![Reset::new("v:1", 5), Reset::new("v:2", 6)]),
            ]
        );
    }

    #[test]
    fn a_reset_drops_what_came_before_it_and_clears_every_group() {
        let mut b = Batch::default();
        b.add(1, "v:1", 5, 0);
        b.add(1, "v:2", 2, 1);
        b.add_member(3, "v:1", "u1", true, 2);
        b.reset("v:1", 0..4, 3);
        b.add(1, "v:1", 7, 4);
        let sealed = b.seal().expect("sealed");
        assert_eq!(sealed.groups.len(), 4, "every group clears it");
        for g in &sealed.groups {
            assert_eq!(g.resets, [Reset::new("v:1", 3)]);
            assert!(g.members.is_empty(), "the like before the reset is dropped");
        }
        let group1 = sealed
            .groups
            .iter()
            .find(|g| g.group == 1)
            .expect("group 1");
        let mut deltas = group1.deltas.clone();
        deltas.sort();
        assert_eq!(deltas, [("v:1".to_owned(), 7), ("v:2".to_owned(), 2)]);
    }

    #[test]
    fn window_deltas_sum_per_counter_and_bucket_and_count_as_one_entry() {
        let bucket = |width_ms, start_ms| Bucket {
            width_ms,
            start_ms,
            expire_at_ms: start_ms + 2 * width_ms,
        };
        let mut b = Batch::default();
        b.add_windowed(0, "v:1", 2, &[bucket(60, 0), bucket(3600, 0)], 0);
        b.add_windowed(0, "v:1", 3, &[bucket(60, 60), bucket(3600, 0)], 1);
        b.add_windowed(0, "v:1", -2, &[bucket(60, 0)], 2);
        assert_eq!(
            b.entries, 1,
            "one (group, counter): its total and its buckets"
        );
        let sealed = b.seal().expect("sealed");
        let mut windows: Vec<(i64, i64, i64)> = (sealed.groups[0].windows.iter())
            .map(|w| (w.width_ms, w.start_ms, w.delta))
            .collect();
        windows.sort();
        // The minute bucket at 0 summed to zero: nothing to write.
        assert_eq!(windows, [(60, 60, 3), (3600, 0, 5)]);
        assert_eq!(sealed.groups[0].deltas, [("v:1".to_owned(), 3)]);
    }

    #[test]
    fn keeps_the_last_action_per_counter_and_actor() {
        let mut b = Batch::default();
        b.add_member(2, "likes:p:1", "u1", true, 0);
        b.add_member(2, "likes:p:1", "u1", false, 1);
        b.add_member(2, "likes:p:1", "u2", true, 2);
        b.add_member(2, "likes:p:1", "u2", true, 3);
        b.add_member(2, "likes:p:2", "u1", true, 4);
        let sealed = b.seal().expect("not empty");
        let mut members: Vec<Like> = sealed.groups[0].members.iter().collect();
        members.sort();
        let m = |counter, actor, like| Like {
            counter,
            actor,
            like,
        };
        assert_eq!(
            members,
            [
                m("likes:p:1", "u1", false),
                m("likes:p:1", "u2", true),
                m("likes:p:2", "u1", true)
            ]
        );
        assert_eq!(
            (sealed.events, sealed.writes(), sealed.next_offset),
            (5, 3, 5)
        );
    }

    fn limits() -> Limits {
        Limits {
            flush_interval: Duration::from_secs(3600),
            live: Size {
                max_events: 5,
                max_counters: 3,
                memberships_per_entry: MEMBERSHIPS_PER_ENTRY,
                max_group_entries: usize::MAX,
            },
            catch_up: Size {
                max_events: 50,
                max_counters: 30,
                memberships_per_entry: MEMBERSHIPS_PER_ENTRY,
                max_group_entries: usize::MAX,
            },
            catch_up_interval: Duration::from_secs(7200),
        }
    }

    #[test]
    fn sums_deltas_per_counter_and_drops_those_that_cancel() {
        let mut b = Batch::default();
        b.add(0, "a", 2, 10);
        b.add(0, "b", 1, 11);
        b.add(0, "a", -5, 12);
        b.add(0, "b", -1, 13);
        let sealed = b.seal().expect("not empty");
        assert_eq!(sealed.groups, vec![deltas(0, &[("a", -3)])]);
        assert_eq!((sealed.events, sealed.next_offset), (4, 14));
        assert!(b.is_empty() && b.seal().is_none());
    }

    #[test]
    fn keeps_groups_apart_and_skipped_messages_move_the_offset() {
        let mut b = Batch::default();
        b.add(3, "a", 1, 0);
        b.add(7, "a", 2, 1);
        b.add(3, "a", 1, 2);
        b.skip(3);
        let mut sealed = b.seal().expect("not empty");
        sealed.groups.sort_by_key(|g| g.group);
        assert_eq!(
            sealed.groups,
            vec![deltas(3, &[("a", 2)]), deltas(7, &[("a", 2)])]
        );
        assert_eq!(
            (sealed.events, sealed.next_offset, sealed.writes()),
            (4, 4, 2)
        );
    }

    #[test]
    fn full_on_too_many_events() {
        let mut b = Batch::default();
        for offset in 0..4 {
            b.add(0, "a", 1, offset);
        }
        assert!(!b.is_full(&limits().live));
        b.add(0, "a", 1, 4);
        assert!(b.is_full(&limits().live));
    }

    #[test]
    fn full_on_too_many_distinct_counters() {
        let mut b = Batch::default();
        b.add(0, "a", 1, 0);
        b.add(0, "b", 1, 1);
        assert!(!b.is_full(&limits().live));
        // The same counter in another group is another entry.
        b.add(1, "a", 1, 2);
        assert!(b.is_full(&limits().live));
    }

    #[test]
    fn full_when_one_group_holds_its_most_entries_however_many_the_others_hold() {
        let size = Size {
            max_events: 1_000,
            max_counters: 1_000,
            memberships_per_entry: MEMBERSHIPS_PER_ENTRY,
            max_group_entries: 3,
        };
        let mut b = Batch::default();
        // Two entries in each of groups 0, 2 and 3: a delta, a run of likes, a reset.
        b.add(0, "a", 1, 0);
        b.add_member(0, "b", "u1", true, 1);
        b.add_member(0, "b", "u2", true, 2);
        b.add(2, "a", 1, 3);
        b.reset("c", [2, 3].into_iter(), 4);
        b.add(3, "d", 1, 5);
        // Again into one it holds: no new entry.
        b.add(0, "a", 1, 6);
        b.add_member(0, "b", "u3", false, 7);
        b.reset("c", [2, 3].into_iter(), 8);
        assert!(!b.is_full(&size), "six entries, two a group");
        // A third in group 3, whatever kind.
        b.add_member(3, "e", "u1", true, 9);
        assert!(b.is_full(&size));
        let sealed = b.seal().expect("not empty");
        let group = |g: u32| sealed.groups.iter().find(|batch| batch.group == g);
        assert_eq!(
            group(3).map(GroupBatch::writes),
            Some(3),
            "d, e's like, c's reset"
        );
        // Sealing starts the count again.
        b.add(3, "f", 1, 10);
        assert!(!b.is_full(&size));
    }

    /// Adds counters `c<i>` for `i` in `range`, a delta each, to group 1 at offset 100 + i.
    fn add_counters(b: &mut Batch, range: std::ops::Range<i64>) {
        for i in range {
            b.add(1, &format!("c{i}"), 1, 100 + i);
        }
    }

    #[test]
    fn a_counters_likes_count_as_one_entry_and_every_eight_memberships_as_one_more() {
        // 26 entries (and fewer than 26 * 8 / 24 = 8.7 memberships in one group).
        let size = Size {
            max_events: 1_000,
            max_counters: 26,
            memberships_per_entry: MEMBERSHIPS_PER_ENTRY,
            max_group_entries: usize::MAX,
        };
        let mut b = Batch::default();
        // One counter with 7 likers and an unlike: 1 + 8 / 8 = 2 entries.
        for actor in 0..8 {
            b.add_member(0, "a", &format!("u{actor}"), actor != 7, actor);
        }
        b.add_member(0, "a", "u1", false, 8);
        // 23 more counters: 25 entries of 26.
        add_counters(&mut b, 0..23);
        assert!(!b.is_full(&size));
        // Another is the 26th.
        add_counters(&mut b, 23..24);
        assert!(b.is_full(&size));
        let sealed = b.seal().expect("not empty");
        let members = &(sealed.groups.iter())
            .find(|g| g.group == 0)
            .expect("group 0")
            .members;
        assert_eq!(members.len(), 8, "eight memberships");
        assert!(members.iter().any(|m| m.actor == "u1" && !m.like));
    }

    #[test]
    fn one_groups_likes_fill_the_batch_at_its_share_of_the_weight() {
        // 3 entries of 32 memberships: 96 memberships in all, at most 96 / 24 = 4 in one group.
        let size = Size {
            max_events: 1_000,
            max_counters: 3,
            memberships_per_entry: 32,
            max_group_entries: usize::MAX,
        };
        let mut b = Batch::default();
        for actor in 0..3 {
            b.add_member(0, "viral", &format!("u{actor}"), true, actor);
            b.add_member(1, "other", &format!("u{actor}"), true, 100 + actor);
        }
        assert!(!b.is_full(&size), "3 in each of two groups");
        // The same actor again is no new membership.
        b.add_member(0, "viral", "u2", false, 200);
        assert!(!b.is_full(&size));
        b.add_member(0, "viral", "u3", true, 201);
        assert!(b.is_full(&size), "4 in one group");
        let sealed = b.seal().expect("not empty");
        assert!(!b.is_full(&size), "an empty batch holds none");
        assert_eq!(sealed.writes(), 7);
    }

    #[test]
    fn a_sink_that_writes_memberships_for_less_weighs_them_less() {
        // 50 entries (and more than 16 memberships in one group at either weight).
        let size = |memberships_per_entry| Size {
            max_events: 1_000,
            max_counters: 50,
            memberships_per_entry,
            max_group_entries: usize::MAX,
        };
        let mut b = Batch::default();
        // One counter with 16 likers: 1 + 16 / 8 = 3 entries, or 1 + 16 / 16 = 2.
        for actor in 0..16 {
            b.add_member(0, "a", &format!("u{actor}"), true, actor);
        }
        add_counters(&mut b, 0..47);
        assert!(b.is_full(&size(MEMBERSHIPS_PER_ENTRY)));
        assert!(!b.is_full(&size(16)));
        add_counters(&mut b, 47..48);
        assert!(b.is_full(&size(16)));
    }

    #[test]
    fn due_at_the_partitions_next_flush_time_at_most_one_interval_after_the_oldest_message() {
        let interval = Duration::from_millis(100);
        let limits = Limits {
            flush_interval: interval,
            ..limits()
        };
        let start = Instant::now();
        let clock = FlushClock::new(interval, 3, start, SystemTime::now());
        let mut b = Batch::default();
        assert!(
            !b.is_due(&limits, Pace::Live, &clock, start + Duration::from_secs(10)),
            "empty is never due"
        );
        b.add(0, "a", 1, 0);
        let added = b.started.expect("started");
        let due_at = (0..=100u64)
            .map(|ms| added + Duration::from_millis(ms))
            .find(|&t| b.is_due(&limits, Pace::Live, &clock, t))
            .expect("due within the interval");
        assert!(due_at > added, "not due the moment it starts");
        assert!(due_at - added <= interval);
        // The next flush time is one interval later, whenever the next batch starts.
        assert!(clock.passed(due_at - Duration::from_millis(1), due_at));
        assert!(clock.passed(due_at, due_at + interval));
        assert!(!clock.passed(due_at, due_at + interval - Duration::from_millis(1)));
    }

    #[test]
    fn a_catching_up_batch_waits_past_the_clock_for_its_size_or_the_catch_up_interval() {
        let interval = Duration::from_millis(100);
        let limits = Limits {
            flush_interval: interval,
            catch_up_interval: Duration::from_secs(5),
            ..limits()
        };
        let start = Instant::now();
        let clock = FlushClock::new(interval, 0, start, SystemTime::now());
        let mut b = Batch::default();
        for offset in 0..6 {
            b.add(0, "a", 1, offset);
        }
        let added = b.started.expect("started");
        let later = added + Duration::from_secs(1);
        // Full at the live size (6 events >= 5), not at the catch-up size.
        assert!(b.is_due(&limits, Pace::Live, &clock, added));
        assert!(!b.is_due(&limits, Pace::CatchingUp, &clock, later));
        assert!(b.is_due(
            &limits,
            Pace::CatchingUp,
            &clock,
            added + Duration::from_secs(5)
        ));
        for offset in 6..50 {
            b.add(0, "a", 1, offset);
        }
        assert!(b.is_due(&limits, Pace::CatchingUp, &clock, later));
        // The partition stops fetching behind a flush in flight at twice the live size, but at
        // the catch-up size itself while catching up.
        assert!(b.is_full(&limits.pause_size(Pace::Live)));
        assert!(b.is_full(&limits.pause_size(Pace::CatchingUp)));
        let mut small = Batch::default();
        for offset in 0..9 {
            small.add(0, "a", 1, offset);
        }
        assert!(!small.is_full(&limits.pause_size(Pace::Live)), "9 < 2 x 5");
        assert_eq!(limits.pause_size(Pace::CatchingUp), limits.catch_up);
    }

    #[test]
    fn dead_letters_move_the_offset_and_count_as_events() {
        let mut b = Batch::default();
        b.add_dead_letter(
            DeadLetter::for_test(tally_common::DeadLetterReason::Undecodable),
            7,
        );
        let sealed = b.seal().expect("not empty");
        assert!(sealed.groups.is_empty());
        assert_eq!(sealed.dead_letters.len(), 1);
        assert_eq!(sealed.next_offset, 8);
    }
}

//! A batch's likes and unlikes for one shard group: the last action per (counter, actor) while
//! the batch grows ([`LikeTable`]), and each counter's run once it is sealed ([`Likes`]), as
//! `scripts/flush.lua` takes them: per counter, one `SADD` of its likers, one `SREM` of its
//! unlikers and one `INCRBY` by what they changed.
//!
//! Every name is kept once, in one text buffer, and the tables hold places in it: a membership
//! allocates nothing of its own, the table of memberships is one table however many counters
//! there are, and a flushed batch frees a few buffers rather than a string per membership. With
//! a map of counters to maps of actors (an owned string each), adding the likes, sealing them
//! and dropping them took ~40% of the aggregator's CPU on a catch-up of likes (perf, dwarf call
//! graphs: per-counter maps growing by rehash, a string per actor made and freed twice).

use std::hash::BuildHasher;
use std::ops::Range;

/// foldhash, seeded at random per table, as the batch's other maps (`super::batch`).
type Hasher = foldhash::fast::RandomState;

/// No slot: the end of a counter's list.
const NONE: u32 = u32::MAX;

/// Where a name is in the text buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    start: usize,
    end: usize,
}

impl Span {
    fn range(self) -> Range<usize> {
        self.start..self.end
    }
}

/// Appends `name` to `text` and returns where it is.
fn push(text: &mut String, name: &str) -> Span {
    let start = text.len();
    text.push_str(name);
    Span {
        start,
        end: text.len(),
    }
}

/// An index from hashes to places (in a table's counters or slots): open addressing with
/// linear probing over one array of entries, each the hash's top 32 bits above the place plus
/// one (0: empty). A probe reads entries only, several to a cache line, and compares hashes
/// without reading the key; growing rehashes from the entries alone. hashbrown's table kept its
/// tags and its entries apart, a cache miss each in tables of hundreds of thousands of
/// memberships (the bench's 5,000,000 likes caught up one at a time, 11 alternated rounds: the
/// consume thread 2.03 against 2.12 CPU s and 1.05 x the rate, medians).
#[derive(Debug, Default)]
struct Index {
    entries: Vec<u64>,
    len: usize,
}

/// Most entries per slot of an [`Index`] before it doubles: three quarters.
const INDEX_LOAD: (usize, usize) = (3, 4);

impl Index {
    /// Where `top` (a hash's top 32 bits) starts probing in `slots` (a power of two) entries.
    fn start(top: u64, slots: usize) -> usize {
        ((u128::from(top) * slots as u128) >> 32) as usize
    }

    /// The place of the first entry with `hash` for which `is` holds.
    fn find(&self, hash: u64, mut is: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.entries.is_empty() {
            return None;
        }
        let (top, mask) = (hash >> 32, self.entries.len() - 1);
        let mut i = Self::start(top, self.entries.len());
        loop {
            let e = self.entries[i];
            if e == 0 {
                return None;
            }
            if e >> 32 == top && is(place(e)) {
                return Some(place(e));
            }
            i = (i + 1) & mask;
        }
    }

    /// Adds `place` under `hash` (not there yet).
    fn insert(&mut self, hash: u64, place: u32) {
        let slots = self.entries.len();
        if (self.len + 1) * INDEX_LOAD.1 > slots * INDEX_LOAD.0 {
            let old = std::mem::replace(&mut self.entries, vec![0; (slots * 2).max(16)]);
            for e in old.into_iter().filter(|&e| e != 0) {
                self.put(e);
            }
        }
        self.put((hash & !u64::from(u32::MAX)) | (u64::from(place) + 1));
        self.len += 1;
    }

    fn put(&mut self, e: u64) {
        let mask = self.entries.len() - 1;
        let mut i = Self::start(e >> 32, self.entries.len());
        while self.entries[i] != 0 {
            i = (i + 1) & mask;
        }
        self.entries[i] = e;
    }
}

/// The place an [`Index`] entry holds.
fn place(entry: u64) -> u32 {
    ((entry & u64::from(u32::MAX)) - 1) as u32
}

/// A counter in the table.
#[derive(Debug)]
struct CounterSlot {
    name: Span,
    /// Its first membership (the latest added), linked through [`Slot::next`].
    head: u32,
    /// Bumped when the counter's likes are removed (a reset, an expiry record): slots of an
    /// older generation are no longer its memberships, and are taken again if their actor
    /// comes back.
    generation: u32,
}

/// Actor ids up to this long are kept in their slot as well as in the text, so that finding a
/// membership compares its actor without reading the text.
const INLINE: usize = 12;

/// A (counter, actor) in the table, and the actor's last action.
#[derive(Debug)]
struct Slot {
    /// The actor's first [`INLINE`] bytes (all of them, zero-padded, if it is that short).
    inline: [u8; INLINE],
    /// The actor's length.
    len: u32,
    /// Where the actor starts in the text.
    start: usize,
    counter: u32,
    generation: u32,
    like: bool,
    /// The counter's next membership.
    next: u32,
}

impl Slot {
    /// Whether this is (`counter`, `actor`), the table's text being `text`.
    fn is(&self, text: &str, counter: u32, actor: &str) -> bool {
        let (len, bytes) = (actor.len(), actor.as_bytes());
        self.counter == counter
            && self.len as usize == len
            && if len <= INLINE {
                self.inline[..len] == *bytes
            } else {
                self.inline[..] == bytes[..INLINE] && &text[self.actor().range()] == actor
            }
    }

    /// Where the actor is in the text.
    fn actor(&self) -> Span {
        Span {
            start: self.start,
            end: self.start + self.len as usize,
        }
    }
}

/// What [`LikeTable::set`] added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Added {
    /// The counter had no likes in the table: its run is new.
    pub run: bool,
    /// The (counter, actor) had no action in the table.
    pub membership: bool,
}

/// The last like or unlike per (counter, actor) of one group in a growing batch.
#[derive(Debug, Default)]
pub struct LikeTable {
    text: String,
    counters: Vec<CounterSlot>,
    counter_index: Index,
    slots: Vec<Slot>,
    slot_index: Index,
    hasher: Hasher,
}

/// A slot's or counter's index, within what a table may hold.
fn index(len: usize) -> u32 {
    u32::try_from(len)
        .ok()
        .filter(|&i| i != NONE)
        .expect("a batch holds fewer than 2^32 - 1 memberships")
}

impl LikeTable {
    /// The counter's index, if the table has it.
    fn find_counter(&self, counter: &str) -> Option<u32> {
        self.find_counter_hashed(counter, self.hasher.hash_one(counter))
    }

    /// [`LikeTable::find_counter`], its hash already taken.
    fn find_counter_hashed(&self, counter: &str, hash: u64) -> Option<u32> {
        let (text, counters) = (&self.text, &self.counters);
        (self.counter_index).find(hash, |c| {
            &text[counters[c as usize].name.range()] == counter
        })
    }

    /// The counter's index, added if new.
    fn counter(&mut self, counter: &str) -> u32 {
        let hash = self.hasher.hash_one(counter);
        if let Some(c) = self.find_counter_hashed(counter, hash) {
            return c;
        }
        let c = index(self.counters.len());
        let name = push(&mut self.text, counter);
        self.counters.push(CounterSlot {
            name,
            head: NONE,
            generation: 0,
        });
        self.counter_index.insert(hash, c);
        c
    }

    /// The slot of (`c`, `actor`), of any generation, if the table has one.
    fn find_slot(&self, c: u32, actor: &str, hash: u64) -> Option<u32> {
        let (text, slots) = (&self.text, &self.slots);
        (self.slot_index).find(hash, |i| slots[i as usize].is(text, c, actor))
    }

    /// Records that `actor` likes `counter` (`like`) or unlikes it, replacing the actor's
    /// earlier action on it.
    pub fn set(&mut self, counter: &str, actor: &str, like: bool) -> Added {
        let c = self.counter(counter);
        let hash = self.hasher.hash_one((c, actor));
        let found = self.find_slot(c, actor, hash);
        let owner = &mut self.counters[c as usize];
        let run = owner.head == NONE;
        let i = match found {
            Some(i) => {
                let slot = &mut self.slots[i as usize];
                slot.like = like;
                if slot.generation == owner.generation {
                    return Added {
                        run: false,
                        membership: false,
                    };
                }
                // Removed with its counter's likes, and back: a membership again.
                slot.generation = owner.generation;
                slot.next = owner.head;
                i
            }
            None => {
                let i = index(self.slots.len());
                let mut inline = [0; INLINE];
                let head = &actor.as_bytes()[..actor.len().min(INLINE)];
                inline[..head.len()].copy_from_slice(head);
                let Span { start, end } = push(&mut self.text, actor);
                self.slots.push(Slot {
                    inline,
                    len: u32::try_from(end - start).expect("an actor id is shorter than 4 GiB"),
                    start,
                    counter: c,
                    generation: owner.generation,
                    like,
                    next: owner.head,
                });
                self.slot_index.insert(hash, i);
                i
            }
        };
        owner.head = i;
        Added {
            run,
            membership: true,
        }
    }

    /// Whether the table holds an action of `actor` on `counter`.
    pub fn contains(&self, counter: &str, actor: &str) -> bool {
        let Some(c) = self.find_counter(counter) else {
            return false;
        };
        let hash = self.hasher.hash_one((c, actor));
        (self.find_slot(c, actor, hash)).is_some_and(|i| {
            self.slots[i as usize].generation == self.counters[c as usize].generation
        })
    }

    /// How many (counter, actor) pairs the table has held: its memberships, and those a reset
    /// or an expiry took out until their actor comes back (so at least as many as it holds).
    pub fn held(&self) -> usize {
        self.slots.len()
    }

    /// Takes out `counter`'s likes and unlikes: `(actor, like)`, latest first.
    pub fn remove(&mut self, counter: &str) -> Vec<(String, bool)> {
        let Some(c) = self.find_counter(counter) else {
            return Vec::new();
        };
        let owner = &mut self.counters[c as usize];
        let mut i = std::mem::replace(&mut owner.head, NONE);
        owner.generation = owner.generation.wrapping_add(1);
        let mut removed = Vec::new();
        while i != NONE {
            let slot = &self.slots[i as usize];
            removed.push((self.text[slot.actor().range()].to_owned(), slot.like));
            i = slot.next;
        }
        removed
    }

    /// The counters' runs, in the order the counters came.
    pub fn seal(self) -> Likes {
        let mut members = Vec::with_capacity(self.slots.len());
        let mut runs = Vec::new();
        let mut unlikes = Vec::new();
        for counter in &self.counters {
            let start = members.len();
            let mut i = counter.head;
            while i != NONE {
                let slot = &self.slots[i as usize];
                if slot.like {
                    members.push(slot.actor());
                } else {
                    unlikes.push(slot.actor());
                }
                i = slot.next;
            }
            let likes = members.len() - start;
            members.append(&mut unlikes);
            if members.len() > start {
                runs.push(Run {
                    counter: counter.name,
                    end: members.len(),
                    likes,
                });
            }
        }
        Likes {
            text: self.text,
            runs,
            members,
        }
    }
}

/// One counter's memberships in [`Likes`].
#[derive(Debug, Clone, Copy)]
struct Run {
    counter: Span,
    /// Where its memberships end.
    end: usize,
    /// How many of them, from its start, are likes; the rest are unlikes.
    likes: usize,
}

/// One group's likes and unlikes in a sealed batch, one per (counter, actor), in runs: each
/// counter's likes, then its unlikes, then the next counter's. Memberships are numbered in that
/// order (`crate::machine::write::Refused::Member`).
#[derive(Debug, Clone, Default)]
pub struct Likes {
    text: String,
    runs: Vec<Run>,
    members: Vec<Span>,
}

/// One like or unlike in [`Likes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Like<'a> {
    /// The counter.
    pub counter: &'a str,
    /// Who.
    pub actor: &'a str,
    /// Like (true) or unlike (false).
    pub like: bool,
}

/// One counter's run in [`Likes`]: its memberships' numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LikeRun<'a> {
    /// The counter.
    pub counter: &'a str,
    /// Its likes.
    pub likes: Range<usize>,
    /// Its unlikes, right after its likes.
    pub unlikes: Range<usize>,
}

impl LikeRun<'_> {
    /// All its memberships: its likes, then its unlikes.
    pub fn members(&self) -> Range<usize> {
        self.likes.start..self.unlikes.end
    }
}

impl Likes {
    /// No like nor unlike.
    pub const NONE: &'static Self = &Self {
        text: String::new(),
        runs: Vec::new(),
        members: Vec::new(),
    };

    /// The last action per (counter, actor) of `actions`, in runs.
    pub fn from_actions<'a>(actions: impl IntoIterator<Item = (&'a str, &'a str, bool)>) -> Self {
        let mut table = LikeTable::default();
        for (counter, actor, like) in actions {
            table.set(counter, actor, like);
        }
        table.seal()
    }

    /// These likes, with those of `more` whose (counter, actor) they do not have.
    pub fn with_absent<'a>(self, more: impl IntoIterator<Item = (&'a str, &'a str, bool)>) -> Self {
        let mut table = LikeTable::default();
        for like in self.iter() {
            table.set(like.counter, like.actor, like.like);
        }
        for (counter, actor, like) in more {
            if !table.contains(counter, actor) {
                table.set(counter, actor, like);
            }
        }
        table.seal()
    }

    /// How many memberships.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// How many runs (counters).
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Run `k`.
    pub fn run(&self, k: usize) -> LikeRun<'_> {
        let run = self.runs[k];
        let start = k.checked_sub(1).map_or(0, |j| self.runs[j].end);
        LikeRun {
            counter: &self.text[run.counter.range()],
            likes: start..start + run.likes,
            unlikes: start + run.likes..run.end,
        }
    }

    /// Every run, in order.
    pub fn each_run(&self) -> impl ExactSizeIterator<Item = LikeRun<'_>> {
        (0..self.runs.len()).map(|k| self.run(k))
    }

    /// Membership `i`'s actor.
    pub fn actor(&self, i: usize) -> &str {
        &self.text[self.members[i].range()]
    }

    /// The bytes of the actors of memberships `members`, from their places alone (the text is
    /// not read): what a command of them takes.
    pub fn actors_len(&self, members: Range<usize>) -> usize {
        self.members[members].iter().map(|m| m.end - m.start).sum()
    }

    /// Membership `i`.
    pub fn get(&self, i: usize) -> Like<'_> {
        let k = self.runs.partition_point(|r| r.end <= i);
        let run = self.run(k);
        Like {
            counter: run.counter,
            actor: self.actor(i),
            like: run.likes.contains(&i),
        }
    }

    /// Every membership, in order.
    pub fn iter(&self) -> impl Iterator<Item = Like<'_>> {
        self.each_run().flat_map(move |run| {
            (run.members()).map(move |i| Like {
                counter: run.counter,
                actor: self.actor(i),
                like: i < run.likes.end,
            })
        })
    }

    /// Takes out the memberships numbered in `refused` (the others keep their order, and are
    /// numbered again from 0).
    pub fn remove(&mut self, refused: &[usize]) {
        if refused.is_empty() {
            return;
        }
        let mut gone = vec![false; self.members.len()];
        for &i in refused {
            gone[i] = true;
        }
        let mut members = Vec::with_capacity(self.members.len());
        let mut runs = Vec::with_capacity(self.runs.len());
        for k in 0..self.runs.len() {
            let run = self.run(k);
            let start = members.len();
            members.extend(
                (run.likes.clone())
                    .filter(|&i| !gone[i])
                    .map(|i| self.members[i]),
            );
            let likes = members.len() - start;
            members.extend((run.unlikes).filter(|&i| !gone[i]).map(|i| self.members[i]));
            if members.len() > start {
                runs.push(Run {
                    counter: self.runs[k].counter,
                    end: members.len(),
                    likes,
                });
            }
        }
        self.members = members;
        self.runs = runs;
    }
}

/// Equal when they hold the same memberships in the same order.
impl PartialEq for Likes {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for Likes {}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(likes: &Likes) -> Vec<(String, String, bool)> {
        let mut all: Vec<_> = (likes.iter())
            .map(|l| (l.counter.to_owned(), l.actor.to_owned(), l.like))
            .collect();
        all.sort();
        all
    }

    fn owned(list: &[(&str, &str, bool)]) -> Vec<(String, String, bool)> {
        list.iter()
            .map(|&(c, a, l)| (c.to_owned(), a.to_owned(), l))
            .collect()
    }

    #[test]
    fn keeps_the_last_action_and_says_what_is_new() {
        let mut table = LikeTable::default();
        let new = |run, membership| Added { run, membership };
        assert_eq!(table.set("p1", "u1", true), new(true, true));
        assert_eq!(table.set("p1", "u1", false), new(false, false));
        assert_eq!(table.set("p1", "u2", true), new(false, true));
        assert_eq!(table.set("p2", "u1", true), new(true, true));
        assert!(table.contains("p1", "u2") && !table.contains("p2", "u2"));
        let likes = table.seal();
        assert_eq!(
            sorted(&likes),
            owned(&[("p1", "u1", false), ("p1", "u2", true), ("p2", "u1", true)])
        );
        assert_eq!(likes.runs(), 2);
    }

    #[test]
    fn a_run_lists_its_likes_then_its_unlikes() {
        let likes = Likes::from_actions([
            ("p1", "u1", false),
            ("p2", "u9", true),
            ("p1", "u2", true),
            ("p1", "u3", false),
            ("p1", "u4", true),
        ]);
        let run = likes.run(0);
        assert_eq!(run.counter, "p1");
        assert_eq!((run.likes.len(), run.unlikes.len()), (2, 2));
        assert!(run.likes.clone().all(|i| likes.get(i).like));
        assert!(run.unlikes.clone().all(|i| !likes.get(i).like));
        assert_eq!(likes.run(1).members(), 4..5);
        let listed: Vec<Like> = (0..likes.len()).map(|i| likes.get(i)).collect();
        assert_eq!(listed, likes.iter().collect::<Vec<_>>());
        // What a command of a run's actors takes, from their places: u2 and u4, then u1 and u3.
        assert_eq!(likes.actors_len(run.likes.clone()), 4);
        assert_eq!(likes.actors_len(run.members()), 8);
        assert_eq!(likes.actors_len(4..5), "u9".len());
    }

    #[test]
    fn removing_a_counter_takes_its_likes_and_an_actor_can_come_back() {
        let mut table = LikeTable::default();
        table.set("p1", "u1", true);
        table.set("p1", "u2", false);
        table.set("p2", "u1", true);
        let mut removed = table.remove("p1");
        removed.sort();
        assert_eq!(
            removed,
            vec![("u1".to_owned(), true), ("u2".to_owned(), false)]
        );
        assert!(table.remove("p1").is_empty() && table.remove("p3").is_empty());
        assert!(!table.contains("p1", "u1"));
        let back = table.set("p1", "u2", true);
        assert_eq!(
            back,
            Added {
                run: true,
                membership: true
            }
        );
        assert_eq!(
            sorted(&table.seal()),
            owned(&[("p1", "u2", true), ("p2", "u1", true)])
        );
        let mut emptied = LikeTable::default();
        emptied.set("p1", "u1", true);
        emptied.remove("p1");
        assert!(emptied.seal().is_empty());
    }

    #[test]
    fn removing_memberships_keeps_the_runs() {
        let mut likes = Likes::from_actions([
            ("p1", "u1", true),
            ("p1", "u2", false),
            ("p2", "u3", true),
            ("p3", "u4", true),
        ]);
        let p2 = likes.run(1).members().start;
        let u2 = likes.run(0).unlikes.start;
        likes.remove(&[p2, u2]);
        assert_eq!(likes.runs(), 2);
        assert_eq!(
            likes.iter().collect::<Vec<_>>(),
            vec![
                Like {
                    counter: "p1",
                    actor: "u1",
                    like: true
                },
                Like {
                    counter: "p3",
                    actor: "u4",
                    like: true
                },
            ]
        );
    }

    #[test]
    fn with_absent_adds_only_what_is_not_there() {
        let likes = Likes::from_actions([("p1", "u1", false)]);
        let merged =
            likes.with_absent([("p1", "u1", true), ("p1", "u2", true), ("p2", "u1", false)]);
        assert_eq!(
            sorted(&merged),
            owned(&[("p1", "u1", false), ("p1", "u2", true), ("p2", "u1", false)])
        );
    }

    #[test]
    fn actors_are_told_apart_at_every_length_around_the_inline_bytes() {
        // Ids that share their first bytes, their length, or both, on both sides of INLINE.
        let mut actors = Vec::new();
        for len in [1, INLINE - 1, INLINE, INLINE + 1, 40] {
            for tail in ['a', 'b'] {
                let mut id = "x".repeat(len - 1);
                id.push(tail);
                actors.push(id);
            }
        }
        actors.push("x".repeat(INLINE - 1) + "\u{e9}");
        let mut table = LikeTable::default();
        for (i, actor) in actors.iter().enumerate() {
            assert!(table.set("p1", actor, i % 2 == 0).membership, "{actor}");
            assert!(table.set("p2", actor, true).membership, "{actor}");
        }
        for actor in &actors {
            assert!(!table.set("p1", actor, true).membership, "{actor}");
            assert!(table.contains("p2", actor), "{actor}");
        }
        assert!(!table.contains("p1", &"x".repeat(INLINE + 2)));
        let likes = table.seal();
        assert_eq!((likes.len(), likes.runs()), (2 * actors.len(), 2));
        let mut listed: Vec<&str> = (likes.run(0).members()).map(|i| likes.actor(i)).collect();
        listed.sort_unstable();
        let mut expected: Vec<&str> = actors.iter().map(String::as_str).collect();
        expected.sort_unstable();
        assert_eq!(listed, expected);
    }

    #[test]
    fn an_index_finds_every_place_among_equal_hashes_as_it_grows() {
        let mut index = Index::default();
        assert_eq!(index.find(7, |_| true), None);
        // Places under a few hashes (many sharing their top 32 bits), across several doublings;
        // the largest place an index may hold.
        let hash = |i: u32| u64::from(i % 7) << 40 | u64::from(i);
        let places: Vec<u32> = (0..1000).chain([NONE - 1]).collect();
        for &p in &places {
            index.insert(hash(p), p);
        }
        for &p in &places {
            assert_eq!(index.find(hash(p), |q| q == p), Some(p));
        }
        assert_eq!(
            index.find(hash(5), |q| q == 6),
            None,
            "6 is under another hash"
        );
        assert_eq!(index.find(u64::MAX, |_| true), None);
        assert_eq!(index.len, places.len());
        assert!(index.len * 4 <= index.entries.len() * 3);
    }

    #[test]
    fn many_memberships_grow_the_tables() {
        let mut table = LikeTable::default();
        for i in 0..10_000 {
            let added = table.set(&format!("p{}", i % 100), &format!("u{i}"), i % 3 != 0);
            assert!(added.membership);
        }
        for i in 0..10_000 {
            assert!(
                !table
                    .set(&format!("p{}", i % 100), &format!("u{i}"), true)
                    .membership
            );
        }
        let likes = table.seal();
        assert_eq!((likes.len(), likes.runs()), (10_000, 100));
        assert!(likes.iter().all(|l| l.like));
    }
}

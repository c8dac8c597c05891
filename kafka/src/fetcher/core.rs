//! The fetcher's decisions, with no I/O (in the manner of quinn-proto): which partitions each
//! broker is asked about next and with what (where a log starts or ends, whether a position
//! survived a leader change, records), and what each answer does to the positions, the
//! leaders, the backoffs and throttles, and what the owner is told. The tokio driver in
//! `super` only carries requests and answers and sleeps when told to, so every decision here
//! is unit-tested with scripted broker answers.
//!
//! # Leader epochs (KIP-320)
//! Every fetch carries the partition's leader epoch from metadata, and (from Fetch v12) the
//! epoch of the last batch read. When metadata shows a partition's leader epoch moved since it
//! was last read from, its position is checked before the next fetch: `OffsetForLeaderEpoch`
//! asks the new leader where the last epoch read ends in its log. An end before the position
//! means the log was truncated under it (an unclean election): reading resumes at the end and
//! the owner is told ([`Fetched::Truncated`]). A v12 fetch whose answer says the log diverged
//! triggers the same check.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::backoff::Backoff;
use crate::config::{OffsetReset, Waits};
use crate::protocol::{EpochEnd, EpochQuery, ErrorCode, FetchPosition, LogEnd, Metadata};

use super::{CORRUPT_BACKOFF, Fetched, Start};

/// Where a partition is read from next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Position {
    /// This offset.
    At(i64),
    /// Where the log starts or ends, once the leader says; `from` is the offset found outside
    /// the log, when that is why (reported as [`Fetched::OutOfRange`] once found).
    Find { end: LogEnd, from: Option<i64> },
}

/// A partition the owner reads.
#[derive(Debug, Clone, Copy)]
struct Wanted {
    position: Position,
    /// Bumped by every seek.
    epoch: u64,
    /// Not fetched while paused.
    paused: bool,
    /// In a request now (its answer clears it).
    in_flight: bool,
    /// Not asked about before then: its last request failed.
    not_before: Option<Instant>,
    /// The leader epoch of the last batch read (-1: none).
    last_epoch: i32,
    /// The furthest offset read up to under what `last_epoch` knows.
    read_to: i64,
    /// The leader epoch the partition was last read under (-1: not read yet).
    read_under: i32,
    /// Leadership moved since it was read (or a fetch said the log diverged): the position is
    /// checked with `OffsetForLeaderEpoch` before the next fetch.
    validate: bool,
}

/// A partition's leader, as metadata last said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Leader {
    node: i32,
    epoch: i32,
}

/// A partition put in a request: its position and seek epoch then, so that an answer to a
/// request sent before a seek changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Claim {
    pub(super) partition: i32,
    /// The offset asked from (for a [`Step::ListOffsets`], the offset found outside the log,
    /// if that is why it is asked; else -1).
    pub(super) offset: i64,
    pub(super) epoch: u64,
    /// The partition's leader epoch the request was sent under.
    pub(super) leader_epoch: i32,
}

/// What a broker's task sends next.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// Nothing now: wait to be woken (a seek, a resume, new leaders, an answer), or until
    /// `wake` (a backoff or a throttle ends).
    Idle { wake: Option<Instant> },
    /// `ListOffsets`: where the logs of `claims` start or end.
    ListOffsets { end: LogEnd, claims: Vec<Claim> },
    /// `OffsetForLeaderEpoch`: whether the positions of `claims` are still in the leader's log.
    Validate {
        queries: Vec<EpochQuery>,
        claims: Vec<Claim>,
    },
    /// `Fetch` from `positions`.
    Fetch {
        positions: Vec<FetchPosition>,
        claims: Vec<Claim>,
    },
}

/// One partition's records, as the driver read them from a fetch answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Read {
    /// The offset after the last one read past.
    pub(super) next: i64,
    /// The leader epoch of the last batch read past.
    pub(super) last_epoch: Option<i32>,
    /// With `check.crcs`, why a batch did not match its CRC (reading stopped before it).
    pub(super) corrupt: Option<String>,
    /// From v12: the log diverged from the last fetched epoch.
    pub(super) diverging: bool,
}

/// One partition of a fetch answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Answer {
    pub(super) partition: i32,
    pub(super) error: ErrorCode,
    /// Its records, when `error` is none.
    pub(super) read: Option<Read>,
}

/// What an answer does beyond the positions: reports for the owner, and whether leaders
/// should be asked for again.
#[derive(Debug, Default)]
pub(super) struct Outcome {
    pub(super) reports: Vec<Fetched>,
    pub(super) stale: bool,
    /// For a whole fetch answered at once (the tests' [`Core::fetched`]): which answers'
    /// chunks to hand out, in order.
    #[cfg(test)]
    pub(super) deliver: Vec<bool>,
}

/// Every decision's state: the partitions wanted, the leaders and brokers, each broker's quiet
/// time (a throttle or a backoff after a failure).
#[derive(Debug)]
pub(super) struct Core {
    wanted: HashMap<i32, Wanted>,
    /// Partitions no longer read, as they were when removed (what was read of them).
    removed: HashMap<i32, Wanted>,
    leaders: HashMap<i32, Leader>,
    brokers: HashMap<i32, String>,
    /// Brokers with a task.
    running: HashSet<i32>,
    /// Brokers not sent anything before then (a throttle, a backoff), with their backoffs.
    quiet: HashMap<i32, Instant>,
    backoffs: HashMap<i32, Backoff>,
    /// The last seek epoch given out.
    seeks: u64,
    waits: Waits,
    offset_reset: OffsetReset,
}

impl Core {
    pub(super) fn new(waits: Waits, offset_reset: OffsetReset) -> Self {
        Self {
            wanted: HashMap::new(),
            removed: HashMap::new(),
            leaders: HashMap::new(),
            brokers: HashMap::new(),
            running: HashSet::new(),
            quiet: HashMap::new(),
            backoffs: HashMap::new(),
            seeks: 0,
            waits,
            offset_reset,
        }
    }

    /// Reads `partition` from `start`; returns the seek's epoch and whether its leader is
    /// unknown (metadata should be asked for).
    pub(super) fn seek(&mut self, partition: i32, start: Start, paused: bool) -> (u64, bool) {
        self.seeks += 1;
        let position = match start {
            Start::At(offset) => Position::At(offset.max(0)),
            Start::Earliest => Position::Find {
                end: LogEnd::Earliest,
                from: None,
            },
            Start::Latest => Position::Find {
                end: LogEnd::Latest,
                from: None,
            },
        };
        let in_flight = self.wanted.get(&partition).is_some_and(|w| w.in_flight);
        let before = self.wanted.get(&partition).or(self.removed.get(&partition));
        // A seek back to (or at) where reading had got keeps the last epoch read: the record
        // before the new position was read under it or an older one. Sent with the next fetch
        // (v12), it has the leader check the position against its log: an owner re-reading
        // from its store's ledger (after a rebalance, or a truncation it has not moved back
        // yet) may ask for offsets the log no longer holds, and the answer's diverging epoch
        // then has the position checked with `OffsetForLeaderEpoch`. Not checked up front: a
        // paused partition seeks back to where it read at every pause. A seek anywhere else
        // knows no epoch.
        let (last_epoch, read_to, read_under, validate) = match (before, position) {
            (Some(w), Position::At(to)) if w.last_epoch >= 0 && to <= w.read_to => {
                (w.last_epoch, w.read_to, w.read_under, w.validate)
            }
            _ => (-1, -1, -1, false),
        };
        self.removed.remove(&partition);
        self.wanted.insert(
            partition,
            Wanted {
                position,
                epoch: self.seeks,
                paused,
                in_flight,
                not_before: None,
                last_epoch,
                read_to,
                read_under,
                validate,
            },
        );
        (self.seeks, !self.leaders.contains_key(&partition))
    }

    pub(super) fn pause(&mut self, partition: i32, paused: bool) {
        if let Some(w) = self.wanted.get_mut(&partition) {
            w.paused = paused;
        }
    }

    /// Stops reading `partition`; what was read of it is remembered for a later seek (a
    /// partition revoked and assigned back is re-read from its owner's store).
    pub(super) fn remove(&mut self, partition: i32) {
        if let Some(w) = self.wanted.remove(&partition) {
            self.removed.insert(partition, w);
        }
    }

    /// The address of broker `node`, as metadata last said.
    pub(super) fn address(&self, node: i32) -> Option<String> {
        self.brokers.get(&node).cloned()
    }

    /// Every broker's address metadata named, for asking metadata again.
    pub(super) fn addresses(&self) -> Vec<String> {
        self.brokers.values().cloned().collect()
    }

    /// New metadata: the brokers and leaders it names. Returns the brokers that need a task
    /// (each is returned once), and whether a wanted partition still has no leader.
    pub(super) fn metadata(&mut self, metadata: &Metadata) -> (Vec<i32>, bool) {
        self.brokers = (metadata.brokers.iter())
            .map(|b| (b.node_id, format!("{}:{}", b.host, b.port)))
            .collect();
        self.leaders = (metadata.partitions.iter())
            .filter(|p| p.leader >= 0 && !p.error.is_error())
            .map(|p| {
                let leader = Leader {
                    node: p.leader,
                    epoch: p.leader_epoch,
                };
                (p.partition, leader)
            })
            .collect();
        for (partition, w) in &mut self.wanted {
            let Some(leader) = self.leaders.get(partition) else {
                continue;
            };
            // Read under another leader epoch: the new leader's log may not hold it all.
            if w.last_epoch >= 0 && w.read_under >= 0 && leader.epoch != w.read_under {
                w.validate = true;
            }
        }
        let mut start: Vec<i32> = (self.leaders.values())
            .map(|l| l.node)
            .filter(|node| self.running.insert(*node))
            .collect();
        start.sort_unstable();
        start.dedup();
        let missing = (self.wanted.keys()).any(|p| !self.leaders.contains_key(p));
        (start, missing)
    }

    /// What broker `node` is sent next.
    pub(super) fn next(&mut self, node: i32, now: Instant) -> Step {
        if let Some(&until) = self.quiet.get(&node) {
            if until > now {
                return Step::Idle { wake: Some(until) };
            }
            self.quiet.remove(&node);
        }
        let mut wake: Option<Instant> = None;
        let mut ready: Vec<i32> = Vec::new();
        for (p, w) in &self.wanted {
            if w.paused || w.in_flight || self.leaders.get(p).is_none_or(|l| l.node != node) {
                continue;
            }
            match w.not_before {
                Some(t) if t > now => wake = Some(wake.map_or(t, |first| first.min(t))),
                _ => ready.push(*p),
            }
        }
        if ready.is_empty() {
            return Step::Idle { wake };
        }
        ready.sort_unstable();
        // Positions to find first, then positions to check, then records.
        let find = (ready.iter()).find_map(|p| match self.wanted[p].position {
            Position::Find { end, .. } => Some(end),
            Position::At(_) => None,
        });
        if let Some(end) = find {
            let claims = self.claim(&ready, |w| match w.position {
                Position::Find { end: e, from } if e == end => Some(from.unwrap_or(-1)),
                _ => None,
            });
            return Step::ListOffsets { end, claims };
        }
        if ready.iter().any(|p| self.wanted[p].validate) {
            let claims = self.claim(&ready, |w| match w.position {
                Position::At(offset) if w.validate => Some(offset),
                _ => None,
            });
            let queries = (claims.iter())
                .map(|c| EpochQuery {
                    partition: c.partition,
                    current_leader_epoch: c.leader_epoch,
                    leader_epoch: self.wanted[&c.partition].last_epoch,
                })
                .collect();
            return Step::Validate { queries, claims };
        }
        let claims = self.claim(&ready, |w| match w.position {
            Position::At(offset) => Some(offset),
            Position::Find { .. } => None,
        });
        let positions = (claims.iter())
            .map(|c| FetchPosition {
                partition: c.partition,
                offset: c.offset,
                current_leader_epoch: c.leader_epoch,
                last_fetched_epoch: self.wanted[&c.partition].last_epoch,
            })
            .collect();
        Step::Fetch { positions, claims }
    }

    /// Marks in flight the partitions of `ready` that `pick` gives an offset for.
    fn claim(&mut self, ready: &[i32], pick: impl Fn(&Wanted) -> Option<i64>) -> Vec<Claim> {
        let mut claims = Vec::new();
        for p in ready {
            let w = self.wanted.get_mut(p).expect("ready partitions are wanted");
            if let Some(offset) = pick(w) {
                w.in_flight = true;
                claims.push(Claim {
                    partition: *p,
                    offset,
                    epoch: w.epoch,
                    leader_epoch: self.leaders.get(p).map_or(-1, |l| l.epoch),
                });
            }
        }
        claims
    }

    /// The partition of `claim`, if no seek came since it was claimed.
    fn current(&mut self, claim: &Claim) -> Option<&mut Wanted> {
        self.wanted
            .get_mut(&claim.partition)
            .filter(|w| w.epoch == claim.epoch)
    }

    /// Clears the in-flight marks of `claims`; the broker answered, so its backoff restarts.
    fn release(&mut self, node: i32, claims: &[Claim]) {
        for c in claims {
            if let Some(w) = self.wanted.get_mut(&c.partition) {
                w.in_flight = false;
            }
        }
        if let Some(b) = self.backoffs.get_mut(&node) {
            b.reset();
        }
    }

    /// A request to `node` got no answer (no connection, a timeout, a malformed response):
    /// its partitions are released, the broker is left alone for a backoff, and leaders are
    /// asked for again.
    pub(super) fn failed(&mut self, node: i32, claims: &[Claim], now: Instant) -> Outcome {
        for c in claims {
            if let Some(w) = self.wanted.get_mut(&c.partition) {
                w.in_flight = false;
            }
        }
        let waits = self.waits;
        let backoff = (self.backoffs.entry(node))
            .or_insert_with(|| Backoff::new(waits.reconnect, waits.reconnect_max));
        self.quiet.insert(node, now + backoff.next_delay());
        Outcome {
            stale: true,
            ..Outcome::default()
        }
    }

    /// A partition's request failed for a reason of its own: asked about again after
    /// `fetch.error.backoff.ms`; a stale leadership drops its leader.
    fn partition_error(&mut self, partition: i32, error: ErrorCode, now: Instant) -> bool {
        if let Some(w) = self.wanted.get_mut(&partition) {
            w.not_before = Some(now + self.waits.fetch_error);
        }
        if error.is_stale_leadership() {
            self.leaders.remove(&partition);
            return true;
        }
        false
    }

    /// Where the logs of `claims` start or end (`ListOffsets` answered).
    pub(super) fn listed(
        &mut self,
        node: i32,
        claims: &[Claim],
        found: &[(i32, ErrorCode, i64)],
        now: Instant,
    ) -> Outcome {
        self.release(node, claims);
        let mut outcome = Outcome::default();
        for claim in claims {
            let Some(&(_, error, at)) = found.iter().find(|(p, _, _)| *p == claim.partition) else {
                continue;
            };
            if error.is_error() {
                outcome.stale |= self.partition_error(claim.partition, error, now);
                continue;
            }
            let Some(w) = self.current(claim) else {
                continue;
            };
            let Position::Find { from, .. } = w.position else {
                continue;
            };
            w.position = Position::At(at);
            if let Some(from) = from {
                outcome.reports.push(Fetched::OutOfRange {
                    partition: claim.partition,
                    epoch: claim.epoch,
                    from,
                    to: Some(at),
                });
            }
        }
        outcome
    }

    /// Where the epochs asked about end in the leader's log (`OffsetForLeaderEpoch`
    /// answered): a position past that end was truncated away, and reading resumes there.
    pub(super) fn validated(
        &mut self,
        node: i32,
        claims: &[Claim],
        ends: &[EpochEnd],
        now: Instant,
    ) -> Outcome {
        self.release(node, claims);
        let mut outcome = Outcome::default();
        let reset = self.reset_end();
        for claim in claims {
            let Some(end) = ends.iter().find(|e| e.partition == claim.partition) else {
                continue;
            };
            if end.error.is_error() {
                outcome.stale |= self.partition_error(claim.partition, end.error, now);
                continue;
            }
            let Some(w) = self.current(claim) else {
                continue;
            };
            if w.position != Position::At(claim.offset) {
                continue;
            }
            w.validate = false;
            w.read_under = claim.leader_epoch;
            if end.leader_epoch < 0 || end.end_offset < 0 {
                // The leader holds no epoch as old as the last one read: nothing of the
                // position is known to be in its log. Out of range, as auto.offset.reset says.
                out_of_range(w, claim, reset, &mut outcome.reports);
            } else if end.end_offset < claim.offset {
                w.position = Position::At(end.end_offset);
                w.last_epoch = end.leader_epoch;
                outcome.reports.push(Fetched::Truncated {
                    partition: claim.partition,
                    epoch: claim.epoch,
                    from: claim.offset,
                    to: end.end_offset,
                });
            }
        }
        outcome
    }

    /// Where `auto.offset.reset` moves a position outside its log (`None`: nowhere).
    fn reset_end(&self) -> Option<LogEnd> {
        match self.offset_reset {
            OffsetReset::Earliest => Some(LogEnd::Earliest),
            OffsetReset::Latest => Some(LogEnd::Latest),
            OffsetReset::Error => None,
        }
    }

    /// One partition of a fetch answer (the driver built its chunk): its position moves on.
    /// Returns whether its chunk is handed out; reports and staleness go to `outcome`. The
    /// partition stays claimed until [`Self::fetch_done`], so that no other request reads it
    /// before its chunk is queued.
    pub(super) fn answer(
        &mut self,
        claims: &[Claim],
        answer: &Answer,
        now: Instant,
        outcome: &mut Outcome,
    ) -> bool {
        let reset = self.reset_end();
        let claim = claims.iter().find(|c| c.partition == answer.partition);
        match (claim, &answer.read) {
            (Some(claim), Some(read)) if answer.error == ErrorCode::NONE => {
                self.records(claim, read, now, &mut outcome.reports)
            }
            (Some(claim), _) if answer.error == ErrorCode::OFFSET_OUT_OF_RANGE => {
                if let Some(w) = self.current(claim)
                    && w.position == Position::At(claim.offset)
                {
                    out_of_range(w, claim, reset, &mut outcome.reports);
                }
                false
            }
            (Some(_), _) => {
                let error = answer.error;
                outcome.stale |= self.partition_error(answer.partition, error, now);
                if error == ErrorCode::TOPIC_AUTHORIZATION_FAILED {
                    outcome.reports.push(Fetched::Failed {
                        error: format!("reading partition {}: {error}", answer.partition),
                    });
                }
                false
            }
            (None, _) => false,
        }
    }

    /// Every partition of a fetch answered: the claims are released, and `throttle_ms` (the
    /// broker's, KIP-219) quiets the broker.
    pub(super) fn fetch_done(
        &mut self,
        node: i32,
        claims: &[Claim],
        throttle_ms: u32,
        now: Instant,
        outcome: &mut Outcome,
    ) {
        self.release(node, claims);
        if throttle_ms > 0 {
            // The broker gets nothing more until the throttle is over: a request sent sooner
            // would only wait on its muted connection.
            let until = now + Duration::from_millis(u64::from(throttle_ms));
            self.quiet.insert(node, until);
            outcome.reports.push(Fetched::Throttled {
                node,
                ms: throttle_ms,
            });
        }
    }

    /// A whole fetch answered at once: [`Self::answer`] for each of `answers`, in order, then
    /// [`Self::fetch_done`]; `deliver` says which chunks to hand out.
    #[cfg(test)]
    pub(super) fn fetched(
        &mut self,
        node: i32,
        claims: &[Claim],
        answers: &[Answer],
        throttle_ms: u32,
        now: Instant,
    ) -> Outcome {
        let mut outcome = Outcome::default();
        for answer in answers {
            let deliver = self.answer(claims, answer, now, &mut outcome);
            outcome.deliver.push(deliver);
        }
        self.fetch_done(node, claims, throttle_ms, now, &mut outcome);
        outcome
    }

    /// One partition's records read: its position moves past them; returns whether its chunk
    /// is handed out (not if a seek came since).
    fn records(
        &mut self,
        claim: &Claim,
        read: &Read,
        now: Instant,
        reports: &mut Vec<Fetched>,
    ) -> bool {
        let Some(w) = self.current(claim) else {
            return false;
        };
        if read.diverging {
            // The leader's log parted from the last epoch read before this position: nothing
            // was read, and the position is checked before the next fetch.
            w.validate = true;
            return false;
        }
        if let Position::At(offset) = w.position
            && read.next > offset
        {
            w.position = Position::At(read.next);
        }
        if let Some(epoch) = read.last_epoch {
            w.last_epoch = epoch;
            w.read_to = w.read_to.max(read.next);
        }
        w.read_under = claim.leader_epoch;
        if let Some(reason) = &read.corrupt {
            w.not_before = Some(now + CORRUPT_BACKOFF);
            reports.push(Fetched::Corrupt {
                partition: claim.partition,
                offset: read.next,
                reason: reason.clone(),
            });
        }
        true
    }
}

/// `claim`'s position is not in its log: it moves to where `reset` (`auto.offset.reset`) says,
/// once the leader says where that is; with no reset it stays, unfetched, until the owner
/// seeks it, and the owner is told now. The last epoch read is forgotten either way.
fn out_of_range(w: &mut Wanted, claim: &Claim, reset: Option<LogEnd>, reports: &mut Vec<Fetched>) {
    w.last_epoch = -1;
    w.read_to = -1;
    match reset {
        Some(end) => {
            w.position = Position::Find {
                end,
                from: Some(claim.offset),
            }
        }
        None => {
            w.paused = true;
            reports.push(Fetched::OutOfRange {
                partition: claim.partition,
                epoch: claim.epoch,
                from: claim.offset,
                to: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{BrokerAddress, PartitionMetadata};

    fn waits() -> Waits {
        Waits {
            reconnect: Duration::from_millis(50),
            reconnect_max: Duration::from_secs(2),
            fetch_error: Duration::from_millis(500),
            metadata_refresh: Duration::from_secs(60),
        }
    }

    /// Metadata naming brokers 1 and 2, and `(partition, leader, epoch)`.
    fn metadata(leaders: &[(i32, i32, i32)]) -> Metadata {
        Metadata {
            brokers: [1, 2]
                .map(|node_id| BrokerAddress {
                    node_id,
                    host: format!("b{node_id}"),
                    port: 9092,
                })
                .into(),
            topic_error: ErrorCode::NONE,
            partitions: (leaders.iter())
                .map(|&(partition, leader, leader_epoch)| PartitionMetadata {
                    partition,
                    error: ErrorCode::NONE,
                    leader,
                    leader_epoch,
                })
                .collect(),
        }
    }

    fn read(next: i64, last_epoch: i32) -> Answer {
        Answer {
            partition: 0,
            error: ErrorCode::NONE,
            read: Some(Read {
                next,
                last_epoch: Some(last_epoch),
                corrupt: None,
                diverging: false,
            }),
        }
    }

    fn error(partition: i32, error: ErrorCode) -> Answer {
        Answer {
            partition,
            error,
            read: None,
        }
    }

    /// A core reading partition 0 from offset 10, led by broker 1 in epoch 3.
    fn reading(reset: OffsetReset) -> (Core, Instant) {
        let mut core = Core::new(waits(), reset);
        let (epoch, unknown) = core.seek(0, Start::At(10), false);
        assert_eq!((epoch, unknown), (1, true), "no leader known yet");
        let (start, missing) = core.metadata(&metadata(&[(0, 1, 3)]));
        assert_eq!((start, missing), (vec![1], false));
        (core, Instant::now())
    }

    fn fetch(core: &mut Core, node: i32, now: Instant) -> (Vec<FetchPosition>, Vec<Claim>) {
        match core.next(node, now) {
            Step::Fetch { positions, claims } => (positions, claims),
            other => panic!("expected a fetch, got {other:?}"),
        }
    }

    #[test]
    fn a_fetch_carries_the_leader_epoch_and_moves_the_position_past_what_was_read() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        assert_eq!(
            core.next(2, now),
            Step::Idle { wake: None },
            "not its leader"
        );
        let (positions, claims) = fetch(&mut core, 1, now);
        let first = FetchPosition {
            partition: 0,
            offset: 10,
            current_leader_epoch: 3,
            last_fetched_epoch: -1,
        };
        assert_eq!(positions, [first]);
        assert_eq!(core.next(1, now), Step::Idle { wake: None }, "in flight");
        let outcome = core.fetched(1, &claims, &[read(25, 3)], 0, now);
        assert_eq!(outcome.deliver, [true]);
        assert!(outcome.reports.is_empty() && !outcome.stale);
        let (positions, _) = fetch(&mut core, 1, now);
        assert_eq!(
            (positions[0].offset, positions[0].last_fetched_epoch),
            (25, 3)
        );
    }

    #[test]
    fn an_answer_to_a_request_sent_before_a_seek_is_dropped() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        let (_, claims) = fetch(&mut core, 1, now);
        core.seek(0, Start::At(100), false);
        let outcome = core.fetched(1, &claims, &[read(25, 3)], 0, now);
        assert_eq!(outcome.deliver, [false], "fetched before the seek");
        let (positions, _) = fetch(&mut core, 1, now);
        assert_eq!(
            (positions[0].offset, positions[0].last_fetched_epoch),
            (100, -1)
        );
    }

    #[test]
    fn after_a_leader_change_the_position_is_validated_and_a_truncation_resumes_at_the_end() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        let (_, claims) = fetch(&mut core, 1, now);
        core.fetched(1, &claims, &[read(500, 3)], 0, now);
        // An unclean election: broker 2 leads in epoch 4, its log ending epoch 3 at 420.
        core.metadata(&metadata(&[(0, 2, 4)]));
        assert_eq!(core.next(1, now), Step::Idle { wake: None });
        let Step::Validate { queries, claims } = core.next(2, now) else {
            panic!("the position is checked before anything is fetched");
        };
        let query = EpochQuery {
            partition: 0,
            current_leader_epoch: 4,
            leader_epoch: 3,
        };
        assert_eq!(queries, [query]);
        let end = EpochEnd {
            partition: 0,
            error: ErrorCode::NONE,
            leader_epoch: 3,
            end_offset: 420,
        };
        let outcome = core.validated(2, &claims, &[end], now);
        let [
            Fetched::Truncated {
                partition: 0,
                epoch: 1,
                from: 500,
                to: 420,
            },
        ] = outcome.reports[..]
        else {
            panic!("a truncation is reported: {:?}", outcome.reports);
        };
        let (positions, _) = fetch(&mut core, 2, now);
        let resumed = FetchPosition {
            partition: 0,
            offset: 420,
            current_leader_epoch: 4,
            last_fetched_epoch: 3,
        };
        assert_eq!(positions, [resumed]);
    }

    #[test]
    fn a_position_the_new_leader_holds_is_read_on_without_a_report() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        let (_, claims) = fetch(&mut core, 1, now);
        core.fetched(1, &claims, &[read(500, 3)], 0, now);
        core.metadata(&metadata(&[(0, 1, 5)]));
        let Step::Validate { claims, .. } = core.next(1, now) else {
            panic!("validated");
        };
        let end = EpochEnd {
            partition: 0,
            error: ErrorCode::NONE,
            leader_epoch: 3,
            end_offset: 800,
        };
        let outcome = core.validated(1, &claims, &[end], now);
        assert!(outcome.reports.is_empty());
        let (positions, _) = fetch(&mut core, 1, now);
        assert_eq!(
            (positions[0].offset, positions[0].current_leader_epoch),
            (500, 5)
        );
        // The same epoch again asks nothing more.
        core.metadata(&metadata(&[(0, 1, 5)]));
        assert!(!core.wanted[&0].validate);
    }

    #[test]
    fn a_seek_back_keeps_the_last_epoch_read_and_a_seek_ahead_forgets_it() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        let (_, claims) = fetch(&mut core, 1, now);
        core.fetched(1, &claims, &[read(500, 3)], 0, now);
        let at = |p: &[FetchPosition]| (p[0].offset, p[0].last_fetched_epoch);
        // Sought back (a pause drops what was fetched past the reader): fetched with the epoch,
        // so that the leader checks the position, at no extra request.
        core.seek(0, Start::At(450), false);
        let (positions, claims) = fetch(&mut core, 1, now);
        assert_eq!(at(&positions), (450, 3));
        core.fetched(1, &claims, &[read(500, 3)], 0, now);
        // The log truncated at 420 under the position: found after the leader change.
        core.metadata(&metadata(&[(0, 2, 4)]));
        let Step::Validate { claims, .. } = core.next(2, now) else {
            panic!("validated after the leader change");
        };
        let ended = EpochEnd {
            partition: 0,
            error: ErrorCode::NONE,
            leader_epoch: 3,
            end_offset: 420,
        };
        let outcome = core.validated(2, &claims, &[ended], now);
        let [Fetched::Truncated { from, to, .. }] = outcome.reports[..] else {
            panic!("a truncation: {:?}", outcome.reports);
        };
        assert_eq!((from, to), (500, 420));
        // An owner that has not moved its ledgers back seeks to 500 again, or is revoked and
        // assigned back and does: fetched with the epoch, the leader says the log diverged,
        // and the truncation is found again.
        for revoked in [false, true] {
            if revoked {
                core.remove(0);
            }
            core.seek(0, Start::At(500), false);
            let (positions, claims) = fetch(&mut core, 2, now);
            assert_eq!(at(&positions), (500, 3));
            let mut diverged = read(500, 3);
            diverged.read.as_mut().expect("read").diverging = true;
            assert_eq!(
                core.fetched(2, &claims, &[diverged], 0, now).deliver,
                [false]
            );
            let Step::Validate { claims, .. } = core.next(2, now) else {
                panic!("validated after the diverging answer");
            };
            let outcome = core.validated(2, &claims, &[ended], now);
            assert!(matches!(
                outcome.reports[..],
                [Fetched::Truncated {
                    from: 500,
                    to: 420,
                    ..
                }]
            ));
        }
        // Ahead of what was read, the epoch of the record before is unknown.
        core.seek(0, Start::At(900), false);
        assert_eq!(at(&fetch(&mut core, 2, now).0), (900, -1));
    }

    #[test]
    fn a_partition_not_read_yet_is_not_validated() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        core.metadata(&metadata(&[(0, 2, 9)]));
        let (positions, _) = fetch(&mut core, 2, now);
        assert_eq!(positions[0].current_leader_epoch, 9);
    }

    #[test]
    fn a_diverging_fetch_answer_validates_the_position() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        let (_, claims) = fetch(&mut core, 1, now);
        core.fetched(1, &claims, &[read(500, 3)], 0, now);
        let (_, claims) = fetch(&mut core, 1, now);
        let mut diverged = read(500, 3);
        diverged.read.as_mut().expect("read").diverging = true;
        let outcome = core.fetched(1, &claims, &[diverged], 0, now);
        assert_eq!(outcome.deliver, [false]);
        assert!(matches!(core.next(1, now), Step::Validate { .. }));
    }

    #[test]
    fn an_unknown_epoch_is_out_of_range_as_auto_offset_reset_says() {
        for (reset, found) in [(OffsetReset::Earliest, true), (OffsetReset::Error, false)] {
            let (mut core, now) = reading(reset);
            let (_, claims) = fetch(&mut core, 1, now);
            core.fetched(1, &claims, &[read(500, 3)], 0, now);
            core.metadata(&metadata(&[(0, 1, 4)]));
            let Step::Validate { claims, .. } = core.next(1, now) else {
                panic!("validated");
            };
            let none = EpochEnd {
                partition: 0,
                error: ErrorCode::NONE,
                leader_epoch: -1,
                end_offset: -1,
            };
            let outcome = core.validated(1, &claims, &[none], now);
            if found {
                let Step::ListOffsets { end, claims } = core.next(1, now) else {
                    panic!("where the log starts is asked");
                };
                assert_eq!((end, claims[0].offset), (LogEnd::Earliest, 500));
                let outcome = core.listed(1, &claims, &[(0, ErrorCode::NONE, 77)], now);
                let [
                    Fetched::OutOfRange {
                        from: 500,
                        to: Some(77),
                        ..
                    },
                ] = outcome.reports[..]
                else {
                    panic!("reported: {:?}", outcome.reports);
                };
            } else {
                let [
                    Fetched::OutOfRange {
                        from: 500,
                        to: None,
                        ..
                    },
                ] = outcome.reports[..]
                else {
                    panic!("reported: {:?}", outcome.reports);
                };
                assert_eq!(core.next(1, now), Step::Idle { wake: None }, "until sought");
            }
        }
    }

    #[test]
    fn out_of_range_finds_where_the_log_starts_or_waits_for_a_seek() {
        let (mut core, now) = reading(OffsetReset::Latest);
        let (_, claims) = fetch(&mut core, 1, now);
        let outcome = core.fetched(
            1,
            &claims,
            &[error(0, ErrorCode::OFFSET_OUT_OF_RANGE)],
            0,
            now,
        );
        assert_eq!((outcome.deliver, outcome.reports.len()), (vec![false], 0));
        let Step::ListOffsets { end, claims } = core.next(1, now) else {
            panic!("where the log ends is asked");
        };
        assert_eq!(end, LogEnd::Latest);
        let outcome = core.listed(1, &claims, &[(0, ErrorCode::NONE, 900)], now);
        assert!(matches!(
            outcome.reports[..],
            [Fetched::OutOfRange {
                from: 10,
                to: Some(900),
                ..
            }]
        ));
        assert_eq!(fetch(&mut core, 1, now).0[0].offset, 900);
    }

    #[test]
    fn a_seek_to_the_log_start_asks_before_fetching() {
        let mut core = Core::new(waits(), OffsetReset::Earliest);
        core.metadata(&metadata(&[(0, 1, 3), (1, 1, 3)]));
        let now = Instant::now();
        core.seek(0, Start::Earliest, false);
        core.seek(1, Start::At(4), false);
        let Step::ListOffsets { end, claims } = core.next(1, now) else {
            panic!("ListOffsets first");
        };
        assert_eq!(
            (end, claims.len(), claims[0].partition),
            (LogEnd::Earliest, 1, 0)
        );
        // Partition 1 goes on meanwhile.
        assert_eq!(fetch(&mut core, 1, now).0[0].partition, 1);
        let outcome = core.listed(1, &claims, &[(0, ErrorCode::NONE, 3)], now);
        assert!(outcome.reports.is_empty(), "a seek is not an out-of-range");
        assert_eq!(fetch(&mut core, 1, now).0[0].offset, 3);
    }

    #[test]
    fn stale_leadership_drops_the_leader_and_backs_the_partition_off() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        let (_, claims) = fetch(&mut core, 1, now);
        let fenced = error(0, ErrorCode::FENCED_LEADER_EPOCH);
        let outcome = core.fetched(1, &claims, &[fenced], 0, now);
        assert!(outcome.stale);
        assert_eq!(
            core.next(1, now),
            Step::Idle { wake: None },
            "no leader now"
        );
        let (start, _) = core.metadata(&metadata(&[(0, 1, 4)]));
        assert!(start.is_empty(), "broker 1 has its task");
        let wake = now + waits().fetch_error;
        assert_eq!(core.next(1, now), Step::Idle { wake: Some(wake) });
        assert_eq!(fetch(&mut core, 1, wake).0[0].current_leader_epoch, 4);
    }

    #[test]
    fn a_throttle_quiets_the_broker_until_it_is_over() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        let (_, claims) = fetch(&mut core, 1, now);
        let outcome = core.fetched(1, &claims, &[read(20, 3)], 250, now);
        assert!(matches!(
            outcome.reports[..],
            [Fetched::Throttled { node: 1, ms: 250 }]
        ));
        let over = now + Duration::from_millis(250);
        assert_eq!(core.next(1, now), Step::Idle { wake: Some(over) });
        assert_eq!(fetch(&mut core, 1, over).0[0].offset, 20);
    }

    #[test]
    fn a_failed_request_backs_the_broker_off_doubling_and_an_answer_resets_it() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        let mut at = now;
        let mut delays = Vec::new();
        for _ in 0..3 {
            let (_, claims) = fetch(&mut core, 1, at);
            assert!(core.failed(1, &claims, at).stale);
            let Step::Idle { wake: Some(wake) } = core.next(1, at) else {
                panic!("quiet after a failure");
            };
            delays.push(wake - at);
            at = wake;
        }
        let ms = |d: Duration| d.as_millis();
        assert!(ms(delays[0]) >= 25 && ms(delays[0]) <= 50, "{delays:?}");
        assert!(ms(delays[2]) >= 100 && ms(delays[2]) <= 200, "{delays:?}");
        let (_, claims) = fetch(&mut core, 1, at);
        core.fetched(1, &claims, &[read(11, 3)], 0, at);
        let (_, claims) = fetch(&mut core, 1, at);
        core.failed(1, &claims, at);
        let Step::Idle { wake: Some(wake) } = core.next(1, at) else {
            panic!("quiet");
        };
        assert!(ms(wake - at) <= 50, "the backoff restarted after an answer");
    }

    #[test]
    fn a_corrupt_batch_holds_the_partition_for_the_corrupt_backoff() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        let (_, claims) = fetch(&mut core, 1, now);
        let mut corrupt = read(40, 3);
        corrupt.read.as_mut().expect("read").corrupt = Some("crc".into());
        let outcome = core.fetched(1, &claims, &[corrupt], 0, now);
        assert_eq!(outcome.deliver, [true], "what came before it is handed out");
        assert!(matches!(
            outcome.reports[..],
            [Fetched::Corrupt { offset: 40, .. }]
        ));
        let later = now + CORRUPT_BACKOFF;
        assert_eq!(core.next(1, now), Step::Idle { wake: Some(later) });
        assert_eq!(fetch(&mut core, 1, later).0[0].offset, 40);
    }

    #[test]
    fn paused_partitions_are_not_fetched_and_resume_where_they_stopped() {
        let (mut core, now) = reading(OffsetReset::Earliest);
        core.pause(0, true);
        assert_eq!(core.next(1, now), Step::Idle { wake: None });
        core.pause(0, false);
        assert_eq!(fetch(&mut core, 1, now).0[0].offset, 10);
        core.remove(0);
        assert_eq!(core.next(1, now), Step::Idle { wake: None });
    }
}

//! The appender's state, shared by its owner and its I/O thread: each partition's open, sealed
//! and in-flight batches, and what every decision on them does (seal, take for sending with a
//! sequence, settle an answer, expire, fail), free of I/O so that it is tested directly.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

use crate::compression;
use crate::config::{AppendConfig, Codec};
use crate::protocol::{self, ErrorCode};
use crate::records::{self, Stamp};

/// What became of appended records.
#[derive(Debug)]
pub enum Completion {
    /// Written: the records of `tokens`, in order, from `base_offset` on.
    Written {
        /// The partition.
        partition: i32,
        /// The first record's offset (-1 if the broker did not say, as for a retry it
        /// recognised).
        base_offset: i64,
        /// The records' tokens, in order.
        tokens: Vec<usize>,
    },
    /// Not written.
    Failed {
        /// The records' tokens.
        tokens: Vec<usize>,
        /// Why.
        error: String,
    },
}

/// A batch being filled.
#[derive(Debug)]
pub(super) struct Open {
    pub(super) records: Vec<u8>,
    pub(super) tokens: Vec<usize>,
    pub(super) base_timestamp: i64,
    pub(super) max_timestamp: i64,
    pub(super) opened: Instant,
}

/// A batch waiting to be sent, or to be sent again.
#[derive(Debug)]
pub(super) struct Sealed {
    pub(super) records: Vec<u8>,
    pub(super) tokens: Vec<usize>,
    pub(super) base_timestamp: i64,
    pub(super) max_timestamp: i64,
    /// When its first record was appended: its records fail `delivery_timeout` after.
    pub(super) created: Instant,
    /// Its producer id, epoch and sequence number, given when it is first taken for sending.
    pub(super) stamp: Option<Stamp>,
    /// The encoded batch: what every attempt sends.
    pub(super) encoded: Option<Vec<u8>>,
}

/// One partition's state.
#[derive(Debug, Default)]
pub(super) struct Part {
    pub(super) open: Option<Open>,
    pub(super) ready: VecDeque<Sealed>,
    pub(super) in_flight: bool,
    pub(super) next_sequence: i32,
    pub(super) leader: Option<i32>,
    /// Refused for good: every record of this partition fails.
    pub(super) failed: Option<String>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) parts: Vec<Part>,
    pub(super) brokers: HashMap<i32, String>,
    pub(super) running: HashSet<i32>,
    /// The idempotent producer's id and epoch, once known.
    pub(super) producer: Option<(i64, i16)>,
    /// The partition unkeyed records go to until its batch is sealed.
    pub(super) sticky: Option<usize>,
    /// Records appended and not yet reported.
    pub(super) queued: usize,
    /// The last failure while starting, if any.
    pub(super) start_error: Option<String>,
    pub(super) completions: Vec<Completion>,
}

pub(super) struct Shared {
    pub(super) config: AppendConfig,
    pub(super) state: Mutex<State>,
    /// Batches are ready to send, or leaders changed.
    pub(super) work: Notify,
    /// Metadata should be asked for again.
    pub(super) stale: Notify,
    /// Completions were queued, or start-up ended.
    pub(super) reported: Condvar,
    /// Milliseconds since the epoch, updated by the I/O thread: the records' create time.
    pub(super) now_ms: AtomicI64,
    pub(super) stop: AtomicBool,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(super) fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Moves a partition's open batch, if any, to its queue.
pub(super) fn seal(part: &mut Part) {
    if let Some(open) = part.open.take() {
        part.ready.push_back(Sealed {
            records: open.records,
            tokens: open.tokens,
            base_timestamp: open.base_timestamp,
            max_timestamp: open.max_timestamp,
            created: open.opened,
            stamp: None,
            encoded: None,
        });
    }
}

/// Fails every record of a partition, queued or open, for `error`: nothing of it is written
/// past a batch that was not.
pub(super) fn fail_partition(part: &mut Part, error: &str, out: &mut Vec<Completion>) {
    part.failed = Some(error.to_owned());
    let failed = |tokens| Completion::Failed {
        tokens,
        error: error.to_owned(),
    };
    out.extend(part.ready.drain(..).map(|b| failed(b.tokens)));
    if let Some(open) = part.open.take() {
        out.push(failed(open.tokens));
    }
}

/// Fails the partitions whose next batch is older than `timeout` and not in flight.
pub(super) fn expire(state: &mut State, timeout: Duration) -> Vec<Completion> {
    let mut out = Vec::new();
    for part in &mut state.parts {
        let stale = !part.in_flight
            && part
                .ready
                .front()
                .is_some_and(|b| b.created.elapsed() >= timeout);
        if stale {
            fail_partition(
                part,
                &format!("not acknowledged within {timeout:?}"),
                &mut out,
            );
        }
    }
    out
}

/// Queues completions and wakes whoever waits for them.
pub(super) fn complete(
    shared: &Shared,
    state: &mut State,
    completions: impl IntoIterator<Item = Completion>,
) {
    for c in completions {
        state.queued -= match &c {
            Completion::Written { tokens, .. } | Completion::Failed { tokens, .. } => tokens.len(),
        };
        state.completions.push(c);
    }
    shared.reported.notify_all();
}

/// A batch taken for one request.
pub(super) struct Taken {
    pub(super) partition: usize,
    pub(super) batch: Sealed,
}

/// Takes the head batch of every partition `node` leads that has one and none in flight,
/// stamping first attempts with their sequence numbers (consecutive per partition).
pub(super) fn take_batches(state: &mut State, node: i32) -> Vec<Taken> {
    let Some((producer_id, producer_epoch)) = state.producer else {
        return Vec::new();
    };
    let mut taken = Vec::new();
    for (partition, part) in state.parts.iter_mut().enumerate() {
        if part.in_flight || part.leader != Some(node) {
            continue;
        }
        let Some(mut batch) = part.ready.pop_front() else {
            continue;
        };
        if batch.stamp.is_none() {
            batch.stamp = Some(Stamp {
                producer_id,
                producer_epoch,
                base_sequence: part.next_sequence,
            });
            part.next_sequence =
                part.next_sequence.wrapping_add(batch.tokens.len() as i32) & i32::MAX;
        }
        part.in_flight = true;
        taken.push(Taken { partition, batch });
    }
    taken
}

/// The batch as sent: its records compressed with `codec` (left plain if that is no smaller).
pub(super) fn encode(codec: Codec, batch: &Sealed, stamp: Stamp) -> Vec<u8> {
    let compressed = compression::compress(codec, &batch.records);
    let (attributes, section) = match &compressed {
        Some((attributes, out)) => (*attributes, out.as_slice()),
        None => (0, batch.records.as_slice()),
    };
    let mut encoded = Vec::with_capacity(records::BATCH_HEADER_LEN + section.len());
    records::put_batch(
        &mut encoded,
        attributes,
        batch.tokens.len() as i32,
        batch.base_timestamp,
        batch.max_timestamp,
        stamp,
        section,
    );
    encoded
}

/// Carries out a request's answers (none if it failed as a whole): batches written or refused
/// for good are completed, the others go back to the head of their partition; returns whether
/// any is to be sent again.
pub(super) fn settle(
    shared: &Shared,
    node: i32,
    taken: Vec<Taken>,
    answers: &[protocol::ProducePartition],
) -> bool {
    let mut retry = false;
    let mut state = shared.lock();
    let mut completions = Vec::new();
    for Taken { partition, batch } in taken {
        let part = &mut state.parts[partition];
        part.in_flight = false;
        let answer = answers.iter().find(|a| a.partition == partition as i32);
        match answer.map(|a| (a.error, a)) {
            Some((ErrorCode::NONE | ErrorCode::DUPLICATE_SEQUENCE_NUMBER, a)) => {
                completions.push(Completion::Written {
                    partition: partition as i32,
                    base_offset: a.base_offset,
                    tokens: batch.tokens,
                });
            }
            Some((error, a)) if !error.is_retriable_produce() => {
                let why = match &a.message {
                    Some(m) => format!("{error}: {m}"),
                    None => error.to_string(),
                };
                completions.push(Completion::Failed {
                    tokens: batch.tokens,
                    error: why.clone(),
                });
                fail_partition(part, &why, &mut completions);
            }
            // Retriable, or no answer (the connection failed): the same bytes again.
            other => {
                if let Some((error, _)) = other {
                    tracing::debug!(node, partition, %error, "appender: batch refused for now; sending again");
                    if error.is_stale_leadership() {
                        part.leader = None;
                    }
                }
                part.ready.push_front(batch);
                retry = true;
            }
        }
    }
    if !completions.is_empty() {
        complete(shared, &mut state, completions);
    }
    retry
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(partitions: usize) -> Shared {
        let config =
            AppendConfig::from_options("t", [("bootstrap.servers", "127.0.0.1:1")]).expect("valid");
        let mut state = State::default();
        state.parts.resize_with(partitions, Part::default);
        for part in &mut state.parts {
            part.leader = Some(1);
        }
        state.producer = Some((77, 2));
        Shared {
            config,
            state: Mutex::new(state),
            work: Notify::new(),
            stale: Notify::new(),
            reported: Condvar::new(),
            now_ms: AtomicI64::new(1_000),
            stop: AtomicBool::new(false),
        }
    }

    fn sealed(tokens: &[usize]) -> Sealed {
        Sealed {
            records: Vec::new(),
            tokens: tokens.to_vec(),
            base_timestamp: 0,
            max_timestamp: 0,
            created: Instant::now(),
            stamp: None,
            encoded: None,
        }
    }

    fn answer(partition: i32, error: i16, base_offset: i64) -> protocol::ProducePartition {
        protocol::ProducePartition {
            partition,
            error: ErrorCode(error),
            base_offset,
            message: None,
        }
    }

    #[test]
    fn one_batch_per_partition_in_flight_with_consecutive_sequences() {
        let s = shared(2);
        {
            let mut state = s.lock();
            state.parts[0]
                .ready
                .extend([sealed(&[1, 2, 3]), sealed(&[4])]);
            state.parts[1].ready.push_back(sealed(&[5]));
            state.queued = 5;
        }
        let first = take_batches(&mut s.lock(), 1);
        assert_eq!(first.len(), 2, "the head batch of each partition");
        assert_eq!(
            first[0]
                .batch
                .stamp
                .map(|st| (st.producer_id, st.producer_epoch, st.base_sequence)),
            Some((77, 2, 0))
        );
        assert!(
            take_batches(&mut s.lock(), 1).is_empty(),
            "both partitions are in flight"
        );
        assert!(!settle(&s, 1, first, &[answer(0, 0, 100), answer(1, 0, 7)]));
        let second = take_batches(&mut s.lock(), 1);
        assert_eq!(second.len(), 1);
        assert_eq!(
            second[0].batch.stamp.map(|st| st.base_sequence),
            Some(3),
            "after 3 records"
        );
        let done = std::mem::take(&mut s.lock().completions);
        assert!(
            matches!(&done[0], Completion::Written { partition: 0, base_offset: 100, tokens } if tokens == &[1, 2, 3])
        );
        assert!(
            take_batches(&mut s.lock(), 2).is_empty(),
            "node 2 leads nothing"
        );
    }

    #[test]
    fn a_retried_batch_goes_first_again_with_its_sequence() {
        let s = shared(1);
        s.lock().parts[0].ready.extend([sealed(&[1]), sealed(&[2])]);
        s.lock().queued = 2;
        let taken = take_batches(&mut s.lock(), 1);
        // NOT_LEADER_OR_FOLLOWER: retried, the leader forgotten until metadata says again.
        assert!(settle(&s, 1, taken, &[answer(0, 6, -1)]));
        assert_eq!(s.lock().parts[0].leader, None);
        s.lock().parts[0].leader = Some(2);
        let again = take_batches(&mut s.lock(), 2);
        assert_eq!(again[0].batch.tokens, [1]);
        assert_eq!(
            again[0].batch.stamp.map(|st| st.base_sequence),
            Some(0),
            "the same sequence"
        );
        // A duplicate is the first attempt having landed: written.
        assert!(!settle(&s, 2, again, &[answer(0, 46, -1)]));
        let next = take_batches(&mut s.lock(), 2);
        assert_eq!(next[0].batch.stamp.map(|st| st.base_sequence), Some(1));
        // No answer at all (the connection failed): sent again as it was.
        assert!(settle(&s, 2, next, &[]));
        assert_eq!(
            s.lock().parts[0].ready.front().map(|b| b.tokens.clone()),
            Some(vec![2])
        );
    }

    #[test]
    fn a_batch_refused_for_good_fails_everything_behind_it() {
        let s = shared(1);
        {
            let mut state = s.lock();
            state.parts[0].ready.extend([sealed(&[1]), sealed(&[2, 3])]);
            state.queued = 4;
        }
        let taken = take_batches(&mut s.lock(), 1);
        // MESSAGE_TOO_LARGE
        assert!(!settle(&s, 1, taken, &[answer(0, 10, -1)]));
        let state = s.lock();
        let failed: Vec<usize> = (state.completions.iter())
            .flat_map(|c| match c {
                Completion::Failed { tokens, .. } => tokens.clone(),
                Completion::Written { .. } => Vec::new(),
            })
            .collect();
        assert_eq!(failed, [1, 2, 3]);
        assert_eq!(state.queued, 1);
        assert!(
            state.parts[0]
                .failed
                .as_deref()
                .is_some_and(|e| e.contains("MESSAGE_TOO_LARGE"))
        );
    }

    #[test]
    fn batches_not_acknowledged_in_time_fail() {
        let s = shared(1);
        let mut old = sealed(&[1]);
        old.created = Instant::now() - Duration::from_secs(10);
        s.lock().parts[0].ready.push_back(old);
        s.lock().queued = 1;
        let expired = expire(&mut s.lock(), Duration::from_secs(5));
        assert!(
            matches!(&expired[..], [Completion::Failed { tokens, error }] if tokens == &[1] && error.contains("not acknowledged"))
        );
    }

    #[test]
    fn records_are_encoded_into_a_batch_that_reads_back() {
        let mut batch = sealed(&[1, 2]);
        records::put_record(&mut batch.records, 0, 0, Some(b"k"), b"{\"counter\":\"c\"}");
        records::put_record(&mut batch.records, 1, 3, Some(b"k"), b"{\"counter\":\"c\"}");
        let stamp = Stamp {
            producer_id: 1,
            producer_epoch: 0,
            base_sequence: 5,
        };
        for codec in [Codec::None, Codec::Lz4, Codec::Gzip] {
            let encoded = encode(codec, &batch, stamp);
            let Some(Ok(records::RawBatch::V2 {
                header,
                records: section,
                ..
            })) = records::batches(&encoded).next()
            else {
                panic!("a batch");
            };
            let mut plain = Vec::new();
            crate::compression::decompress(header.compression(), section, &mut plain)
                .expect("decompresses");
            let values: Vec<_> = records::Records::new(header, &plain)
                .map(|r| r.expect("record").value)
                .collect();
            assert_eq!(values, [Some(&b"{\"counter\":\"c\"}"[..]); 2], "{codec:?}");
        }
    }
}

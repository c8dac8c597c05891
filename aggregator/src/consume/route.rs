//! Messages in, from librdkafka or from tally's fetcher's chunks: each decoded, routed to its
//! partition's state machine, and the action that returns carried out.

use std::collections::VecDeque;

use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::message::BorrowedMessage;
use tally_common::codec::Record;
use tally_common::keyspace::Fan;
use tally_common::window::{Placement, Placer};
use tally_common::{DeadLetterReason, codec};
use tally_kafka::{Chunk, Fetched, Item};

use crate::consume::decide::{Decided, Decisions};
use crate::consume::idempotency;
use crate::machine::letter::DeadLetter;
use crate::machine::partition::{Entry, Handled};
use crate::store::sink::Sink;

use super::{MAX_UNREADABLE_BYTES, Message, Partitions, Shared, Slot, lock};

/// A message decoded: the record, or why it is malformed, and for an event with an
/// idempotency key, the key and its window ([`idempotency::record_id`]).
struct Decoded<'a> {
    decoded: Result<Record<'a>, codec::DecodeError>,
    id: Option<(u64, i64)>,
}

/// Whether an item of a chunk is at or past offset `from` (every item, with `None`).
fn unread(from: Option<i64>) -> impl Fn(&Item<'_>) -> bool {
    move |item| {
        from.is_none_or(|from| match item {
            Item::Record(record) => record.offset >= from,
            Item::Undecodable { first_offset, .. } => *first_offset >= from,
        })
    }
}

impl<S: Sink> Shared<S> {
    /// Handles a run of messages under one lock of the partitions.
    pub(crate) fn handle_messages<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        messages: &[KafkaResult<BorrowedMessage<'_>>],
    ) {
        let mut parts = lock(&self.partitions);
        let mut read = 0;
        let mut placer = Placer::default();
        for message in messages {
            match message {
                Ok(message) => {
                    read += 1;
                    let message = Message::of(message);
                    if let Some(slot) = parts.map.get_mut(&message.partition) {
                        self.handle_message(slot, &mut placer, consumer, &message, None);
                    }
                }
                Err(error) => tracing::warn!(%error, "Kafka consumer error"),
            }
        }
        self.metrics.consumed(read);
    }

    /// What tally's fetcher handed over: a chunk of one partition's records (with its ids'
    /// decisions, if the decider made them), each decoded and routed to the partition's state
    /// machine in turn, under one lock.
    pub(crate) fn handle_fetched<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        (fetched, decisions): Decided,
    ) {
        let chunk = match fetched {
            Fetched::Chunk(chunk) => chunk,
            Fetched::OutOfRange {
                partition,
                from,
                to,
                ..
            } => {
                self.metrics.offset_reset();
                match to {
                    Some(to) => tracing::error!(
                        partition,
                        from,
                        to,
                        "the partition's position is no longer in its log (retention deleted it): reading goes on where auto.offset.reset says; the events in between were never counted"
                    ),
                    None => tracing::error!(
                        partition,
                        from,
                        "the partition's position is no longer in its log, and auto.offset.reset = error: it is not read until it is positioned again"
                    ),
                }
                return;
            }
            Fetched::Corrupt {
                partition,
                offset,
                reason,
            } => {
                self.metrics.corrupt_batch();
                tracing::error!(
                    partition,
                    offset,
                    %reason,
                    retry_in = ?tally_kafka::fetcher::CORRUPT_BACKOFF,
                    "a corrupt record batch: the partition is not read past it, and it is fetched again (move the partition's leadership to a clean replica if it persists)"
                );
                return;
            }
            Fetched::Truncated {
                partition,
                epoch,
                from,
                to,
            } => {
                self.truncated(consumer, partition, epoch, from, to);
                return;
            }
            Fetched::Throttled { node, ms } => {
                self.metrics.fetch_throttled(ms);
                tracing::debug!(node, ms, "fetches throttled by a broker quota");
                return;
            }
            Fetched::Failed { error } => {
                tracing::error!(%error, "reading the topic fails; retrying");
                return;
            }
        };
        let mut parts = lock(&self.partitions);
        let read = self.handle_chunk(&mut parts, consumer, chunk, decisions);
        self.metrics.consumed(read);
    }

    /// A leader change truncated the partition's log from `to` on, under its position `from`:
    /// what was read past `to` is no longer in the log. In exactly-once mode the partition drops
    /// its buffer and is acquired again, so that nothing unflushed from the lost records is
    /// applied; the acquisition then tells how much had been applied already.
    fn truncated<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        partition: i32,
        epoch: u64,
        from: i64,
        to: i64,
    ) {
        let mut parts = lock(&self.partitions);
        let Some(slot) = parts.map.get_mut(&partition) else {
            return;
        };
        if slot.epoch != epoch {
            return;
        }
        self.metrics.log_truncated(from - to);
        tracing::error!(
            partition,
            from,
            to,
            "a leader change truncated the partition's log under its position (an unclean election): reading goes on at the new leader's end; buffered events from the lost records are dropped"
        );
        slot.truncated_to = Some(slot.truncated_to.map_or(to, |t| t.min(to)));
        for action in slot.machine.on_truncated() {
            self.execute(consumer, partition, slot, action);
        }
    }

    /// Routes a chunk's records while the chunk's epoch is the partition's; returns how many
    /// were read. A chunk that arrives while its partition is held, or whose reading the
    /// partition's hold stopped, is kept (`Slot::held`).
    pub(super) fn handle_chunk<X: ConsumerContext, K: Consumer<X>>(
        &self,
        parts: &mut Partitions,
        consumer: &K,
        chunk: Chunk,
        decisions: Option<Decisions>,
    ) -> u64 {
        let partition = chunk.partition;
        let Some(slot) = parts.map.get_mut(&partition) else {
            return 0;
        };
        if slot.epoch != chunk.epoch {
            // Fetched before the partition's last seek (or pause).
            self.dropped(&chunk, None);
            return 0;
        }
        slot.machine.on_log_end(chunk.log_end);
        if let Some(held) = &mut slot.held {
            held.push_back((chunk, decisions));
            return 0;
        }
        self.read_chunks(consumer, slot, VecDeque::from([(chunk, decisions)]))
    }

    /// Counts the records of `chunk` from offset `from` on (all with `None`) as dropped unread.
    fn dropped(&self, chunk: &Chunk, from: Option<i64>) {
        (self.metrics).fetched_records_dropped(chunk.items().filter(unread(from)).count());
    }

    /// Reads what the partition held, once it resumes.
    pub(super) fn read_held<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        slot: &mut Slot,
    ) {
        if let Some(held) = slot.held.take() {
            let read = self.read_chunks(consumer, slot, held);
            self.metrics.consumed(read);
        }
    }

    /// Reads `chunks` in order, each from where the partition stopped reading (a chunk held
    /// part way is read on from there), until the partition is held (the rest is then held,
    /// before anything held since) or positioned again (the rest was fetched before the seek,
    /// and is dropped). Returns how many records were read.
    fn read_chunks<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        slot: &mut Slot,
        mut chunks: VecDeque<(Chunk, Option<Decisions>)>,
    ) -> u64 {
        let epoch = slot.epoch;
        let mut read = 0;
        while let Some((chunk, decisions)) = chunks.pop_front() {
            let from = slot.machine.read_to();
            let (n, stopped) = self.read_chunk(slot, consumer, &chunk, decisions.as_ref(), from);
            read += n;
            if !stopped {
                continue;
            }
            match &mut slot.held {
                Some(again) if slot.epoch == epoch => {
                    chunks.push_front((chunk, decisions));
                    chunks.append(again);
                    *again = chunks;
                }
                _ => {
                    self.dropped(&chunk, slot.machine.read_to());
                    for (chunk, _) in &chunks {
                        self.dropped(chunk, None);
                    }
                }
            }
            break;
        }
        read
    }

    /// Routes `chunk`'s records from offset `from` on (all of them with `None`), with their
    /// ids' `decisions` if the decider made them: how many were read, and whether reading
    /// stopped before the chunk's end (the partition was held, or positioned again).
    fn read_chunk<X: ConsumerContext, K: Consumer<X>>(
        &self,
        slot: &mut Slot,
        consumer: &K,
        chunk: &Chunk,
        decisions: Option<&Decisions>,
        from: Option<i64>,
    ) -> (u64, bool) {
        let partition = chunk.partition;
        let mut read = 0;
        let mut placer = Placer::default();
        for item in chunk.items().filter(unread(from)) {
            read += 1;
            if !self.handle_item(slot, &mut placer, consumer, partition, item, decisions) {
                return (read, true);
            }
        }
        (read, false)
    }

    /// Handles one item of a chunk (with its ids' `decisions`, if made); false if the
    /// partition was paused or held, so that the rest of the chunk is not read now.
    fn handle_item<'s, X: ConsumerContext, K: Consumer<X>>(
        &'s self,
        slot: &mut Slot,
        placer: &mut Placer<'s>,
        consumer: &K,
        partition: i32,
        item: Item<'_>,
        decisions: Option<&Decisions>,
    ) -> bool {
        let epoch = slot.epoch;
        match item {
            Item::Record(record) => {
                let message = Message {
                    partition,
                    offset: record.offset,
                    key: record.key,
                    payload: record.value,
                    timestamp_ms: (record.timestamp_ms >= 0).then_some(record.timestamp_ms),
                };
                self.handle_message(slot, placer, consumer, &message, decisions);
            }
            Item::Undecodable {
                first_offset,
                last_offset,
                bytes,
                reason,
            } => {
                if slot.machine.accepts() {
                    tracing::warn!(partition, first_offset, last_offset, %reason, "dead-lettering a batch that cannot be read");
                    // Its bytes as evidence, at most a dead letter's worth.
                    let kept = bytes.len().min(MAX_UNREADABLE_BYTES);
                    let letter = DeadLetter {
                        key: None,
                        payload: Some(bytes[..kept].to_vec()),
                        reason: DeadLetterReason::Undecodable,
                        error: format!(
                            "offsets {first_offset} to {last_offset}: {reason} (the first {kept} of its {} bytes)",
                            bytes.len()
                        ),
                        partition,
                        offset: first_offset,
                    };
                    let entry = Entry::DeadLetter {
                        group: None,
                        letter,
                    };
                    // At the stretch's last offset: reading goes on after it.
                    self.deliver(consumer, partition, slot, last_offset, entry);
                }
            }
        }
        // Paused: the fetcher reads on from the next offset once resumed. Held: the rest of
        // the chunk is read once resumed.
        slot.epoch == epoch && slot.held.is_none()
    }

    /// Decodes one message and routes it to its partition's state machine, by its id's
    /// decision in `decisions` if the decider made it.
    pub(super) fn handle_message<'s, X: ConsumerContext, K: Consumer<X>>(
        &'s self,
        slot: &mut Slot,
        placer: &mut Placer<'s>,
        consumer: &K,
        message: &Message<'_>,
        decisions: Option<&Decisions>,
    ) {
        // Not positioned yet (it will be re-read after the seek), or fenced off: not decoded.
        if !slot.machine.accepts() {
            return;
        }
        let decided = decisions.and_then(|d| d.repeat(message.offset));
        let payload = message.payload.unwrap_or_default();
        // An event the decider decoded is not decoded again.
        let decoded = match decisions.and_then(|d| d.event(message.offset, payload)) {
            Some(event) => Decoded {
                decoded: Ok(Record::Event(event)),
                id: None,
            },
            None => self.decode(message.payload, slot.ids.is_some() && decided.is_none()),
        };
        self.route(slot, placer, consumer, message, decoded, decided);
    }

    /// Decodes a message's payload: an event, or an expiry record an expirer wrote into the
    /// partition (`crate::tasks::expiry`); with `ids` (the partition keeps idempotency keys),
    /// an event's id key too.
    fn decode<'a>(&self, payload: Option<&'a [u8]>, ids: bool) -> Decoded<'a> {
        let payload = payload.unwrap_or_default();
        let decoded = codec::decode_record(payload, self.settings.max_message_bytes);
        let id = match &decoded {
            Ok(record) if ids => idempotency::record_id(&self.settings.namespaces, record),
            _ => None,
        };
        Decoded { decoded, id }
    }

    /// Routes a decoded message to its partition's state machine; `decided`: whether its id
    /// repeats one counted, if the decider decided it.
    fn route<'s, X: ConsumerContext, K: Consumer<X>>(
        &'s self,
        slot: &mut Slot,
        placer: &mut Placer<'s>,
        consumer: &K,
        message: &Message<'_>,
        decoded: Decoded<'_>,
        decided: Option<bool>,
    ) {
        if !slot.machine.accepts() {
            return;
        }
        let Message {
            partition,
            offset,
            key,
            payload,
            timestamp_ms: kafka_ms,
        } = *message;
        let dead_letter = |reason: DeadLetterReason, error: String| DeadLetter {
            key: key.map(<[u8]>::to_vec),
            payload: payload.map(<[u8]>::to_vec),
            reason,
            error,
            partition,
            offset,
        };
        let Decoded { decoded, id } = decoded;
        // Every message's Kafka timestamp (`kafka_ms`) is what windows, idempotency windows and
        // expiry go by.
        // Idempotency keys: every event read is decided (and its id recorded) in log order, by
        // the decider or here.
        let repeat = match (decided, id, &slot.ids) {
            (Some(repeat), _, _) => repeat,
            (None, Some((key, window)), Some(ids)) => {
                (ids.lock()).decide(offset, kafka_ms.unwrap_or(0), key, window)
            }
            _ => false,
        };
        // A windowed event's buckets, borrowed by its entry.
        let placement;
        let entry = match &decoded {
            Ok(_) if repeat => {
                self.metrics.repeated_id();
                Entry::Repeat
            }
            Ok(Record::Expiry(expiry)) => Entry::Expire {
                counter: &expiry.counter,
                deadline_ms: expiry.deadline_ms,
                groups: self.groups_holding_shares(slot),
            },
            Ok(Record::Event(event)) if event.reset => Entry::Reset {
                counter: &event.counter,
                groups: self.groups_holding_shares(slot),
            },
            Ok(Record::Event(event)) => {
                let policy = self.settings.namespaces.policy(&event.counter);
                let actor = event.actor.as_deref();
                let keyspace = &self.settings.keyspace;
                let fan = slot.machine.fan_at(offset).unwrap_or_else(|| {
                    let (_, write, _) = self.plan.get();
                    Fan::over(self.settings.partition_spread, write, keyspace.groups())
                });
                let group = keyspace.group_for_event(
                    policy.grouping,
                    partition,
                    actor,
                    &event.counter,
                    fan,
                );
                // Only windowed namespaces pay for a placement.
                placement = (!policy.windows.is_empty()).then(|| {
                    let placed = placer.place(&policy.windows, event.ts_ms, kafka_ms);
                    self.metrics.window_dropped(placed.late, placed.future);
                    placed
                });
                let idle_deadline = (policy.expire_after_ms)
                    .map(|after| kafka_ms.unwrap_or(0).saturating_add(after));
                match actor {
                    _ if !policy.dedup => Entry::Delta {
                        group,
                        counter: &event.counter,
                        delta: event.delta,
                        buckets: placement.map_or(&[], Placement::buckets),
                        idle_deadline,
                    },
                    Some(actor) => Entry::Member {
                        group,
                        counter: &event.counter,
                        actor,
                        like: event.delta > 0,
                        idle_deadline,
                    },
                    None => {
                        tracing::debug!(
                            partition,
                            offset,
                            "dead-lettering a like without an actor"
                        );
                        let why = format!(
                            "{} is in a namespace that counts one per actor, and the event names no actor",
                            event.counter
                        );
                        Entry::DeadLetter {
                            group: Some(group),
                            letter: dead_letter(DeadLetterReason::MissingActor, why),
                        }
                    }
                }
            }
            Err(error) => {
                tracing::debug!(partition, offset, %error, "dead-lettering a malformed message");
                let letter = dead_letter(error.reason(), error.to_string());
                Entry::DeadLetter {
                    group: None,
                    letter,
                }
            }
        };
        self.deliver(consumer, partition, slot, offset, entry);
    }

    /// Hands the message at `offset` to its partition's state machine and carries out what it
    /// decides.
    /// How many groups may hold a counter's shares, for a reset or an expiry to clear: every
    /// group its owner stamped (every group readers summed when it was acquired), else every
    /// group readers sum now.
    fn groups_holding_shares(&self, slot: &Slot) -> u32 {
        match slot.machine.ledgers() {
            Some(ledgers) => ledgers.len() as u32,
            None => self.plan.get().2,
        }
    }

    pub(super) fn deliver<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        partition: i32,
        slot: &mut Slot,
        offset: i64,
        entry: Entry<'_>,
    ) {
        let (handled, action) = slot.machine.on_message(offset, entry, &slot.limits);
        if handled == Handled::Skipped {
            self.metrics.skipped();
        }
        if let Some(action) = action {
            self.execute(consumer, partition, slot, action);
        }
    }
}

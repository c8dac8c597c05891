//! The record source: where the partitions' records come from. librdkafka's consumer always
//! runs the group (assignments, revokes, offset commits); either it also reads the partitions,
//! or tally's fetcher does and librdkafka keeps every partition paused. Every difference
//! between the two read paths is here, so the rest of the loop asks the source and never
//! which one it is.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::{Offset, TopicPartitionList};
use tally_kafka::{Fetcher, OffsetReset, Start};

use crate::machine::ownership::Resume;

/// Where the partitions' records come from.
pub(crate) enum Source {
    /// librdkafka's consumer reads them.
    Consumer,
    /// tally's fetcher reads them; its chunks carry the epoch of the partition's last seek.
    Fetcher(Fetcher),
}

impl Source {
    /// The source for `fetcher`: tally's when there is one, librdkafka's otherwise.
    pub(crate) fn new(fetcher: Option<Fetcher>) -> Self {
        fetcher.map_or(Source::Consumer, Source::Fetcher)
    }

    /// `Fetch` requests tally's fetcher sent so far (none through librdkafka).
    pub(crate) fn fetch_requests(&self) -> u64 {
        match self {
            Source::Fetcher(fetcher) => fetcher.requests(),
            Source::Consumer => 0,
        }
    }

    /// Whether each partition's lag is known from what was read (tally's fetcher reports where
    /// each log ends), rather than from librdkafka's statistics.
    pub(crate) fn knows_lag(&self) -> bool {
        matches!(self, Source::Fetcher(_))
    }

    /// Newly assigned partitions. librdkafka keeps an application pause across revoke and
    /// re-assign, so it is set explicitly: at-least-once partitions start reading; exactly-once
    /// ones wait, paused, until their fences are stamped and their position is known. With
    /// tally's fetcher, librdkafka reads nothing: every partition stays paused there, and each
    /// at-least-once partition is positioned at the group's committed offset.
    ///
    /// Returns the epoch of each partition positioned here.
    pub(crate) fn assigned<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        topic: &str,
        assigned: &TopicPartitionList,
        exactly_once: bool,
    ) -> HashMap<i32, u64> {
        let paused = match self {
            Source::Consumer if !exactly_once => consumer.resume(assigned),
            _ => consumer.pause(assigned),
        };
        if let Err(error) = paused {
            tracing::warn!(%error, "pausing/resuming newly assigned partitions failed");
        }
        let Source::Fetcher(fetcher) = self else {
            return HashMap::new();
        };
        if exactly_once {
            // Positioned once acquired (`seek`).
            return HashMap::new();
        }
        let committed = committed(consumer, topic, assigned);
        let reset = match fetcher.offset_reset() {
            OffsetReset::Latest => Start::Latest,
            OffsetReset::Earliest | OffsetReset::Error => Start::Earliest,
        };
        (assigned.elements_for_topic(topic).iter())
            .map(|element| {
                let partition = element.partition();
                let start = committed.get(&partition).copied().map_or(reset, Start::At);
                (partition, fetcher.seek(partition, start, false))
            })
            .collect()
    }

    /// Positions a partition (paused, as it is while acquired; the resume follows) at `resume`.
    /// Returns whether it is positioned; `epoch` becomes that of the seek, where the source
    /// has epochs.
    pub(crate) fn seek<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        topic: &str,
        partition: i32,
        resume: Resume,
        epoch: &mut u64,
    ) -> bool {
        match self {
            Source::Fetcher(fetcher) => {
                let start = match resume {
                    Resume::Beginning => Start::Earliest,
                    Resume::At(offset) => Start::At(offset),
                };
                *epoch = fetcher.seek(partition, start, true);
                true
            }
            Source::Consumer => {
                let offset = match resume {
                    Resume::Beginning => Offset::Beginning,
                    Resume::At(offset) => Offset::Offset(offset),
                };
                let sought = consumer.seek(topic, partition, offset, Duration::from_secs(10));
                if let Err(error) = &sought {
                    // Without the seek the position is unknown: stay paused and acquire again.
                    tracing::warn!(partition, %error, "seek failed; acquiring the partition again");
                }
                sought.is_ok()
            }
        }
    }

    /// Stops fetching a partition for now, keeping what was fetched: true if tally's fetcher
    /// reads it (the chunks already fetched, or on their way, are then the loop's to hold);
    /// librdkafka's consumer is paused as by [`Source::set_paused`].
    pub(crate) fn hold<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        topic: &str,
        partition: i32,
        epoch: &mut u64,
    ) -> bool {
        if let Source::Fetcher(fetcher) = self {
            fetcher.pause(partition);
            return true;
        }
        self.set_paused(consumer, topic, partition, true, None, epoch);
        false
    }

    /// Pauses or resumes reading a partition. A paused partition holds nothing more than it
    /// has read: tally's fetcher drops what it fetched past `read_to` (the next offset to
    /// read, if any was) and fetches from there once resumed, as librdkafka does. (A held
    /// partition, [`Source::hold`], keeps what was fetched.)
    pub(crate) fn set_paused<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        topic: &str,
        partition: i32,
        pause: bool,
        read_to: Option<i64>,
        epoch: &mut u64,
    ) {
        if let Source::Fetcher(fetcher) = self {
            match (pause, read_to) {
                (true, Some(next)) => *epoch = fetcher.seek(partition, Start::At(next), true),
                (true, None) => fetcher.pause(partition),
                (false, _) => fetcher.resume(partition),
            }
            return;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, partition);
        let result = if pause {
            consumer.pause(&tpl)
        } else {
            consumer.resume(&tpl)
        };
        match result {
            Ok(()) => tracing::debug!(partition, pause, "partition fetch paused/resumed"),
            Err(error) => tracing::warn!(partition, pause, %error, "pause/resume failed"),
        }
    }

    /// Partitions no longer owned: tally's fetcher stops reading them (librdkafka stops on its
    /// own when they are revoked).
    pub(crate) fn released(&self, partitions: impl IntoIterator<Item = i32>) {
        if let Source::Fetcher(fetcher) = self {
            for partition in partitions {
                fetcher.remove(partition);
            }
        }
    }
}

/// The group's committed offsets of `assigned`; a partition with none, or whose lookup failed,
/// is read from where `auto.offset.reset` says (its start unless it says `latest`), as
/// librdkafka does.
fn committed<X: ConsumerContext, K: Consumer<X>>(
    consumer: &K,
    topic: &str,
    assigned: &TopicPartitionList,
) -> HashMap<i32, i64> {
    match consumer.committed_offsets(assigned.clone(), Duration::from_secs(10)) {
        Ok(tpl) => (tpl.elements_for_topic(topic).iter())
            .filter_map(|e| match e.offset() {
                Offset::Offset(offset) => Some((e.partition(), offset)),
                _ => None,
            })
            .collect(),
        Err(error) => {
            tracing::warn!(%error, "reading the committed offsets failed; reading the partitions from their start");
            HashMap::new()
        }
    }
}

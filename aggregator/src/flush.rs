//! A flush: making one sealed batch durable, then reporting where its partition may resume.
//!
//! A flush first copies the batch's malformed messages to the dead-letter topic (waiting for
//! Kafka's acknowledgement), then applies the summed deltas to the partition's shard group
//! through the [`Sink`], retrying both with capped backoff until they succeed or the flush is
//! cancelled (shutdown or revoke deadline). Only a flush that returns [`FlushOutcome::Durable`]
//! lets its partition's offset move: **an offset is never committed past work that is not
//! durable.** A cancelled flush commits nothing, so its messages are read again by whoever owns
//! the partition next.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::batch::SealedBatch;
use crate::dead_letter::DeadLetterQueue;
use crate::metrics::Metrics;
use crate::sink::{Sink, SinkErrorKind};

/// How a flush ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushOutcome {
    /// Everything is durable; the partition may resume from `next_offset`.
    Durable {
        /// The offset to commit.
        next_offset: i64,
    },
    /// Cancelled before it was durable; nothing may be committed.
    Cancelled,
}

/// What every flush needs besides its batch.
#[derive(Debug, Clone)]
pub struct Flusher<S> {
    /// Where deltas go.
    pub sink: S,
    /// Where malformed messages go.
    pub dead_letters: DeadLetterQueue,
    /// Counts flushes, errors and latency.
    pub metrics: Arc<Metrics>,
    /// First retry delay.
    pub retry_initial: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
}

impl<S: Sink> Flusher<S> {
    /// Makes `batch` durable in `group`, retrying until it is or `cancel` fires.
    pub async fn flush(
        &self,
        partition: i32,
        group: u32,
        batch: SealedBatch,
        cancel: &CancellationToken,
    ) -> FlushOutcome {
        let started = Instant::now();
        let mut backoff = Backoff::new(self.retry_initial, self.retry_max);
        for letter in &batch.dead_letters {
            loop {
                match self.dead_letters.send(letter).await {
                    Ok(()) => {
                        self.metrics.dead_lettered(letter.reason);
                        break;
                    }
                    Err(error) => {
                        tracing::warn!(partition, offset = letter.offset, %error, "dead-letter write failed; retrying");
                        if sleep_or_cancel(backoff.next_delay(), cancel).await {
                            return FlushOutcome::Cancelled;
                        }
                    }
                }
            }
        }
        let mut backoff = Backoff::new(self.retry_initial, self.retry_max);
        loop {
            let attempt = tokio::select! {
                biased;
                () = cancel.cancelled() => return FlushOutcome::Cancelled,
                result = self.sink.apply(group, &batch.deltas) => result,
            };
            match attempt {
                Ok(()) => break,
                Err(error) => {
                    self.metrics.redis_error();
                    match error.kind {
                        SinkErrorKind::Retryable => {
                            tracing::warn!(partition, group, %error, "flush failed; retrying")
                        }
                        SinkErrorKind::Fatal => tracing::error!(
                            partition, group, %error,
                            "flush refused by Redis; retrying, but this needs an operator"
                        ),
                    }
                    if sleep_or_cancel(backoff.next_delay(), cancel).await {
                        return FlushOutcome::Cancelled;
                    }
                }
            }
        }
        self.metrics
            .batch_flushed(batch.events, batch.deltas.len(), started.elapsed());
        tracing::debug!(
            partition,
            group,
            events = batch.events,
            counters = batch.deltas.len(),
            next_offset = batch.next_offset,
            "flushed"
        );
        FlushOutcome::Durable {
            next_offset: batch.next_offset,
        }
    }
}

/// Sleeps for `delay`; true if `cancel` fired first.
async fn sleep_or_cancel(delay: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        () = cancel.cancelled() => true,
        () = tokio::time::sleep(delay) => false,
    }
}

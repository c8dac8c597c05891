//! A flush: making one sealed batch durable, then reporting where its partition may resume.
//!
//! A flush first copies the batch's malformed messages to the dead-letter topic (waiting for
//! Kafka's acknowledgement), then applies the summed deltas group by group through the [`Sink`],
//! retrying with capped backoff until they land or the flush is cancelled (shutdown or revoke
//! deadline). Only a flush that returns [`FlushOutcome::Durable`] lets its partition's offset
//! move: **an offset is never committed past work that is not durable.** A cancelled flush
//! commits nothing, so its messages are read again by whoever owns the partition next.
//!
//! In exactly-once mode (an [`Owner`] is given) each group write is fenced and deduplicated by the
//! group's ledger (see [`crate::store::fence`]); after the last group the partition's watermark moves
//! (in the same operation when the batch wrote only to the home group). A write refused by the
//! fence ends the flush as [`FlushOutcome::Fenced`]: another aggregator owns the partition now.
//! Counters that Redis cannot take (the sum would overflow 64 bits, or the key holds something
//! else) are dead-lettered with the reason and left out; the rest of the batch is applied.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::consume::dead_letter::DeadLetterQueue;
use crate::machine::batch::{GroupBatch, SealedBatch};
use crate::machine::letter::DeadLetter;
use crate::machine::outcome::{FlushOutcome, Standing};
use crate::machine::ownership::Owner;
use crate::operator::metrics::Metrics;
use crate::store::fence::Watermark;
use crate::store::sink::{
    Applied, GroupWrite, IdleWrite, Marked, Refused, Rejection, Sink, SinkError, SinkErrorKind,
};
use tally_kafka::backoff::Backoff;

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
    /// Trending sketches and the cache warmer, if on.
    pub trending: Option<Arc<crate::tasks::trending::Trending>>,
}

impl<S: Sink> Flusher<S> {
    /// Makes `batch` durable, retrying until it is, `cancel` fires, or (exactly-once, with
    /// `owner`) a fence refuses it.
    pub async fn flush(
        &self,
        partition: i32,
        mut batch: SealedBatch,
        owner: Option<Owner>,
        cancel: &CancellationToken,
    ) -> FlushOutcome {
        let started = Instant::now();
        if !self
            .send_dead_letters(partition, &batch.dead_letters, cancel)
            .await
        {
            return FlushOutcome::Cancelled;
        }
        let owner = match owner {
            None => {
                for g in &batch.groups {
                    // Memberships never reach this path: dedup namespaces need exactly-once;
                    // nor do expiries (expiring namespaces need it too).
                    let Some(rejected) = self
                        .retry(partition, g.group, cancel, || {
                            self.sink.apply(g.group, &g.deltas, &g.windows, &g.resets)
                        })
                        .await
                    else {
                        return FlushOutcome::Cancelled;
                    };
                    if !rejected.is_empty() {
                        // The refused deltas were not applied (the rest was): dead-letter them.
                        let letters = rejected_letters(partition, g, batch.next_offset, &rejected);
                        if !self.send_dead_letters(partition, &letters, cancel).await {
                            return FlushOutcome::Cancelled;
                        }
                    }
                }
                self.forget_cached(&batch).await;
                None
            }
            Some(owner) => match self
                .flush_fenced(partition, &mut batch, owner, cancel)
                .await
            {
                Ok(owner) => Some(owner),
                Err(outcome) => return outcome,
            },
        };
        let writes = batch.writes();
        self.metrics
            .batch_flushed(batch.events, writes, started.elapsed());
        tracing::debug!(
            partition,
            events = batch.events,
            writes,
            next_offset = batch.next_offset,
            ms = started.elapsed().as_millis(),
            "flushed"
        );
        FlushOutcome::Durable {
            next_offset: batch.next_offset,
            owner,
        }
    }

    /// The exactly-once path: one fenced write per group, then the watermark.
    async fn flush_fenced(
        &self,
        partition: i32,
        batch: &mut SealedBatch,
        mut owner: Owner,
        cancel: &CancellationToken,
    ) -> Result<Owner, FlushOutcome> {
        let next_offset = batch.next_offset;
        if !batch.expiries.is_empty() || !batch.touched.is_empty() {
            let write = IdleWrite {
                home: owner.home,
                field: &owner.field,
                epoch: owner.epoch,
                expiries: &batch.expiries,
                touched: &batch.touched,
            };
            let marked = self
                .retry(partition, owner.home, cancel, || self.sink.mark_idle(write))
                .await
                .ok_or(FlushOutcome::Cancelled)?;
            match marked {
                Marked::Decided(expired) => {
                    let expired = batch.settle(&expired);
                    self.metrics.expired(expired);
                    if expired > 0 && abort_after_expiry() {
                        tracing::error!(partition, "failpoint: aborting after an expiry decision");
                        std::process::abort();
                    }
                }
                Marked::Refused(Applied::Fenced) => return Err(self.fenced(partition, owner.home)),
                Marked::Refused(_) => return Err(self.rolled_back(partition, owner.home)),
            }
        }
        // A batch that wrote only into the home group moves the watermark in the same operation.
        let home_only = batch.groups.len() == 1 && batch.groups[0].group == owner.home;
        let groups = batch.groups.len();
        for (written, g) in batch.groups.iter_mut().enumerate() {
            let group = g.group;
            let watermark = home_only.then(|| {
                let mut after = owner.ledgers.clone();
                after[group as usize] = next_offset;
                Watermark::new(next_offset, &after, owner.spread.clone()).encode()
            });
            loop {
                let write = GroupWrite {
                    group,
                    field: &owner.field,
                    epoch: owner.epoch,
                    expected_ledger: owner.ledgers[group as usize],
                    next_offset,
                    deltas: &g.deltas,
                    windows: &g.windows,
                    resets: &g.resets,
                    members: &g.members,
                    watermark: watermark.as_deref(),
                };
                let applied = self
                    .retry(partition, group, cancel, || self.sink.apply_fenced(write))
                    .await
                    .ok_or(FlushOutcome::Cancelled)?;
                match applied {
                    Applied::Written => break,
                    Applied::AlreadyApplied => {
                        self.metrics.repeated_write();
                        break;
                    }
                    Applied::Fenced => return Err(self.fenced(partition, group)),
                    Applied::RolledBack => return Err(self.rolled_back(partition, group)),
                    Applied::Rejected(rejected) => {
                        let letters = rejected_letters(partition, g, next_offset, &rejected);
                        if !self.send_dead_letters(partition, &letters, cancel).await {
                            return Err(FlushOutcome::Cancelled);
                        }
                        // Highest index first in each list, so that a removal never moves an
                        // entry still to be removed.
                        let mut refused: Vec<Refused> =
                            rejected.iter().map(|r| r.refused).collect();
                        refused.sort_unstable_by(|a, b| b.cmp(a));
                        refused.dedup();
                        let mut members = Vec::new();
                        for r in refused {
                            match r {
                                Refused::Delta(i) => {
                                    g.deltas.swap_remove(i);
                                }
                                Refused::Window(i) => {
                                    g.windows.swap_remove(i);
                                }
                                Refused::Member(i) => members.push(i),
                            }
                        }
                        g.members.remove(&members);
                    }
                }
            }
            owner.ledgers[group as usize] = next_offset;
            if written + 1 < groups {
                abort_mid_flush(partition);
            }
        }
        if !home_only {
            let watermark = owner.watermark(next_offset).encode();
            let home = owner.home;
            let applied = self
                .retry(partition, home, cancel, || {
                    self.sink
                        .write_watermark(home, &owner.field, owner.epoch, &watermark)
                })
                .await
                .ok_or(FlushOutcome::Cancelled)?;
            match applied {
                Applied::Fenced => return Err(self.fenced(partition, home)),
                Applied::RolledBack => return Err(self.rolled_back(partition, home)),
                _ => {}
            }
        }
        self.forget_cached(batch).await;
        Ok(owner)
    }

    /// Drops the shared cached totals of the counters the batch reset (best effort: they expire
    /// within their namespace's TTL anyway).
    async fn forget_cached(&self, batch: &SealedBatch) {
        let mut reset: Vec<String> = (batch.groups.iter())
            .flat_map(|g| g.resets.iter().cloned())
            .collect();
        if reset.is_empty() {
            return;
        }
        reset.sort_unstable();
        reset.dedup();
        if let Err(error) = self.sink.forget_cached(&reset).await {
            tracing::warn!(%error, "could not drop the cached totals of reset counters");
        }
    }

    /// Checks an idle partition's standing in Redis ([`crate::store::fence::verify`]): a rollback found
    /// here re-feeds the partition without waiting for its next event.
    pub async fn verify(&self, partition: i32, owner: &Owner) -> Standing {
        match crate::store::fence::verify(&self.sink, owner).await {
            Ok(Applied::Written) => Standing::Held,
            Ok(Applied::Fenced) => {
                self.fenced(partition, owner.home);
                Standing::Fenced
            }
            Ok(_) => {
                self.rolled_back(partition, owner.home);
                Standing::RolledBack
            }
            Err(error) => {
                // The next check (or the next flush) asks again.
                self.metrics.redis_error();
                tracing::debug!(partition, %error, "checking an idle partition failed");
                Standing::Held
            }
        }
    }

    fn fenced(&self, partition: i32, group: u32) -> FlushOutcome {
        self.metrics.fenced();
        tracing::warn!(
            partition,
            group,
            "write refused by the fence: another aggregator owns this partition now"
        );
        FlushOutcome::Fenced
    }

    fn rolled_back(&self, partition: i32, group: u32) -> FlushOutcome {
        self.metrics.rolled_back();
        tracing::warn!(
            partition,
            group,
            "Redis lost writes this partition had made (restarted from an older state): re-feeding it from Kafka"
        );
        FlushOutcome::RolledBack
    }

    /// Copies `letters` to the dead-letter topic, retrying each until Kafka acknowledges it.
    /// False if cancelled first.
    async fn send_dead_letters(
        &self,
        partition: i32,
        letters: &[DeadLetter],
        cancel: &CancellationToken,
    ) -> bool {
        for letter in letters {
            let mut backoff = Backoff::new(self.retry_initial, self.retry_max);
            loop {
                match self.dead_letters.send(letter).await {
                    Ok(()) => {
                        self.metrics.dead_lettered(letter.reason);
                        break;
                    }
                    Err(error) => {
                        tracing::warn!(partition, offset = letter.offset, %error, "dead-letter write failed; retrying");
                        if sleep_or_cancel(backoff.next_delay(), cancel).await {
                            return false;
                        }
                    }
                }
            }
        }
        true
    }

    /// Runs `op` until it succeeds, with capped backoff; `None` if cancelled first.
    async fn retry<T, F, Fut>(
        &self,
        partition: i32,
        group: u32,
        cancel: &CancellationToken,
        mut op: F,
    ) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, SinkError>>,
    {
        let mut backoff = Backoff::new(self.retry_initial, self.retry_max);
        loop {
            let attempt = tokio::select! {
                biased;
                () = cancel.cancelled() => return None,
                result = op() => result,
            };
            match attempt {
                Ok(value) => return Some(value),
                Err(error) => {
                    self.metrics.redis_error();
                    match error.kind {
                        SinkErrorKind::Retryable => {
                            tracing::warn!(partition, group, %error, "store write failed; retrying")
                        }
                        SinkErrorKind::Fatal => tracing::error!(
                            partition, group, %error,
                            "the store refused the write; retrying, but this needs an operator"
                        ),
                    }
                    if sleep_or_cancel(backoff.next_delay(), cancel).await {
                        return None;
                    }
                }
            }
        }
    }
}

/// Dead letters for deltas that Redis cannot take: the summed delta and why, one per counter.
fn rejected_letters(
    partition: i32,
    batch: &GroupBatch,
    next_offset: i64,
    rejected: &[Rejection],
) -> Vec<DeadLetter> {
    let group = batch.group;
    let (deltas, windows, members) = (&batch.deltas, &batch.windows, &batch.members);
    rejected
        .iter()
        .map(|rejection| {
            let (counter, payload, delta) = match rejection.refused {
                Refused::Delta(i) => {
                    let (counter, delta) = &deltas[i];
                    let payload = serde_json::json!({ "counter": counter, "delta": delta });
                    (counter.as_str(), payload, *delta)
                }
                Refused::Window(i) => {
                    let w = &windows[i];
                    let payload = serde_json::json!({
                        "counter": &*w.counter,
                        "delta": w.delta,
                        "window_ms": w.width_ms,
                        "bucket_start_ms": w.start_ms,
                    });
                    (&*w.counter, payload, w.delta)
                }
                Refused::Member(i) => {
                    let m = members.get(i);
                    let delta = if m.like { 1 } else { -1 };
                    let payload = serde_json::json!({ "counter": m.counter, "actor": m.actor, "delta": delta });
                    (m.counter, payload, delta)
                }
            };
            DeadLetter {
                key: Some(counter.as_bytes().to_vec()),
                payload: Some(payload.to_string().into_bytes()),
                reason: rejection.reason,
                error: format!(
                    "the summed delta {delta} of {counter} (messages up to offset {}) cannot be added in group {group}: {}",
                    next_offset - 1,
                    rejection.reason
                ),
                partition,
                offset: next_offset - 1,
            }
        })
        .collect()
}

/// Test-only failpoint (`TALLY_FAILPOINT_ABORT_AFTER_EXPIRY`): abort the process right after the
/// home group decided that a counter expired, before any group is written, so that the replay
/// must decide every group's part from the recorded decision.
fn abort_after_expiry() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TALLY_FAILPOINT_ABORT_AFTER_EXPIRY").is_some())
}

/// Test-only failpoint (`TALLY_FAILPOINT_ABORT_MID_FLUSH=n`): abort the process right after the
/// `n`th group write that has more groups of its flush still to write, so that a restart finds
/// one flush applied in some groups and not others.
fn abort_mid_flush(partition: i32) {
    static AFTER: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    static SEEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let after = AFTER.get_or_init(|| {
        let value = std::env::var("TALLY_FAILPOINT_ABORT_MID_FLUSH").ok()?;
        value.parse().ok()
    });
    if let Some(after) = *after {
        let seen = SEEN.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if seen >= after {
            eprintln!("failpoint: aborting in the middle of a flush of partition {partition}");
            std::process::abort();
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

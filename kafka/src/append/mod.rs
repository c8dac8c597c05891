//! [`Appender`]: appends records to a topic, batched per partition, as an idempotent producer
//! (`enable.idempotence`, `acks = all`) and with librdkafka's default partitioner, so that a
//! key lands in the partition a librdkafka producer would send it to.
//!
//! The owner's thread appends: each record is encoded straight into its partition's open batch
//! (under one mutex, no allocation, no clock read per record). A batch is sealed when it is
//! full or has lingered; an I/O thread of the appender's own sends each broker one `Produce` at
//! a time, holding at most one batch of each partition in flight, and queues what became of
//! every record. The owner collects those with [`Appender::completions`].
//!
//! # Order and retries
//! A partition's batches get consecutive sequence numbers when they are first sent, and a
//! partition's next batch is sent only once the previous one is answered. A batch that failed in
//! a way that may be retried (a leader moved, replicas were short, the connection dropped) goes
//! back to the head of its partition and is sent again byte for byte: if the first attempt had
//! landed, the broker recognises the sequence and answers `DUPLICATE_SEQUENCE_NUMBER`, a
//! success. So every record is written once, in order, through broker failures; one that is not
//! acknowledged within `delivery_timeout` is reported failed. A batch refused for good (too
//! large, not authorized, a sequence the broker does not accept) fails with every record queued
//! after it in that partition, so no later record is written past a gap.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::config::AppendConfig;
use crate::records::{self};

mod io;
mod state;

use io::io_main;
pub use state::Completion;
use state::{Open, Shared, State, seal, wall_ms};

/// Why a record was not appended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppendError {
    /// As many records are appended and not yet reported as the appender holds: collect
    /// completions and try again.
    #[error("the appender holds as many records as it may")]
    Full,
    /// The partition refused an earlier batch for good.
    #[error("the partition refused an earlier batch: {0}")]
    Failed(String),
    /// The appender could not start.
    #[error("{0}")]
    Start(String),
}

/// Appends records to one topic. Dropping it stops its I/O thread; records not reported by then
/// are lost to the caller (wait for their completions first: [`Appender::send_now`], [`Appender::wait`], [`Appender::completions`]).
pub struct Appender {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Appender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Appender")
            .field("topic", &self.shared.config.topic)
            .finish_non_exhaustive()
    }
}

impl Drop for Appender {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.work.notify_waiters();
        self.shared.stale.notify_one();
    }
}

impl Appender {
    /// Starts the appender's I/O thread and waits until it knows the topic's partitions and has
    /// its producer id (at most the connection timeout).
    pub fn start(config: AppendConfig) -> Result<Self, AppendError> {
        let wait = config.client.timeout.min(Duration::from_secs(30));
        let shared = Arc::new(Shared {
            config,
            state: Mutex::new(State::default()),
            work: Notify::new(),
            stale: Notify::new(),
            reported: Condvar::new(),
            now_ms: AtomicI64::new(wall_ms()),
            stop: AtomicBool::new(false),
        });
        let io = shared.clone();
        std::thread::Builder::new()
            .name("tally-append".into())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime.block_on(io_main(io)),
                    Err(e) => {
                        io.lock().start_error = Some(format!("cannot start the I/O thread: {e}"))
                    }
                }
            })
            .map_err(|e| AppendError::Start(format!("cannot start the I/O thread: {e}")))?;
        let deadline = Instant::now() + wait;
        let mut state = shared.lock();
        loop {
            if state.producer.is_some() && !state.parts.is_empty() {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let last = state.start_error.clone().unwrap_or_default();
                return Err(AppendError::Start(format!(
                    "no metadata for {} and producer id from {:?} within {wait:?}: {last}",
                    shared.config.topic, shared.config.client.bootstrap
                )));
            }
            state = (shared.reported.wait_timeout(state, left))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        drop(state);
        Ok(Self { shared })
    }

    /// Appends a record with `key` (routed as librdkafka's default partitioner routes it: CRC-32
    /// of the key modulo the partition count; no key, or an empty one: the partition unkeyed
    /// records stick to until its batch is sent) and `value`; `token` comes back in its
    /// [`Completion`].
    pub fn append(
        &self,
        key: Option<&[u8]>,
        value: &[u8],
        token: usize,
    ) -> Result<(), AppendError> {
        let config = &self.shared.config;
        let mut state = self.shared.lock();
        if state.queued >= config.max_queued {
            // The caller waits for room: lingering would only make it wait longer.
            for part in &mut state.parts {
                seal(part);
            }
            drop(state);
            self.shared.work.notify_waiters();
            return Err(AppendError::Full);
        }
        let partitions = state.parts.len();
        let partition = match key.filter(|k| !k.is_empty()) {
            Some(key) => crc32fast::hash(key) as usize % partitions,
            None => match state.sticky.filter(|p| state.parts[*p].open.is_some()) {
                Some(p) => p,
                None => {
                    let p = rand::random::<u32>() as usize % partitions;
                    state.sticky = Some(p);
                    p
                }
            },
        };
        let part = &mut state.parts[partition];
        if let Some(error) = &part.failed {
            return Err(AppendError::Failed(error.clone()));
        }
        let now = self.shared.now_ms.load(Ordering::Relaxed);
        let open = part.open.get_or_insert_with(|| Open {
            records: Vec::with_capacity(config.batch_bytes.min(1 << 20)),
            tokens: Vec::new(),
            base_timestamp: now,
            max_timestamp: now,
            opened: Instant::now(),
        });
        let offset_delta = open.tokens.len() as i32;
        records::put_record(
            &mut open.records,
            offset_delta,
            now - open.base_timestamp,
            key,
            value,
        );
        open.tokens.push(token);
        open.max_timestamp = open.max_timestamp.max(now);
        let full =
            open.records.len() >= config.batch_bytes || open.tokens.len() >= config.batch_records;
        if full {
            seal(part);
        }
        state.queued += 1;
        drop(state);
        if full {
            self.shared.work.notify_waiters();
        }
        Ok(())
    }

    /// What became of records since the last call.
    pub fn completions(&self) -> Vec<Completion> {
        std::mem::take(&mut self.shared.lock().completions)
    }

    /// Records appended whose completion is not queued yet.
    pub fn in_flight(&self) -> usize {
        self.shared.lock().queued
    }

    /// Waits up to `timeout` for a completion to be queued (returns at once if one is).
    pub fn wait(&self, timeout: Duration) {
        let state = self.shared.lock();
        if state.completions.is_empty() {
            let _ = self.shared.reported.wait_timeout(state, timeout);
        }
    }

    /// Sends every open batch now, without waiting for its linger.
    pub fn send_now(&self) {
        let mut state = self.shared.lock();
        for part in &mut state.parts {
            seal(part);
        }
        drop(state);
        self.shared.work.notify_waiters();
    }
}

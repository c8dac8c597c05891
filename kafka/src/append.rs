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

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

use crate::config::{AppendConfig, Codec};
use crate::connection::{Connection, ConnectionError};
use crate::protocol::{self, ErrorCode};
use crate::records::{self, Stamp};

/// Shortest and longest wait before trying a failed connection again.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(20), Duration::from_secs(1));

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

/// A batch being filled.
#[derive(Debug)]
struct Open {
    records: Vec<u8>,
    tokens: Vec<usize>,
    base_timestamp: i64,
    max_timestamp: i64,
    opened: Instant,
}

/// A batch waiting to be sent, or to be sent again.
#[derive(Debug)]
struct Sealed {
    records: Vec<u8>,
    tokens: Vec<usize>,
    base_timestamp: i64,
    max_timestamp: i64,
    /// When its first record was appended: its records fail `delivery_timeout` after.
    created: Instant,
    /// Its producer id, epoch and sequence number, given when it is first taken for sending.
    stamp: Option<Stamp>,
    /// The encoded batch: what every attempt sends.
    encoded: Option<Vec<u8>>,
}

/// One partition's state.
#[derive(Debug, Default)]
struct Part {
    open: Option<Open>,
    ready: VecDeque<Sealed>,
    in_flight: bool,
    next_sequence: i32,
    leader: Option<i32>,
    /// Refused for good: every record of this partition fails.
    failed: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    parts: Vec<Part>,
    brokers: HashMap<i32, String>,
    running: HashSet<i32>,
    /// The idempotent producer's id and epoch, once known.
    producer: Option<(i64, i16)>,
    /// The partition unkeyed records go to until its batch is sealed.
    sticky: Option<usize>,
    /// Records appended and not yet reported.
    queued: usize,
    /// The last failure while starting, if any.
    start_error: Option<String>,
    completions: Vec<Completion>,
}

struct Shared {
    config: AppendConfig,
    state: Mutex<State>,
    /// Batches are ready to send, or leaders changed.
    work: Notify,
    /// Metadata should be asked for again.
    stale: Notify,
    /// Completions were queued, or start-up ended.
    reported: Condvar,
    /// Milliseconds since the epoch, updated by the I/O thread: the records' create time.
    now_ms: AtomicI64,
    stop: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Appends records to one topic. Dropping it stops its I/O thread; records not reported by then
/// are lost to the caller (call [`Appender::flush`] first).
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

/// Moves a partition's open batch, if any, to its queue.
fn seal(part: &mut Part) {
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
fn fail_partition(part: &mut Part, error: &str, out: &mut Vec<Completion>) {
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
fn expire(state: &mut State, timeout: Duration) -> Vec<Completion> {
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
fn complete(shared: &Shared, state: &mut State, completions: impl IntoIterator<Item = Completion>) {
    for c in completions {
        state.queued -= match &c {
            Completion::Written { tokens, .. } | Completion::Failed { tokens, .. } => tokens.len(),
        };
        state.completions.push(c);
    }
    shared.reported.notify_all();
}

/// The I/O thread's work: the clock, lingering batches, metadata, the producer id, and one task
/// per broker.
async fn io_main(shared: Arc<Shared>) {
    let ticker = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let every = (shared.config.linger / 2)
                .clamp(Duration::from_millis(1), Duration::from_millis(50));
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                shared.now_ms.store(wall_ms(), Ordering::Relaxed);
                let mut sealed = false;
                {
                    let mut state = shared.lock();
                    let linger = shared.config.linger;
                    for part in &mut state.parts {
                        if part
                            .open
                            .as_ref()
                            .is_some_and(|o| o.opened.elapsed() >= linger)
                        {
                            seal(part);
                            sealed = true;
                        }
                    }
                    let expired = expire(&mut state, shared.config.delivery_timeout);
                    if !expired.is_empty() {
                        complete(&shared, &mut state, expired);
                    }
                }
                if sealed {
                    shared.work.notify_waiters();
                }
            }
        })
    };
    metadata_loop(shared.clone()).await;
    ticker.abort();
}

/// Keeps the partition count, the leaders and the producer id known; starts a task for each
/// leading broker. Returns when the appender is dropped.
async fn metadata_loop(shared: Arc<Shared>) {
    let config = &shared.config;
    let mut connection: Option<Connection> = None;
    let mut backoff = BACKOFF.0;
    while !shared.stop.load(Ordering::Acquire) {
        let outcome = async {
            if connection.is_none() {
                let known: Vec<String> = shared.lock().brokers.values().cloned().collect();
                let opened = Connection::any(&config.client, &known).await.map_err(|e| {
                    e.map_or_else(|| "no broker to ask".to_owned(), |e| e.to_string())
                })?;
                connection = Some(opened);
            }
            let Some(c) = connection.as_mut() else {
                return Err("no connection".to_owned());
            };
            let metadata = c
                .metadata(&config.topic, true)
                .await
                .map_err(|e| e.to_string())?;
            if metadata.topic_error.is_error() {
                return Err(format!(
                    "metadata for {}: {}",
                    config.topic, metadata.topic_error
                ));
            }
            let producer = if shared.lock().producer.is_none() {
                Some(init_producer_id(c).await?)
            } else {
                None
            };
            Ok((metadata, producer))
        }
        .await;
        match outcome {
            Ok((metadata, producer)) => {
                backoff = BACKOFF.0;
                let leaderless = apply_metadata(&shared, &metadata, producer);
                shared.work.notify_waiters();
                let wait = if leaderless {
                    BACKOFF.1 / 4
                } else {
                    config.metadata_refresh
                };
                let _ = tokio::time::timeout(wait, shared.stale.notified()).await;
            }
            Err(error) => {
                tracing::warn!(%error, "appender: metadata request failed; retrying");
                connection = None;
                {
                    let mut state = shared.lock();
                    if state.producer.is_none() {
                        state.start_error = Some(error);
                    }
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF.1);
            }
        }
    }
}

/// Takes in the topic's metadata (and the producer id, once): partition count, leaders, a task
/// for each new leading broker; returns whether a partition has no leader.
fn apply_metadata(
    shared: &Arc<Shared>,
    metadata: &protocol::Metadata,
    producer: Option<(i64, i16)>,
) -> bool {
    let mut state = shared.lock();
    if let Some(p) = producer {
        state.producer = Some(p);
    }
    state.brokers = (metadata.brokers.iter())
        .map(|b| (b.node_id, format!("{}:{}", b.host, b.port)))
        .collect();
    let count = (metadata.partitions.iter())
        .map(|p| p.partition + 1)
        .max()
        .unwrap_or(0);
    if count as usize > state.parts.len() {
        state.parts.resize_with(count as usize, Part::default);
    }
    for p in &metadata.partitions {
        let leader = (p.leader >= 0 && !p.error.is_error()).then_some(p.leader);
        state.parts[p.partition as usize].leader = leader;
        if let Some(node) = leader
            && state.running.insert(node)
        {
            tokio::spawn(broker_task(shared.clone(), node));
        }
    }
    shared.reported.notify_all();
    state.parts.iter().any(|p| p.leader.is_none())
}

async fn init_producer_id(c: &mut Connection) -> Result<(i64, i16), String> {
    let mut buf = Vec::new();
    c.request(
        protocol::INIT_PRODUCER_ID,
        protocol::init_producer_id_request,
        &mut buf,
    )
    .await
    .map_err(|e| e.to_string())?;
    let (error, id, epoch) = protocol::parse_init_producer_id(&buf).map_err(|e| e.to_string())?;
    if error.is_error() {
        return Err(format!("InitProducerId: {error}"));
    }
    Ok((id, epoch))
}

/// A batch taken for one request.
struct Taken {
    partition: usize,
    batch: Sealed,
}

/// Takes the head batch of every partition `node` leads that has one and none in flight,
/// stamping first attempts with their sequence numbers (consecutive per partition).
fn take_batches(state: &mut State, node: i32) -> Vec<Taken> {
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
fn encode(codec: Codec, batch: &Sealed, stamp: Stamp) -> Vec<u8> {
    let compressed = match codec {
        Codec::None => None,
        Codec::Lz4 => {
            let mut encoder =
                lz4_flex::frame::FrameEncoder::new(Vec::with_capacity(batch.records.len() / 2));
            encoder
                .write_all(&batch.records)
                .ok()
                .and_then(|()| encoder.finish().ok())
                .map(|out| (3i16, out))
        }
        Codec::Gzip => {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder
                .write_all(&batch.records)
                .ok()
                .and_then(|()| encoder.finish().ok())
                .map(|out| (1i16, out))
        }
    }
    .filter(|(_, out)| out.len() < batch.records.len());
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

/// Sends the batches of the partitions `node` leads, one request at a time, until the appender
/// is dropped.
async fn broker_task(shared: Arc<Shared>, node: i32) {
    let config = &shared.config;
    let mut connection: Option<Connection> = None;
    let mut response = Vec::new();
    let mut backoff = BACKOFF.0;
    let timeout_ms = i32::try_from(config.client.timeout.as_millis())
        .unwrap_or(i32::MAX)
        .min(30_000);
    while !shared.stop.load(Ordering::Acquire) {
        let (mut taken, address) = loop {
            let work = shared.work.notified();
            {
                let mut state = shared.lock();
                let taken = take_batches(&mut state, node);
                if !taken.is_empty() {
                    break (taken, state.brokers.get(&node).cloned());
                }
            }
            if shared.stop.load(Ordering::Acquire) {
                return;
            }
            // Also woken by the ticker's sealing; a timeout re-checks delivery timeouts.
            let _ = tokio::time::timeout(Duration::from_millis(500), work).await;
        };
        // Encoded (compressed) outside the lock, once: every attempt sends the same bytes.
        for t in &mut taken {
            if let (None, Some(stamp)) = (&t.batch.encoded, t.batch.stamp) {
                t.batch.encoded = Some(encode(config.codec, &t.batch, stamp));
                t.batch.records = Vec::new();
            }
        }
        let sent = async {
            let Some(address) = address else {
                return Err(None);
            };
            let c = Connection::reuse(&mut connection, &address, &config.client)
                .await
                .map_err(Some)?;
            let batches: Vec<(i32, &[u8])> = (taken.iter())
                .map(|t| {
                    (
                        t.partition as i32,
                        t.batch.encoded.as_deref().unwrap_or_default(),
                    )
                })
                .collect();
            c.request_waiting(
                protocol::PRODUCE,
                |w| protocol::produce_request(w, &config.topic, timeout_ms, &batches),
                &mut response,
                Duration::from_millis(timeout_ms as u64),
            )
            .await
            .map_err(Some)?;
            protocol::parse_produce(&response, &config.topic).map_err(|e| {
                Some(ConnectionError::Malformed {
                    broker: address.clone(),
                    source: e,
                })
            })
        }
        .await;
        let answers = match sent {
            Ok(answers) => {
                backoff = BACKOFF.0;
                answers
            }
            Err(error) => {
                if let Some(error) = &error {
                    tracing::warn!(node, %error, "appender: produce failed; sending again");
                }
                connection = None;
                Vec::new()
            }
        };
        let retry = settle(&shared, node, taken, &answers);
        if retry {
            shared.stale.notify_one();
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF.1);
        }
        shared.work.notify_waiters();
    }
}

/// Carries out a request's answers (none if it failed as a whole): batches written or refused
/// for good are completed, the others go back to the head of their partition; returns whether
/// any is to be sent again.
fn settle(
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

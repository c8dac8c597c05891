//! [`Fetcher`]: reads a topic's partitions straight from their leaders, one `Fetch` request per
//! broker at a time covering every partition it leads, and hands out each partition's records as
//! [`Chunk`]s: decompressed, aborted transactions left out, parsed in place by the reader.
//!
//! The owner decides what is read: [`Fetcher::seek`] starts (or restarts) a partition at an
//! offset and returns a new *epoch*; [`Fetcher::pause`], [`Fetcher::resume`] and
//! [`Fetcher::remove`] do what they say. Every chunk carries the epoch it was fetched under, so
//! a chunk fetched before a seek is recognised and dropped by its reader.
//!
//! # Order and flow
//! A partition is in at most one request at a time, and its chunk is queued before it can be
//! fetched again, so a partition's chunks arrive in log order even when its leadership moves.
//! The bytes handed out and not yet dropped are counted: past `max_buffered_bytes` no broker
//! sends another fetch until the reader catches up, so memory stays bounded while the reader is
//! slow, exactly as librdkafka's `queued.max.messages.kbytes` bounds its prefetch.
//!
//! # Failures
//! A broker that cannot be reached, or that answers that it no longer leads a partition, makes
//! the fetcher ask for the topic's metadata again (with capped backoff) and go on with the new
//! leaders; nothing is skipped. An offset outside the log (retention deleted it) is reset to the
//! log's start and reported as [`Fetched::Reset`]. Authentication and version failures are
//! reported as [`Fetched::Failed`] and retried with backoff: the owner decides whether to stop.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;

use crate::compression;
use crate::config::{FetchConfig, OffsetReset};
use crate::connection::Connection;
use crate::protocol::{self, ErrorCode, FetchPartition, LogEnd};
use crate::records::{self, BatchHeader, Control, RawBatch, Record, Records};

/// Shortest and longest wait before trying a failed connection or metadata request again.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(2));

/// How often metadata is asked for when nothing asks for it.
const METADATA_REFRESH: Duration = Duration::from_secs(60);

/// Shortest time between two metadata requests, however often fetches find leadership stale.
const METADATA_SPACING: Duration = Duration::from_millis(100);

/// How long a partition whose fetch failed waits before it is fetched again (librdkafka's
/// `fetch.error.backoff.ms`).
const FETCH_ERROR_BACKOFF: Duration = Duration::from_millis(500);

/// Wanted offsets meaning "where the log starts" and "where it ends", resolved by the leader
/// before fetching (Kafka's own sentinels in `ListOffsets`).
const EARLIEST: i64 = -2;
const LATEST: i64 = -1;

/// Where [`Fetcher::seek`] starts reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// At this offset.
    At(i64),
    /// At the first offset still in the log.
    Earliest,
    /// At the log's end: what is appended from now on.
    Latest,
}

/// What the fetcher hands its owner.
#[derive(Debug)]
pub enum Fetched {
    /// Records of one partition, in log order.
    Chunk(Chunk),
    /// A partition's offset was outside its log: it moved as `auto.offset.reset` says (`to`), or
    /// (`error`) it is fetched no more until it is sought (`to` is `None`).
    OutOfRange {
        /// The partition.
        partition: i32,
        /// The epoch it was read under.
        epoch: u64,
        /// The offset that was out of range.
        from: i64,
        /// Where reading goes on, if it does.
        to: Option<i64>,
    },
    /// Something failed that retrying may not cure (credentials, authorization, versions); the
    /// fetcher keeps trying with backoff.
    Failed {
        /// What failed.
        error: String,
    },
}

/// Something a chunk holds.
#[derive(Debug)]
enum Piece {
    /// A batch of records.
    Batch(BatchPiece),
    /// Offsets that could not be read (a codec not supported, a corrupt batch, an old format):
    /// their bytes are `data[range]`.
    Undecodable {
        first_offset: i64,
        last_offset: i64,
        range: std::ops::Range<usize>,
        reason: String,
    },
}

/// A batch in a chunk: its records section (decompressed) is `data[range]`, its records (from
/// the chunk's start) `located[records]`, and then, if a record was malformed, why.
#[derive(Debug)]
struct BatchPiece {
    header: BatchHeader,
    range: std::ops::Range<usize>,
    records: std::ops::Range<usize>,
    malformed: Option<String>,
}

/// One partition's records from one fetch response: owned, decompressed, read in place with
/// [`Chunk::items`].
pub struct Chunk {
    /// The partition.
    pub partition: i32,
    /// The epoch of the seek it was fetched under.
    pub epoch: u64,
    /// Where the partition's log ended at the broker (its last stable offset): the reader is
    /// caught up when it has read up to here.
    pub log_end: i64,
    /// The offset fetched from: records before it (in the first batch) are not items.
    start: i64,
    pieces: Vec<Piece>,
    data: Vec<u8>,
    /// Where each record lies in `data`, found when the chunk is built (on the fetch task), so
    /// that its reader (the consume loop's thread) only slices: walking the records there was
    /// ~13% of that thread's samples in a JSON catch-up.
    located: Vec<Located>,
    /// Gives the bytes back to the fetcher's budget when the chunk is dropped.
    budget: Arc<Budget>,
}

/// What a chunk with this data and these records counts against the fetcher's budget.
fn held(data: &[u8], located: &[Located]) -> usize {
    std::mem::size_of_val(data) + std::mem::size_of_val(located)
}

/// A record's place in its chunk.
#[derive(Debug, Clone, Copy)]
struct Located {
    offset: i64,
    timestamp_ms: i64,
    key: Place,
    value: Place,
}

/// Where bytes lie in a chunk's data, if anywhere.
#[derive(Debug, Clone, Copy)]
struct Place {
    start: usize,
    end: usize,
}

impl Place {
    const NONE: Place = Place {
        start: usize::MAX,
        end: 0,
    };

    /// The place of `part` (borrowed from `data`).
    fn of(data: &[u8], part: Option<&[u8]>) -> Self {
        part.map_or(Place::NONE, |p| {
            let start = p.as_ptr().addr() - data.as_ptr().addr();
            Place {
                start,
                end: start + p.len(),
            }
        })
    }

    fn get(self, data: &[u8]) -> Option<&[u8]> {
        (self.start != usize::MAX).then(|| &data[self.start..self.end])
    }
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chunk")
            .field("partition", &self.partition)
            .field("epoch", &self.epoch)
            .field("log_end", &self.log_end)
            .field("start", &self.start)
            .field("bytes", &self.data.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        self.budget.release(self.len_bytes());
        self.budget.recycle(
            std::mem::take(&mut self.data),
            std::mem::take(&mut self.located),
        );
    }
}

/// An item of a chunk.
#[derive(Debug)]
pub enum Item<'a> {
    /// A record.
    Record(Record<'a>),
    /// Offsets that could not be read, with their raw bytes and why.
    Undecodable {
        /// The first offset not read.
        first_offset: i64,
        /// The last.
        last_offset: i64,
        /// The bytes that could not be read.
        bytes: &'a [u8],
        /// Why.
        reason: String,
    },
}

impl Chunk {
    /// Its records (and undecodable stretches), in log order.
    pub fn items(&self) -> Items<'_> {
        Items {
            chunk: self,
            next_piece: 0,
            batch: None,
        }
    }

    /// Bytes it holds (its data, and where its records lie), as the fetcher's budget counts
    /// them.
    pub fn len_bytes(&self) -> usize {
        held(&self.data, &self.located)
    }
}

/// The iterator [`Chunk::items`] returns.
#[derive(Debug)]
pub struct Items<'a> {
    chunk: &'a Chunk,
    next_piece: usize,
    /// The batch being read, and its records not yet read (indices into `located`).
    batch: Option<(&'a BatchPiece, std::ops::Range<usize>)>,
}

impl<'a> Iterator for Items<'a> {
    type Item = Item<'a>;

    fn next(&mut self) -> Option<Item<'a>> {
        let chunk = self.chunk;
        loop {
            if let Some((batch, unread)) = &mut self.batch {
                if let Some(i) = unread.next() {
                    let at = chunk.located[i];
                    return Some(Item::Record(Record {
                        offset: at.offset,
                        timestamp_ms: at.timestamp_ms,
                        key: at.key.get(&chunk.data),
                        value: at.value.get(&chunk.data),
                    }));
                }
                let batch = *batch;
                self.batch = None;
                if let Some(reason) = &batch.malformed {
                    return Some(Item::Undecodable {
                        first_offset: batch.header.base_offset.max(chunk.start),
                        last_offset: batch.header.last_offset(),
                        bytes: &chunk.data[batch.range.clone()],
                        reason: reason.clone(),
                    });
                }
            }
            let piece = chunk.pieces.get(self.next_piece)?;
            self.next_piece += 1;
            match piece {
                Piece::Batch(batch) => self.batch = Some((batch, batch.records.clone())),
                Piece::Undecodable {
                    first_offset,
                    last_offset,
                    range,
                    reason,
                } => {
                    return Some(Item::Undecodable {
                        first_offset: *first_offset,
                        last_offset: *last_offset,
                        bytes: &chunk.data[range.clone()],
                        reason: reason.clone(),
                    });
                }
            }
        }
    }
}

/// The bytes handed out and not yet dropped, and the buffers of dropped chunks, kept for the
/// next (a fresh buffer of a few MiB costs its pages' faults and zeroing every time).
#[derive(Debug)]
struct Budget {
    held: AtomicUsize,
    max: usize,
    freed: Notify,
    spare: Mutex<Vec<(Vec<u8>, Vec<Located>)>>,
}

/// Most buffers kept for reuse.
const SPARE_BUFFERS: usize = 16;

impl Budget {
    fn new(max: usize) -> Self {
        Self {
            held: AtomicUsize::new(0),
            max: max.max(1),
            freed: Notify::new(),
            spare: Mutex::new(Vec::new()),
        }
    }

    /// Empty buffers for a chunk's data and records, reused if some are spare.
    fn buffers(&self) -> (Vec<u8>, Vec<Located>) {
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        spare.pop().unwrap_or_default()
    }

    /// Keeps a chunk's buffers for reuse, if there is room.
    fn recycle(&self, mut data: Vec<u8>, mut located: Vec<Located>) {
        data.clear();
        located.clear();
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        if spare.len() < SPARE_BUFFERS && data.capacity() > 0 {
            spare.push((data, located));
        }
    }

    fn hold(&self, n: usize) {
        self.held.fetch_add(n, Ordering::AcqRel);
    }

    fn release(&self, n: usize) {
        let before = self.held.fetch_sub(n, Ordering::AcqRel);
        if before >= self.max && before - n < self.max {
            self.freed.notify_waiters();
        }
    }

    /// Waits until there is room for another fetch.
    async fn room(&self) {
        loop {
            let freed = self.freed.notified();
            if self.held.load(Ordering::Acquire) < self.max {
                return;
            }
            freed.await;
        }
    }
}

/// A partition the owner reads.
#[derive(Debug, Clone, Copy)]
struct Wanted {
    /// The next offset to fetch.
    offset: i64,
    /// Bumped by every seek.
    epoch: u64,
    /// Not fetched while paused.
    paused: bool,
    /// In a request now (only that request's broker task clears it).
    in_flight: bool,
    /// Not fetched before then: its last fetch failed.
    not_before: Option<std::time::Instant>,
}

/// State the tasks share.
#[derive(Debug, Default)]
struct State {
    /// Partitions being read, by index.
    wanted: HashMap<i32, Wanted>,
    /// Each partition's leader, by node id.
    leaders: HashMap<i32, i32>,
    /// Each broker's address, by node id.
    brokers: HashMap<i32, String>,
    /// Brokers with a running fetch task.
    running: HashSet<i32>,
    /// The last epoch given out.
    last_epoch: u64,
}

struct Shared {
    config: FetchConfig,
    state: Mutex<State>,
    /// Fired when there may be something new to fetch (a seek, a resume, new leaders).
    work: Notify,
    /// Fired when metadata should be asked for again.
    stale: Notify,
    budget: Arc<Budget>,
    out: mpsc::UnboundedSender<Fetched>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Reads partitions of one topic from their leaders. Dropping it stops every task.
pub struct Fetcher {
    shared: Arc<Shared>,
    tasks: Arc<Mutex<JoinSet<()>>>,
}

impl std::fmt::Debug for Fetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetcher")
            .field("topic", &self.shared.config.topic)
            .finish_non_exhaustive()
    }
}

impl Fetcher {
    /// Starts the fetcher (its metadata task; broker tasks start as leaders become known) and
    /// returns it with the receiver of what it fetches. Must run inside a Tokio runtime.
    pub fn start(config: FetchConfig) -> (Self, mpsc::UnboundedReceiver<Fetched>) {
        let (out, rx) = mpsc::unbounded_channel();
        let budget = Arc::new(Budget::new(config.max_buffered_bytes));
        let shared = Arc::new(Shared {
            config,
            state: Mutex::new(State::default()),
            work: Notify::new(),
            stale: Notify::new(),
            budget,
            out,
        });
        let tasks = Arc::new(Mutex::new(JoinSet::new()));
        let fetcher = Self { shared, tasks };
        let (shared, tasks) = (fetcher.shared.clone(), fetcher.tasks.clone());
        lock_tasks(&fetcher.tasks).spawn(metadata_task(shared, tasks));
        (fetcher, rx)
    }

    /// Reads `partition` from `start` on, dropping whatever was fetched before, paused or not;
    /// returns the epoch its chunks will carry.
    pub fn seek(&self, partition: i32, start: Start, paused: bool) -> u64 {
        let offset = match start {
            Start::At(offset) => offset.max(0),
            Start::Earliest => EARLIEST,
            Start::Latest => LATEST,
        };
        let mut state = self.shared.lock();
        state.last_epoch += 1;
        let epoch = state.last_epoch;
        let known = state.leaders.contains_key(&partition);
        let entry = state.wanted.entry(partition).or_insert(Wanted {
            offset,
            epoch,
            paused,
            in_flight: false,
            not_before: None,
        });
        entry.offset = offset;
        entry.epoch = epoch;
        entry.paused = paused;
        entry.not_before = None;
        drop(state);
        if !known {
            self.shared.stale.notify_one();
        }
        self.shared.work.notify_waiters();
        epoch
    }

    /// Stops fetching `partition` (a request in flight still delivers).
    pub fn pause(&self, partition: i32) {
        if let Some(w) = self.shared.lock().wanted.get_mut(&partition) {
            w.paused = true;
        }
    }

    /// Fetches `partition` again from where it stopped.
    pub fn resume(&self, partition: i32) {
        if let Some(w) = self.shared.lock().wanted.get_mut(&partition) {
            w.paused = false;
        }
        self.shared.work.notify_waiters();
    }

    /// Stops reading `partition` altogether.
    pub fn remove(&self, partition: i32) {
        self.shared.lock().wanted.remove(&partition);
    }

    /// What it does when a position is not in its log (`auto.offset.reset`).
    pub fn offset_reset(&self) -> OffsetReset {
        self.shared.config.offset_reset
    }

    /// Bytes handed out and not yet dropped.
    pub fn buffered_bytes(&self) -> usize {
        self.shared.budget.held.load(Ordering::Acquire)
    }
}

impl Drop for Fetcher {
    fn drop(&mut self) {
        lock_tasks(&self.tasks).abort_all();
    }
}

fn lock_tasks(tasks: &Mutex<JoinSet<()>>) -> MutexGuard<'_, JoinSet<()>> {
    tasks.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Doubling waits between `BACKOFF`'s bounds.
#[derive(Debug)]
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Self(BACKOFF.0)
    }

    async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(BACKOFF.1);
    }

    fn reset(&mut self) {
        self.0 = BACKOFF.0;
    }
}

/// Keeps the partitions' leaders known: asks when a broker task or a seek says they are stale,
/// and every [`METADATA_REFRESH`]; starts a fetch task for each broker that leads a partition.
async fn metadata_task(shared: Arc<Shared>, tasks: Arc<Mutex<JoinSet<()>>>) {
    let config = &shared.config;
    let mut connection: Option<Connection> = None;
    let mut backoff = Backoff::new();
    let mut last_failure: Option<String> = None;
    loop {
        let metadata = async {
            if connection.is_none() {
                let known: Vec<String> = shared.lock().brokers.values().cloned().collect();
                connection = Some(Connection::any(&config.client, &known).await?);
            }
            let Some(c) = connection.as_mut() else {
                return Err(None);
            };
            c.metadata(&config.topic, false).await.map_err(Some)
        };
        match metadata.await {
            Ok(metadata) if !metadata.topic_error.is_error() => {
                last_failure = None;
                let missing = {
                    let mut state = shared.lock();
                    state.brokers = (metadata.brokers.iter())
                        .map(|b| (b.node_id, format!("{}:{}", b.host, b.port)))
                        .collect();
                    state.leaders = (metadata.partitions.iter())
                        .filter(|p| p.leader >= 0 && !p.error.is_error())
                        .map(|p| (p.partition, p.leader))
                        .collect();
                    let leaders: HashSet<i32> = state.leaders.values().copied().collect();
                    for node in &leaders {
                        if state.running.insert(*node) {
                            lock_tasks(&tasks).spawn(broker_task(shared.clone(), *node));
                        }
                    }
                    state.wanted.keys().any(|p| !state.leaders.contains_key(p))
                };
                shared.work.notify_waiters();
                if missing {
                    // A partition without a leader (an election, or too new): ask again soon.
                    backoff.wait().await;
                    continue;
                }
                backoff.reset();
            }
            outcome => {
                let (error, fatal) = match outcome {
                    Ok(m) => (
                        format!("metadata for {}: {}", config.topic, m.topic_error),
                        false,
                    ),
                    Err(Some(e)) => (e.to_string(), e.is_fatal()),
                    Err(None) => ("no broker to ask for metadata".to_owned(), false),
                };
                if last_failure.as_ref() != Some(&error) {
                    tracing::warn!(%error, "fetcher: metadata request failed; retrying");
                    if fatal {
                        let _ = shared.out.send(Fetched::Failed {
                            error: error.clone(),
                        });
                    }
                    last_failure = Some(error);
                }
                connection = None;
                backoff.wait().await;
                continue;
            }
        }
        // However often fetches find leadership stale, at most one request per spacing.
        tokio::time::sleep(METADATA_SPACING).await;
        let _ = tokio::time::timeout(METADATA_REFRESH, shared.stale.notified()).await;
    }
}

/// What `node` should fetch now: the partitions led by it, positioned, not paused, not in
/// flight and not backing off; and when the first of its partitions backing off may be fetched.
struct Fetchable {
    request: Vec<(i32, i64, u64)>,
    wake: Option<std::time::Instant>,
}

fn fetchable(state: &mut State, node: i32) -> Fetchable {
    let State {
        wanted, leaders, ..
    } = state;
    let now = std::time::Instant::now();
    let mut wake: Option<std::time::Instant> = None;
    let mut request: Vec<(i32, i64, u64)> = wanted
        .iter_mut()
        .filter(|(p, w)| !w.paused && !w.in_flight && leaders.get(p) == Some(&node))
        .filter(|(_, w)| match w.not_before {
            Some(t) if t > now => {
                wake = Some(wake.map_or(t, |first| first.min(t)));
                false
            }
            _ => true,
        })
        .map(|(p, w)| {
            w.in_flight = true;
            (*p, w.offset, w.epoch)
        })
        .collect();
    request.sort_unstable_by_key(|(p, _, _)| *p);
    Fetchable { request, wake }
}

/// Fetches the partitions `node` leads, one request at a time, for as long as the fetcher runs.
async fn broker_task(shared: Arc<Shared>, node: i32) {
    let config = &shared.config;
    let mut connection: Option<Connection> = None;
    let mut backoff = Backoff::new();
    let mut response = Vec::new();
    let mut scratch = Vec::new();
    loop {
        shared.budget.room().await;
        let (mut request, address) = loop {
            let work = shared.work.notified();
            let wake = {
                let mut state = shared.lock();
                let Fetchable { request, wake } = fetchable(&mut state, node);
                if !request.is_empty() {
                    let address = state.brokers.get(&node).cloned();
                    break (request, address);
                }
                wake
            };
            // Woken by a seek, a resume or new leaders, or when a partition's backoff ends.
            match wake {
                Some(at) => {
                    let _ = tokio::time::timeout_at(at.into(), work).await;
                }
                None => work.await,
            }
        };
        let outcome = async {
            let Some(address) = address else {
                return Err(None);
            };
            let c = Connection::reuse(&mut connection, &address, &config.client)
                .await
                .map_err(Some)?;
            resolve_ends(&shared, c, &mut request).await.map_err(Some)?;
            let pairs: Vec<(i32, i64)> = request.iter().map(|&(p, o, _)| (p, o)).collect();
            let wait = Duration::from_millis(config.limits.max_wait_ms as u64);
            c.request_waiting(
                protocol::FETCH,
                |w| protocol::fetch_request(w, &config.topic, &pairs, config.limits),
                &mut response,
                wait,
            )
            .await
            .map_err(Some)
        }
        .await;
        match outcome {
            Ok(()) => match protocol::parse_fetch(&response, &config.topic) {
                Ok((error, partitions)) if !error.is_error() => {
                    backoff.reset();
                    let stale = handle_response(
                        &shared,
                        node,
                        &request,
                        partitions,
                        &mut scratch,
                        connection.as_mut(),
                    )
                    .await;
                    if stale {
                        shared.stale.notify_one();
                    }
                    continue;
                }
                Ok((error, _)) => {
                    tracing::warn!(node, %error, "fetcher: fetch refused as a whole");
                    connection = None;
                }
                Err(e) => {
                    tracing::warn!(node, error = %e, "fetcher: a malformed fetch response");
                    connection = None;
                }
            },
            Err(error) => {
                if let Some(error) = &error {
                    tracing::warn!(node, %error, "fetcher: fetch failed; finding the leaders again");
                    if error.is_fatal() {
                        let _ = shared.out.send(Fetched::Failed {
                            error: error.to_string(),
                        });
                    }
                }
                connection = None;
                shared.stale.notify_one();
            }
        }
        release(&shared, &request);
        backoff.wait().await;
    }
}

/// Turns the [`EARLIEST`] and [`LATEST`] offsets of `request` into where those logs start or
/// end now, asking the leader.
async fn resolve_ends(
    shared: &Shared,
    connection: &mut Connection,
    request: &mut [(i32, i64, u64)],
) -> Result<(), crate::connection::ConnectionError> {
    for (sentinel, end) in [(EARLIEST, LogEnd::Earliest), (LATEST, LogEnd::Latest)] {
        let unresolved: Vec<i32> = (request.iter())
            .filter(|(_, offset, _)| *offset == sentinel)
            .map(|(p, _, _)| *p)
            .collect();
        if unresolved.is_empty() {
            continue;
        }
        let found = connection
            .list_offsets(&shared.config.topic, &unresolved, end)
            .await?;
        let mut state = shared.lock();
        for (partition, offset, epoch) in request.iter_mut() {
            let Some(&(_, error, at)) = found.iter().find(|(p, _, _)| p == partition) else {
                continue;
            };
            if *offset != sentinel || error.is_error() {
                continue;
            }
            *offset = at;
            if let Some(w) = state.wanted.get_mut(partition)
                && w.epoch == *epoch
            {
                w.offset = at;
            }
        }
    }
    Ok(())
}

/// Clears the in-flight marks of `request`'s partitions.
fn release(shared: &Shared, request: &[(i32, i64, u64)]) {
    let mut state = shared.lock();
    for (partition, _, _) in request {
        if let Some(w) = state.wanted.get_mut(partition) {
            w.in_flight = false;
        }
    }
    drop(state);
    shared.work.notify_waiters();
}

/// Hands out a fetch response's partitions and moves their offsets on; returns whether a
/// partition's leadership looked stale.
async fn handle_response(
    shared: &Shared,
    node: i32,
    request: &[(i32, i64, u64)],
    partitions: Vec<FetchPartition<'_>>,
    scratch: &mut Vec<u8>,
    connection: Option<&mut Connection>,
) -> bool {
    let mut stale = false;
    let mut out_of_range = Vec::new();
    for part in partitions {
        let Some(&(partition, offset, epoch)) =
            request.iter().find(|(p, _, _)| *p == part.partition)
        else {
            continue;
        };
        match part.error {
            ErrorCode::NONE => {
                let chunk = chunk(shared, partition, epoch, offset, &part, scratch);
                let mut state = shared.lock();
                let Some(w) = state.wanted.get_mut(&partition) else {
                    continue;
                };
                if w.epoch != epoch {
                    continue;
                }
                if chunk.next > w.offset {
                    w.offset = chunk.next;
                }
                if let Some(chunk) = chunk.chunk {
                    // Queued before the partition can be fetched again: chunks stay in order.
                    let _ = shared.out.send(Fetched::Chunk(chunk));
                }
            }
            ErrorCode::OFFSET_OUT_OF_RANGE => out_of_range.push((partition, offset, epoch)),
            error if error.is_stale_leadership() => {
                tracing::debug!(node, partition, %error, "fetcher: leadership moved");
                back_off(shared, partition);
                shared.lock().leaders.remove(&partition);
                stale = true;
            }
            error => {
                tracing::warn!(node, partition, %error, "fetcher: partition fetch failed; trying again in 500 ms");
                back_off(shared, partition);
                if error == ErrorCode::TOPIC_AUTHORIZATION_FAILED {
                    let _ = shared.out.send(Fetched::Failed {
                        error: format!(
                            "reading {} partition {partition}: {error}",
                            shared.config.topic
                        ),
                    });
                }
            }
        }
    }
    if !out_of_range.is_empty() {
        stale |= reset_out_of_range(shared, node, out_of_range, connection).await;
    }
    release(shared, request);
    stale
}

/// Keeps `partition` from being fetched for [`FETCH_ERROR_BACKOFF`].
fn back_off(shared: &Shared, partition: i32) {
    if let Some(w) = shared.lock().wanted.get_mut(&partition) {
        w.not_before = Some(std::time::Instant::now() + FETCH_ERROR_BACKOFF);
    }
}

/// Moves partitions whose offsets were out of range as `auto.offset.reset` says, and reports
/// each; returns whether leadership looked stale.
async fn reset_out_of_range(
    shared: &Shared,
    node: i32,
    out_of_range: Vec<(i32, i64, u64)>,
    connection: Option<&mut Connection>,
) -> bool {
    let report = |partition, epoch, from, to| {
        let _ = shared.out.send(Fetched::OutOfRange {
            partition,
            epoch,
            from,
            to,
        });
    };
    let end = match shared.config.offset_reset {
        OffsetReset::Earliest => LogEnd::Earliest,
        OffsetReset::Latest => LogEnd::Latest,
        OffsetReset::Error => {
            let mut state = shared.lock();
            for (partition, from, epoch) in out_of_range {
                if let Some(w) = state.wanted.get_mut(&partition)
                    && w.epoch == epoch
                {
                    // Stays where it is, unfetched, until the owner seeks it.
                    w.paused = true;
                    report(partition, epoch, from, None);
                }
            }
            return false;
        }
    };
    let Some(c) = connection else {
        return true;
    };
    let ids: Vec<i32> = out_of_range.iter().map(|(p, _, _)| *p).collect();
    let found = match c.list_offsets(&shared.config.topic, &ids, end).await {
        Ok(found) => found,
        Err(error) => {
            tracing::warn!(node, %error, "fetcher: could not find where the logs start or end");
            return true;
        }
    };
    let mut stale = false;
    let mut state = shared.lock();
    for (partition, from, epoch) in out_of_range {
        let Some(&(_, error, to)) = found.iter().find(|(p, _, _)| *p == partition) else {
            continue;
        };
        if error.is_error() {
            stale = true;
            continue;
        }
        if let Some(w) = state.wanted.get_mut(&partition)
            && w.epoch == epoch
            && w.offset == from
        {
            w.offset = to;
            report(partition, epoch, from, Some(to));
        }
    }
    stale
}

/// A chunk, if the partition's answer held anything to hand out, and the next offset to fetch.
struct Built {
    chunk: Option<Chunk>,
    next: i64,
}

/// Turns one partition's record set into a chunk: decompresses each batch, leaves out control
/// batches and the batches of aborted transactions, and notes what cannot be read.
fn chunk(
    shared: &Shared,
    partition: i32,
    epoch: u64,
    start: i64,
    part: &FetchPartition<'_>,
    scratch: &mut Vec<u8>,
) -> Built {
    let (mut data, mut located) = shared.budget.buffers();
    let mut pieces = Vec::new();
    let mut next = start;
    // Aborted transactions, by first offset; a producer is in `aborting` from its first aborted
    // offset until its abort marker.
    let mut aborted: Vec<(i64, i64)> = part.aborted.clone();
    aborted.sort_unstable_by_key(|(_, first)| std::cmp::Reverse(*first));
    let mut aborting: HashSet<i64> = HashSet::new();
    for batch in records::batches(part.records) {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                // The rest of the set cannot be split into batches: hand it out as one
                // undecodable stretch.
                let at = data.len();
                data.extend_from_slice(part.records);
                // Its offsets are unknown: skip one offset at a time (each fetch from the next
                // one returns the same batch until reading passes it), losing the least.
                pieces.push(Piece::Undecodable {
                    first_offset: next,
                    last_offset: next,
                    range: at..data.len(),
                    reason: e.to_string(),
                });
                next += 1;
                break;
            }
        };
        let (header, section) = match batch {
            RawBatch::V2 { header, records } => (header, records),
            RawBatch::Legacy {
                offset,
                magic,
                bytes,
            } => {
                if offset >= start {
                    let at = data.len();
                    data.extend_from_slice(bytes);
                    pieces.push(Piece::Undecodable {
                        first_offset: offset,
                        last_offset: offset,
                        range: at..data.len(),
                        reason: format!("message format v{magic} is not read (only v2)"),
                    });
                }
                next = next.max(offset + 1);
                continue;
            }
        };
        let last = header.last_offset();
        if last < start {
            continue;
        }
        next = next.max(last + 1);
        while let Some(&(producer, first)) = aborted.last() {
            if first > last {
                break;
            }
            aborting.insert(producer);
            aborted.pop();
        }
        if header.is_control() {
            // A transaction's marker: read whether it aborts, hand nothing out.
            let marker = match header.compression() {
                records::Compression::None => records::control(header, section).ok(),
                codec => {
                    scratch.clear();
                    compression::decompress(codec, section, scratch)
                        .ok()
                        .and_then(|()| records::control(header, scratch).ok())
                }
            };
            if header.is_transactional() && marker == Some(Control::Abort) {
                aborting.remove(&header.producer_id);
            }
            continue;
        }
        if header.is_transactional() && aborting.contains(&header.producer_id) {
            // Aborted: never decompressed, never handed out.
            continue;
        }
        // Decompressed (or copied) straight into the chunk.
        let at = data.len();
        let read = match header.compression() {
            records::Compression::None => {
                data.extend_from_slice(section);
                Ok(())
            }
            codec => compression::decompress(codec, section, &mut data),
        };
        if let Err(e) = read {
            data.truncate(at);
            data.extend_from_slice(section);
            pieces.push(Piece::Undecodable {
                first_offset: header.base_offset.max(start),
                last_offset: last,
                range: at..data.len(),
                reason: e.to_string(),
            });
            continue;
        }
        // Its records located now, on this task, rather than walked by the reader.
        let first = located.len();
        let mut malformed = None;
        for record in Records::new(header, &data[at..]) {
            match record {
                Ok(record) if record.offset < start => {}
                Ok(record) => located.push(Located {
                    offset: record.offset,
                    timestamp_ms: record.timestamp_ms,
                    key: Place::of(&data, record.key),
                    value: Place::of(&data, record.value),
                }),
                Err(e) => malformed = Some(format!("a malformed record: {e}")),
            }
        }
        pieces.push(Piece::Batch(BatchPiece {
            header,
            range: at..data.len(),
            records: first..located.len(),
            malformed,
        }));
    }
    if pieces.is_empty() {
        shared.budget.recycle(data, located);
        return Built { chunk: None, next };
    }
    shared.budget.hold(held(&data, &located));
    let chunk = Chunk {
        partition,
        epoch,
        log_end: part.log_end(),
        start,
        pieces,
        data,
        located,
        budget: shared.budget.clone(),
    };
    Built {
        chunk: Some(chunk),
        next,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::tests::{batch, header, records_section};

    fn shared() -> Shared {
        let config = FetchConfig::from_options("t", [("bootstrap.servers", "127.0.0.1:1")])
            .expect("as written");
        let (out, _rx) = mpsc::unbounded_channel();
        Shared {
            config,
            state: Mutex::new(State::default()),
            work: Notify::new(),
            stale: Notify::new(),
            budget: Arc::new(Budget::new(1 << 20)),
            out,
        }
    }

    fn part(records: &[u8], aborted: Vec<(i64, i64)>) -> FetchPartition<'_> {
        FetchPartition {
            partition: 0,
            error: ErrorCode::NONE,
            high_watermark: 100,
            last_stable_offset: 100,
            log_start_offset: 0,
            aborted,
            records,
        }
    }

    fn offsets(chunk: &Chunk) -> Vec<i64> {
        chunk
            .items()
            .map(|i| match i {
                Item::Record(r) => r.offset,
                Item::Undecodable { first_offset, .. } => -first_offset,
            })
            .collect()
    }

    fn plain_batch(base: i64, n: i32, attributes: i16, producer: i64) -> Vec<u8> {
        let recs: Vec<_> = (0..n).map(|i| (i, 0, None, Some(&b"v"[..]))).collect();
        let mut h = header(base, n, attributes);
        h.producer_id = producer;
        batch(&h, &records_section(&recs))
    }

    fn control_batch(offset: i64, producer: i64, kind: i16) -> Vec<u8> {
        let mut key = crate::wire::Writer::default();
        key.i16(0).i16(kind);
        let mut h = header(offset, 1, 0x30);
        h.producer_id = producer;
        batch(
            &h,
            &records_section(&[(0, 0, Some(&key.buf), Some(b"\0\0\0\0\0\0"))]),
        )
    }

    #[test]
    fn records_before_the_fetch_offset_are_not_items() {
        let s = shared();
        let set = [plain_batch(10, 5, 0, -1), plain_batch(15, 2, 0, -1)].concat();
        let built = chunk(&s, 0, 1, 12, &part(&set, vec![]), &mut Vec::new());
        let c = built.chunk.expect("as written");
        assert_eq!(offsets(&c), [12, 13, 14, 15, 16]);
        assert_eq!(built.next, 17);
        assert_eq!(s.budget.held.load(Ordering::Acquire), c.len_bytes());
        drop(c);
        assert_eq!(
            s.budget.held.load(Ordering::Acquire),
            0,
            "a dropped chunk gives its bytes back"
        );
    }

    #[test]
    fn aborted_transactions_and_markers_are_left_out() {
        let s = shared();
        // Producer 7 aborts offsets 0-1 (marker at 2); producer 8 commits 3-4 (marker at 5);
        // a plain batch at 6.
        let set = [
            plain_batch(0, 2, 0x10, 7),
            control_batch(2, 7, 0),
            plain_batch(3, 2, 0x10, 8),
            control_batch(5, 8, 1),
            plain_batch(6, 1, 0, -1),
        ]
        .concat();
        let built = chunk(&s, 0, 1, 0, &part(&set, vec![(7, 0)]), &mut Vec::new());
        assert_eq!(offsets(&built.chunk.expect("as written")), [3, 4, 6]);
        assert_eq!(built.next, 7);
    }

    #[test]
    fn a_batch_that_cannot_be_decompressed_is_undecodable_and_reading_goes_on() {
        let s = shared();
        let recs = records_section(&[(0, 0, None, Some(b"v"))]);
        let zstd = batch(&header(4, 1, 4), &recs);
        let set = [plain_batch(3, 1, 0, -1), zstd, plain_batch(5, 1, 0, -1)].concat();
        let built = chunk(&s, 0, 1, 3, &part(&set, vec![]), &mut Vec::new());
        assert_eq!(offsets(&built.chunk.expect("as written")), [3, -4, 5]);
        assert_eq!(built.next, 6);
    }

    #[test]
    fn records_located_at_build_read_back_whole_and_a_malformed_one_ends_its_batch() {
        let s = shared();
        let good = records_section(&[
            (0, 5, Some(&b"k0"[..]), Some(&b"first"[..])),
            (1, 6, None, Some(&b"second"[..])),
            (2, 7, Some(&b"k2"[..]), None),
        ]);
        // The header says four records; the section holds three and a cut-off fourth.
        let cut = [good.as_slice(), &[0x40]].concat();
        let set = [batch(&header(20, 4, 0), &cut), plain_batch(24, 1, 0, -1)].concat();
        let built = chunk(&s, 0, 1, 20, &part(&set, vec![]), &mut Vec::new());
        let c = built.chunk.expect("as written");
        let items: Vec<_> = c
            .items()
            .map(|i| match i {
                Item::Record(r) => (r.offset, r.timestamp_ms, r.key, r.value, None),
                Item::Undecodable {
                    first_offset,
                    last_offset,
                    reason,
                    ..
                } => (first_offset, last_offset, None, None, Some(reason)),
            })
            .collect();
        let reason = items[3].4.clone().expect("the cut-off record is reported");
        assert!(reason.starts_with("a malformed record"), "{reason}");
        assert_eq!(
            items,
            [
                (20, 1_005, Some(&b"k0"[..]), Some(&b"first"[..]), None),
                (21, 1_006, None, Some(&b"second"[..]), None),
                (22, 1_007, Some(&b"k2"[..]), None, None),
                (20, 23, None, None, Some(reason)),
                (24, 1_000, None, Some(&b"v"[..]), None),
            ]
        );
        assert_eq!(built.next, 25);
    }

    #[test]
    fn an_lz4_batch_is_read_like_a_plain_one() {
        use std::io::Write;
        let s = shared();
        let recs: Vec<_> = (0..50)
            .map(|i| (i, i64::from(i), None, Some(&b"{\"counter\":\"c\"}"[..])))
            .collect();
        let section = records_section(&recs);
        let mut lz = lz4_flex::frame::FrameEncoder::new(Vec::new());
        lz.write_all(&section).expect("as written");
        let set = batch(&header(100, 50, 3), &lz.finish().expect("as written"));
        let built = chunk(&s, 0, 1, 100, &part(&set, vec![]), &mut Vec::new());
        let c = built.chunk.expect("as written");
        assert_eq!(offsets(&c), (100..150).collect::<Vec<_>>());
        let Some(Item::Record(r)) = c.items().nth(7) else {
            panic!()
        };
        assert_eq!(
            (r.timestamp_ms, r.value),
            (1_007, Some(&b"{\"counter\":\"c\"}"[..]))
        );
    }

    #[test]
    fn only_positioned_unpaused_idle_partitions_of_the_node_are_fetched() {
        let w = |paused, in_flight| Wanted {
            offset: 5,
            epoch: 1,
            paused,
            in_flight,
            not_before: None,
        };
        let mut state = State {
            leaders: [(0, 1), (1, 1), (2, 2), (3, 1)].into(),
            wanted: [
                (0, w(false, false)),
                (1, w(true, false)),
                (2, w(false, false)),
                (3, w(false, true)),
            ]
            .into(),
            ..State::default()
        };
        assert_eq!(fetchable(&mut state, 1).request, [(0, 5, 1)]);
        assert!(state.wanted[&0].in_flight);
        assert!(fetchable(&mut state, 1).request.is_empty(), "in flight now");
        // A partition whose fetch failed waits out its backoff.
        let soon = std::time::Instant::now() + Duration::from_secs(60);
        state.wanted.insert(
            4,
            Wanted {
                not_before: Some(soon),
                ..w(false, false)
            },
        );
        state.leaders.insert(4, 1);
        let backing_off = fetchable(&mut state, 1);
        assert!(backing_off.request.is_empty(), "backing off");
        assert_eq!(backing_off.wake, Some(soon), "woken when the backoff ends");
        state.wanted.get_mut(&4).expect("wanted").not_before = Some(std::time::Instant::now());
        let after = fetchable(&mut state, 1);
        assert_eq!((after.request, after.wake), (vec![(4, 5, 1)], None));
    }
}

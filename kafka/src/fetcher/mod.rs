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
//! The bytes handed out and not yet dropped are counted as allocated: past `max_buffered_bytes`
//! no more of an answer is read until the reader catches up, as librdkafka's
//! `queued.max.messages.kbytes` bounds its prefetch. A chunk is read only while the budget has
//! room and stops at a quarter of it, so what the fetcher holds stays within the budget and one
//! batch per broker however much an answer decompresses to (a batch is refused past 256 MiB
//! once read); the buffers it keeps for reuse hold at most the budget again. Each broker's next
//! fetch is sent as soon as its last answer is handed out, so that it arrives while the reader
//! still has the budget's worth to read: at most one answer per broker waits, compressed, for
//! room (at most `fetch.max.bytes`).
//!
//! # Failures
//! A broker that cannot be reached, or that answers that it no longer leads a partition, makes
//! the fetcher ask for the topic's metadata again (with capped backoff) and go on with the new
//! leaders; nothing is skipped. An offset outside the log (retention deleted it) moves as
//! `auto.offset.reset` says and is reported as [`Fetched::OutOfRange`]; a log truncated under
//! the position by a leader change (KIP-320) resumes where it now ends, reported as
//! [`Fetched::Truncated`]. Authentication and version failures are reported as
//! [`Fetched::Failed`] and retried with backoff: the owner decides whether to stop.
//!
//! # Layout
//! Every decision (what each broker is sent next, what each answer does) is made by `core`,
//! which does no I/O; the tasks here only carry its requests and answers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;

use crate::backoff::Backoff;
use crate::config::{FetchConfig, OffsetReset};
use crate::connection::{Connection, ConnectionError};
use crate::protocol::{self, FetchResponse};

mod chunk;
mod core;

use self::core::{Answer, Claim, Core, Outcome, Read, Step};
use chunk::{Budget, PartReader, Reading};
pub use chunk::{Chunk, Item, Items};

/// Shortest time between two metadata requests, however often fetches find leadership stale.
const METADATA_SPACING: Duration = Duration::from_millis(100);

/// How long a partition whose batch did not match its CRC waits before it is fetched again.
pub const CORRUPT_BACKOFF: Duration = Duration::from_secs(5);

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
    /// With `check.crcs`, a batch did not match its CRC-32C: the partition is read up to it and
    /// no further, and fetched again from it every [`CORRUPT_BACKOFF`] (a batch corrupted on
    /// the wire reads clean the next time; one corrupted on the leader's disk stays, until the
    /// operator moves leadership to a clean replica).
    Corrupt {
        /// The partition.
        partition: i32,
        /// Where the corrupt batch starts.
        offset: i64,
        /// What did not match.
        reason: String,
    },
    /// After a leader change, the new leader's log ends before the partition's position: the
    /// records in between (read, and perhaps counted) are no longer in the log (an unclean
    /// election lost them), and reading goes on at `to`, where the new leader's records start.
    Truncated {
        /// The partition.
        partition: i32,
        /// The epoch it was read under.
        epoch: u64,
        /// The position the log was truncated under.
        from: i64,
        /// Where the log now ends, and reading goes on.
        to: i64,
    },
    /// A broker asked for a pause before the next request (a quota, KIP-219); the fetcher
    /// sends that broker nothing until it is over.
    Throttled {
        /// The broker.
        node: i32,
        /// How long, in milliseconds.
        ms: u32,
    },
    /// Something failed that retrying may not cure (credentials, authorization, versions); the
    /// fetcher keeps trying with backoff.
    Failed {
        /// What failed.
        error: String,
    },
}

struct Shared {
    config: FetchConfig,
    core: Mutex<Core>,
    /// Fired when there may be something new to fetch (a seek, a resume, new leaders).
    work: Notify,
    /// Fired when metadata should be asked for again.
    stale: Notify,
    budget: Arc<Budget>,
    out: mpsc::UnboundedSender<Fetched>,
    /// `Fetch` requests sent.
    requests: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hands out an answer's reports, and asks for leaders again if it says so.
    fn report(&self, outcome: Outcome) {
        for report in outcome.reports {
            let _ = self.out.send(report);
        }
        if outcome.stale {
            self.stale.notify_one();
        }
        // Partitions were released: any broker's task may have work again.
        self.work.notify_waiters();
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
        let core = Core::new(config.waits, config.offset_reset);
        let shared = Arc::new(Shared {
            config,
            core: Mutex::new(core),
            work: Notify::new(),
            stale: Notify::new(),
            budget,
            out,
            requests: AtomicU64::new(0),
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
        let (epoch, unknown) = self.shared.lock().seek(partition, start, paused);
        if unknown {
            self.shared.stale.notify_one();
        }
        self.shared.work.notify_waiters();
        epoch
    }

    /// Stops fetching `partition` (a request in flight still delivers).
    pub fn pause(&self, partition: i32) {
        self.shared.lock().pause(partition, true);
    }

    /// Fetches `partition` again from where it stopped.
    pub fn resume(&self, partition: i32) {
        self.shared.lock().pause(partition, false);
        self.shared.work.notify_waiters();
    }

    /// Stops reading `partition` altogether.
    pub fn remove(&self, partition: i32) {
        self.shared.lock().remove(partition);
    }

    /// What it does when a position is not in its log (`auto.offset.reset`).
    pub fn offset_reset(&self) -> OffsetReset {
        self.shared.config.offset_reset
    }

    /// `Fetch` requests sent so far.
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::Relaxed)
    }

    /// Bytes handed out and not yet dropped.
    pub fn buffered_bytes(&self) -> usize {
        self.shared.budget.held()
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

/// Keeps the partitions' leaders known: asks when a broker task or a seek says they are stale,
/// and every `topic.metadata.refresh.interval.ms` ([`crate::config::Waits`]); starts a fetch
/// task for each broker that leads a partition.
async fn metadata_task(shared: Arc<Shared>, tasks: Arc<Mutex<JoinSet<()>>>) {
    let config = &shared.config;
    let mut connection: Option<Connection> = None;
    let waits = shared.config.waits;
    let mut backoff = Backoff::new(waits.reconnect, waits.reconnect_max);
    let mut last_failure: Option<String> = None;
    loop {
        let metadata = async {
            if connection.is_none() {
                let known = shared.lock().addresses();
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
                let (start, missing) = shared.lock().metadata(&metadata);
                for node in start {
                    lock_tasks(&tasks).spawn(broker_task(shared.clone(), node));
                }
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
        let _ = tokio::time::timeout(waits.metadata_refresh, shared.stale.notified()).await;
    }
}

/// Carries `node`'s requests, as the core decides them, for as long as the fetcher runs.
async fn broker_task(shared: Arc<Shared>, node: i32) {
    let mut connection: Option<Connection> = None;
    let mut response = Vec::new();
    let mut scratch = Vec::new();
    loop {
        // Registered before the core is asked, so that a wake-up in between is not lost.
        let work = shared.work.notified();
        let (step, address) = {
            let mut core = shared.lock();
            (core.next(node, Instant::now()), core.address(node))
        };
        let outcome = match step {
            Step::Idle { wake } => {
                // Woken by a seek, a resume, new leaders or an answer, or when a wait ends.
                match wake {
                    Some(at) => {
                        let _ = tokio::time::timeout_at(at.into(), work).await;
                    }
                    None => work.await,
                }
                continue;
            }
            Step::ListOffsets { end, claims } => {
                let ids: Vec<i32> = claims.iter().map(|c| c.partition).collect();
                let topic = &shared.config.topic;
                match connect(&shared, &mut connection, address).await {
                    Ok(c) => c.list_offsets(topic, &ids, end).await.map_err(Some),
                    Err(e) => Err(e),
                }
                .map(|found| shared.lock().listed(node, &claims, &found, Instant::now()))
                .unwrap_or_else(|e| failed(&shared, &mut connection, node, &claims, e))
            }
            Step::Validate { queries, claims } => {
                let topic = &shared.config.topic;
                match connect(&shared, &mut connection, address).await {
                    Ok(c) => (c.offsets_for_leader_epochs(topic, &queries).await).map_err(Some),
                    Err(e) => Err(e),
                }
                .map(|ends| {
                    shared
                        .lock()
                        .validated(node, &claims, &ends, Instant::now())
                })
                .unwrap_or_else(|e| failed(&shared, &mut connection, node, &claims, e))
            }
            Step::Fetch { positions, claims } => {
                let sent = async {
                    let c = connect(&shared, &mut connection, address).await?;
                    let config = &shared.config;
                    let wait = Duration::from_millis(config.limits.max_wait_ms as u64);
                    let version = c.version(protocol::FETCH);
                    shared.requests.fetch_add(1, Ordering::Relaxed);
                    let request = |w: &mut _| {
                        let (limits, isolation) = (config.limits, config.isolation);
                        protocol::fetch_request(
                            w,
                            version,
                            &config.topic,
                            &positions,
                            limits,
                            isolation,
                        )
                    };
                    (c.request_waiting(protocol::FETCH, request, &mut response, wait)
                        .await)
                        .map_err(Some)
                        .map(|()| version)
                }
                .await;
                match sent {
                    Ok(version) => {
                        let handled =
                            fetched(&shared, node, &claims, &mut response, version, &mut scratch)
                                .await;
                        handled.unwrap_or_else(|error| {
                            tracing::warn!(node, %error, "fetcher: a fetch response not used");
                            failed(&shared, &mut connection, node, &claims, None)
                        })
                    }
                    Err(e) => failed(&shared, &mut connection, node, &claims, e),
                }
            }
        };
        shared.report(outcome);
    }
}

/// The connection to `address`, opened first if there is none (`None`: the broker's address
/// is unknown).
async fn connect<'a>(
    shared: &Shared,
    connection: &'a mut Option<Connection>,
    address: Option<String>,
) -> Result<&'a mut Connection, Option<ConnectionError>> {
    let address = address.ok_or(None)?;
    Connection::reuse(connection, &address, &shared.config.client)
        .await
        .map_err(Some)
}

/// A request to `node` got no answer: logged (reported if retrying may not cure it), the
/// connection dropped, and the core told.
fn failed(
    shared: &Shared,
    connection: &mut Option<Connection>,
    node: i32,
    claims: &[Claim],
    error: Option<ConnectionError>,
) -> Outcome {
    let mut outcome = shared.lock().failed(node, claims, Instant::now());
    if let Some(error) = error {
        tracing::warn!(node, %error, "fetcher: request failed; finding the leaders again");
        if error.is_fatal() {
            outcome.reports.push(Fetched::Failed {
                error: error.to_string(),
            });
        }
    }
    *connection = None;
    outcome
}

/// A fetch answered: each partition's records read into chunks, the core told, and each chunk
/// queued under its lock, one after another (the reader starts on the first while the next is
/// read); the partitions are released once all are queued. A chunk is read only while the
/// budget has room (this waits until it has), so however much the response decompresses to,
/// what is held stays within the budget and one batch.
async fn fetched(
    shared: &Shared,
    node: i32,
    claims: &[Claim],
    response: &mut Vec<u8>,
    version: i16,
    scratch: &mut Vec<u8>,
) -> Result<Outcome, String> {
    let config = &shared.config;
    // The response's record sets are slices of its bytes: the buffer goes as `Bytes`, and
    // comes back for the next response once they are dropped.
    let body = Bytes::from(std::mem::take(response));
    let decoded = FetchResponse::decode(&mut body.clone(), version);
    let result = match decoded {
        Ok(fetched) if !fetched.error().is_error() => {
            let reading = Reading {
                check_crcs: config.check_crcs,
                isolation: config.isolation,
                ..Reading::default()
            };
            let mut outcome = Outcome::default();
            for part in fetched.partitions(&config.topic) {
                let claim = claims.iter().find(|c| c.partition == part.partition);
                let answer = |read| Answer {
                    partition: part.partition,
                    error: part.error,
                    read,
                };
                let Some(c) = claim.filter(|_| !part.error.is_error() && part.diverging.is_none())
                else {
                    let diverged = Read {
                        next: -1,
                        last_epoch: None,
                        corrupt: None,
                        diverging: true,
                    };
                    let answer = answer(part.diverging.is_some().then_some(diverged));
                    shared
                        .lock()
                        .answer(claims, &answer, Instant::now(), &mut outcome);
                    continue;
                };
                let mut reader = PartReader::new(&part, c.offset, reading);
                loop {
                    shared.budget.room().await;
                    let chunk = reader.chunk(&shared.budget, c.partition, c.epoch, scratch);
                    let answer = answer(Some(Read {
                        next: reader.next(),
                        last_epoch: reader.last_epoch(),
                        corrupt: reader.take_corrupt(),
                        diverging: false,
                    }));
                    let current = {
                        let mut core = shared.lock();
                        let current = core.answer(claims, &answer, Instant::now(), &mut outcome);
                        if current && let Some(chunk) = chunk {
                            let _ = shared.out.send(Fetched::Chunk(chunk));
                        }
                        current
                    };
                    // All read, or the partition was sought elsewhere since (then the rest is
                    // not wanted).
                    if reader.done() || !current {
                        break;
                    }
                }
            }
            let throttle = fetched.throttle_time_ms();
            let mut core = shared.lock();
            core.fetch_done(node, claims, throttle, Instant::now(), &mut outcome);
            Ok(outcome)
        }
        Ok(fetched) => Err(format!("fetch refused as a whole: {}", fetched.error())),
        Err(e) => Err(format!("a malformed fetch response: {e}")),
    };
    *response = reclaim(body);
    result
}

/// The buffer of a handled response, for the next one: its allocation is kept when nothing
/// holds a slice of it any more (always, once the response's partitions are handled).
fn reclaim(body: Bytes) -> Vec<u8> {
    body.try_into_mut().map(Vec::from).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_buffer_comes_back_with_its_allocation() {
        let mut buffer = Vec::with_capacity(1 << 20);
        buffer.extend_from_slice(&[7; 1000]);
        let address = buffer.as_ptr();
        let body = Bytes::from(buffer);
        let slice = body.slice(10..20);
        drop(slice);
        let back = reclaim(body);
        assert_eq!((back.as_ptr(), back.len()), (address, 1000));
        assert!(back.capacity() >= 1 << 20, "{}", back.capacity());
    }
}

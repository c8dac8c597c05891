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
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;

use crate::backoff::Backoff;
use crate::config::{FetchConfig, OffsetReset};
use crate::connection::Connection;
use crate::protocol::{self, ErrorCode, FetchPartition, FetchPosition, FetchResponse};

mod chunk;
mod ends;

use chunk::{Budget, Reading, chunk};
pub use chunk::{Chunk, Item, Items};
use ends::{reset_out_of_range, resolve_ends};

/// Shortest time between two metadata requests, however often fetches find leadership stale.
const METADATA_SPACING: Duration = Duration::from_millis(100);

/// How long a partition whose batch did not match its CRC waits before it is fetched again.
pub const CORRUPT_BACKOFF: Duration = Duration::from_secs(5);

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

/// A partition's leader: its node, and its leader epoch, sent with every fetch (KIP-320) so
/// that a broker whose leadership is older or newer than ours says so (`FENCED_LEADER_EPOCH`,
/// `UNKNOWN_LEADER_EPOCH`) and leaders are asked for again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Leader {
    node: i32,
    epoch: i32,
}

/// State the tasks share.
#[derive(Debug, Default)]
struct State {
    /// Partitions being read, by index.
    wanted: HashMap<i32, Wanted>,
    /// Each partition's leader, as metadata last said.
    leaders: HashMap<i32, Leader>,
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
                        .map(|p| {
                            let leader = Leader {
                                node: p.leader,
                                epoch: p.leader_epoch,
                            };
                            (p.partition, leader)
                        })
                        .collect();
                    let leaders: HashSet<i32> = state.leaders.values().map(|l| l.node).collect();
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
        let _ = tokio::time::timeout(waits.metadata_refresh, shared.stale.notified()).await;
    }
}

/// What `node` should fetch now: the partitions led by it, positioned, not paused, not in
/// flight and not backing off; and when the first of its partitions backing off may be fetched.
struct Fetchable {
    request: Vec<(i32, i64, u64)>,
    /// The leader epoch of each partition of `request`, in the same order (-1: unknown).
    leader_epochs: Vec<i32>,
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
        .filter(|(p, w)| {
            !w.paused && !w.in_flight && leaders.get(p).is_some_and(|l| l.node == node)
        })
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
    let leader_epochs = (request.iter())
        .map(|(p, _, _)| leaders.get(p).map_or(-1, |l| l.epoch))
        .collect();
    Fetchable {
        request,
        leader_epochs,
        wake,
    }
}

/// Fetches the partitions `node` leads, one request at a time, for as long as the fetcher runs.
async fn broker_task(shared: Arc<Shared>, node: i32) {
    let config = &shared.config;
    let mut connection: Option<Connection> = None;
    let waits = shared.config.waits;
    let mut backoff = Backoff::new(waits.reconnect, waits.reconnect_max);
    let mut response = Vec::new();
    let mut scratch = Vec::new();
    loop {
        shared.budget.room().await;
        let (mut request, leader_epochs, address) = loop {
            let work = shared.work.notified();
            let wake = {
                let mut state = shared.lock();
                let Fetchable {
                    request,
                    leader_epochs,
                    wake,
                } = fetchable(&mut state, node);
                if !request.is_empty() {
                    let address = state.brokers.get(&node).cloned();
                    break (request, leader_epochs, address);
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
            let positions: Vec<FetchPosition> = (request.iter().zip(&leader_epochs))
                .map(
                    |(&(partition, offset, _), &current_leader_epoch)| FetchPosition {
                        partition,
                        offset,
                        current_leader_epoch,
                        last_fetched_epoch: -1,
                    },
                )
                .collect();
            let wait = Duration::from_millis(config.limits.max_wait_ms as u64);
            let version = c.version(protocol::FETCH);
            c.request_waiting(
                protocol::FETCH,
                |w| {
                    protocol::fetch_request(
                        w,
                        version,
                        &config.topic,
                        &positions,
                        config.limits,
                        config.isolation,
                    )
                },
                &mut response,
                wait,
            )
            .await
            .map_err(Some)
            .map(|()| version)
        }
        .await;
        match outcome {
            Ok(version) => {
                // The response's record sets are slices of its bytes: the buffer goes as
                // `Bytes`, and comes back for the next response once they are dropped.
                let body = Bytes::from(std::mem::take(&mut response));
                let handled = match FetchResponse::decode(&mut body.clone(), version) {
                    Ok(fetched) if !fetched.error().is_error() => {
                        backoff.reset();
                        let partitions = fetched.partitions(&config.topic);
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
                        Ok(fetched.throttle_time_ms())
                    }
                    Ok(fetched) => Err(format!("fetch refused as a whole: {}", fetched.error())),
                    Err(e) => Err(format!("a malformed fetch response: {e}")),
                };
                response = reclaim(body);
                match handled {
                    Ok(throttle) => {
                        // A throttled response is handled, then the broker gets nothing more
                        // until the throttle is over: a request sent sooner would only wait on
                        // its muted connection.
                        if throttle > 0 {
                            let _ = shared.out.send(Fetched::Throttled { node, ms: throttle });
                            tokio::time::sleep(Duration::from_millis(u64::from(throttle))).await;
                        }
                        continue;
                    }
                    Err(error) => {
                        tracing::warn!(node, %error, "fetcher: a fetch response not used");
                        connection = None;
                    }
                }
            }
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

/// The buffer of a handled response, for the next one: its allocation is kept when nothing
/// holds a slice of it any more (always, once the response's partitions are handled).
fn reclaim(body: Bytes) -> Vec<u8> {
    body.try_into_mut().map(Vec::from).unwrap_or_default()
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
                let reading = Reading {
                    check_crcs: shared.config.check_crcs,
                    isolation: shared.config.isolation,
                };
                let built = chunk(
                    &shared.budget,
                    partition,
                    epoch,
                    offset,
                    &part,
                    reading,
                    scratch,
                );
                let mut state = shared.lock();
                let Some(w) = state.wanted.get_mut(&partition) else {
                    continue;
                };
                if w.epoch != epoch {
                    continue;
                }
                if built.next > w.offset {
                    w.offset = built.next;
                }
                if let Some(chunk) = built.chunk {
                    // Queued before the partition can be fetched again: chunks stay in order.
                    let _ = shared.out.send(Fetched::Chunk(chunk));
                }
                if let Some(reason) = built.corrupt {
                    w.not_before = Some(std::time::Instant::now() + CORRUPT_BACKOFF);
                    let _ = shared.out.send(Fetched::Corrupt {
                        partition,
                        offset: built.next,
                        reason,
                    });
                }
            }
            ErrorCode::OFFSET_OUT_OF_RANGE => out_of_range.push((partition, offset, epoch)),
            error if error.is_stale_leadership() => {
                tracing::debug!(node, partition, %error, "fetcher: leadership moved");
                back_off(shared, partition);
                let mut state = shared.lock();
                state.leaders.remove(&partition);
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

/// Keeps `partition` from being fetched for `fetch.error.backoff.ms`.
fn back_off(shared: &Shared, partition: i32) {
    if let Some(w) = shared.lock().wanted.get_mut(&partition) {
        w.not_before = Some(std::time::Instant::now() + shared.config.waits.fetch_error);
    }
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
            leaders: [(0, (1, 7)), (1, (1, 0)), (2, (2, 0)), (3, (1, 0))]
                .map(|(p, (node, epoch))| (p, Leader { node, epoch }))
                .into(),
            wanted: [
                (0, w(false, false)),
                (1, w(true, false)),
                (2, w(false, false)),
                (3, w(false, true)),
            ]
            .into(),
            ..State::default()
        };
        let first = fetchable(&mut state, 1);
        assert_eq!(first.request, [(0, 5, 1)]);
        assert_eq!(first.leader_epochs, [7], "sent with the fetch");
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
        state.leaders.insert(4, Leader { node: 1, epoch: 0 });
        let backing_off = fetchable(&mut state, 1);
        assert!(backing_off.request.is_empty(), "backing off");
        assert_eq!(backing_off.wake, Some(soon), "woken when the backoff ends");
        state.wanted.get_mut(&4).expect("wanted").not_before = Some(std::time::Instant::now());
        let after = fetchable(&mut state, 1);
        assert_eq!((after.request, after.wake), (vec![(4, 5, 1)], None));
    }
}

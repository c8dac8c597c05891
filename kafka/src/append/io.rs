//! The appender's I/O thread: the metadata loop (partitions, leaders, the producer id) and one
//! task per leading broker sending its partitions' batches, one `Produce` at a time.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::backoff::Backoff;
use crate::connection::{Connection, ConnectionError};
use crate::protocol;

use super::state::{Part, Shared, complete, encode, expire, seal, settle, take_batches, wall_ms};

/// The I/O thread's work: the clock, lingering batches, metadata, the producer id, and one task
/// per broker.
pub(super) async fn io_main(shared: Arc<Shared>) {
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
pub(super) async fn metadata_loop(shared: Arc<Shared>) {
    let config = &shared.config;
    let mut connection: Option<Connection> = None;
    let mut backoff = Backoff::new(config.retry_backoff.0, config.retry_backoff.1);
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
                Some(c.init_producer_id().await?)
            } else {
                None
            };
            Ok((metadata, producer))
        }
        .await;
        match outcome {
            Ok((metadata, producer)) => {
                backoff.reset();
                let leaderless = apply_metadata(&shared, &metadata, producer);
                shared.work.notify_waiters();
                let wait = if leaderless {
                    config.retry_backoff.1 / 4
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
                backoff.wait().await;
            }
        }
    }
}

/// Takes in the topic's metadata (and the producer id, once): partition count, leaders, a task
/// for each new leading broker; returns whether a partition has no leader.
pub(super) fn apply_metadata(
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

/// Sends the batches of the partitions `node` leads, one request at a time, until the appender
/// is dropped.
pub(super) async fn broker_task(shared: Arc<Shared>, node: i32) {
    let config = &shared.config;
    let mut connection: Option<Connection> = None;
    let mut response = Vec::new();
    let mut backoff = Backoff::new(config.retry_backoff.0, config.retry_backoff.1);
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
                backoff.reset();
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
            backoff.wait().await;
        }
        shared.work.notify_waiters();
    }
}

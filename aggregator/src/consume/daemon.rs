//! The daemon's loop: [`Aggregator`] owns the Kafka consumer and waits, in one task, for the
//! next of: shutdown, a task's report, the tick, a chunk from tally's fetcher, or a run of
//! librdkafka's messages (group events only, when the fetcher reads the partitions); each goes to
//! the shared state (`crate::consume`), whose partitions' state machines decide what happens.

use std::sync::Arc;
use std::time::Duration;

use futures_core::Stream;
use rdkafka::ClientConfig;
use rdkafka::consumer::stream_consumer::MessageStream;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::BorrowedMessage;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use tally_kafka::{Fetched, Fetcher};

use crate::consume::decide::{Decided, Decider};
use crate::consume::flush::Flusher;
use crate::consume::idempotency::WarmUp;
use crate::consume::rebalance::AggregatorContext;
use crate::consume::{LoopSettings, Report, RunSummary, Shared};
use crate::store::sink::Sink;

/// Most messages taken from librdkafka's queue in one go (one lock of the partitions, one
/// trip through the loop).
const MAX_DRAIN: usize = 1_024;

/// Waits for the next message, then takes every message already waiting behind it, up to
/// [`MAX_DRAIN`]: one wake-up and one lock per run of messages instead of per message.
async fn ready_messages<'a, C: rdkafka::consumer::ConsumerContext>(
    stream: &mut MessageStream<'a, C>,
) -> Vec<KafkaResult<BorrowedMessage<'a>>> {
    std::future::poll_fn(|cx| {
        let mut messages = Vec::new();
        while messages.len() < MAX_DRAIN {
            match std::pin::Pin::new(&mut *stream).poll_next(cx) {
                std::task::Poll::Ready(Some(message)) => messages.push(message),
                std::task::Poll::Ready(None) | std::task::Poll::Pending => break,
            }
        }
        if messages.is_empty() {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(messages)
        }
    })
    .await
}

/// How much the aggregator fetches per partition and holds fetched, through librdkafka or
/// tally's fetcher, unless the operator's Kafka options say otherwise. Fetch more per
/// partition, hold less: librdkafka's defaults (1 MiB per partition per fetch, 64 MiB queued)
/// caught up at 363,209 events/s with a 160 MiB peak RSS; these at 506,765 events/s with 280
/// MiB (3,000,000 events, 8 partitions, 2 cores; 8 MiB fetches reached 862,161 events/s but
/// peaked at 723 MiB). Through tally's fetcher, against its library defaults (4 MiB, 64 MiB)
/// over the bench's 5,000,000 events, 8 alternated rounds: 0.99 x the rate (0.78-1.16), peak
/// RSS 78-95 MiB against 131-147.
pub(crate) const FETCH_SIZES: [(&str, &str); 2] = [
    ("max.partition.fetch.bytes", "2097152"),
    ("queued.max.messages.kbytes", "16384"),
];

/// The aggregator: a consumer, its partitions' state, and the flusher.
pub struct Aggregator<S: Sink> {
    shared: Arc<Shared<S>>,
    consumer: StreamConsumer<AggregatorContext<S>>,
    done_rx: mpsc::UnboundedReceiver<Report>,
    /// What tally's fetcher reads, when it reads the partitions.
    fetched_rx: Option<Feed>,
}

/// Where tally's fetcher's chunks come from: the fetcher, or the decider after it (when a
/// namespace keeps an idempotency window).
enum Feed {
    Fetched(mpsc::UnboundedReceiver<Fetched>),
    Decided(mpsc::UnboundedReceiver<Decided>),
}

/// The next thing tally's fetcher handed over; never, without one.
async fn next_fetched(rx: &mut Option<Feed>) -> Option<Decided> {
    match rx {
        Some(Feed::Fetched(rx)) => rx.recv().await.map(|fetched| (fetched, None)),
        Some(Feed::Decided(rx)) => rx.recv().await,
        None => std::future::pending().await,
    }
}

impl<S: Sink> std::fmt::Debug for Aggregator<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aggregator")
            .field("settings", &self.shared.settings)
            .finish_non_exhaustive()
    }
}

impl<S: Sink> Aggregator<S> {
    /// Creates the consumer from `kafka` (tally's consumer settings are applied first, `kafka`'s
    /// own entries override them) and subscribes to the topic. Must run inside a multi-threaded
    /// Tokio runtime.
    pub fn new(
        kafka: &ClientConfig,
        settings: LoopSettings,
        flusher: Flusher<S>,
    ) -> Result<Self, KafkaError> {
        // Idempotency keys: partitions rebuild their recent ids from the log with a consumer of
        // their own, with the operator's Kafka settings (security...).
        let warm_up = WarmUp::new(
            kafka,
            &settings.topic,
            settings.namespaces.clone(),
            settings.max_message_bytes,
        );
        // tally's fetcher, when it reads the partitions (librdkafka then only runs the group).
        let (fetcher, fetched_rx) = match &settings.fetch {
            Some(config) => {
                let (fetcher, rx) = Fetcher::start(config.clone());
                (Some(fetcher), Some(rx))
            }
            None => (None, None),
        };
        let namespaces = settings.namespaces.clone();
        let max_message_bytes = settings.max_message_bytes;
        let ids = warm_up.is_some();
        let (shared, done_rx) = Shared::new(settings, flusher, warm_up, fetcher);
        // Idempotency keys are decided on a thread of their own, between the fetcher and
        // the loop.
        let fetched_rx = fetched_rx.map(|rx| {
            if ids {
                let decider = Decider::new(namespaces, max_message_bytes);
                Feed::Decided(decider.start(shared.ids.clone(), rx))
            } else {
                Feed::Fetched(rx)
            }
        });
        // tally's consumer settings under the operator's: start from the operator's (copying the
        // config, never its `config_map()`, which masks secrets such as `sasl.password`).
        let mut config = kafka.clone();
        let defaults = [
            ("enable.auto.commit", "false"),
            ("auto.offset.reset", "earliest"),
            ("enable.partition.eof", "false"),
            // Each report tells every partition where its log ends (its pace, see
            // `pace::Pace`) and feeds the lag gauge.
            ("statistics.interval.ms", "1000"),
            // Once a partition's prefetched messages pass the queue limits above, librdkafka
            // waits this long before fetching it again. Its default, 1,000 ms, starved a
            // catch-up: every partition got one burst a second and the machine sat 63-76% idle
            // (2 M JSON events, 8 partitions: 149,000 events/s). Measured from launch to the
            // last flush on the same topic, two runs each: 1 ms 622-623k, 10 ms 633-667k,
            // 50 ms 608-621k, 200 ms 475-518k events/s.
            ("fetch.queue.backoff.ms", "10"),
            // Partitions added to the topic are noticed at the next metadata refresh (which
            // starts the rebalance that assigns them): librdkafka's default is 5 minutes.
            ("topic.metadata.refresh.interval.ms", "5000"),
        ];
        for (key, value) in FETCH_SIZES.into_iter().chain(defaults) {
            if config.get(key).is_none() {
                config.set(key, value);
            }
        }
        let consumer: StreamConsumer<_> = config.create_with_context(AggregatorContext {
            shared: shared.clone(),
        })?;
        consumer.subscribe(&[&shared.settings.topic])?;
        Ok(Self {
            shared,
            consumer,
            done_rx,
            fetched_rx,
        })
    }

    /// Consumes until `shutdown` fires, then drains every partition (bounded by the shutdown
    /// timeout), commits, and closes the consumer.
    pub async fn run(mut self, shutdown: CancellationToken) -> RunSummary {
        let shared = self.shared.clone();
        let interval = shared.settings.limits.flush_interval;
        // A batch is flushed within one period after its flush time: that slack is part of the
        // end-to-end latency.
        let period = (interval / 100).clamp(Duration::from_millis(1), Duration::from_millis(10));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut stream = self.consumer.stream();
        tokio::spawn(super::refresh_plan(shared.clone(), shutdown.clone()));
        if let Some(shortest) = shared.settings.namespaces.shortest_expiry_ms() {
            let every = crate::tasks::expiry::interval(shortest);
            tokio::spawn(super::expirer::run(shared.clone(), every, shutdown.clone()));
        }
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                () = shared.outdated.fired.cancelled() => break,
                Some(report) = self.done_rx.recv() => shared.report(&self.consumer, report),
                _ = tick.tick() => shared.tick(&self.consumer),
                Some(fetched) = next_fetched(&mut self.fetched_rx) => {
                    shared.handle_fetched(&self.consumer, fetched);
                }
                messages = ready_messages(&mut stream) => {
                    shared.handle_messages(&self.consumer, &messages);
                }
            }
        }
        drop(stream);
        shared.metrics.group_membership(false);
        tracing::info!("shutting down: draining every partition");
        let drained = shared.drain_all(&self.consumer).await;
        shared.metrics.buffers(0, 0, 0, 0);
        self.consumer.unsubscribe();
        RunSummary {
            drained: drained.drained,
            not_drained: drained.not_drained,
            outdated: shared.outdated.why(),
        }
    }
}

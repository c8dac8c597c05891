//! The consumer's context: librdkafka's callbacks (rebalances, statistics, logs, errors), each
//! handed to the loop's shared state (`crate::consume`). They run inside the consumer's poll.
//! A revoke drains the revoked partitions before it returns (`Shared::revoke`); an assignment
//! gives each new partition its state machine (`Shared::assign`); statistics tell each
//! partition where its log ends, for its pace.

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::statistics::Statistics;

use crate::consume::Shared;
use crate::store::sink::Sink;

/// The consumer's context: rebalance hooks, statistics, logs.
pub struct AggregatorContext<S> {
    /// The state the consume loop shares with these callbacks.
    pub(crate) shared: std::sync::Arc<Shared<S>>,
}

impl<S> std::fmt::Debug for AggregatorContext<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AggregatorContext")
    }
}

impl<S: Sink> ClientContext for AggregatorContext<S> {
    fn stats(&self, statistics: Statistics) {
        if self.shared.source.knows_lag() {
            // librdkafka fetches nothing: the partitions know their lag from the fetcher.
            self.shared.metrics.consumer_lag(self.shared.lags());
            return;
        }
        let partitions = statistics
            .topics
            .get(&self.shared.settings.topic)
            .into_iter()
            .flat_map(|t| t.partitions.iter())
            .filter(|(p, _)| **p >= 0);
        // A report without the topic (no partition owned) clears the lag gauge.
        let lags = partitions
            .clone()
            .filter(|(_, s)| s.consumer_lag >= 0)
            .map(|(p, s)| (*p, s.consumer_lag));
        self.shared.metrics.consumer_lag(lags);
        // Where each owned partition's log ends, for its pace: the last stable offset (what a
        // read_committed consumer can read), the high watermark where that is unknown. A
        // partition not fetched yet reports neither (-1); it keeps the end read at its
        // acquisition.
        self.shared.log_ends(partitions.map(|(partition, stats)| {
            let end = if stats.ls_offset >= 0 {
                stats.ls_offset
            } else {
                stats.hi_offset
            };
            (*partition, end)
        }));
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", fac, "{log_message}"),
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", fac, "{log_message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", fac, "{log_message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", fac, "{log_message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", %error, reason, "Kafka client error");
    }
}

impl<S: Sink> ConsumerContext for AggregatorContext<S> {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(revoked) = rebalance {
            self.shared.revoke(consumer, revoked);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let metrics = &self.shared.metrics;
        match rebalance {
            Rebalance::Assign(assigned) => {
                self.shared.assign(consumer, assigned);
                metrics.group_membership(true);
            }
            // A revoke in a rebalance keeps the membership; a lost assignment (session timeout,
            // max.poll.interval.ms exceeded) does not.
            Rebalance::Revoke(_) => {
                if consumer.assignment_lost() {
                    metrics.group_membership(false);
                }
            }
            Rebalance::Error(error) => {
                metrics.group_membership(false);
                tracing::error!(%error, "rebalance failed");
            }
        }
    }
}

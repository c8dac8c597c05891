//! The server's Prometheus metrics, served at `GET /metrics`:
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `tally_http_requests_total` | `route`, `method`, `status` | requests answered (`route` is the route's template, never a counter id) |
//! | `tally_http_request_duration_seconds` | `route` | time to answer |
//! | `tally_http_events_accepted_total` | | events Kafka acknowledged through `POST /v1/events` |
//! | `tally_http_events_unacknowledged_total` | | events Kafka did not acknowledge (answered 503) |
//! | `tally_http_cache_reads_total` | `outcome` | what the read cache did: `local_hit`, `stale_served`, `shared_hit`, `shard_read` |

use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry, TextEncoder,
};
use tally_common::CacheStats;

/// The server's metrics.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    duration: HistogramVec,
    /// Events Kafka acknowledged.
    pub events_accepted: IntCounter,
    /// Events Kafka did not acknowledge.
    pub events_failed: IntCounter,
    cache_reads: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("tally_http_requests_total", "HTTP requests answered"),
            &["route", "method", "status"],
        )
        .expect("valid metric");
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "tally_http_request_duration_seconds",
                "Time to answer an HTTP request",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            &["route"],
        )
        .expect("valid metric");
        let events_accepted = IntCounter::new(
            "tally_http_events_accepted_total",
            "Events Kafka acknowledged through POST /v1/events",
        )
        .expect("valid metric");
        let events_failed = IntCounter::new(
            "tally_http_events_unacknowledged_total",
            "Events Kafka did not acknowledge through POST /v1/events (answered 503)",
        )
        .expect("valid metric");
        let cache_reads = IntCounterVec::new(
            Opts::new(
                "tally_http_cache_reads_total",
                "What the read cache did, by outcome",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        for metric in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(duration.clone()),
            Box::new(events_accepted.clone()),
            Box::new(events_failed.clone()),
            Box::new(cache_reads.clone()),
        ] {
            registry.register(metric).expect("metric names are unique");
        }
        Self {
            registry,
            requests,
            duration,
            events_accepted,
            events_failed,
            cache_reads,
        }
    }

    /// Brings the cache counters up to `stats` (they only ever grow).
    fn sync_cache(&self, stats: &CacheStats) {
        for (outcome, value) in [
            ("local_hit", &stats.local_hits),
            ("stale_served", &stats.stale_served),
            ("shared_hit", &stats.shared_hits),
            ("shard_read", &stats.shard_reads),
        ] {
            let counter = self.cache_reads.with_label_values(&[outcome]);
            let now = value.load(Ordering::Relaxed);
            counter.inc_by(now.saturating_sub(counter.get()));
        }
    }

    /// The Prometheus text exposition of every metric, the cache's brought up to `stats`.
    pub fn render(&self, stats: &CacheStats) -> Vec<u8> {
        self.sync_cache(stats);
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("encoding to memory cannot fail");
        out
    }
}

/// A method as a label: one of the standard nine, or `other`, so a client making methods up
/// cannot grow the series without bound (routes are templates, statuses three digits).
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "other",
    }
}

/// The middleware counting and timing every request by its route's template.
pub async fn track(State(metrics): State<Metrics>, request: Request, next: Next) -> Response {
    let route = (request.extensions().get::<MatchedPath>())
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = method_label(request.method());
    let started = Instant::now();
    let response = next.run(request).await;
    metrics
        .duration
        .with_label_values(&[&route])
        .observe(started.elapsed().as_secs_f64());
    metrics
        .requests
        .with_label_values(&[&route, method, response.status().as_str()])
        .inc();
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_up_methods_share_one_label() {
        let made_up = axum::http::Method::from_bytes(b"BREW").expect("a token");
        assert_eq!(method_label(&made_up), "other");
        assert_eq!(method_label(&axum::http::Method::GET), "GET");
    }
}

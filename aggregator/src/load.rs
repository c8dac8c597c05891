//! The traffic generator behind `tally load`: Zipf-distributed counter events sent through the
//! producer crate, with the exact totals of what Kafka acknowledged.
//!
//! Only acknowledged events enter the totals, so a test can compare them with what the pipeline
//! wrote to Redis. Up to `window` events are in flight at once; a failed send is counted and
//! reported, never silently left out.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use tally_common::CounterEvent;
use tally_producer::{Pending, ProduceError, Producer};

/// What to generate.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Events to send.
    pub events: u64,
    /// Distinct counters to spread them over.
    pub counters: u64,
    /// Zipf exponent of counter popularity (0 = uniform).
    pub zipf: f64,
    /// Events per second (0 = as fast as possible).
    pub rate: u64,
    /// Counter ids are `<prefix><n>`.
    pub counter_prefix: String,
    /// Deltas are drawn uniformly from 1..=max_delta ...
    pub max_delta: i64,
    /// ... and negated with this probability.
    pub negative_share: f64,
    /// Distinct actors attached to events (0 = no actor).
    pub actors: u64,
    /// Seed of the random generator, for repeatable runs.
    pub seed: u64,
    /// Most events in flight at once.
    pub window: usize,
    /// Share of events sent to one counter, `<prefix>hot` (0 = none): a viral post.
    pub hot_share: f64,
    /// One event per counter: event `i` goes to `<prefix><i>` (`counters` and `zipf` are
    /// ignored), for a stream of distinct counters.
    pub distinct: bool,
}

impl Default for LoadSpec {
    fn default() -> Self {
        Self {
            events: 100_000,
            counters: 1_000,
            zipf: 1.1,
            rate: 0,
            counter_prefix: "likes:post:".to_owned(),
            max_delta: 1,
            negative_share: 0.0,
            actors: 10_000,
            seed: 42,
            window: 50_000,
            hot_share: 0.0,
            distinct: false,
        }
    }
}

/// What was sent.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Events Kafka acknowledged.
    pub acked: u64,
    /// Events that failed, with the first error.
    pub failed: u64,
    /// The first failure, if any.
    pub first_error: Option<String>,
    /// Wall time from the first send to the last acknowledgement.
    pub elapsed: Duration,
    /// Exact total per counter over acknowledged events.
    pub totals: HashMap<String, i64>,
}

impl LoadReport {
    /// Acknowledged events per second.
    pub fn events_per_second(&self) -> f64 {
        self.acked as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The `n` counters with the largest totals, largest first (ties by id).
    pub fn top(&self, n: usize) -> Vec<(&str, i64)> {
        let mut all: Vec<(&str, i64)> = self.totals.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        all.truncate(n);
        all
    }
}

/// Why a load could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The spec asks for something impossible.
    #[error("invalid load spec: {0}")]
    Spec(&'static str),
    /// A generated event was invalid (e.g. a counter prefix with braces).
    #[error(transparent)]
    Event(#[from] tally_common::EventError),
}

/// Sends `spec.events` events through `producer` and reports exactly what was acknowledged.
pub async fn run(producer: &Producer, spec: &LoadSpec) -> Result<LoadReport, LoadError> {
    if spec.counters == 0 || spec.max_delta < 1 {
        return Err(LoadError::Spec("counters and max_delta must be at least 1"));
    }
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let zipf = Zipf::new(spec.counters as f64, spec.zipf)
        .map_err(|_| LoadError::Spec("the Zipf exponent must be 0 or more"))?;
    let mut report = LoadReport::default();
    let mut in_flight: VecDeque<(Pending, String, i64)> = VecDeque::with_capacity(spec.window);
    let started = Instant::now();
    for i in 0..spec.events {
        let counter = if spec.distinct {
            format!("{}{i}", spec.counter_prefix)
        } else if spec.hot_share > 0.0 && rng.random_bool(spec.hot_share.clamp(0.0, 1.0)) {
            format!("{}hot", spec.counter_prefix)
        } else {
            format!("{}{}", spec.counter_prefix, zipf.sample(&mut rng) as u64)
        };
        let mut delta = rng.random_range(1..=spec.max_delta);
        if rng.random_bool(spec.negative_share.clamp(0.0, 1.0)) {
            delta = -delta;
        }
        let mut event = CounterEvent::new(counter.clone(), delta)?;
        if spec.actors > 0 {
            event = event.with_actor(format!("u{}", rng.random_range(0..spec.actors)))?;
        }
        if spec.rate > 0 && i % 100 == 0 {
            let due = started + Duration::from_secs_f64(i as f64 / spec.rate as f64);
            tokio::time::sleep_until(due.into()).await;
        }
        while in_flight.len() >= spec.window.max(1) {
            if let Some(oldest) = in_flight.pop_front() {
                settle(&mut report, oldest).await;
            }
        }
        match producer.enqueue(&event).await {
            Ok(pending) => in_flight.push_back((pending, counter, delta)),
            Err(e) => record_failure(&mut report, &e),
        }
    }
    while let Some(oldest) = in_flight.pop_front() {
        settle(&mut report, oldest).await;
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

async fn settle(report: &mut LoadReport, (pending, counter, delta): (Pending, String, i64)) {
    match pending.acked().await {
        Ok(_) => {
            report.acked += 1;
            *report.totals.entry(counter).or_default() += delta;
        }
        Err(e) => record_failure(report, &e),
    }
}

fn record_failure(report: &mut LoadReport, error: &ProduceError) {
    report.failed += 1;
    report.first_error.get_or_insert_with(|| error.to_string());
}

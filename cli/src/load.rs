//! The traffic generator behind `tally load`: Zipf-distributed counter events sent through the
//! producer crate, with the exact totals of what Kafka acknowledged.
//!
//! Only acknowledged events enter the totals, so a test can compare them with what the pipeline
//! wrote to Redis. Up to `window` events are in flight at once; a failed send is counted and
//! reported, never silently left out. Events go through [`BulkProducer`]: one delivery callback,
//! a reused encode buffer and counter indexes instead of a future and strings per event.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use tally_common::codec::EventRef;
use tally_common::event::now_ms;
use tally_producer::{BulkProducer, ProduceError, ProducerConfig};

/// How long the end of a load waits for Kafka to acknowledge what is still in flight.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(60);

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
    /// Each event carries an id, `e<i>` (for namespaces with idempotency keys).
    pub event_ids: bool,
    /// Sending threads, each with its own producer; event `i` goes through thread `i mod
    /// threads`. 0: one per core, up to 4, for an unpaced load (one thread saturates on
    /// librdkafka's per-message path, see `docs/performance/producer-profile.txt`); one for a
    /// paced load, whose draws then stay in the same order for the same seed.
    pub threads: usize,
    /// Stops sending once set: the events sent before are flushed and reported (`events` is
    /// then an upper bound), for a load that lasts as long as what it accompanies.
    pub stop: Option<Arc<AtomicBool>>,
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
            window: 400_000,
            hot_share: 0.0,
            distinct: false,
            event_ids: false,
            threads: 0,
            stop: None,
        }
    }
}

/// What was sent.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Events sent (`LoadSpec::events`, unless the load was stopped).
    pub sent: u64,
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
    /// The producer could not be created.
    #[error(transparent)]
    Producer(ProduceError),
}

impl LoadSpec {
    /// Checks the spec and returns how many counter slots it needs (slot 0 is the hot counter).
    fn check(&self) -> Result<usize, LoadError> {
        if self.counters == 0 || self.max_delta < 1 {
            return Err(LoadError::Spec("counters and max_delta must be at least 1"));
        }
        if self.max_delta > i64::from(i32::MAX) {
            return Err(LoadError::Spec("max_delta must fit in 32 bits"));
        }
        let slots = if self.distinct {
            self.events
        } else {
            self.counters
        };
        if slots >= u64::from(CounterIndex::MAX) {
            return Err(LoadError::Spec("at most 2^32 - 2 counters"));
        }
        tally_common::event::validate_counter(&format!("{}hot", self.counter_prefix))
            .map_err(|_| LoadError::Spec("the counter prefix makes invalid counter ids"))?;
        Ok(slots as usize + 1)
    }
}

/// Sends `spec.events` events with the producer crate's [`BulkProducer`] and reports exactly what
/// was acknowledged. The sending runs on a blocking thread (it never awaits per event).
pub async fn run(config: &ProducerConfig, spec: &LoadSpec) -> Result<LoadReport, LoadError> {
    let (config, spec) = (config.clone(), spec.clone());
    tokio::task::spawn_blocking(move || run_blocking(&config, &spec))
        .await
        .map_err(|_| LoadError::Spec("the load thread panicked"))?
}

/// Which counter an event goes to: index 0 is `<prefix>hot`, any other `n` is `<prefix><n>`.
type CounterIndex = u32;

/// A delivery token: the counter index in the high 32 bits, the delta in the low 32.
fn token(counter: CounterIndex, delta: i64) -> usize {
    let delta = i32::try_from(delta).expect("LoadSpec::check bounds deltas to i32");
    ((u64::from(counter) << 32) | u64::from(delta as u32)) as usize
}

fn untoken(token: usize) -> (CounterIndex, i64) {
    let token = token as u64;
    (
        (token >> 32) as CounterIndex,
        i64::from(token as u32 as i32),
    )
}

/// What the delivery callback has seen. Atomics, not a mutex: the callback runs once per event.
#[derive(Debug, Default)]
struct Acks {
    /// Events sent.
    sent: AtomicU64,
    /// Acknowledged events.
    acked: AtomicU64,
    /// The first failure.
    first_error: Mutex<Option<String>>,
    /// Total per counter index.
    totals: Vec<AtomicI64>,
    /// Whether a counter index has an acknowledged event.
    seen: Vec<AtomicBool>,
}

impl Acks {
    fn fail(&self, error: &ProduceError) {
        self.first_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(|| error.to_string());
    }
}

/// One event's random choices: its counter, delta and actor (`u32::MAX`: none).
#[derive(Debug, Clone, Copy)]
struct Draw {
    /// The counter index.
    counter: CounterIndex,
    /// The delta.
    delta: i32,
    /// The actor index, `NO_ACTOR` when the event carries none.
    actor: u32,
}

/// [`Draw::actor`] of an event without an actor.
const NO_ACTOR: u32 = u32::MAX;

/// Most events an unpaced load draws before its clock starts (12 bytes each: 1.2 GB); a larger
/// load draws each event as it sends it.
const MAX_PREDRAWN: u64 = 100_000_000;

/// Draws events from a seeded generator, the same sequence for the same spec.
struct Generator<'a> {
    spec: &'a LoadSpec,
    rng: StdRng,
    zipf: Zipf<f64>,
}

impl<'a> Generator<'a> {
    fn new(spec: &'a LoadSpec) -> Result<Self, LoadError> {
        let zipf = Zipf::new(spec.counters as f64, spec.zipf)
            .map_err(|_| LoadError::Spec("the Zipf exponent must be 0 or more"))?;
        if spec.actors >= u64::from(NO_ACTOR) {
            return Err(LoadError::Spec("at most 2^32 - 2 actors"));
        }
        Ok(Self {
            spec,
            rng: StdRng::seed_from_u64(spec.seed),
            zipf,
        })
    }

    /// Event `i`'s draw.
    fn draw(&mut self, i: u64) -> Draw {
        let spec = self.spec;
        let counter: CounterIndex = if spec.distinct {
            i as CounterIndex + 1
        } else if spec.hot_share > 0.0 && self.rng.random_bool(spec.hot_share.clamp(0.0, 1.0)) {
            0
        } else {
            self.zipf.sample(&mut self.rng) as CounterIndex
        };
        let mut delta = self.rng.random_range(1..=spec.max_delta);
        if self.rng.random_bool(spec.negative_share.clamp(0.0, 1.0)) {
            delta = -delta;
        }
        let actor = if spec.actors > 0 {
            self.rng.random_range(0..spec.actors) as u32
        } else {
            NO_ACTOR
        };
        Draw {
            counter,
            delta: i32::try_from(delta).expect("LoadSpec::check bounds deltas to i32"),
            actor,
        }
    }
}

/// A counter index's id: index 0 is `<prefix>hot`, any other `n` is `<prefix><n>` (`<prefix><n -
/// 1>` for a load of distinct counters, whose event `i` goes to index `i + 1`).
fn counter_name(spec: &LoadSpec, index: usize) -> String {
    if index == 0 {
        format!("{}hot", spec.counter_prefix)
    } else if spec.distinct {
        format!("{}{}", spec.counter_prefix, index - 1)
    } else {
        format!("{}{index}", spec.counter_prefix)
    }
}

/// What every sending thread shares.
struct Sender<'a> {
    spec: &'a LoadSpec,
    counters: &'a [String],
    actors: &'a [String],
    /// The events drawn before the clock started (unpaced loads), else empty.
    predrawn: &'a [Draw],
    /// Draws the rest, in event order.
    generator: &'a Mutex<Generator<'a>>,
    acks: &'a Arc<Acks>,
    threads: usize,
}

impl Sender<'_> {
    /// Sends thread `t`'s share of the events (event `i` with `i mod threads == t`) through a
    /// producer of its own, then waits for their acknowledgements.
    fn send(&self, config: &ProducerConfig, t: usize, started: Instant) -> Result<(), LoadError> {
        let (spec, threads) = (self.spec, self.threads as u64);
        let reports = Arc::clone(self.acks);
        let mut producer = BulkProducer::new(config, move |token, outcome| match outcome {
            Ok(_) => {
                reports.acked.fetch_add(1, Ordering::Relaxed);
                let (counter, delta) = untoken(token);
                reports.totals[counter as usize].fetch_add(delta, Ordering::Relaxed);
                reports.seen[counter as usize].store(true, Ordering::Relaxed);
            }
            Err(e) => reports.fail(&e),
        })
        .map_err(LoadError::Producer)?;
        let window = (spec.window / self.threads).max(1);
        let mut ts_ms = now_ms();
        let mut id = String::new();
        let mut sent = 0;
        for (n, i) in (t as u64..spec.events).step_by(self.threads).enumerate() {
            if n % 100 == 0
                && spec
                    .stop
                    .as_ref()
                    .is_some_and(|s| s.load(Ordering::Relaxed))
            {
                break;
            }
            sent += 1;
            // The event time, read once per 256 events: a clock read per event is a tenth of
            // the cost.
            if n % 256 == 0 {
                ts_ms = now_ms();
            }
            let draw = match self.predrawn.get(i as usize) {
                Some(draw) => *draw,
                None => (self.generator.lock())
                    .unwrap_or_else(PoisonError::into_inner)
                    .draw(i),
            };
            if spec.rate > 0 && n % 100 == 0 {
                let rate = spec.rate as f64 / threads as f64;
                let due = started + Duration::from_secs_f64(n as f64 / rate);
                while let Some(wait) = due.checked_duration_since(Instant::now()) {
                    producer.poll(wait);
                }
            }
            while n % 64 == 0 && producer.in_flight() >= window {
                producer.poll(Duration::from_millis(1));
            }
            if spec.event_ids {
                id.clear();
                // Writing to a String cannot fail.
                let _ = write!(id, "e{i}");
            }
            let event = EventRef {
                counter: Cow::Borrowed(&self.counters[draw.counter as usize]),
                delta: i64::from(draw.delta),
                actor: (draw.actor != NO_ACTOR)
                    .then(|| Cow::Borrowed(self.actors[draw.actor as usize].as_str())),
                ts_ms,
                event_id: spec.event_ids.then_some(Cow::Borrowed(id.as_str())),
                reset: false,
            };
            if let Err(e) = producer.send(&event, token(draw.counter, i64::from(draw.delta))) {
                self.acks.fail(&e);
            }
        }
        self.acks.sent.fetch_add(sent, Ordering::Relaxed);
        if let Err(e) = producer.flush(FLUSH_TIMEOUT) {
            self.acks.fail(&e);
        }
        Ok(())
    }
}

fn run_blocking(config: &ProducerConfig, spec: &LoadSpec) -> Result<LoadReport, LoadError> {
    let slots = spec.check()?;
    let mut generator = Generator::new(spec)?;
    // Every counter and actor id is formatted once, not once per event.
    let counters: Vec<String> = (0..slots).map(|index| counter_name(spec, index)).collect();
    let actors: Vec<String> = (0..spec.actors).map(|n| format!("u{n}")).collect();
    // An unpaced load measures the producer, so its events are drawn before the clock starts,
    // as a yardstick's input file is written before it starts; a paced one draws as it goes.
    let predrawn: Vec<Draw> = if spec.rate == 0 && spec.events <= MAX_PREDRAWN {
        (0..spec.events).map(|i| generator.draw(i)).collect()
    } else {
        Vec::new()
    };
    let acks = Arc::new(Acks {
        totals: (0..slots).map(|_| AtomicI64::new(0)).collect(),
        seen: (0..slots).map(|_| AtomicBool::new(false)).collect(),
        ..Acks::default()
    });
    let threads = match spec.threads {
        0 if spec.rate == 0 => std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
        0 => 1,
        n => n,
    };
    let generator = Mutex::new(generator);
    let sender = Sender {
        spec,
        counters: &counters,
        actors: &actors,
        predrawn: &predrawn,
        generator: &generator,
        acks: &acks,
        threads,
    };
    let started = Instant::now();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let sender = &sender;
                scope.spawn(move || sender.send(config, t, started))
            })
            .collect();
        for handle in handles {
            match handle.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(LoadError::Spec("a sending thread panicked")),
            }
        }
        Ok(())
    })?;
    let elapsed = started.elapsed();
    let totals = (acks.totals.iter().zip(&acks.seen).enumerate())
        .filter(|(_, (_, seen))| seen.load(Ordering::Relaxed))
        .map(|(index, (total, _))| (counters[index].clone(), total.load(Ordering::Relaxed)))
        .collect();
    let acked = acks.acked.load(Ordering::Relaxed);
    let sent = acks.sent.load(Ordering::Relaxed);
    let first_error = acks
        .first_error
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    Ok(LoadReport {
        sent,
        acked,
        // Events refused, failed, or never reported before the flush gave up.
        failed: sent - acked,
        first_error,
        elapsed,
        totals,
    })
}

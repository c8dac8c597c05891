//! What every handler shares, and the API's limits.

use std::time::Duration;

use tally_common::RedisConn;
use tally_producer::{Counts, Producer};

use crate::metrics::Metrics;
use crate::pipeline::Pipeline;

/// Most counters one `batch-get` may name.
pub const MAX_BATCH: usize = 1_000;

/// Most counters `top` returns.
pub const MAX_TOP: usize = 100;

/// Largest request body accepted, in bytes: a full batch of events or counter ids fits.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// Longest `/readyz` waits for Redis to answer its `PING`.
pub const READY_PING_TIMEOUT: Duration = Duration::from_secs(1);

/// What every handler shares.
#[derive(Debug)]
pub struct AppState {
    /// Reads through the cache; likes by each namespace's write path.
    pub counts: Counts,
    /// Appends events to tally's topic.
    pub producer: Producer,
    /// The Redis connection, for readiness.
    pub conn: RedisConn,
    /// The pipeline's progress, for the console.
    pub pipeline: Pipeline,
    /// The server's metrics.
    pub metrics: Metrics,
}

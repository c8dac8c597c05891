//! What every handler shares.

use tally_common::RedisConn;
use tally_producer::{Counts, Producer};

use crate::metrics::Metrics;
use crate::pipeline::Pipeline;

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

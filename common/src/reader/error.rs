//! Why a read fails.

use crate::event::EventError;
use crate::regroup::PlanError;

/// Why a read failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The counter id is not valid, so it can have no value.
    #[error("invalid counter id: {0}")]
    InvalidCounter(#[from] EventError),
    /// Redis failed or timed out.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A key of the counter holds something that is not a count.
    #[error("a key of {counter} holds {value:?}, not a count")]
    Corrupt {
        /// The counter.
        counter: String,
        /// What the key holds.
        value: String,
    },
    /// The shards add up to more than an i64 holds.
    #[error("the shards of {counter} add up to more than 64 bits")]
    Overflow {
        /// The counter.
        counter: String,
    },
    /// The counter's namespace keeps no window that can answer for this span.
    #[error("{counter}: {why}")]
    Window {
        /// The counter.
        counter: String,
        /// Why, with the windows the namespace keeps.
        why: String,
    },
    /// A window read of more (counter, bucket) pairs than
    /// [`crate::window::MAX_WINDOW_CELLS`].
    #[error("the read sums {cells} (counter, bucket) pairs; at most {max} per read: ask for fewer counters or a shorter span", max = crate::window::MAX_WINDOW_CELLS)]
    WindowTooLarge {
        /// The pairs it would sum.
        cells: i64,
    },
    /// The store of record (PostgreSQL) failed or timed out.
    #[error("the store of record: {0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The deployment's group plan is unreadable, or was made for another group count.
    #[error("{0}")]
    Groups(String),
    /// The deployment's layout record (`crate::layout`) is unreadable.
    #[error("{0}")]
    Layout(String),
    /// Reads on a Redis Cluster kept taking longer than a shrink's fold allows: such a read
    /// could count an amount moving between groups twice or not at all, so none is answered.
    #[error(
        "{attempts} reads in a row took longer than {bound:?} while a shrink folds shares on the Redis Cluster; try again"
    )]
    Slow {
        /// The reads tried.
        attempts: u32,
        /// How long each may take ([`crate::regroup::FOLD_READ_BOUND`]).
        bound: std::time::Duration,
    },
}

impl From<PlanError> for ReadError {
    fn from(error: PlanError) -> Self {
        match error {
            PlanError::Redis(e) => Self::Redis(e),
            other => Self::Groups(other.to_string()),
        }
    }
}

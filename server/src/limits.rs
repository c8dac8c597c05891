//! The API's limits on what one request may ask: below every handler, so that the handlers,
//! the errors that name them and the router all read them from one place.

use std::time::Duration;

/// Most counters one `batch-get` may name.
pub const MAX_BATCH: usize = 1_000;

/// Most counters `top` returns.
pub const MAX_TOP: usize = 100;

/// Largest request body accepted, in bytes: a full batch of events or counter ids fits.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// Longest `/readyz` waits for Redis to answer its `PING`.
pub const READY_PING_TIMEOUT: Duration = Duration::from_secs(1);

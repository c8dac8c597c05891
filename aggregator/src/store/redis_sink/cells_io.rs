//! The cells half of the Redis sink: reading the fields a write changes, and at-least-once
//! window writes through `scripts/cells.lua` (`crate::store::cells` plans them).

use std::time::Duration;

use redis::ErrorKind;
use tally_kafka::backoff::Backoff;

use super::{RedisSink, unexpected};
use crate::machine::batch::WindowDelta;
use crate::machine::verdict::window_rejections;
use crate::store::cells;
use crate::store::sink::{Rejection, SinkError, SinkErrorKind};
use crate::store::store_error::RedisReply;

impl RedisSink {
    /// Reads the cells `reads` names and plans the window deltas' rewrites.
    pub(super) async fn read_cells(
        &self,
        reads: &cells::Reads,
        windows: &[WindowDelta],
    ) -> Result<cells::Plan, SinkError> {
        let got = if reads.is_empty() {
            Vec::new()
        } else {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            reads.add_to(&mut pipe);
            let mut conn = self.conn.clone();
            let replies: Vec<redis::Value> = pipe.query_async(&mut conn).await?;
            (replies.iter())
                .map(cells::Read::from_reply)
                .collect::<Result<Vec<_>, _>>()?
        };
        Ok(cells::plan(reads, &got, windows, cells::now_ms()))
    }

    /// An at-least-once write's window deltas through `scripts/cells.lua`, with the ones refused.
    pub(super) async fn script_cells(
        &self,
        group: u32,
        windows: &[WindowDelta],
    ) -> Result<Vec<Rejection>, SinkError> {
        let reads = cells::Reads::new(&self.keyspace, group, windows);
        let mut backoff = stale_backoff();
        for _ in 0..MAX_STALE_READS {
            let plan = self.read_cells(&reads, windows).await?;
            let refused = window_rejections(&plan.currents, windows);
            if plan.writes.is_empty() {
                return Ok(refused);
            }
            let mut invocation = self.scripts.cells.prepare_invoke();
            invocation.arg(plan.writes.len());
            for stripe in &plan.writes {
                invocation
                    .key(&stripe.key)
                    .arg(stripe.expire_at_ms)
                    .arg(stripe.fields.len());
                for f in &stripe.fields {
                    invocation
                        .arg(&f.field)
                        .arg(f.read.as_deref().unwrap_or(""))
                        .arg(f.value.as_deref().unwrap_or(""));
                }
            }
            let mut conn = self.conn.clone();
            let reply: Vec<String> = invocation.invoke_async(&mut conn).await?;
            match reply.first().map(String::as_str) {
                Some("ok") => return Ok(refused),
                Some("stale") => backoff.wait().await,
                Some("failed") => {
                    return Err(SinkError::from(RedisReply(
                        reply.get(1).cloned().unwrap_or_default(),
                    )));
                }
                _ => return Err(unexpected(&reply)),
            }
        }
        Err(stale_cells())
    }
}

/// How many times one flush reads the cells again after another writer changed them before it
/// reports a retryable error (the flush's own retry then backs off).
pub(super) const MAX_STALE_READS: usize = 32;

/// The wait before reading changed cells again: jittered, so that two writers racing for one
/// field do not keep meeting (from up to 1 ms to up to 20 ms).
pub(super) fn stale_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(1), Duration::from_millis(20))
}

/// The error of a flush whose cells kept changing under it.
pub(super) fn stale_cells() -> SinkError {
    SinkError {
        kind: SinkErrorKind::Retryable,
        source: Box::new(redis::RedisError::from((
            ErrorKind::Client,
            "the window cells kept changing between read and write",
            format!("{MAX_STALE_READS} reads in a row"),
        ))),
    }
}

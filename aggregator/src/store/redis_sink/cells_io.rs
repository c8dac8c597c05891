//! The cells half of the Redis sink: reading the fields a write changes, and at-least-once
//! window writes through `scripts/cells.lua` (`crate::store::cells` plans them).

use redis::ErrorKind;
use tally_common::event::now_ms;

use super::{RedisSink, unexpected};
use crate::machine::batch::WindowDelta;
use crate::machine::verdict::window_rejections;
use crate::store::cells::{self, MAX_STALE_READS, Rereads};
use crate::store::script_call::ScriptCall;
use crate::store::sink::{Rejection, SinkError, SinkErrorKind};
use crate::store::store_error::RedisReply;

impl RedisSink {
    /// Plans the window deltas' rewrites from the cells `reads` names (group `group`'s): from
    /// what this writer remembers of them when `may_predict` and it has learnt to trust that
    /// (`crate::store::recall`), else from reading them. A plan that would refuse a delta is
    /// always made from a read: a refusal is never checked by the write. Also says whether the
    /// plan went by memory.
    pub(super) async fn read_cells(
        &self,
        group: u32,
        reads: &cells::Reads,
        windows: &[WindowDelta],
        may_predict: bool,
    ) -> Result<(cells::Plan, bool), SinkError> {
        if reads.is_empty() {
            return Ok((cells::plan(reads, Vec::new(), windows, now_ms()), false));
        }
        if let Some(predicted) = (may_predict.then(|| self.recall.predict(group, reads))).flatten()
        {
            let plan = cells::plan(reads, predicted, windows, now_ms());
            if window_rejections(&plan.currents, windows).is_empty() {
                self.recall.predicted_write();
                return Ok((plan, true));
            }
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        reads.add_to(&mut pipe);
        let mut conn = self.conn.clone();
        let replies: Vec<redis::Value> = pipe.query_async(&mut conn).await?;
        let got = (replies.into_iter())
            .map(cells::Read::from_reply)
            .collect::<Result<Vec<_>, _>>()?;
        self.recall.read(group, reads, &got);
        Ok((cells::plan(reads, got, windows, now_ms()), false))
    }

    /// An at-least-once write's window deltas through `scripts/cells.lua`, with the ones refused.
    pub(super) async fn script_cells(
        &self,
        group: u32,
        windows: &[WindowDelta],
    ) -> Result<Vec<Rejection>, SinkError> {
        let reads = cells::Reads::new(&self.keyspace, group, windows);
        let mut rereads = Rereads::new(MAX_STALE_READS);
        loop {
            let (plan, predicted) =
                (self.read_cells(group, &reads, windows, rereads.may_predict())).await?;
            let refused = window_rejections(&plan.currents, windows);
            if plan.writes.is_empty() {
                return Ok(refused);
            }
            let mut invocation = ScriptCall::new(&self.scripts.cells);
            invocation.arg(plan.writes.len());
            for stripe in &plan.writes {
                stripe.add_to(&mut invocation);
            }
            let mut conn = self.conn.clone();
            let reply: Vec<String> = invocation.invoke(&mut conn).await?;
            match reply.first().map(String::as_str) {
                Some("ok") => {
                    self.recall.wrote(group, &plan.writes);
                    return Ok(refused);
                }
                Some("stale") => {
                    self.recall.stale(group, predicted);
                    if !rereads.again_after(predicted).await {
                        return Err(stale_cells());
                    }
                }
                Some("failed") => {
                    return Err(SinkError::from(RedisReply(
                        reply.get(1).cloned().unwrap_or_default(),
                    )));
                }
                _ => return Err(unexpected(&reply)),
            }
        }
    }
}

/// The error of a write whose cells kept changing under it.
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

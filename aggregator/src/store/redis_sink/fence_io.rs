//! The fence half of the Redis sink: the exactly-once operations other than the flush as Lua
//! scripts (epochs, fence stamps, fenced one-field writes, idle marks), each with its
//! transactions twin in `crate::store::transactions` (`RedisSink::either` picks).

use super::{RedisSink, parse_number, unexpected};
use crate::store::script_call::ScriptCall;
use crate::store::sink::{Applied, IdleWrite, Marked, SinkError, Stamp};

/// The exactly-once operations as Lua scripts.
impl RedisSink {
    pub(super) async fn script_mark_idle(&self, write: IdleWrite<'_>) -> Result<Marked, SinkError> {
        let ks = &self.keyspace;
        let mut invocation = ScriptCall::new(&self.scripts.idle);
        invocation
            .key(ks.fence_key(write.home))
            .key(ks.watermark_key(write.home))
            .key(ks.idle_key(write.home, write.field))
            .key(ks.expired_key(write.home, write.field))
            .arg(write.field)
            .arg(write.epoch)
            .arg(write.expiries.len());
        for e in write.expiries {
            invocation
                .arg(e.offset)
                .arg(&e.counter)
                .arg(e.deadline_ms)
                .arg(e.held_deadline.map(|d| d.to_string()).unwrap_or_default());
        }
        for (counter, deadline) in write.touched {
            invocation.arg(counter).arg(*deadline);
        }
        let mut conn = self.conn.clone();
        let reply: Vec<String> = invocation.invoke(&mut conn).await?;
        match reply.first().map(String::as_str) {
            Some("ok") if reply.len() == write.expiries.len() + 1 => Ok(Marked::Decided(
                reply[1..].iter().map(|d| d == "1").collect(),
            )),
            Some("fenced") => Ok(Marked::Refused(Applied::from_fence(
                parse_number(&reply, 1).ok(),
                write.epoch,
            ))),
            _ => Err(unexpected(&reply)),
        }
    }

    pub(super) async fn script_next_epoch(
        &self,
        home: u32,
        field: &str,
        at_least: u64,
    ) -> Result<u64, SinkError> {
        let mut conn = self.conn.clone();
        let reply: String = self
            .scripts
            .epoch
            .key(self.keyspace.epoch_key(home))
            .arg(field)
            .arg(at_least)
            .invoke_async(&mut conn)
            .await?;
        parse_number(&[reply], 0)
    }

    pub(super) async fn script_stamp_fence(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
    ) -> Result<Stamp, SinkError> {
        let mut conn = self.conn.clone();
        let reply: Vec<String> = self
            .scripts
            .stamp
            .key(self.keyspace.fence_key(group))
            .key(self.keyspace.ledger_key(group))
            .arg(field)
            .arg(epoch)
            .arg(if self.keyspace.likes_in_shares() {
                "1"
            } else {
                "0"
            })
            .invoke_async(&mut conn)
            .await?;
        match reply.first().map(String::as_str) {
            Some("stamped") => Ok(Stamp::Stamped {
                ledger: parse_number(&reply, 1)?,
            }),
            Some("stale") => Ok(Stamp::Stale {
                current: parse_number(&reply, 1)?,
            }),
            Some("moved") => Err(SinkError::likes_moved(group)),
            _ => Err(unexpected(&reply)),
        }
    }

    /// Runs `script`, one of the fenced one-field writes (`rewind.lua`, `watermark.lua`): the
    /// fence of `group`, then the hash it writes (`target`), the partition `field`, the
    /// writer's `epoch` and the value.
    pub(super) async fn fenced_write(
        &self,
        script: &redis::Script,
        group: u32,
        target: String,
        field: &str,
        epoch: u64,
        value: impl redis::ToRedisArgs,
    ) -> Result<Applied, SinkError> {
        let mut conn = self.conn.clone();
        let reply: Vec<String> = script
            .key(self.keyspace.fence_key(group))
            .key(target)
            .arg(field)
            .arg(epoch)
            .arg(value)
            .invoke_async(&mut conn)
            .await?;
        fenced_reply(&reply, epoch)
    }
}

/// A fenced script's reply: `{'ok'}`, or `{'fenced', current epoch}`.
fn fenced_reply(reply: &[String], epoch: u64) -> Result<Applied, SinkError> {
    match reply.first().map(String::as_str) {
        Some("ok") => Ok(Applied::Written),
        Some("fenced") => Ok(Applied::from_fence(parse_number(reply, 1).ok(), epoch)),
        _ => Err(unexpected(reply)),
    }
}

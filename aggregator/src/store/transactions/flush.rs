//! The transactional `scripts/flush.lua`: an exactly-once write of one group, its reads under
//! `WATCH` and its writes in one `MULTI`/`EXEC`.

use redis::Value;
use tally_common::Keyspace;
use tally_common::layout::{MOVING_FIELD, PACKED_FIELD, reset_recorded};

use super::{
    MemberState, Plan, Transactions, current, flush_verdict, number, protocol_error, rewrite_cells,
};
use crate::machine::verdict::Current;
use crate::store::cells;
use crate::store::sink::{Applied, GroupWrite, SinkError};

/// Whether `mark`, a group's moving mark (`MOVING_FIELD`), holds at `time` (the server's `TIME`
/// reply): it does unless its deadline passed (`scripts/compact_moving.lua`); an earlier
/// release's mark, the epoch alone, always holds.
fn mark_live(mark: &Value, time: &Value) -> Result<bool, SinkError> {
    let text = |v: &Value| match v {
        Value::BulkString(bytes) => Ok(String::from_utf8_lossy(bytes).into_owned()),
        other => Err(protocol_error("a moving mark or the time", other)),
    };
    let mark = text(mark)?;
    let Some(deadline) = mark
        .split_once(' ')
        .and_then(|(_, d)| d.parse::<u64>().ok())
    else {
        return Ok(true);
    };
    let Value::Array(parts) = time else {
        return Err(protocol_error("TIME reply", time));
    };
    let [seconds, micros] = parts.as_slice() else {
        return Err(protocol_error("TIME reply", time));
    };
    let number = |v: &Value| {
        text(v)?
            .parse::<u64>()
            .map_err(|_| protocol_error("TIME reply", v))
    };
    let now_ms = number(seconds)? * 1000 + number(micros)? / 1000;
    Ok(deadline >= now_ms)
}

impl Transactions {
    /// The transactional `scripts/flush.lua`.
    pub async fn apply_fenced(&self, write: GroupWrite<'_>) -> Result<Applied, SinkError> {
        // A group packed otherwise than these transactions knew: they learn and write again (a
        // group's mark is set once, so the second try agrees).
        for _ in 0..2 {
            let buckets = self.packing.buckets(write.group);
            match self.apply_fenced_as(write, buckets).await? {
                Ok(applied) => return Ok(applied),
                Err(packed) => self.packing.learn(write.group, packed),
            }
        }
        Err(protocol_error(
            "the group's packing changed twice in a row",
            &Value::Nil,
        ))
    }

    /// [`Transactions::apply_fenced`] with the deltas in the group's packed hashes if `buckets`
    /// is not 0, or the group's buckets if it packs otherwise.
    async fn apply_fenced_as(
        &self,
        write: GroupWrite<'_>,
        buckets: u32,
    ) -> Result<Result<Applied, u32>, SinkError> {
        let ks = &self.keyspace;
        let (fence_key, ledger_key) = (ks.fence_key(write.group), ks.ledger_key(write.group));
        // Each delta's key, or its bucket's hash and its field.
        let counter_keys: Vec<String> = write
            .deltas
            .iter()
            .map(|(counter, _)| match buckets {
                0 => ks.counter_key(write.group, counter),
                _ => ks.packed_key(write.group, Keyspace::bucket_of(counter, buckets)),
            })
            .collect();
        let cells_reads = cells::Reads::new(ks, write.group, write.windows);
        // Each membership's set and, unless its likes are counted by their set, its counter.
        let member_keys: Vec<(String, Option<String>)> = write
            .members
            .iter()
            .map(|m| {
                (
                    ks.likes_key(write.group, m.counter),
                    (!ks.likes_by_set(m.counter)).then(|| ks.counter_key(write.group, m.counter)),
                )
            })
            .collect();
        let mut watch = vec![fence_key.clone(), ledger_key.clone()];
        watch.extend(counter_keys.iter().cloned());
        watch.extend(cells_reads.stripes.iter().map(|(key, _)| key.clone()));
        for (set, counter) in &member_keys {
            watch.push(set.clone());
            watch.extend(counter.iter().cloned());
        }
        // A reset's record keeps each partition's last reset of its counter, so one partition's
        // is written over what the others' left (`scripts/flush.lua`): read, and watched.
        let resets_key = ks.resets_key(write.group);
        let shares: Vec<String> = (write.resets.iter())
            .map(|reset| ks.counter_key(write.group, &reset.counter))
            .collect();
        if !shares.is_empty() {
            watch.push(resets_key.clone());
        }
        let mut reads = redis::pipe();
        reads.ignore_errors();
        reads
            .hget(&fence_key, write.field)
            .hget(&ledger_key, write.field)
            .hget(&fence_key, PACKED_FIELD)
            .hget(&fence_key, MOVING_FIELD);
        for (key, (counter, _)) in counter_keys.iter().zip(write.deltas) {
            match buckets {
                0 => reads.get(key),
                _ => reads.hget(key, counter),
            };
        }
        cells_reads.add_to(&mut reads);
        for ((set, counter), m) in member_keys.iter().zip(write.members.iter()) {
            reads.sismember(set, m.actor);
            if let Some(counter) = counter {
                reads.get(counter);
            }
        }
        for share in &shares {
            reads.hget(&resets_key, share);
        }
        if !shares.is_empty() {
            // The server's clock, for the moving mark's deadline.
            reads.cmd("TIME");
        }
        let n = counter_keys.len();
        let w = cells_reads.stripes.len();
        self.optimistic(&watch, &reads, |replies| {
            let [fence, ledger, packed, moving, rest @ ..] = replies else {
                return Err(protocol_error(
                    "short reply",
                    &Value::Array(replies.to_vec()),
                ));
            };
            let packed: u32 = number(packed)?.unwrap_or(0);
            if packed != buckets {
                return Ok(Plan::Done(Err(packed)));
            }
            let counted = member_keys.iter().filter(|(_, c)| c.is_some()).count();
            let r = shares.len();
            let clock = usize::from(r > 0);
            if rest.len() != n + w + write.members.len() + counted + r + clock {
                return Err(protocol_error(
                    "short reply",
                    &Value::Array(replies.to_vec()),
                ));
            }
            let currents = rest[..n]
                .iter()
                .map(current)
                .collect::<Result<Vec<_>, _>>()?;
            let got = rest[n..n + w]
                .iter()
                .cloned()
                .map(cells::Read::from_reply)
                .collect::<Result<Vec<_>, _>>()?;
            let cells = cells::plan(
                &cells_reads,
                got,
                write.windows,
                tally_common::event::now_ms(),
            );
            // After the memberships' reads, each reset's record and the server's clock.
            let (rest, records) = rest.split_at(rest.len() - r - clock);
            let (records, clock) = records.split_at(r);
            // Per membership, its SISMEMBER and, unless counted by its set, its counter's GET.
            let mut replies = rest[n + w..].iter();
            let states = member_keys
                .iter()
                .map(|(_, counter)| {
                    let short = || protocol_error("short reply", &Value::Nil);
                    Ok(MemberState {
                        member: match replies.next().ok_or_else(short)? {
                            Value::Int(n) => Some(*n == 1),
                            Value::ServerError(e) if e.code() == "WRONGTYPE" => None,
                            v => return Err(protocol_error("SISMEMBER reply", v)),
                        },
                        // Counted by its set: no counter to take the change.
                        counter: match counter {
                            Some(_) => current(replies.next().ok_or_else(short)?)?,
                            None => Current::Missing,
                        },
                    })
                })
                .collect::<Result<Vec<_>, SinkError>>()?;
            // A counter reset here first starts with no members and no share.
            let mut states = states;
            for (state, m) in states.iter_mut().zip(write.members.iter()) {
                if write.resets.iter().any(|r| r.counter == m.counter) {
                    state.member = Some(false);
                    state.counter = Current::Missing;
                }
            }
            let (fence, ledger) = (number(fence)?, number(ledger)?);
            if let Some(verdict) =
                flush_verdict(fence, ledger, &currents, &cells.currents, &states, &write)
            {
                return Ok(Plan::Done(Ok(verdict)));
            }
            let mut writes = redis::pipe();
            // While a compactor moves shares, each reset is recorded (`scripts/flush.lua`).
            let moving = match (moving, clock.first()) {
                (Value::Nil, _) | (_, None) => false,
                (mark, Some(now)) => mark_live(mark, now)?,
            };
            for ((reset, share), record) in write.resets.iter().zip(&shares).zip(records) {
                let counter = &reset.counter;
                if moving {
                    let record: Option<String> = match record {
                        Value::Nil => None,
                        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into()),
                        other => return Err(protocol_error("a reset's record", other)),
                    };
                    let at = reset_recorded(record.as_deref(), write.field, reset.offset);
                    writes.hset(&resets_key, share, at).ignore();
                }
                writes
                    .del(&[
                        share.clone(),
                        ks.likes_key(write.group, counter),
                        ks.journal_key(write.group, counter),
                    ])
                    .ignore();
                if buckets > 0 {
                    let bucket = Keyspace::bucket_of(counter, buckets);
                    writes
                        .hdel(ks.packed_key(write.group, bucket), counter)
                        .ignore();
                }
            }
            for (key, (counter, delta)) in counter_keys.iter().zip(write.deltas) {
                match buckets {
                    0 => writes.incr(key, *delta).ignore(),
                    _ => writes.hincr(key, counter, *delta).ignore(),
                };
            }
            rewrite_cells(&mut writes, &cells.writes);
            // Reads saw each set before any of this batch's changes; one actor appears once per
            // counter in a batch, so each change is decided on what the set holds now.
            for (((set, counter), m), state) in
                member_keys.iter().zip(write.members.iter()).zip(&states)
            {
                let step = match (m.like, state.member) {
                    (true, Some(false)) => {
                        writes.sadd(set, m.actor).ignore();
                        1
                    }
                    (false, Some(true)) => {
                        writes.srem(set, m.actor).ignore();
                        -1
                    }
                    _ => continue,
                };
                if let Some(counter) = counter {
                    writes.incr(counter, step).ignore();
                }
            }
            writes
                .hset(&ledger_key, write.field, write.next_offset)
                .ignore();
            if let Some(watermark) = write.watermark {
                writes
                    .hset(ks.watermark_key(write.group), write.field, watermark)
                    .ignore();
            }
            Ok(Plan::Write(writes, Ok(Applied::Written)))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn a_mark_holds_until_its_deadline_and_an_earlier_releases_always() {
        // TIME: 1,000 s and 500,000 us, so 1,000,500 ms.
        let time = Value::Array(vec![bulk("1000"), bulk("500000")]);
        let live = |mark: &str| mark_live(&bulk(mark), &time).expect("a mark and a time");
        assert!(live("7 1000500"));
        assert!(live("7 2000000"));
        assert!(!live("7 1000499"));
        assert!(live("7"), "an earlier release's mark never lapses");
        assert!(mark_live(&bulk("7 1"), &Value::Nil).is_err());
    }
}

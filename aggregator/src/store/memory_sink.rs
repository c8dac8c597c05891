//! [`MemorySink`]: a [`Sink`] in memory, for unit tests of the flush, the fences and the
//! partition state machine together, with faults on demand: failed writes, a newer owner, and a
//! store that goes back to an older state. It decides every exactly-once operation with the same
//! functions as the `WATCH`/`MULTI`/`EXEC` path (`crate::store::transactions`: `flush_verdict`,
//! `next_epoch_after`, `stamp_refusal`, `watermark_refusal`), which mirror the Lua scripts. Evidence that tally works comes from the end-to-end tests against
//! a real Redis; these tests pin down the rules, in milliseconds.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use crate::machine::batch::{Reset, WindowDelta};
use crate::machine::verdict::{
    Current, MemberState, flush_verdict, next_epoch_after, stamp_refusal, watermark_refusal,
};
use crate::store::sink::{Applied, GroupWrite, Rejection, Sink, SinkError, Stamp};

/// Everything the store holds, per shard group and key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct State {
    /// `(group, counter)` → share.
    pub(crate) counters: HashMap<(u32, String), i64>,
    /// `(group, field)` → the fence's epoch.
    fences: HashMap<(u32, String), u64>,
    /// `(group, field)` → the ledger entry.
    ledgers: HashMap<(u32, String), i64>,
    /// `(home, field)` → the epoch counter.
    epochs: HashMap<(u32, String), u64>,
    /// `(home, field)` → the watermark.
    pub(crate) watermarks: HashMap<(u32, String), String>,
    /// The stored group plan, if any.
    pub(crate) plan: Option<String>,
}

impl State {
    /// A counter's total over every group.
    pub(crate) fn total(&self, counter: &str) -> i64 {
        (self.counters.iter())
            .filter(|((_, c), _)| c == counter)
            .map(|(_, v)| v)
            .sum()
    }
}

/// A [`Sink`] in memory. Clones share the store.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemorySink {
    state: Arc<Mutex<State>>,
    /// Operations still to let through, then operations still to fail (a connection error
    /// each).
    failures: Arc<Mutex<(u32, u32)>>,
}

impl MemorySink {
    /// What the store holds now.
    pub(crate) fn snapshot(&self) -> State {
        self.lock().clone()
    }

    /// Puts the store back to an older state (a Redis restarted from an old snapshot).
    pub(crate) fn restore(&self, state: State) {
        *self.lock() = state;
    }

    /// Makes the next `n` operations fail with a connection error.
    pub(crate) fn fail_next(&self, n: u32) {
        self.fail_after(0, n);
    }

    /// Lets `grace` operations through, then fails `n` (a crash between two group writes).
    pub(crate) fn fail_after(&self, grace: u32, n: u32) {
        *self.failures.lock().unwrap_or_else(PoisonError::into_inner) = (grace, n);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The store, unless this operation is one that must fail.
    fn reach(&self) -> Result<std::sync::MutexGuard<'_, State>, SinkError> {
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let (grace, failing) = &mut *failures;
        if *grace > 0 {
            *grace -= 1;
        } else if *failing > 0 {
            *failing -= 1;
            let error = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "injected");
            return Err(redis::RedisError::from(error).into());
        }
        Ok(self.lock())
    }

    fn apply_now(
        &self,
        group: u32,
        deltas: &[(String, i64)],
        windows: &[WindowDelta],
        resets: &[Reset],
    ) -> Result<Vec<Rejection>, SinkError> {
        assert!(
            windows.is_empty() && resets.is_empty(),
            "windows and resets are not modelled here"
        );
        let mut state = self.reach()?;
        for (counter, delta) in deltas {
            *state.counters.entry((group, counter.clone())).or_default() += delta;
        }
        Ok(Vec::new())
    }

    fn apply_fenced_now(&self, write: GroupWrite<'_>) -> Result<Applied, SinkError> {
        let mut state = self.reach()?;
        let key = (write.group, write.field.to_owned());
        let currents: Vec<Current> = (write.deltas.iter())
            .map(|(counter, _)| {
                let value = state.counters.get(&(write.group, counter.clone()));
                value.map_or(Current::Missing, |v| Current::Integer(*v))
            })
            .collect();
        assert!(
            write.members.is_empty() && write.windows.is_empty() && write.resets.is_empty(),
            "memberships, windows and resets are not modelled here"
        );
        let members: [MemberState; 0] = [];
        let fence = state.fences.get(&key).copied();
        let ledger = state.ledgers.get(&key).copied();
        if let Some(verdict) = flush_verdict(fence, ledger, &currents, &[], &members, &write) {
            return Ok(verdict);
        }
        for (counter, delta) in write.deltas {
            *state
                .counters
                .entry((write.group, counter.clone()))
                .or_default() += delta;
        }
        state.ledgers.insert(key.clone(), write.next_offset);
        if let Some(watermark) = write.watermark {
            state.watermarks.insert(key, watermark.to_owned());
        }
        Ok(Applied::Written)
    }

    fn next_epoch_now(&self, home: u32, field: &str, at_least: u64) -> Result<u64, SinkError> {
        let mut state = self.reach()?;
        let epoch = state.epochs.entry((home, field.to_owned())).or_default();
        *epoch = next_epoch_after(Some(*epoch), at_least);
        Ok(*epoch)
    }

    fn stamp_fence_now(&self, group: u32, field: &str, epoch: u64) -> Result<Stamp, SinkError> {
        let mut state = self.reach()?;
        let key = (group, field.to_owned());
        if let Some(stale) = stamp_refusal(state.fences.get(&key).copied(), epoch) {
            return Ok(stale);
        }
        state.fences.insert(key.clone(), epoch);
        let ledger = state.ledgers.get(&key).copied().unwrap_or(-1);
        Ok(Stamp::Stamped { ledger })
    }

    fn write_watermark_now(
        &self,
        home: u32,
        field: &str,
        epoch: u64,
        watermark: &str,
    ) -> Result<Applied, SinkError> {
        let mut state = self.reach()?;
        let key = (home, field.to_owned());
        if let Some(refused) = watermark_refusal(state.fences.get(&key).copied(), epoch) {
            return Ok(refused);
        }
        state.watermarks.insert(key, watermark.to_owned());
        Ok(Applied::Written)
    }
}

impl Sink for MemorySink {
    fn apply(
        &self,
        group: u32,
        deltas: &[(String, i64)],
        windows: &[WindowDelta],
        resets: &[Reset],
    ) -> impl Future<Output = Result<Vec<Rejection>, SinkError>> + Send {
        std::future::ready(self.apply_now(group, deltas, windows, resets))
    }

    fn apply_fenced(
        &self,
        write: GroupWrite<'_>,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send {
        std::future::ready(self.apply_fenced_now(write))
    }

    fn next_epoch(
        &self,
        home: u32,
        field: &str,
        at_least: u64,
    ) -> impl Future<Output = Result<u64, SinkError>> + Send {
        std::future::ready(self.next_epoch_now(home, field, at_least))
    }

    fn stamp_fence(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
    ) -> impl Future<Output = Result<Stamp, SinkError>> + Send {
        std::future::ready(self.stamp_fence_now(group, field, epoch))
    }

    fn write_watermark(
        &self,
        home: u32,
        field: &str,
        epoch: u64,
        watermark: &str,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send {
        std::future::ready(self.write_watermark_now(home, field, epoch, watermark))
    }

    fn rewind_ledger(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
        to: i64,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send {
        let rewound = self.reach().map(|mut state| {
            let key = (group, field.to_owned());
            if let Some(refused) = watermark_refusal(state.fences.get(&key).copied(), epoch) {
                return refused;
            }
            if let Some(ledger) = state.ledgers.get_mut(&key).filter(|l| **l > to) {
                *ledger = to;
            }
            Applied::Written
        });
        std::future::ready(rewound)
    }

    fn read_fence_and_ledger(
        &self,
        group: u32,
        field: &str,
    ) -> impl Future<Output = Result<(Option<u64>, Option<i64>), SinkError>> + Send {
        let read = self.reach().map(|state| {
            let key = (group, field.to_owned());
            (
                state.fences.get(&key).copied(),
                state.ledgers.get(&key).copied(),
            )
        });
        std::future::ready(read)
    }

    fn read_watermark(
        &self,
        home: u32,
        field: &str,
    ) -> impl Future<Output = Result<Option<String>, SinkError>> + Send {
        let read = self
            .reach()
            .map(|state| state.watermarks.get(&(home, field.to_owned())).cloned());
        std::future::ready(read)
    }

    fn read_plan(&self) -> impl Future<Output = Result<Option<String>, SinkError>> + Send {
        std::future::ready(self.reach().map(|state| state.plan.clone()))
    }
}

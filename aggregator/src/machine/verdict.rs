//! The exactly-once decisions every store makes the same way before it writes: fenced, already
//! applied, rolled back, or a delta the data refuses (`overflow`, `wrong_type`,
//! `not_an_integer`); where a new epoch starts; when a stamp or a watermark is refused.
//! `scripts/flush.lua` makes them in Lua; the transactions path, the PostgreSQL store and the
//! in-memory sink call these, and `tests/tests/fence_decision.rs` holds the script and them to
//! one table.

use tally_common::DeadLetterReason;

use super::batch::WindowDelta;
use super::write::{Applied, GroupWrite, Refused, Rejection, Stamp};

/// What one counter key holds, as far as adding to it is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Current {
    /// The key does not exist (counts as 0).
    Missing,
    /// A 64-bit integer.
    Integer(i64),
    /// A string that is not an integer.
    NotAnInteger,
    /// Another type (a hash, a set...).
    WrongType,
}

impl Current {
    /// Why adding `delta` to this value is refused, the same as `scripts/flush.lua`'s `refusal`.
    fn refusal(&self, delta: i64) -> Option<DeadLetterReason> {
        match self {
            Current::Missing => None,
            Current::Integer(v) => v
                .checked_add(delta)
                .is_none()
                .then_some(DeadLetterReason::Overflow),
            Current::NotAnInteger => Some(DeadLetterReason::NotAnInteger),
            Current::WrongType => Some(DeadLetterReason::WrongType),
        }
    }
}

/// Why these deltas cannot be applied, as the script gives it.
pub fn rejections(currents: &[Current], deltas: &[(String, i64)]) -> Vec<Rejection> {
    (currents.iter().zip(deltas).enumerate())
        .filter_map(|(i, (current, (_, delta)))| {
            Some(Rejection {
                refused: Refused::Delta(i),
                reason: current.refusal(*delta)?,
            })
        })
        .collect()
}

/// Why these window deltas cannot be applied, as the script gives it.
pub fn window_rejections(currents: &[Current], windows: &[WindowDelta]) -> Vec<Rejection> {
    (currents.iter().zip(windows).enumerate())
        .filter_map(|(i, (current, w))| {
            Some(Rejection {
                refused: Refused::Window(i),
                reason: current.refusal(w.delta)?,
            })
        })
        .collect()
}

/// What a membership's keys hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberState {
    /// Whether the actor is in the set; `None` when the key is not a set.
    pub member: Option<bool>,
    /// The counter's share in the group.
    pub counter: Current,
}

/// Why these memberships cannot be applied, as the script gives it.
fn member_rejections(states: &[MemberState]) -> Vec<Rejection> {
    (states.iter().enumerate())
        .filter_map(|(j, state)| {
            let reason = match state.member {
                None => DeadLetterReason::WrongType,
                Some(_) => state.counter.refusal(1)?,
            };
            Some(Rejection {
                refused: Refused::Member(j),
                reason,
            })
        })
        .collect()
}

/// The epoch `scripts/epoch.lua` takes: one more than the `last`, and at least `at_least`.
pub fn next_epoch_after(last: Option<u64>, at_least: u64) -> u64 {
    (last.unwrap_or(0) + 1).max(at_least)
}

/// `scripts/stamp.lua`'s refusal: the fence already holds `epoch` or a newer one. `None` means
/// stamp.
pub fn stamp_refusal(current: Option<u64>, epoch: u64) -> Option<Stamp> {
    let current = current.unwrap_or(0);
    (current >= epoch).then_some(Stamp::Stale { current })
}

/// `scripts/watermark.lua`'s refusal: the fence holds another epoch than the writer's. `None`
/// means write.
pub fn watermark_refusal(fence: Option<u64>, epoch: u64) -> Option<Applied> {
    (fence != Some(epoch)).then(|| Applied::from_fence(fence, epoch))
}

/// The flush decision before any write, the same as `scripts/flush.lua`: `None` means write.
pub fn flush_verdict(
    fence: Option<u64>,
    ledger: Option<i64>,
    currents: &[Current],
    window_currents: &[Current],
    members: &[MemberState],
    write: &GroupWrite<'_>,
) -> Option<Applied> {
    if fence != Some(write.epoch) {
        return Some(Applied::from_fence(fence, write.epoch));
    }
    let applied = ledger.unwrap_or(-1);
    if applied >= write.next_offset {
        return Some(Applied::AlreadyApplied);
    }
    if applied < write.expected_ledger {
        return Some(Applied::RolledBack);
    }
    let mut rejected = rejections(currents, write.deltas);
    rejected.extend(window_rejections(window_currents, write.windows));
    rejected.extend(member_rejections(members));
    (!rejected.is_empty()).then_some(Applied::Rejected(rejected))
}

/// Whether a counter expires at its expiry record: `last` is its deadline in the index (the
/// latest of its events before this batch since its last expiry, if any), `held` the latest of
/// its events earlier in the batch, `deadline` the record's clock. Idle means: it had an event
/// since its last expiry (else there is nothing to clear), and every one's deadline has passed.
/// `scripts/idle.lua` decides the same way (`crate::tasks::expiry` explains expiry).
pub fn expires(last: Option<i64>, held: Option<i64>, deadline: i64) -> bool {
    last.max(held).is_some_and(|latest| latest <= deadline)
}

#[cfg(test)]
mod tests {
    use super::super::likes::Likes;
    use super::*;

    fn rejection(refused: Refused, reason: DeadLetterReason) -> Rejection {
        Rejection { refused, reason }
    }

    fn write<'a>(deltas: &'a [(String, i64)]) -> GroupWrite<'a> {
        GroupWrite {
            group: 0,
            field: "t/0",
            epoch: 3,
            expected_ledger: 10,
            next_offset: 20,
            deltas,
            windows: &[],
            resets: &[],
            members: Likes::NONE,
            watermark: None,
        }
    }

    #[test]
    fn the_verdict_checks_fence_then_ledger_then_values_like_the_script() {
        let deltas = [("a".to_owned(), 5), ("b".to_owned(), 1)];
        let ok = [Current::Integer(1), Current::Missing];
        let w = write(&deltas);
        assert_eq!(flush_verdict(Some(3), Some(10), &ok, &[], &[], &w), None);
        assert_eq!(
            flush_verdict(Some(4), Some(10), &ok, &[], &[], &w),
            Some(Applied::Fenced)
        );
        assert_eq!(
            flush_verdict(Some(2), Some(10), &ok, &[], &[], &w),
            Some(Applied::RolledBack)
        );
        assert_eq!(
            flush_verdict(None, Some(10), &ok, &[], &[], &w),
            Some(Applied::RolledBack)
        );
        assert_eq!(
            flush_verdict(Some(3), Some(20), &ok, &[], &[], &w),
            Some(Applied::AlreadyApplied)
        );
        assert_eq!(
            flush_verdict(Some(3), Some(9), &ok, &[], &[], &w),
            Some(Applied::RolledBack)
        );
        assert_eq!(
            flush_verdict(Some(3), None, &ok, &[], &[], &write(&deltas[..0])),
            Some(Applied::RolledBack)
        );
        // A fence refusal wins over a bad value; a duplicate is recognised before validation.
        let bad = [Current::WrongType, Current::Integer(i64::MAX)];
        assert_eq!(
            flush_verdict(Some(4), Some(10), &bad, &[], &[], &w),
            Some(Applied::Fenced)
        );
        assert_eq!(
            flush_verdict(Some(3), Some(25), &bad, &[], &[], &w),
            Some(Applied::AlreadyApplied)
        );
        assert_eq!(
            flush_verdict(Some(3), Some(10), &bad, &[], &[], &w),
            Some(Applied::Rejected(vec![
                rejection(Refused::Delta(0), DeadLetterReason::WrongType),
                rejection(Refused::Delta(1), DeadLetterReason::Overflow),
            ]))
        );
    }

    #[test]
    fn memberships_are_rejected_after_the_deltas_when_their_keys_hold_other_types() {
        let states = [
            MemberState {
                member: Some(true),
                counter: Current::Integer(4),
            },
            MemberState {
                member: None,
                counter: Current::Missing,
            },
            MemberState {
                member: Some(false),
                counter: Current::NotAnInteger,
            },
        ];
        assert_eq!(
            member_rejections(&states),
            [
                rejection(Refused::Member(1), DeadLetterReason::WrongType),
                rejection(Refused::Member(2), DeadLetterReason::NotAnInteger),
            ]
        );
    }

    #[test]
    fn values_that_cannot_take_a_delta_are_rejected_with_a_reason() {
        let deltas = [
            ("a".to_owned(), -1),
            ("b".to_owned(), 1),
            ("c".to_owned(), 7),
            ("d".to_owned(), i64::MIN),
        ];
        let currents = [
            Current::Integer(i64::MIN),
            Current::NotAnInteger,
            Current::Integer(i64::MAX - 7),
            Current::Missing,
        ];
        assert_eq!(
            rejections(&currents, &deltas),
            [
                rejection(Refused::Delta(0), DeadLetterReason::Overflow),
                rejection(Refused::Delta(1), DeadLetterReason::NotAnInteger),
            ]
        );
    }

    #[test]
    fn epochs_fences_and_watermarks_decide_as_the_scripts_do() {
        assert_eq!(next_epoch_after(None, 0), 1);
        assert_eq!(next_epoch_after(Some(4), 0), 5);
        assert_eq!(next_epoch_after(Some(4), 9), 9);
        assert_eq!(stamp_refusal(None, 1), None);
        assert_eq!(stamp_refusal(Some(3), 4), None);
        assert_eq!(stamp_refusal(Some(4), 4), Some(Stamp::Stale { current: 4 }));
        assert_eq!(stamp_refusal(Some(7), 4), Some(Stamp::Stale { current: 7 }));
        assert_eq!(watermark_refusal(Some(4), 4), None);
        assert_eq!(watermark_refusal(Some(5), 4), Some(Applied::Fenced));
        assert_eq!(watermark_refusal(Some(3), 4), Some(Applied::RolledBack));
        assert_eq!(watermark_refusal(None, 4), Some(Applied::RolledBack));
    }

    #[test]
    fn a_counter_expires_only_if_it_was_touched_and_every_touch_is_past_its_deadline() {
        assert!(!expires(None, None, 100), "nothing to clear");
        assert!(expires(Some(100), None, 100));
        assert!(expires(None, Some(90), 100));
        assert!(expires(Some(50), Some(90), 100));
        assert!(!expires(Some(101), None, 100));
        assert!(!expires(Some(50), Some(101), 100));
        assert!(!expires(Some(150), Some(90), 100));
    }
}

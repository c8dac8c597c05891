//! Why a message went to the dead-letter topic: one fixed label per cause, the same in the
//! `tally-reason` header, the `reason` label of `tally_events_dead_lettered_total`, and the
//! replies of the exactly-once scripts (`aggregator/src/store/scripts/flush.lua`).

use std::fmt;
use std::str::FromStr;

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeadLetterReason {
    /// Larger than the largest message accepted.
    Oversized,
    /// Empty, of an unknown format or version, or not decodable as one.
    Undecodable,
    /// The counter id breaks the id rules.
    InvalidCounter,
    /// The delta is zero or out of range.
    InvalidDelta,
    /// Another field breaks a rule.
    InvalidField,
    /// A like in a namespace that counts once per actor, without an actor.
    MissingActor,
    /// Adding the summed delta would overflow the counter's share (64 bits).
    Overflow,
    /// A key the delta goes to holds another type (a hash, a set...).
    WrongType,
    /// A key the delta goes to holds a string that is not an integer.
    NotAnInteger,
    /// A store refused the delta for a reason not listed above. No longer given: written by
    /// earlier versions (PostgreSQL resets), and kept so that their dead letters still read.
    Rejected,
}

impl DeadLetterReason {
    /// Every reason, in the order metrics list them.
    pub const ALL: [DeadLetterReason; 10] = [
        Self::Oversized,
        Self::Undecodable,
        Self::InvalidCounter,
        Self::InvalidDelta,
        Self::InvalidField,
        Self::MissingActor,
        Self::Overflow,
        Self::WrongType,
        Self::NotAnInteger,
        Self::Rejected,
    ];

    /// The label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Oversized => "oversized",
            Self::Undecodable => "undecodable",
            Self::InvalidCounter => "invalid_counter",
            Self::InvalidDelta => "invalid_delta",
            Self::InvalidField => "invalid_field",
            Self::MissingActor => "missing_actor",
            Self::Overflow => "overflow",
            Self::WrongType => "wrong_type",
            Self::NotAnInteger => "not_an_integer",
            Self::Rejected => "rejected",
        }
    }

    /// The reason a script gave for refusing a delta, if it is one about the data
    /// ([`Self::Overflow`], [`Self::WrongType`], [`Self::NotAnInteger`]): the only reasons a
    /// store may refuse one. Any other label is not a refusal to dead-letter on (the write is
    /// retried instead).
    pub fn from_script(label: &str) -> Option<Self> {
        match label.parse() {
            Ok(reason @ (Self::Overflow | Self::WrongType | Self::NotAnInteger)) => Some(reason),
            _ => None,
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A label that names no reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dead-letter reason {0:?}")]
pub struct UnknownReason(pub String);

impl FromStr for DeadLetterReason {
    type Err = UnknownReason;

    fn from_str(label: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == label)
            .ok_or_else(|| UnknownReason(label.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_label_reads_back_as_its_reason() {
        for reason in DeadLetterReason::ALL {
            assert_eq!(reason.as_str().parse(), Ok(reason));
        }
        assert!("nonsense".parse::<DeadLetterReason>().is_err());
        assert_eq!(
            DeadLetterReason::from_script("overflow"),
            Some(DeadLetterReason::Overflow)
        );
        for label in ["from_a_newer_script", "rejected", "undecodable", ""] {
            assert_eq!(DeadLetterReason::from_script(label), None, "{label}");
        }
    }
}

//! Counter events and the rules every one of them obeys.
//!
//! A [`CounterEvent`] says "add `delta` to `counter`", optionally naming who did it (the actor),
//! when (event time) and a caller-chosen event id. Validation happens once, here, and both the
//! producer (before sending) and the aggregator (after decoding) go through it, so a bad event is
//! rejected with the same typed [`EventError`] wherever it shows up.

use std::fmt;

/// Longest counter id accepted, in bytes.
pub const MAX_COUNTER_BYTES: usize = 256;
/// Longest actor id accepted, in bytes.
pub const MAX_ACTOR_BYTES: usize = 256;
/// Longest event id accepted, in bytes.
pub const MAX_EVENT_ID_BYTES: usize = 128;
/// Largest magnitude of a single delta. Anything above is a bug upstream, not a like.
pub const MAX_ABS_DELTA: i64 = 1_000_000_000_000;

/// Why an event was rejected. Each variant says exactly what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EventError {
    /// The counter id was the empty string.
    #[error("counter id is empty")]
    EmptyCounter,
    /// The counter id was longer than [`MAX_COUNTER_BYTES`].
    #[error("counter id is {len} bytes long, the limit is {MAX_COUNTER_BYTES}")]
    CounterTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The counter id held a character that is not allowed.
    #[error("counter id has {found:?} at byte {position}: {why}")]
    CounterCharacter {
        /// The offending character.
        found: char,
        /// Its byte offset in the id.
        position: usize,
        /// Which rule it broke.
        why: &'static str,
    },
    /// The delta was zero: the event would change nothing.
    #[error("delta is zero")]
    ZeroDelta,
    /// The delta's magnitude was above [`MAX_ABS_DELTA`].
    #[error("delta {delta} is out of range (|delta| must be at most {MAX_ABS_DELTA})")]
    DeltaOutOfRange {
        /// The rejected delta.
        delta: i64,
    },
    /// An optional string field (actor, event id) was empty or too long.
    #[error("{field} is {len} bytes long, it must be 1 to {max} bytes")]
    FieldLength {
        /// Which field.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// Bytes that may appear in a counter id without a closer look: printable ASCII except `{`, `}`.
static PLAIN_ID_BYTE: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let byte = b as u8;
        table[b] = byte.is_ascii_graphic() && byte != b'{' && byte != b'}';
        b += 1;
    }
    table
};

/// Checks a counter id: non-empty, at most [`MAX_COUNTER_BYTES`] bytes, printable characters only
/// (no control characters, no whitespace, which would break `tally get`'s one-line output), and no
/// `{` or `}` (they would form a Redis Cluster hash tag inside our keys and move the key's slot).
pub fn validate_counter(counter: &str) -> Result<(), EventError> {
    if counter.is_empty() {
        return Err(EventError::EmptyCounter);
    }
    if counter.len() > MAX_COUNTER_BYTES {
        return Err(EventError::CounterTooLong { len: counter.len() });
    }
    // Fast path: the common id is plain printable ASCII. One table lookup per byte, without a
    // branch per byte (a per-byte `all` cost ~10 instructions a byte, a tenth of decoding).
    if counter
        .bytes()
        .fold(true, |ok, b| ok & PLAIN_ID_BYTE[usize::from(b)])
    {
        return Ok(());
    }
    for (position, found) in counter.char_indices() {
        let why = if found == '{' || found == '}' {
            "braces would form a Redis Cluster hash tag"
        } else if found.is_control() {
            "control characters are not allowed"
        } else if found.is_whitespace() {
            "whitespace is not allowed"
        } else {
            continue;
        };
        return Err(EventError::CounterCharacter {
            found,
            position,
            why,
        });
    }
    Ok(())
}

/// Checks a delta: non-zero and at most [`MAX_ABS_DELTA`] in magnitude.
pub fn validate_delta(delta: i64) -> Result<(), EventError> {
    if delta == 0 {
        Err(EventError::ZeroDelta)
    } else if delta.unsigned_abs() > MAX_ABS_DELTA as u64 {
        Err(EventError::DeltaOutOfRange { delta })
    } else {
        Ok(())
    }
}

fn validate_field(field: &'static str, value: Option<&str>, max: usize) -> Result<(), EventError> {
    match value {
        Some(v) if v.is_empty() || v.len() > max => Err(EventError::FieldLength {
            field,
            len: v.len(),
            max,
        }),
        _ => Ok(()),
    }
}

/// Checks an actor id: 1 to [`MAX_ACTOR_BYTES`] bytes.
pub fn validate_actor(actor: &str) -> Result<(), EventError> {
    validate_field("actor", Some(actor), MAX_ACTOR_BYTES)
}

/// Checks every field of an event, borrowed or owned.
pub fn validate(
    counter: &str,
    delta: i64,
    actor: Option<&str>,
    event_id: Option<&str>,
) -> Result<(), EventError> {
    validate_counter(counter)?;
    validate_delta(delta)?;
    validate_field("actor", actor, MAX_ACTOR_BYTES)?;
    validate_field("event id", event_id, MAX_EVENT_ID_BYTES)
}

/// One counter event: add `delta` to `counter`.
///
/// Construct it with [`CounterEvent::new`] (which validates) and the `with_*` builders; the fields
/// are private so that an invalid event cannot exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterEvent {
    /// The counter id, e.g. `likes:post:42`. Validated by [`validate_counter`].
    counter: String,
    /// What to add; negative to take away. Non-zero, |delta| <= [`MAX_ABS_DELTA`], except in a
    /// reset ([`CounterEvent::reset`]), where it is 0.
    delta: i64,
    /// Who did it (a user id), if known. Routing by actor and, later, deduplication use it.
    actor: Option<String>,
    /// When it happened, in milliseconds since the Unix epoch (0 when unknown).
    ts_ms: i64,
    /// A caller-chosen id that names this logical event, if the caller has one.
    event_id: Option<String>,
}

impl CounterEvent {
    /// A new event adding `delta` to `counter`, stamped with the current time.
    pub fn new(counter: impl Into<String>, delta: i64) -> Result<Self, EventError> {
        let counter = counter.into();
        validate_counter(&counter)?;
        validate_delta(delta)?;
        Ok(Self {
            counter,
            delta,
            actor: None,
            ts_ms: now_ms(),
            event_id: None,
        })
    }

    /// A reset of `counter`: everything counted before it (in its partition of the log) is
    /// cleared, everything after counts from zero. Stamped with the current time.
    pub fn reset(counter: impl Into<String>) -> Result<Self, EventError> {
        let counter = counter.into();
        validate_counter(&counter)?;
        Ok(Self {
            counter,
            delta: 0,
            actor: None,
            ts_ms: now_ms(),
            event_id: None,
        })
    }

    /// Whether this is a reset (its delta is 0).
    pub fn is_reset(&self) -> bool {
        self.delta == 0
    }

    /// Names the actor (who did it).
    pub fn with_actor(mut self, actor: impl Into<String>) -> Result<Self, EventError> {
        let actor = actor.into();
        validate_field("actor", Some(&actor), MAX_ACTOR_BYTES)?;
        self.actor = Some(actor);
        Ok(self)
    }

    /// Sets the event time, in milliseconds since the Unix epoch.
    pub fn with_ts_ms(mut self, ts_ms: i64) -> Self {
        self.ts_ms = ts_ms;
        self
    }

    /// Names the logical event with a caller-chosen id.
    pub fn with_event_id(mut self, event_id: impl Into<String>) -> Result<Self, EventError> {
        let event_id = event_id.into();
        validate_field("event id", Some(&event_id), MAX_EVENT_ID_BYTES)?;
        self.event_id = Some(event_id);
        Ok(self)
    }

    /// The counter id.
    pub fn counter(&self) -> &str {
        &self.counter
    }
    /// The delta.
    pub fn delta(&self) -> i64 {
        self.delta
    }
    /// The actor, if any.
    pub fn actor(&self) -> Option<&str> {
        self.actor.as_deref()
    }
    /// The event time in milliseconds since the Unix epoch.
    pub fn ts_ms(&self) -> i64 {
        self.ts_ms
    }
    /// The event id, if any.
    pub fn event_id(&self) -> Option<&str> {
        self.event_id.as_deref()
    }
}

impl fmt::Display for CounterEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_reset() {
            write!(f, "{} reset", self.counter)?;
        } else {
            write!(f, "{} {:+}", self.counter, self.delta)?;
        }
        if let Some(actor) = &self.actor {
            write!(f, " by {actor}")?;
        }
        Ok(())
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_ids_and_unicode() {
        assert!(validate_counter("likes:post:42").is_ok());
        assert!(validate_counter("views:vidéo:9").is_ok());
        assert!(validate_counter(&"a".repeat(MAX_COUNTER_BYTES)).is_ok());
    }

    #[test]
    fn rejects_each_bad_counter_with_its_reason() {
        assert_eq!(validate_counter(""), Err(EventError::EmptyCounter));
        assert_eq!(
            validate_counter(&"a".repeat(MAX_COUNTER_BYTES + 1)),
            Err(EventError::CounterTooLong { len: 257 })
        );
        for (id, found, position) in [
            ("a{b", '{', 1),
            ("ab}", '}', 2),
            ("a b", ' ', 1),
            ("a\nb", '\n', 1),
            ("é\u{7f}", '\u{7f}', 2),
        ] {
            match validate_counter(id) {
                Err(EventError::CounterCharacter {
                    found: f,
                    position: p,
                    ..
                }) => assert_eq!((f, p), (found, position), "{id:?}"),
                other => panic!("{id:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn every_ascii_character_is_judged_as_the_rules_say() {
        for c in (0u8..128).map(char::from) {
            let allowed = !(c == '{' || c == '}' || c.is_control() || c.is_whitespace());
            assert_eq!(
                validate_counter(&format!("a{c}b")).is_ok(),
                allowed,
                "{c:?}"
            );
        }
    }

    #[test]
    fn rejects_zero_and_absurd_deltas() {
        assert_eq!(validate_delta(0), Err(EventError::ZeroDelta));
        assert!(validate_delta(MAX_ABS_DELTA).is_ok());
        assert!(validate_delta(-MAX_ABS_DELTA).is_ok());
        assert_eq!(
            validate_delta(MAX_ABS_DELTA + 1),
            Err(EventError::DeltaOutOfRange {
                delta: MAX_ABS_DELTA + 1
            })
        );
        assert!(matches!(
            validate_delta(i64::MIN),
            Err(EventError::DeltaOutOfRange { .. })
        ));
    }

    #[test]
    fn rejects_empty_or_long_actor_and_event_id() {
        let e = CounterEvent::new("c", 1).expect("valid");
        assert!(matches!(
            e.clone().with_actor(""),
            Err(EventError::FieldLength { field: "actor", .. })
        ));
        assert!(matches!(
            e.with_event_id("x".repeat(MAX_EVENT_ID_BYTES + 1)),
            Err(EventError::FieldLength {
                field: "event id",
                ..
            })
        ));
    }
}

//! The wire format of a counter event: one event per Kafka message, in one of two forms.
//!
//! - **Binary** (what the producer crate writes): one envelope byte, `0xB1` (high nibble `0xB` =
//!   tally binary, low nibble = version 1), then the event encoded with bincode 2 (standard
//!   configuration: little-endian, variable-length integers) as the struct
//!   `(counter: str, delta: i64, actor: Option<str>, ts_ms: i64, event_id: Option<str>)`.
//! - **JSON** (for services in other languages, kcat, Kafka Connect): one object,
//!   `{"counter":"likes:post:42","delta":1,"actor":"u7","ts_ms":1764460800000,"event_id":"e1"}`,
//!   where only `counter` is required, `delta` defaults to 1 and unknown fields are rejected (a
//!   misspelt `"detla": 5` must not silently count as 1).
//!
//! [`decode`] tells the two apart by the first byte and returns a borrowed, validated
//! [`EventRef`] (JSON in the common shape through a fast reader of our own, `json`, anything
//! else through serde_json); bincode is used only inside this module, so it can be swapped for another
//! encoding behind a new envelope version. The format is documented in `docs/wire-format.md`.

mod binary;
#[cfg(test)]
mod fuzz;
mod json;

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::dead_letter::DeadLetterReason;
use crate::event::{self, CounterEvent, EventError};

/// The envelope byte of binary version 1.
pub const BINARY_V1: u8 = 0xB1;
/// Default largest message accepted by [`decode`], in bytes.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024;

/// Why a message could not be turned into an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The message had no payload at all.
    #[error("empty message")]
    Empty,
    /// The message was larger than the configured limit.
    #[error("message is {len} bytes, the limit is {max}")]
    Oversized {
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The first byte is neither a tally envelope nor the start of a JSON object.
    #[error(
        "unknown format: first byte is {first:#04x} (expected {BINARY_V1:#04x} or a JSON object)"
    )]
    UnknownFormat {
        /// The first byte.
        first: u8,
    },
    /// A tally binary envelope of a version this build does not know.
    #[error("unsupported binary envelope version {version}")]
    UnsupportedVersion {
        /// The version nibble.
        version: u8,
    },
    /// The binary body did not decode.
    #[error("malformed binary event: {message}")]
    Binary {
        /// What bincode said.
        message: String,
    },
    /// The JSON body did not parse into an event.
    #[error("malformed JSON event: {message}")]
    Json {
        /// What serde_json said, with line and column.
        message: String,
    },
    /// The event decoded but broke a rule.
    #[error("invalid event: {0}")]
    Invalid(#[from] EventError),
}

impl DecodeError {
    /// Why the message goes to the dead-letter topic: oversized, undecodable, or the rule the
    /// event broke.
    pub fn reason(&self) -> DeadLetterReason {
        match self {
            DecodeError::Oversized { .. } => DeadLetterReason::Oversized,
            DecodeError::Empty
            | DecodeError::UnknownFormat { .. }
            | DecodeError::UnsupportedVersion { .. }
            | DecodeError::Binary { .. }
            | DecodeError::Json { .. } => DeadLetterReason::Undecodable,
            DecodeError::Invalid(e) => match e {
                EventError::EmptyCounter
                | EventError::CounterTooLong { .. }
                | EventError::CounterCharacter { .. } => DeadLetterReason::InvalidCounter,
                EventError::ZeroDelta | EventError::DeltaOutOfRange { .. } => {
                    DeadLetterReason::InvalidDelta
                }
                _ => DeadLetterReason::InvalidField,
            },
        }
    }
}

/// A decoded, validated event that borrows from the message where it can.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventRef<'a> {
    /// The counter id.
    #[serde(borrow)]
    pub counter: Cow<'a, str>,
    /// The delta.
    #[serde(default = "default_delta")]
    pub delta: i64,
    /// The actor, if any.
    #[serde(borrow, default)]
    pub actor: Option<Cow<'a, str>>,
    /// Event time in milliseconds since the Unix epoch (0 when absent).
    #[serde(default)]
    pub ts_ms: i64,
    /// The event id, if any.
    #[serde(borrow, default)]
    pub event_id: Option<Cow<'a, str>>,
    /// A reset of the counter rather than a delta (its `delta` is then 0). In JSON,
    /// `"reset": true`; in the binary form, a delta of 0.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reset: bool,
}

fn default_delta() -> i64 {
    1
}

impl EventRef<'_> {
    /// Checks every field against the event rules (what [`CounterEvent::new`] and its builders
    /// check for an owned event).
    pub fn validate(&self) -> Result<(), EventError> {
        // A reset carries no delta to check.
        let delta = if self.reset { 1 } else { self.delta };
        event::validate(
            &self.counter,
            delta,
            self.actor.as_deref(),
            self.event_id.as_deref(),
        )
    }

    /// Copies the event into an owned [`CounterEvent`].
    pub fn to_owned_event(&self) -> Result<CounterEvent, EventError> {
        let mut e = if self.reset {
            CounterEvent::reset(self.counter.as_ref())?
        } else {
            CounterEvent::new(self.counter.as_ref(), self.delta)?
        }
        .with_ts_ms(self.ts_ms);
        if let Some(actor) = &self.actor {
            e = e.with_actor(actor.as_ref())?;
        }
        if let Some(id) = &self.event_id {
            e = e.with_event_id(id.as_ref())?;
        }
        Ok(e)
    }
}

/// The binary body, borrowed both ways: for encoding, and for decoding (bincode strings are
/// never escaped, so `&str` always works).
#[derive(Serialize, Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct Binary<'a> {
    counter: &'a str,
    delta: i64,
    actor: Option<&'a str>,
    ts_ms: i64,
    event_id: Option<&'a str>,
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
}

/// Appends the binary form of `event` to `out`.
pub fn encode_into(event: &CounterEvent, out: &mut Vec<u8>) {
    encode_body(
        &Binary {
            counter: event.counter(),
            delta: event.delta(),
            actor: event.actor(),
            ts_ms: event.ts_ms(),
            event_id: event.event_id(),
        },
        out,
    );
}

/// Appends the binary form of a borrowed event to `out` (it does not validate: the caller has).
pub fn encode_ref_into(event: &EventRef<'_>, out: &mut Vec<u8>) {
    encode_body(
        &Binary {
            counter: &event.counter,
            delta: event.delta,
            actor: event.actor.as_deref(),
            ts_ms: event.ts_ms,
            event_id: event.event_id.as_deref(),
        },
        out,
    );
}

fn encode_body(body: &Binary<'_>, out: &mut Vec<u8>) {
    out.push(BINARY_V1);
    bincode::serde::encode_into_std_write(body, out, bincode_config())
        .expect("bincode writes strings and integers into a Vec without failing");
}

/// The binary form of `event`.
pub fn encode(event: &CounterEvent) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + event.counter().len());
    encode_into(event, &mut out);
    out
}

/// The JSON form of `event`.
pub fn encode_json(event: &CounterEvent) -> String {
    let view = EventRef {
        counter: Cow::Borrowed(event.counter()),
        delta: event.delta(),
        actor: event.actor().map(Cow::Borrowed),
        ts_ms: event.ts_ms(),
        event_id: event.event_id().map(Cow::Borrowed),
        reset: event.is_reset(),
    };
    serde_json::to_string(&view).expect("an event always serializes to JSON")
}

/// Decodes and validates one message, binary or JSON, of at most `max_bytes` bytes.
pub fn decode(payload: &[u8], max_bytes: usize) -> Result<EventRef<'_>, DecodeError> {
    if payload.len() > max_bytes {
        return Err(DecodeError::Oversized {
            len: payload.len(),
            max: max_bytes,
        });
    }
    let Some(&first) = payload.first() else {
        return Err(DecodeError::Empty);
    };
    let event = match first {
        BINARY_V1 => decode_binary_v1(&payload[1..])?,
        0xB0..=0xBF => {
            return Err(DecodeError::UnsupportedVersion {
                version: first & 0x0F,
            });
        }
        b'{' | b' ' | b'\t' | b'\r' | b'\n' => match json::parse(payload) {
            Some(event) => event,
            None => {
                serde_json::from_slice::<EventRef<'_>>(payload).map_err(|e| DecodeError::Json {
                    message: e.to_string(),
                })?
            }
        },
        _ => return Err(DecodeError::UnknownFormat { first }),
    };
    let mut event = event;
    if event.reset {
        event.delta = 0;
    }
    event.validate()?;
    Ok(event)
}

fn decode_binary_v1(body: &[u8]) -> Result<EventRef<'_>, DecodeError> {
    let wire = match binary::read(body) {
        Some(wire) => wire,
        // bincode says why it does not read.
        None => bincode_v1(body)?,
    };
    Ok(EventRef {
        counter: Cow::Borrowed(wire.counter),
        delta: wire.delta,
        actor: wire.actor.map(Cow::Borrowed),
        ts_ms: wire.ts_ms,
        event_id: wire.event_id.map(Cow::Borrowed),
        // The binary form writes a reset as a delta of 0, which no delta may be.
        reset: wire.delta == 0,
    })
}

/// The binary body read by bincode.
fn bincode_v1(body: &[u8]) -> Result<Binary<'_>, DecodeError> {
    let (wire, read): (Binary<'_>, usize) =
        bincode::serde::borrow_decode_from_slice(body, bincode_config()).map_err(|e| {
            DecodeError::Binary {
                message: e.to_string(),
            }
        })?;
    if read != body.len() {
        return Err(DecodeError::Binary {
            message: format!("{} trailing bytes after the event", body.len() - read),
        });
    }
    Ok(wire)
}

/// The envelope byte of an expiry record: written into a partition by the aggregator's expirer
/// (never by a producer), then `(counter: str, deadline_ms: i64)` in bincode as above.
pub const EXPIRY_V1: u8 = 0xE1;

/// An expiry record: clear `counter` at this point of its partition if, by then, it has gone
/// idle: no event of it in the partition since the last expiry that cleared it, or the last
/// one's idle deadline (its Kafka timestamp plus its namespace's `expire_after`) at or before
/// `deadline_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiry<'a> {
    /// The counter.
    pub counter: Cow<'a, str>,
    /// Idle deadlines at or before this (ms since the epoch) have passed.
    pub deadline_ms: i64,
}

/// The expiry record for `counter` with `deadline_ms`.
pub fn encode_expiry(counter: &str, deadline_ms: i64) -> Vec<u8> {
    let mut out = vec![EXPIRY_V1];
    bincode::serde::encode_into_std_write((counter, deadline_ms), &mut out, bincode_config())
        .expect("writing to a Vec cannot fail");
    out
}

/// What one message of the topic holds: an event (a producer's) or an expiry record (the
/// aggregator's expirer's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record<'a> {
    /// A counter event, decoded and validated as [`decode`] does.
    Event(EventRef<'a>),
    /// An expiry record.
    Expiry(Expiry<'a>),
}

impl Record<'_> {
    /// The counter it concerns.
    pub fn counter(&self) -> &str {
        match self {
            Record::Event(event) => &event.counter,
            Record::Expiry(expiry) => &expiry.counter,
        }
    }
}

/// Decodes one message of the topic, of at most `max_bytes` bytes: what the aggregator and
/// `tally audit` read. Readers of events alone use [`decode`], which refuses expiry records.
pub fn decode_record(payload: &[u8], max_bytes: usize) -> Result<Record<'_>, DecodeError> {
    match decode_expiry(payload) {
        Some(expiry) => expiry.map(Record::Expiry),
        None => decode(payload, max_bytes).map(Record::Event),
    }
}

/// The expiry record in `payload`; `None` if the payload is not one.
fn decode_expiry(payload: &[u8]) -> Option<Result<Expiry<'_>, DecodeError>> {
    let body = payload.strip_prefix(&[EXPIRY_V1])?;
    let decoded =
        bincode::serde::borrow_decode_from_slice::<(&str, i64), _>(body, bincode_config());
    Some(match decoded {
        Ok(((counter, deadline_ms), read)) if read == body.len() => {
            event::validate_counter(counter)
                .map(|()| Expiry {
                    counter: Cow::Borrowed(counter),
                    deadline_ms,
                })
                .map_err(DecodeError::Invalid)
        }
        Ok((_, read)) => Err(DecodeError::Binary {
            message: format!(
                "{} trailing bytes after the expiry record",
                body.len() - read
            ),
        }),
        Err(e) => Err(DecodeError::Binary {
            message: e.to_string(),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = DEFAULT_MAX_MESSAGE_BYTES;

    fn full_event() -> CounterEvent {
        CounterEvent::new("likes:post:42", -3)
            .and_then(|e| e.with_actor("u7"))
            .and_then(|e| e.with_event_id("evt-1"))
            .map(|e| e.with_ts_ms(1_764_460_800_000))
            .expect("valid event")
    }

    #[test]
    fn binary_round_trip_keeps_every_field_and_borrows() {
        let event = full_event();
        let bytes = encode(&event);
        assert_eq!(bytes[0], BINARY_V1);
        let decoded = decode(&bytes, MAX).expect("decodes");
        assert!(matches!(decoded.counter, Cow::Borrowed(_)));
        assert_eq!(decoded.to_owned_event(), Ok(event));
    }

    #[test]
    fn binary_round_trip_without_optional_fields() {
        let event = CounterEvent::new("views:video:9", 1)
            .expect("valid")
            .with_ts_ms(0);
        assert_eq!(
            decode(&encode(&event), MAX).and_then(|e| Ok(e.to_owned_event()?)),
            Ok(event)
        );
    }

    #[test]
    fn json_round_trip_keeps_every_field() {
        let event = full_event();
        let json = encode_json(&event);
        assert_eq!(
            json,
            r#"{"counter":"likes:post:42","delta":-3,"actor":"u7","ts_ms":1764460800000,"event_id":"evt-1"}"#
        );
        assert_eq!(
            decode(json.as_bytes(), MAX).map(|e| e.to_owned_event()),
            Ok(Ok(event))
        );
    }

    #[test]
    fn an_expiry_record_round_trips_and_is_not_an_event() {
        let bytes = encode_expiry("campaign:c:7", 1_764_460_800_000);
        assert_eq!(
            decode_expiry(&bytes),
            Some(Ok(Expiry {
                counter: Cow::Borrowed("campaign:c:7"),
                deadline_ms: 1_764_460_800_000
            }))
        );
        assert_eq!(decode_expiry(&encode(&full_event())), None);
        let event = encode(&full_event());
        let record = decode_record(&event, MAX).expect("decodes");
        assert!(matches!(record, Record::Event(_)) && record.counter() == "likes:post:42");
        let record = decode_record(&bytes, MAX).expect("decodes");
        assert!(matches!(record, Record::Expiry(_)) && record.counter() == "campaign:c:7");
        assert!(matches!(
            decode(&bytes, MAX),
            Err(DecodeError::UnknownFormat { first: EXPIRY_V1 })
        ));
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(
            decode_expiry(&trailing),
            Some(Err(DecodeError::Binary { .. }))
        ));
        let bad = encode_expiry("no{braces}", 1);
        assert!(matches!(
            decode_expiry(&bad),
            Some(Err(DecodeError::Invalid(_)))
        ));
    }

    #[test]
    fn a_reset_round_trips_both_ways_and_a_zero_delta_is_still_refused() {
        let reset = CounterEvent::reset("likes:post:42").expect("valid");
        let bytes = encode(&reset);
        let binary = decode(&bytes, MAX).expect("decodes");
        assert!(binary.reset && binary.delta == 0);
        assert_eq!(binary.to_owned_event(), Ok(reset.clone()));
        let json = encode_json(&reset);
        assert!(json.contains(r#""reset":true"#), "{json}");
        assert_eq!(
            decode(json.as_bytes(), MAX).map(|e| e.to_owned_event()),
            Ok(Ok(reset))
        );
        let typed = decode(br#"{"counter":"likes:post:42","reset":true}"#, MAX).expect("decodes");
        assert!(typed.reset && typed.delta == 0);
        assert!(matches!(
            decode(br#"{"counter":"likes:post:42","delta":0}"#, MAX),
            Err(DecodeError::Invalid(_))
        ));
    }

    #[test]
    fn json_needs_only_the_counter_and_delta_defaults_to_one() {
        let e = decode(br#" {"counter":"likes:post:42"}"#, MAX).expect("decodes");
        assert_eq!(
            (e.counter.as_ref(), e.delta, e.ts_ms),
            ("likes:post:42", 1, 0)
        );
        assert_eq!(e.actor, None);
    }

    #[test]
    fn json_with_escapes_decodes() {
        let e = decode(br#"{"counter":"likes:caf\u00e9","delta":2}"#, MAX).expect("decodes");
        assert_eq!(e.counter, "likes:café");
    }

    #[test]
    fn rejects_every_kind_of_malformed_message() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "undecodable"),
            (b"hello".to_vec(), "undecodable"),
            (vec![0xB2, 1, 2], "undecodable"),
            (vec![BINARY_V1, 0xFF, 0xFF], "undecodable"),
            (b"{\"counter\":".to_vec(), "undecodable"),
            (br#"{"counter":"a","detla":5}"#.to_vec(), "undecodable"),
            (br#"{"delta":5}"#.to_vec(), "undecodable"),
            (br#"{"counter":"a","delta":"5"}"#.to_vec(), "undecodable"),
            (br#"{"counter":""}"#.to_vec(), "invalid_counter"),
            (br#"{"counter":"a{b}"}"#.to_vec(), "invalid_counter"),
            (br#"{"counter":"a","delta":0}"#.to_vec(), "invalid_delta"),
            (
                br#"{"counter":"a","delta":1000000000001}"#.to_vec(),
                "invalid_delta",
            ),
            (br#"{"counter":"a","actor":""}"#.to_vec(), "invalid_field"),
            (vec![b' '; MAX + 1], "oversized"),
        ];
        for (payload, reason) in cases {
            let err = decode(&payload, MAX).expect_err("must be rejected");
            assert_eq!(err.reason().as_str(), reason, "{err}");
        }
    }

    #[test]
    fn rejects_trailing_bytes_after_a_binary_event() {
        let mut bytes = encode(&full_event());
        bytes.push(0);
        assert!(matches!(
            decode(&bytes, MAX),
            Err(DecodeError::Binary { message }) if message.contains("trailing")
        ));
    }

    #[test]
    fn binary_event_that_breaks_a_rule_is_rejected_after_decoding() {
        // Hand-build a binary body whose delta is out of range: decoding works, validation must
        // not. (A delta of 0 is a reset there.)
        let mut bytes = vec![BINARY_V1];
        let body = Binary {
            counter: "c",
            delta: 2_000_000_000_000,
            actor: None,
            ts_ms: 0,
            event_id: None,
        };
        bincode::serde::encode_into_std_write(&body, &mut bytes, bincode_config())
            .expect("encodes");
        assert!(matches!(
            decode(&bytes, MAX),
            Err(DecodeError::Invalid(EventError::DeltaOutOfRange { .. }))
        ));
    }
}

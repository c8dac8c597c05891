//! `POST /v1/events`: events in the wire format, appended to tally's topic, answered only once
//! Kafka has acknowledged every one.
//!
//! The body is one event or an array of at most [`MAX_EVENTS`], each exactly as a service would
//! put it on the topic (`docs/wire-format.md`). Every event is checked before any is sent: one
//! bad event refuses the whole body (400 `invalid_events`, with each bad one's index and
//! reason), so a client never has to work out which half of a batch landed. An event without
//! `ts_ms` gets the time the server received it. A body holding a reset needs a token with the
//! `reset` scope (403 `forbidden` otherwise, and nothing is sent).
//!
//! If Kafka does not acknowledge every event within the produce timeout, the answer is 503
//! `kafka_unavailable`, and its `details` say how many were acknowledged and which indexes were
//! not: nothing is reported as accepted that Kafka did not store. (An unacknowledged event may
//! still have been stored; retrying it may count it twice, as with any producer.)

use std::sync::Arc;

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::{Extension, Json};
use serde::Serialize;
use serde_json::{Value, json};
use tally_common::CounterEvent;
use tally_common::codec::{self, DEFAULT_MAX_MESSAGE_BYTES};
use tally_common::event::now_ms;
use utoipa::ToSchema;

use crate::auth::{Granted, Scope};
use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

/// Most events one request may carry.
pub const MAX_EVENTS: usize = 1_000;

/// Events Kafka acknowledged.
#[derive(Debug, Serialize, ToSchema)]
pub struct Accepted {
    /// How many events Kafka acknowledged: all of them.
    accepted: usize,
}

/// One event in the wire format.
#[derive(Debug, serde::Deserialize, ToSchema)]
#[allow(dead_code)] // Only its schema is used: events are decoded by the wire-format codec.
pub struct WireEvent {
    /// The counter id: `<namespace>:<rest>`, at most 256 bytes.
    counter: String,
    /// The amount to add (default 1).
    delta: Option<i64>,
    /// Who, in a namespace that counts once per actor.
    actor: Option<String>,
    /// Event time, ms since the Unix epoch (default: when the server received it).
    ts_ms: Option<i64>,
    /// The sender's id for the event; in a namespace with an idempotency window, repeats of it
    /// for the same counter within the window count once.
    event_id: Option<String>,
    /// `true`: reset the counter instead (everything sent before it is cleared); `delta` is then
    /// ignored.
    reset: Option<bool>,
}

/// One event, or an array of them.
#[derive(Debug, serde::Deserialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // Only its schema is used.
pub enum Events {
    /// One event.
    One(WireEvent),
    /// Several, at most 1,000.
    Many(Vec<WireEvent>),
}

/// Checks every event of `body`: the events, or each bad one's index and reason.
fn parse(body: Value) -> Result<Vec<CounterEvent>, ApiError> {
    let items = match body {
        Value::Array(items) => items,
        one => vec![one],
    };
    if items.len() > MAX_EVENTS {
        return Err(ApiError::bad_request(
            "too_many_events",
            format!(
                "{} events sent; at most {MAX_EVENTS} per request",
                items.len()
            ),
        ));
    }
    if items.is_empty() {
        return Err(ApiError::bad_request(
            "invalid_events",
            "the array holds no event",
        ));
    }
    let received = now_ms();
    let mut events = Vec::with_capacity(items.len());
    let mut problems = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let checked = if item.is_object() {
            let bytes = serde_json::to_vec(item).expect("a JSON value serializes");
            codec::decode(&bytes, DEFAULT_MAX_MESSAGE_BYTES)
                .map_err(|e| e.to_string())
                .and_then(|event| event.to_owned_event().map_err(|e| e.to_string()))
        } else {
            Err("an event is a JSON object".to_owned())
        };
        match checked {
            Ok(event) if event.ts_ms() == 0 => events.push(event.with_ts_ms(received)),
            Ok(event) => events.push(event),
            Err(reason) => problems.push(json!({ "index": index, "reason": reason })),
        }
    }
    if problems.is_empty() {
        return Ok(events);
    }
    Err(ApiError::bad_request(
        "invalid_events",
        format!(
            "{} of {} events are invalid; none was sent",
            problems.len(),
            items.len()
        ),
    )
    .with_details(json!({ "invalid": problems })))
}

/// Appends events to tally's topic; answers once Kafka has acknowledged every one.
#[utoipa::path(
    post, path = "/v1/events", tag = "events",
    request_body(content = Events, description = "One event or an array of at most 1,000, in the wire format"),
    responses(
        (status = 200, body = Accepted, description = "Kafka acknowledged every event"),
        (status = 400, body = ErrorBody, description = "A bad event: none was sent"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 415, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "Kafka did not acknowledge them all; details say which"),
    ),
    security(("bearer" = ["write"]))
)]
pub async fn post_events(
    State(state): State<Arc<AppState>>,
    Extension(granted): Extension<Granted>,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Json<Accepted>, ApiError> {
    let Json(body) = body?;
    let events = parse(body)?;
    if events.iter().any(CounterEvent::is_reset) {
        granted.allows(Scope::Reset, "a reset")?;
    }
    // All handed to librdkafka first (in order), then every acknowledgement awaited.
    let mut pending = Vec::with_capacity(events.len());
    for event in &events {
        pending.push(state.producer.enqueue(event).await);
    }
    let mut failed = Vec::new();
    let mut reason = None;
    for (index, enqueued) in pending.into_iter().enumerate() {
        let outcome = match enqueued {
            Ok(p) => p.acked().await.map(|_| ()),
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            reason.get_or_insert_with(|| e.to_string());
            failed.push(index);
        }
    }
    let accepted = events.len() - failed.len();
    state.metrics.events_accepted.inc_by(accepted as u64);
    if failed.is_empty() {
        return Ok(Json(Accepted { accepted }));
    }
    state.metrics.events_failed.inc_by(failed.len() as u64);
    Err(ApiError::kafka(format!(
        "Kafka acknowledged {accepted} of {} events: {}",
        events.len(),
        reason.unwrap_or_default()
    ))
    .with_details(json!({ "accepted": accepted, "not_acknowledged": failed })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_or_an_array_and_every_bad_one_named() {
        let one = parse(json!({"counter": "likes:post:1"})).expect("valid");
        assert_eq!((one[0].counter(), one[0].delta()), ("likes:post:1", 1));
        assert!(one[0].ts_ms() > 0, "stamped with the time received");
        let kept = parse(json!([{"counter": "a:1", "delta": 5, "ts_ms": 7}])).expect("valid");
        assert_eq!((kept[0].delta(), kept[0].ts_ms()), (5, 7));

        let error = parse(json!([
            {"counter": "likes:post:1"},
            {"counter": "has space"},
            {"delta": 2},
            7,
            {"counter": "a:1", "delta": "x"},
        ]))
        .expect_err("refused whole");
        assert_eq!(error.code(), "invalid_events");
        let indexes: Vec<u64> = error.details().expect("details")["invalid"]
            .as_array()
            .expect("a list")
            .iter()
            .filter_map(|p| p["index"].as_u64())
            .collect();
        assert_eq!(indexes, [1, 2, 3, 4]);
        let body = axum::response::IntoResponse::into_response(error);
        assert_eq!(body.status(), 400);
    }

    #[test]
    fn too_many_or_none_is_refused() {
        let many = Value::Array(vec![json!({"counter": "a:1"}); MAX_EVENTS + 1]);
        assert_eq!(parse(many).expect_err("refused").code(), "too_many_events");
        assert_eq!(
            parse(json!([])).expect_err("refused").code(),
            "invalid_events"
        );
    }
}

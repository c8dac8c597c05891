//! Property tests of the decoders of untrusted bytes: the JSON fast path against serde_json,
//! the binary decoder, and `decode` as a whole, on generated, truncated and corrupted input.
//! Never a panic; the fast path never accepts what serde_json would read differently.

use proptest::prelude::*;

use super::*;

/// A JSON value of the kinds events hold, and the kinds they must not.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        // Plain strings, strings with escapes and non-ASCII, odd ones.
        "[a-z:0-9_]{0,12}".prop_map(|s| format!("\"{s}\"")),
        "[a-z\\\\\"/ \u{e9}\u{1F600}]{0,8}".prop_map(|s| serde_json::to_string(&s).expect("json")),
        Just("\"\\u0041b\"".to_owned()),
        Just("\"\\ud800\"".to_owned()),
        // Integers of every size, fractions, exponents.
        any::<i64>().prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        Just("123456789012345678901234567890".to_owned()),
        Just("-0".to_owned()),
        Just("1.0".to_owned()),
        Just("1e3".to_owned()),
        Just("01".to_owned()),
        // Everything else.
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        Just("[]".to_owned()),
        Just("{}".to_owned()),
    ]
}

/// A JSON object with event keys (some repeated, some unknown) and generated values.
fn object() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        Just("counter"),
        Just("delta"),
        Just("actor"),
        Just("ts_ms"),
        Just("event_id"),
        Just("reset"),
        Just("other"),
        Just("Counter"),
    ];
    let space = prop_oneof![Just(""), Just(" "), Just("\n\t "), Just("\r")];
    (
        prop::collection::vec((key, value(), space.clone()), 0..8),
        space,
        prop_oneof![Just(""), Just(""), Just(" "), Just("x"), Just("}")],
    )
        .prop_map(|(fields, space, tail)| {
            let fields: Vec<String> = fields
                .into_iter()
                .map(|(k, v, s)| format!("{s}\"{k}\"{s}:{s}{v}{s}"))
                .collect();
            format!("{space}{{{}}}{tail}", fields.join(","))
        })
}

/// An event of the common shape, each key once in a random order, the fast path's main diet.
fn common_shape() -> impl Strategy<Value = String> {
    (
        counter(),
        proptest::option::of(any::<i64>()),
        proptest::option::of(prop_oneof![
            "[a-z0-9]{1,10}".prop_map(|a| format!("\"{a}\"")),
            Just("null".to_owned())
        ]),
        proptest::option::of(any::<i64>()),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(counter, delta, actor, ts, rotate)| {
            let mut fields = vec![format!("\"counter\":\"{counter}\"")];
            fields.extend(delta.map(|d| format!("\"delta\":{d}")));
            fields.extend(actor.map(|a| format!("\"actor\": {a}")));
            fields.extend(ts.map(|t| format!("\"ts_ms\":{t}")));
            let by = rotate.index(fields.len());
            fields.rotate_left(by);
            format!("{{{}}}", fields.join(","))
        })
}

/// A valid counter id: a namespace, a colon and a rest.
fn counter() -> impl Strategy<Value = String> {
    "[a-z]{1,8}:[a-zA-Z0-9:._<>/=-]{1,40}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Whatever the fast path accepts, serde_json reads the same way.
    #[test]
    fn the_json_fast_path_agrees_with_serde_json(payload in prop_oneof![object(), common_shape()]) {
        if let Some(fast) = json::parse(payload.as_bytes()) {
            let slow = serde_json::from_slice::<EventRef<'_>>(payload.as_bytes());
            prop_assert!(slow.is_ok(), "fast path took {payload:?}: {slow:?}");
            prop_assert_eq!(fast, slow.expect("checked"));
        }
        // And the whole decoder never panics on it.
        let _ = decode(payload.as_bytes(), DEFAULT_MAX_MESSAGE_BYTES);
    }

    /// Arbitrary bytes, with each format's first byte: an error or an event, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(first in prop::sample::select(vec![BINARY_V1, 0xB3, b'{', b' ', b'x']), rest in prop::collection::vec(any::<u8>(), 0..300)) {
        let mut payload = vec![first];
        payload.extend(rest);
        let _ = decode(&payload, DEFAULT_MAX_MESSAGE_BYTES);
    }

    /// A valid binary event, truncated or with a byte changed: an error or a valid event.
    #[test]
    fn damaged_binary_events_never_panic(
        counter in counter(),
        delta in any::<i64>(),
        actor in proptest::option::of("[a-z0-9]{1,12}"),
        cut in any::<prop::sample::Index>(),
        flip in any::<(prop::sample::Index, u8)>(),
    ) {
        let delta = match delta.clamp(-1_000_000, 1_000_000) {
            0 => 1,
            delta => delta,
        };
        let mut event = CounterEvent::new(counter, delta).expect("valid");
        if let Some(actor) = actor {
            event = event.with_actor(actor).expect("valid actor");
        }
        let bytes = encode(&event);
        let decoded = decode(&bytes, DEFAULT_MAX_MESSAGE_BYTES).expect("its own encoding decodes");
        prop_assert_eq!(decoded.to_owned_event().expect("valid"), event);
        let truncated = &bytes[..cut.index(bytes.len())];
        let _ = decode(truncated, DEFAULT_MAX_MESSAGE_BYTES);
        let mut corrupted = bytes.clone();
        let at = flip.0.index(corrupted.len());
        corrupted[at] ^= flip.1.max(1);
        if let Ok(event) = decode(&corrupted, DEFAULT_MAX_MESSAGE_BYTES) {
            // Whatever decodes from damaged bytes still passed every rule.
            prop_assert!(event.validate().is_ok());
        }
    }
}

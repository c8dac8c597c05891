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

    /// The binary body read by hand and by bincode: the same event from the same bytes, or
    /// neither reads them. Bodies built field by field with every length of integer (longer
    /// than needed too, and the ones bincode refuses), option tags other than 0 and 1, strings
    /// cut short or not UTF-8; encoded events damaged; arbitrary bytes.
    #[test]
    fn the_binary_reader_agrees_with_bincode(
        body in prop_oneof![
            4 => built_body(),
            1 => damaged_body(),
            1 => prop::collection::vec(any::<u8>(), 0..40),
        ]
    ) {
        let ours = binary::read(&body);
        let theirs = bincode_v1(&body).ok();
        prop_assert_eq!(ours, theirs);
    }
}

/// A `u64` in one of bincode's variable-length forms (or a malformed one): the shortest that
/// fits, a longer one, the 16-byte form, the reserved tag, or cut short.
fn varint(n: u64, form: u8) -> Vec<u8> {
    let mut out = Vec::new();
    match form % 7 {
        0 if n <= 250 => out.push(n as u8),
        0 | 1 if n <= u64::from(u16::MAX) => {
            out.push(251);
            out.extend((n as u16).to_le_bytes());
        }
        0..=2 if n <= u64::from(u32::MAX) => {
            out.push(252);
            out.extend((n as u32).to_le_bytes());
        }
        0..=3 => {
            out.push(253);
            out.extend(n.to_le_bytes());
        }
        4 => {
            out.push(254);
            out.extend(u128::from(n).to_le_bytes());
        }
        5 => out.push(255),
        _ => out.push(253),
    }
    out
}

/// A string: its length in some form, then bytes (perhaps fewer, perhaps not UTF-8).
fn string(bytes: &[u8], form: u8, short: bool) -> Vec<u8> {
    let mut out = varint(bytes.len() as u64, form);
    out.extend(&bytes[..bytes.len() - usize::from(short && !bytes.is_empty())]);
    out
}

fn zigzag(n: i64) -> u64 {
    if n < 0 {
        !(n as u64) * 2 + 1
    } else {
        (n as u64) * 2
    }
}

type Field = (Vec<u8>, u8, bool);

/// A body built field by field.
fn built_body() -> impl Strategy<Value = Vec<u8>> {
    // Mostly what reads, so that both readers' events are compared often.
    let text = || {
        prop_oneof![
            4 => "[a-z:0-9\u{e9}]{0,300}".prop_map(String::into_bytes),
            1 => prop::collection::vec(any::<u8>(), 0..8),
        ]
    };
    let form = || prop_oneof![6 => 0u8..4, 1 => 4u8..7];
    let field = move || (text(), form(), prop::bool::weighted(0.05));
    let int = move || (prop_oneof![any::<i64>(), -300i64..300], form());
    let tag = || prop_oneof![3 => Just(0u8), 3 => Just(1u8), 1 => any::<u8>()];
    (
        field(),
        int(),
        (tag(), field()),
        int(),
        (tag(), field()),
        prop::bool::weighted(0.05),
    )
        .prop_map(|(counter, delta, actor, ts, id, extra)| {
            let put = |out: &mut Vec<u8>, (bytes, form, short): Field| {
                out.extend(string(&bytes, form, short));
            };
            let mut out = Vec::new();
            put(&mut out, counter);
            out.extend(varint(zigzag(delta.0), delta.1));
            let (tag, field) = actor;
            out.push(tag);
            if tag == 1 {
                put(&mut out, field);
            }
            out.extend(varint(zigzag(ts.0), ts.1));
            let (tag, field) = id;
            out.push(tag);
            if tag == 1 {
                put(&mut out, field);
            }
            if extra {
                out.push(0);
            }
            out
        })
}

/// An encoded event's body, cut short or with a byte changed.
fn damaged_body() -> impl Strategy<Value = Vec<u8>> {
    (
        counter(),
        any::<i64>(),
        any::<prop::sample::Index>(),
        any::<(prop::sample::Index, u8)>(),
    )
        .prop_map(|(counter, delta, cut, flip)| {
            let event = CounterEvent::new(counter, delta.clamp(1, 1_000_000))
                .and_then(|e| e.with_actor("u7"))
                .and_then(|e| e.with_event_id("e1"))
                .expect("valid");
            let mut body = encode(&event)[1..].to_vec();
            let at = flip.0.index(body.len());
            body[at] ^= flip.1;
            body.truncate(body.len() - cut.index(body.len()) / 4);
            body
        })
}

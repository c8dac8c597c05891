//! The fast path for JSON events: a reader for the shape nearly every JSON event has, one object
//! whose keys are the event's field names, each once, with plain strings (no escapes) and
//! integers as values, and `null` for an absent actor or event id. It borrows every string from
//! the message and allocates nothing.
//!
//! It only ever accepts what serde_json would decode to the same event: whenever it meets
//! anything else (an escape, any other `null`, a fraction or exponent, an unknown or repeated
//! key, a missing counter, bytes after the object) it gives up and [`super::decode`] asks
//! serde_json, so every rule and every error message stay serde_json's.

use std::borrow::Cow;

use super::EventRef;

/// The event in `payload`, if it has the common shape; `None` means "ask serde_json".
pub(super) fn parse(payload: &[u8]) -> Option<EventRef<'_>> {
    // One UTF-8 check for the whole message (serde_json refuses what fails it, in a string or
    // out of one): every string is then a slice of it, cut at ASCII quotes. (A check per string
    // value instead, two calls a message, measured slower: 8.5% of decode + aggregate, not 4.8.)
    let text = std::str::from_utf8(payload).ok()?;
    let mut c = Cursor {
        text,
        bytes: payload,
        at: 0,
    };
    c.skip_whitespace();
    c.expect(b'{')?;
    let mut counter = None;
    let mut delta = None;
    let mut actor = None;
    let mut ts_ms = None;
    let mut event_id = None;
    loop {
        c.skip_whitespace();
        let (start, end) = c.string_bounds()?;
        let key = &payload[start..end];
        c.skip_whitespace();
        c.expect(b':')?;
        c.skip_whitespace();
        match key {
            b"counter" if counter.is_none() => counter = Some(c.string()?),
            b"delta" if delta.is_none() => delta = Some(c.integer()?),
            b"actor" if actor.is_none() => actor = Some(c.string_or_null()?),
            b"ts_ms" if ts_ms.is_none() => ts_ms = Some(c.integer()?),
            b"event_id" if event_id.is_none() => event_id = Some(c.string_or_null()?),
            _ => return None,
        }
        c.skip_whitespace();
        match c.next()? {
            b',' => {}
            b'}' => break,
            _ => return None,
        }
    }
    c.skip_whitespace();
    if c.at != payload.len() {
        return None;
    }
    Some(EventRef {
        counter: Cow::Borrowed(counter?),
        delta: delta.unwrap_or(1),
        actor: actor.flatten().map(Cow::Borrowed),
        ts_ms: ts_ms.unwrap_or(0),
        event_id: event_id.flatten().map(Cow::Borrowed),
        reset: false,
    })
}

/// A position in the message.
struct Cursor<'a> {
    /// The message, checked to be UTF-8.
    text: &'a str,
    /// The same, as bytes.
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn next(&mut self) -> Option<u8> {
        let b = *self.bytes.get(self.at)?;
        self.at += 1;
        Some(b)
    }

    fn expect(&mut self, wanted: u8) -> Option<()> {
        (self.next()? == wanted).then_some(())
    }

    /// Skips JSON's four whitespace characters.
    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.at) {
            self.at += 1;
        }
    }

    /// Where the contents of a string without escapes or control characters start and end.
    fn string_bounds(&mut self) -> Option<(usize, usize)> {
        self.expect(b'"')?;
        let start = self.at;
        let end = start + string_end(&self.bytes[start..])?;
        if self.bytes[end] != b'"' {
            // An escape or a control character: serde_json's to read (or refuse).
            return None;
        }
        self.at = end + 1;
        Some((start, end))
    }

    /// A string without escapes or control characters, borrowed from the message.
    fn string(&mut self) -> Option<&'a str> {
        let (start, end) = self.string_bounds()?;
        self.text.get(start..end)
    }

    /// A string as [`Cursor::string`] reads one, or `null` (what many clients write for an
    /// absent optional field, and serde_json reads as none).
    fn string_or_null(&mut self) -> Option<Option<&'a str>> {
        if self.bytes[self.at..].starts_with(b"null") {
            self.at += 4;
            return Some(None);
        }
        self.string().map(Some)
    }

    /// An integer as JSON writes one (`-?(0|[1-9][0-9]*)`, but not `-0`) that fits an i64, not
    /// followed by a fraction or an exponent.
    fn integer(&mut self) -> Option<i64> {
        let negative = self.bytes.get(self.at) == Some(&b'-');
        if negative {
            self.at += 1;
        }
        let number = &self.bytes[self.at..];
        // Digits counted and summed in one pass (past u64, serde_json's to refuse).
        let mut digits = 0;
        let mut magnitude: u64 = 0;
        while let Some(digit) = number.get(digits).map(|b| b.wrapping_sub(b'0')) {
            if digit > 9 {
                break;
            }
            magnitude = magnitude.checked_mul(10)?.checked_add(u64::from(digit))?;
            digits += 1;
        }
        // No digits, a leading zero, or `-0` (which serde_json reads as a float).
        if digits == 0 || (number[0] == b'0' && (digits > 1 || negative)) {
            return None;
        }
        if let Some(b'.' | b'e' | b'E') = number.get(digits) {
            return None;
        }
        let value = if negative {
            0i64.checked_sub_unsigned(magnitude)?
        } else {
            i64::try_from(magnitude).ok()?
        };
        self.at += digits;
        Some(value)
    }
}

/// The index in `bytes` of the first `"`, `\` or control character (below 0x20), read eight
/// bytes at a time: a byte-by-byte loop over the strings was the reader's hottest code
/// (`perf annotate`: its compares held a third of `decode`'s samples).
fn string_end(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let mut i = 0;
    while let Some(word) = bytes.get(i..i + 8) {
        let w = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        // A byte's high bit is set in `zero(v)` where the byte of `v` is 0, and in `below`
        // where the byte of `w` is under 0x20; bits above the lowest such byte may be set
        // falsely (a borrow), never bits below it, so the lowest set bit is the first match.
        let zero = |v: u64| v.wrapping_sub(ONES) & !v;
        let quote = zero(w ^ (ONES * u64::from(b'"')));
        let backslash = zero(w ^ (ONES * u64::from(b'\\')));
        let below = w.wrapping_sub(ONES * 0x20) & !w;
        let found = (quote | backslash | below) & HIGHS;
        if found != 0 {
            return Some(i + (found.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    (bytes[i..].iter())
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        .map(|p| i + p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serde(payload: &[u8]) -> Option<EventRef<'_>> {
        serde_json::from_slice(payload).ok()
    }

    #[test]
    fn reads_the_common_shapes_and_borrows() {
        let e = parse(br#"{"counter":"likes:post:7","delta":-3,"actor":"u1","ts_ms":1764460800000,"event_id":"e1"}"#)
            .expect("common shape");
        assert!(matches!(e.counter, Cow::Borrowed("likes:post:7")));
        assert_eq!(
            (e.delta, e.actor.as_deref(), e.ts_ms, e.event_id.as_deref()),
            (-3, Some("u1"), 1_764_460_800_000, Some("e1"))
        );
        let e = parse(b" {\n\t\"counter\" : \"c\" } \r\n").expect("whitespace");
        assert_eq!((e.counter.as_ref(), e.delta, e.ts_ms), ("c", 1, 0));
        let e = parse(br#"{"counter":"c","actor":null,"event_id":null}"#).expect("nulls");
        assert_eq!((e.actor, e.event_id), (None, None));
    }

    /// Eight bytes at a time finds what one at a time would, wherever it is.
    #[test]
    fn string_end_finds_the_first_stop_byte() {
        let naive = |b: &[u8]| b.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
        let mut state: u64 = 0x2545_F491_4F6C_DD1D;
        let mut random = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..200_000 {
            let len = (random() % 40) as usize;
            // Mostly plain bytes (ASCII and not), a stop byte now and then.
            let bytes: Vec<u8> = (0..len)
                .map(|_| match random() % 16 {
                    0 => [b'"', b'\\', 0x00, 0x1F, b'\n'][(random() % 5) as usize],
                    1..=3 => 0x80 + (random() % 128) as u8,
                    _ => 0x20 + (random() % 96) as u8,
                })
                .collect();
            assert_eq!(string_end(&bytes), naive(&bytes), "{bytes:?}");
        }
    }

    #[test]
    fn leaves_everything_unusual_to_serde_json() {
        for payload in [
            &br#"{"counter":"caf\u00e9"}"#[..],
            br#"{"counter":null}"#,
            br#"{"counter":"a","delta":null}"#,
            br#"{"counter":"a","actor":nul}"#,
            br#"{"counter":"a","actor":null,"actor":"u1"}"#,
            br#"{"counter":"likes:post:1\"2345678"}"#,
            b"{\"counter\":\"likes:post:1\t2345678\"}",
            br#"{"counter":"a","delta":1.0}"#,
            br#"{"counter":"a","delta":1e2}"#,
            br#"{"counter":"a","delta":01}"#,
            br#"{"counter":"a","delta":-0}"#,
            br#"{"counter":"a","delta":9223372036854775808}"#,
            br#"{"counter":"a","counter":"b"}"#,
            br#"{"counter":"a","detla":5}"#,
            br#"{"delta":5}"#,
            br#"{"counter":"a",}"#,
            br#"{"counter":"a"} x"#,
            br#"{}"#,
            b"{\"counter\":\"a\tb\"}",
        ] {
            assert!(
                parse(payload).is_none(),
                "{}",
                String::from_utf8_lossy(payload)
            );
        }
    }

    /// Messages built from pieces of valid and invalid JSON events, with a small generator
    /// (no dependency): whatever the fast path accepts, serde_json decodes to the same event.
    #[test]
    fn never_disagrees_with_serde_json() {
        let keys = [
            "\"counter\"",
            "\"delta\"",
            "\"actor\"",
            "\"ts_ms\"",
            "\"event_id\"",
            "\"other\"",
            "\"count\\u0065r\"",
        ];
        let values = [
            "\"likes:post:1\"",
            "\"u7\"",
            "\"\"",
            "\"caf\u{e9}\"",
            "\"a\\\"b\"",
            "1",
            "-42",
            "0",
            "-0",
            "01",
            "1.5",
            "2e3",
            "9223372036854775807",
            "-9223372036854775808",
            "9223372036854775808",
            "null",
            "nul",
            "true",
            "\"likes:post:123456789\"",
            "\"likes:post:12\\\"456789\"",
            "\"u\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}x\"",
            "[]",
        ];
        let glue = ["", " ", "\n", "\t"];
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut random = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let strings = [0, 1, 2, 3, 4, 15, 18, 19, 20];
        let integers = [5, 6, 7, 12, 13];
        let (mut fast, mut accepted) = (0, 0);
        for _ in 0..50_000 {
            let mut json = String::from(glue[random(glue.len())]);
            json.push('{');
            let first = random(5);
            for i in 0..random(6) {
                if i > 0 {
                    json.push(',');
                }
                // Mostly each field once with a value of its type, sometimes anything.
                let key = if random(6) > 0 {
                    (first + i) % 5
                } else {
                    random(keys.len())
                };
                let value = match (random(4) > 0, key) {
                    (true, 1 | 3) => integers[random(integers.len())],
                    (true, _) => strings[random(strings.len())],
                    (false, _) => random(values.len()),
                };
                json.push_str(glue[random(glue.len())]);
                json.push_str(keys[key]);
                json.push_str(glue[random(glue.len())]);
                json.push(':');
                json.push_str(glue[random(glue.len())]);
                json.push_str(values[value]);
            }
            json.push('}');
            if random(10) == 0 {
                json.push_str([",", "}", " x", "\n"][random(4)]);
            }
            let expected = serde(json.as_bytes());
            accepted += usize::from(expected.is_some());
            if let Some(event) = parse(json.as_bytes()) {
                fast += 1;
                assert_eq!(Some(event), expected, "{json}");
            }
        }
        // Most of what serde_json accepts has no escapes: the fast path must take it.
        assert!(
            fast * 2 > accepted,
            "the fast path took {fast} of the {accepted} events serde_json accepted"
        );
    }
}

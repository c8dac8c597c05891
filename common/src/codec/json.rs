//! The fast path for JSON events: a reader for the shape nearly every JSON event has, one object
//! whose keys are the event's field names, each once, with plain strings (no escapes) and
//! integers as values. It borrows every string from the message and allocates nothing.
//!
//! It only ever accepts what serde_json would decode to the same event: whenever it meets
//! anything else (an escape, `null`, a fraction or exponent, an unknown or repeated key, a
//! missing counter, bytes after the object) it gives up and [`super::decode`] asks serde_json,
//! so every rule and every error message stay serde_json's.

use std::borrow::Cow;

use super::EventRef;

/// The event in `payload`, if it has the common shape; `None` means "ask serde_json".
pub(super) fn parse(payload: &[u8]) -> Option<EventRef<'_>> {
    // One UTF-8 check for the whole message (serde_json refuses what fails it, in a string or
    // out of one): every string is then a slice of it, cut at ASCII quotes.
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
            b"actor" if actor.is_none() => actor = Some(c.string()?),
            b"ts_ms" if ts_ms.is_none() => ts_ms = Some(c.integer()?),
            b"event_id" if event_id.is_none() => event_id = Some(c.string()?),
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
        actor: actor.map(Cow::Borrowed),
        ts_ms: ts_ms.unwrap_or(0),
        event_id: event_id.map(Cow::Borrowed),
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

    /// Where the contents of a string without escapes or control characters start and end,
    /// read in one pass.
    fn string_bounds(&mut self) -> Option<(usize, usize)> {
        self.expect(b'"')?;
        let start = self.at;
        for (i, &b) in self.bytes[start..].iter().enumerate() {
            match b {
                b'"' => {
                    self.at = start + i + 1;
                    return Some((start, start + i));
                }
                b'\\' | 0..0x20 => return None,
                _ => {}
            }
        }
        None
    }

    /// A string without escapes or control characters, borrowed from the message.
    fn string(&mut self) -> Option<&'a str> {
        let (start, end) = self.string_bounds()?;
        self.text.get(start..end)
    }

    /// An integer as JSON writes one (`-?(0|[1-9][0-9]*)`, but not `-0`) that fits an i64, not
    /// followed by a fraction or an exponent.
    fn integer(&mut self) -> Option<i64> {
        let negative = self.bytes.get(self.at) == Some(&b'-');
        if negative {
            self.at += 1;
        }
        let digits = self.bytes[self.at..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        // No digits, a leading zero, or `-0` (which serde_json reads as a float).
        if digits == 0 || (self.bytes[self.at] == b'0' && (digits > 1 || negative)) {
            return None;
        }
        if let Some(b'.' | b'e' | b'E') = self.bytes.get(self.at + digits) {
            return None;
        }
        let mut value: i64 = 0;
        for &b in &self.bytes[self.at..self.at + digits] {
            let digit = i64::from(b - b'0');
            value = value.checked_mul(10)?;
            value = if negative {
                value.checked_sub(digit)?
            } else {
                value.checked_add(digit)?
            };
        }
        self.at += digits;
        Some(value)
    }
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
    }

    #[test]
    fn leaves_everything_unusual_to_serde_json() {
        for payload in [
            &br#"{"counter":"caf\u00e9"}"#[..],
            br#"{"counter":"a","actor":null}"#,
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
            "true",
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
        let strings = [0, 1, 2, 3, 4];
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

//! The binary body read by hand: what `bincode::serde::borrow_decode_from_slice` reads for
//! [`Binary`] under bincode's standard configuration (variable-length integers, little end
//! first; signed ones zigzagged; a string's length, then its UTF-8 bytes; an option's tag byte,
//! 0 or 1), without serde's machinery around each field, which was half of a binary event's
//! decoding. It returns `None` wherever bincode would fail, and the caller then asks bincode,
//! whose error says why.

use super::Binary;

/// The body's event, if it reads whole.
pub(super) fn read(body: &[u8]) -> Option<Binary<'_>> {
    let mut r = Reader(body);
    let counter = r.str()?;
    let delta = r.i64()?;
    let actor = r.option_str()?;
    let ts_ms = r.i64()?;
    let event_id = r.option_str()?;
    r.0.is_empty().then_some(Binary {
        counter,
        delta,
        actor,
        ts_ms,
        event_id,
    })
}

/// The bytes not read yet.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }

    /// A variable-length `u64`: one byte up to 250, else a tag (251, 252, 253) and 2, 4 or 8
    /// bytes. bincode takes a longer form than needed too; a 16-byte one (254) never fits.
    fn u64(&mut self) -> Option<u64> {
        let [tag] = self.bytes::<1>()?;
        match tag {
            0..=250 => Some(u64::from(tag)),
            251 => self.bytes::<2>().map(|b| u64::from(u16::from_le_bytes(b))),
            252 => self.bytes::<4>().map(|b| u64::from(u32::from_le_bytes(b))),
            253 => self.bytes::<8>().map(u64::from_le_bytes),
            _ => None,
        }
    }

    /// A zigzagged `i64`.
    fn i64(&mut self) -> Option<i64> {
        let n = self.u64()?;
        Some(if n % 2 == 0 {
            (n / 2) as i64
        } else {
            !(n / 2) as i64
        })
    }

    fn str(&mut self) -> Option<&'a str> {
        let len = usize::try_from(self.u64()?).ok()?;
        let bytes = self.0.get(..len)?;
        self.0 = &self.0[len..];
        std::str::from_utf8(bytes).ok()
    }

    fn option_str(&mut self) -> Option<Option<&'a str>> {
        match self.bytes::<1>()? {
            [0] => Some(None),
            [1] => self.str().map(Some),
            _ => None,
        }
    }
}

//! Property tests of the parsers of bytes a broker (or whoever wrote the log) sent: the record
//! set splitter, the records reader and every decompressor, on generated, truncated and
//! corrupted input. Never a panic, and never a buffer grown past
//! [`compression::MAX_DECOMPRESSED_BYTES`] by a length read from the input.

use std::io::Write;

use proptest::prelude::*;

use crate::compression::{self, DecompressError, MAX_DECOMPRESSED_BYTES};
use crate::records::Compression;
use crate::records::tests::{TestRecord, batch, header, records_section};
use crate::records::{self, RawBatch, Records};

/// Every codec Kafka defines, and one it does not.
const CODECS: [Compression; 6] = [
    Compression::None,
    Compression::Gzip,
    Compression::Snappy,
    Compression::Lz4,
    Compression::Zstd,
    Compression::Unknown(7),
];

/// Reads every batch of `set` and every record of each, as the fetcher does: the outcome is
/// whatever it is, but it comes back.
fn read_all(set: &[u8]) {
    for raw in records::batches(set).take(10_000) {
        let Ok(RawBatch::V2 {
            header, records, ..
        }) = raw
        else {
            continue;
        };
        let mut plain = Vec::new();
        let section = match header.compression() {
            Compression::None => records,
            codec => match compression::decompress(codec, records, &mut plain) {
                Ok(()) => &plain,
                Err(_) => continue,
            },
        };
        for record in Records::new(header, section).take(100_000) {
            if record.is_err() {
                break;
            }
        }
    }
}

/// A valid record set: `count` records with generated keys and values, compressed with
/// `codec` (attributes 0-4).
fn record_set(values: &[Vec<u8>], codec: i16) -> Vec<u8> {
    let records: Vec<TestRecord<'_>> = (values.iter().enumerate())
        .map(|(i, v)| (i as i32, i as i64, Some(&b"k"[..]), Some(v.as_slice())))
        .collect();
    let plain = records_section(&records);
    let section = match codec {
        1 => {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(&plain).expect("in memory");
            gz.finish().expect("in memory")
        }
        2 => snap::raw::Encoder::new()
            .compress_vec(&plain)
            .expect("in memory"),
        3 => {
            let mut lz4 = lz4_flex::frame::FrameEncoder::new(Vec::new());
            lz4.write_all(&plain).expect("in memory");
            lz4.finish().expect("in memory")
        }
        _ => plain,
    };
    let count = values.len() as i32;
    batch(
        &header(0, count, if codec == 4 { 0 } else { codec }),
        &section,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    #[test]
    fn arbitrary_record_sets_never_panic(set in prop::collection::vec(any::<u8>(), 0..2_000)) {
        read_all(&set);
    }

    /// A valid record set, cut anywhere or with bytes changed: read without a panic.
    #[test]
    fn damaged_record_sets_never_panic(
        values in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 1..20),
        codec in 0i16..4,
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..), 1..4),
    ) {
        let set = record_set(&values, codec);
        // Intact, it reads back whole.
        let mut read = 0;
        for raw in records::batches(&set) {
            let Ok(RawBatch::V2 { header, records, .. }) = raw else { panic!("a v2 batch") };
            let mut plain = Vec::new();
            let section = match header.compression() {
                Compression::None => records,
                codec => {
                    compression::decompress(codec, records, &mut plain).expect("decompresses");
                    &plain
                }
            };
            for record in Records::new(header, section) {
                prop_assert_eq!(record.expect("a record").value, Some(values[read].as_slice()));
                read += 1;
            }
        }
        prop_assert_eq!(read, values.len());
        read_all(&set[..cut.index(set.len())]);
        let mut corrupted = set.clone();
        for (at, xor) in flips {
            let at = at.index(corrupted.len());
            corrupted[at] ^= xor;
        }
        read_all(&corrupted);
    }

    /// Every decompressor, on arbitrary bytes (with each codec's magic up front, so that the
    /// decoders get past their first check): an error or data, within the cap.
    #[test]
    fn decompressors_never_panic_on_arbitrary_input(
        codec in prop::sample::select(CODECS.to_vec()),
        magic in prop::sample::select(vec![
            &b""[..],
            &b"\x1f\x8b\x08\x00"[..],
            &b"\x82SNAPPY\x00"[..],
            &b"\x04\x22\x4d\x18"[..],
            &b"\x28\xb5\x2f\xfd"[..],
        ]),
        rest in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let input: Vec<u8> = magic.iter().copied().chain(rest).collect();
        let mut out = Vec::new();
        let _ = compression::decompress(codec, &input, &mut out);
        prop_assert!(out.len() <= MAX_DECOMPRESSED_BYTES);
    }
}

/// Lengths read from the input never size an allocation past the cap: a snappy block that
/// claims 4 GiB is refused before any buffer grows, raw or in Java's framing; a framing cut
/// inside its header is an error, not a panic.
#[test]
fn a_snappy_block_claiming_gigabytes_is_refused_before_allocating() {
    let claims_4_gib = [0xff, 0xff, 0xff, 0xff, 0x0f, 0x00];
    let mut out = Vec::new();
    let refused = compression::decompress(Compression::Snappy, &claims_4_gib, &mut out);
    assert!(
        matches!(refused, Err(DecompressError::TooLarge { .. })),
        "{refused:?}"
    );
    assert!(out.capacity() < 1024, "grew to {}", out.capacity());

    let mut framed = b"\x82SNAPPY\x00\x00\x00\x00\x01\x00\x00\x00\x01".to_vec();
    framed.extend_from_slice(&(claims_4_gib.len() as u32).to_be_bytes());
    framed.extend_from_slice(&claims_4_gib);
    let refused = compression::decompress(Compression::Snappy, &framed, &mut out);
    assert!(
        matches!(refused, Err(DecompressError::TooLarge { .. })),
        "{refused:?}"
    );

    let cut = compression::decompress(Compression::Snappy, b"\x82SNAPPY\x00\x00", &mut out);
    assert!(
        matches!(cut, Err(DecompressError::Corrupt { .. })),
        "{cut:?}"
    );
}

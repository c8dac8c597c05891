//! Decompressing a batch's records section: gzip, Snappy (raw or Java's xerial framing), LZ4
//! frames and Zstandard frames: every codec Kafka defines. A codec id Kafka does not define is
//! an error naming it (the aggregator dead-letters such a batch whole, as it does any batch it
//! cannot read). And compressing one, for the appender: LZ4 frames or gzip.

use std::io::{BufRead, Read, Write};

use crate::config::Codec;
use crate::records::Compression;

/// `section` compressed with `codec`, with the batch attributes that name it; `None` for
/// [`Codec::None`], or when compressing failed or saved nothing (the batch then goes plain).
pub fn compress(codec: Codec, section: &[u8]) -> Option<(i16, Vec<u8>)> {
    match codec {
        Codec::None => None,
        Codec::Lz4 => {
            let mut encoder =
                lz4_flex::frame::FrameEncoder::new(Vec::with_capacity(section.len() / 2));
            encoder
                .write_all(section)
                .ok()
                .and_then(|()| encoder.finish().ok())
                .map(|out| (3i16, out))
        }
        Codec::Gzip => {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder
                .write_all(section)
                .ok()
                .and_then(|()| encoder.finish().ok())
                .map(|out| (1i16, out))
        }
    }
    .filter(|(_, out)| out.len() < section.len())
}

/// A records section that could not be decompressed.
#[derive(Debug, thiserror::Error)]
pub enum DecompressError {
    /// A codec this reader does not decompress.
    #[error("record batches compressed with {0:?} are not supported")]
    Unsupported(Compression),
    /// The data decompresses to more than [`MAX_DECOMPRESSED_BYTES`].
    #[error("{codec:?} data decompresses to more than {MAX_DECOMPRESSED_BYTES} bytes")]
    TooLarge {
        /// The codec.
        codec: Compression,
    },
    /// The data did not decompress.
    #[error("{codec:?} decompression failed: {message}")]
    Corrupt {
        /// The codec.
        codec: Compression,
        /// What the decoder said.
        message: String,
    },
}

/// Java's snappy framing (`SnappyOutputStream`): this magic, two version words, then blocks of
/// `int32` length and raw snappy data.
const XERIAL_MAGIC: &[u8] = b"\x82SNAPPY\x00";

/// The most one records section may decompress to: 256 MiB, far above what Kafka's limits let
/// a producer compress into one batch of JSON events (a 1 MiB batch at 20:1), yet a bound on
/// what a decompression bomb can make the reader hold.
pub const MAX_DECOMPRESSED_BYTES: usize = 256 * 1024 * 1024;

/// Reads `reader` to its end into `out`, refusing to grow `out` past `limit` bytes: for
/// decoders that only implement `Read` (gzip, zstd); [`copy_capped`] for those with a buffer of
/// their own.
fn read_capped(
    reader: impl Read,
    out: &mut Vec<u8>,
    limit: usize,
    codec: Compression,
) -> Result<(), DecompressError> {
    let room = limit.saturating_sub(out.len()) as u64;
    reader
        .take(room + 1)
        .read_to_end(out)
        .map_err(|e| DecompressError::Corrupt {
            codec,
            message: e.to_string(),
        })?;
    if out.len() > limit {
        return Err(DecompressError::TooLarge { codec });
    }
    Ok(())
}

/// Copies what `reader` decompresses, buffer by buffer, to the end of `out`, refusing to grow
/// `out` past `limit` bytes: as [`read_capped`], without `read_to_end`'s zeroing of the room it
/// reads into (a tenth of the fetcher's time on an LZ4 catch-up).
fn copy_capped(
    mut reader: impl BufRead,
    out: &mut Vec<u8>,
    limit: usize,
    codec: Compression,
) -> Result<(), DecompressError> {
    loop {
        let got = match reader.fill_buf() {
            Ok(got) => got,
            // As `read_to_end` does.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(DecompressError::Corrupt {
                    codec,
                    message: e.to_string(),
                });
            }
        };
        if got.is_empty() {
            return Ok(());
        }
        if got.len() > limit.saturating_sub(out.len()) {
            return Err(DecompressError::TooLarge { codec });
        }
        out.extend_from_slice(got);
        let n = got.len();
        reader.consume(n);
    }
}

/// Decompresses `input`, compressed with `codec`, appending to `out` (on an error, `out` may
/// hold part of it: truncate it back), at most [`MAX_DECOMPRESSED_BYTES`] of it: no length
/// read from `input` sizes an allocation beyond that.
pub fn decompress(
    codec: Compression,
    input: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), DecompressError> {
    let corrupt = |e: &dyn std::fmt::Display| DecompressError::Corrupt {
        codec,
        message: e.to_string(),
    };
    let limit = out.len().saturating_add(MAX_DECOMPRESSED_BYTES);
    // A snappy block says how long it decompresses to: checked before the buffer grows to it.
    let snappy_len = |block: &[u8], out: &Vec<u8>| {
        let size = snap::raw::decompress_len(block).map_err(|e| corrupt(&e))?;
        match out.len().checked_add(size) {
            Some(end) if end <= limit => Ok(size),
            _ => Err(DecompressError::TooLarge { codec }),
        }
    };
    match codec {
        Compression::None => out.extend_from_slice(input),
        Compression::Gzip => {
            read_capped(flate2::read::MultiGzDecoder::new(input), out, limit, codec)?
        }
        Compression::Lz4 => {
            copy_capped(lz4_flex::frame::FrameDecoder::new(input), out, limit, codec)?;
        }
        Compression::Snappy if input.starts_with(XERIAL_MAGIC) => {
            let mut blocks = input
                .get(XERIAL_MAGIC.len() + 8..)
                .ok_or_else(|| corrupt(&"a cut-off xerial header"))?;
            let mut decoder = snap::raw::Decoder::new();
            while !blocks.is_empty() {
                if blocks.len() < 4 {
                    return Err(corrupt(&"a cut-off xerial block length"));
                }
                let (len, rest) = blocks.split_at(4);
                let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
                if rest.len() < len {
                    return Err(corrupt(&"a cut-off xerial block"));
                }
                let (block, rest) = rest.split_at(len);
                let start = out.len();
                let size = snappy_len(block, out)?;
                out.resize(start + size, 0);
                decoder
                    .decompress(block, &mut out[start..])
                    .map_err(|e| corrupt(&e))?;
                blocks = rest;
            }
        }
        Compression::Snappy => {
            let start = out.len();
            let size = snappy_len(input, out)?;
            out.resize(start + size, 0);
            snap::raw::Decoder::new()
                .decompress(input, &mut out[start..])
                .map_err(|e| corrupt(&e))?;
        }
        Compression::Zstd => {
            let mut frames = input;
            while !frames.is_empty() {
                let decoder = ruzstd::decoding::StreamingDecoder::new(&mut frames)
                    .map_err(|e| corrupt(&e))?;
                read_capped(decoder, out, limit, codec)?;
            }
        }
        Compression::Unknown(_) => return Err(DecompressError::Unsupported(codec)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn sample() -> Vec<u8> {
        (0..10_000u32)
            .flat_map(|i| format!("{{\"counter\":\"likes:post:{}\"}}", i % 97).into_bytes())
            .collect()
    }

    #[test]
    fn every_supported_codec_round_trips() {
        let data = sample();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&data).expect("as written");
        let gzip = gz.finish().expect("as written");
        let mut lz = lz4_flex::frame::FrameEncoder::new(Vec::new());
        lz.write_all(&data).expect("as written");
        let lz4 = lz.finish().expect("as written");
        let raw_snappy = snap::raw::Encoder::new()
            .compress_vec(&data)
            .expect("as written");
        let mut xerial = XERIAL_MAGIC.to_vec();
        xerial.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1]);
        for chunk in data.chunks(4_096) {
            let block = snap::raw::Encoder::new()
                .compress_vec(chunk)
                .expect("as written");
            xerial.extend_from_slice(&(block.len() as u32).to_be_bytes());
            xerial.extend_from_slice(&block);
        }
        let zstd = ruzstd::encoding::compress_to_vec(
            &data[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        // Two frames back to back read as one stream, as Kafka allows.
        let half = data.len() / 2;
        let mut two_frames = ruzstd::encoding::compress_to_vec(
            &data[..half],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        two_frames.extend(ruzstd::encoding::compress_to_vec(
            &data[half..],
            ruzstd::encoding::CompressionLevel::Fastest,
        ));
        for (codec, input) in [
            (Compression::Zstd, &zstd),
            (Compression::Zstd, &two_frames),
            (Compression::None, &data),
            (Compression::Gzip, &gzip),
            (Compression::Lz4, &lz4),
            (Compression::Snappy, &raw_snappy),
            (Compression::Snappy, &xerial),
        ] {
            // It appends.
            let mut out = vec![1, 2, 3];
            decompress(codec, input, &mut out).expect("as written");
            assert!(out[..3] == [1, 2, 3] && out[3..] == data, "{codec:?}");
        }
    }

    /// LZ4 is copied out buffer by buffer: past the limit it is refused, `out` held within it.
    #[test]
    fn lz4_past_the_limit_is_refused_within_it() {
        let data = sample();
        let mut lz = lz4_flex::frame::FrameEncoder::new(Vec::new());
        lz.write_all(&data).expect("as written");
        let lz4 = lz.finish().expect("as written");
        let decoder = || lz4_flex::frame::FrameDecoder::new(&lz4[..]);
        let mut out = b"before".to_vec();
        let limit = out.len() + data.len() - 1;
        let refused = copy_capped(decoder(), &mut out, limit, Compression::Lz4);
        assert!(
            matches!(refused, Err(DecompressError::TooLarge { .. })),
            "{refused:?}"
        );
        assert!(out.len() <= limit, "{} bytes held", out.len());
        let mut out = b"before".to_vec();
        copy_capped(decoder(), &mut out, limit + 1, Compression::Lz4).expect("just fits");
        assert_eq!(&out[6..], &data[..]);
    }

    #[test]
    fn corrupt_and_unsupported_input_are_errors() {
        let mut out = Vec::new();
        assert!(matches!(
            decompress(Compression::Lz4, b"not lz4 at all", &mut out),
            Err(DecompressError::Corrupt {
                codec: Compression::Lz4,
                ..
            })
        ));
        assert!(matches!(
            decompress(Compression::Zstd, b"not zstd", &mut out),
            Err(DecompressError::Corrupt {
                codec: Compression::Zstd,
                ..
            })
        ));
        assert!(matches!(
            decompress(Compression::Unknown(6), b"", &mut out),
            Err(DecompressError::Unsupported(Compression::Unknown(6)))
        ));
        let mut xerial = XERIAL_MAGIC.to_vec();
        xerial.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 9, 1]);
        assert!(decompress(Compression::Snappy, &xerial, &mut out).is_err());
    }
}

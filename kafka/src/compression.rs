//! Decompressing a batch's records section: gzip, Snappy (raw or Java's xerial framing), LZ4
//! frames and Zstandard frames: every codec Kafka defines. A codec id Kafka does not define is
//! an error naming it (the aggregator dead-letters such a batch whole, as it does any batch it
//! cannot read). And compressing one, for the appender: LZ4 frames or gzip.

use std::hash::Hasher;
use std::io::{Read, Write};
use std::ops::RangeInclusive;

use crate::config::Codec;
use crate::records::Compression;
use crate::wire::{Malformed, Reader};

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
/// decoders that only implement `Read` (gzip, zstd).
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

/// The magic number of an LZ4 frame, and the range of those of skippable frames (LZ4's frame
/// format, 1.6).
const LZ4_MAGIC: u32 = 0x184D_2204;
const LZ4_SKIPPABLE: RangeInclusive<u32> = 0x184D_2A50..=0x184D_2A5F;

/// How far back a linked block may refer into the frame's earlier output.
const LZ4_WINDOW: usize = 64 * 1024;

thread_local! {
    /// Where an LZ4 block is decompressed before it is copied to its batch's output: as large
    /// as the largest block this thread has met (64 KiB for librdkafka's and Java's producers,
    /// at most 4 MiB), zeroed once. Decompressing into the output itself meant zeroing room for
    /// the largest block the frame allows before every block: the memset took 10% of the
    /// aggregator's CPU on the bench's LZ4 catch-up of likes, twice what decompressing did.
    static LZ4_ROOM: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Decompresses the LZ4 frames of `input`, back to back, into `out`, refusing to grow `out`
/// past `limit` bytes (on an error `out` is as it was). Each block is decompressed into
/// [`LZ4_ROOM`] and copied to `out`: a frame decoder of its own copies the input into a buffer,
/// decompresses into another and copies that out, with both buffers made per batch, which was
/// most of an LZ4 catch-up's decompression time.
fn lz4_frames(input: &[u8], out: &mut Vec<u8>, limit: usize) -> Result<(), DecompressError> {
    let start = out.len();
    let mut r = Reader::new(input);
    while !r.is_empty() {
        if let Err(e) = lz4_frame(&mut r, out, limit) {
            out.truncate(start);
            return Err(e);
        }
    }
    Ok(())
}

fn lz4_corrupt(message: impl Into<String>) -> DecompressError {
    DecompressError::Corrupt {
        codec: Compression::Lz4,
        message: message.into(),
    }
}

/// LZ4 data cut off.
fn cut(e: Malformed) -> DecompressError {
    lz4_corrupt(e.to_string())
}

/// One frame (or skippable frame) from `r`, appended to `out`.
fn lz4_frame(r: &mut Reader<'_>, out: &mut Vec<u8>, limit: usize) -> Result<(), DecompressError> {
    let magic = r.u32_le("an LZ4 frame's magic number").map_err(cut)?;
    if LZ4_SKIPPABLE.contains(&magic) {
        let len = r.u32_le("a skippable frame's length").map_err(cut)?;
        r.skip(len as usize, "a skippable frame").map_err(cut)?;
        return Ok(());
    }
    if magic != LZ4_MAGIC {
        return Err(lz4_corrupt(format!(
            "not an LZ4 frame (magic {magic:#010x})"
        )));
    }
    let mut descriptor = r.clone();
    let [flags, bd] = r.take(2, "an LZ4 frame descriptor").map_err(cut)? else {
        unreachable!("two bytes taken")
    };
    let (flags, bd) = (*flags, *bd);
    if flags >> 6 != 1 || flags & 0b10 != 0 || bd & 0b1000_1111 != 0 {
        return Err(lz4_corrupt(format!(
            "an LZ4 frame descriptor of another version or with reserved bits set ({flags:#04x} {bd:#04x})"
        )));
    }
    let independent = flags & 0x20 != 0;
    let block_checksums = flags & 0x10 != 0;
    let content_size = (flags & 0x08 != 0)
        .then(|| r.u64_le("an LZ4 frame's content size"))
        .transpose()
        .map_err(cut)?;
    let content_checksum = flags & 0x04 != 0;
    if flags & 0x01 != 0 {
        return Err(lz4_corrupt(
            "LZ4 frames with a dictionary are not supported",
        ));
    }
    let max_block = match (bd >> 4) & 0b111 {
        4 => 64 << 10,
        5 => 256 << 10,
        6 => 1 << 20,
        7 => 4 << 20,
        other => return Err(lz4_corrupt(format!("an LZ4 block size id of {other}"))),
    };
    // The descriptor read again whole, for its checksum.
    let header =
        (descriptor.take(r.position() - descriptor.position(), "the descriptor")).map_err(cut)?;
    let checksum = r.take(1, "an LZ4 frame header's checksum").map_err(cut)?[0];
    if (twox_hash::XxHash32::oneshot(0, header) >> 8) as u8 != checksum {
        return Err(lz4_corrupt(
            "the LZ4 frame header's checksum does not match",
        ));
    }
    let frame_start = out.len();
    let mut content = content_checksum.then(|| twox_hash::XxHash32::with_seed(0));
    loop {
        let word = r.u32_le("an LZ4 block's size").map_err(cut)?;
        if word == 0 {
            break;
        }
        let (len, stored) = ((word & 0x7FFF_FFFF) as usize, word & 0x8000_0000 != 0);
        if len > max_block {
            return Err(lz4_corrupt("an LZ4 block larger than its frame allows"));
        }
        let block = r.take(len, "an LZ4 block").map_err(cut)?;
        if block_checksums
            && twox_hash::XxHash32::oneshot(0, block)
                != r.u32_le("an LZ4 block's checksum").map_err(cut)?
        {
            return Err(lz4_corrupt("an LZ4 block's checksum does not match"));
        }
        let at = out.len();
        if stored {
            if len > limit.saturating_sub(at) {
                return Err(DecompressError::TooLarge {
                    codec: Compression::Lz4,
                });
            }
            out.extend_from_slice(block);
        } else {
            let room = limit.saturating_sub(at);
            let dict = (!independent && at > frame_start)
                .then(|| frame_start.max(at.saturating_sub(LZ4_WINDOW))..at);
            LZ4_ROOM.with_borrow_mut(|scratch| {
                if scratch.len() < max_block {
                    scratch.resize(max_block, 0);
                }
                let scratch = &mut scratch[..max_block];
                let n = match dict {
                    None => lz4_flex::block::decompress_into(block, scratch),
                    Some(dict) => {
                        lz4_flex::block::decompress_into_with_dict(block, scratch, &out[dict])
                    }
                }
                .map_err(|e| lz4_corrupt(e.to_string()))?;
                if n > room {
                    return Err(DecompressError::TooLarge {
                        codec: Compression::Lz4,
                    });
                }
                out.extend_from_slice(&scratch[..n]);
                Ok(())
            })?;
        }
        if let Some(content) = &mut content {
            content.write(&out[at..]);
        }
    }
    if content_size.is_some_and(|size| size != (out.len() - frame_start) as u64) {
        return Err(lz4_corrupt(
            "an LZ4 frame's content is not the size its header gives",
        ));
    }
    if let Some(content) = content
        && content.finish_32() != r.u32_le("an LZ4 frame's content checksum").map_err(cut)?
    {
        return Err(lz4_corrupt(
            "an LZ4 frame's content checksum does not match",
        ));
    }
    Ok(())
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
        Compression::Lz4 => lz4_frames(input, out, limit)?,
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

    /// `data` as one LZ4 frame of `info`'s kind.
    fn lz4_frame_of(data: &[u8], info: lz4_flex::frame::FrameInfo) -> Vec<u8> {
        let mut lz = lz4_flex::frame::FrameEncoder::with_frame_info(info, Vec::new());
        lz.write_all(data).expect("as written");
        lz.finish().expect("as written")
    }

    /// Every kind of frame the format allows (linked or independent blocks, each block size,
    /// block and content checksums, the content size, incompressible blocks stored as they
    /// are) decompresses to what lz4_flex's own frame decoder gives.
    #[test]
    fn lz4_frames_of_every_kind_decompress_as_lz4_flex_reads_them() {
        use lz4_flex::frame::{BlockMode, BlockSize, FrameInfo};
        // Compressible text, then noise that LZ4 stores as it is, past several 64 KiB blocks.
        let mut data = sample();
        let mut x = 0x2545_f491_u32;
        data.extend((0..300_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        }));
        data.extend(sample());
        for mode in [BlockMode::Independent, BlockMode::Linked] {
            for size in [
                BlockSize::Max64KB,
                BlockSize::Max256KB,
                BlockSize::Max1MB,
                BlockSize::Max4MB,
            ] {
                for (block_checksums, content_checksum, content_size) in
                    [(false, false, None), (true, true, Some(data.len() as u64))]
                {
                    let info = FrameInfo::new()
                        .block_mode(mode)
                        .block_size(size)
                        .block_checksums(block_checksums)
                        .content_checksum(content_checksum)
                        .content_size(content_size);
                    let frame = lz4_frame_of(&data, info);
                    let mut reference = Vec::new();
                    lz4_flex::frame::FrameDecoder::new(&frame[..])
                        .read_to_end(&mut reference)
                        .expect("lz4_flex reads it");
                    assert!(reference == data);
                    let mut out = b"before".to_vec();
                    decompress(Compression::Lz4, &frame, &mut out).expect("as written");
                    assert!(
                        out[..6] == *b"before" && out[6..] == data,
                        "{mode:?} {size:?}"
                    );
                }
            }
        }
    }

    /// Frames back to back read as one stream, skippable frames are skipped, and a frame cut
    /// anywhere, or with a byte changed under a checksum, is an error that leaves `out` as it
    /// was.
    #[test]
    fn lz4_frames_follow_each_other_and_damage_is_an_error() {
        use lz4_flex::frame::FrameInfo;
        let data = sample();
        let checked = FrameInfo::new()
            .block_checksums(true)
            .content_checksum(true);
        let one = lz4_frame_of(&data[..1000], checked);
        let mut stream = one.clone();
        stream.extend_from_slice(&0x184D_2A53_u32.to_le_bytes());
        stream.extend_from_slice(&3u32.to_le_bytes());
        stream.extend_from_slice(b"abc");
        stream.extend(lz4_frame_of(&data[1000..], FrameInfo::new()));
        let mut out = Vec::new();
        decompress(Compression::Lz4, &stream, &mut out).expect("as written");
        assert!(out == data);
        for cut in 1..one.len() {
            let mut out = b"before".to_vec();
            let refused = decompress(Compression::Lz4, &one[..cut], &mut out);
            assert!(refused.is_err() && out == b"before", "cut at {cut}");
        }
        for at in 4..one.len() {
            let mut damaged = one.clone();
            damaged[at] ^= 0x10;
            let mut out = b"before".to_vec();
            let refused = decompress(Compression::Lz4, &damaged, &mut out);
            assert!(refused.is_err() && out == b"before", "byte {at} changed");
        }
    }

    /// Past the limit LZ4 is refused, with `out` left as it was.
    #[test]
    fn lz4_past_the_limit_is_refused_within_it() {
        let data = sample();
        let lz4 = lz4_frame_of(&data, lz4_flex::frame::FrameInfo::new());
        let mut out = b"before".to_vec();
        let limit = out.len() + data.len() - 1;
        let refused = lz4_frames(&lz4, &mut out, limit);
        assert!(
            matches!(refused, Err(DecompressError::TooLarge { .. })),
            "{refused:?}"
        );
        assert_eq!(out, b"before");
        lz4_frames(&lz4, &mut out, limit + 1).expect("just fits");
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

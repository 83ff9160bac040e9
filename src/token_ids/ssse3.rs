//! Packed token ids decoded with SSSE3, four values a step.
//!
//! Why: after the SWAR decoder (41 instructions per id) the 32K-token
//! `Score`'s largest CPU item was still this decode, ~20% of the service's
//! CPU per request. A token id takes 1 to 3 bytes (vocabularies are under
//! 2^21), so the first 12 bytes of a window always hold up to four whole
//! ids: their continuation bits (one `movemask`) name the ids' lengths
//! through a 4 KB table, one byte shuffle (`pshufb`) puts each id's bytes in
//! a 32-bit lane, and three masks pack the 7-bit groups of all four lanes
//! at once. Nothing branches on a length. A longer varint (a 4 or 5-byte
//! value, or a malformed one) is read by the scalar `varint`, which gives
//! exactly the scalar decoder's value or error.

use std::arch::x86_64::{
    __m128i, _mm_and_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi32, _mm_shuffle_epi8,
    _mm_srli_epi32,
};

/// Values a step decodes at most, and the window bytes they come from.
const LANES: usize = 4;
const WINDOW: usize = 12;

/// A step's shape: the lengths (1 to 3 bytes) of the whole varints at the
/// window's start, as base-4 digits, lowest first (a 0 digit ends them):
/// `3 + 2 * 4` is a 3-byte id followed by a 2-byte one. 0 means the first
/// varint is longer than 3 bytes.
type Shape = usize;

/// Each window's shape (low byte) and the bytes its ids take (high byte),
/// by its first 12 continuation bits: one load on the chain from one step's
/// offset to the next, which bounds the loop (a second table for the bytes
/// made each step wait on two loads).
static STEP: [u16; 1 << WINDOW] = steps();

/// Per shape: where each lane's bytes come from (0x80: a zero byte).
static SHUFFLE: [[u8; 16]; 256] = shuffles();

/// Per shape: values decoded.
static VALUES: [u8; 256] = counts(false);

const fn steps() -> [u16; 1 << WINDOW] {
    let bytes = counts(true);
    let mut table = [0u16; 1 << WINDOW];
    let mut bits = 0;
    while bits < 1 << WINDOW {
        let (mut shape, mut pos, mut lane) = (0, 0, 0);
        while lane < LANES {
            // The varint at `pos` ends at the first byte without a
            // continuation bit.
            let mut end = pos;
            while end < WINDOW && bits >> end & 1 == 1 {
                end += 1;
            }
            let len = end + 1 - pos;
            if end >= WINDOW || len > 3 {
                break;
            }
            shape += len << (2 * lane);
            pos = end + 1;
            lane += 1;
        }
        table[bits] = (bytes[shape] as u16) << 8 | shape as u16;
        bits += 1;
    }
    table
}

const fn shuffles() -> [[u8; 16]; 256] {
    let mut table = [[0x80u8; 16]; 256];
    let mut shape = 0;
    while shape < 256 {
        let (mut pos, mut lane) = (0, 0);
        while lane < LANES {
            let len = shape >> (2 * lane) & 3;
            if len == 0 {
                break;
            }
            let mut b = 0;
            while b < len {
                table[shape][4 * lane + b] = (pos + b) as u8;
                b += 1;
            }
            pos += len;
            lane += 1;
        }
        shape += 1;
    }
    table
}

const fn counts(bytes: bool) -> [u8; 256] {
    let mut table = [0u8; 256];
    let mut shape = 0;
    while shape < 256 {
        let (mut n, mut lane) = (0, 0);
        while lane < LANES {
            let len = shape >> (2 * lane) & 3;
            if len == 0 {
                break;
            }
            n += if bytes { len } else { 1 };
            lane += 1;
        }
        table[shape] = n as u8;
        shape += 1;
    }
    table
}

/// Appends the varints of `body` up to where fewer than 16 bytes are left;
/// returns that offset (a varint boundary), or `None` if a varint there is
/// malformed. The caller decodes the rest.
#[target_feature(enable = "ssse3")]
pub(super) fn decode(body: &[u8], ids: &mut Vec<u32>) -> Option<usize> {
    // Values gathered here and appended in runs (see `decode_packed`).
    let mut values = [0u32; 64 + LANES];
    let mut n = 0;
    let window = |at: usize| -> __m128i {
        let bytes: [u8; 16] = body[at..at + 16].try_into().expect("16 bytes");
        bytemuck::cast(bytes)
    };
    // Decodes the ids at `$at`, whose continuation bits are the low bits of
    // `$bits`; evaluates to the bytes they took. A macro, not a function: a
    // `#[target_feature]` function cannot be forced inline, and a call per
    // step doubled the instructions per id.
    macro_rules! step {
        ($at:expr, $bits:expr) => {{
            let at = $at;
            let step = STEP[$bits & ((1 << WINDOW) - 1)];
            let shape: Shape = usize::from(step as u8);
            let used = if shape == 0 {
                let (value, used) = super::varint(&body[at..])?;
                values[n] = value as u32;
                n += 1;
                used
            } else {
                let x = _mm_shuffle_epi8(window(at), bytemuck::cast(SHUFFLE[shape]));
                // Each lane holds one id's bytes, low first: drop the
                // continuation bits and close the gaps they leave.
                let packed = _mm_or_si128(
                    _mm_or_si128(
                        _mm_and_si128(x, _mm_set1_epi32(0x7f)),
                        _mm_and_si128(_mm_srli_epi32(x, 1), _mm_set1_epi32(0x3f80)),
                    ),
                    _mm_and_si128(_mm_srli_epi32(x, 2), _mm_set1_epi32(0x1f_c000)),
                );
                let lanes: [u32; LANES] = bytemuck::cast(packed);
                values[n..n + LANES].copy_from_slice(&lanes);
                n += usize::from(VALUES[shape]);
                usize::from(step >> 8)
            };
            if n > 64 - LANES {
                ids.extend_from_slice(&values[..n]);
                n = 0;
            }
            used
        }};
    }
    let mut i = 0;
    // The continuation bits of 64 bytes first, then the steps through them:
    // a step's next offset then comes from bits already in a register, not
    // from a load of the window at its own offset (that chain of two
    // dependent loads per step bounded the loop).
    while i + 64 + 16 <= body.len() {
        let mut bits = 0u64;
        for k in 0..4 {
            bits |= u64::from(_mm_movemask_epi8(window(i + 16 * k)) as u16) << (16 * k);
        }
        let mut at = 0;
        while at <= 64 - WINDOW {
            at += step!(i + at, (bits >> at) as usize);
        }
        i += at;
    }
    while i + 16 <= body.len() {
        let bits = _mm_movemask_epi8(window(i)) as u16;
        i += step!(i, usize::from(bits));
    }
    ids.extend_from_slice(&values[..n]);
    Some(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_window_shape_is_the_lengths_of_its_leading_whole_ids() {
        for (bits, step) in STEP.iter().enumerate() {
            let shape = usize::from(*step as u8);
            // Rebuild the ids' lengths from the bits, one byte at a time.
            let mut want = Vec::new();
            let mut len = 0;
            for k in 0..WINDOW {
                len += 1;
                if bits >> k & 1 == 0 {
                    if len > 3 || want.len() == LANES {
                        break;
                    }
                    want.push(len);
                    len = 0;
                }
            }
            let got: Vec<usize> = (0..LANES)
                .map(|lane| shape >> (2 * lane) & 3)
                .take_while(|len| *len > 0)
                .collect();
            assert_eq!(got, want, "bits {bits:012b}");
            assert_eq!(usize::from(VALUES[shape]), want.len());
            assert_eq!(usize::from(step >> 8), want.iter().sum::<usize>());
        }
    }
}

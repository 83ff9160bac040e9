//! `kvindexer.v1.TokenIds`, written by hand (the generated code refers to
//! it through `extern_path`, see `build.rs`) for one reason: decoding.
//!
//! A 32K-token Score is ~100 KB of packed varints. prost decodes a packed
//! field one value at a time through its generic field merge and grows the
//! vector as it goes: half of the service's CPU per such request went there.
//! Here a well-formed packed field is decoded in one tight loop over the
//! slice into a vector reserved up front (four ids a step with SSSE3, see
//! `ssse3`; the scalar loops below for other CPUs and a field's last 16
//! bytes); anything else (a field split
//! across buffers, an unpacked encoding, a malformed varint) goes to prost's
//! own decoder, so the accepted inputs, the results and the errors stay
//! prost's.

use bytes::{Buf, BufMut};
use prost::encoding::{self, DecodeContext, WireType};
use prost::DecodeError;

#[derive(Clone, PartialEq, Eq, Hash, Default, Debug)]
pub struct TokenIds {
    pub ids: Vec<u32>,
}

const IDS: u32 = 1;

impl prost::Message for TokenIds {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        encoding::uint32::encode_packed(IDS, &self.ids, buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if tag != IDS {
            return encoding::skip_field(wire_type, tag, buf, ctx);
        }
        if wire_type == WireType::LengthDelimited {
            if let Some(consumed) = merge_packed(buf.chunk(), &mut self.ids) {
                buf.advance(consumed);
                return Ok(());
            }
        }
        encoding::uint32::merge_repeated(wire_type, &mut self.ids, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        encoding::uint32::encoded_len_packed(IDS, &self.ids)
    }

    fn clear(&mut self) {
        self.ids.clear();
    }
}

/// Decodes a length-delimited packed field wholly inside `chunk` into
/// `ids`; returns the bytes it took, or `None` (and `ids` as it was) if the
/// field is not all there or not well formed.
fn merge_packed(chunk: &[u8], ids: &mut Vec<u32>) -> Option<usize> {
    let mut rest = chunk;
    let len = encoding::decode_varint(&mut rest).ok()?;
    let header = chunk.len() - rest.len();
    let body = rest.get(..usize::try_from(len).ok()?)?;
    let before = ids.len();
    // Decoded into a local vector (its length and capacity stay in
    // registers), handed back whole or not at all.
    let mut out = std::mem::take(ids);
    // Token ids take 1 to 3 bytes (vocabularies are < 2^21): reserve for
    // 2, growing at most once for larger ids.
    out.reserve(body.len() / 2 + 1);
    let ok = decode_packed(body, &mut out);
    if !ok {
        out.truncate(before);
    }
    *ids = out;
    ok.then_some(header + body.len())
}

/// Appends the varints of a packed field's body; false if one is malformed
/// or cut short. Inlined into `merge_packed`, where `ids` is a local.
#[inline(always)]
fn decode_packed(body: &[u8], ids: &mut Vec<u32>) -> bool {
    let Some(mut i) = decode_simd(body, ids) else {
        return false;
    };
    // One block's values, appended to `ids` together: a push per value
    // kept the vector's length and capacity on the stack (7 of the loop's
    // 38 instructions per value went to them); an index into a local array
    // stays in a register.
    let mut values = [0u32; 64];
    // 64 bytes at a time: first where every varint in them ends (bytes with
    // the top bit clear), then each value from an 8-byte load at its start.
    // Nothing waits on a decoded length, so random ids (1 to 3 bytes each)
    // cost no branch mispredictions and the loads overlap.
    while i + 72 <= body.len() {
        // The 64 bytes and the 8 after them, so loads need no bounds check.
        let block: &[u8; 72] = body[i..i + 72].try_into().expect("72 bytes");
        let word_in = |at: usize| word_at(block, at);
        let mut ends = 0u64;
        for k in 0..8 {
            ends |= stop_bits(word_in(8 * k)) << (8 * k);
        }
        if ends == 0 {
            break;
        }
        let mut start = 0;
        let mut n = 0;
        while ends != 0 {
            let end = ends.trailing_zeros() as usize;
            ends &= ends - 1;
            let used = end + 1 - start;
            // `start` is within the 64 bytes: a value starts after the
            // previous one's end, and ends are bits of a u64.
            let word = word_in(start & 63);
            let value = if used <= 3 {
                // Every token id of a vocabulary under 2^21: three 7-bit
                // groups packed directly.
                let x = word & (u64::MAX >> (64 - 8 * used));
                (x & 0x7f) | ((x >> 1) & 0x3f80) | ((x >> 2) & 0x1f_c000)
            } else if used <= 8 {
                compact(word & (u64::MAX >> (64 - 8 * used)))
            } else {
                match varint(&body[i + start..]) {
                    Some((value, n)) if n == used => value,
                    _ => return false,
                }
            };
            // At most 64 ends in 64 bytes: `n` < 64 here.
            values[n & 63] = value as u32;
            n += 1;
            start = end + 1;
        }
        ids.extend_from_slice(&values[..n]);
        i += start;
    }
    while i < body.len() {
        match varint(&body[i..]) {
            Some((value, used)) => {
                ids.push(value as u32);
                i += used;
            }
            None => return false,
        }
    }
    true
}

/// Decodes what it can with SSSE3 (see `ssse3`); returns where the scalar
/// loops go on from, or `None` if a varint is malformed.
#[cfg(target_arch = "x86_64")]
fn decode_simd(body: &[u8], ids: &mut Vec<u32>) -> Option<usize> {
    if !std::arch::is_x86_feature_detected!("ssse3") || scalar_only() {
        return Some(0);
    }
    // SAFETY: the one requirement of a `#[target_feature]` function is that
    // the CPU has the feature; it was detected just above.
    #[allow(unsafe_code)]
    unsafe {
        ssse3::decode(body, ids)
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn decode_simd(_: &[u8], _: &mut Vec<u32>) -> Option<usize> {
    Some(0)
}

#[cfg(test)]
thread_local! {
    /// Tests decode with and without SSSE3 and compare.
    static SCALAR_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
fn scalar_only() -> bool {
    SCALAR_ONLY.with(|s| s.get())
}

#[cfg(not(test))]
fn scalar_only() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
mod ssse3;

fn word_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Bit k set where byte k of `word` has its top bit clear (ends a varint).
#[inline]
fn stop_bits(word: u64) -> u64 {
    let low = (!word >> 7) & 0x0101_0101_0101_0101;
    // Gathers bit 8k to bit 56 + k; no two products collide or carry.
    low.wrapping_mul(0x0102_0408_1020_4080) >> 56
}

/// A varint's bytes (little-endian, at most 8) to its value: drops the
/// continuation bits and packs the 7-bit groups together.
#[inline]
fn compact(bytes: u64) -> u64 {
    let mut x = bytes & 0x7f7f_7f7f_7f7f_7f7f;
    x = (x & 0x007f_007f_007f_007f) | ((x & 0x7f00_7f00_7f00_7f00) >> 1);
    x = (x & 0x0000_3fff_0000_3fff) | ((x & 0x3fff_0000_3fff_0000) >> 2);
    (x & 0x0000_0000_0fff_ffff) | ((x & 0x0fff_ffff_0000_0000) >> 4)
}

/// One varint at the start of `bytes`: (value, bytes used), or `None` if it
/// is cut short or longer than a u64 (prost then reports the error).
#[inline]
fn varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, b) in bytes.iter().take(10).enumerate() {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            // The 10th byte may only carry the u64's top bit.
            return (i < 9 || *b <= 1).then_some((value, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// What prost generates for `repeated uint32 ids = 1;`.
    #[derive(Clone, PartialEq, prost::Message)]
    struct Generated {
        #[prost(uint32, repeated, tag = "1")]
        ids: Vec<u32>,
    }

    fn varint_bytes(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// xorshift64: `rnd(n)` is below `n`.
    fn rng(mut x: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        }
    }

    /// Random messages, well formed or not: ours decodes exactly what
    /// prost's generated code decodes, and fails where it fails.
    #[test]
    fn decodes_what_prost_decodes() {
        let mut rnd = rng(0x9e37_79b9_7f4a_7c15);
        for case in 0..4000 {
            let mut msg = Vec::new();
            for _ in 0..1 + rnd(3) {
                match rnd(6) {
                    // Packed, the usual encoding, values of every width.
                    0..=2 => {
                        let mut body = Vec::new();
                        for _ in 0..rnd(200) {
                            let v = match rnd(5) {
                                0 => rnd(128),
                                1 => rnd(1 << 21),
                                2 => u64::from(u32::MAX) + rnd(1000),
                                3 => u64::MAX - rnd(3),
                                _ => rnd(200_000),
                            };
                            varint_bytes(v, &mut body);
                        }
                        if rnd(8) == 0 && !body.is_empty() {
                            // A varint cut short at the end of the field.
                            let last = body.len() - 1;
                            body[last] |= 0x80;
                        }
                        if rnd(10) == 0 {
                            // Overlong: eleven bytes.
                            body.extend([0xff; 10]);
                            body.push(1);
                        }
                        msg.push(0x0a);
                        varint_bytes(body.len() as u64, &mut msg);
                        msg.extend(&body);
                    }
                    // Unpacked values.
                    3 => {
                        msg.push(0x08);
                        varint_bytes(rnd(300_000), &mut msg);
                    }
                    // An unknown field.
                    4 => {
                        msg.push(0x12);
                        msg.push(3);
                        msg.extend([1, 2, 3]);
                    }
                    // A length past the end.
                    _ => {
                        msg.push(0x0a);
                        varint_bytes(5 + rnd(10), &mut msg);
                        msg.extend([1, 2]);
                    }
                }
            }
            let ours = TokenIds::decode(&msg[..]).map(|m| m.ids);
            let theirs = Generated::decode(&msg[..]).map(|m| m.ids);
            match (&ours, &theirs) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "case {case}"),
                (Err(_), Err(_)) => {}
                _ => panic!("case {case}: ours {ours:?}, prost {theirs:?}"),
            }
            // And from a buffer that splits the field (prost's path).
            let split = bytes::Buf::chain(&msg[..msg.len() / 2], &msg[msg.len() / 2..]);
            assert_eq!(
                TokenIds::decode(split).map(|m| m.ids).ok(),
                theirs.clone().ok(),
                "case {case} split"
            );
        }
    }

    /// Long fields, as a 32K-token prompt's: what the SSSE3 steps decode
    /// (ids of 1 to 3 bytes, and the longer or malformed varints among
    /// them that they leave to the scalar code) equals the scalar decoder's
    /// result, and prost's.
    #[test]
    fn simd_and_scalar_decode_long_fields_alike() {
        let mut rnd = rng(0x2545_f491_4f6c_dd1d);
        for case in 0..300 {
            let mut body = Vec::new();
            let n = rnd(5000);
            // Runs of one width, or every width mixed: each window shape.
            let widths = rnd(4);
            for _ in 0..n {
                let v = match (widths, rnd(100)) {
                    (_, 0) if case % 3 == 0 => u64::from(u32::MAX) + rnd(1000),
                    (_, 1) if case % 3 == 0 => rnd(1 << 28),
                    (0, _) => rnd(128),
                    (1, _) => 128 + rnd(16_384 - 128),
                    (2, _) => 16_384 + rnd((1 << 21) - 16_384),
                    _ => rnd(1 << 21),
                };
                varint_bytes(v, &mut body);
            }
            if case % 10 == 9 && !body.is_empty() {
                // A malformed varint somewhere: eleven bytes.
                let at = rnd(body.len() as u64) as usize;
                // Move to a varint boundary (after a byte with the top bit clear).
                let at = (at..body.len())
                    .find(|i| body[*i] & 0x80 == 0)
                    .map_or(0, |i| i + 1);
                body.splice(at..at, [0xff; 10].into_iter().chain([1]));
            }
            let decode = |scalar: bool| {
                SCALAR_ONLY.with(|s| s.set(scalar));
                let mut ids = vec![7];
                let ok = decode_packed(&body, &mut ids);
                SCALAR_ONLY.with(|s| s.set(false));
                ok.then_some(ids)
            };
            let simd = decode(false);
            assert_eq!(simd, decode(true), "case {case}");
            let mut msg = vec![0x0a];
            varint_bytes(body.len() as u64, &mut msg);
            msg.extend(&body);
            let theirs = Generated::decode(&msg[..]).ok().map(|m| m.ids);
            assert_eq!(simd.map(|ids| ids[1..].to_vec()), theirs, "case {case}");
        }
    }

    #[test]
    fn encodes_as_prost_does() {
        let ids = vec![0, 1, 127, 128, 150_000, u32::MAX];
        let ours = TokenIds { ids: ids.clone() }.encode_to_vec();
        assert_eq!(ours, Generated { ids }.encode_to_vec());
        assert_eq!(TokenIds::default().encode_to_vec(), Vec::<u8>::new());
    }
}

//! One block's token ids hashed to 64 bits, by AES rounds.
//!
//! Why AES rounds and not a general-purpose hash: a block is 16 token ids
//! (64 bytes) and a 32K-token prompt is 2,048 of them, hashed on every
//! `Score`. xxh3-64 takes four 128-bit multiplies and an avalanche per
//! 64-byte input, ~3 ns a block here; one AES round mixes 16 bytes in one
//! instruction (two a cycle on current x86 cores), and a block takes seven:
//! ~1.7 ns, every block independent of the others, so a prompt's blocks
//! pipeline. The same rounds are what aHash and gxhash build on; like
//! xxh3 they are not cryptographic, which a key never needed to be (two
//! prompts whose keys collide only score alike).
//!
//! The construction: the 16-byte chunks of the block (4 token ids each,
//! little-endian, the last zero-padded; the token count is in the initial
//! state, so padding is never confused with token 0) are absorbed into two
//! lanes by turns, one round each (`s = aesenc(s ^ chunk, K1)`); the lanes
//! are merged by a round keyed by one of them, and two more rounds spread
//! every input bit over the 128-bit state, whose halves are xored.
//!
//! Keys are stored in snapshots and copied between replicas, so every
//! machine must compute the same values: x86-64 with AES-NI uses the
//! instructions (with VAES, two blocks' rounds per 256-bit instruction),
//! everything else the `aes` crate's round function (FIPS 197's round, the
//! instruction's definition), and tests hold them equal.

/// The token count and a constant: lane `s`'s initial state.
const S0: u64 = 0x4528_21e6_38d0_1377;
/// Lane `t`'s initial state.
const T0: [u64; 2] = [0xbe54_66cf_34e9_0c6c, 0xc0ac_29b7_c97c_50dd];
/// Round keys (digits of pi, as in Blowfish's P-array).
const K1: [u64; 2] = [0x1319_8a2e_0370_7344, 0x243f_6a88_85a3_08d3];
const K2: [u64; 2] = [0x082e_fa98_ec4e_6c89, 0xa409_3822_299f_31d0];

/// The hash of one block of token ids.
#[inline]
pub fn block_hash(tokens: &[u32]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if ni::available() {
        return ni::block_hash(tokens);
    }
    portable::block_hash(tokens)
}

/// `out[i] = fold(out[i - 1], block_hash(block i))`, from `prev`, for every
/// full block of `tokens`: the whole loop in one function, so that on x86
/// the rounds are inlined and a prompt's blocks overlap in the pipeline.
/// `block_size` is not 0. The x86 loops write keys into `out`'s spare
/// room rather than pushing: a push reloads the `Vec`'s length after each
/// key's store (which might alias it), a wait on each store that cost
/// ~12% of a prompt's keys when measured.
pub fn chain_blocks(
    prev: u64,
    tokens: &[u32],
    block_size: usize,
    fold: impl Fn(u64, u64) -> u64,
    out: &mut Vec<u64>,
) {
    #[cfg(target_arch = "x86_64")]
    if block_size.is_multiple_of(8) && vaes::available() {
        return vaes::chain_blocks(prev, tokens, block_size, fold, out);
    }
    #[cfg(target_arch = "x86_64")]
    if ni::available() {
        return ni::chain_blocks(prev, tokens, block_size, fold, out);
    }
    let mut prev = prev;
    for block in tokens.chunks_exact(block_size) {
        prev = fold(prev, portable::block_hash(block));
        out.push(prev);
    }
}

/// Chunk `i` of `tokens` (4 ids, little-endian, zero-padded).
fn chunk_bytes(tokens: &[u32], i: usize) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    let end = (i * 4 + 4).min(tokens.len());
    for (j, t) in tokens[i * 4..end].iter().enumerate() {
        bytes[j * 4..j * 4 + 4].copy_from_slice(&t.to_le_bytes());
    }
    bytes
}

mod portable {
    use super::*;

    fn block(words: [u64; 2]) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&words[0].to_le_bytes());
        b[8..].copy_from_slice(&words[1].to_le_bytes());
        b
    }

    fn xor(a: [u8; 16], b: [u8; 16]) -> [u8; 16] {
        std::array::from_fn(|i| a[i] ^ b[i])
    }

    /// One AES encryption round: x86's `aesenc`.
    fn round(state: [u8; 16], key: [u8; 16]) -> [u8; 16] {
        let mut state = aes::Block::from(state);
        aes::hazmat::cipher_round(&mut state, &aes::Block::from(key));
        state.into()
    }

    pub fn block_hash(tokens: &[u32]) -> u64 {
        let (k1, k2) = (block(K1), block(K2));
        let chunks = tokens.len().div_ceil(4);
        let mut s = block([S0, tokens.len() as u64]);
        let mut t = block(T0);
        let mut i = 0;
        while i + 1 < chunks {
            s = round(xor(s, chunk_bytes(tokens, i)), k1);
            t = round(xor(t, chunk_bytes(tokens, i + 1)), k1);
            i += 2;
        }
        if i < chunks {
            s = round(xor(s, chunk_bytes(tokens, i)), k1);
        }
        let m = round(round(round(s, t), k2), k1);
        let lo = u64::from_le_bytes(m[..8].try_into().expect("8 bytes"));
        let hi = u64::from_le_bytes(m[8..].try_into().expect("8 bytes"));
        lo ^ hi
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod ni {
    use super::*;
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("sse4.1")
    }

    pub fn block_hash(tokens: &[u32]) -> u64 {
        // SAFETY: `available()` said the CPU has both features.
        unsafe { hash(tokens) }
    }

    pub fn chain_blocks(
        prev: u64,
        tokens: &[u32],
        block_size: usize,
        fold: impl Fn(u64, u64) -> u64,
        out: &mut Vec<u64>,
    ) {
        // SAFETY: as above.
        unsafe { chain(prev, tokens, block_size, fold, out) }
    }

    #[target_feature(enable = "aes,sse4.1")]
    fn chain(
        mut prev: u64,
        tokens: &[u32],
        block_size: usize,
        fold: impl Fn(u64, u64) -> u64,
        out: &mut Vec<u64>,
    ) {
        let n = tokens.len() / block_size.max(1);
        out.reserve(n);
        let keys = &mut out.spare_capacity_mut()[..n];
        let mut written = 0;
        if block_size.is_multiple_of(4) {
            // Every chunk whole (vLLM's block sizes): no padding to check for.
            for block in tokens.chunks_exact(block_size) {
                prev = fold(prev, hash_whole(block));
                keys[written].write(prev);
                written += 1;
            }
        } else {
            for block in tokens.chunks_exact(block_size) {
                prev = fold(prev, hash(block));
                keys[written].write(prev);
                written += 1;
            }
        }
        // SAFETY: the first `written` spare slots were written, in order.
        unsafe { out.set_len(out.len() + written) };
    }

    /// `hash` of a block of whole chunks (a multiple of 4 token ids): the
    /// same rounds, read a pair of chunks at a time. It is `hash` written
    /// again on purpose: one function over chunk indexes serving both (a
    /// loader closure per chunk) measured 1.4x slower for a 2,048-block
    /// prompt (`cargo bench -p indexer --bench keys`).
    #[inline]
    #[target_feature(enable = "aes,sse4.1")]
    pub(super) fn hash_whole(tokens: &[u32]) -> u64 {
        debug_assert!(tokens.len().is_multiple_of(4));
        let (k1, k2) = (words(K1), words(K2));
        let mut s = words([S0, tokens.len() as u64]);
        let mut t = words(T0);
        let mut pairs = tokens.chunks_exact(8);
        for pair in &mut pairs {
            // SAFETY: 32 bytes; `loadu` takes any alignment.
            let (a, b) = unsafe {
                let p = pair.as_ptr().cast::<__m128i>();
                (_mm_loadu_si128(p), _mm_loadu_si128(p.add(1)))
            };
            s = _mm_aesenc_si128(_mm_xor_si128(s, a), k1);
            t = _mm_aesenc_si128(_mm_xor_si128(t, b), k1);
        }
        if let [_, _, _, _] = pairs.remainder() {
            // SAFETY: 16 bytes, as above.
            let a = unsafe { _mm_loadu_si128(pairs.remainder().as_ptr().cast()) };
            s = _mm_aesenc_si128(_mm_xor_si128(s, a), k1);
        }
        let m = _mm_aesenc_si128(_mm_aesenc_si128(_mm_aesenc_si128(s, t), k2), k1);
        (_mm_cvtsi128_si64(m) as u64) ^ (_mm_extract_epi64::<1>(m) as u64)
    }

    #[inline]
    #[target_feature(enable = "aes,sse4.1")]
    fn words(w: [u64; 2]) -> __m128i {
        _mm_set_epi64x(w[1] as i64, w[0] as i64)
    }

    /// Chunk `i`: loaded in place when whole, else padded.
    #[inline]
    #[target_feature(enable = "aes,sse4.1")]
    fn load(tokens: &[u32], i: usize) -> __m128i {
        match tokens.get(i * 4..i * 4 + 4) {
            // SAFETY: the slice is 16 bytes; `loadu` takes any alignment.
            Some(whole) => unsafe { _mm_loadu_si128(whole.as_ptr().cast()) },
            None => {
                let bytes = chunk_bytes(tokens, i);
                // SAFETY: as above.
                unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "aes,sse4.1")]
    fn hash(tokens: &[u32]) -> u64 {
        let (k1, k2) = (words(K1), words(K2));
        let chunks = tokens.len().div_ceil(4);
        let mut s = words([S0, tokens.len() as u64]);
        let mut t = words(T0);
        let mut i = 0;
        while i + 1 < chunks {
            s = _mm_aesenc_si128(_mm_xor_si128(s, load(tokens, i)), k1);
            t = _mm_aesenc_si128(_mm_xor_si128(t, load(tokens, i + 1)), k1);
            i += 2;
        }
        if i < chunks {
            s = _mm_aesenc_si128(_mm_xor_si128(s, load(tokens, i)), k1);
        }
        let m = _mm_aesenc_si128(_mm_aesenc_si128(_mm_aesenc_si128(s, t), k2), k1);
        (_mm_cvtsi128_si64(m) as u64) ^ (_mm_extract_epi64::<1>(m) as u64)
    }
}

/// Two blocks a pass, on x86 with VAES (256-bit AES rounds: two 128-bit
/// lanes per instruction, two instructions a cycle on current cores):
/// the same rounds as `ni`, so the same hashes. A block's lanes `s` and `t`
/// are one 256-bit state absorbing a pair of chunks per round, and two
/// blocks' merges and final rounds run side by side. A 2,048-block prompt:
/// ~1.35x faster than `ni` when measured (`cargo bench -p indexer --bench
/// keys` times the path this CPU takes).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod vaes {
    use super::*;
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        super::ni::available()
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("vaes")
    }

    /// `block_size` is a multiple of 8 (whole pairs of chunks).
    pub fn chain_blocks(
        prev: u64,
        tokens: &[u32],
        block_size: usize,
        fold: impl Fn(u64, u64) -> u64,
        out: &mut Vec<u64>,
    ) {
        assert!(block_size.is_multiple_of(8) && block_size > 0);
        // SAFETY: `available()` said the CPU has every feature used. The
        // common sizes get a loop of their own, unrolled: a block size
        // known only at run time kept the rounds in a loop: 1.7x slower.
        unsafe {
            match block_size {
                16 => chain::<2>(prev, tokens, block_size, fold, out),
                32 => chain::<4>(prev, tokens, block_size, fold, out),
                64 => chain::<8>(prev, tokens, block_size, fold, out),
                _ => chain::<0>(prev, tokens, block_size, fold, out),
            }
        }
    }

    /// `PAIRS`: pairs of chunks per block, `block_size / 8`; 0 when not
    /// one of the sizes unrolled.
    #[target_feature(enable = "aes,sse4.1,avx2,vaes")]
    fn chain<const PAIRS: usize>(
        mut prev: u64,
        tokens: &[u32],
        block_size: usize,
        fold: impl Fn(u64, u64) -> u64,
        out: &mut Vec<u64>,
    ) {
        let pairs = if PAIRS > 0 { PAIRS } else { block_size / 8 };
        assert_eq!(pairs * 8, block_size);
        let twice =
            |w: [u64; 2]| _mm256_set_epi64x(w[1] as i64, w[0] as i64, w[1] as i64, w[0] as i64);
        let (k1, k2) = (twice(K1), twice(K2));
        // Lane `s` (low) and lane `t` (high), as `ni` starts them.
        let init = _mm256_set_epi64x(T0[1] as i64, T0[0] as i64, block_size as i64, S0 as i64);
        // A block's lanes after absorbing its chunks, a pair per round.
        let absorb = |block: &[u32]| {
            // One check a block: every read below is inside it.
            let block = &block[..8 * pairs];
            let mut st = init;
            for i in 0..pairs {
                // SAFETY: pair `i` is 32 bytes inside the block (`pairs`
                // is `block_size / 8`); `loadu` takes any alignment.
                let c = unsafe { _mm256_loadu_si256(block.as_ptr().add(8 * i).cast()) };
                st = _mm256_aesenc_epi128(_mm256_xor_si256(st, c), k1);
            }
            st
        };
        let n = tokens.len() / block_size;
        out.reserve(n);
        let keys = &mut out.spare_capacity_mut()[..n];
        let mut written = 0;
        let mut twos = tokens.chunks_exact(2 * block_size);
        for two in &mut twos {
            let (a, b) = two.split_at(block_size);
            let (a, b) = (absorb(a), absorb(b));
            // [s_a, s_b] merged under [t_a, t_b], then the final rounds.
            let s = _mm256_permute2x128_si256::<0x20>(a, b);
            let t = _mm256_permute2x128_si256::<0x31>(a, b);
            let m = _mm256_aesenc_epi128(_mm256_aesenc_epi128(_mm256_aesenc_epi128(s, t), k2), k1);
            // Each lane's halves xored.
            let h = _mm256_xor_si256(m, _mm256_shuffle_epi32::<0x4e>(m));
            prev = fold(prev, _mm256_extract_epi64::<0>(h) as u64);
            keys[written].write(prev);
            prev = fold(prev, _mm256_extract_epi64::<2>(h) as u64);
            keys[written + 1].write(prev);
            written += 2;
        }
        if let Some(last) = twos.remainder().get(..block_size) {
            keys[written].write(fold(prev, super::ni::hash_whole(last)));
            written += 1;
        }
        // SAFETY: the first `written` spare slots were written, in order.
        unsafe { out.set_len(out.len() + written) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every machine computes the same keys: the instructions and the
    /// portable rounds agree on every length, padded or not.
    #[test]
    fn instructions_and_portable_rounds_agree() {
        let mut rng = crate::test_rng::xorshift(7);
        for len in 0..80usize {
            for _ in 0..20 {
                let tokens: Vec<u32> = (0..len).map(|_| rng(u64::MAX) as u32).collect();
                assert_eq!(
                    block_hash(&tokens),
                    portable::block_hash(&tokens),
                    "{len} tokens"
                );
            }
        }
    }

    /// The prompt loop (whole chunks read in place where the block size
    /// allows) computes what the portable rounds do, block by block.
    #[test]
    fn a_prompts_chain_agrees_with_the_portable_rounds() {
        let mut rng = crate::test_rng::xorshift(11);
        let fold = |prev: u64, h: u64| prev.rotate_left(17) ^ h;
        for block_size in [1usize, 3, 4, 8, 12, 16, 20, 32, 64] {
            let tokens: Vec<u32> = (0..block_size * 9 + 2)
                .map(|_| rng(u64::MAX) as u32)
                .collect();
            let mut out = Vec::new();
            chain_blocks(5, &tokens, block_size, fold, &mut out);
            let mut prev = 5;
            let want: Vec<u64> = tokens
                .chunks_exact(block_size)
                .map(|b| {
                    prev = fold(prev, portable::block_hash(b));
                    prev
                })
                .collect();
            assert_eq!(out, want, "block size {block_size}");
        }
    }

    /// The VAES loop itself (not whichever path `chain_blocks` picks)
    /// against the portable rounds: the unrolled sizes and the loop for
    /// the others, 0 to 5 blocks (odd counts end on a lone block).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vaes_loop_agrees_with_the_portable_rounds() {
        if !vaes::available() {
            eprintln!("no VAES on this CPU: its loop is not run here");
            return;
        }
        let mut rng = crate::test_rng::xorshift(13);
        let fold = |prev: u64, h: u64| prev.rotate_left(23).wrapping_add(h);
        for block_size in [8usize, 16, 24, 32, 40, 64, 128] {
            for blocks in 0..=5 {
                let tokens: Vec<u32> = (0..block_size * blocks + 3)
                    .map(|_| rng(u64::MAX) as u32)
                    .collect();
                let mut out = vec![42];
                vaes::chain_blocks(9, &tokens, block_size, fold, &mut out);
                let mut prev = 9;
                let mut want = vec![42];
                want.extend(tokens.chunks_exact(block_size).map(|b| {
                    prev = fold(prev, portable::block_hash(b));
                    prev
                }));
                assert_eq!(out, want, "block size {block_size}, {blocks} blocks");
            }
        }
    }

    #[test]
    fn padding_length_and_every_bit_count() {
        let mut seen = std::collections::HashSet::new();
        // Zero tokens of every length: the count tells them apart.
        for len in 0..64usize {
            assert!(seen.insert(block_hash(&vec![0u32; len])), "{len} zeros");
        }
        let base: Vec<u32> = (1000..1016).collect();
        assert!(seen.insert(block_hash(&base)));
        for i in 0..16 {
            for bit in 0..32 {
                let mut t = base.clone();
                t[i] ^= 1 << bit;
                assert!(seen.insert(block_hash(&t)), "token {i} bit {bit}");
            }
        }
    }
}

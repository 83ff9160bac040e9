//! Our block keys: each full block's token ids hashed alone (AES rounds,
//! `block_hash`), then chained to the key before it by a rotate and an add.
//!
//! Keys are computed the same way from a prompt (request side) and from a
//! `BlockStored`'s `token_ids` (event side), so they never depend on how the
//! engine hashes. A chain starts from a *root seed* that folds in everything
//! that makes two identical token sequences different caches: the model, the
//! LoRA adapter and block 0's extra keys (the cache salt). Because every key
//! is seeded by its parent, anything folded into the root reaches every block.

mod block_hash;
pub mod engine_hash;
pub mod multimodal;
pub mod scheme;
pub mod sglang_hash;

use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::event::ExtraKey;

/// The block loop under any fold (for benches: the keys bench times the
/// previous scheme's fold over the same rounds).
#[doc(hidden)]
pub use block_hash::chain_blocks;

/// A block's identity in our index. Transparent, so that a prompt's keys
/// are the runs' `u64`s without a copy (`as_raw`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, bytemuck::Pod, bytemuck::Zeroable,
)]
#[repr(transparent)]
pub struct BlockKey(pub u64);

impl BlockKey {
    /// Keys as the numbers they are, borrowed.
    pub fn as_raw(keys: &[BlockKey]) -> &[u64] {
        bytemuck::cast_slice(keys)
    }
}

/// Hasher for 64-bit keys in hash tables: one finalizer round (murmur3's
/// fmix64) instead of SipHash. Our keys are xxh3 values, but engine hashes
/// come from the pods: whatever their distribution, every bit of the result
/// must depend on every bit of the key (hashbrown tags slots from the top
/// bits; sequential ints would otherwise crowd into a few groups).
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^ (x >> 33)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub type KeyBuildHasher = BuildHasherDefault<KeyHasher>;

/// Everything besides tokens that selects a cache: what the root seed is made of.
#[derive(Clone, Copy, Debug)]
pub struct KeyScope<'a> {
    pub model: &'a str,
    pub lora_name: Option<&'a str>,
    /// Block 0's non-LoRA extra keys: on the request side the cache salt.
    pub first_block_extras: &'a [ExtraKey],
}

impl KeyScope<'_> {
    pub fn root_seed(&self) -> u64 {
        let mut buf = Vec::with_capacity(64);
        put_str(&mut buf, 0x01, "kv-indexer/root/v1");
        put_str(&mut buf, 0x02, self.model);
        if let Some(lora) = self.lora_name {
            put_str(&mut buf, 0x03, lora);
        }
        for extra in self.first_block_extras {
            encode_extra(&mut buf, extra);
        }
        xxh3_64(&buf)
    }
}

/// SGLang with EAGLE speculative decoding keys a prompt by its bigrams:
/// unit `i` is `(t[i], t[i+1])`, so `n` tokens make `n - 1` units, and a
/// page of `P` units is `2P` ids, each pair as two. The prompt as those
/// ids; keyed by pages of `2P` (and SGLang hashes them so).
pub fn bigram_words(tokens: &[u32]) -> Vec<u32> {
    tokens.windows(2).flat_map(|w| [w[0], w[1]]).collect()
}

/// The model scope bigram pages are keyed in: apart from the same model's
/// plain pages, whose ids could spell the same words.
pub fn bigram_scope(model: &str) -> String {
    format!("{model}\0bigram")
}

/// The request side's scope: `cache_salt` is block 0's only extra key.
pub fn request_root_seed(model: &str, lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let salt = cache_salt.map(|s| [ExtraKey::Str(s.to_owned())]);
    KeyScope {
        model,
        lora_name,
        first_block_extras: salt.as_ref().map_or(&[], |s| s.as_slice()),
    }
    .root_seed()
}

/// The key scheme, part of the snapshot's key fingerprint: a snapshot's
/// token keys are only valid under the scheme that computed them.
pub const SCHEME: &str = "token-keys/v4: AES rounds per block, folded by rotate-add";

/// Key of one full block given the key (or root seed) before it.
///
/// Why two steps rather than one seeded hash over the tokens: the token
/// hash of a block does not wait for the previous block's key, so a
/// prompt's blocks hash in a pipeline and only the fold is serial. A
/// 2,048-block prompt took 17.5 us chained through xxh3's seed, 9.5 us
/// this way with xxh3 per block, less with AES rounds (see `block_hash`;
/// `cargo bench -p indexer --bench keys`).
#[inline]
pub fn chain(prev: u64, tokens: &[u32]) -> BlockKey {
    BlockKey(fold(prev, block_hash::block_hash(tokens)))
}

/// Mixes a block's token hash into the chain: the key before it rotated,
/// plus the hash.
///
/// The fold is the only serial step of a prompt's keys, so its latency is
/// what a long prompt pays per block: two cycles here, against about four
/// for a 128-bit multiply (the previous scheme's, which made 2,048 blocks
/// take 3.4 us over the same loop, against 1.9). Whatever the hash,
/// `prev -> fold(prev, h)` is a bijection: two chains never merge, so
/// prompts that differ in one block never share a later key (unless the
/// two blocks' hashes collide). The add is what keeps it from being
/// linear: with a xor, the same block at two positions 64 apart would
/// cancel out of every later key (64 rotations by 23 are the identity),
/// and two prompts that differ only there would collide; the carries of
/// an add do not cancel so (`the_fold_is_not_linear` shows both).
#[inline]
fn fold(prev: u64, block: u64) -> u64 {
    prev.rotate_left(23).wrapping_add(block)
}

/// Folds extra keys that appear on a block after the first (multimodal
/// placeholders): such a block must never match a text-only prompt.
pub fn fold_extras(key: BlockKey, extras: &[ExtraKey]) -> BlockKey {
    if extras.is_empty() {
        return key;
    }
    let mut buf = Vec::with_capacity(32);
    for extra in extras {
        encode_extra(&mut buf, extra);
    }
    BlockKey(xxh3_64_with_seed(&buf, key.0))
}

/// Keys of every full block of `tokens`; a trailing partial block has none.
pub fn prompt_keys(root_seed: u64, tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut keys = Vec::with_capacity(tokens.len() / block_size);
    block_hash::chain_blocks(root_seed, tokens, block_size, fold, &mut keys);
    // Built as `u64`s by the loop above; `BlockKey` is their transparent wrapper.
    keys.into_iter().map(BlockKey).collect()
}

/// `prompt_keys` of a prompt with multimodal items (sorted, as
/// `multimodal::sorted_items` leaves them): every block an item overlaps
/// carries the item's pair, as a pod's `BlockStored` of the prompt does,
/// block 0's in the root seed before the cache salt (vLLM's order: adapter,
/// items, salt), the later blocks' folded into their keys.
pub fn multimodal_prompt_keys(
    model: &str,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
    tokens: &[u32],
    block_size: usize,
    items: &[multimodal::MmItem],
) -> Vec<BlockKey> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut first = multimodal::block_extras(items, 0, block_size);
    first.extend(cache_salt.map(|s| ExtraKey::Str(s.to_owned())));
    let mut prev = KeyScope {
        model,
        lora_name,
        first_block_extras: &first,
    }
    .root_seed();
    tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, block)| {
            let mut key = chain(prev, block);
            if i > 0 {
                let start = i * block_size;
                key = fold_extras(
                    key,
                    &multimodal::block_extras(items, start, start + block_size),
                );
            }
            prev = key.0;
            key
        })
        .collect()
}

fn put_str(buf: &mut Vec<u8>, tag: u8, s: &str) {
    buf.push(tag);
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

/// Unambiguous (tagged, length-prefixed) encoding of an extra key.
fn encode_extra(buf: &mut Vec<u8>, extra: &ExtraKey) {
    match extra {
        ExtraKey::Nil => buf.push(0x10),
        ExtraKey::Bool(b) => buf.extend_from_slice(&[0x11, u8::from(*b)]),
        ExtraKey::Int(i) => {
            buf.push(0x12);
            buf.extend_from_slice(&i.to_le_bytes());
        }
        ExtraKey::Float(f) => {
            buf.push(0x13);
            buf.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        ExtraKey::Str(s) => put_str(buf, 0x14, s),
        ExtraKey::Bytes(b) => {
            buf.push(0x15);
            buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
            buf.extend_from_slice(b);
        }
        ExtraKey::List(items) => {
            buf.push(0x16);
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                encode_extra(buf, item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_ignore_partial_blocks() {
        let root = request_root_seed("m", None, None);
        let tokens: Vec<u32> = (0..37).collect();
        let keys = prompt_keys(root, &tokens, 16);
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], chain(root, &tokens[..16]));
        assert_eq!(keys[1], chain(keys[0].0, &tokens[16..32]));
        // A prefix has a prefix of the keys.
        assert_eq!(prompt_keys(root, &tokens[..20], 16), keys[..1].to_vec());
    }

    #[test]
    fn model_lora_and_salt_separate_caches() {
        let tokens: Vec<u32> = (0..16).collect();
        let seeds = [
            request_root_seed("a", None, None),
            request_root_seed("b", None, None),
            request_root_seed("a", Some("lora"), None),
            request_root_seed("a", None, Some("lora")),
            request_root_seed("a", Some("lora"), Some("salt")),
        ];
        let keys: std::collections::HashSet<_> = seeds
            .iter()
            .map(|s| prompt_keys(*s, &tokens, 16)[0])
            .collect();
        assert_eq!(keys.len(), seeds.len());
    }

    #[test]
    fn event_scope_with_salt_matches_request_scope() {
        let extras = [ExtraKey::Str("tenant-a".into())];
        let event_side = KeyScope {
            model: "m",
            lora_name: None,
            first_block_extras: &extras,
        };
        assert_eq!(
            event_side.root_seed(),
            request_root_seed("m", None, Some("tenant-a"))
        );
    }

    #[test]
    fn extras_after_block_zero_change_the_key() {
        let k = BlockKey(7);
        assert_eq!(fold_extras(k, &[]), k);
        assert_ne!(fold_extras(k, &[ExtraKey::Str("mm".into())]), k);
        assert_ne!(
            fold_extras(k, &[ExtraKey::Str("ab".into())]),
            fold_extras(k, &[ExtraKey::Str("a".into()), ExtraKey::Str("b".into())])
        );
    }

    #[test]
    fn keys_are_distinct_for_repeats_swaps_and_one_token_changes() {
        let mut seen = std::collections::HashSet::new();
        let root = request_root_seed("m", None, None);
        // The same block 8,192 times (padding): every position its own key.
        let same: Vec<u32> = (0..8192 * 16).map(|i| i % 16).collect();
        for k in prompt_keys(root, &same, 16) {
            assert!(seen.insert(k), "a repeated block's keys cycle");
        }
        // Two blocks swapped, and every single-token change of block 0.
        let a: Vec<u32> = (0..32).collect();
        let mut b = a[16..].to_vec();
        b.extend_from_slice(&a[..16]);
        assert_ne!(prompt_keys(root, &a, 16), prompt_keys(root, &b, 16));
        for i in 0..16 {
            for delta in [1u32, 1 << 16, 1 << 31] {
                let mut t = a.clone();
                t[i] ^= delta;
                let keys = prompt_keys(root, &t, 16);
                assert!(seen.insert(keys[0]));
                // The change reaches every later key.
                assert!(seen.insert(keys[1]));
            }
        }
    }

    /// A prompt with the same block at two positions, against one with
    /// another block at both: a linear fold (rotate and xor) cancels the
    /// pair at distance 64 and the two prompts share every later key; ours
    /// keeps them apart at every distance.
    #[test]
    fn the_fold_is_not_linear() {
        let root = request_root_seed("m", None, None);
        let filler: Vec<u32> = (0..300 * 16).map(|i| (i * 7919) % 151_000).collect();
        let with_pair = |block: u32, at: usize, distance: usize| {
            let mut t = filler.clone();
            for i in [at, at + distance] {
                t[i * 16..(i + 1) * 16].fill(block);
            }
            t
        };
        let last = |fold: fn(u64, u64) -> u64, tokens: &[u32]| {
            let mut out = Vec::new();
            block_hash::chain_blocks(root, tokens, 16, fold, &mut out);
            *out.last().expect("blocks")
        };
        let linear: fn(u64, u64) -> u64 = |prev, h| prev.rotate_left(23) ^ h;
        let (a, b) = (with_pair(1, 10, 64), with_pair(2, 10, 64));
        assert_eq!(last(linear, &a), last(linear, &b), "the control collides");
        for distance in 1..=256 {
            let (a, b) = (with_pair(1, 20, distance), with_pair(2, 20, distance));
            assert_ne!(last(fold, &a), last(fold, &b), "distance {distance}");
        }
    }

    /// Keys are stored in snapshots: a change of these values must come
    /// with a new `SCHEME` (snapshots of the old keys are then refused).
    #[test]
    fn the_scheme_is_pinned() {
        let tokens: Vec<u32> = (0..32).collect();
        let keys = prompt_keys(request_root_seed("Qwen/Qwen3-8B", None, None), &tokens, 16);
        assert_eq!(
            (keys[0].0, keys[1].0, SCHEME),
            (
                0xc755_6fd0_00a2_7859,
                0xeb64_7b38_697b_4d39,
                "token-keys/v4: AES rounds per block, folded by rotate-add"
            )
        );
    }
}

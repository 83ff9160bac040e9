//! Our block keys: chained 64-bit xxh3 over each full block's token ids.
//!
//! Keys are computed the same way from a prompt (request side) and from a
//! `BlockStored`'s `token_ids` (event side), so they never depend on how the
//! engine hashes. A chain starts from a *root seed* that folds in everything
//! that makes two identical token sequences different caches: the model, the
//! LoRA adapter and block 0's extra keys (the cache salt). Because every key
//! is seeded by its parent, anything folded into the root reaches every block.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::event::ExtraKey;

/// A block's identity in our index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

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

/// Key of one full block given the key (or root seed) before it.
#[inline]
pub fn chain(prev: u64, tokens: &[u32]) -> BlockKey {
    BlockKey(xxh3_64_with_seed(token_bytes(tokens).as_ref(), prev))
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
    let mut prev = root_seed;
    for block in tokens.chunks_exact(block_size) {
        let key = chain(prev, block);
        keys.push(key);
        prev = key.0;
    }
    keys
}

/// Token ids as little-endian bytes, so keys are the same on every platform.
#[cfg(target_endian = "little")]
fn token_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Borrowed(bytemuck::cast_slice(tokens))
}

#[cfg(target_endian = "big")]
fn token_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
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
}

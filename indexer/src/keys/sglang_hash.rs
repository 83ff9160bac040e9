//! SGLang's block hashes (0.5.23), as its events publish them: what engine
//! key mode computes for a prompt sent to SGLang pods
//! (`--engine-hash-algo sglang` or `sglang_dynamo`, the pods'
//! `--kv-events-config` `format`), so that a prompt's keys are the hashes
//! the pods' `BlockStored` events name.
//!
//! - A page's bytes are its token ids, 4 bytes little-endian each.
//! - A chain of SHA-256 digests: `D[k] = SHA-256(D[k-1] || page k)`; the
//!   first page has no seed (`SHA-256(page 0)`), or under a cache salt
//!   `SHA-256("sglang-cache-salt-v1" 0x00 salt)`.
//! - The hash of page k: `D[k]`'s first 8 bytes, big-endian.
//! - Namespaced, in SGLang's own format for a LoRA adapter the request
//!   named (its tree's extra key: the adapter's id), in the dynamo format
//!   for any extra key or salt: `SHA-256(N || hash, 8 bytes big-endian)`'s
//!   first 8 bytes, `N = SHA-256("sglang-kv-event-namespace-v1" part(extra
//!   key) part(salt))` with `part` = 0x00 for none, else 0x01, the length
//!   (8 bytes little-endian) and the UTF-8 bytes (the salt only in the
//!   dynamo format).
//!
//! Checked against the hashes SGLang's own trees publish
//! (`tests/fixtures/hash-vectors/sglang-0.5.23-hashes.json`).

use sha2::{Digest as _, Sha256};

/// SGLang's two event formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `"default"`: only a LoRA adapter's extra key namespaces the hashes.
    Sglang,
    /// `"dynamo"`: any extra key or cache salt does.
    Dynamo,
}

/// What a request's pages are hashed under.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scope<'a> {
    pub cache_salt: Option<&'a str>,
    /// The tree's extra key: a LoRA adapter's id (`lora_uuid`) after the
    /// request's own extra key, if any.
    pub extra_key: Option<&'a str>,
    /// The extra key is a LoRA adapter the request named (SGLang's own
    /// format namespaces only those).
    pub lora: bool,
}

/// The id SGLang gives an adapter loaded with `--lora-paths NAME=PATH`:
/// `uuid5(NAMESPACE_URL, NAME "\0" PATH)` as 32 hex digits.
pub fn lora_uuid(name: &str, path: &str) -> String {
    let id = format!("{name}\0{path}");
    uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, id.as_bytes())
        .simple()
        .to_string()
}

/// The hash of each full page of `tokens` (a trailing partial page has
/// none), as SGLang publishes it: the 64-bit values are the signed int64s
/// on the wire, as bits.
pub fn page_hashes(tokens: &[u32], page: usize, format: Format, scope: Scope<'_>) -> Vec<u64> {
    if page == 0 {
        return Vec::new();
    }
    // An empty salt is none, as SGLang normalises it.
    let salt = scope.cache_salt.filter(|s| !s.is_empty());
    let namespace = namespace(format, scope.extra_key, salt, scope.lora);
    let mut prev: Option<[u8; 32]> = salt.map(|s| {
        Sha256::new()
            .chain_update(b"sglang-cache-salt-v1\0")
            .chain_update(s.as_bytes())
            .finalize()
            .into()
    });
    let mut bytes = Vec::with_capacity(page * 4);
    tokens
        .chunks_exact(page)
        .map(|tokens| {
            bytes.clear();
            for t in tokens {
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            let mut h = Sha256::new();
            if let Some(prev) = &prev {
                h.update(prev);
            }
            h.update(&bytes);
            let digest: [u8; 32] = h.finalize().into();
            prev = Some(digest);
            let hash = first_8(&digest);
            match &namespace {
                None => hash,
                Some(n) => first_8(
                    &Sha256::new()
                        .chain_update(n)
                        .chain_update(hash.to_be_bytes())
                        .finalize()
                        .into(),
                ),
            }
        })
        .collect()
}

fn first_8(digest: &[u8; 32]) -> u64 {
    u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// The namespace seed a page's hash is namespaced under, if any.
fn namespace(
    format: Format,
    extra_key: Option<&str>,
    salt: Option<&str>,
    lora: bool,
) -> Option<[u8; 32]> {
    let (extra_key, salt) = match format {
        Format::Sglang if lora && extra_key.is_some() => (extra_key, None),
        Format::Sglang => return None,
        Format::Dynamo if extra_key.is_some() || salt.is_some() => (extra_key, salt),
        Format::Dynamo => return None,
    };
    let mut h = Sha256::new();
    h.update(b"sglang-kv-event-namespace-v1");
    for part in [extra_key, salt] {
        match part {
            None => h.update([0u8]),
            Some(s) => {
                h.update([1u8]);
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    Some(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every recorded case SGLang's own trees published (but ids past 32
    /// bits, which no vocabulary has and `Score` does not take): the same
    /// hashes, page by page; EAGLE's pages from the prompt's bigrams.
    #[test]
    fn reproduces_what_sglang_publishes() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/hash-vectors/sglang-0.5.23-hashes.json"
        );
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut checked = 0;
        for case in &cases {
            let wide = case["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t.as_u64().unwrap() > u64::from(u32::MAX));
            if wide {
                continue;
            }
            let ids = |v: &serde_json::Value| -> Vec<u32> {
                v.as_array()
                    .map(|a| a.iter().map(|t| t.as_u64().unwrap() as u32).collect())
                    .unwrap_or_default()
            };
            // The whole prompt (a prefix stored before it included).
            let tokens = ids(&case["token_ids"]);
            let page = case["page_size"].as_u64().unwrap() as usize;
            let format = match case["format"].as_str().unwrap() {
                "dynamo" => Format::Dynamo,
                _ => Format::Sglang,
            };
            let lora = !case["lora_name"].is_null();
            if lora {
                let uuid = lora_uuid(
                    case["lora_name"].as_str().unwrap(),
                    case["lora_path"].as_str().unwrap(),
                );
                assert_eq!(uuid, case["lora_uuid"].as_str().unwrap(), "{}", case["id"]);
            }
            let scope = Scope {
                cache_salt: case["cache_salt"].as_str(),
                extra_key: case["radix_extra_key"].as_str(),
                // Named by the request (not only loaded: SGLang's own
                // format then publishes the base hashes).
                lora: lora && case["lora_registration"] == "request",
            };
            let got = if case["is_eagle"].as_bool().unwrap() {
                page_hashes(&crate::keys::bigram_words(&tokens), 2 * page, format, scope)
            } else {
                page_hashes(&tokens, page, format, scope)
            };
            let want: Vec<u64> = case["block_hashes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_i64().unwrap() as u64)
                .collect();
            assert_eq!(got, want, "{}", case["id"]);
            checked += 1;
        }
        assert_eq!(checked, 80, "every case but wide ids");
    }
}

//! How a model's blocks are keyed: our token-chained keys, or the engine's
//! own block hashes.
//!
//! In engine mode a prompt's keys are exactly the 64-bit hashes vLLM puts on
//! the wire, so an event's blocks are indexed by their `block_hashes` the
//! moment they arrive: no parent lookup, no tokens needed (CPU offload events
//! carry none). Blocks whose engine hash we cannot reproduce on the request
//! side (a LoRA adapter whose path vLLM hashed but events do not carry, and no
//! `--lora-path` for it) keep token keys, on both sides.

use std::collections::HashMap;

use crate::keys::engine_hash::{EngineHasher, ExtraKeyStyle};
use crate::keys::multimodal::{self, MmItem};
use crate::keys::sglang_hash;
use crate::keys::{multimodal_prompt_keys, prompt_keys, request_root_seed, BlockKey};

#[derive(Clone, Debug)]
pub struct EngineKeys {
    pub hasher: EngineHasher,
    /// LoRA adapter name -> the path vLLM was given for it (hashed since 0.31).
    pub lora_paths: HashMap<String, String>,
    /// Treat a pod's cached set as prefix-closed: holding block k of a prompt
    /// implies holding blocks 0..k (vLLM evicts descendants first).
    pub assume_prefix_closed: bool,
    /// After a pod's first few, check one in this many eligible stores'
    /// hashes against our own (0 = never).
    pub self_check_every: u32,
}

impl EngineKeys {
    /// Whether requests (and events) of this adapter can use engine keys.
    pub fn lora_keyable(&self, lora: Option<&str>) -> bool {
        match lora {
            None => true,
            // SGLang names an adapter by an id made of its name and path.
            Some(name) if self.hasher.algo().sglang().is_some() => {
                self.lora_paths.contains_key(name)
            }
            Some(name) => {
                self.hasher.style() == ExtraKeyStyle::Bare || self.lora_paths.contains_key(name)
            }
        }
    }

    fn lora_path<'a>(&'a self, name: &'a str) -> &'a str {
        self.lora_paths.get(name).map_or("", String::as_str)
    }
}

#[derive(Clone, Debug, Default)]
pub enum KeyMode {
    #[default]
    Token,
    Engine(Box<EngineKeys>),
}

impl KeyMode {
    /// An explicit encoding of only what changes this mode's keys: token
    /// keys depend on nothing configurable; engine keys on the hasher and
    /// the LoRA paths (sorted). Scoring-only settings (prefix closure, the
    /// self-check) are left out, so changing them keeps a snapshot valid.
    pub fn key_fingerprint(&self) -> String {
        match self {
            KeyMode::Token => "token".to_owned(),
            KeyMode::Engine(e) => {
                let mut lora: Vec<String> = e
                    .lora_paths
                    .iter()
                    .map(|(name, path)| format!("{}={}:{}={}", name.len(), name, path.len(), path))
                    .collect();
                lora.sort();
                format!("engine:{}:[{}]", e.hasher.describe(), lora.join(","))
            }
        }
    }

    pub fn engine(&self) -> Option<&EngineKeys> {
        match self {
            KeyMode::Token => None,
            KeyMode::Engine(e) => Some(e),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            KeyMode::Token => "token",
            KeyMode::Engine(_) => "engine",
        }
    }

    /// Keys of a prompt's full blocks, and whether they are engine hashes.
    /// `mm_items`: the prompt's multimodal items, sorted (see
    /// `multimodal::sorted_items`).
    ///
    /// Engine hashes of blocks with multimodal items follow vLLM's tagged
    /// style (>= 0.31); with the bare style a prompt's keys stop before the
    /// first block an item touches, so it never matches more than a pod
    /// holds.
    pub fn request_keys(
        &self,
        model: &str,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        tokens: &[u32],
        block_size: usize,
        mm_items: &[MmItem],
    ) -> (Vec<BlockKey>, bool) {
        let engine = self.engine().filter(|e| e.lora_keyable(lora_name));
        match (engine, engine.and_then(|e| e.hasher.algo().sglang())) {
            (Some(e), Some(format)) => {
                let uuid = lora_name.map(|n| sglang_hash::lora_uuid(n, e.lora_path(n)));
                let scope = sglang_hash::Scope {
                    cache_salt,
                    extra_key: uuid.as_deref(),
                    lora: uuid.is_some(),
                };
                // SGLang's events carry no item keys.
                let keyable = before_first_item(tokens, mm_items, block_size);
                let keys = sglang_hash::page_hashes(keyable, block_size, format, scope)
                    .into_iter()
                    .map(BlockKey)
                    .collect();
                (keys, true)
            }
            (Some(e), None) => {
                let lora = lora_name.map(|n| (n, e.lora_path(n)));
                let (first, rest) = e.hasher.request_extras(lora, cache_salt);
                let digests = if mm_items.is_empty() || block_size == 0 {
                    e.hasher.prompt_digests(tokens, block_size, &first, &rest)
                } else {
                    // vLLM's order: adapter, items, salt (block 0's).
                    let salt = &first[rest.len()..];
                    let per_block = |i: usize| {
                        let start = i * block_size;
                        let pairs = multimodal::block_extras(mm_items, start, start + block_size);
                        let mut extras = rest.clone();
                        extras.extend(EngineHasher::mm_extras(&pairs));
                        if i == 0 {
                            extras.extend_from_slice(salt);
                        }
                        std::borrow::Cow::Owned(extras)
                    };
                    // The bare style: only the blocks before the first item.
                    let keyable = match e.hasher.style() {
                        ExtraKeyStyle::Tagged => tokens,
                        ExtraKeyStyle::Bare => before_first_item(tokens, mm_items, block_size),
                    };
                    e.hasher.prompt_digests_each(keyable, block_size, per_block)
                };
                let keys = digests.iter().map(|d| BlockKey(d.wire().0)).collect();
                (keys, true)
            }
            _ if !mm_items.is_empty() => (
                multimodal_prompt_keys(model, lora_name, cache_salt, tokens, block_size, mm_items),
                false,
            ),
            _ => {
                let seed = request_root_seed(model, lora_name, cache_salt);
                (prompt_keys(seed, tokens, block_size), false)
            }
        }
    }
}

/// The full blocks of `tokens` before the block its first multimodal item
/// touches (all of them without items): what keys whose items cannot be
/// hashed cover, so that they never claim more than a pod holds.
fn before_first_item<'t>(tokens: &'t [u32], mm_items: &[MmItem], block_size: usize) -> &'t [u32] {
    match mm_items.first() {
        Some(first) if block_size > 0 => {
            &tokens[..(first.offset as usize / block_size) * block_size]
        }
        _ => tokens,
    }
}

/// Key modes by model, with a default.
#[derive(Clone, Debug, Default)]
pub struct KeySchemes {
    pub default: KeyMode,
    pub per_model: HashMap<String, KeyMode>,
}

impl KeySchemes {
    /// Every model in engine mode with `hasher` and no LoRA paths.
    pub fn engine(
        hasher: EngineHasher,
        assume_prefix_closed: bool,
        self_check_every: u32,
    ) -> KeySchemes {
        KeySchemes {
            default: KeyMode::Engine(Box::new(EngineKeys {
                hasher,
                lora_paths: HashMap::new(),
                assume_prefix_closed,
                self_check_every,
            })),
            per_model: HashMap::new(),
        }
    }

    pub fn for_model(&self, model: &str) -> &KeyMode {
        self.per_model.get(model).unwrap_or(&self.default)
    }
}

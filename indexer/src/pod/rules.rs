//! What a pod's store events mean before any block is held: which events
//! count (full-attention groups only), the block sizes they teach, the
//! engine-hash self-check, and how their blocks are keyed (engine hashes,
//! or token keys with the adapter and extra keys folded in).
//!
//! Why a module of its own: these are vLLM's rules, not the index's, and
//! the tests' model of the index (`model`) applies the same ones as `pod`
//! does.

use std::collections::HashSet;

use crate::event::{is_full_attention_kind, BlockStored, EngineHash, ExtraKey};
use crate::keys::scheme::{EngineKeys, KeyMode};
use crate::keys::{chain, fold_extras, BlockKey, KeyScope};
use crate::pod::ApplyStats;

/// Every pod's first stores are checked, then one in `self_check_every`.
const ALWAYS_CHECKED_STORES: u64 = 8;

/// One pod's rule state: what its events taught about it.
#[derive(Debug, Default)]
pub(crate) struct StoreRules {
    /// `group_idx` values a store declared to be sliding-window, mamba...:
    /// removals for them (which carry no kind) are ignored too.
    pub non_full_groups: HashSet<u32>,
    pub block_size: Option<u32>,
    /// Its pages are EAGLE's bigrams (`BlockStored::bigram`).
    pub bigram: bool,
    /// Offloaded block size in tokens, as token-less stores give it (older
    /// vLLM; newer ones send 0): see `offload`.
    pub offload_block_size: Option<u32>,
    /// Engine mode: stores eligible for the hash self-check seen so far.
    checkable_stores: u64,
    check_buf: Vec<u8>,
}

/// How a store's blocks are to be held, once the rules let it through.
pub(crate) enum StorePlan<'e> {
    /// Nothing to hold (counted in the stats where it is a fault).
    Skip,
    /// No tokens: blocks offloaded to another tier, known by hash. With
    /// `engine`, a block the pod does not hold is keyed by its hash; else
    /// it cannot be keyed.
    TierOnly { engine: bool },
    /// Engine keys: each block's key is its hash.
    Engine,
    /// Token keys, chained from the parent's key (or the root seed).
    Tokens(TokenKeying<'e>),
}

impl StoreRules {
    /// Whether the removals of `group` are ignored (not full attention).
    pub fn skips_removal(&self, group: Option<u32>) -> bool {
        group.is_some_and(|g| self.non_full_groups.contains(&g))
    }

    /// The plan for `ev` under `mode`: learns its block sizes and groups,
    /// counts what it skips and self-checks engine hashes.
    pub fn plan<'e>(
        &mut self,
        ev: &'e BlockStored,
        mode: &KeyMode,
        stats: &mut ApplyStats,
    ) -> StorePlan<'e> {
        if self.skip_group(ev.group_idx, ev.kv_cache_spec_kind.as_deref()) {
            stats.non_full_attention_events += 1;
            return StorePlan::Skip;
        }
        let n = ev.block_hashes.len();
        if n == 0 {
            return StorePlan::Skip;
        }
        let named_lora = named_lora(ev);
        // Engine keys unless this adapter's hashes cannot be reproduced.
        let engine = mode
            .engine()
            .filter(|e| e.lora_keyable(named_lora.as_deref()));
        if ev.token_ids.is_empty() {
            if let Some(size) = ev.block_size.filter(|s| *s > 0) {
                self.offload_block_size = Some(size);
            }
            return StorePlan::TierOnly {
                engine: engine.is_some(),
            };
        }
        // Ids per unit of a block: two for EAGLE's bigrams.
        let words = if ev.bigram { 2 } else { 1 };
        let block_size = match ev.block_size {
            Some(bs) if bs > 0 && ev.token_ids.len() == n * bs as usize * words => bs as usize,
            None if ev.token_ids.len().is_multiple_of(n * words) => ev.token_ids.len() / n / words,
            _ => {
                stats.malformed_stores += 1;
                return StorePlan::Skip;
            }
        };
        self.block_size = Some(block_size as u32);
        self.bigram = ev.bigram;
        // A block's ids.
        let block_words = block_size * words;
        if let Some(engine) = engine {
            self.self_check(ev, block_words, engine, stats);
            return StorePlan::Engine;
        }
        // An adapter known only by id (old wire forms) gets a marker that can
        // never equal a requested name: such blocks never match a prompt.
        let lora = named_lora.or_else(|| ev.lora_id.map(|id| format!("\0lora-id:{id}")));
        // Most stores carry no extra keys past the adapter's: nothing to
        // fold per block then (a filtered copy of none was a tenth of
        // keying a block).
        let extras = salt_of(ev).is_some()
            || ev.extra_keys.as_ref().is_some_and(|v| {
                v.iter()
                    .flatten()
                    .any(|e| !non_lora_extras(e, lora.as_deref(), ev.lora_id).is_empty())
            });
        StorePlan::Tokens(TokenKeying {
            ev,
            lora,
            block_size: block_words,
            extras,
        })
    }

    fn skip_group(&mut self, group: Option<u32>, kind: Option<&str>) -> bool {
        match (group, kind) {
            (Some(g), Some(k)) if !is_full_attention_kind(k) => {
                self.non_full_groups.insert(g);
                true
            }
            (None, Some(k)) => !is_full_attention_kind(k),
            (Some(g), None) => self.non_full_groups.contains(&g),
            _ => false,
        }
    }

    /// Recomputes (sampled) a prompt-start store's hashes from its tokens:
    /// a mismatch means our algorithm or seed is not the pod's.
    fn self_check(
        &mut self,
        ev: &BlockStored,
        block_size: usize,
        engine: &EngineKeys,
        stats: &mut ApplyStats,
    ) {
        // Only stores whose hash inputs we know fully: a chain start (the
        // wire carries parents truncated to 64 bits), no adapter, and extra
        // keys present and empty (old wire forms omit them, salt included;
        // SGLang's have none, and name a salt beside them: in its own
        // format a request's bare extra key changes no hash, in the dynamo
        // format it does and is named nowhere, so those are never checked).
        let sglang = engine.hasher.algo().sglang();
        let extras_known = match sglang {
            Some(crate::keys::sglang_hash::Format::Dynamo) => false,
            Some(_) => salt_of(ev).is_none() && ev.extra_keys.is_none(),
            None => ev
                .extra_keys
                .as_ref()
                .is_some_and(|v| v.iter().all(|e| e.as_ref().is_none_or(|e| e.is_empty()))),
        };
        let plain = ev.parent_block_hash.is_none()
            && ev.lora_name.is_none()
            && ev.lora_id.is_none()
            && extras_known;
        if !plain || engine.self_check_every == 0 {
            return;
        }
        self.checkable_stores += 1;
        if self.checkable_stores > ALWAYS_CHECKED_STORES
            && !self
                .checkable_stores
                .is_multiple_of(u64::from(engine.self_check_every))
        {
            return;
        }
        stats.engine_hash_checks += 1;
        if let Some(format) = sglang {
            let scope = crate::keys::sglang_hash::Scope::default();
            let ours =
                crate::keys::sglang_hash::page_hashes(&ev.token_ids, block_size, format, scope);
            if ours.iter().zip(&ev.block_hashes).any(|(a, b)| *a != b.0) {
                stats.engine_hash_mismatches += 1;
            }
            return;
        }
        let hasher = &engine.hasher;
        let mut parent = hasher.none_hash();
        for (hash, tokens) in ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(block_size))
        {
            parent = hasher.block_digest(&mut self.check_buf, &parent, tokens, &[]);
            if parent.wire() != *hash {
                stats.engine_hash_mismatches += 1;
                return;
            }
        }
    }
}

/// How a token-keyed store's blocks get their keys: each from its parent's
/// key and its tokens, extra keys (images, a salt) folded in, the adapter in
/// the root seed of a chain's first block.
pub(crate) struct TokenKeying<'e> {
    ev: &'e BlockStored,
    lora: Option<String>,
    /// Ids per block (a bigram page's are twice its units).
    block_size: usize,
    /// Some block has extra keys besides the adapter's.
    extras: bool,
}

impl<'e> TokenKeying<'e> {
    /// The key a chain's first block is chained from, for `model`.
    pub fn root_seed(&self, model: &str) -> u64 {
        let extras = if self.extras {
            self.extras_of(0)
        } else {
            Vec::new()
        };
        let bigram;
        let model = if self.ev.bigram {
            bigram = crate::keys::bigram_scope(model);
            bigram.as_str()
        } else {
            model
        };
        KeyScope {
            model,
            lora_name: self.lora.as_deref(),
            first_block_extras: &extras,
        }
        .root_seed()
    }

    /// Each block's (engine hash, key) from block `first` on, chained from
    /// `prev`: the key of the block before it (the parent's key, or
    /// `root_seed`, for block 0).
    pub fn keys_from(
        &self,
        first: usize,
        mut prev: u64,
    ) -> impl Iterator<Item = (EngineHash, BlockKey)> + '_ {
        let under_parent = self.ev.parent_block_hash.is_some();
        self.ev
            .block_hashes
            .iter()
            .zip(self.ev.token_ids.chunks_exact(self.block_size))
            .enumerate()
            .skip(first)
            .map(move |(i, (hash, tokens))| {
                let mut key = chain(prev, tokens);
                // Block 0 of a prompt had its extras folded into the root seed.
                if self.extras && (i > 0 || under_parent) {
                    key = fold_extras(key, &self.extras_of(i));
                }
                prev = key.0;
                (*hash, key)
            })
    }

    /// Whether the blocks' keys are made of nothing their engine hashes
    /// do not cover: no adapter (older vLLM hashes an adapter by its id,
    /// which two pods may give different adapters) and no extra keys. A
    /// block such a store names by a hash the index has is then the block
    /// the index has, with its key: the hash covers the parent's hash and
    /// the tokens, as the key covers the parent's key and the tokens.
    pub fn names_fix_keys(&self) -> bool {
        self.lora.is_none() && !self.extras
    }

    fn extras_of(&self, i: usize) -> Vec<ExtraKey> {
        let block = self
            .ev
            .extra_keys
            .as_ref()
            .and_then(|v| v.get(i))
            .and_then(|e| e.as_deref())
            .unwrap_or(&[]);
        let mut extras = non_lora_extras(block, self.lora.as_deref(), self.ev.lora_id);
        // A salt named beside the blocks (SGLang) is a prompt's block 0's,
        // last, as a request's salt is (vLLM's order: adapter, items, salt).
        if i == 0 && self.ev.parent_block_hash.is_none() {
            extras.extend(salt_of(self.ev).map(|s| ExtraKey::Str(s.to_owned())));
        }
        extras
    }
}

/// The cache salt a store names beside its blocks (SGLang); empty is none,
/// as SGLang treats it.
fn salt_of(ev: &BlockStored) -> Option<&str> {
    ev.cache_salt.as_deref().filter(|s| !s.is_empty())
}

/// The LoRA adapter a store names: `lora_name`, else a tagged
/// `("lora", name, ...)` extra key.
fn named_lora(ev: &BlockStored) -> Option<String> {
    if let Some(name) = &ev.lora_name {
        return Some(name.clone());
    }
    let first = ev
        .extra_keys
        .as_ref()
        .and_then(|v| v.first())
        .and_then(|e| e.as_deref())
        .unwrap_or(&[]);
    for extra in first {
        if let ExtraKey::List(items) = extra {
            if let [ExtraKey::Str(tag), ExtraKey::Str(name), ..] = items.as_slice() {
                if tag == "lora" {
                    return Some(name.clone());
                }
            }
        }
    }
    None
}

/// A block's extra keys minus the LoRA markers (the LoRA is in the root seed),
/// with tagged cache salts `("cache_salt", s)` reduced to the bare salt, the
/// form a request's salt takes.
fn non_lora_extras(extras: &[ExtraKey], lora: Option<&str>, lora_id: Option<i64>) -> Vec<ExtraKey> {
    extras
        .iter()
        .filter(|e| match e {
            ExtraKey::Str(s) => Some(s.as_str()) != lora,
            ExtraKey::Int(i) => Some(*i) != lora_id,
            ExtraKey::List(items) => {
                !matches!(items.first(), Some(ExtraKey::Str(t)) if t == "lora")
            }
            _ => true,
        })
        .map(|e| match e {
            ExtraKey::List(items) => match items.as_slice() {
                [ExtraKey::Str(tag), salt @ ExtraKey::Str(_)] if tag == "cache_salt" => {
                    salt.clone()
                }
                _ => e.clone(),
            },
            _ => e.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys as every block's extras were folded before the shortcut (a
    /// filtered copy of each block's extra keys, folded in past block 0),
    /// chained from `prev`, or from the root seed with block 0's extras.
    fn folded_each_block(k: &TokenKeying<'_>, model: &str, prev: Option<u64>) -> Vec<u64> {
        let mut prev = prev.unwrap_or_else(|| {
            KeyScope {
                model,
                lora_name: k.lora.as_deref(),
                first_block_extras: &k.extras_of(0),
            }
            .root_seed()
        });
        (0..k.ev.block_hashes.len())
            .map(|i| {
                let tokens = &k.ev.token_ids[i * k.block_size..(i + 1) * k.block_size];
                let mut key = chain(prev, tokens);
                if i > 0 || k.ev.parent_block_hash.is_some() {
                    key = fold_extras(key, &k.extras_of(i));
                }
                prev = key.0;
                key.0
            })
            .collect()
    }

    /// A store's adapter name, adapter id and per-block extra keys.
    type Extras = (
        Option<&'static str>,
        Option<i64>,
        Option<Vec<Option<Vec<ExtraKey>>>>,
    );

    #[test]
    fn keys_skip_extra_keys_only_when_every_block_has_none() {
        let lora = ExtraKey::List(vec![
            ExtraKey::Str("lora".into()),
            ExtraKey::Str("sql".into()),
        ]);
        let salt = ExtraKey::List(vec![
            ExtraKey::Str("cache_salt".into()),
            ExtraKey::Str("s".into()),
        ]);
        let image = ExtraKey::Bytes(vec![7; 8]);
        let cases: Vec<Extras> = vec![
            (None, None, None),
            (None, None, Some(vec![None, None, None])),
            (None, None, Some(vec![Some(vec![]), None, Some(vec![])])),
            // Only the adapter, tagged or bare, or by id: nothing to fold.
            (
                None,
                None,
                Some(vec![
                    Some(vec![lora.clone()]),
                    Some(vec![lora.clone()]),
                    None,
                ]),
            ),
            (
                Some("sql"),
                None,
                Some(vec![Some(vec![ExtraKey::Str("sql".into())]); 3]),
            ),
            (None, Some(3), Some(vec![Some(vec![ExtraKey::Int(3)]); 3])),
            // A salt on block 0, an image past it, both beside an adapter.
            (
                None,
                None,
                Some(vec![Some(vec![lora.clone(), salt.clone()]), None, None]),
            ),
            (
                Some("sql"),
                None,
                Some(vec![None, Some(vec![image.clone()]), None]),
            ),
            (
                None,
                Some(3),
                Some(vec![
                    Some(vec![ExtraKey::Int(3), salt]),
                    None,
                    Some(vec![image]),
                ]),
            ),
        ];
        let mut with_extras = 0;
        for (lora_name, lora_id, extra_keys) in cases {
            for parent in [None, Some(EngineHash(9))] {
                let ev = BlockStored {
                    block_hashes: (1..=3).map(EngineHash).collect(),
                    parent_block_hash: parent,
                    token_ids: (0..12).collect(),
                    block_size: Some(4),
                    lora_name: lora_name.map(str::to_owned),
                    lora_id,
                    extra_keys: extra_keys.clone(),
                    ..BlockStored::default()
                };
                let mut stats = ApplyStats::default();
                let plan = StoreRules::default().plan(&ev, &KeyMode::Token, &mut stats);
                let StorePlan::Tokens(keying) = plan else {
                    panic!("token keyed");
                };
                with_extras += usize::from(keying.extras);
                // A parent's key, or the root seed.
                let parent_key = parent.map(|_| 0x5eed);
                let prev = parent_key.unwrap_or_else(|| keying.root_seed("m"));
                let got: Vec<u64> = keying.keys_from(0, prev).map(|(_, k)| k.0).collect();
                assert_eq!(
                    got,
                    folded_each_block(&keying, "m", parent_key),
                    "{lora_name:?} {lora_id:?} {extra_keys:?} {parent:?}"
                );
            }
        }
        assert_eq!(with_extras, 6, "the last three cases fold extras");
    }
}

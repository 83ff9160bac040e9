//! The index as a test oracle: each pod's blocks in a `BTreeMap` by engine
//! hash, and Score's rules block by block. Written to be read, not to be
//! fast: what the run layout (`index`, fed by `pod`, answered by `score`)
//! must agree with on every history the property tests draw.
//!
//! A pod holds a block on a tier while it has stored it there more times
//! than it removed it (vLLM can store a hash twice and remove it twice); a
//! block keeps the key it was first stored with. What an event means before
//! any block is held is `pod::rules`, which the model shares with the
//! service: those rules are vLLM's, tested on their own.

use std::collections::BTreeMap;

use crate::event::{BlockRemoved, BlockStored, EventBatch, KvEvent, Tier, TierMask, TIERS};
use crate::keys::scheme::KeyMode;
use crate::pod::rules::{StorePlan, StoreRules};
use crate::pod::ApplyStats;
use crate::score::{chunked_match, PrefixMatch, TierWeights};

/// One block a pod holds: its key and how many stores of it on each tier
/// are not removed yet.
#[derive(Clone, Debug)]
struct Block {
    key: u64,
    stores: [u32; TIERS],
}

/// One pod.
pub struct Pod {
    model: String,
    rules: StoreRules,
    blocks: BTreeMap<u64, Block>,
}

impl Pod {
    pub fn new(model: &str) -> Pod {
        Pod {
            model: model.to_owned(),
            rules: StoreRules::default(),
            blocks: BTreeMap::new(),
        }
    }

    pub fn apply(&mut self, batch: &EventBatch, mode: &KeyMode) -> ApplyStats {
        let mut stats = ApplyStats::default();
        for event in &batch.events {
            match event {
                KvEvent::Stored(ev) => self.store(ev, mode, &mut stats),
                KvEvent::Removed(ev) => self.remove(ev, &mut stats),
                KvEvent::AllCleared => {
                    self.blocks.clear();
                    stats.clears += 1;
                }
            }
        }
        stats
    }

    fn store(&mut self, ev: &BlockStored, mode: &KeyMode, stats: &mut ApplyStats) {
        let tier = ev.tier();
        let hashes: Vec<u64> = ev.block_hashes.iter().map(|h| h.0).collect();
        match self.rules.plan(ev, mode, stats) {
            StorePlan::Skip => {}
            StorePlan::TierOnly { engine } => {
                for h in hashes {
                    if !engine && !self.blocks.contains_key(&h) {
                        stats.unkeyable_blocks += 1;
                        continue;
                    }
                    self.put(h, h, tier);
                    stats.stored_blocks += 1;
                }
            }
            StorePlan::Engine => {
                for h in hashes {
                    self.put(h, h, tier);
                    stats.stored_blocks += 1;
                }
            }
            StorePlan::Tokens(keying) => {
                let prev = match ev.parent_block_hash {
                    None => keying.root_seed(&self.model),
                    // A parent held under its hash has no token key to
                    // chain from.
                    Some(p) => match self.blocks.get(&p.0) {
                        Some(b) if b.key != p.0 => b.key,
                        _ => {
                            stats.parent_unknown_blocks += hashes.len() as u64;
                            return;
                        }
                    },
                };
                let keyed: Vec<(u64, u64)> =
                    keying.keys_from(0, prev).map(|(h, k)| (h.0, k.0)).collect();
                for (h, key) in keyed {
                    self.put(h, key, tier);
                    stats.stored_blocks += 1;
                }
            }
        }
    }

    fn put(&mut self, hash: u64, key: u64, tier: Tier) {
        let block = self.blocks.entry(hash).or_insert(Block {
            key,
            stores: [0; TIERS],
        });
        block.stores[tier.index()] += 1;
    }

    fn remove(&mut self, ev: &BlockRemoved, stats: &mut ApplyStats) {
        if self.rules.skips_removal(ev.group_idx) {
            stats.non_full_attention_events += 1;
            return;
        }
        let t = ev.tier().index();
        for h in &ev.block_hashes {
            let Some(block) = self.blocks.get_mut(&h.0).filter(|b| b.stores[t] > 0) else {
                stats.unknown_removals += 1;
                continue;
            };
            block.stores[t] -= 1;
            stats.removed_blocks += 1;
            if block.stores.iter().all(|s| *s == 0) {
                self.blocks.remove(&h.0);
            }
        }
    }

    /// Distinct engine hashes held, per tier.
    pub fn held_per_tier(&self) -> [u64; TIERS] {
        std::array::from_fn(|t| self.blocks.values().filter(|b| b.stores[t] > 0).count() as u64)
    }

    /// The key of the block held as `hash`.
    pub fn key_of(&self, hash: u64) -> Option<u64> {
        self.blocks.get(&hash).map(|b| b.key)
    }

    /// The tiers holding a block keyed `key`.
    pub fn tiers(&self, key: u64) -> TierMask {
        let mut mask = TierMask::default();
        for b in self.blocks.values().filter(|b| b.key == key) {
            for tier in Tier::ALL {
                if b.stores[tier.index()] > 0 {
                    mask.0 |= 1 << tier.index();
                }
            }
        }
        mask
    }
}

/// A pod's match for a prompt under Score's rules, from the tiers holding
/// each of its blocks: the leading blocks held on any tier; with
/// `closure`, every block up to the deepest one held on GPU (vLLM evicts a
/// GPU block only after its descendants), counted on GPU besides where it
/// is known; with chunks of `chunk` > 1 blocks, what vLLM's offloading
/// connector loads past the GPU hit.
pub fn pod_match(
    held: &[TierMask],
    chunk: u32,
    closure: bool,
    weights: &TierWeights,
) -> PrefixMatch {
    let gpu = TierMask(1 << Tier::Gpu.index());
    let walked = held.iter().take_while(|m| !m.is_empty()).count();
    let mut gpu_run = held.iter().take_while(|m| m.contains(Tier::Gpu)).count();
    let mut matched: Vec<TierMask> = held[..walked].to_vec();
    if closure {
        let from = if chunk > 1 { gpu_run } else { walked };
        if let Some(d) = (from..held.len())
            .rev()
            .find(|&i| held[i].contains(Tier::Gpu))
        {
            if chunk > 1 {
                gpu_run = d + 1;
            } else {
                matched = held[..=d].iter().map(|m| TierMask(m.0 | gpu.0)).collect();
            }
        }
    }
    if chunk > 1 {
        return chunked_match(held.len() as u32, chunk, gpu_run as u32, weights, |i| {
            held[i as usize]
        });
    }
    let mut m = PrefixMatch {
        matched_blocks: matched.len() as u32,
        ..PrefixMatch::default()
    };
    for mask in matched {
        let mut best: Option<Tier> = None;
        for tier in mask.tiers() {
            m.blocks_per_tier[tier.index()] += 1;
            if best.is_none_or(|b| weights.get(tier) > weights.get(b)) {
                best = Some(tier);
            }
        }
        if let Some(b) = best {
            m.best_tier_blocks[b.index()] += 1;
        }
    }
    m.weighted_blocks = Tier::ALL
        .iter()
        .map(|t| f64::from(m.best_tier_blocks[t.index()]) * weights.get(*t))
        .sum();
    m
}

//! One pod's events onto the run layout (`runs`): the rules `pod` applies
//! to the service's index today, with no per-block map of the pod's own.
//!
//! Why: the run layout keeps each (pod, block) entry once, as a span of a
//! shared run; the service's pods keep a map from engine hash per pod
//! beside the shared index, which is most of its memory and half of each
//! block's work. What that map answers the runs answer too:
//! - a parent's key (a token-keyed store chains from it) and whether a
//!   tier-only store's block is known: `RunIndex::key_held_by`, which
//!   reads only this pod's spans, so another pod's claim to a hash never
//!   keys this pod's blocks;
//! - removals per (engine hash, tier), repeated stores counted: the runs'
//!   own table and repeat counts;
//! - blocks per tier: the runs' per-pod counts.
//!
//! What an event means before any block is held (groups that are not full
//! attention, block sizes, the engine-hash self-check, LoRA and extra keys)
//! is `pod::rules`, shared with `pod`, so the two cannot drift apart.
//!
//! A model's blocks go to one of two indexes by how they are keyed
//! (`KeyedRuns`): engine hashes, or token keys. An engine-keyed model's
//! blocks under an adapter whose hashes cannot be reproduced are token
//! keyed (see `scheme`), so its pods can hold blocks in both.
//!
//! Where it differs from `pod` (neither happens with vLLM's own streams,
//! whose pods name only blocks they stored):
//! - token keys: a removal of an engine hash the pod never stored, naming
//!   a block it holds under another hash, releases that block (the runs'
//!   table is shared; `pod` counts it unknown);
//! - token keys: a block whose engine hash another pod gave a different
//!   block is not stored (`ApplyStats::hash_conflicts`); per-pod maps
//!   never meet.
//!
//! Not yet used by the service: see BENCHMARKS.md, "fourteenth session".

use crate::event::{BlockRemoved, BlockStored, EventBatch, KvEvent, Tier, TIERS};
use crate::keys::BlockKey;
use crate::pod::rules::{StorePlan, StoreRules};
use crate::pod::ApplyStats;
use crate::runs::RunIndex;
use crate::scheme::KeyMode;
use crate::score::TierWeights;

/// A model's blocks, by how they are keyed.
pub struct KeyedRuns {
    /// Engine keys: each block's key is its engine hash.
    pub engine: RunIndex,
    /// Token keys (and engine-keyed models' unreproducible adapters).
    pub token: RunIndex,
}

impl KeyedRuns {
    /// Both indexes, answering best tiers as `weights` rank them (ties in
    /// `Tier::ALL` order, as a score weighs them), `bounded` if a capacity
    /// evicts from them (see `RunIndex::bounded`).
    pub fn new(weights: &TierWeights, bounded: bool) -> Self {
        let mut better = Tier::ALL;
        better.sort_by(|a, b| weights.get(*b).total_cmp(&weights.get(*a)));
        let made = |ix: RunIndex| {
            let ix = ix.with_best_tiers(better);
            if bounded {
                ix.bounded()
            } else {
                ix
            }
        };
        KeyedRuns {
            engine: made(RunIndex::new()),
            token: made(RunIndex::with_token_keys()),
        }
    }

    /// The index a prompt's keys are looked up in: `engine_keys` as
    /// `KeyMode::request_keys` says.
    pub fn for_request(&self, engine_keys: bool) -> &RunIndex {
        if engine_keys {
            &self.engine
        } else {
            &self.token
        }
    }
}

/// One pod's state beside its blocks in the runs.
pub struct PodFeed {
    pod: u32,
    model: String,
    rules: StoreRules,
}

impl PodFeed {
    /// `pod`: its id in the runs (below 2^30).
    pub fn new(pod: u32, model: impl Into<String>) -> Self {
        PodFeed {
            pod,
            model: model.into(),
            rules: StoreRules::default(),
        }
    }

    /// Block size learned from this pod's stores.
    pub fn block_size(&self) -> Option<u32> {
        self.rules.block_size
    }

    pub fn offload_block_size(&self) -> Option<u32> {
        self.rules.offload_block_size
    }

    /// Applies `batch`'s events in order.
    pub fn apply(&mut self, runs: &KeyedRuns, batch: &EventBatch, mode: &KeyMode) -> ApplyStats {
        let mut stats = ApplyStats::default();
        for event in &batch.events {
            match event {
                KvEvent::Stored(ev) => self.store(runs, ev, mode, &mut stats),
                KvEvent::Removed(ev) => self.remove(runs, ev, mode, &mut stats),
                KvEvent::AllCleared => self.clear(runs, &mut stats),
            }
        }
        stats
    }

    /// The blocks the pod holds on each tier, over both indexes.
    pub fn held_per_tier(&self, runs: &KeyedRuns) -> [u64; TIERS] {
        let (e, t) = (
            runs.engine.held_per_tier(self.pod),
            runs.token.held_per_tier(self.pod),
        );
        std::array::from_fn(|i| e[i] + t[i])
    }

    /// Our key of a block the pod holds, by its engine hash.
    pub fn key_of(&self, runs: &KeyedRuns, hash: u64) -> Option<BlockKey> {
        runs.token
            .key_held_by(self.pod, hash)
            .or_else(|| runs.engine.key_held_by(self.pod, hash))
            .map(BlockKey)
    }

    pub fn store(
        &mut self,
        runs: &KeyedRuns,
        ev: &BlockStored,
        mode: &KeyMode,
        stats: &mut ApplyStats,
    ) {
        let tier = ev.tier();
        let n = ev.block_hashes.len();
        let parent = ev.parent_block_hash.map(|p| p.0);
        match self.rules.plan(ev, mode, stats) {
            StorePlan::Skip => {}
            StorePlan::TierOnly { engine } => self.store_tier_only(runs, ev, engine, stats),
            StorePlan::Engine => {
                let hashes: Vec<u64> = ev.block_hashes.iter().map(|h| h.0).collect();
                runs.engine.store(self.pod, tier, parent, &hashes);
                stats.stored_blocks += n as u64;
            }
            StorePlan::Tokens(keying) => {
                let prev = match parent {
                    None => keying.root_seed(&self.model),
                    Some(p) => match runs.token.key_held_by(self.pod, p) {
                        Some(key) => key,
                        None => {
                            stats.parent_unknown_blocks += n as u64;
                            return;
                        }
                    },
                };
                let blocks: Vec<(u64, u64)> = keying.keys(prev).map(|(h, k)| (h.0, k.0)).collect();
                let skipped = runs.token.store_keyed(self.pod, tier, parent, &blocks);
                stats.stored_blocks += (n - skipped) as u64;
                stats.hash_conflicts += skipped as u64;
            }
        }
    }

    /// Blocks offloaded to `ev`'s tier, named by hash alone. A block the
    /// pod holds gets the tier where it is; a new one is keyed by its hash
    /// if `engine` (under the block before it if the event is a chain, else
    /// as a chain's start: vLLM's offloading connectors list what one step
    /// stored, from several chains' middles), else it cannot be keyed.
    fn store_tier_only(
        &self,
        runs: &KeyedRuns,
        ev: &BlockStored,
        engine: bool,
        stats: &mut ApplyStats,
    ) {
        let tier = ev.tier();
        let chained = ev.parent_block_hash.is_some();
        let mut parent = ev.parent_block_hash.map(|p| p.0);
        for hash in ev.block_hashes.iter().map(|h| h.0) {
            let under = parent.replace(hash).filter(|_| chained);
            if let Some(key) = runs.token.key_held_by(self.pod, hash) {
                let skipped = runs.token.store_keyed(self.pod, tier, None, &[(hash, key)]);
                debug_assert_eq!(skipped, 0, "a block the pod holds");
            } else if engine || runs.engine.key_held_by(self.pod, hash).is_some() {
                runs.engine.store(self.pod, tier, under, &[hash]);
            } else {
                stats.unkeyable_blocks += 1;
                continue;
            }
            stats.stored_blocks += 1;
        }
    }

    pub fn remove(
        &mut self,
        runs: &KeyedRuns,
        ev: &BlockRemoved,
        mode: &KeyMode,
        stats: &mut ApplyStats,
    ) {
        if self.rules.skips_removal(ev.group_idx) {
            stats.non_full_attention_events += 1;
            return;
        }
        let tier = ev.tier();
        let hashes: Vec<u64> = ev.block_hashes.iter().map(|h| h.0).collect();
        let (first, second) = match mode {
            KeyMode::Engine(_) => (&runs.engine, &runs.token),
            KeyMode::Token => (&runs.token, &runs.engine),
        };
        let unknown = if second.entries(self.pod) == 0 {
            first.remove(self.pod, tier, &hashes)
        } else {
            // Some of the pod's blocks are keyed the other way: each
            // removal tried in both, the usual one first.
            hashes
                .iter()
                .map(|h| {
                    let missed = first.remove(self.pod, tier, std::slice::from_ref(h));
                    if missed == 0 {
                        0
                    } else {
                        second.remove(self.pod, tier, std::slice::from_ref(h))
                    }
                })
                .sum()
        };
        stats.removed_blocks += (hashes.len() - unknown) as u64;
        stats.unknown_removals += unknown as u64;
    }

    /// Drops every block of this pod.
    pub fn clear(&mut self, runs: &KeyedRuns, stats: &mut ApplyStats) {
        runs.engine.clear(self.pod);
        runs.token.clear(self.pod);
        stats.clears += 1;
    }
}

#[cfg(test)]
mod tests;

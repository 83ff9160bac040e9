//! One pod's events onto its model's index: the rules vLLM's events
//! follow (`rules`: groups that are not full attention, block sizes, the
//! engine-hash self-check, LoRA and extra keys), then the blocks stored,
//! removed or cleared in the runs (`index`), where the index keeps each
//! (pod, block) entry once, as a span of a shared run. What a per-pod map
//! from engine hash would answer the runs answer:
//! - a parent's key (a token-keyed store chains from it) and whether a
//!   tier-only store's block is known: `RunIndex::key_held_by`, which
//!   answers only for blocks this pod holds, so a block only other pods
//!   hold never keys this pod's stores;
//! - removals per (engine hash, tier), repeated stores counted: the runs'
//!   own table and repeat counts;
//! - blocks per tier: the runs' per-pod counts.
//!
//! A model's blocks go to one of two indexes by how they are keyed
//! (`KeyedRuns`): engine hashes, or token keys. An engine-keyed model's
//! blocks under an adapter whose hashes cannot be reproduced are token
//! keyed (see `keys::scheme`), so its pods can hold blocks in both.
//!
//! A block the pod holds keeps its key: a store of a hash the pod holds
//! keyed the other way gets the tier where it is. That takes what engine
//! keys take anyway: every pod of an engine-keyed model names a block alike
//! (one hash seed). Pods of several seeds there would give the token index
//! a block it cannot find by its key under the new name
//! (`RunIndex::store_keyed`), and `held_along` could miss it; their
//! first-miss answers would still be exact.
//!
//! Two cases a per-pod map would count otherwise (neither happens with
//! vLLM's own streams, whose pods name only blocks they stored):
//! - token keys: a removal of an engine hash the pod never stored, naming
//!   a block it holds under another hash, releases that block (the runs'
//!   table is shared);
//! - token keys: a block whose engine hash another pod gave a different
//!   block is not stored, nor the rest of its chain
//!   (`ApplyStats::hash_conflicts`).
//!
//! One writer per pod: its events and its evictions come from one thread,
//! so what a store reads of the pod (`key_held_by`) is still so when it
//! stores. The service's pods keep their rules' state here (`Indexer`'s
//! `PodInner`); their blocks are in their model's `KeyedRuns`.

pub(crate) mod rules;

use crate::event::{BlockRemoved, BlockStored, EventBatch, KvEvent, Tier, TIERS};
use crate::index::{RunIndex, MAX_POD};
use crate::keys::scheme::KeyMode;
use crate::keys::BlockKey;
use crate::score::TierWeights;
use rules::{StorePlan, StoreRules};

/// Interned pod identity: an index into the indexer's pod table, and the
/// pod's id in its model's runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodId(pub u32);

/// What applying events did, for metrics and `ListPods`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub clears: u64,
    /// Blocks of stores whose parent hash this pod never stored (or, for
    /// a token-keyed store, holds keyed by its hash: see `store`).
    pub parent_unknown_blocks: u64,
    /// Tier-only stores (no tokens) for hashes we do not know.
    pub unkeyable_blocks: u64,
    /// Removals of hashes (or tiers) this pod does not hold.
    pub unknown_removals: u64,
    /// Events for KV groups that are not full attention.
    pub non_full_attention_events: u64,
    /// Stores whose token count does not fit their block count and size.
    pub malformed_stores: u64,
    /// Engine mode: stores whose hashes we recomputed from their tokens.
    pub engine_hash_checks: u64,
    /// ...and found different: our algorithm or seed differs from the pod's.
    pub engine_hash_mismatches: u64,
    /// Token-keyed blocks not stored because another pod gave their engine
    /// hash to a different block, and the rest of their chain (keyed from
    /// them).
    pub hash_conflicts: u64,
}

impl ApplyStats {
    pub fn add(&mut self, o: &ApplyStats) {
        self.stored_blocks += o.stored_blocks;
        self.removed_blocks += o.removed_blocks;
        self.clears += o.clears;
        self.parent_unknown_blocks += o.parent_unknown_blocks;
        self.unkeyable_blocks += o.unkeyable_blocks;
        self.unknown_removals += o.unknown_removals;
        self.non_full_attention_events += o.non_full_attention_events;
        self.malformed_stores += o.malformed_stores;
        self.engine_hash_checks += o.engine_hash_checks;
        self.engine_hash_mismatches += o.engine_hash_mismatches;
        self.hash_conflicts += o.hash_conflicts;
    }
}

/// What a holding (a pod's part of a run on a tier) costs against a
/// capacity counted in entries. A run's own bookkeeping is about 400 bytes
/// whatever its length (in process; ~550 in the service's resident memory
/// for a run of one block, glibc's arenas included), against 30-60 per
/// block. Every run has a holding, so a capacity's budget per entry
/// (`BYTES_PER_ENTRY` in the service: 256) covers a run of one block at
/// 1 + 3 entries (`tests/it/memory.rs`: 137 bytes per unit; 202-238 before
/// the service fixed glibc's mmap threshold, `kv_indexer::malloc`), and
/// adds little where runs are long (a 1,000-block store is one holding).
pub const HOLDING_ENTRIES: u64 = 3;

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
    /// It stored into the engine-keyed / token-keyed index since its last
    /// clear (an eviction may have emptied it since): the index is read
    /// for it only then. Most models' pods use one index only.
    in_engine: bool,
    in_token: bool,
}

impl PodFeed {
    /// `pod`: its id in the runs, below `MAX_POD` (a holder is the pod
    /// and its tier in 32 bits).
    pub fn new(pod: u32, model: impl Into<String>) -> Self {
        assert!(pod < MAX_POD, "pod id {pod} out of the runs' range");
        PodFeed {
            pod,
            model: model.into(),
            rules: StoreRules::default(),
            in_engine: false,
            in_token: false,
        }
    }

    /// Block size learned from this pod's stores.
    pub fn block_size(&self) -> Option<u32> {
        self.rules.block_size
    }

    /// Its pages are EAGLE's bigrams.
    pub fn bigram(&self) -> bool {
        self.rules.bigram
    }

    pub fn offload_block_size(&self) -> Option<u32> {
        self.rules.offload_block_size
    }

    /// The (tier, block) entries it has, over both indexes: what a
    /// capacity counts and `evict` drops.
    pub fn entries(&self, runs: &KeyedRuns) -> u64 {
        self.held_per_tier(runs).iter().sum()
    }

    /// What it costs against a capacity counted in entries: its entries,
    /// and `HOLDING_ENTRIES` per holding (see `RunIndex::usage`).
    pub fn cost(&self, runs: &KeyedRuns) -> u64 {
        [Keying::Engine, Keying::Token]
            .into_iter()
            .filter(|k| self.may_hold(*k))
            .map(|k| {
                let (entries, holdings) = k.of(runs).usage(self.pod);
                entries + HOLDING_ENTRIES * holdings
            })
            .sum()
    }

    /// Drops up to `n` of its entries, least recently stored holdings
    /// first, leaf first (`RunIndex::evict`), from the index holding more
    /// of them first. Returns how many went.
    pub fn evict(&mut self, runs: &KeyedRuns, n: usize) -> usize {
        let (e, t) = (runs.engine.entries(self.pod), runs.token.entries(self.pod));
        let order = if e >= t {
            [Keying::Engine, Keying::Token]
        } else {
            [Keying::Token, Keying::Engine]
        };
        let mut evicted = 0;
        for keying in order {
            if evicted < n && self.may_hold(keying) {
                evicted += keying.of(runs).evict(self.pod, n - evicted).len();
            }
        }
        evicted
    }

    /// What its events taught of it (a snapshot keeps it): the groups that
    /// are not full attention (sorted), its block size and its offloaded
    /// block size.
    pub fn rules_state(&self) -> (Vec<u32>, Option<u32>, Option<u32>, bool) {
        let mut groups: Vec<u32> = self.rules.non_full_groups.iter().copied().collect();
        groups.sort_unstable();
        (
            groups,
            self.rules.block_size,
            self.rules.offload_block_size,
            self.rules.bigram,
        )
    }

    /// Takes back what `rules_state` gave.
    pub fn restore_rules(
        &mut self,
        non_full_groups: &[u32],
        block_size: Option<u32>,
        offload_block_size: Option<u32>,
        bigram: bool,
    ) {
        self.rules.non_full_groups = non_full_groups.iter().copied().collect();
        self.rules.block_size = block_size;
        self.rules.offload_block_size = offload_block_size;
        self.rules.bigram = bigram;
    }

    /// After the runs were restored from a dump: which indexes hold its
    /// blocks.
    pub fn restored(&mut self, runs: &KeyedRuns) {
        self.in_engine = runs.engine.entries(self.pod) > 0;
        self.in_token = runs.token.entries(self.pod) > 0;
    }

    /// Stores the blocks of a pod's record in a snapshot of format 2
    /// (older releases'): (engine hash, key, stores per tier), least
    /// recently stored first, with each one's parent hash (`parents`,
    /// parallel, or empty). A block keyed by its hash in an engine-keyed
    /// model goes to the engine keys, any other to the token keys; each is
    /// stored under its parent if the pod holds that in the same index,
    /// else as a run's start (keys are chained whatever the runs: lookups
    /// find it by its key).
    pub fn import_blocks(
        &mut self,
        runs: &KeyedRuns,
        blocks: &[crate::snapshot::SnapshotBlock],
        parents: &[Option<u64>],
        mode: &KeyMode,
    ) {
        let engine_mode = matches!(mode, KeyMode::Engine(_));
        for (i, &(hash, key, counts)) in blocks.iter().enumerate() {
            let keying = if engine_mode && key == hash {
                Keying::Engine
            } else {
                Keying::Token
            };
            let parent = parents
                .get(i)
                .copied()
                .flatten()
                .filter(|p| self.key_in(runs, keying, *p).is_some());
            for tier in Tier::ALL {
                for _ in 0..counts[tier.index()] {
                    if self.key_in(runs, keying, hash).is_some() {
                        // Held already (on another tier, or stored again):
                        // found by its name, as a store of it would be.
                        self.put(runs, keying, tier, None, &[(hash, key)]);
                    } else {
                        self.put(runs, keying, tier, parent, &[(hash, key)]);
                    }
                }
            }
        }
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
        self.key_in(runs, Keying::Token, hash)
            .or_else(|| self.key_in(runs, Keying::Engine, hash))
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
        let parent = ev.parent_block_hash.map(|p| p.0);
        match self.rules.plan(ev, mode, stats) {
            StorePlan::Skip => {}
            StorePlan::TierOnly { engine } => self.store_tier_only(runs, ev, engine, stats),
            // Most pods of an engine-keyed model: one chain, hashes as keys.
            StorePlan::Engine if !self.in_token => {
                self.in_engine = true;
                let hashes: Vec<u64> = ev.block_hashes.iter().map(|h| h.0).collect();
                runs.engine.store(self.pod, tier, parent, &hashes);
                stats.stored_blocks += hashes.len() as u64;
            }
            StorePlan::Engine => {
                let blocks: Vec<(u64, u64)> = ev.block_hashes.iter().map(|h| (h.0, h.0)).collect();
                self.store_chain(runs, Keying::Engine, tier, parent, &blocks, stats);
            }
            StorePlan::Tokens(keying) => {
                // A parent keyed by its hash (in the engine index) has no
                // token key to chain from, as in `pod`.
                let prev = match parent {
                    None => keying.root_seed(&self.model),
                    Some(p) => match self.key_in(runs, Keying::Token, p) {
                        Some(key) => key,
                        None => {
                            stats.parent_unknown_blocks += ev.block_hashes.len() as u64;
                            return;
                        }
                    },
                };
                // The blocks the index has by these hashes have the keys
                // it has: not computed again (most of a store is a prefix
                // other pods stored). Only where the hashes cover all the
                // keys are made of.
                let mut blocks: Vec<(u64, u64)> = Vec::with_capacity(ev.block_hashes.len());
                if keying.names_fix_keys() {
                    let engines: Vec<u64> = ev.block_hashes.iter().map(|h| h.0).collect();
                    let mut known = Vec::with_capacity(engines.len());
                    runs.token.keys_along(parent, &engines, &mut known);
                    blocks.extend(engines.iter().copied().zip(known));
                }
                let from = blocks.last().map_or(prev, |&(_, k)| k);
                blocks.extend(
                    keying
                        .keys_from(blocks.len(), from)
                        .map(|(h, k)| (h.0, k.0)),
                );
                self.store_chain(runs, Keying::Token, tier, parent, &blocks, stats);
            }
        }
    }

    /// Stores `blocks` ((engine hash, key) each) on `tier` as a chain
    /// under `under` in `keying`'s index. A block the pod holds keeps its
    /// key and gets the tier where it is, as a held hash keeps its key in
    /// `pod`; that matters only once the pod holds blocks keyed both ways
    /// (an engine-keyed model's offload by hash, then the block stored
    /// under an adapter it cannot engine key), and only then is each block
    /// looked up first.
    fn store_chain(
        &mut self,
        runs: &KeyedRuns,
        keying: Keying,
        tier: Tier,
        mut under: Option<u64>,
        blocks: &[(u64, u64)],
        stats: &mut ApplyStats,
    ) {
        let other = keying.other();
        if !self.may_hold(other) {
            let skipped = self.put(runs, keying, tier, under, blocks);
            stats.stored_blocks += (blocks.len() - skipped) as u64;
            stats.hash_conflicts += skipped as u64;
            return;
        }
        for (i, &(hash, key)) in blocks.iter().enumerate() {
            if let Some(held) = self.key_in(runs, other, hash) {
                self.put(runs, other, tier, None, &[(hash, held)]);
                under = None;
            } else {
                let held = self.key_in(runs, keying, hash);
                let at = if held.is_some() { None } else { under };
                if self.put(runs, keying, tier, at, &[(hash, held.unwrap_or(key))]) > 0 {
                    // The rest is keyed from the one not stored.
                    stats.hash_conflicts += (blocks.len() - i) as u64;
                    return;
                }
                under = Some(hash);
            }
            stats.stored_blocks += 1;
        }
    }

    /// Stores `blocks` as one chain under `under` in `keying`'s index;
    /// returns how many were not (see `RunIndex::store_keyed`).
    fn put(
        &mut self,
        runs: &KeyedRuns,
        keying: Keying,
        tier: Tier,
        under: Option<u64>,
        blocks: &[(u64, u64)],
    ) -> usize {
        match keying {
            Keying::Engine => {
                self.in_engine = true;
                let hashes: Vec<u64> = blocks.iter().map(|(h, _)| *h).collect();
                runs.engine.store(self.pod, tier, under, &hashes);
                0
            }
            Keying::Token => {
                self.in_token = true;
                runs.token.store_keyed(self.pod, tier, under, blocks)
            }
        }
    }

    /// Whether the pod may hold blocks in `keying`'s index (it stored some
    /// there since its last clear): the other index is read only then.
    fn may_hold(&self, keying: Keying) -> bool {
        match keying {
            Keying::Engine => self.in_engine,
            Keying::Token => self.in_token,
        }
    }

    /// The key of the block `hash` names in `keying`'s index, if the pod
    /// holds it there.
    fn key_in(&self, runs: &KeyedRuns, keying: Keying, hash: u64) -> Option<u64> {
        if !self.may_hold(keying) {
            return None;
        }
        keying.of(runs).key_held_by(self.pod, hash)
    }

    /// Blocks offloaded to `ev`'s tier, named by hash alone. A block the
    /// pod holds gets the tier where it is; a new one is keyed by its hash
    /// if `engine` (under the block before it if the event is a chain, else
    /// as a chain's start: vLLM's offloading connectors list what one step
    /// stored, from several chains' middles), else it cannot be keyed.
    fn store_tier_only(
        &mut self,
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
            if let Some(key) = self.key_in(runs, Keying::Token, hash) {
                let skipped = self.put(runs, Keying::Token, tier, None, &[(hash, key)]);
                debug_assert_eq!(skipped, 0, "a block the pod holds");
            } else if engine || self.key_in(runs, Keying::Engine, hash).is_some() {
                self.put(runs, Keying::Engine, tier, under, &[(hash, hash)]);
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
        // The index the model's blocks are usually keyed in first.
        let first = match mode {
            KeyMode::Engine(_) => Keying::Engine,
            KeyMode::Token => Keying::Token,
        };
        let (one, two) = (first.of(runs), first.other().of(runs));
        let unknown = if !self.may_hold(first.other()) {
            if self.may_hold(first) {
                one.remove(self.pod, tier, &hashes)
            } else {
                hashes.len()
            }
        } else {
            // Some of the pod's blocks are keyed the other way: each
            // removal tried in both.
            hashes
                .iter()
                .map(|h| {
                    let missed = one.remove(self.pod, tier, std::slice::from_ref(h));
                    if missed == 0 {
                        0
                    } else {
                        two.remove(self.pod, tier, std::slice::from_ref(h))
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
        (self.in_engine, self.in_token) = (false, false);
        stats.clears += 1;
    }
}

/// Which of `KeyedRuns`' indexes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Keying {
    Engine,
    Token,
}

impl Keying {
    fn other(self) -> Keying {
        match self {
            Keying::Engine => Keying::Token,
            Keying::Token => Keying::Engine,
        }
    }

    fn of(self, runs: &KeyedRuns) -> &RunIndex {
        match self {
            Keying::Engine => &runs.engine,
            Keying::Token => &runs.token,
        }
    }
}

#[cfg(test)]
mod tests;

//! The index: which pod holds which block, on which tier, with runs of a
//! chain as its unit. One per model and key kind, fed by `pod`, read by
//! `score`.
//!
//! - `write`: the writer's runs and table; `write/store`, `write/remove`
//!   (removals, clears) and `write/evict` (each pod's store order, and
//!   eviction by it) change them;
//! - `published`: what readers see of the runs, with no lock;
//! - `read`: lookups (`prefix_matches`, `held_along`);
//! - `dump`: the index as data, for snapshots, and back.
//!
//! Why runs: an index with an entry per (pod, block) (a map per pod from
//! engine hash, a table of holders per block) costs every applied block
//! two random cache misses, and a lookup a probe per block. Both peers
//! do at least one per block, which is why the
//! comparison bench's floor (one hash-map operation per block) caps them.
//! Here the unit is a *run*: a stretch of one chain's distinct blocks, side
//! by side, shared by every pod that holds any of them. Per distinct block
//! the index keeps one table slot, its key in the run and a holder count;
//! per (pod, tier, run) the spans of the run the pod holds, usually one.
//! So:
//! - a pod storing blocks others hold already walks the run (the next
//!   block is compared with the run's next hash, no probe) and widens its
//!   span: work per run, not per block;
//! - a removal finds its block by the same table (vLLM names removals by
//!   hash), and the next one, evicted leaf first, is the run's previous
//!   block: compared, not probed;
//! - a lookup probes once per run and finds where it leaves the run by
//!   binary search (keys are chained: two chains that differ at a block
//!   differ at every block after it), then reads each holder's span;
//! - memory per (pod, block) is a share of what the block costs once, plus
//!   a span per (pod, run).
//!
//! Readers take no lock and write nothing shared but `arc-swap`'s own
//! per-thread slots (see `published`); writers take turns (one mutex), which
//! costs little: applying is a small part of ingesting (the service's
//! profile: messaging and wake-ups bound it, not the index).
//!
//! Keys are the engine hashes (`store`), or computed from the blocks'
//! tokens (`with_token_keys`, `store_tokens`), removals still naming
//! engine hashes: the writer's table is by engine hash, runs hold keys.
//!
//! A pod holds blocks per tier (a holder is a pod and a tier); a lookup
//! answers each pod's leading blocks on any tier and how many of those are
//! on each.
//!
//! A second store of a block its holder holds is counted (vLLM can store a
//! hash twice and remove it twice): the block stays until the last
//! removal.
//!
//! Beyond first-miss answers, `held_along` lists every stretch of a prompt
//! each pod holds, per tier, wherever it is: what Score's other rules read
//! (prefix closure, offloaded chunks, speculative entries).
//!
//! Bounded by eviction: the least recently stored holdings lose their
//! blocks first, leaf first (`evict`, with per-pod entry counts for a
//! capacity policy to compare; `write/evict`). Saved and restored as data, run by
//! run (`dump`). Answers count each block's best tier, what a score
//! weighs (`with_best_tiers`). Keys the caller computed (adapters, images)
//! are taken as given (`store_keyed`).
//!
//! A run costs about 400 bytes of its own whatever its length, so each
//! pod's holdings are counted (`usage`) for a capacity to charge: blocks
//! stored one by one are each a run. BENCHMARKS.md ("The index against
//! its peers") has its numbers against the peers.

mod dump;
mod published;
mod read;
mod write;

pub use dump::{Dump, DumpError, DumpView, HoldingRecord, RepeatRecord, Restore, RunRecord};
pub use read::head_probes;

use parking_lot::Mutex;

use crate::event::{Tier, TIERS};
use published::{tier_of, Arena, Counts, Heads, Held, View, TIER_BITS};
use write::Writer;

/// Pods' blocks by chain runs; see the module doc for what it covers.
pub struct RunIndex {
    heads: Heads,
    published: Arena,
    writer: Mutex<Writer>,
    /// Tier indices, best first (`RunMatch::best_tier`).
    better: [usize; TIERS],
}

impl Default for RunIndex {
    fn default() -> Self {
        RunIndex {
            heads: Heads::default(),
            published: Arena::default(),
            writer: Mutex::default(),
            better: std::array::from_fn(|t| t),
        }
    }
}

impl RunIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Ranks the tiers for `RunMatch::best_tier`: `better` names them all,
    /// best first (by default, in `Tier::ALL`'s order).
    pub fn with_best_tiers(mut self, better: [Tier; TIERS]) -> Self {
        let order = better.map(Tier::index);
        let mut seen = order;
        seen.sort_unstable();
        assert!(
            seen.iter().enumerate().all(|(i, t)| i == *t),
            "every tier once"
        );
        self.better = order;
        self
    }

    /// Distinct blocks indexed (held, or dead but followed by a held one).
    pub fn blocks(&self) -> usize {
        self.writer.lock().table.len()
    }

    /// An index whose keys are not the engine hashes: blocks are stored
    /// with `store_tokens` and keyed from their tokens, and removals still
    /// name engine hashes.
    pub fn with_token_keys() -> Self {
        let ix = Self::default();
        ix.writer.lock().token_keys = true;
        ix
    }

    /// For an index whose memory a capacity bounds by `evict`: each store
    /// then also restamps the pod's holdings up the prefix it was stored
    /// under, so that eviction never takes a block before the pod's blocks
    /// under it (a few more reads per store: 5-9% of applying, measured).
    /// Without it `evict` still works, and answers still only shorten, but
    /// a prefix a pod stored once may go before the branches it later
    /// stored under it.
    pub fn bounded(self) -> Self {
        self.writer.lock().bounded = true;
        self
    }

    /// `pod` stored `hashes` on `tier`, a chain under `parent` (the block
    /// before the first, if it has one); the engine hashes are the keys.
    pub fn store(&self, pod: u32, tier: Tier, parent: Option<u64>, hashes: &[u64]) {
        let mut w = self.writer.lock();
        debug_assert!(!w.token_keys, "store_tokens");
        let at = parent.and_then(|p| w.table.find(p));
        w.store(
            &self.heads,
            &self.published,
            holder(pod, tier),
            at,
            hashes.iter().map(|h| (*h, *h)),
        );
        w.publish(&self.published);
    }

    /// `pod` stored the blocks `engines` name on `tier`, a chain under
    /// `parent`, with `tokens` (`block_size` per block): each keyed from
    /// its parent's key (`root_seed` for a chain's first block), as a
    /// prompt's keys are (`keys::prompt_keys`). Returns how many blocks
    /// were not stored: all of them if the parent is unknown, the tokens
    /// do not fit or the index is not `with_token_keys`, or from a block
    /// whose engine hash names another block.
    #[allow(clippy::too_many_arguments)]
    pub fn store_tokens(
        &self,
        pod: u32,
        tier: Tier,
        parent: Option<u64>,
        engines: &[u64],
        tokens: &[u32],
        block_size: usize,
        root_seed: u64,
    ) -> usize {
        if block_size == 0 || tokens.len() != engines.len() * block_size {
            return engines.len();
        }
        let mut w = self.writer.lock();
        // An index of engine keys has no room for other names.
        if !w.token_keys {
            return engines.len();
        }
        let (at, mut prev) = match parent {
            None => (None, root_seed),
            Some(p) => match w.table.find(p).zip(w.key_of(p)) {
                Some(found) => (Some(found.0), found.1),
                None => return engines.len(),
            },
        };
        let blocks = engines
            .iter()
            .zip(tokens.chunks_exact(block_size))
            .map(|(e, t)| {
                prev = crate::keys::chain(prev, t).0;
                (*e, prev)
            });
        let skipped = w.store(&self.heads, &self.published, holder(pod, tier), at, blocks);
        w.publish(&self.published);
        skipped
    }

    /// `pod` stored on `tier` the blocks `blocks` names, (engine hash,
    /// key) each, keyed by the caller (token keys whose blocks carry more
    /// than tokens: an adapter, images), a chain under the block `parent`
    /// names. Returns how many blocks were not stored: all of them if the
    /// parent is unknown (the caller keyed them from a parent key the
    /// index does not have, and a block already in a run under another
    /// engine hash could not be found by its key: only runs' first blocks
    /// are) or the index is not `with_token_keys`, or from a block whose
    /// engine hash names another block on.
    pub fn store_keyed(
        &self,
        pod: u32,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[(u64, u64)],
    ) -> usize {
        let mut w = self.writer.lock();
        if !w.token_keys {
            return blocks.len();
        }
        let at = match parent.map(|p| w.table.find(p)) {
            None => None,
            Some(Some(at)) => Some(at),
            Some(None) => return blocks.len(),
        };
        let skipped = w.store(
            &self.heads,
            &self.published,
            holder(pod, tier),
            at,
            blocks.iter().copied(),
        );
        w.publish(&self.published);
        skipped
    }

    /// `pod` removed from `tier` the blocks its engine hashes `hashes`
    /// name; unknown ones (or ones it does not hold there) are counted in
    /// the result, not applied.
    pub fn remove(&self, pod: u32, tier: Tier, hashes: &[u64]) -> usize {
        let mut w = self.writer.lock();
        let unknown = w.remove(&self.heads, holder(pod, tier), hashes);
        w.publish(&self.published);
        unknown
    }

    /// Everything the index holds, as data (see `dump`). It is copied under
    /// the writer's lock: stores wait meanwhile, and the copy is about the
    /// size of the index.
    pub fn dump(&self) -> Dump {
        self.writer.lock().dump()
    }

    /// An index holding what `dump` does, with token keys or not (a dump
    /// of the other kind is refused). A dump that breaks any rule the
    /// index keeps (a block named twice, spans out of order, a dead last
    /// block...) is refused as a whole.
    pub fn from_dump(dump: Dump, token_keys: bool) -> Result<RunIndex, DumpError> {
        let ix = if token_keys {
            RunIndex::with_token_keys()
        } else {
            RunIndex::new()
        };
        ix.writer.lock().restore(&ix.heads, &ix.published, dump)?;
        Ok(ix)
    }

    /// Restores `dump` into this index, which must hold nothing yet (its
    /// best tiers and bound stay as built): `from_dump` in place.
    pub fn restore(&self, dump: Dump) -> Result<(), DumpError> {
        self.writer
            .lock()
            .restore(&self.heads, &self.published, dump)
    }

    /// The index as a `Dump` serializes, read run by run under the
    /// writer's lock, which it holds: stores wait until it is dropped.
    pub fn dump_view(&self) -> DumpView<'_> {
        DumpView(self.writer.lock())
    }

    /// `restore` a run at a time, as a dump is read from a file: begin,
    /// each run in the dump's order, end. On an error the index holds
    /// part of the dump: drop it (or clear its pods).
    pub fn restore_begin(&self, token_keys: bool, clock: u32) -> Result<Restore, DumpError> {
        self.writer.lock().restore_begin(token_keys, clock)
    }

    pub fn restore_run(&self, restore: &mut Restore, run: RunRecord) -> Result<(), DumpError> {
        self.writer
            .lock()
            .restore_run(&self.heads, &self.published, restore, run)
    }

    pub fn restore_end(
        &self,
        restore: Restore,
        repeats: Vec<RepeatRecord>,
    ) -> Result<(), DumpError> {
        self.writer
            .lock()
            .restore_end(&self.published, restore, repeats)
    }

    /// Drops up to `n` of `pod`'s (tier, block) entries to bound memory:
    /// from the holdings it stored into least recently, each leaf first,
    /// so its answers only shorten (see `bounded`). Returns each entry
    /// dropped, as (tier, key).
    pub fn evict(&self, pod: u32, n: usize) -> Vec<(Tier, u64)> {
        let mut dropped = Vec::new();
        let mut w = self.writer.lock();
        w.evict(&self.heads, pod, n, &mut dropped);
        w.publish(&self.published);
        drop(w);
        dropped
            .into_iter()
            .map(|(holder, key)| (Tier::ALL[usize::from(tier_of(holder))], key))
            .collect()
    }

    /// The (tier, block) entries `pod` has: what `evict` can drop.
    pub fn entries(&self, pod: u32) -> u64 {
        self.writer.lock().entries(pod).iter().sum()
    }

    /// `pod`'s entries (all tiers) and holdings (runs it holds part of,
    /// per tier): a run's own bookkeeping (its record, words, table slots,
    /// about 400 bytes) is paid per run whatever its length, and every run
    /// has a holding, so the holdings bound it where entries cannot (blocks
    /// stored one by one, each its own run, as offloads without a parent
    /// are).
    pub fn usage(&self, pod: u32) -> (u64, u64) {
        let w = self.writer.lock();
        (w.entries(pod).iter().sum(), w.holdings(pod))
    }

    /// The blocks `pod` has on each tier (`Tier::index` order).
    pub fn held_per_tier(&self, pod: u32) -> [u64; TIERS] {
        self.writer.lock().entries(pod)
    }

    /// The key of the block engine hash `e` names, if `pod` holds it on
    /// some tier: what a store under it, or a tier-only store of it, is
    /// keyed from. Only blocks the pod holds: a hash no block of the pod
    /// goes by never keys its stores. (With token keys a block can go by
    /// several pods' hashes, and any of them finds it: see `pod`.)
    pub fn key_held_by(&self, pod: u32, e: u64) -> Option<u64> {
        self.writer.lock().key_held_by(pod, e)
    }

    /// Token keys: the keys of the leading blocks of a store (under the
    /// block engine hash `parent` names, if any) that the index has under
    /// the same engine hashes (`engines`, in chain order), appended to
    /// `out` (none if the parent is unknown). What a store whose keys its
    /// engine hashes fix (see `pod`) need not compute from its tokens
    /// again: most of a store is a prefix other pods stored.
    pub fn keys_along(&self, parent: Option<u64>, engines: &[u64], out: &mut Vec<u64>) {
        let w = self.writer.lock();
        if w.token_keys {
            w.keys_along(parent, engines, out);
        }
    }

    /// Drops everything `pod` holds, on every tier (its cache was cleared).
    pub fn clear(&self, pod: u32) {
        let mut w = self.writer.lock();
        w.clear(&self.heads, pod);
        w.publish(&self.published);
    }
}

/// What a pod holds of a prompt: its leading blocks held on any tier, and
/// of those, how many on each tier and how many have each tier as the best
/// one holding them (see `RunIndex::with_best_tiers`; a score weighs each
/// block by its best tier).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RunMatch {
    pub pod: u32,
    pub blocks: u32,
    pub per_tier: [u32; TIERS],
    pub best_tier: [u32; TIERS],
}

/// Pod ids are below this: a holder is a pod and its tier in 32 bits.
pub const MAX_POD: u32 = u32::MAX >> TIER_BITS;

/// The stretches of a prompt one pod holds (see `RunIndex::held_along`):
/// (tier, start, end) in prompt positions, end excluded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldAlong {
    pub pod: u32,
    pub spans: Vec<(Tier, u32, u32)>,
}

/// A holder: one pod's blocks on one tier.
fn holder(pod: u32, tier: Tier) -> u32 {
    debug_assert!(pod < MAX_POD);
    pod << TIER_BITS | tier.index() as u32
}

#[cfg(test)]
mod tests;

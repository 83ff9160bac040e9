//! One pod's (one cache domain's) view in the former per-block index:
//! engine hash -> our key and per-tier counts, and how its events change
//! that index. The service now uses `pod_feed`; this stays as the reference
//! its property test compares with. What the events mean, before any block
//! is held, is `rules`, which both use.
//!
//! Invariants:
//! - a pod's events are applied in order, by one applier at a time (the
//!   caller holds the pod's lock), so this state needs no inner locking;
//! - `(pod, key, tier)` is in the `BlockIndex` exactly while some engine hash
//!   of this pod maps to `key` with a non-zero count on `tier`. vLLM can store
//!   the same hash twice and remove it twice, so counts, not flags;
//! - a block whose parent is unknown cannot be keyed. It is counted and
//!   skipped; nothing else is touched.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use crate::block_map::{BlockMap, Column, Entry};
use crate::closure::Closure;
use rules::{StorePlan, StoreRules};

use crate::event::{BlockRemoved, BlockStored, EngineHash, Tier, TIERS};
use crate::index::{BlockIndex, Change, PodId};
use crate::keys::BlockKey;
use crate::repeats::Repeats;
use crate::scheme::KeyMode;
use crate::snapshot::SnapshotBlock;

/// One held engine hash: 8 bytes, so a pod's map entry (hash and block)
/// is 16. The entries are most of the index's memory (one per pod and
/// block) and each change touches one at random: at 40 bytes (our key, the
/// parent's hash, incarnation numbers and a stamp inline) they took 2.5
/// times the memory and a cache line held 1.6 of them, not 4.
///
/// What the rest of the pod needs of a block lives elsewhere, only where
/// it is needed: its key in `PodState::keys` (only once some key differs
/// from its engine hash, i.e. token keys), its store stamp in
/// `PodState::stamps` (only under a capacity).
///
/// An entry whose block left (removed, evicted) while held blocks are
/// still linked to it as their parent stays in its slot, out of the table:
/// *detached* (`BlockMap::insert_detached`), its `links` holding no tier,
/// only the count of those children. Its slot is not reused while any
/// child names it, so a child's `parent` slot always names the entry it was
/// linked to, and a child whose parent is detached is an orphan; the slot
/// is freed with the last such child. A block stored under a parent the pod
/// does not hold is linked to a new detached entry of that parent's hash.
/// (This replaced a parent hash and two incarnation numbers per entry.)
#[derive(Clone, Copy, Debug, Default)]
struct HeldBlock {
    /// The slot of the entry this block was stored under, if
    /// `links.has_parent()`.
    parent: u32,
    links: Links,
}

/// The tiers a block is held on, whether it has a parent, and how many held
/// blocks are linked to it as their parent, in one word (no tier: a
/// detached entry, see `HeldBlock`). A tier bit stands for the first store
/// on that tier; further stores of the same hash and tier (vLLM can store a
/// hash twice) are counted in `PodState::extra`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Links(u32);

const HAS_PARENT: u32 = 1 << TIERS;
const CHILD_SHIFT: u32 = TIERS as u32 + 1;
/// Children a block can count (2^28 - 1: more than any pod holds blocks).
const MAX_CHILDREN: u32 = u32::MAX >> CHILD_SHIFT;

impl Links {
    fn holds(self, tier: Tier) -> bool {
        self.0 & (1 << tier.index()) != 0
    }

    fn holds_any(self) -> bool {
        self.0 & ((1 << TIERS) - 1) != 0
    }

    fn hold(&mut self, tier: Tier) {
        self.0 |= 1 << tier.index();
    }

    fn release(&mut self, tier: Tier) {
        self.0 &= !(1 << tier.index());
    }

    fn has_parent(self) -> bool {
        self.0 & HAS_PARENT != 0
    }

    fn set_has_parent(&mut self) {
        self.0 |= HAS_PARENT;
    }

    fn children(self) -> u32 {
        self.0 >> CHILD_SHIFT
    }

    fn add_child(&mut self) {
        debug_assert!(self.children() < MAX_CHILDREN);
        self.0 += 1 << CHILD_SHIFT;
    }

    fn remove_child(&mut self) {
        debug_assert!(self.children() > 0);
        self.0 -= 1 << CHILD_SHIFT;
    }

    /// No tier, no parent: what a detached entry keeps (see `HeldBlock`).
    fn children_only(self) -> Links {
        Links(self.0 & !((1 << CHILD_SHIFT) - 1))
    }
}

/// The hash a detached entry stands under when nobody named the parent
/// (see `store_event`'s offloads): a snapshot keeps it as the parent, and a
/// restore links such a block to a detached entry again, never to a held
/// block that happens to have this hash.
const UNKNOWN_PARENT: EngineHash = EngineHash(0);

/// A store time: the pod's store clock in 32 bits. Stamps are compared as
/// ages from the clock (wrapping), which is exact while every age is below
/// 2^32: every `AGE_PASS` stores, `PodState::age_out` clamps ages above
/// `MAX_AGE` to it, so none grows past `MAX_AGE + AGE_PASS`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Stamp(u32);

const AGE_PASS: u64 = 1 << 30;
const MAX_AGE: u32 = 1 << 31;

/// A pod's blocks as a snapshot keeps them (see `snapshot::PodSnapshot`).
pub struct PodExport {
    pub blocks: Vec<SnapshotBlock>,
    /// Each block's parent hash, parallel to `blocks`.
    pub parents: Vec<Option<u64>>,
    pub non_full_groups: Vec<u32>,
}

/// What applying events did, for metrics and `ListPods`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub clears: u64,
    /// Blocks of stores whose parent hash this pod never stored (or, for
    /// a token-keyed store, holds keyed by its hash: see `store_event`).
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
    /// Run layout only (`pod_feed`): token-keyed blocks not stored because
    /// another pod gave their engine hash to a different block, and the
    /// rest of their chain (keyed from them).
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

pub struct PodState {
    id: PodId,
    model: String,
    by_hash: BlockMap<HeldBlock>,
    /// Each held block's key, by slot, once some block's key is not its
    /// engine hash (token keys; adapters engine keys cannot reproduce):
    /// until then `None`, and every key is its hash (engine keys).
    keys: Option<Column<u64>>,
    /// Each held block's store stamp, by slot: bounded pods only (only
    /// eviction reads them).
    stamps: Column<Stamp>,
    /// What its events taught about it (groups, block sizes, the
    /// self-check): vLLM's rules, shared with `pod_feed`.
    rules: StoreRules,
    held_per_tier: [u64; TIERS],
    /// Stores of a hash on a tier it already holds, beyond the first.
    extra: Repeats<EngineHash>,
    /// Store clock, and (slot in `by_hash`, stamp) in store order for
    /// eviction. An entry whose slot holds no block with that stamp any
    /// more was re-stored or removed since (a reused slot's block has a
    /// later stamp): skipped, and compacted away when they pile up. A
    /// block eviction reaches while it still has children is passed (see
    /// `released`). Slots, not hashes: 8 bytes an entry, not 16, and
    /// `order` holds one to two per held block.
    clock: u64,
    order: VecDeque<(u32, Stamp)>,
    /// Blocks whose `order` entry eviction passed while they had children
    /// (a prefix this pod still extends), and whose last child has gone
    /// since: evictable again, and older than anything left in `order`.
    /// By store time (the clock's, so the heap's order never changes),
    /// oldest first; stale entries are skipped as `order`'s are.
    released: BinaryHeap<Reverse<(u64, u32)>>,
    /// Under a capacity limit: `by_hash` keeps its size under churn (see
    /// `make_room`). Also the only case that needs `order`.
    bounded: bool,
    /// Bounded: the capacity `by_hash` was last sized to (`make_room`).
    table_capacity: usize,
    /// Links to detached entries (see `HeldBlock`): held blocks whose
    /// parent is not held (and, within an event, the next block's link made
    /// in advance when its parent could not count it). 0 means the held set
    /// is prefix-closed, which lets scoring binary-search it (see `score`).
    orphans: u64,
    /// Index changes of the event being applied, flushed to the index in
    /// one batch at its end (`BlockIndex::apply`).
    pending: Vec<Change>,
    /// What readers are told of this pod's closure, and its last value.
    closure: Arc<Closure>,
    published: Option<Tier>,
}

/// A bounded pod's table doubles once its live entries fill more than this
/// (num, den) of its capacity, else is rebuilt at the same size when full
/// (see `PodState::make_room`): 61% of its buckets, where rebuilding moves
/// ~0.3 entries per insert (a simulation of hashbrown under churn: 0.24 at
/// 59% load, 0.65 at 68%, 1.7 at 76%), each a read of the entry's hash.
const GROW_AT: (usize, usize) = (7, 10);

impl PodState {
    pub fn new(id: PodId, model: impl Into<String>) -> Self {
        PodState {
            id,
            model: model.into(),
            by_hash: BlockMap::default(),
            keys: None,
            stamps: Column::default(),
            rules: StoreRules::default(),
            held_per_tier: [0; TIERS],
            extra: Repeats::default(),
            clock: 0,
            order: VecDeque::new(),
            released: BinaryHeap::new(),
            bounded: false,
            table_capacity: 0,
            orphans: 0,
            pending: Vec::new(),
            closure: Arc::default(),
            published: Some(Tier::Gpu),
        }
    }

    /// Where this pod publishes its closure for lock-free readers.
    pub fn closure(&self) -> Arc<Closure> {
        self.closure.clone()
    }

    /// For a capacity-bounded index (see `bounded`).
    pub fn bounded(mut self) -> Self {
        self.bounded = true;
        self
    }

    /// Room for one more entry; when bounded, made by us (see
    /// `make_room`). The check inline, the rest not: it runs on every
    /// stored block.
    #[inline]
    fn reserve_one(&mut self) {
        if self.bounded && self.by_hash.capacity() <= self.by_hash.len() + 1 {
            self.make_room();
        }
    }

    /// A bounded pod's table has no room left (removals leave tombstones,
    /// which use it up). hashbrown would rehash in place only while at
    /// most half full and otherwise double, so under churn at capacity the
    /// table would keep doubling; it was kept half full for that, and a
    /// share that ran ahead late still doubled it once (a 2-3 MB step in
    /// `tests/it/memory.rs`). Here it is rebuilt at the same size, which
    /// clears the tombstones, unless the live entries fill more than
    /// `GROW_AT` of it: then it doubles. Either way its memory is resident
    /// at once (see `regrow`).
    #[cold]
    fn make_room(&mut self) {
        let needed = self.by_hash.len() + 1;
        let size = if needed * GROW_AT.1 > self.table_capacity * GROW_AT.0 {
            (2 * self.table_capacity).max(2 * needed)
        } else {
            self.table_capacity
        };
        self.by_hash.regrow(size);
        self.table_capacity = self.by_hash.capacity();
    }

    /// Block size learned from this pod's stores.
    pub fn block_size(&self) -> Option<u32> {
        self.rules.block_size
    }

    pub fn offload_block_size(&self) -> Option<u32> {
        self.rules.offload_block_size
    }

    /// Our key of a block the pod holds, by its engine hash.
    pub fn key_of(&self, hash: EngineHash) -> Option<BlockKey> {
        let (slot, _) = self.by_hash.get_with_slot(&hash)?;
        Some(self.key_at(slot, hash))
    }

    /// The key of the block held as `hash` in `slot`.
    #[inline]
    fn key_at(&self, slot: u32, hash: EngineHash) -> BlockKey {
        key_in(&self.keys, slot, hash)
    }

    /// Distinct engine hashes held, per tier.
    pub fn held_per_tier(&self) -> [u64; TIERS] {
        self.held_per_tier
    }

    pub fn store(
        &mut self,
        index: &BlockIndex,
        ev: &BlockStored,
        mode: &KeyMode,
        stats: &mut ApplyStats,
    ) {
        self.store_event(ev, mode, stats);
        self.flush(index);
    }

    fn store_event(&mut self, ev: &BlockStored, mode: &KeyMode, stats: &mut ApplyStats) {
        let plan = self.rules.plan(ev, mode, stats);
        if matches!(plan, StorePlan::Skip) {
            return;
        }
        let tier = ev.tier();
        let n = ev.block_hashes.len();
        // Up front: a long document's changes otherwise grow the buffer,
        // copying it, a dozen times.
        self.pending.reserve(n);
        self.by_hash.touch(&ev.block_hashes);
        match plan {
            StorePlan::Skip => {}
            StorePlan::TierOnly { engine } => {
                // Offload to another tier: token mode needs the blocks known
                // by hash already; engine mode keys them by hash alone.
                //
                // With a named parent the event is a chain, as a GPU store
                // is. Without one (vLLM's offloading connectors name none)
                // it lists what one step stored: possibly blocks of several
                // chains, and from their middles. A block new to the pod
                // then has a parent nobody named: an orphan, so the pod is
                // walked block by block rather than binary-searched as if
                // the block began a chain.
                let chained = ev.parent_block_hash.is_some();
                let mut parent = ev.parent_block_hash;
                for hash in &ev.block_hashes {
                    let linked_to = parent.replace(*hash);
                    let held = self.by_hash.contains_key(hash);
                    if !engine && !held {
                        stats.unkeyable_blocks += 1;
                        continue;
                    }
                    // Usually a new tier for a held block: linked only if new.
                    let link = match linked_to {
                        _ if held => None,
                        Some(p) if chained => Some(self.link_to(p)),
                        _ => Some(self.detached_link(UNKNOWN_PARENT)),
                    };
                    self.store_block(*hash, BlockKey(hash.0), link, tier, false);
                    stats.stored_blocks += 1;
                }
            }
            StorePlan::Engine => {
                let mut link = ev.parent_block_hash.map(|p| self.link_to(p));
                for (i, hash) in ev.block_hashes.iter().enumerate() {
                    link = self.store_block(*hash, BlockKey(hash.0), link, tier, i + 1 < n);
                    stats.stored_blocks += 1;
                }
            }
            StorePlan::Tokens(keying) => {
                let prev = match ev.parent_block_hash {
                    None => keying.root_seed(&self.model),
                    Some(parent) => match self.key_of(parent) {
                        // A parent keyed by its hash (an engine-keyed
                        // model's block, stored or offloaded without the
                        // adapter) has no token key to chain from: its
                        // children's keys would be ones no prompt has.
                        Some(key) if key.0 != parent.0 => key.0,
                        _ => {
                            stats.parent_unknown_blocks += n as u64;
                            return;
                        }
                    },
                };
                let mut link = ev.parent_block_hash.map(|p| self.link_to(p));
                for (i, (hash, key)) in keying.keys(prev).enumerate() {
                    link = self.store_block(hash, key, link, tier, i + 1 < n);
                    stats.stored_blocks += 1;
                }
            }
        }
    }

    pub fn remove(&mut self, index: &BlockIndex, ev: &BlockRemoved, stats: &mut ApplyStats) {
        self.remove_event(ev, stats);
        self.flush(index);
    }

    fn remove_event(&mut self, ev: &BlockRemoved, stats: &mut ApplyStats) {
        if self.rules.skips_removal(ev.group_idx) {
            stats.non_full_attention_events += 1;
            return;
        }
        let tier = ev.tier();
        self.pending.reserve(ev.block_hashes.len());
        self.by_hash.touch(&ev.block_hashes);
        for hash in &ev.block_hashes {
            let Some(mut entry) = self.by_hash.find_entry(*hash) else {
                stats.unknown_removals += 1;
                continue;
            };
            let slot = entry.slot();
            let held = entry.get_mut();
            if !held.links.holds(tier) {
                stats.unknown_removals += 1;
                continue;
            }
            stats.removed_blocks += 1;
            if self.extra.take(*hash, tier) {
                continue;
            }
            held.links.release(tier);
            let key = key_in(&self.keys, slot, *hash);
            self.pending.push(Change::release(key, self.id, tier));
            self.held_per_tier[tier.index()] -= 1;
            if !held.links.holds_any() {
                let (slot, held) = entry.detach();
                self.unlink(slot, held);
            }
        }
    }

    /// Blocks as (hash, key, counts), least recently stored first (bounded
    /// pods; unbounded ones keep no stamps and list them by hash), and the
    /// groups known not to be full attention: what a snapshot keeps.
    pub fn export(&self) -> PodExport {
        let held = self.oldest_first();
        let blocks = held
            .iter()
            .map(|(slot, h, b)| (h.0, self.key_at(*slot, *h).0, self.counts(*h, b)))
            .collect();
        // A parent's hash is in its slot, held or detached (see `HeldBlock`).
        let parents = held
            .iter()
            .map(|(_, _, b)| {
                b.links
                    .has_parent()
                    .then(|| self.by_hash.any_at(b.parent).0 .0)
            })
            .collect();
        let mut non_full_groups: Vec<u32> = self.rules.non_full_groups.iter().copied().collect();
        non_full_groups.sort_unstable();
        PodExport {
            blocks,
            parents,
            non_full_groups,
        }
    }

    /// Restores what `export` returned. A pod that holds blocks already (a
    /// snapshot listing one pod twice) is cleared first: the last record
    /// wins; a hash listed twice in one record keeps its first listing.
    /// Without `parents` (snapshots written before they were kept) every
    /// block counts as an orphan, so the pod is walked block by block until
    /// those blocks are gone.
    pub fn import(
        &mut self,
        index: &BlockIndex,
        blocks: &[SnapshotBlock],
        parents: &[Option<u64>],
        non_full_groups: &[u32],
        block_size: Option<u32>,
        offload_block_size: Option<u32>,
    ) {
        if !self.by_hash.is_empty() {
            self.clear(index, &mut ApplyStats::default());
        }
        self.rules.block_size = block_size;
        self.rules.offload_block_size = offload_block_size;
        self.rules.non_full_groups = non_full_groups.iter().copied().collect();
        // Children may come before their parents: closed only once linked.
        self.closure.open();
        let known_parents = parents.len() == blocks.len();
        // (slot, parent hash if known) of each block stored under a parent,
        // linked once all are in (a parent re-stored after its child comes
        // later in store order).
        let mut links: Vec<(u32, Option<EngineHash>)> = Vec::new();
        for (i, (hash, key, counts)) in blocks.iter().enumerate() {
            let hash = EngineHash(*hash);
            if counts.iter().all(|c| *c == 0) {
                continue;
            }
            self.reserve_one();
            // Blocks come oldest first: stamps keep that order.
            let stamp = self.tick();
            let Entry::Vacant(vacant) = self.by_hash.entry(hash) else {
                continue;
            };
            let mut held = HeldBlock::default();
            for tier in Tier::ALL {
                let count = counts[tier.index()];
                if count > 0 {
                    held.links.hold(tier);
                    self.extra.set(hash, tier, count - 1);
                    self.pending
                        .push(Change::acquire(BlockKey(*key), self.id, tier));
                    self.held_per_tier[tier.index()] += 1;
                }
            }
            let slot = vacant.insert_with_slot(held).0;
            self.set_key(slot, hash, BlockKey(*key));
            if self.bounded {
                self.stamps.set(slot, stamp);
                self.order.push_back((slot, stamp));
            }
            // (A block listed as its own parent links to itself here: a
            // cycle, broken below like any other.)
            match parents.get(i).copied().flatten() {
                Some(p) => links.push((slot, Some(EngineHash(p)))),
                None if !known_parents => links.push((slot, None)),
                None => {}
            }
            if self.pending.len() >= 4096 {
                self.apply_pending(index);
            }
        }
        self.apply_pending(index);
        for (slot, parent) in links {
            // An unknown parent (an offloaded block's, or any in snapshots
            // written before parents were kept): an orphan, walked block by
            // block until it is gone.
            let link = match parent {
                Some(p) if p != UNKNOWN_PARENT => self.link_to(p),
                _ => self.detached_link(UNKNOWN_PARENT),
            };
            let held = self.by_hash.any_at_mut(slot);
            held.links.set_has_parent();
            held.parent = link.0;
        }
        self.break_link_cycles();
        self.published = self.closed_tier();
        self.closure.close(self.published);
    }

    /// Breaks every cycle of links among held blocks, which a snapshot can
    /// hold where the live pod had none: 2 stored under 1 while 1 was not
    /// held (linked to a detached 1), then 1 under 2; restored, each links
    /// to the other. A block on a cycle would never be a leaf, so never be
    /// evicted. Each cycle loses one link, whose block becomes an orphan
    /// (linked to a detached entry of the same parent hash). O(blocks):
    /// each block's chain of parents is walked once.
    fn break_link_cycles(&mut self) {
        const NEW: u8 = 0;
        const ON_WALK: u8 = 1;
        const DONE: u8 = 2;
        let mut state = vec![NEW; self.by_hash.slot_count()];
        let live: Vec<u32> = self.by_hash.iter_slots().map(|(s, _, _)| s).collect();
        let mut walk = Vec::new();
        for start in live {
            let mut at = start;
            loop {
                match state[at as usize] {
                    DONE => break,
                    ON_WALK => {
                        // `at`'s parents lead back to it: cut its link.
                        let parent = self.by_hash.any_at(at).1.parent;
                        let parent_hash = self.by_hash.any_at(parent).0;
                        self.drop_link(Link(parent));
                        let orphan = self.detached_link(parent_hash);
                        self.by_hash.any_at_mut(at).parent = orphan.0;
                        break;
                    }
                    _ => {}
                }
                state[at as usize] = ON_WALK;
                walk.push(at);
                let held = self.by_hash.any_at(at).1;
                // A detached parent has no parent: the chain ends there.
                if !held.links.has_parent() || self.by_hash.at_slot(held.parent).is_none() {
                    break;
                }
                at = held.parent;
            }
            for s in walk.drain(..) {
                state[s as usize] = DONE;
            }
        }
    }

    /// Distinct blocks (engine hashes) held, any tier: this pod's share of
    /// the index's capacity.
    pub fn entries(&self) -> usize {
        self.by_hash.len()
    }

    /// Drops every block of this pod: O(blocks of this pod).
    pub fn clear(&mut self, index: &BlockIndex, stats: &mut ApplyStats) {
        let (id, pending, keys) = (self.id, &mut self.pending, &self.keys);
        self.by_hash.clear_each(|slot, hash, held| {
            for tier in Tier::ALL {
                if held.links.holds(tier) {
                    pending.push(Change::release(key_in(keys, slot, hash), id, tier));
                }
            }
            if pending.len() >= 4096 {
                // Releases only: from closed they stay between closed states.
                index.apply(pending);
            }
        });
        // Empty (and so closed) before the flush publishes it.
        self.keys = None;
        self.stamps.clear();
        self.table_capacity = 0;
        self.held_per_tier = [0; TIERS];
        self.extra.clear();
        self.order.clear();
        self.released.clear();
        self.orphans = 0;
        self.flush(index);
        stats.clears += 1;
    }

    /// Applies the pending index changes (one event's: all acquires or all
    /// releases), opening the closure seqlock only if they change whether
    /// the pod is closed, or on which tier (see `closure`).
    fn flush(&mut self, index: &BlockIndex) {
        let after = self.closed_tier();
        if self.published.is_some() && after == self.published {
            self.apply_pending(index);
        } else {
            self.closure.open();
            self.apply_pending(index);
            self.closure.close(after);
            self.published = after;
        }
    }

    /// Whether readers are told the pod's closure as it now is (checked
    /// after every change in debug builds).
    pub fn closure_is_current(&self) -> bool {
        self.published == self.closed_tier()
    }

    /// A huge event (a 100K-token prompt) leaves a large buffer behind: let
    /// it go rather than keep it per pod.
    fn apply_pending(&mut self, index: &BlockIndex) {
        index.apply(&mut self.pending);
        if self.pending.capacity() > 1024 {
            self.pending = Vec::new();
        }
    }

    /// One store of `hash` on `tier`: its entry (created, under `link`, if
    /// new; `key` is only used then), one more count, a new store stamp.
    ///
    /// One table lookup per block: a new block's link to its parent is made
    /// before its own lookup (`link_to`), by the caller for an event's first
    /// block and, for the rest, by the store of the block before, which
    /// counts the next one as its child in advance when `has_next` and
    /// returns that link. A block found already held takes its link back.
    fn store_block(
        &mut self,
        hash: EngineHash,
        key: BlockKey,
        link: Option<Link>,
        tier: Tier,
        has_next: bool,
    ) -> Option<Link> {
        self.reserve_one();
        let stamp = self.tick();
        let (slot, held, new) = match self.by_hash.entry(hash) {
            Entry::Occupied(e) => (e.slot(), e.into_mut(), false),
            Entry::Vacant(v) => {
                let mut held = HeldBlock::default();
                if let Some(link) = link {
                    held.links.set_has_parent();
                    held.parent = link.0;
                }
                let (slot, held) = v.insert_with_slot(held);
                (slot, held, true)
            }
        };
        let first_on_tier = !held.links.holds(tier);
        held.links.hold(tier);
        // The next block's link, counted in advance (a child count cannot
        // overflow in practice: then the next block links as an orphan).
        let counted = has_next && held.links.children() < MAX_CHILDREN;
        if counted {
            held.links.add_child();
        }
        if new {
            self.set_key(slot, hash, key);
        }
        if first_on_tier {
            let key = if new { key } else { self.key_at(slot, hash) };
            self.pending.push(Change::acquire(key, self.id, tier));
            self.held_per_tier[tier.index()] += 1;
        } else {
            self.extra.add(hash, tier);
        }
        let next = match (has_next, counted) {
            (true, true) => Some(Link(slot)),
            (true, false) => Some(self.detached_link(hash)),
            (false, _) => None,
        };
        if !new {
            if let Some(link) = link {
                // Held already: the link made in advance is taken back,
                // unless it adopts the block (see `adopts`).
                if self.adopts(slot, link, u32::from(counted)) {
                    let held = self.by_hash.any_at_mut(slot);
                    let detached = std::mem::replace(&mut held.parent, link.0);
                    self.drop_link(Link(detached));
                } else {
                    self.drop_link(link);
                }
            }
        }
        // Only a bounded index evicts: the rest never reads stamps or
        // `order`.
        if self.bounded {
            self.stamps.set(slot, stamp);
            self.order.push_back((slot, stamp));
            // Re-stores and removals leave stale order entries: rebuild
            // before they outnumber the live ones (O(1) amortised).
            if self.order.len() > 2 * self.by_hash.len() + 64 {
                self.rebuild_order();
            }
        }
        next
    }

    /// Whether the held block in `slot`, an orphan, takes `link` (to a held
    /// parent an event named) in place of its detached one. An offload
    /// that names no parent, or a store after a lost one, leaves a block an
    /// orphan, and the pod walked block by block, until the block goes; when
    /// vLLM loads it back to GPU its store names the parent, and the pod can
    /// be binary-searched again. Only a block no held block is linked to
    /// (`advance`: the child its own event counted for the next block): the
    /// new parent is then not one of its descendants, so no cycle forms.
    fn adopts(&self, slot: u32, link: Link, advance: u32) -> bool {
        let held = self.by_hash.any_at(slot).1;
        held.links.has_parent()
            && held.links.children() == advance
            && !self.by_hash.any_at(held.parent).1.links.holds_any()
            && self.by_hash.any_at(link.0).1.links.holds_any()
    }

    /// A link for a block about to be stored under `parent`: the parent
    /// counts one more child, or, if the pod does not hold it, the block is
    /// an orphan linked to a detached entry of that hash (see `HeldBlock`).
    fn link_to(&mut self, parent: EngineHash) -> Link {
        match self.by_hash.get_mut_with_slot(&parent) {
            Some((slot, up)) if up.links.children() < MAX_CHILDREN => {
                up.links.add_child();
                Link(slot)
            }
            _ => self.detached_link(parent),
        }
    }

    /// A link to a new detached entry of `parent`: one more orphan.
    fn detached_link(&mut self, parent: EngineHash) -> Link {
        self.orphans += 1;
        let mut links = Links::default();
        links.add_child();
        Link(
            self.by_hash
                .insert_detached(parent, HeldBlock { parent: 0, links }),
        )
    }

    /// Undoes what a link counted: one child of the entry it names, and
    /// one orphan if that entry is detached (freed with its last child).
    fn drop_link(&mut self, link: Link) {
        let up = self.by_hash.any_at_mut(link.0);
        up.links.remove_child();
        let leaf = up.links.children() == 0;
        if up.links.holds_any() {
            // Only a bounded index evicts (see `store_block`).
            if self.bounded && leaf {
                let stamp = self.stamps.get(link.0);
                self.became_leaf(link.0, stamp);
            }
        } else {
            debug_assert!(self.orphans > 0, "orphan count out of step");
            self.orphans -= 1;
            if leaf {
                self.by_hash.free(link.0);
            }
        }
    }

    /// Sets the key of the new entry in `slot`: kept only once some key is
    /// not its hash (see `keys`); the first such key fills the column in.
    fn set_key(&mut self, slot: u32, hash: EngineHash, key: BlockKey) {
        match &mut self.keys {
            Some(keys) => keys.set(slot, key.0),
            None if key.0 == hash.0 => {}
            None => {
                let mut keys = Column::default();
                for (s, h, _) in self.by_hash.iter_slots() {
                    keys.set(s, h.0);
                }
                keys.set(slot, key.0);
                self.keys = Some(keys);
            }
        }
    }

    /// Stores minus removals of `hash` per tier (what a snapshot keeps).
    fn counts(&self, hash: EngineHash, held: &HeldBlock) -> [u32; TIERS] {
        std::array::from_fn(|i| {
            let tier = Tier::ALL[i];
            match held.links.holds(tier) {
                false => 0,
                true => 1 + self.extra.count(hash, tier),
            }
        })
    }

    /// Removes an entry (see `unlink`): what it held, and its key.
    fn forget(&mut self, hash: EngineHash) -> Option<(HeldBlock, BlockKey)> {
        let (slot, held) = self.by_hash.find_entry(hash)?.detach();
        let key = self.key_at(slot, hash);
        self.unlink(slot, held);
        Some((held, key))
    }

    /// Keeps `orphans` exact after the block `held` in `slot` left the
    /// table: its children become orphans (it stays there, detached, for
    /// them, see `HeldBlock`; with none its slot is freed); it stops being
    /// one, or stops counting as its parent's child.
    fn unlink(&mut self, slot: u32, held: HeldBlock) {
        let children = held.links.children();
        self.orphans += u64::from(children);
        if held.links.has_parent() {
            self.drop_link(Link(held.parent));
        }
        if children == 0 {
            self.by_hash.free(slot);
        } else {
            *self.by_hash.any_at_mut(slot) = HeldBlock {
                parent: 0,
                links: held.links.children_only(),
            };
        }
    }

    /// The tier every held block is on, if the held set is prefix-closed
    /// (every held block's parent is held) and on one tier at most: then a
    /// prompt's held blocks are exactly a prefix of it, and scoring may
    /// binary-search for where it ends.
    pub fn closed_tier(&self) -> Option<Tier> {
        if self.orphans != 0 {
            return None;
        }
        let mut tiers = Tier::ALL
            .into_iter()
            .filter(|t| self.held_per_tier[t.index()] > 0);
        match (tiers.next(), tiers.next()) {
            (None, _) => Some(Tier::Gpu),
            (Some(t), None) => Some(t),
            _ => None,
        }
    }
}

/// A new block's link to its parent, made before the block's own lookup:
/// the slot of the parent entry, which counts it as a child (see
/// `PodState::store_block`).
#[derive(Clone, Copy, Debug)]
struct Link(u32);

/// The key of the block held as `hash` in `slot`, given a pod's `keys`. A
/// free function: callers hold the pod's table borrowed.
#[inline]
fn key_in(keys: &Option<Column<u64>>, slot: u32, hash: EngineHash) -> BlockKey {
    match keys {
        Some(keys) => BlockKey(keys.get(slot)),
        None => BlockKey(hash.0),
    }
}

mod order;
pub(crate) mod rules;
#[cfg(test)]
mod tests;

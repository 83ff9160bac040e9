//! One pod's (one cache domain's) view: engine hash -> our key and per-tier
//! counts, and the rules that turn its events into index updates.
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
use std::collections::{BinaryHeap, HashSet, VecDeque};
use std::sync::Arc;

use crate::block_map::{BlockMap, Entry};
use crate::closure::Closure;

use crate::event::{
    is_full_attention_kind, BlockRemoved, BlockStored, EngineHash, ExtraKey, Tier, TIERS,
};
use crate::index::{BlockIndex, Change, PodId};
use crate::keys::{chain, fold_extras, BlockKey, KeyScope};
use crate::repeats::Repeats;
use crate::scheme::{EngineKeys, KeyMode};
use crate::snapshot::SnapshotBlock;

/// One held engine hash: 32 bytes, so a pod's map entry (hash and block)
/// is 40. The entries are most of the index's memory (one per pod and
/// block) and each change touches one at random: at 56 bytes they took 31%
/// more memory per entry and 21% more cache misses per change.
#[derive(Clone, Copy, Debug)]
struct HeldBlock {
    key: BlockKey,
    /// The parent this block was stored under (if `links.has_parent()`) and
    /// that parent entry's `born`, or 0 if the parent was not held then.
    parent: EngineHash,
    parent_born: u32,
    /// This entry's incarnation (never 0), so a child can tell its parent
    /// from a later re-store of the same hash.
    born: u32,
    /// When it was last stored, for eviction (see `Stamp`).
    stamp: Stamp,
    links: Links,
}

impl HeldBlock {
    fn new(key: BlockKey) -> HeldBlock {
        HeldBlock {
            key,
            parent: EngineHash(0),
            parent_born: 0,
            born: 0,
            stamp: Stamp(0),
            links: Links::default(),
        }
    }
}

/// The tiers a block is held on, whether it has a parent, and how many held
/// blocks are linked to it as their parent, in one word. A tier bit stands
/// for the first store on that tier; further stores of the same hash and
/// tier (vLLM can store a hash twice) are counted in `PodState::extra`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Links(u32);

const HAS_PARENT: u32 = 1 << TIERS;
const CHILD_SHIFT: u32 = TIERS as u32 + 1;
/// Children a block can count (2^28: more than any pod holds blocks).
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
}

/// A store time: the pod's store clock in 32 bits. Stamps are compared as
/// ages from the clock (wrapping), which is exact while every age is below
/// 2^32: every `AGE_PASS` stores, `PodState::age_out` clamps ages above
/// `MAX_AGE` to it, so none grows past `MAX_AGE + AGE_PASS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    /// Blocks of stores whose parent hash this pod never stored.
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
    }
}

pub struct PodState {
    id: PodId,
    model: String,
    by_hash: BlockMap<HeldBlock>,
    /// `group_idx` values a store declared to be sliding-window, mamba...:
    /// removals for them (which carry no kind) are ignored too.
    non_full_groups: HashSet<u32>,
    block_size: Option<u32>,
    held_per_tier: [u64; TIERS],
    /// Engine mode: stores eligible for the hash self-check seen so far.
    checkable_stores: u64,
    check_buf: Vec<u8>,
    /// Stores of a hash on a tier it already holds, beyond the first.
    extra: Repeats<EngineHash>,
    /// Store clock, and (hash, stamp) in store order for eviction. An
    /// entry whose stamp no longer matches was re-stored or removed since:
    /// skipped, and compacted away when they pile up. A block eviction
    /// reaches while it still has children is passed (see `released`).
    clock: u64,
    order: VecDeque<(EngineHash, Stamp)>,
    /// Blocks whose `order` entry eviction passed while they had children
    /// (a prefix this pod still extends), and whose last child has gone
    /// since: evictable again, and older than anything left in `order`.
    /// By store time (the clock's, so the heap's order never changes),
    /// oldest first; stale entries are skipped as `order`'s are.
    released: BinaryHeap<Reverse<(u64, EngineHash)>>,
    /// Under a capacity limit: keep `by_hash` at most half full, so churn at
    /// capacity rehashes in place instead of doubling the table. Also the
    /// only case that needs `order`.
    half_full: bool,
    /// Held blocks whose parent is not held: 0 means the held set is
    /// prefix-closed, which lets scoring binary-search it (see `score`).
    orphans: u64,
    born_clock: u32,
    /// Index changes of the event being applied, flushed to the index in
    /// one batch at its end (`BlockIndex::apply`).
    pending: Vec<Change>,
    /// What readers are told of this pod's closure, and its last value.
    closure: Arc<Closure>,
    published: Option<Tier>,
}

/// Every pod's first stores are checked, then one in `self_check_every`.
const ALWAYS_CHECKED_STORES: u64 = 8;

impl PodState {
    pub fn new(id: PodId, model: impl Into<String>) -> Self {
        PodState {
            id,
            model: model.into(),
            by_hash: BlockMap::default(),
            non_full_groups: HashSet::new(),
            block_size: None,
            held_per_tier: [0; TIERS],
            checkable_stores: 0,
            check_buf: Vec::new(),
            extra: Repeats::default(),
            clock: 0,
            order: VecDeque::new(),
            released: BinaryHeap::new(),
            half_full: false,
            orphans: 0,
            born_clock: 0,
            pending: Vec::new(),
            closure: Arc::default(),
            published: Some(Tier::Gpu),
        }
    }

    /// Where this pod publishes its closure for lock-free readers.
    pub fn closure(&self) -> Arc<Closure> {
        self.closure.clone()
    }

    /// For a capacity-bounded index (see `half_full`).
    pub fn bounded(mut self) -> Self {
        self.half_full = true;
        self
    }

    /// Room for one more entry, growing early when bounded (see `grow`).
    /// The check inline, the growth not: it runs on every stored block.
    #[inline]
    fn reserve_one(&mut self) {
        if self.half_full && (self.by_hash.len() + 1) * 2 > self.by_hash.capacity() {
            self.grow();
        }
    }

    /// Doubles the table, its memory resident at once (see `regrow`).
    #[cold]
    fn grow(&mut self) {
        self.by_hash.regrow(2 * self.by_hash.len() + 2);
    }

    /// Block size learned from this pod's stores.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
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
        if self.skip_group(ev.group_idx, ev.kv_cache_spec_kind.as_deref()) {
            stats.non_full_attention_events += 1;
            return;
        }
        let tier = ev.tier();
        let n = ev.block_hashes.len();
        if n == 0 {
            return;
        }
        // Up front: a long document's changes otherwise grow the buffer,
        // copying it, a dozen times.
        self.pending.reserve(n);
        let named_lora = named_lora(ev);
        // Engine keys unless this adapter's hashes cannot be reproduced.
        let engine = mode
            .engine()
            .filter(|e| e.lora_keyable(named_lora.as_deref()));
        if ev.token_ids.is_empty() {
            // Offload to another tier: token mode needs the blocks known by
            // hash already; engine mode keys them by hash alone.
            let mut parent = ev.parent_block_hash;
            for hash in &ev.block_hashes {
                let linked_to = parent.replace(*hash);
                let held = self.by_hash.contains_key(hash);
                if engine.is_none() && !held {
                    stats.unkeyable_blocks += 1;
                    continue;
                }
                // Usually a new tier for a held block: linked only if new.
                let link = linked_to.filter(|_| !held).map(|p| self.link_to(p));
                self.store_block(*hash, BlockKey(hash.0), link, tier, false);
                stats.stored_blocks += 1;
            }
            return;
        }
        let block_size = match ev.block_size {
            Some(bs) if bs > 0 && ev.token_ids.len() == n * bs as usize => bs as usize,
            None if ev.token_ids.len() % n == 0 => ev.token_ids.len() / n,
            _ => {
                stats.malformed_stores += 1;
                return;
            }
        };
        self.block_size = Some(block_size as u32);

        if let Some(engine) = engine {
            self.self_check(ev, block_size, engine, stats);
            let mut link = ev.parent_block_hash.map(|p| self.link_to(p));
            for (i, hash) in ev.block_hashes.iter().enumerate() {
                link = self.store_block(*hash, BlockKey(hash.0), link, tier, i + 1 < n);
                stats.stored_blocks += 1;
            }
            return;
        }

        // An adapter known only by id (old wire forms) gets a marker that can
        // never equal a requested name: such blocks never match a prompt.
        let lora = named_lora.or_else(|| ev.lora_id.map(|id| format!("\0lora-id:{id}")));
        let extras_of = |i: usize| -> Vec<ExtraKey> {
            let block = ev
                .extra_keys
                .as_ref()
                .and_then(|v| v.get(i))
                .and_then(|e| e.as_deref())
                .unwrap_or(&[]);
            non_lora_extras(block, lora.as_deref(), ev.lora_id)
        };

        let mut prev = match ev.parent_block_hash {
            None => KeyScope {
                model: &self.model,
                lora_name: lora.as_deref(),
                first_block_extras: &extras_of(0),
            }
            .root_seed(),
            Some(parent) => match self.by_hash.get(&parent) {
                Some(held) => held.key.0,
                None => {
                    stats.parent_unknown_blocks += n as u64;
                    return;
                }
            },
        };
        let mut link = ev.parent_block_hash.map(|p| self.link_to(p));
        for (i, (hash, tokens)) in ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(block_size))
            .enumerate()
        {
            let mut key = chain(prev, tokens);
            // Block 0 of a prompt had its extras folded into the root seed.
            if i > 0 || ev.parent_block_hash.is_some() {
                key = fold_extras(key, &extras_of(i));
            }
            prev = key.0;
            link = self.store_block(*hash, key, link, tier, i + 1 < n);
            stats.stored_blocks += 1;
        }
    }

    pub fn remove(&mut self, index: &BlockIndex, ev: &BlockRemoved, stats: &mut ApplyStats) {
        self.remove_event(ev, stats);
        self.flush(index);
    }

    fn remove_event(&mut self, ev: &BlockRemoved, stats: &mut ApplyStats) {
        if ev
            .group_idx
            .is_some_and(|g| self.non_full_groups.contains(&g))
        {
            stats.non_full_attention_events += 1;
            return;
        }
        let tier = ev.tier();
        self.pending.reserve(ev.block_hashes.len());
        for hash in &ev.block_hashes {
            let Some(mut entry) = self.by_hash.find_entry(*hash) else {
                stats.unknown_removals += 1;
                continue;
            };
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
            self.pending.push(Change::release(held.key, self.id, tier));
            self.held_per_tier[tier.index()] -= 1;
            if !held.links.holds_any() {
                let held = entry.remove();
                self.unlink(&held);
            }
        }
    }

    /// Blocks as (hash, key, counts), least recently stored first, and the
    /// groups known not to be full attention: what a snapshot keeps.
    pub fn export(&self) -> PodExport {
        let held = self.oldest_first();
        let blocks = held
            .iter()
            .map(|(h, b)| (h.0, b.key.0, self.counts(*h, b)))
            .collect();
        let parents = held
            .iter()
            .map(|(_, b)| b.links.has_parent().then_some(b.parent.0))
            .collect();
        let mut non_full_groups: Vec<u32> = self.non_full_groups.iter().copied().collect();
        non_full_groups.sort_unstable();
        PodExport {
            blocks,
            parents,
            non_full_groups,
        }
    }

    /// Restores what `export` returned, into an empty pod. Without
    /// `parents` (snapshots written before they were kept) every block
    /// counts as an orphan, so the pod is walked block by block until those
    /// blocks are gone.
    pub fn import(
        &mut self,
        index: &BlockIndex,
        blocks: &[SnapshotBlock],
        parents: &[Option<u64>],
        non_full_groups: &[u32],
        block_size: Option<u32>,
    ) {
        self.block_size = block_size;
        self.non_full_groups = non_full_groups.iter().copied().collect();
        // Children may come before their parents: closed only once linked.
        self.closure.open();
        let known_parents = parents.len() == blocks.len();
        for (i, (hash, key, counts)) in blocks.iter().enumerate() {
            if counts.iter().all(|c| *c == 0) {
                continue;
            }
            self.reserve_one();
            // Blocks come oldest first: stamps keep that order.
            let stamp = self.tick();
            let mut held = HeldBlock::new(BlockKey(*key));
            held.stamp = stamp;
            held.born = next_born(&mut self.born_clock);
            match parents.get(i).copied().flatten() {
                Some(p) => {
                    held.links.set_has_parent();
                    held.parent = EngineHash(p);
                }
                None if !known_parents => held.links.set_has_parent(),
                None => {}
            }
            for tier in Tier::ALL {
                let count = counts[tier.index()];
                if count > 0 {
                    held.links.hold(tier);
                    self.extra.set(EngineHash(*hash), tier, count - 1);
                    self.pending
                        .push(Change::acquire(BlockKey(*key), self.id, tier));
                    self.held_per_tier[tier.index()] += 1;
                }
            }
            self.by_hash.insert(EngineHash(*hash), held);
            if self.half_full {
                self.order.push_back((EngineHash(*hash), stamp));
            }
            if self.pending.len() >= 4096 {
                self.apply_pending(index);
            }
        }
        self.apply_pending(index);
        // Link children to parents once all are in (a parent re-stored
        // after its child comes later in store order).
        let links: Vec<(EngineHash, Option<EngineHash>)> = self
            .by_hash
            .iter()
            .filter(|(_, b)| b.links.has_parent())
            .map(|(h, b)| (*h, known_parents.then_some(b.parent)))
            .collect();
        for (hash, parent) in links {
            let Some(parent) = parent else {
                self.orphans += 1;
                continue;
            };
            let born = self.adopt(parent);
            if let Some(held) = self.by_hash.get_mut(&hash) {
                held.parent_born = born;
            }
        }
        self.published = self.closed_tier();
        self.closure.close(self.published);
    }

    /// Distinct blocks (engine hashes) held, any tier: this pod's share of
    /// the index's capacity.
    pub fn entries(&self) -> usize {
        self.by_hash.len()
    }

    /// Evicts up to `n` blocks (every tier of each), least recently stored
    /// leaves first: a block another held block extends goes only after
    /// that one, so the held set stays prefix-closed where it was and an
    /// eviction only ever shortens a match from its end. Returns how many
    /// were evicted: `n`, or every block if fewer (a non-empty held set
    /// always has a leaf: links only point to older incarnations).
    ///
    /// O(log) amortised per block: `order` is walked once, a block passed
    /// for its children waits for its last child to go (`became_leaf`).
    pub fn evict_oldest(&mut self, index: &BlockIndex, n: usize) -> usize {
        let mut evicted = 0;
        while evicted < n {
            // Released blocks first: they are the older ones.
            let next = match self.released.pop() {
                Some(Reverse((time, hash))) => Some((hash, Stamp(time as u32))),
                None => self.order.pop_front(),
            };
            let Some((hash, stamp)) = next else {
                break;
            };
            let leaf = match self.by_hash.get(&hash) {
                Some(b) if b.stamp == stamp => b.links.children() == 0,
                // Re-stored or removed since.
                _ => continue,
            };
            if !leaf {
                // Passed: `released` takes it when its last child goes.
                continue;
            }
            if let Some(held) = self.forget(hash) {
                for tier in Tier::ALL {
                    if held.links.holds(tier) {
                        self.extra.forget(hash, tier);
                        self.pending.push(Change::release(held.key, self.id, tier));
                        self.held_per_tier[tier.index()] -= 1;
                    }
                }
                evicted += 1;
            }
        }
        self.flush(index);
        evicted
    }

    /// `hash`, stored at `stamp`, just lost its last child. If eviction
    /// passed its `order` entry meanwhile (it is not newer than the front:
    /// `order` is in store order), it is evictable again: into `released`.
    /// A block still queued may be pushed too (equal stamps, after
    /// `age_out`): the second entry is stale by the time it is reached.
    fn became_leaf(&mut self, hash: EngineHash, stamp: Stamp) {
        let passed = self
            .order
            .front()
            .is_none_or(|(_, front)| self.age(stamp) >= self.age(*front));
        if !passed {
            return;
        }
        let time = self.clock.saturating_sub(u64::from(self.age(stamp)));
        self.released.push(Reverse((time, hash)));
        // A child that comes and goes again and again pushes its parent
        // each time: rebuild before they outnumber the live blocks.
        if self.released.len() > self.by_hash.len() + 64 {
            self.rebuild_order();
        }
    }

    /// Drops every block of this pod: O(blocks of this pod).
    pub fn clear(&mut self, index: &BlockIndex, stats: &mut ApplyStats) {
        let (id, pending) = (self.id, &mut self.pending);
        self.by_hash.clear_each(|_, held| {
            for tier in Tier::ALL {
                if held.links.holds(tier) {
                    pending.push(Change::release(held.key, id, tier));
                }
            }
            if pending.len() >= 4096 {
                // Releases only: from closed they stay between closed states.
                index.apply(pending);
            }
        });
        // Empty (and so closed) before the flush publishes it.
        self.held_per_tier = [0; TIERS];
        self.extra.clear();
        self.order.clear();
        self.released.clear();
        self.orphans = 0;
        self.flush(index);
        stats.clears += 1;
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
        // keys present and empty (old wire forms omit them, salt included).
        let plain = ev.parent_block_hash.is_none()
            && ev.lora_name.is_none()
            && ev.lora_id.is_none()
            && ev
                .extra_keys
                .as_ref()
                .is_some_and(|v| v.iter().all(|e| e.as_ref().is_none_or(|e| e.is_empty())));
        if !plain || engine.self_check_every == 0 {
            return;
        }
        self.checkable_stores += 1;
        if self.checkable_stores > ALWAYS_CHECKED_STORES
            && self.checkable_stores % u64::from(engine.self_check_every) != 0
        {
            return;
        }
        stats.engine_hash_checks += 1;
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
        let (held, new) = match self.by_hash.entry(hash) {
            Entry::Occupied(e) => (e.into_mut(), false),
            Entry::Vacant(v) => {
                let mut held = HeldBlock::new(key);
                held.born = next_born(&mut self.born_clock);
                if let Some(link) = link {
                    held.links.set_has_parent();
                    held.parent = link.parent;
                    held.parent_born = link.born;
                }
                (v.insert(held), true)
            }
        };
        if held.links.holds(tier) {
            self.extra.add(hash, tier);
        } else {
            held.links.hold(tier);
            self.pending.push(Change::acquire(held.key, self.id, tier));
            self.held_per_tier[tier.index()] += 1;
        }
        held.stamp = stamp;
        let next = has_next.then(|| link_child(held, hash, &mut self.orphans));
        if !new {
            if let Some(link) = link {
                self.unlink_advance(link);
            }
        }
        // Only a bounded index evicts: the rest never reads `order`.
        if self.half_full {
            self.order.push_back((hash, stamp));
            // Re-stores and removals leave stale order entries: rebuild
            // before they outnumber the live ones (O(1) amortised).
            if self.order.len() > 2 * self.by_hash.len() + 64 {
                self.rebuild_order();
            }
        }
        next
    }

    /// A link for a block about to be stored under `parent` (see `adopt`).
    fn link_to(&mut self, parent: EngineHash) -> Link {
        Link {
            parent,
            born: self.adopt(parent),
        }
    }

    /// Takes back a link made in advance for a block that was held already.
    fn unlink_advance(&mut self, link: Link) {
        debug_assert!(
            link.born == 0
                || self
                    .by_hash
                    .get(&link.parent)
                    .is_some_and(|up| up.born == link.born),
            "the parent changed meanwhile"
        );
        self.drop_link(link);
    }

    /// Undoes what a link counted: one child of the parent it names, if
    /// that incarnation is still held, else one orphan.
    fn drop_link(&mut self, link: Link) {
        match self.by_hash.get_mut(&link.parent) {
            Some(up) if link.born != 0 && up.born == link.born => {
                up.links.remove_child();
                // Only a bounded index evicts (see `store_block`).
                if self.half_full && up.links.children() == 0 {
                    let stamp = up.stamp;
                    self.became_leaf(link.parent, stamp);
                }
            }
            _ => {
                debug_assert!(self.orphans > 0, "orphan count out of step");
                self.orphans -= 1;
            }
        }
    }

    /// Advances the store clock: the new stamp.
    fn tick(&mut self) -> Stamp {
        self.clock += 1;
        if self.clock % AGE_PASS == 0 {
            self.age_out();
        }
        Stamp(self.clock as u32)
    }

    /// Stores since `stamp` (see `Stamp`).
    fn age(&self, stamp: Stamp) -> u32 {
        (self.clock as u32).wrapping_sub(stamp.0)
    }

    /// Clamps the age of blocks not stored for `MAX_AGE` stores to that
    /// (see `Stamp`). Their order among themselves is lost (they are all
    /// the oldest), and the eviction order is rebuilt from the new stamps.
    /// O(blocks) once every 2^30 stores.
    fn age_out(&mut self) {
        let clock = self.clock as u32;
        let oldest = Stamp(clock.wrapping_sub(MAX_AGE));
        self.by_hash.for_each_value_mut(|held| {
            if clock.wrapping_sub(held.stamp.0) >= MAX_AGE {
                held.stamp = oldest;
            }
        });
        if self.half_full {
            self.rebuild_order();
        }
    }

    /// The eviction order of the live entries, oldest first (every one
    /// queued again: nothing is left passed or released).
    fn rebuild_order(&mut self) {
        self.released.clear();
        self.order = self
            .oldest_first()
            .into_iter()
            .map(|(h, b)| (h, b.stamp))
            .collect();
    }

    /// The held blocks, least recently stored first (ties by hash).
    fn oldest_first(&self) -> Vec<(EngineHash, &HeldBlock)> {
        let mut held: Vec<(EngineHash, &HeldBlock)> =
            self.by_hash.iter().map(|(h, b)| (*h, b)).collect();
        held.sort_unstable_by_key(|(h, b)| (std::cmp::Reverse(self.age(b.stamp)), *h));
        held
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

    /// Counts a new entry as a child of `parent`: returns the parent's
    /// incarnation, or 0 (and one more orphan) if the parent is not held.
    fn adopt(&mut self, parent: EngineHash) -> u32 {
        count_child(self.by_hash.get_mut(&parent), &mut self.orphans)
    }

    /// Removes an entry (see `unlink`).
    fn forget(&mut self, hash: EngineHash) -> Option<HeldBlock> {
        let held = self.by_hash.remove(&hash)?;
        self.unlink(&held);
        Some(held)
    }

    /// Keeps `orphans` exact after `held` left: its children become
    /// orphans; it stops being one, or stops counting as its parent's child.
    fn unlink(&mut self, held: &HeldBlock) {
        self.orphans += u64::from(held.links.children());
        if held.links.has_parent() {
            self.drop_link(Link {
                parent: held.parent,
                born: held.parent_born,
            });
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
}

/// A new incarnation number from a pod's `born_clock` (never 0: 0 means
/// "no parent held"). A free function: it is called while the pod's table
/// is borrowed.
fn next_born(born_clock: &mut u32) -> u32 {
    *born_clock = born_clock.wrapping_add(1).max(1);
    *born_clock
}

/// A new block's link to its parent, made before the block's own lookup:
/// the parent's `born` (the parent counts one more child), or 0 (the pod
/// counts one more orphan). See `PodState::store_block`.
#[derive(Clone, Copy, Debug)]
struct Link {
    parent: EngineHash,
    born: u32,
}

/// Counts one more child of `held` (stored as `hash`): the link for the
/// block stored next under it.
fn link_child(held: &mut HeldBlock, hash: EngineHash, orphans: &mut u64) -> Link {
    Link {
        parent: hash,
        born: count_child(Some(held), orphans),
    }
}

/// Counts a new block as a child of `parent`: the parent's incarnation, or
/// 0 and one more orphan if it is not held (or, beyond any real pod, out of
/// child counts: an orphan only costs the binary search). A free function:
/// callers hold the parent borrowed from the pod's table.
fn count_child(parent: Option<&mut HeldBlock>, orphans: &mut u64) -> u32 {
    match parent {
        Some(up) if up.links.children() < MAX_CHILDREN => {
            up.links.add_child();
            up.born
        }
        _ => {
            *orphans += 1;
            0
        }
    }
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
    use std::collections::HashMap;

    use super::*;
    use crate::keys::{prompt_keys, request_root_seed};
    use crate::scheme::KeySchemes;

    const BS: usize = 4;

    impl PodState {
        /// Token-mode store, for brevity.
        fn store_t(&mut self, index: &BlockIndex, ev: &BlockStored, stats: &mut ApplyStats) {
            self.store(index, ev, &KeyMode::Token, stats)
        }
    }

    fn tokens(n: usize, base: u32) -> Vec<u32> {
        (0..n as u32).map(|i| base + i).collect()
    }

    fn store(hashes: &[u64], parent: Option<u64>, toks: &[u32]) -> BlockStored {
        BlockStored {
            block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids: toks.to_vec(),
            block_size: Some(BS as u32),
            ..Default::default()
        }
    }

    fn removed(hashes: &[u64]) -> BlockRemoved {
        BlockRemoved {
            block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            ..Default::default()
        }
    }

    fn held_keys(index: &BlockIndex, keys: &[BlockKey], pod: PodId) -> usize {
        keys.iter()
            .take_while(|k| {
                index.with_holders(**k, |h| h.is_some_and(|h| h.iter().any(|x| x.pod() == pod)))
            })
            .count()
    }

    #[test]
    fn stored_blocks_match_request_keys_across_batches() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        let t = tokens(12, 100);
        pod.store_t(&index, &store(&[1, 2], None, &t[..8]), &mut stats);
        pod.store_t(&index, &store(&[3], Some(2), &t[8..]), &mut stats);
        let keys = prompt_keys(request_root_seed("m", None, None), &t, BS);
        assert_eq!(held_keys(&index, &keys, PodId(0)), 3);
        assert_eq!(stats.stored_blocks, 3);
        assert_eq!(pod.block_size(), Some(BS as u32));
    }

    #[test]
    fn double_store_needs_double_remove() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        let t = tokens(4, 0);
        let keys = prompt_keys(request_root_seed("m", None, None), &t, BS);
        pod.store_t(&index, &store(&[1], None, &t), &mut stats);
        pod.store_t(&index, &store(&[1], None, &t), &mut stats);
        pod.remove(&index, &removed(&[1]), &mut stats);
        assert_eq!(held_keys(&index, &keys, PodId(0)), 1);
        pod.remove(&index, &removed(&[1]), &mut stats);
        assert_eq!(held_keys(&index, &keys, PodId(0)), 0);
        pod.remove(&index, &removed(&[1]), &mut stats);
        assert_eq!(stats.unknown_removals, 1);
        assert!(index.is_empty());
    }

    #[test]
    fn eviction_drops_the_least_recently_stored_blocks_first() {
        // Every block a prompt start, so every one a leaf: plain store order.
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m").bounded();
        let mut stats = ApplyStats::default();
        for h in 1..=5u64 {
            pod.store_t(
                &index,
                &store(&[h], None, &tokens(4, h as u32 * 10)),
                &mut stats,
            );
        }
        // Re-storing 1 makes it the most recent.
        pod.store_t(&index, &store(&[1], None, &tokens(4, 10)), &mut stats);
        pod.remove(&index, &removed(&[3]), &mut stats);
        assert_eq!(pod.evict_oldest(&index, 2), 2); // 2 and 4 (3 is gone)
        let left: Vec<u64> = {
            let mut v: Vec<u64> = pod.by_hash.keys().map(|h| h.0).collect();
            v.sort_unstable();
            v
        };
        assert_eq!(left, vec![1, 5]);
        assert_eq!(index.len(), 2);
        assert_eq!(pod.held_per_tier(), [2, 0, 0]);
        // Many re-stores do not grow the order queue without bound.
        for _ in 0..1000 {
            pod.store_t(&index, &store(&[5], None, &tokens(4, 50)), &mut stats);
        }
        assert!(pod.order.len() <= 2 * pod.entries() + 64);
    }

    /// Children and orphans counted from scratch: what `adopt`, the links
    /// made in advance and `unlink` must keep.
    fn recount(pod: &PodState) -> (u64, HashMap<EngineHash, u32>) {
        let mut orphans = 0;
        let mut children: HashMap<EngineHash, u32> = HashMap::new();
        for held in pod.by_hash.values() {
            if !held.links.has_parent() {
                continue;
            }
            match pod.by_hash.get(&held.parent) {
                Some(up) if held.parent_born != 0 && up.born == held.parent_born => {
                    *children.entry(held.parent).or_default() += 1;
                }
                _ => orphans += 1,
            }
        }
        (orphans, children)
    }

    #[test]
    fn child_and_orphan_counts_stay_exact_under_random_events() {
        let index = BlockIndex::new();
        let mut rnd = crate::test_rng::xorshift(0x5eed_0fc4_11d5);
        let engine = crate::engine_hash::EngineHasher::new(
            crate::engine_hash::HashAlgo::Sha256,
            crate::engine_hash::DEFAULT_SEED,
            crate::engine_hash::ExtraKeyStyle::Tagged,
        );
        let engine = KeySchemes::engine(engine, false, 0).default;
        for mode in [KeyMode::Token, engine] {
            // Bounded, so evictions take part too.
            let mut pod = PodState::new(PodId(0), "m").bounded();
            let mut stats = ApplyStats::default();
            for step in 0..3000 {
                // A small hash space: re-stores, repeats within an event,
                // blocks that are their own parent, unknown parents.
                let n = 1 + rnd(6) as usize;
                let hashes: Vec<u64> = (0..n).map(|_| 1 + rnd(40)).collect();
                match rnd(10) {
                    0..=5 => {
                        let parent = (rnd(3) > 0).then(|| 1 + rnd(40));
                        let mut ev = store(&hashes, parent, &tokens(n * BS, rnd(3) as u32));
                        if rnd(8) == 0 {
                            ev.token_ids.clear();
                            ev.medium = Some("CPU".into());
                        }
                        pod.store(&index, &ev, &mode, &mut stats);
                    }
                    6..=7 => pod.remove(&index, &removed(&hashes), &mut stats),
                    8 => {
                        pod.evict_oldest(&index, n);
                    }
                    _ if rnd(20) == 0 => pod.clear(&index, &mut stats),
                    _ => {}
                }
                let (orphans, children) = recount(&pod);
                assert_eq!(pod.orphans, orphans, "step {step}");
                for (hash, held) in pod.by_hash.iter() {
                    let want = children.get(hash).copied().unwrap_or(0);
                    assert_eq!(held.links.children(), want, "step {step}, block {hash:?}");
                }
            }
            assert!(
                stats.stored_blocks > 1000 && stats.removed_blocks > 300,
                "{stats:?}"
            );
        }
    }

    /// A held block's incarnation and the parent (hash, incarnation) it is
    /// linked to, if it was stored under a held parent.
    type Linked = HashMap<EngineHash, (u32, Option<(EngineHash, u32)>)>;

    fn links_of(pod: &PodState) -> Linked {
        pod.by_hash
            .iter()
            .map(|(h, b)| {
                let parent = (b.links.has_parent() && b.parent_born != 0)
                    .then_some((b.parent, b.parent_born));
                (*h, (b.born, parent))
            })
            .collect()
    }

    /// What eviction must keep: a block still held that extended a held
    /// parent before still has that parent (so an evicted block only ever
    /// shortened a match from its end).
    fn assert_prefixes_kept(before: &Linked, pod: &PodState, what: &str) {
        for (hash, (_, parent)) in links_of(pod) {
            let Some((p, born)) = parent else { continue };
            let held_before = before.get(&p).is_some_and(|(b, _)| *b == born);
            let held_now = pod.by_hash.get(&p).is_some_and(|up| up.born == born);
            assert!(
                !held_before || held_now,
                "{what}: {hash:?} kept, its parent {p:?} evicted"
            );
        }
    }

    #[test]
    fn eviction_takes_leaves_first_and_keeps_the_prefixes_a_pod_extends() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m").bounded();
        let mut stats = ApplyStats::default();
        let held = |pod: &PodState| -> Vec<u64> {
            let mut v: Vec<u64> = pod.by_hash.keys().map(|h| h.0).collect();
            v.sort_unstable();
            v
        };
        // 1 <- 2 <- 3 first (the oldest blocks), 4 and 5 alone, 6 under 1.
        pod.store_t(&index, &store(&[1, 2, 3], None, &tokens(12, 0)), &mut stats);
        pod.store_t(&index, &store(&[4], None, &tokens(4, 40)), &mut stats);
        pod.store_t(&index, &store(&[5], None, &tokens(4, 50)), &mut stats);
        pod.store_t(&index, &store(&[6], Some(1), &tokens(4, 60)), &mut stats);
        let before = links_of(&pod);
        // 1 and 2 are the oldest, but 3 extends them: 3 goes, then 2 (a
        // leaf now, and older than 4). 1 still has 6.
        assert_eq!(pod.evict_oldest(&index, 2), 2);
        assert_eq!(held(&pod), vec![1, 4, 5, 6]);
        assert_prefixes_kept(&before, &pod, "first");
        assert_eq!(pod.closed_tier(), Some(Tier::Gpu));
        assert_eq!(pod.evict_oldest(&index, 2), 2);
        assert_eq!(held(&pod), vec![1, 6]);
        // 6, then 1 (its last child gone).
        assert_eq!(pod.evict_oldest(&index, 1), 1);
        assert_eq!(held(&pod), vec![1]);
        assert_eq!(pod.evict_oldest(&index, 5), 1);
        assert!(index.is_empty() && pod.entries() == 0);

        // A parent eviction passed while it had a child is evicted once
        // that child is removed by the pod itself.
        pod.store_t(&index, &store(&[1, 2], None, &tokens(8, 0)), &mut stats);
        pod.store_t(&index, &store(&[3], None, &tokens(4, 40)), &mut stats);
        pod.store_t(&index, &store(&[2], Some(1), &tokens(4, 4)), &mut stats);
        assert_eq!(pod.evict_oldest(&index, 1), 1);
        assert_eq!(held(&pod), vec![1, 2], "3, the oldest leaf");
        pod.remove(&index, &removed(&[2]), &mut stats);
        pod.remove(&index, &removed(&[2]), &mut stats);
        assert_eq!(held(&pod), vec![1]);
        assert_eq!(pod.evict_oldest(&index, 1), 1);
        assert!(index.is_empty() && pod.entries() == 0);
    }

    /// Random histories (prompts under held, unknown or no parents, repeated
    /// hashes, offloads, removals that leave holes, clears), evicting at
    /// random points: every eviction takes what it was asked for (a held
    /// set always has a leaf), makes no orphan, and keeps every prefix.
    #[test]
    fn eviction_keeps_every_prefix_under_random_histories() {
        let engine = crate::engine_hash::EngineHasher::new(
            crate::engine_hash::HashAlgo::Sha256,
            crate::engine_hash::DEFAULT_SEED,
            crate::engine_hash::ExtraKeyStyle::Tagged,
        );
        let engine = KeySchemes::engine(engine, false, 0).default;
        let mut evictions = 0;
        for seed in 1..=24u64 {
            let mode = if seed % 2 == 0 {
                &engine
            } else {
                &KeyMode::Token
            };
            let mut rnd = crate::test_rng::xorshift(0x9e37_79b9_7f4a_7c15 ^ seed);
            let index = BlockIndex::new();
            let mut pod = PodState::new(PodId(0), "m").bounded();
            let mut stats = ApplyStats::default();
            let mut fresh = 0u64;
            for step in 0..600 {
                let what = format!("seed {seed}, step {step}");
                match rnd(12) {
                    0..=6 => {
                        let n = 1 + rnd(5) as usize;
                        let hashes: Vec<u64> = (0..n)
                            .map(|_| match rnd(5) {
                                0 => 1 + rnd(fresh + 1),
                                _ => {
                                    fresh += 1;
                                    fresh
                                }
                            })
                            .collect();
                        let parent = (rnd(4) > 0).then(|| 1 + rnd(fresh + 1));
                        let mut ev = store(&hashes, parent, &tokens(n * BS, rnd(3) as u32));
                        if rnd(8) == 0 {
                            ev.token_ids.clear();
                            ev.medium = Some("CPU".into());
                        }
                        pod.store(&index, &ev, mode, &mut stats);
                    }
                    7..=8 => {
                        let hashes: Vec<u64> =
                            (0..1 + rnd(3)).map(|_| 1 + rnd(fresh + 1)).collect();
                        pod.remove(&index, &removed(&hashes), &mut stats);
                    }
                    9..=10 => {
                        let before = links_of(&pod);
                        let orphans = pod.orphans;
                        let n = 1 + rnd(8) as usize;
                        let want = n.min(pod.entries());
                        assert_eq!(pod.evict_oldest(&index, n), want, "{what}");
                        assert!(pod.orphans <= orphans, "{what}: eviction made an orphan");
                        assert_prefixes_kept(&before, &pod, &what);
                        evictions += want;
                    }
                    _ if rnd(30) == 0 => pod.clear(&index, &mut stats),
                    _ => {}
                }
                assert!(pod.released.len() <= pod.entries() + 64, "{what}");
            }
        }
        assert!(evictions > 5000, "{evictions}");
    }

    #[test]
    fn a_slot_is_forty_bytes() {
        assert_eq!(std::mem::size_of::<(EngineHash, HeldBlock)>(), 40);
    }

    #[test]
    fn an_evicted_block_takes_its_extra_stores_with_it() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m").bounded();
        let mut stats = ApplyStats::default();
        let t = tokens(4, 0);
        for _ in 0..3 {
            pod.store_t(&index, &store(&[1], None, &t), &mut stats);
        }
        assert_eq!(
            pod.export().blocks,
            vec![(1, pod.by_hash[&EngineHash(1)].key.0, [3, 0, 0])]
        );
        assert_eq!(pod.evict_oldest(&index, 1), 1);
        assert!(pod.extra.is_empty() && index.is_empty());
        // Stored again: one removal takes it.
        pod.store_t(&index, &store(&[1], None, &t), &mut stats);
        pod.remove(&index, &removed(&[1]), &mut stats);
        assert!(index.is_empty());
        assert_eq!(pod.entries(), 0);
    }

    #[test]
    fn store_order_survives_the_32_bit_stamp_wrap_and_long_lived_blocks() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m").bounded();
        let mut stats = ApplyStats::default();
        let put = |pod: &mut PodState, h: u64, stats: &mut ApplyStats| {
            pod.store_t(&index, &store(&[h], None, &tokens(4, h as u32 * 10)), stats)
        };
        let exported = |pod: &PodState| -> Vec<u64> {
            pod.export().blocks.iter().map(|(h, _, _)| *h).collect()
        };
        // The clock moved on by `n` stores of other blocks.
        let skip = |pod: &mut PodState, n: u64| {
            let target = pod.clock + n;
            while pod.clock < target {
                pod.clock = (target - 1).min((pod.clock / AGE_PASS + 1) * AGE_PASS - 1);
                pod.tick();
            }
        };
        // 9, 8, 7 stored around the wrap of the 32-bit stamps.
        pod.clock = (1 << 32) - 2;
        for h in [9, 8, 7] {
            put(&mut pod, h, &mut stats);
        }
        assert_eq!(exported(&pod), vec![9, 8, 7]);
        // 2^31 stores later, 6: the passes have clamped 9 and 8, not 7.
        skip(&mut pod, (1 << 31) - 1);
        put(&mut pod, 6, &mut stats);
        assert_eq!(exported(&pod), vec![8, 9, 7, 6], "clamped ones by hash");
        // 2^31 more: 7 is clamped too, 6 not yet, and all are older than 5
        // (without the passes, 9's stamp would read as one store old).
        skip(&mut pod, (1 << 31) - 1);
        put(&mut pod, 5, &mut stats);
        assert_eq!(exported(&pod), vec![7, 8, 9, 6, 5]);
        assert_eq!(pod.evict_oldest(&index, 4), 4);
        assert_eq!(exported(&pod), vec![5]);
        assert_eq!(index.len(), 1);
    }

    #[test]
    fn unknown_parent_is_counted_and_touches_nothing() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        pod.store_t(&index, &store(&[5, 6], Some(99), &tokens(8, 0)), &mut stats);
        assert_eq!(stats.parent_unknown_blocks, 2);
        assert!(index.is_empty());
        pod.remove(&index, &removed(&[5]), &mut stats);
        assert_eq!(stats.unknown_removals, 1);
    }

    #[test]
    fn tier_only_store_adds_a_tier_to_known_hashes() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        let t = tokens(4, 0);
        let keys = prompt_keys(request_root_seed("m", None, None), &t, BS);
        pod.store_t(&index, &store(&[1], None, &t), &mut stats);
        let mut offload = store(&[1, 2], None, &[]);
        offload.medium = Some("CPU".into());
        pod.store_t(&index, &offload, &mut stats);
        assert_eq!(stats.unkeyable_blocks, 1);
        assert_eq!(pod.held_per_tier(), [1, 1, 0]);
        pod.remove(&index, &removed(&[1]), &mut stats);
        // Still on CPU.
        assert_eq!(held_keys(&index, &keys, PodId(0)), 1);
        index.with_holders(keys[0], |h| {
            assert_eq!(
                h.unwrap()[0].tiers().tiers().collect::<Vec<_>>(),
                vec![Tier::Cpu]
            )
        });
    }

    #[test]
    fn clear_drops_only_this_pod() {
        let index = BlockIndex::new();
        let mut a = PodState::new(PodId(0), "m");
        let mut b = PodState::new(PodId(1), "m");
        let mut stats = ApplyStats::default();
        let t = tokens(8, 0);
        let keys = prompt_keys(request_root_seed("m", None, None), &t, BS);
        a.store_t(&index, &store(&[1, 2], None, &t), &mut stats);
        b.store_t(&index, &store(&[1, 2], None, &t), &mut stats);
        a.clear(&index, &mut stats);
        assert_eq!(held_keys(&index, &keys, PodId(0)), 0);
        assert_eq!(held_keys(&index, &keys, PodId(1)), 2);
        assert_eq!(a.held_per_tier(), [0; TIERS]);
        // Stores after a clear start from scratch again.
        a.store_t(&index, &store(&[3], Some(1), &t[4..]), &mut stats);
        assert_eq!(stats.parent_unknown_blocks, 1);
    }

    #[test]
    fn non_full_attention_groups_are_ignored_including_their_removals() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        let t = tokens(4, 0);
        let mut full = store(&[1], None, &t);
        full.group_idx = Some(0);
        full.kv_cache_spec_kind = Some("full_attention".into());
        let mut swa = full.clone();
        swa.group_idx = Some(1);
        swa.kv_cache_spec_kind = Some("sliding_window".into());
        pod.store_t(&index, &full, &mut stats);
        pod.store_t(&index, &swa, &mut stats);
        let mut rm = removed(&[1]);
        rm.group_idx = Some(1);
        pod.remove(&index, &rm, &mut stats);
        assert_eq!(stats.non_full_attention_events, 2);
        assert_eq!(pod.held_per_tier(), [1, 0, 0]);
    }

    #[test]
    fn lora_and_salt_extra_keys_make_request_compatible_keys() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        let t = tokens(8, 0);
        // Bare form (as vLLM 0.33 events carry it): salt on block 0, LoRA on all.
        let mut ev = store(&[1, 2], None, &t);
        ev.lora_name = Some("sql".into());
        ev.extra_keys = Some(vec![
            Some(vec![
                ExtraKey::Str("sql".into()),
                ExtraKey::Str("tenant".into()),
            ]),
            Some(vec![ExtraKey::Str("sql".into())]),
        ]);
        pod.store_t(&index, &ev, &mut stats);
        // Tagged form (0.31+ hashing tuples), no lora_name field.
        let mut tagged = store(&[3, 4], None, &t);
        let lora = ExtraKey::List(vec![
            ExtraKey::Str("lora".into()),
            ExtraKey::Str("chat".into()),
            ExtraKey::Str("/p".into()),
        ]);
        tagged.extra_keys = Some(vec![
            Some(vec![
                lora.clone(),
                ExtraKey::List(vec![
                    ExtraKey::Str("cache_salt".into()),
                    ExtraKey::Str("t2".into()),
                ]),
            ]),
            Some(vec![lora]),
        ]);
        pod.store_t(&index, &tagged, &mut stats);
        let want = |lora, salt| prompt_keys(request_root_seed("m", lora, salt), &t, BS);
        assert_eq!(
            held_keys(&index, &want(Some("sql"), Some("tenant")), PodId(0)),
            2
        );
        assert_eq!(
            held_keys(&index, &want(Some("chat"), Some("t2")), PodId(0)),
            2
        );
        assert_eq!(held_keys(&index, &want(Some("sql"), None), PodId(0)), 0);
        assert_eq!(held_keys(&index, &want(None, Some("tenant")), PodId(0)), 0);
        assert_eq!(held_keys(&index, &want(None, None), PodId(0)), 0);
    }

    #[test]
    fn id_only_lora_never_matches_a_plain_prompt() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        let t = tokens(4, 0);
        let mut ev = store(&[1], None, &t);
        ev.lora_id = Some(3);
        pod.store_t(&index, &ev, &mut stats);
        let plain = prompt_keys(request_root_seed("m", None, None), &t, BS);
        assert_eq!(held_keys(&index, &plain, PodId(0)), 0);
    }

    #[test]
    fn malformed_token_counts_are_rejected() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        pod.store_t(&index, &store(&[1, 2], None, &tokens(7, 0)), &mut stats);
        let mut zero = store(&[1], None, &tokens(4, 0));
        zero.block_size = Some(0);
        pod.store_t(&index, &zero, &mut stats);
        assert_eq!(stats.malformed_stores, 2);
        assert!(index.is_empty());
    }

    #[test]
    fn prefix_closure_is_tracked_through_holes_and_re_stores() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        let remove = |pod: &mut PodState, h: u64, stats: &mut ApplyStats| {
            pod.remove(
                &index,
                &BlockRemoved {
                    block_hashes: vec![EngineHash(h)],
                    ..Default::default()
                },
                stats,
            )
        };
        // 1 <- 2 <- 3, one store.
        pod.store_t(&index, &store(&[1, 2, 3], None, &tokens(12, 0)), &mut stats);
        assert_eq!(pod.closed_tier(), Some(Tier::Gpu));
        // A hole: 3 is an orphan now.
        remove(&mut pod, 2, &mut stats);
        assert_eq!(pod.closed_tier(), None);
        // 2 comes back: a new incarnation; 3 stays counted as the orphan it
        // was (conservative), until it goes.
        pod.store_t(&index, &store(&[2], Some(1), &tokens(4, 4)), &mut stats);
        assert_eq!(pod.closed_tier(), None);
        remove(&mut pod, 3, &mut stats);
        assert_eq!(pod.closed_tier(), Some(Tier::Gpu));
        // The new 2's own children are counted against it, not the old one.
        pod.store_t(&index, &store(&[9], Some(2), &tokens(4, 8)), &mut stats);
        remove(&mut pod, 9, &mut stats);
        remove(&mut pod, 2, &mut stats);
        assert_eq!(pod.closed_tier(), Some(Tier::Gpu));
        assert_eq!(pod.orphans, 0);
        // A CPU copy makes two tiers: not the single-tier fast path.
        let mut cpu = store(&[1], None, &[]);
        cpu.medium = Some("CPU".into());
        pod.store_t(&index, &cpu, &mut stats);
        assert_eq!(pod.closed_tier(), None);
    }

    #[test]
    fn a_restored_pod_keeps_its_prefix_closure() {
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m");
        let mut stats = ApplyStats::default();
        pod.store_t(&index, &store(&[1, 2, 3], None, &tokens(12, 0)), &mut stats);
        // Re-storing the root makes it newer than its children: the export
        // lists children before their parent.
        pod.store_t(&index, &store(&[1], None, &tokens(4, 0)), &mut stats);
        pod.store_t(&index, &store(&[4], Some(3), &tokens(4, 5)), &mut stats);
        pod.store_t(&index, &store(&[5], Some(1), &tokens(4, 9)), &mut stats);
        // A hole: 2 goes, 3 (and through it 4) is cut off.
        pod.remove(
            &index,
            &BlockRemoved {
                block_hashes: vec![EngineHash(2)],
                ..Default::default()
            },
            &mut stats,
        );
        assert_eq!(pod.orphans, 1);
        let export = pod.export();

        let restored_index = BlockIndex::new();
        let mut restored = PodState::new(PodId(0), "m");
        restored.import(
            &restored_index,
            &export.blocks,
            &export.parents,
            &export.non_full_groups,
            Some(4),
        );
        assert_eq!(restored.orphans, 1, "3 is still the one orphan");
        let remove = |pod: &mut PodState, index: &BlockIndex, h: u64| {
            let mut stats = ApplyStats::default();
            pod.remove(
                index,
                &BlockRemoved {
                    block_hashes: vec![EngineHash(h)],
                    ..Default::default()
                },
                &mut stats,
            )
        };
        remove(&mut restored, &restored_index, 4);
        remove(&mut restored, &restored_index, 3);
        assert_eq!(restored.closed_tier(), Some(Tier::Gpu));
        // 1 was stored twice: it goes on the second removal.
        remove(&mut restored, &restored_index, 1);
        assert_eq!(restored.closed_tier(), Some(Tier::Gpu));
        remove(&mut restored, &restored_index, 1);
        assert_eq!(restored.closed_tier(), None, "5 lost its parent");

        // An old snapshot (no parents): every block is an orphan.
        let mut old = PodState::new(PodId(1), "m");
        old.import(&BlockIndex::new(), &export.blocks, &[], &[], Some(4));
        assert_eq!(old.orphans, 4);
        assert_eq!(old.closed_tier(), None);
    }
}

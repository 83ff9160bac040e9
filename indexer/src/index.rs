//! The former concurrent store: block key -> the pods holding it, per
//! tier. The service's index is now `runs`; this stays as the reference
//! the runs are tested against (`pod_feed`'s property test), and for the
//! small types both use (`PodId`, `TierMask`, `KeyBuildHasher`).
//!
//! Sharded (a read-write lock per shard), so pods applying events and
//! requests scoring prompts only contend when they touch the same shard at
//! the same instant; there is no global lock. The per-pod bookkeeping that makes removals and clears
//! cheap lives in `pod`; this module only knows keys and holders.

use std::cell::RefCell;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

use hashbrown::hash_table::{Entry, HashTable};
use parking_lot::RwLock;
use smallvec::SmallVec;

use crate::event::Tier;
pub use crate::holders::{Holder, HolderSet, Holders, MAX_PODS};
use crate::keys::BlockKey;
use crate::repeats::Repeats;

/// Interned pod identity: an index into the indexer's pod table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodId(pub u32);

/// Bit set of tiers (`1 << Tier as usize`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierMask(pub u8);

impl TierMask {
    pub fn contains(self, tier: Tier) -> bool {
        self.0 & (1 << tier.index()) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn tiers(self) -> impl Iterator<Item = Tier> {
        Tier::ALL.into_iter().filter(move |t| self.contains(*t))
    }
}

/// Hasher for 64-bit keys: one finalizer round (murmur3's fmix64) instead
/// of SipHash. Our keys are xxh3 values, but engine hashes come from the
/// pods: whatever their distribution, every bit of the result must depend on
/// every bit of the key (hashbrown tags slots from the top bits; sequential
/// ints would otherwise crowd into a few groups).
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^ (x >> 33)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub type KeyBuildHasher = BuildHasherDefault<KeyHasher>;

/// A key as the shared table holds it: mixed by `KeyHasher`'s finalizer.
/// Each of its steps (`x ^= x >> 33`, a multiply by an odd constant) can be
/// undone, so the mixed word names the key as uniquely as the key does, and
/// it is also the key's hash: a change carries one word for both, and a
/// probe hashes once.
#[inline]
fn mixed(key: BlockKey) -> u64 {
    KeyBuildHasher::default().hash_one(key)
}

/// One reference of a pod on a key and tier, taken or dropped: what a pod's
/// event turns into, applied to the index in one batch.
#[derive(Clone, Copy, Debug)]
pub struct Change {
    /// `mixed(key)`.
    key: u64,
    pod: PodId,
    tier: Tier,
    acquire: bool,
    /// The key's shard, set by `BlockIndex::apply` once per batch (in what
    /// was padding), where grouping computed it three or four times.
    shard: u16,
}

impl Change {
    pub fn acquire(key: BlockKey, pod: PodId, tier: Tier) -> Change {
        Change {
            key: mixed(key),
            shard: 0,
            pod,
            tier,
            acquire: true,
        }
    }

    pub fn release(key: BlockKey, pod: PodId, tier: Tier) -> Change {
        Change {
            acquire: false,
            ..Change::acquire(key, pod, tier)
        }
    }
}

/// One shard: holders per key, and the rare extra references. A pod holds a
/// key on a tier once per engine hash of its that resolves to the key
/// (normally one; more only when an engine distinguishes blocks our keys
/// cannot, e.g. old wire forms without extra keys): the holder's tier bit
/// stands for the first, `extra` counts the rest.
#[derive(Default)]
struct Shard {
    /// (mixed key, holders); the mixed key is also the slot's hash.
    holders: HashTable<(u64, Holders)>,
    extra: Repeats<(u64, PodId)>,
    /// A bounded index's table capacity, kept (see `make_room`); 0: the
    /// table grows as it fills.
    fixed: usize,
}

/// One shard's lock on its own cache line (readers of one shard do not
/// bounce the line of the next).
#[repr(align(64))]
#[derive(Default)]
struct Padded(RwLock<Shard>);

/// Shards: enough that a reader's probe rarely lands on a shard a writer
/// holds or just held (its lock's cache line then has to come back from the
/// writer's core). Lookups under ingest with 128 pods ran 1.3x faster with
/// 64 shards than 16, and 1.5x faster again with 256, in interleaved runs;
/// applying did not measurably slow, although one event's blocks now share
/// fewer shard locks (see `apply`). A bounded index takes up to twice as
/// many, however many fit its tables best (see `with_max_keys`).
const SHARDS: usize = 256;
const MAX_SHARDS: usize = 2 * SHARDS;

/// A bounded index's tables are sized so that the fullest shard one can
/// expect (its mean share of keys plus four standard deviations) fills at
/// most this much of its buckets. Above it, rehashing in place (see
/// `Shard::make_room`) comes often: a simulation of hashbrown under churn
/// moved 0.24 keys per insert at 59% load, 0.65 at 68%, 1.7 at 76% and 7.3
/// at 83%.
const BOUNDED_LOAD: f64 = 0.7;

/// Most changes applied under one shard lock.
const MAX_GROUP: usize = 32;

/// Most keys `BlockIndex::with_holders_each` probes under one set of shard
/// guards.
pub const MAX_PROBES: usize = 8;

/// Batches from this size on are grouped by counting: for a few dozen
/// changes, zeroing and summing the 256-entry table costs about what
/// sorting them does.
const COUNTING_MIN: usize = 64;

/// A grouping buffer larger than this (a long document's event) is let go.
const MAX_KEPT_GROUPED: usize = 8192;

thread_local! {
    /// Where `BlockIndex::apply` groups a batch, per thread, reused.
    static GROUPED: RefCell<Vec<Change>> = const { RefCell::new(Vec::new()) };
}

/// `changes` (their `shard` set) into `out` in shard order (of `shards`
/// shards), stable: a counting sort.
fn group_by_shard(changes: &[Change], shards: usize, out: &mut Vec<Change>) {
    // Indexed under a mask that changes nothing (shards <= MAX_SHARDS, a
    // power of two) but lets the compiler drop the bounds checks.
    let mut next = [0u32; MAX_SHARDS];
    for c in changes {
        next[usize::from(c.shard) & (MAX_SHARDS - 1)] += 1;
    }
    let mut at = 0;
    for n in next[..shards].iter_mut() {
        let count = *n;
        *n = at;
        at += count;
    }
    out.clear();
    out.resize(changes.len(), changes[0]);
    for c in changes {
        let slot = &mut next[usize::from(c.shard) & (MAX_SHARDS - 1)];
        out[*slot as usize] = *c;
        *slot += 1;
    }
}

pub struct BlockIndex {
    shards: Box<[Padded]>,
}

impl Default for BlockIndex {
    fn default() -> Self {
        BlockIndex::with_shards(SHARDS, 0)
    }
}

impl BlockIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// `shards` shards whose tables keep `fixed` capacity (0: grow).
    fn with_shards(shards: usize, fixed: usize) -> Self {
        BlockIndex {
            shards: (0..shards)
                .map(|_| {
                    Padded(RwLock::new(Shard {
                        holders: HashTable::with_capacity(fixed),
                        extra: Repeats::default(),
                        fixed,
                    }))
                })
                .collect(),
        }
    }

    /// An index that will hold at most `max_keys` keys, its tables sized
    /// for them up front and kept at that size (churn at capacity rehashes
    /// them in place, see `Shard::make_room`), so memory stays flat.
    ///
    /// Keys spread over the shards by hash, so a shard's share is binomial
    /// around the mean; tables come in powers of two. Of the shard counts
    /// from `SHARDS` to twice that, the one whose tables, each sized for
    /// the mean share plus four standard deviations at `BOUNDED_LOAD`,
    /// take the fewest buckets in all: a factor of two in shard counts
    /// spans one power of two in table sizes, so from 100,000 keys on the
    /// mean shard's table is 54-69% full, 36-46 bytes per key. (Sized at
    /// twice the share, with 256 shards, it was 22-44%, 86-138 bytes.)
    pub fn with_max_keys(max_keys: usize) -> Self {
        let buckets_for = |shards: usize| {
            let mean = max_keys.div_ceil(shards);
            let fullest = mean + 4 * (mean as f64).sqrt().ceil() as usize + 16;
            ((fullest as f64 / BOUNDED_LOAD).ceil() as usize).next_power_of_two()
        };
        let shards = (SHARDS..=MAX_SHARDS)
            .min_by_key(|n| n.saturating_mul(buckets_for(*n)))
            .unwrap_or(SHARDS);
        // hashbrown's capacity for that many buckets: 7/8 of them.
        Self::with_shards(shards, buckets_for(shards) / 8 * 7)
    }

    fn shard(&self, key: u64) -> &RwLock<Shard> {
        &self.shards[shard_of(key, self.shards.len())].0
    }

    /// Records one more reference of `pod` holding `key` on `tier`.
    pub fn acquire(&self, key: BlockKey, pod: PodId, tier: Tier) {
        self.change(Change::acquire(key, pod, tier));
    }

    /// Drops one reference; forgets the holder, and the key, once
    /// unreferenced.
    pub fn release(&self, key: BlockKey, pod: PodId, tier: Tier) {
        self.change(Change::release(key, pod, tier));
    }

    /// Applies `changes` (emptying it), taking each shard's lock once.
    ///
    /// Why batch: a lock round trip per block is a full fence on x86, which
    /// also keeps the next block's cache miss from starting early. Grouped by
    /// shard, one event's blocks pay a few locks and their misses overlap.
    /// Changes to one key by one batch must commute (all acquires or all
    /// releases, as one event's are): the grouping reorders them.
    ///
    /// Large batches are grouped by counting (two linear passes), not by a
    /// comparison sort: the sort was a fifth of applying's instructions
    /// (callgrind, a few hundred changes per event).
    pub fn apply(&self, changes: &mut Vec<Change>) {
        if changes.len() < 4 {
            for c in changes.drain(..) {
                self.change(c);
            }
            return;
        }
        let shards = self.shards.len();
        for c in changes.iter_mut() {
            c.shard = shard_of(c.key, shards) as u16;
        }
        if changes.len() >= COUNTING_MIN {
            let counted = GROUPED.with(|cell| {
                let Ok(mut grouped) = cell.try_borrow_mut() else {
                    return false;
                };
                group_by_shard(changes, shards, &mut grouped);
                self.apply_grouped(&grouped);
                if grouped.capacity() > MAX_KEPT_GROUPED {
                    *grouped = Vec::new();
                }
                true
            });
            if counted {
                changes.clear();
                return;
            }
        }
        changes.sort_unstable_by_key(|c| c.shard);
        self.apply_grouped(changes);
        changes.clear();
    }

    /// Applies changes ordered by shard (their `shard` set), one lock per
    /// shard's run of them.
    fn apply_grouped(&self, changes: &[Change]) {
        // Bounded groups: a reader waits out one group, never a whole
        // 8K-block document.
        let mut rest = changes;
        while let Some(first) = rest.first() {
            let shard = first.shard;
            let run = 1 + rest[1..rest.len().min(MAX_GROUP)]
                .iter()
                .take_while(|c| c.shard == shard)
                .count();
            let (group, tail) = rest.split_at(run);
            rest = tail;
            let mut map = self.shards[usize::from(shard)].0.write();
            // Every key probed first, the answers dropped: these probes do
            // not wait on each other, so their cache misses overlap, where
            // each change's probe came after the last one's insert or
            // removal and took its misses one at a time (apply +18-34% in
            // the comparison bench).
            // A spilled holder list is a line of its own on the heap: its
            // ends are read here too (a key's bits: their first word), so
            // that its miss overlaps the others instead of waiting in
            // `change` (with 128 pods, the binary search's first read of
            // such lists was ~60% of `change`'s samples).
            for c in group {
                if let Some((_, holders)) = map.holders.find(c.key, |(k, _)| *k == c.key) {
                    holders.touch();
                }
            }
            for c in group {
                map.change(c);
            }
        }
    }

    fn change(&self, c: Change) {
        self.shard(c.key).write().change(&c);
    }

    /// Runs `f` on the holders of `key` (empty if nobody holds it).
    pub fn with_holders<R>(&self, key: BlockKey, f: impl FnOnce(HolderSet<'_>) -> R) -> R {
        let key = mixed(key);
        let shard = read_spinning(self.shard(key));
        f(shard
            .holders
            .find(key, |(k, _)| *k == key)
            .map_or(HolderSet::EMPTY, |(_, h)| h.view()))
    }

    /// Runs `f(i, holders of keys[i])` for every key, probing up to
    /// `MAX_PROBES` keys together: their shards' read locks are taken
    /// first, then every key is found, and only then is `f` called.
    ///
    /// Why: a probe is one to three dependent cache misses (the table's
    /// control bytes, its slot, a spilled holder list), and taking or
    /// releasing a lock is a locked instruction, which waits for every load
    /// before it. Probe after probe (`with_holders`), a search pays its
    /// misses one after another; here a group's finds do not wait on each
    /// other, so their misses overlap.
    ///
    /// A group never waits while it holds a shard: it takes its shards with
    /// `try_read`, and if a writer holds one, it lets go of the others and
    /// probes its keys one at a time, as `with_holders` does. (Waiting for
    /// one shard while holding another could deadlock: a writer queued on a
    /// held shard blocks new readers of it, and the lock is fair.) `f` must
    /// not use the index.
    pub fn with_holders_each(&self, keys: &[BlockKey], mut f: impl FnMut(usize, HolderSet<'_>)) {
        for (c, chunk) in keys.chunks(MAX_PROBES).enumerate() {
            let mut hashes = [0u64; MAX_PROBES];
            let mut shard_of_key = [0u16; MAX_PROBES];
            for (i, key) in chunk.iter().enumerate() {
                hashes[i] = mixed(*key);
                shard_of_key[i] = shard_of(hashes[i], self.shards.len()) as u16;
            }
            let mut guards = SmallVec::new();
            if !self.try_read_all(&shard_of_key[..chunk.len()], &mut guards) {
                drop(guards);
                for (i, key) in chunk.iter().enumerate() {
                    self.with_holders(*key, |holders| f(c * MAX_PROBES + i, holders));
                }
                continue;
            }
            let mut found: [Option<&Holders>; MAX_PROBES] = [None; MAX_PROBES];
            for (i, hash) in hashes[..chunk.len()].iter().enumerate() {
                let (_, shard) = guards
                    .iter()
                    .find(|(s, _)| *s == shard_of_key[i])
                    .expect("every key's shard is held");
                found[i] = shard
                    .holders
                    .find(*hash, |(k, _)| k == hash)
                    .map(|(_, h)| h);
                // A spilled list's line: its miss overlaps the next find's.
                if let Some(h) = found[i] {
                    h.touch();
                }
            }
            for (i, holders) in found[..chunk.len()].iter().enumerate() {
                f(
                    c * MAX_PROBES + i,
                    holders.map_or(HolderSet::EMPTY, Holders::view),
                );
            }
        }
    }

    /// Takes read guards of `shards` into `guards`, each shard once (sorted,
    /// so that repeats sit together); false as soon as a writer holds one.
    fn try_read_all<'a>(
        &'a self,
        shards: &[u16],
        guards: &mut SmallVec<[(u16, ShardGuard<'a>); MAX_PROBES]>,
    ) -> bool {
        let mut sorted = [0u16; MAX_PROBES];
        let sorted = &mut sorted[..shards.len()];
        sorted.copy_from_slice(shards);
        sorted.sort_unstable();
        for &s in sorted.iter() {
            if guards.last().is_none_or(|(last, _)| *last != s) {
                match self.shards[usize::from(s)].0.try_read() {
                    Some(guard) => guards.push((s, guard)),
                    None => return false,
                }
            }
        }
        true
    }

    /// Number of distinct keys held by at least one pod.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.read().holders.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|s| s.0.read().holders.is_empty())
    }
}

type ShardGuard<'a> = parking_lot::RwLockReadGuard<'a, Shard>;

/// A shard's read lock, spinning briefly before parking: writers hold a
/// shard for at most `MAX_GROUP` changes (microseconds), while parking and
/// being woken costs a reader tens of them (mixed reads under ingest went
/// 1.5x faster with 128 pods).
fn read_spinning(lock: &RwLock<Shard>) -> ShardGuard<'_> {
    for _ in 0..256 {
        if let Some(map) = lock.try_read() {
            return map;
        }
        std::hint::spin_loop();
    }
    lock.read()
}

/// The shard of a key's hash, of `shards`: the 32 bits below the top 7
/// (which the shard's own table uses for its control bytes) scaled to the
/// shard count. With 256 shards, the top 8 of those bits.
#[inline]
fn shard_of(hash: u64, shards: usize) -> usize {
    ((((hash << 7) >> 32) * shards as u64) >> 32) as usize
}

impl Shard {
    fn change(&mut self, c: &Change) {
        if c.acquire {
            self.take(c.key, c.pod, c.tier);
        } else {
            self.drop_ref(c.key, c.pod, c.tier);
        }
    }

    /// Rehashes a fixed-size table in place when it has no room left:
    /// removals leave tombstones, and hashbrown, on running out, rehashes
    /// in place only while at most half full and otherwise doubles, so a
    /// bounded table under churn at capacity would grow. Here the live keys
    /// (the index's share, at most `BOUNDED_LOAD` of the buckets as sized)
    /// are taken out and put back, which clears the tombstones. A shard
    /// whose live keys nearly fill it (far past the share it was sized for)
    /// is left to grow instead: rehashing it would come every few inserts.
    fn make_room(&mut self) {
        let (len, capacity) = (self.holders.len(), self.holders.capacity());
        if self.fixed == 0 || capacity > len || len > self.fixed - self.fixed / 16 {
            return;
        }
        let live: Vec<(u64, Holders)> = self.holders.drain().collect();
        for entry in live {
            self.holders.insert_unique(entry.0, entry, |(k, _)| *k);
        }
    }

    fn take(&mut self, key: u64, pod: PodId, tier: Tier) {
        self.make_room();
        match self.holders.entry(key, |(k, _)| *k == key, |(k, _)| *k) {
            // The common case while caches fill: a key's first holder.
            Entry::Vacant(v) => {
                v.insert((key, Holders::one(pod, tier)));
            }
            Entry::Occupied(o) => {
                if !o.into_mut().1.add(pod, tier) {
                    self.extra.add((key, pod), tier);
                }
            }
        }
    }

    fn drop_ref(&mut self, key: u64, pod: PodId, tier: Tier) {
        // `find_entry`, not `entry`: a miss must not grow the table.
        let Ok(mut entry) = self.holders.find_entry(key, |(k, _)| *k == key) else {
            return;
        };
        let holders = &mut entry.get_mut().1;
        if !holders.view().get(pod).is_some_and(|t| t.contains(tier)) {
            return;
        }
        if self.extra.take((key, pod), tier) {
            return;
        }
        holders.remove(pod, tier);
        if holders.is_empty() {
            entry.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiers_of(index: &BlockIndex, key: BlockKey) -> Vec<(u32, u8)> {
        index.with_holders(key, |h| {
            h.iter().map(|h| (h.pod().0, h.tiers().0)).collect()
        })
    }

    #[test]
    fn acquire_and_release_are_counted_per_pod_and_tier() {
        let index = BlockIndex::new();
        let k = BlockKey(1);
        index.acquire(k, PodId(2), Tier::Gpu);
        index.acquire(k, PodId(1), Tier::Gpu);
        index.acquire(k, PodId(2), Tier::Gpu);
        index.acquire(k, PodId(2), Tier::Cpu);
        assert_eq!(tiers_of(&index, k), vec![(1, 0b001), (2, 0b011)]);

        index.release(k, PodId(2), Tier::Gpu);
        assert_eq!(tiers_of(&index, k), vec![(1, 0b001), (2, 0b011)]);
        index.release(k, PodId(2), Tier::Gpu);
        assert_eq!(tiers_of(&index, k), vec![(1, 0b001), (2, 0b010)]);
        index.release(k, PodId(2), Tier::Cpu);
        index.release(k, PodId(1), Tier::Gpu);
        assert!(index.is_empty());
    }

    /// The table holds mixed keys in place of keys: that is only sound if
    /// mixing loses nothing. Undo it step by step.
    #[test]
    fn mixing_a_key_can_be_undone() {
        fn inverse(odd: u64) -> u64 {
            // Newton's iteration doubles the correct low bits each step.
            let mut inv = odd;
            for _ in 0..6 {
                inv = inv.wrapping_mul(2u64.wrapping_sub(odd.wrapping_mul(inv)));
            }
            inv
        }
        let unmix = |mut x: u64| {
            x ^= x >> 33;
            x = x.wrapping_mul(inverse(0xc4ce_b9fe_1a85_ec53));
            x ^= x >> 33;
            x = x.wrapping_mul(inverse(0xff51_afd7_ed55_8ccd));
            x ^ (x >> 33)
        };
        let mut rnd = crate::test_rng::xorshift(0x5eed);
        for key in [0, 1, u64::MAX, 1 << 63]
            .into_iter()
            .chain((0..10_000).map(|_| rnd(u64::MAX)))
        {
            assert_eq!(unmix(mixed(BlockKey(key))), key);
        }
    }

    #[test]
    fn sequential_keys_spread_over_the_top_bits() {
        use std::hash::BuildHasher;
        let top: std::collections::HashSet<u64> = (0..1000u64)
            .map(|k| KeyBuildHasher::default().hash_one(k) >> 56)
            .collect();
        assert!(top.len() > 200, "{}", top.len());
    }

    #[test]
    fn releasing_what_was_never_held_is_harmless() {
        let index = BlockIndex::new();
        index.release(BlockKey(9), PodId(0), Tier::Gpu);
        index.acquire(BlockKey(9), PodId(0), Tier::Cpu);
        index.release(BlockKey(9), PodId(0), Tier::Gpu);
        index.release(BlockKey(9), PodId(1), Tier::Cpu);
        assert_eq!(tiers_of(&index, BlockKey(9)), vec![(0, 0b010)]);
    }

    #[test]
    fn a_change_keeps_its_shard_in_what_was_padding() {
        assert_eq!(std::mem::size_of::<Change>(), 16);
    }

    #[test]
    fn large_batches_are_grouped_by_counting_and_applied_whole() {
        let index = BlockIndex::new();
        for n in [5, COUNTING_MIN - 1, COUNTING_MIN, 3000] {
            let keys: Vec<BlockKey> = (0..n as u64).map(|k| BlockKey(k * 7 + 1)).collect();
            // Two pods per key, on two tiers.
            let batch = |change: fn(BlockKey, PodId, Tier) -> Change| -> Vec<Change> {
                keys.iter()
                    .flat_map(|k| {
                        [
                            change(*k, PodId(1), Tier::Gpu),
                            change(*k, PodId(0), Tier::Cpu),
                        ]
                    })
                    .collect()
            };
            let mut acquires = batch(Change::acquire);
            index.apply(&mut acquires);
            assert!(acquires.is_empty());
            assert_eq!(index.len(), n);
            for k in &keys {
                assert_eq!(tiers_of(&index, *k), vec![(0, 0b010), (1, 0b001)], "{n}");
            }
            index.apply(&mut batch(Change::release));
            assert!(index.is_empty(), "{n}");
        }
        let mut grouped = Vec::new();
        let changes: Vec<Change> = (0..500u64)
            .map(|k| {
                let mut c = Change::acquire(BlockKey(k), PodId(0), Tier::Gpu);
                c.shard = shard_of(c.key, 300) as u16;
                c
            })
            .collect();
        group_by_shard(&changes, 300, &mut grouped);
        assert!(grouped.windows(2).all(|w| w[0].shard <= w[1].shard));
        let mut keys: Vec<u64> = grouped.iter().map(|c| c.key).collect();
        keys.sort_unstable();
        let mut want: Vec<u64> = (0..500).map(|k| mixed(BlockKey(k))).collect();
        want.sort_unstable();
        assert_eq!(keys, want);
    }

    /// Keys probed together (`with_holders_each`) see what probing them
    /// one at a time sees: held inline, as a list or as bits, absent,
    /// repeated, several in one shard, more than one group of them.
    #[test]
    fn probing_together_finds_what_probing_alone_finds() {
        let index = BlockIndex::new();
        let mut rnd = crate::test_rng::xorshift(0x5eed);
        let keys: Vec<BlockKey> = (0..400).map(|k| BlockKey(k * 7919)).collect();
        for (i, key) in keys.iter().enumerate() {
            // Every third key absent; the rest held by 1 to 120 pods.
            if i % 3 == 0 {
                continue;
            }
            let holders = 1 + rnd(if i % 5 == 0 { 120 } else { 6 });
            for _ in 0..holders {
                let tier = Tier::ALL[rnd(3) as usize];
                index.acquire(*key, PodId(rnd(200) as u32), tier);
            }
        }
        // Keys of one shard, to probe in one group (held by pod 7).
        let first_shard = shard_of(mixed(keys[1]), index.shards.len());
        let same_shard: Vec<BlockKey> = (1..20_000)
            .map(|k| BlockKey(k * 104_729))
            .filter(|k| shard_of(mixed(*k), index.shards.len()) == first_shard)
            .take(5)
            .collect();
        assert_eq!(same_shard.len(), 5);
        for key in &same_shard[1..] {
            index.acquire(*key, PodId(7), Tier::Cpu);
        }
        for probe in [
            keys.clone(),
            keys[..MAX_PROBES + 3].to_vec(),
            vec![keys[1], keys[1], keys[0], keys[1]],
            same_shard,
            (0..50).map(|_| keys[rnd(400) as usize]).collect(),
            Vec::new(),
        ] {
            let mut seen = Vec::new();
            index.with_holders_each(&probe, |i, h| {
                seen.push((i, h.iter().map(|h| (h.pod().0, h.tiers().0)).collect()));
            });
            let want: Vec<(usize, Vec<(u32, u8)>)> = probe
                .iter()
                .enumerate()
                .map(|(i, k)| (i, tiers_of(&index, *k)))
                .collect();
            assert_eq!(seen, want);
        }
    }

    /// While a writer holds one of a group's shards, the group waits for it
    /// holding nothing else, and still answers every key.
    #[test]
    fn a_group_with_a_shard_a_writer_holds_waits_holding_nothing() {
        let index = BlockIndex::new();
        let keys: Vec<BlockKey> = (0..MAX_PROBES as u64)
            .map(|k| BlockKey(k * 104_729))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            index.acquire(*key, PodId(i as u32), Tier::Gpu);
        }
        let written = shard_of(mixed(keys[3]), index.shards.len());
        let writer = index.shards[written].0.write();
        let (index, keys) = (&index, &keys);
        std::thread::scope(|s| {
            let reader = s.spawn(move || {
                let mut seen = Vec::new();
                index.with_holders_each(keys, |i, h| {
                    seen.push((i, h.iter().map(|h| h.pod().0).collect::<Vec<_>>()));
                });
                seen
            });
            // Meanwhile every other key's shard is free: the group let go
            // of those it took.
            std::thread::sleep(std::time::Duration::from_millis(50));
            for (i, key) in keys.iter().enumerate() {
                if shard_of(mixed(*key), index.shards.len()) != written {
                    let free = index.shards[shard_of(mixed(*key), index.shards.len())]
                        .0
                        .try_write();
                    assert!(free.is_some(), "key {i}'s shard is still held");
                }
            }
            drop(writer);
            let seen = reader.join().unwrap();
            let want: Vec<(usize, Vec<u32>)> =
                (0..keys.len()).map(|i| (i, vec![i as u32])).collect();
            assert_eq!(seen, want);
        });
    }

    /// Readers probing groups beside writers changing the same keys: no
    /// deadlock, and every holder a reader sees is one of the writers.
    #[test]
    fn groups_of_probes_beside_writers_finish() {
        let index = BlockIndex::new();
        let keys: Vec<BlockKey> = (0..64).map(|k| BlockKey(k * 31_337)).collect();
        let index = &index;
        let keys = &keys;
        std::thread::scope(|s| {
            for w in 0..2u32 {
                s.spawn(move || {
                    for round in 0..2_000u32 {
                        let mut changes: Vec<Change> = keys
                            .iter()
                            .map(|k| Change::acquire(*k, PodId(w), Tier::Gpu))
                            .collect();
                        index.apply(&mut changes);
                        let mut changes: Vec<Change> = keys
                            .iter()
                            .skip(round as usize % 3)
                            .map(|k| Change::release(*k, PodId(w), Tier::Gpu))
                            .collect();
                        index.apply(&mut changes);
                    }
                });
            }
            for _ in 0..2 {
                s.spawn(move || {
                    for _ in 0..2_000 {
                        index.with_holders_each(keys, |_, h| {
                            assert!(h.iter().all(|h| h.pod().0 < 2));
                        });
                    }
                });
            }
        });
    }

    /// The bytes of the shards' tables.
    fn table_bytes(index: &BlockIndex) -> usize {
        index
            .shards
            .iter()
            .map(|s| s.0.read().holders.allocation_size())
            .sum()
    }

    /// A bounded index's tables take at most 1.9 slots (of 24 bytes and a
    /// control byte) per key from 100,000 keys on (at twice the share and
    /// 256 shards they took 2.6-4.2), and churn at capacity, which leaves
    /// tombstones, never reallocates them.
    #[test]
    fn a_bounded_index_is_sized_for_its_keys_and_stays_so_under_churn() {
        for max_keys in [1_000usize, 200_000, 300_000, 1_000_000, 3_000_000] {
            let index = BlockIndex::with_max_keys(max_keys);
            let bytes = table_bytes(&index);
            let per_key = bytes as f64 / max_keys as f64;
            let slot = std::mem::size_of::<(u64, Holders)>() as f64 + 1.0;
            assert!(
                (slot..=slot * 1.9).contains(&per_key) || max_keys < 100_000,
                "{max_keys} keys: {per_key:.1} bytes per key"
            );
            if max_keys > 200_000 {
                continue;
            }
            // Endless new keys, the oldest released: `max_keys` live.
            let mut rnd = crate::test_rng::xorshift(max_keys as u64);
            let mut live = std::collections::VecDeque::new();
            for _ in 0..4 * max_keys {
                if live.len() == max_keys {
                    let old = live.pop_front().unwrap();
                    index.release(old, PodId(0), Tier::Gpu);
                }
                let key = BlockKey(rnd(u64::MAX));
                index.acquire(key, PodId(0), Tier::Gpu);
                live.push_back(key);
            }
            assert_eq!(index.len(), max_keys);
            assert_eq!(table_bytes(&index), bytes, "{max_keys} keys");
        }
    }

    #[test]
    fn extra_references_keep_each_tier_until_its_last() {
        let index = BlockIndex::new();
        let k = BlockKey(5);
        let top = PodId(MAX_PODS - 1);
        for _ in 0..3 {
            index.acquire(k, top, Tier::Storage);
        }
        index.acquire(k, top, Tier::Gpu);
        assert_eq!(tiers_of(&index, k), vec![(MAX_PODS - 1, 0b101)]);
        index.release(k, top, Tier::Gpu);
        index.release(k, top, Tier::Gpu);
        index.release(k, top, Tier::Storage);
        index.release(k, top, Tier::Storage);
        assert_eq!(tiers_of(&index, k), vec![(MAX_PODS - 1, 0b100)]);
        index.release(k, top, Tier::Storage);
        assert!(index.is_empty());
        assert!(index.shards.iter().all(|s| s.0.read().extra.is_empty()));
    }
}

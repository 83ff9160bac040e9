//! The prefix walk: per candidate pod, how many leading blocks of a prompt it
//! holds, and a tier-weighted score.

use std::ops::Range;

use crate::event::{Tier, TIERS};
use crate::holders::Bits;
use crate::index::{BlockIndex, HolderSet, PodId, TierMask, MAX_PROBES};
use crate::keys::BlockKey;

/// How much a matched block is worth by the tier it is held on. A block held
/// on several tiers counts at its best tier.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierWeights(pub [f64; TIERS]);

impl Default for TierWeights {
    /// GPU hits are free; CPU needs a host-to-device copy; storage a read.
    fn default() -> Self {
        TierWeights([1.0, 0.8, 0.5])
    }
}

impl TierWeights {
    pub fn get(&self, tier: Tier) -> f64 {
        self.0[tier.index()]
    }
}

/// One candidate's run of leading blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefixMatch {
    pub matched_blocks: u32,
    /// Of the matched blocks, how many are held on each tier.
    pub blocks_per_tier: [u32; TIERS],
    /// Of the matched blocks, how many have each tier as their best.
    pub best_tier_blocks: [u32; TIERS],
    /// Sum over matched blocks of the best tier's weight (computed from
    /// `best_tier_blocks`, so every way of finding a match gives the same
    /// floating-point value).
    pub weighted_blocks: f64,
}

impl PrefixMatch {
    /// `blocks` leading blocks, all held on `tier` only.
    pub fn on_one_tier(blocks: u32, tier: Tier, weights: &TierWeights) -> PrefixMatch {
        // Built whole: one element stored at a variable index and the array
        // then read back whole stalls store forwarding, per candidate pod.
        let on_tier: [u32; TIERS] =
            std::array::from_fn(|i| if i == tier.index() { blocks } else { 0 });
        // What `weigh` computes: the other tiers add exact zeros.
        PrefixMatch {
            matched_blocks: blocks,
            blocks_per_tier: on_tier,
            best_tier_blocks: on_tier,
            weighted_blocks: f64::from(blocks) * weights.get(tier),
        }
    }

    pub(crate) fn weigh(&mut self, weights: &TierWeights) {
        self.weighted_blocks = Tier::ALL
            .iter()
            .map(|t| f64::from(self.best_tier_blocks[t.index()]) * weights.get(*t))
            .sum();
    }
}

/// Walks `keys` from block 0 for `candidates` (sorted by id, no duplicates)
/// and returns one match per candidate, in the same order.
///
/// A candidate's run ends at its first missing block; the walk ends at the
/// first block no remaining candidate holds, so a miss on block 0 costs one
/// lookup whatever the prompt length.
///
/// The candidates are bit sets, as in `jump`: per block, one set per tier
/// of the candidates holding it there (a key held as bits gives them a
/// word at a time), ANDed with those still matching. A candidate's count
/// on a tier then changes only where its bit turns on or off (`Runs`), so
/// a block costs a few word operations, not a holder lookup and a count
/// per candidate: 64 pods on two tiers walking a 2,048-block prompt took
/// ~320 us that way, most of it per candidate.
pub fn walk(
    index: &BlockIndex,
    keys: &[BlockKey],
    candidates: &[PodId],
    weights: &TierWeights,
) -> Vec<PrefixMatch> {
    walk_with_gpu_runs(index, keys, candidates, weights).0
}

/// `walk`, and each candidate's GPU run: how many leading blocks it holds
/// on GPU (where vLLM's own prefix hit ends, see `offload`).
pub fn walk_with_gpu_runs(
    index: &BlockIndex,
    keys: &[BlockKey],
    candidates: &[PodId],
    weights: &TierWeights,
) -> (Vec<PrefixMatch>, Vec<u32>) {
    debug_assert!(candidates.windows(2).all(|w| w[0] < w[1]));
    let mut matches = vec![PrefixMatch::default(); candidates.len()];
    let mut gpu_runs = vec![0; candidates.len()];
    over_sets(
        candidates,
        &mut Places::default(),
        &mut Walk {
            index,
            keys,
            beaten_by: beaten_by(weights),
            out: &mut matches,
            gpu_runs: &mut gpu_runs,
        },
    );
    for m in &mut matches {
        m.weigh(weights);
    }
    (matches, gpu_runs)
}

/// For each tier, the tiers a block held on both counts as rather than it:
/// the first tier of greatest weight, as `record` picks.
fn beaten_by(weights: &TierWeights) -> [u8; TIERS] {
    std::array::from_fn(|t| {
        let mut beaten = 0;
        for u in 0..TIERS {
            let (wu, wt) = (weights.0[u], weights.0[t]);
            if wu > wt || (wu == wt && u < t) {
                beaten |= 1 << u;
            }
        }
        beaten
    })
}

/// A walk, over sets of up to `MAX_SET` candidates.
struct Walk<'a> {
    index: &'a BlockIndex,
    keys: &'a [BlockKey],
    beaten_by: [u8; TIERS],
    /// A match per candidate.
    out: &'a mut [PrefixMatch],
    /// Per candidate, its leading blocks on GPU.
    gpu_runs: &'a mut [u32],
}

impl OverSets for Walk<'_> {
    fn run<const W: usize>(&mut self, space: &impl Space, pods: Range<usize>) {
        let Walk {
            index,
            keys,
            beaten_by,
            out,
            gpu_runs,
        } = self;
        let out = &mut out[pods.clone()];
        let gpu_runs = &mut gpu_runs[pods];
        let mut active: [u64; W] = space.all();
        // Candidates whose every block so far is on GPU (a subset of
        // `active`: the walk outlasts each of their GPU runs).
        let mut on_gpu = active;
        // Tracked sets: held on each tier, then best on each tier.
        let mut runs = Runs::<W>::new(2 * TIERS);
        let mut at = 0u32;
        // Keys are probed in groups (`with_holders_each`): a walk's probes
        // do not depend on each other, only whether it goes on does, so
        // their cache misses can overlap. A group may probe up to its size
        // less one key past the block where the last candidate drops out;
        // groups grow from 1 key to `MAX_PROBES`, so a walk that ends early
        // wastes little.
        let mut rest: &[BlockKey] = keys;
        let mut group = 1;
        while !rest.is_empty() && !is_empty(&active) {
            let (now, later) = rest.split_at(group.min(rest.len()));
            index.with_holders_each(now, |_, holders| {
                if is_empty(&active) {
                    return;
                }
                let mut on = [[0u64; W]; TIERS];
                space.mark_tiers(holders, &mut on);
                let still_on_gpu = and(&on_gpu, &on[Tier::Gpu.index()]);
                for_each_pod(&minus(&on_gpu, &still_on_gpu), |bit| {
                    gpu_runs[space.place(bit)] = at;
                });
                on_gpu = still_on_gpu;
                let any = on.iter().fold([0u64; W], |a, t| or(&a, t));
                let still = and(&active, &any);
                for_each_pod(&minus(&active, &still), |bit| {
                    out[space.place(bit)].matched_blocks = at;
                });
                active = still;
                let held: [[u64; W]; TIERS] = std::array::from_fn(|t| and(&on[t], &still));
                for (t, set) in held.iter().enumerate() {
                    let mut beaten = [0u64; W];
                    for (u, other) in held.iter().enumerate() {
                        if beaten_by[t] & (1 << u) != 0 {
                            beaten = or(&beaten, other);
                        }
                    }
                    runs.step(t, set, at);
                    runs.step(TIERS + t, &minus(set, &beaten), at);
                }
                at += 1;
            });
            rest = later;
            group = (group * 2).min(MAX_PROBES);
        }
        // Candidates still matching hold every key.
        for_each_pod(&active, |bit| out[space.place(bit)].matched_blocks = at);
        for_each_pod(&on_gpu, |bit| gpu_runs[space.place(bit)] = at);
        runs.end(at);
        for_each_pod(&space.all::<W>(), |bit| {
            let m = &mut out[space.place(bit)];
            for t in 0..TIERS {
                m.blocks_per_tier[t] = runs.count(t, bit);
                m.best_tier_blocks[t] = runs.count(TIERS + t, bit);
            }
        });
    }
}

/// Per tracked set of pods, how many blocks each pod has been in it:
/// counted when its bit turns off, from where it turned on.
struct Runs<const W: usize> {
    /// Per tracked set: the bits at the last block.
    on: Vec<[u64; W]>,
    /// Per tracked set and pod bit: where its current run began, and the
    /// blocks of its runs that ended.
    began: Vec<u32>,
    counted: Vec<u32>,
}

impl<const W: usize> Runs<W> {
    fn new(sets: usize) -> Self {
        Runs {
            on: vec![[0; W]; sets],
            began: vec![0; sets * W * 64],
            counted: vec![0; sets * W * 64],
        }
    }

    /// Set `set` is `now` at block `at`.
    fn step(&mut self, set: usize, now: &[u64; W], at: u32) {
        let was = self.on[set];
        let base = set * W * 64;
        for_each_pod(&minus(now, &was), |bit| self.began[base + bit] = at);
        for_each_pod(&minus(&was, now), |bit| {
            self.counted[base + bit] += at - self.began[base + bit];
        });
        self.on[set] = *now;
    }

    /// The walk ended before block `at`: every run still on ends there.
    fn end(&mut self, at: u32) {
        for set in 0..self.on.len() {
            self.step(set, &[0; W], at);
        }
    }

    fn count(&self, set: usize, bit: usize) -> u32 {
        self.counted[set * W * 64 + bit]
    }
}

/// How many leading blocks of `keys` each of `pods` holds, for pods whose
/// held set is prefix-closed (holding block k of a chain implies holding
/// its ancestors: `PodState::closed_tier`). For such a pod "holds keys[i]"
/// is true for every i below its match and false from there on, so a
/// binary search finds the match exactly: the same answer as the first-miss
/// walk, in O(log n) lookups instead of n.
///
/// All pods are searched at once: a probe at `mid` splits the pods still
/// in a range into those holding `keys[mid]` (their match is past `mid`)
/// and the rest (at or before it), so pods that share a prefix share every
/// probe, and the cost grows with the number of distinct match lengths, not
/// with the number of pods (a fleet sharing a system prompt settles its
/// depth in log2(n) probes, where scanning block by block would take one
/// per block). One shortcut: the first and last blocks are probed up front
/// (prompts nobody holds, and prompts held whole, are the common cases and
/// settle in one probe each). `pods` must be sorted; returns depths in the
/// same order.
///
/// `first_held`: the caller picked `pods` as holders of `keys[0]` with its
/// own probe (`holding`), so that probe is not made again. A pod that let
/// block 0 go since is searched as if it held it; its answer (at least 1)
/// is still one it had during the lookup, which began with that probe.
///
/// The pods of a range are a bit set, held in words on the stack: a probe
/// marks the key's holders and splits the range with a few word
/// operations. Splitting lists of positions cost ~500 instructions per
/// probe with 16 pods, two thirds of a lookup (callgrind). A bit stands for
/// a pod by its id where it can (`over_sets`): a key held as bits then marks
/// its holders with a word operation per 64 pods, where matching each
/// holder to its pod was most of a 128-pod lookup of a widely held prompt.
pub fn jump<'s>(
    index: &BlockIndex,
    keys: &[BlockKey],
    pods: &[PodId],
    first_held: bool,
    scratch: &'s mut Scratch,
) -> &'s [u32] {
    debug_assert!(pods.windows(2).all(|w| w[0] < w[1]));
    let Scratch {
        depth,
        search_places,
        pending,
        ..
    } = scratch;
    depth.clear();
    depth.resize(pods.len(), 0);
    if keys.is_empty() {
        return depth;
    }
    // A prompt of 2^32 blocks is 2^36 tokens or more: far beyond any limit
    // the service lets through.
    let keys = &keys[..keys.len().min(u32::MAX as usize)];
    over_sets(
        pods,
        search_places,
        &mut Search {
            index,
            keys,
            first_held,
            depth,
            pending,
        },
    );
    depth
}

/// A pass over pods as bit sets (`jump`'s search, `walk`): run once per set
/// of up to `MAX_SET` pods, given the set (`space`, `W` words) and where
/// its pods are in the pods passed (`pods`).
trait OverSets {
    fn run<const W: usize>(&mut self, space: &impl Space, pods: Range<usize>);
}

/// Runs `pass` over `pods` (sorted) as bit sets. A bit stands for a pod by
/// its id when the pods' ids lie within `MAX_SET / 64` aligned words of 64
/// ids (a model's pods, ids given out densely): a key held as bits then
/// marks its holders with a word operation per 64 pods (`HolderSet::mark`).
/// Otherwise (a model's pods among many other pods) a bit stands for a pod
/// by its position, `MAX_SET` pods at a time; `places` remembers where
/// each sits.
fn over_sets(pods: &[PodId], places: &mut Places, pass: &mut impl OverSets) {
    let (Some(first), Some(last)) = (pods.first(), pods.last()) else {
        return;
    };
    let base = first.0 / 64;
    let id_words = (last.0 / 64 - base) as usize + 1;
    if id_words * 64 <= MAX_SET {
        let ids = Ids::new(base, pods);
        let all = 0..pods.len();
        match id_words {
            1 => pass.run::<1>(&ids, all),
            2 => pass.run::<2>(&ids, all),
            3 | 4 => pass.run::<4>(&ids, all),
            _ => pass.run::<{ MAX_SET / 64 }>(&ids, all),
        }
        return;
    }
    for (c, chunk) in pods.chunks(MAX_SET).enumerate() {
        for (pos, pod) in chunk.iter().enumerate() {
            places.set(*pod, pos);
        }
        let positions = Positions {
            pods: chunk,
            places,
        };
        let these = c * MAX_SET..c * MAX_SET + chunk.len();
        match chunk.len().div_ceil(64) {
            1 => pass.run::<1>(&positions, these),
            2 => pass.run::<2>(&positions, these),
            3 | 4 => pass.run::<4>(&positions, these),
            _ => pass.run::<{ MAX_SET / 64 }>(&positions, these),
        }
    }
}

/// Pods searched together at most, and the span of their ids when a bit
/// stands for an id (a bit set of this many on the stack per pending range).
const MAX_SET: usize = 1024;

/// What the bits of a search's sets stand for.
trait Space {
    /// The bits of every pod searched.
    fn all<const W: usize>(&self) -> [u64; W];
    /// The pod bit `bit` stands for.
    fn pod(&self, bit: usize) -> PodId;
    /// Where the pod bit `bit` stands for is in `pods` (and `depth`).
    fn place(&self, bit: usize) -> usize;
    /// Sets the bits of the pods searched among `holders` (and maybe some
    /// others: the caller keeps only its own).
    fn mark<const W: usize>(&self, holders: HolderSet<'_>, held: &mut [u64; W]);
    /// Whether `mark` copies a key held as bits a word at a time (else it
    /// goes holder by holder, like a list).
    fn marks_bits_by_word(&self) -> bool;
    /// `mark`, a set per tier.
    fn mark_tiers<const W: usize>(&self, holders: HolderSet<'_>, held: &mut [[u64; W]; TIERS]);
}

/// Bit `i` of word `w` is the pod with id `(base + w) * 64 + i`.
struct Ids {
    base: u32,
    /// The pods' own bits, and how many of them come before each word.
    bits: [u64; MAX_SET / 64],
    below: [u32; MAX_SET / 64],
}

impl Ids {
    fn new(base: u32, pods: &[PodId]) -> Ids {
        let mut bits = [0u64; MAX_SET / 64];
        for pod in pods {
            let off = (pod.0 - base * 64) as usize;
            bits[off / 64] |= 1 << (off % 64);
        }
        let mut below = [0u32; MAX_SET / 64];
        for w in 1..below.len() {
            below[w] = below[w - 1] + bits[w - 1].count_ones();
        }
        Ids { base, bits, below }
    }
}

impl Space for Ids {
    fn all<const W: usize>(&self) -> [u64; W] {
        std::array::from_fn(|w| self.bits[w])
    }

    fn pod(&self, bit: usize) -> PodId {
        PodId(self.base * 64 + bit as u32)
    }

    fn place(&self, bit: usize) -> usize {
        let (w, b) = (bit / 64, bit % 64);
        (self.below[w] + (self.bits[w] & ((1 << b) - 1)).count_ones()) as usize
    }

    fn mark<const W: usize>(&self, holders: HolderSet<'_>, held: &mut [u64; W]) {
        holders.mark(self.base, held);
    }

    fn mark_tiers<const W: usize>(&self, holders: HolderSet<'_>, held: &mut [[u64; W]; TIERS]) {
        holders.mark_tiers(self.base, held);
    }

    fn marks_bits_by_word(&self) -> bool {
        true
    }
}

/// Bit `i` is `pods[i]`.
struct Positions<'a> {
    pods: &'a [PodId],
    /// Where each of `pods` sits in it.
    places: &'a Places,
}

impl Space for Positions<'_> {
    fn all<const W: usize>(&self) -> [u64; W] {
        std::array::from_fn(|w| match self.pods.len().saturating_sub(w * 64) {
            0 => 0,
            left if left >= 64 => !0,
            left => (1 << left) - 1,
        })
    }

    fn pod(&self, bit: usize) -> PodId {
        self.pods[bit]
    }

    fn place(&self, bit: usize) -> usize {
        bit
    }

    fn mark<const W: usize>(&self, holders: HolderSet<'_>, held: &mut [u64; W]) {
        for h in holders.iter() {
            if let Some(pos) = self.places.get(self.pods, h.pod()) {
                held[pos / 64] |= 1 << (pos % 64);
            }
        }
    }

    fn mark_tiers<const W: usize>(&self, holders: HolderSet<'_>, held: &mut [[u64; W]; TIERS]) {
        for h in holders.iter() {
            if let Some(pos) = self.places.get(self.pods, h.pod()) {
                for tier in h.tiers().tiers() {
                    held[tier.index()][pos / 64] |= 1 << (pos % 64);
                }
            }
        }
    }

    fn marks_bits_by_word(&self) -> bool {
        false
    }
}

/// Pending ranges from which a search probes several at once.
///
/// Probes made together (`BlockIndex::with_holders_each`) overlap their
/// cache misses: with the index out of cache, as between a service's
/// requests, a 64-pod 2,048-block search with 64 different depths (~380
/// probes) took 96-156 us one probe at a time and 64-73 us eight at a time
/// (`cargo bench -p indexer --bench score`, "cold", three runs). In cache
/// it costs ~1 us more (7.8-8.4 -> 9.0-9.3 us): a group's bookkeeping.
/// Grouping from 2 ranges on cost the comparison bench's readers beside a
/// writer 10-17%; from 4 on, prompts whose pods sit at a few depths (most
/// prompts, and most of that bench's) keep the one-probe path.
const BATCH_FROM: usize = 4;

/// A search, over sets of up to `MAX_SET` pods.
struct Search<'a> {
    index: &'a BlockIndex,
    keys: &'a [BlockKey],
    /// The pods are holders of `keys[0]` (see `jump`).
    first_held: bool,
    /// A depth per pod.
    depth: &'a mut [u32],
    pending: &'a mut Pending,
}

impl OverSets for Search<'_> {
    fn run<const W: usize>(&mut self, space: &impl Space, pods: Range<usize>) {
        let Search {
            index,
            keys,
            first_held,
            depth,
            pending,
        } = self;
        let depth = &mut depth[pods];
        let n = keys.len() as u32;
        let all: [u64; W] = space.all();
        let settle = |set: &[u64; W], d: u32, depth: &mut [u32]| {
            for_each_pod(set, |bit| depth[space.place(bit)] = d);
        };
        let first = if *first_held {
            all
        } else {
            // The others match 0 blocks, as `depth` already says.
            who_holds(index, space, keys[0], &all)
        };
        if is_empty(&first) {
            return;
        }
        let whole = who_holds(index, space, keys[n as usize - 1], &first);
        settle(&whole, n, depth);
        // (lo, hi, pods): these pods match somewhere in lo..=hi blocks.
        pending.clear();
        pending.add(1, n - 1, &minus(&first, &whole), |set, d| {
            settle(set, d, depth)
        });
        while !pending.is_empty() {
            if pending.len() < BATCH_FROM {
                let mut set = [0u64; W];
                let (lo, hi) = pending.pop(&mut set).expect("a range is pending");
                let held = who_holds(index, space, keys[mid(lo, hi) as usize], &set);
                pending.split(lo, hi, &set, &held, |set, d| settle(set, d, depth));
                continue;
            }
            // Several ranges pending: their probes do not depend on each
            // other, so up to `MAX_PROBES` are made together (see
            // `BATCH_FROM`).
            let mut taken = [(0u32, 0u32, [0u64; W]); MAX_PROBES];
            let mut probed = [BlockKey(0); MAX_PROBES];
            let mut count = 0;
            while count < MAX_PROBES {
                let Some((lo, hi)) = pending.pop(&mut taken[count].2) else {
                    break;
                };
                taken[count].0 = lo;
                taken[count].1 = hi;
                probed[count] = keys[mid(lo, hi) as usize];
                count += 1;
            }
            let mut held = [[0u64; W]; MAX_PROBES];
            index.with_holders_each(&probed[..count], |i, holders| {
                held[i] = marked(space, holders, &taken[i].2);
            });
            for ((lo, hi, set), held) in taken[..count].iter().zip(&held) {
                pending.split(*lo, *hi, set, held, |set, d| settle(set, d, depth));
            }
        }
    }
}

/// The pods of `of` that hold `key`.
fn who_holds<const W: usize>(
    index: &BlockIndex,
    space: &impl Space,
    key: BlockKey,
    of: &[u64; W],
) -> [u64; W] {
    index.with_holders(key, |holders| marked(space, holders, of))
}

/// Where a range `lo..=hi` (`lo < hi`) is probed: its middle.
fn mid(lo: u32, hi: u32) -> u32 {
    lo + (hi - lo) / 2
}

/// The pods of `of` among `holders`.
fn marked<const W: usize>(space: &impl Space, holders: HolderSet<'_>, of: &[u64; W]) -> [u64; W] {
    let mut held = [0u64; W];
    let by_word = holders.is_dense() && space.marks_bits_by_word();
    if !by_word && holders.len() >= 8 {
        let live: u32 = of.iter().map(|w| w.count_ones()).sum();
        if live as usize * 4 <= holders.len() {
            // A few pods left against a long holder list.
            for_each_pod(of, |bit| {
                if holders.get(space.pod(bit)).is_some() {
                    held[bit / 64] |= 1 << (bit % 64);
                }
            });
            return held;
        }
    }
    space.mark(holders, &mut held);
    for (h, o) in held.iter_mut().zip(of) {
        *h &= o;
    }
    held
}

/// A search's pending ranges: (lo, hi) and the range's pods, `W` words
/// each, in buffers the lookups of a thread reuse. The ranges are disjoint
/// (each split divides one), so there are at most as many as pods.
#[derive(Default)]
struct Pending {
    ranges: Vec<(u32, u32)>,
    sets: Vec<u64>,
}

impl Pending {
    fn clear(&mut self) {
        self.ranges.clear();
        self.sets.clear();
    }

    fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    fn len(&self) -> usize {
        self.ranges.len()
    }

    /// The range `lo..=hi` of `set` probed at `mid(lo, hi)`: the pods
    /// `held` there match past it, the others at or before it.
    fn split<const W: usize>(
        &mut self,
        lo: u32,
        hi: u32,
        set: &[u64; W],
        held: &[u64; W],
        mut settle: impl FnMut(&[u64; W], u32),
    ) {
        let mid = mid(lo, hi);
        self.add(mid + 1, hi, held, &mut settle);
        self.add(lo, mid, &minus(set, held), settle);
    }

    /// Pods matching `lo..=hi` blocks: settled if that is one length,
    /// else pending.
    fn add<const W: usize>(
        &mut self,
        lo: u32,
        hi: u32,
        set: &[u64; W],
        settle: impl FnOnce(&[u64; W], u32),
    ) {
        if is_empty(set) {
        } else if lo >= hi {
            settle(set, hi);
        } else {
            self.ranges.push((lo, hi));
            self.sets.extend_from_slice(set);
        }
    }

    fn pop<const W: usize>(&mut self, set: &mut [u64; W]) -> Option<(u32, u32)> {
        let range = self.ranges.pop()?;
        let from = self.sets.len() - W;
        set.copy_from_slice(&self.sets[from..]);
        self.sets.truncate(from);
        Some(range)
    }
}

/// Where pods sit in a pod list, by pod id. Positions written for one list
/// stay behind when another is used: every read is checked against the
/// list it is for (the pod must be at that position), so nothing is ever
/// cleared.
#[derive(Default)]
struct Places(Vec<u32>);

impl Places {
    fn get(&self, pods: &[PodId], pod: PodId) -> Option<usize> {
        let pos = *self.0.get(pod.0 as usize)? as usize;
        (pods.get(pos) == Some(&pod)).then_some(pos)
    }

    fn set(&mut self, pod: PodId, pos: usize) {
        let id = pod.0 as usize;
        if self.0.len() <= id {
            self.0.resize(id + 1, u32::MAX);
        }
        self.0[id] = pos as u32;
    }
}

fn is_empty<const W: usize>(set: &[u64; W]) -> bool {
    set.iter().all(|w| *w == 0)
}

fn and<const W: usize>(set: &[u64; W], with: &[u64; W]) -> [u64; W] {
    std::array::from_fn(|w| set[w] & with[w])
}

fn or<const W: usize>(set: &[u64; W], with: &[u64; W]) -> [u64; W] {
    std::array::from_fn(|w| set[w] | with[w])
}

fn minus<const W: usize>(set: &[u64; W], without: &[u64; W]) -> [u64; W] {
    std::array::from_fn(|w| set[w] & !without[w])
}

/// Calls `f` with every set bit of `set`, in order.
#[inline]
fn for_each_pod<const W: usize>(set: &[u64; W], mut f: impl FnMut(usize)) {
    for (w, word) in set.iter().enumerate() {
        for bit in Bits(*word) {
            f(w * 64 + bit as usize);
        }
    }
}

/// Buffers a search reuses from one lookup to the next (the indexer keeps
/// one per thread): with 128 pods a lookup made a dozen allocations, a
/// fifth of its time.
#[derive(Default)]
pub struct Scratch {
    depth: Vec<u32>,
    /// The pods of the current search, when searched by position.
    search_places: Places,
    /// The pods of the list `holding` last saw (a model's, usually).
    model_places: Places,
    /// The search's pending ranges.
    pending: Pending,
}

/// Positions (into the sorted `pods`) of the pods holding `key`, in order,
/// into `out`.
///
/// `scratch` remembers, by pod id, where each pod was found last time. A
/// model's pod list rarely changes, so a holder's position is usually one
/// load away, where a merge walked the whole list (3% fewer instructions
/// per lookup with 128 pods); a stale place is noticed, the pod not being
/// there, and searched for again.
pub fn holding(
    index: &BlockIndex,
    key: BlockKey,
    pods: &[PodId],
    scratch: &mut Scratch,
    out: &mut Vec<u32>,
) {
    out.clear();
    let places = &mut scratch.model_places;
    index.with_holders(key, |holders| {
        for h in holders.iter() {
            let pod = h.pod();
            let pos = match places.get(pods, pod) {
                Some(pos) => pos,
                None => {
                    let Ok(pos) = pods.binary_search(&pod) else {
                        continue;
                    };
                    places.set(pod, pos);
                    pos
                }
            };
            out.push(pos as u32);
        }
    });
}

/// Prefix closure: vLLM's GPU block pool evicts a block only after its
/// descendants, so a pod holding block k of a prompt on GPU holds blocks
/// 0..k there too, even when the index missed their events (late start,
/// lost batches). Extends each match to the deepest block of the prompt the
/// pod is known to hold on GPU; inferred blocks count on GPU.
///
/// Only GPU: vLLM's offloading managers (LRU, ARC) evict CPU blocks in
/// their own order, ancestors before descendants as often as not, and load
/// only the run of consecutive hits from a prompt's start. A block held on
/// CPU says nothing of the blocks before it.
///
/// After a late start the known blocks of a pod along a prompt look like
/// `miss.. held.. miss..` (only blocks stored after the join are known), which
/// a binary search cannot find in general. One backward scan from the
/// prompt's end, shared by all candidates and stopping as soon as each has
/// its answer, finds it exactly; in engine mode it costs less than computing
/// the keys did (one map lookup per block against one SHA-256 per block).
///
/// `gpu_runs` are the candidates' GPU runs (`walk_with_gpu_runs`). A
/// candidate that offloads in chunks (`chunked`) keeps its match, which
/// `offload` counts from where vLLM's GPU hit ends: its GPU run becomes
/// the inferred one, in the same scan.
pub fn extend_prefix_closed(
    index: &BlockIndex,
    keys: &[BlockKey],
    candidates: &[PodId],
    matches: &mut [PrefixMatch],
    gpu_runs: &mut [u32],
    chunked: &[bool],
    weights: &TierWeights,
) {
    let from: Vec<u32> = (0..candidates.len())
        .map(|c| match chunked[c] {
            true => gpu_runs[c],
            false => matches[c].matched_blocks,
        })
        .collect();
    let deepest = deepest_on_gpu(index, keys, candidates, &from);
    for (c, found) in deepest.into_iter().enumerate() {
        let Some(d) = found else {
            continue;
        };
        if chunked[c] {
            gpu_runs[c] = d as u32 + 1;
            continue;
        }
        // From block 0: the blocks the walk matched are on GPU now too.
        let m = &mut matches[c];
        *m = PrefixMatch::default();
        let gpu = TierMask(1 << Tier::Gpu.index());
        for key in &keys[..=d] {
            let known = index.with_holders(*key, |h| h.get(candidates[c]).unwrap_or_default());
            record(m, TierMask(known.0 | gpu.0), weights);
        }
        m.weigh(weights);
    }
}

/// Per candidate, the deepest block of `keys` after block `from[c]` (the
/// end of a run it is known to hold) that it holds on GPU, if any: one
/// backward scan shared by all candidates, stopping as soon as each has
/// its answer.
fn deepest_on_gpu(
    index: &BlockIndex,
    keys: &[BlockKey],
    candidates: &[PodId],
    from: &[u32],
) -> Vec<Option<usize>> {
    let mut deepest: Vec<Option<usize>> = vec![None; candidates.len()];
    let mut looking: Vec<usize> = (0..candidates.len())
        .filter(|&c| (from[c] as usize) < keys.len())
        .collect();
    for i in (0..keys.len()).rev() {
        // A candidate known to hold the blocks up to here has no deeper
        // block to find.
        looking.retain(|&c| (from[c] as usize) < i);
        if looking.is_empty() {
            break;
        }
        index.with_holders(keys[i], |holders| {
            looking.retain(|&c| match holders.get(candidates[c]) {
                Some(tiers) if tiers.contains(Tier::Gpu) => {
                    deepest[c] = Some(i);
                    false
                }
                _ => true,
            });
        });
    }
    deepest
}

fn record(m: &mut PrefixMatch, tiers: TierMask, weights: &TierWeights) {
    m.matched_blocks += 1;
    count_tiers(m, tiers, 1, weights);
}

/// `blocks` blocks held on `tiers`, counted on each and, as their best, on
/// the first of greatest weight (not as matched: callers count those).
pub(crate) fn count_tiers(
    m: &mut PrefixMatch,
    tiers: TierMask,
    blocks: u32,
    weights: &TierWeights,
) {
    let mut best: Option<Tier> = None;
    for tier in tiers.tiers() {
        m.blocks_per_tier[tier.index()] += blocks;
        if best.is_none_or(|b| weights.get(tier) > weights.get(b)) {
            best = Some(tier);
        }
    }
    if let Some(b) = best {
        m.best_tier_blocks[b.index()] += blocks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A searched match is built whole; it must equal, to the last bit of
    /// its weight, the one a walk adds up block by block.
    #[test]
    fn a_match_on_one_tier_equals_the_walks_sum() {
        for weights in [
            TierWeights::default(),
            TierWeights([0.1, 0.7, 1e-300]),
            TierWeights([3.7, 0.0, 1.0 / 3.0]),
        ] {
            for tier in Tier::ALL {
                for blocks in [0u32, 1, 7, 333, 4099] {
                    let mut walked = PrefixMatch::default();
                    for _ in 0..blocks {
                        record(&mut walked, TierMask(1 << tier.index()), &weights);
                    }
                    walked.weigh(&weights);
                    let built = PrefixMatch::on_one_tier(blocks, tier, &weights);
                    assert_eq!(built, walked);
                    assert_eq!(
                        built.weighted_blocks.to_bits(),
                        walked.weighted_blocks.to_bits()
                    );
                }
            }
        }
    }

    /// The walk as it first was, block by block and candidate by
    /// candidate: the oracle for `walk`.
    fn walk_by_block(
        index: &BlockIndex,
        keys: &[BlockKey],
        candidates: &[PodId],
        weights: &TierWeights,
    ) -> Vec<PrefixMatch> {
        let mut matches = vec![PrefixMatch::default(); candidates.len()];
        let mut active: Vec<usize> = (0..candidates.len()).collect();
        for key in keys {
            index.with_holders(*key, |holders| {
                active.retain(|&pos| match holders.get(candidates[pos]) {
                    Some(tiers) => {
                        record(&mut matches[pos], tiers, weights);
                        true
                    }
                    None => false,
                });
            });
        }
        for m in &mut matches {
            m.weigh(weights);
        }
        matches
    }

    /// The walk by bit sets equals the walk block by block: pods on one
    /// to three tiers, holding prefixes with gaps and blocks past them,
    /// few and many (more than one set), ids packed and spread (bits by
    /// id and by position), and tier weights that tie.
    #[test]
    fn the_walk_by_sets_equals_the_walk_block_by_block() {
        let mut rnd = crate::test_rng::xorshift(0x3a1b_7c55_d00d_f00d);
        for case in 0..48u64 {
            let index = BlockIndex::new();
            let n = [1u64, 5, 70, 300][case as usize % 4];
            let keys: Vec<BlockKey> = (0..n).map(|k| BlockKey(k + 100_000 * case)).collect();
            let pods = 1 + rnd([3, 70, 300][case as usize % 3]) as u32;
            let gap = [1u32, 3, 70][(case / 3) as usize % 3];
            let ids: Vec<PodId> = (0..pods).map(|p| PodId(p * gap)).collect();
            for pod in &ids {
                let depth = rnd(n + 1);
                for (i, key) in keys.iter().enumerate() {
                    let held = if (i as u64) < depth {
                        rnd(40) != 0
                    } else {
                        rnd(8) == 0
                    };
                    if !held {
                        continue;
                    }
                    let tiers = 1 + rnd(7);
                    for tier in Tier::ALL {
                        if tiers & (1 << tier.index()) != 0 {
                            index.acquire(*key, *pod, tier);
                        }
                    }
                }
            }
            for weights in [
                TierWeights::default(),
                TierWeights([0.5, 0.5, 0.5]),
                TierWeights([0.2, 1.0, 1.0]),
            ] {
                let got = walk(&index, &keys, &ids, &weights);
                assert_eq!(
                    got,
                    walk_by_block(&index, &keys, &ids, &weights),
                    "case {case}: {pods} pods {gap} apart, {n} blocks"
                );
            }
        }
    }

    #[test]
    fn runs_stop_at_each_pods_first_miss() {
        let index = BlockIndex::new();
        let keys: Vec<BlockKey> = (0..5).map(BlockKey).collect();
        // pod 0 holds 0,1,2,4 (4 does not count: 3 is missing); pod 1 holds 0 on CPU.
        for k in [0, 1, 2, 4] {
            index.acquire(BlockKey(k), PodId(0), Tier::Gpu);
        }
        index.acquire(BlockKey(0), PodId(1), Tier::Cpu);
        index.acquire(BlockKey(1), PodId(1), Tier::Storage);
        index.acquire(BlockKey(1), PodId(1), Tier::Cpu);
        let m = walk(
            &index,
            &keys,
            &[PodId(0), PodId(1), PodId(2)],
            &TierWeights::default(),
        );
        assert_eq!(m[0].matched_blocks, 3);
        assert_eq!(m[0].blocks_per_tier, [3, 0, 0]);
        assert_eq!(m[0].weighted_blocks, 3.0);
        assert_eq!(m[1].matched_blocks, 2);
        assert_eq!(m[1].blocks_per_tier, [0, 2, 1]);
        assert!((m[1].weighted_blocks - 1.6).abs() < 1e-9);
        assert_eq!(m[2], PrefixMatch::default());
    }

    #[test]
    fn prefix_closure_extends_past_missing_events_but_never_past_known_blocks() {
        let index = BlockIndex::new();
        let keys: Vec<BlockKey> = (0..10).map(BlockKey).collect();
        // pod 0: events for 0 and 5..=7 (1..=4 lost); pod 1: only block 9,
        // CPU; pod 2: nothing; pod 3: 0..=1 on CPU, 4 on CPU, 6 on GPU and
        // CPU, 8 on CPU.
        index.acquire(BlockKey(0), PodId(0), Tier::Gpu);
        for k in 5..=7 {
            index.acquire(BlockKey(k), PodId(0), Tier::Gpu);
        }
        index.acquire(BlockKey(9), PodId(1), Tier::Cpu);
        for k in [0, 1, 4, 6, 8] {
            index.acquire(BlockKey(k), PodId(3), Tier::Cpu);
        }
        index.acquire(BlockKey(6), PodId(3), Tier::Gpu);
        let pods = [PodId(0), PodId(1), PodId(2), PodId(3)];
        let w = TierWeights::default();
        let (mut m, mut gpu_runs) = walk_with_gpu_runs(&index, &keys, &pods, &w);
        assert_eq!(m[0].matched_blocks, 1);
        extend_prefix_closed(&index, &keys, &pods, &mut m, &mut gpu_runs, &[false; 4], &w);
        assert_eq!(m[0].matched_blocks, 8);
        assert_eq!(m[0].blocks_per_tier, [8, 0, 0]);
        // CPU blocks imply nothing about the blocks before them.
        assert_eq!(m[1], PrefixMatch::default());
        assert_eq!(m[2].matched_blocks, 0);
        // The deepest GPU block (6) does: 0..=6 on GPU, and on CPU where
        // known (0, 1, 4, 6); 8 on CPU alone is not reached.
        assert_eq!(m[3].matched_blocks, 7);
        assert_eq!(m[3].blocks_per_tier, [7, 4, 0]);
        assert_eq!(m[3].best_tier_blocks, [7, 0, 0]);
    }

    #[test]
    fn many_holders_use_the_sorted_search() {
        // Ids 100 apart: a list, never bits (see `holders`).
        let index = BlockIndex::new();
        for p in (0..40).rev() {
            index.acquire(BlockKey(1), PodId(p * 100), Tier::Gpu);
        }
        index.with_holders(BlockKey(1), |h| assert!(!h.is_dense() && h.len() == 40));
        let m = walk(
            &index,
            &[BlockKey(1), BlockKey(2)],
            &[PodId(300), PodId(3900), PodId(4000)],
            &TierWeights::default(),
        );
        let got: Vec<u32> = m.iter().map(|m| m.matched_blocks).collect();
        assert_eq!(got, vec![1, 1, 0]);
    }

    /// Holders among the pods, found through remembered places or by
    /// binary search; holders that are not among the pods are ignored.
    #[test]
    fn holding_picks_the_positions_of_holders() {
        let index = BlockIndex::new();
        let pods: Vec<PodId> = (0..200).map(|p| PodId(p * 2)).collect();
        let mut scratch = Scratch::default();
        for holders in [
            vec![0u32, 7, 8, 398, 399, 500],
            (0..300).collect::<Vec<u32>>(),
        ] {
            let key = BlockKey(holders.len() as u64);
            for h in &holders {
                index.acquire(key, PodId(*h), Tier::Gpu);
            }
            let want: Vec<u32> = holders
                .iter()
                .filter(|h| **h % 2 == 0 && **h < 400)
                .map(|h| h / 2)
                .collect();
            let mut got = Vec::new();
            holding(&index, key, &pods, &mut scratch, &mut got);
            assert_eq!(got, want);
            // Remembered places, and places from another pod list.
            holding(&index, key, &pods, &mut scratch, &mut got);
            assert_eq!(got, want);
            holding(&index, key, &pods[1..], &mut scratch, &mut got);
            let shifted: Vec<u32> = want.iter().filter(|p| **p > 0).map(|p| p - 1).collect();
            assert_eq!(got, shifted);
            holding(&index, key, &pods, &mut scratch, &mut got);
            assert_eq!(got, want);
        }
    }

    /// More pods than one search's bit set holds are searched a set at a
    /// time, each pod with its own answer.
    #[test]
    fn jump_searches_large_fleets_a_set_at_a_time() {
        let index = BlockIndex::new();
        let keys: Vec<BlockKey> = (0..64).map(BlockKey).collect();
        let ids: Vec<PodId> = (0..MAX_SET as u32 * 2 + 77).map(PodId).collect();
        let want: Vec<u32> = ids.iter().map(|p| (p.0 * 7 + 3) % 65).collect();
        for (pod, d) in ids.iter().zip(&want) {
            for key in &keys[..*d as usize] {
                index.acquire(*key, *pod, Tier::Gpu);
            }
        }
        let mut scratch = Scratch::default();
        assert_eq!(jump(&index, &keys, &ids, false, &mut scratch), &want[..]);
    }

    /// Pods holding prefixes of every length, dense and sparse, few and
    /// many: the binary search agrees with the walk.
    #[test]
    fn jump_finds_every_prefix_length_exactly() {
        let mut rnd = crate::test_rng::xorshift(0x9e37_79b9_7f4a_7c15u64);
        // One scratch for every case: buffers left from a longer search
        // must not leak into the next.
        let mut scratch = Scratch::default();
        let mut first = Vec::new();
        for case in 0..60 {
            let n = [1usize, 2, 7, 128, 2048, 8192][case % 6];
            let pods = 1 + rnd([8, 100, 300][case % 3]) as u32;
            let index = BlockIndex::new();
            let keys: Vec<BlockKey> = (0..n as u64)
                .map(|k| BlockKey(k + 1000 * case as u64))
                .collect();
            // Sparse ids, so positions and ids differ; every other case
            // so sparse that a word of ids holds one pod at most, and 300
            // pods span several sets.
            let stride = [3, 70][(case / 6) % 2];
            let ids: Vec<PodId> = (0..pods).map(|p| PodId(p * stride + 1)).collect();
            // A few distinct lengths, shared by many pods, plus the extremes.
            let lengths: Vec<usize> = (0..1 + rnd(12))
                .map(|_| rnd(n as u64 + 1) as usize)
                .collect();
            for pod in &ids {
                let d = match rnd(4) {
                    0 => 0,
                    1 => n,
                    _ => lengths[rnd(lengths.len() as u64) as usize],
                };
                for key in &keys[..d] {
                    index.acquire(*key, *pod, Tier::Gpu);
                }
            }
            let want: Vec<u32> = walk(&index, &keys, &ids, &TierWeights::default())
                .iter()
                .map(|m| m.matched_blocks)
                .collect();
            assert_eq!(
                jump(&index, &keys, &ids, false, &mut scratch),
                &want[..],
                "case {case}: n {n}, {pods} pods"
            );
            // The holders of block 0, as `holding` picks them.
            let (first_ids, first_want): (Vec<PodId>, Vec<u32>) = ids
                .iter()
                .zip(&want)
                .filter(|(_, d)| **d > 0)
                .map(|(id, d)| (*id, *d))
                .unzip();
            holding(&index, keys[0], &ids, &mut scratch, &mut first);
            assert_eq!(
                first,
                (0..ids.len() as u32)
                    .filter(|i| want[*i as usize] > 0)
                    .collect::<Vec<_>>(),
                "case {case}: holders of block 0"
            );
            assert_eq!(
                jump(&index, &keys, &first_ids, true, &mut scratch),
                &first_want[..],
                "case {case}: n {n}, {pods} pods, block 0 known held"
            );
            // Every other pod: the holders outside the search are ignored.
            let (half_ids, half_want): (Vec<PodId>, Vec<u32>) = ids
                .iter()
                .zip(&want)
                .step_by(2)
                .map(|(id, d)| (*id, *d))
                .unzip();
            assert_eq!(
                jump(&index, &keys, &half_ids, false, &mut scratch),
                &half_want[..],
                "case {case}: n {n}, every other of {pods} pods"
            );
        }
    }
}

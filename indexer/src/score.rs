//! Score's match rules: per candidate pod, how many leading blocks of a
//! prompt it holds, on which tiers, and what they weigh.
//!
//! Without closure or chunks a pod's match is its first-miss prefix, which
//! `RunIndex::prefix_matches` answers from the runs that start the prompt.
//! The other rules read blocks past a pod's first miss: the deepest block
//! it holds on GPU (prefix closure), the tiers of each chunk's last block
//! (offloaded chunks, `offload`). Those come from `RunIndex::held_along`,
//! every stretch of the prompt each pod holds, turned per pod into `Held`
//! (which tiers hold each position); the rules are then pure functions of
//! `Held`.
//!
//! `held_along` probes the runs' heads at every position no run covers
//! (about 30 ns each: BENCHMARKS.md, "The index against its peers", its
//! profiling modes), so it is read only when a rule needs it.

mod offload;

pub use offload::chunk_factor;
pub(crate) use offload::chunked_match;

use crate::event::{Tier, TierMask, TIERS};
use crate::index::{HeldAlong, RunIndex, RunMatch};

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

/// What a lookup answers beyond the first-miss walk (the service's
/// `Rules`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatchRules {
    /// Prefix closure (engine keys only): a pod holding block k on GPU
    /// holds blocks 0..k there; every candidate is then looked at.
    pub closure: bool,
    /// Blocks per offloaded chunk of the model (1: none). With more, and no
    /// closure, pods holding the first chunk's last block are candidates
    /// even without block 0 (vLLM's default offload events name a chunk by
    /// that block alone).
    pub model_chunk: u32,
}

impl MatchRules {
    /// The first-miss walk alone, as the peers' indexes answer.
    pub const INDEX_ONLY: MatchRules = MatchRules {
        closure: false,
        model_chunk: 1,
    };
}

/// A candidate pod: its id in the runs and its blocks per offloaded chunk
/// (1: its offloaded blocks count one by one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub pod: u32,
    pub chunk: u32,
}

/// The matches of `candidates` (sorted by pod, no duplicates) for a
/// prompt's `keys` under `rules`: (position in `candidates`, match) for
/// each with at least one block, in position order.
pub fn match_pods(
    runs: &RunIndex,
    keys: &[u64],
    candidates: &[Candidate],
    rules: MatchRules,
    weights: &TierWeights,
) -> Vec<(usize, PrefixMatch)> {
    debug_assert!(candidates.windows(2).all(|w| w[0].pod < w[1].pod));
    if keys.is_empty() || candidates.is_empty() {
        return Vec::new();
    }
    let n = keys.len() as u32;
    let first_chunk_counts = !rules.closure && rules.model_chunk > 1 && n >= rules.model_chunk;
    let needs_more = rules.closure || first_chunk_counts || candidates.iter().any(|c| c.chunk > 1);
    if !needs_more {
        // In pod order, as `merge_by_pod` needs.
        let found = runs.prefix_matches(keys);
        return merge_by_pod(candidates, &found, |m| m.pod)
            .filter(|(_, m)| m.blocks > 0)
            .map(|(at, m)| (at, prefix_match(m, weights)))
            .collect();
    }
    let along = runs.held_along(keys);
    let mut out = Vec::new();
    // A candidate holding nothing of the prompt is credited nothing by any
    // rule (closure needs a block held on GPU): only those in `along`.
    for (at, a) in merge_by_pod(candidates, &along, |a| a.pod) {
        let c = &candidates[at];
        let held = Held::of(a);
        let candidate = rules.closure
            || !held.at(0).is_empty()
            || (first_chunk_counts && !held.at(rules.model_chunk - 1).is_empty());
        if !candidate {
            continue;
        }
        let m = pod_match(&held, n, c.chunk, rules.closure, weights);
        if m.matched_blocks > 0 {
            out.push((at, m));
        }
    }
    out
}

/// A first-miss answer of the runs as a score weighs it.
pub fn prefix_match(m: &RunMatch, weights: &TierWeights) -> PrefixMatch {
    let mut out = PrefixMatch {
        matched_blocks: m.blocks,
        blocks_per_tier: m.per_tier,
        best_tier_blocks: m.best_tier,
        weighted_blocks: 0.0,
    };
    out.weigh(weights);
    out
}

/// Pairs each candidate with the item of `found` (sorted by pod) for its
/// pod, if any.
fn merge_by_pod<'a, T>(
    candidates: &'a [Candidate],
    found: &'a [T],
    pod: impl Fn(&T) -> u32 + 'a,
) -> impl Iterator<Item = (usize, &'a T)> + 'a {
    let mut f = 0;
    candidates.iter().enumerate().filter_map(move |(at, c)| {
        while found.get(f).is_some_and(|x| pod(x) < c.pod) {
            f += 1;
        }
        found.get(f).filter(|x| pod(x) == c.pod).map(|x| (at, x))
    })
}

/// One pod's match under the rules, from what it holds of the prompt (`n`
/// keys): the first-miss walk, extended by closure to the deepest block
/// held on GPU, counted by chunks if it offloads in chunks of `chunk`.
fn pod_match(held: &Held, n: u32, chunk: u32, closure: bool, weights: &TierWeights) -> PrefixMatch {
    let (mut m, mut gpu_run) = held.walk(weights);
    let chunked = chunk > 1;
    if closure {
        // The deepest GPU block past what the pod is known to hold in a
        // run from block 0.
        let from = if chunked { gpu_run } else { m.matched_blocks };
        if let Some(d) = held.deepest_on_gpu().filter(|d| *d > from) {
            if chunked {
                gpu_run = d + 1;
            } else {
                m = held.closed_to(d, weights);
            }
        }
    }
    if chunked {
        m = held.chunked(n, chunk, gpu_run, weights);
    }
    m
}

/// Which tiers hold each position of a prompt, for one pod: stretches of
/// positions held on the same tiers, in order, none empty.
#[derive(Debug, Default)]
pub struct Held(Vec<(u32, u32, TierMask)>);

impl Held {
    /// From a pod's stretches per tier (`held_along`: per tier, sorted and
    /// merged).
    pub fn of(along: &HeldAlong) -> Held {
        // Each tier's stretches turn it on at their start and off at
        // their end: sweep the turns in position order.
        let mut turns: Vec<(u32, u8, bool)> = along
            .spans
            .iter()
            .flat_map(|&(tier, start, end)| {
                let bit = 1u8 << tier.index();
                [(start, bit, true), (end, bit, false)]
            })
            .collect();
        turns.sort_unstable_by_key(|&(at, _, _)| at);
        let mut out = Vec::new();
        let mut mask = 0u8;
        let mut i = 0;
        while i < turns.len() {
            let at = turns[i].0;
            while i < turns.len() && turns[i].0 == at {
                let (_, bit, on) = turns[i];
                if on {
                    mask |= bit;
                } else {
                    mask &= !bit;
                }
                i += 1;
            }
            if let (Some(&(next, _, _)), true) = (turns.get(i), mask != 0) {
                out.push((at, next, TierMask(mask)));
            }
        }
        Held(out)
    }

    /// The tiers holding position `i`.
    pub fn at(&self, i: u32) -> TierMask {
        let after = self.0.partition_point(|&(start, _, _)| start <= i);
        match after.checked_sub(1).map(|s| self.0[s]) {
            Some((_, end, mask)) if i < end => mask,
            _ => TierMask::default(),
        }
    }

    /// The first-miss match and the leading run on GPU.
    fn walk(&self, weights: &TierWeights) -> (PrefixMatch, u32) {
        let mut m = PrefixMatch::default();
        let mut gpu_run = None;
        let mut at = 0;
        for &(start, end, mask) in &self.0 {
            if start != at {
                break;
            }
            if gpu_run.is_none() && !mask.contains(Tier::Gpu) {
                gpu_run = Some(start);
            }
            record(&mut m, mask, end - start, weights);
            at = end;
        }
        m.weigh(weights);
        (m, gpu_run.unwrap_or(at))
    }

    /// The deepest position held on GPU.
    fn deepest_on_gpu(&self) -> Option<u32> {
        self.0
            .iter()
            .rev()
            .find(|(_, _, mask)| mask.contains(Tier::Gpu))
            .map(|&(_, end, _)| end - 1)
    }

    /// Blocks 0..=d, each on GPU besides the tiers known to hold it.
    fn closed_to(&self, d: u32, weights: &TierWeights) -> PrefixMatch {
        let gpu = 1u8 << Tier::Gpu.index();
        let mut m = PrefixMatch::default();
        let mut at = 0;
        for &(start, end, mask) in &self.0 {
            if start > d {
                break;
            }
            record(&mut m, TierMask(gpu), start - at, weights);
            let end = end.min(d + 1);
            record(&mut m, TierMask(mask.0 | gpu), end - start, weights);
            at = end;
        }
        record(&mut m, TierMask(gpu), d + 1 - at, weights);
        m.weigh(weights);
        m
    }

    /// `offload::chunked_match` of a pod holding `gpu_run` leading blocks
    /// on GPU, offloading in chunks of `factor`, for an `n`-block prompt.
    fn chunked(&self, n: u32, factor: u32, gpu_run: u32, weights: &TierWeights) -> PrefixMatch {
        chunked_match(n, factor, gpu_run, weights, |i| self.at(i))
    }
}

/// `blocks` more matched blocks, each held on `tiers`.
fn record(m: &mut PrefixMatch, tiers: TierMask, blocks: u32, weights: &TierWeights) {
    m.matched_blocks += blocks;
    count_tiers(m, tiers, blocks, weights);
}

/// `blocks` blocks held on `tiers`, counted on each and, as their best, on
/// the first of greatest weight (not as matched: callers count those).
fn count_tiers(m: &mut PrefixMatch, tiers: TierMask, blocks: u32, weights: &TierWeights) {
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
mod tests;

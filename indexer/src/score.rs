//! The prefix walk: per candidate pod, how many leading blocks of a prompt it
//! holds, and a tier-weighted score.

use crate::event::{Tier, TIERS};
use crate::index::{BlockIndex, Holder, PodId};
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
    /// Sum over matched blocks of the best tier's weight.
    pub weighted_blocks: f64,
}

/// Walks `keys` from block 0 for `candidates` (sorted by id, no duplicates)
/// and returns one match per candidate, in the same order.
///
/// A candidate's run ends at its first missing block; the walk ends at the
/// first block no remaining candidate holds, so a miss on block 0 costs one
/// lookup whatever the prompt length.
pub fn walk(
    index: &BlockIndex,
    keys: &[BlockKey],
    candidates: &[PodId],
    weights: &TierWeights,
) -> Vec<PrefixMatch> {
    debug_assert!(candidates.windows(2).all(|w| w[0] < w[1]));
    let mut matches = vec![PrefixMatch::default(); candidates.len()];
    // Positions (into `candidates`) still matching, kept in id order.
    let mut active: Vec<usize> = (0..candidates.len()).collect();
    for key in keys {
        if active.is_empty() {
            break;
        }
        index.with_holders(*key, |holders| {
            let holders = holders.unwrap_or(&[]);
            active.retain(|&pos| match find(holders, candidates[pos]) {
                Some(holder) => {
                    record(&mut matches[pos], holder, weights);
                    true
                }
                None => false,
            });
        });
    }
    matches
}

/// Holders are sorted by pod id; most keys have one or two.
fn find(holders: &[Holder], pod: PodId) -> Option<&Holder> {
    if holders.len() <= 8 {
        holders.iter().find(|h| h.pod == pod)
    } else {
        holders
            .binary_search_by_key(&pod, |h| h.pod)
            .ok()
            .map(|i| &holders[i])
    }
}

fn record(m: &mut PrefixMatch, holder: &Holder, weights: &TierWeights) {
    let tiers = holder.tiers();
    m.matched_blocks += 1;
    let mut best = 0.0f64;
    for tier in tiers.tiers() {
        m.blocks_per_tier[tier.index()] += 1;
        best = best.max(weights.get(tier));
    }
    m.weighted_blocks += best;
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn many_holders_use_the_sorted_search() {
        let index = BlockIndex::new();
        for p in (0..40).rev() {
            index.acquire(BlockKey(1), PodId(p), Tier::Gpu);
        }
        let m = walk(
            &index,
            &[BlockKey(1), BlockKey(2)],
            &[PodId(3), PodId(39), PodId(40)],
            &TierWeights::default(),
        );
        let got: Vec<u32> = m.iter().map(|m| m.matched_blocks).collect();
        assert_eq!(got, vec![1, 1, 0]);
    }
}

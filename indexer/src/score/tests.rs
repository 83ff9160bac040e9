//! Score's rules read from what a pod holds along a prompt (`Held`, from
//! the runs' stretches) against the tests' model of them, block by block
//! (`model::pod_match`): random tiers at each position of a prompt, every
//! rule combination.

use proptest::prelude::*;

use super::*;
use crate::model;

/// A pod's stretches per tier (as `held_along` gives them) from the tiers
/// holding each position.
fn along(masks: &[u8]) -> HeldAlong {
    let mut spans = Vec::new();
    for tier in Tier::ALL {
        let bit = 1 << tier.index();
        for (i, mask) in masks.iter().enumerate() {
            let i = i as u32;
            if mask & bit == 0 {
                continue;
            }
            match spans.last_mut() {
                Some((t, _, end)) if *t == tier && *end == i => *end += 1,
                _ => spans.push((tier, i, i + 1)),
            }
        }
    }
    HeldAlong { pod: 0, spans }
}

/// Tiers per position: mostly GPU from the start, then anything, with gaps.
fn masks() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop::sample::select(vec![0u8, 0, 1, 1, 1, 2, 3, 4, 6, 7]),
        0..28,
    )
}

fn weights() -> impl Strategy<Value = TierWeights> {
    prop::sample::select(vec![
        TierWeights::default(),
        TierWeights([1.0, 1.0, 0.5]),
        TierWeights([0.2, 0.8, 0.8]),
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn a_pods_match_is_the_models(
        masks in masks(),
        chunk in prop::sample::select(vec![1u32, 2, 3, 4]),
        closure in any::<bool>(),
        weights in weights(),
    ) {
        let held = Held::of(&along(&masks));
        for (i, mask) in masks.iter().enumerate() {
            prop_assert_eq!(held.at(i as u32), TierMask(*mask), "position {}", i);
        }
        prop_assert_eq!(held.at(masks.len() as u32), TierMask::default());
        let ours = pod_match(&held, masks.len() as u32, chunk, closure, &weights);
        let masks: Vec<TierMask> = masks.into_iter().map(TierMask).collect();
        prop_assert_eq!(ours, model::pod_match(&masks, chunk, closure, &weights));
    }
}

/// A pod holding blocks 2..4 on GPU and nothing before: the walk gives it
/// nothing, closure all five blocks, on GPU (the CPU copy of block 3
/// counted beside it).
#[test]
fn closure_credits_the_blocks_before_the_deepest_on_gpu() {
    let weights = TierWeights::default();
    let held = Held::of(&along(&[0, 0, 1, 3, 1, 2]));
    assert_eq!(
        pod_match(&held, 6, 1, false, &weights),
        PrefixMatch::default()
    );
    let m = pod_match(&held, 6, 1, true, &weights);
    assert_eq!(m.matched_blocks, 5);
    assert_eq!(m.blocks_per_tier, [5, 1, 0]);
    assert_eq!(m.best_tier_blocks, [5, 0, 0]);
}

/// A match on one tier is built whole; it must equal, to the last bit of
/// its weight, the one added up block by block.
#[test]
fn a_match_on_one_tier_equals_the_sum_by_block() {
    for weights in [
        TierWeights::default(),
        TierWeights([0.1, 0.7, 1e-300]),
        TierWeights([3.7, 0.0, 1.0 / 3.0]),
    ] {
        for tier in Tier::ALL {
            for blocks in [0u32, 1, 7, 333, 4099] {
                let mut summed = PrefixMatch::default();
                for _ in 0..blocks {
                    record(&mut summed, TierMask(1 << tier.index()), 1, &weights);
                }
                summed.weigh(&weights);
                let built = PrefixMatch::on_one_tier(blocks, tier, &weights);
                assert_eq!(built, summed);
                assert_eq!(
                    built.weighted_blocks.to_bits(),
                    summed.weighted_blocks.to_bits()
                );
            }
        }
    }
}

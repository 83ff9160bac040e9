//! `run_score`'s rules against the service's own (`score`'s walk and
//! closure, `offload::chunked_match`) on an index holding the same blocks:
//! random tiers at each position of a prompt, every rule combination.

use proptest::prelude::*;

use super::*;
use crate::index::{BlockIndex, PodId};
use crate::keys::BlockKey;
use crate::offload::chunked_match;
use crate::score::{extend_prefix_closed, walk_with_gpu_runs};

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

/// The service's match of a pod holding `masks` along an `n`-key prompt.
fn service(masks: &[u8], chunk: u32, closure: bool, weights: &TierWeights) -> PrefixMatch {
    let index = BlockIndex::new();
    let pod = PodId(0);
    let keys: Vec<BlockKey> = (1..=masks.len() as u64).map(BlockKey).collect();
    for (key, mask) in keys.iter().zip(masks) {
        for tier in TierMask(*mask).tiers() {
            index.acquire(*key, pod, tier);
        }
    }
    let (mut walked, mut gpu_runs) = walk_with_gpu_runs(&index, &keys, &[pod], weights);
    if closure {
        extend_prefix_closed(
            &index,
            &keys,
            &[pod],
            &mut walked,
            &mut gpu_runs,
            &[chunk > 1],
            weights,
        );
    }
    if chunk > 1 {
        walked[0] = chunked_match(&index, &keys, pod, chunk, gpu_runs[0], weights);
    }
    walked[0]
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
    fn a_pods_match_is_the_services(
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
        prop_assert_eq!(ours, service(&masks, chunk, closure, &weights));
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

//! What a pod can load from its offloaded tiers when vLLM offloads in
//! chunks of several blocks (the offloading connector's `block_size` above
//! the GPU block size; vLLM's own usage guide sets 64 tokens against 16).
//!
//! vLLM takes its GPU prefix hit first: `g` blocks. It then asks the
//! offloading manager for the run of chunks held from the chunk that block
//! `g` falls in, each chunk named by its last block's hash, and loads them
//! only if the run ends at least a whole chunk past `g`
//! (`OffloadingConnectorScheduler::get_num_new_matched_tokens`). Only the
//! prompt's full chunks count. So a pod's match is `(start + hits) * f`
//! blocks or `g`, never anything between. Counting offloaded blocks one by
//! one, as the walk does, sees one block per chunk with the connector's
//! default events (they name the chunk by that one hash), and counts
//! partial chunks with its self-describing ones (every block of a chunk).
//!
//! A chunk is held when its last block is held on a tier other than GPU,
//! which both event forms give.

use super::{count_tiers, PrefixMatch, TierWeights};
use crate::event::{Tier, TierMask};

/// Blocks per offloaded chunk: `offload_block_size` tokens in blocks of
/// `block_size`, or 1 (blocks counted one by one) when it is unknown, not
/// larger, or not a multiple.
pub fn chunk_factor(offload_block_size: u32, block_size: u32) -> u32 {
    match block_size {
        0 => 1,
        bs if offload_block_size > bs && offload_block_size.is_multiple_of(bs) => {
            offload_block_size / bs
        }
        _ => 1,
    }
}

/// The match of a pod offloading in chunks of `factor` blocks and holding
/// `gpu_run` leading blocks of an `n`-block prompt on GPU, its tiers at
/// each position given by `tiers_at` (`Held::at`). Matched blocks count on
/// the tier they are served from: GPU below `gpu_run`, the chunk's
/// offloaded tiers above it.
pub(crate) fn chunked_match(
    n: u32,
    factor: u32,
    gpu_run: u32,
    weights: &TierWeights,
    tiers_at: impl Fn(u32) -> TierMask,
) -> PrefixMatch {
    debug_assert!(factor > 1);
    let chunks = n / factor;
    let start = gpu_run / factor;
    // The offloaded tiers of each chunk held from `start` on.
    let mut held: Vec<TierMask> = Vec::new();
    for chunk in start..chunks {
        let tiers = tiers_at((chunk + 1) * factor - 1);
        let offloaded = TierMask(tiers.0 & !(1 << Tier::Gpu.index()));
        if offloaded.is_empty() {
            break;
        }
        held.push(offloaded);
    }
    let end = (start + held.len() as u32) * factor;
    // (A chunk size from a pod's events can be anything: no overflow.)
    let loads = end >= gpu_run.saturating_add(factor);
    let mut m = PrefixMatch {
        matched_blocks: if loads { end } else { gpu_run },
        ..PrefixMatch::default()
    };
    m.blocks_per_tier[Tier::Gpu.index()] = gpu_run;
    m.best_tier_blocks[Tier::Gpu.index()] = gpu_run;
    if loads {
        for (i, tiers) in held.iter().enumerate() {
            let chunk = start + i as u32;
            // The blocks of this chunk past the GPU hit: all, but in the
            // first chunk those from `gpu_run` on.
            let blocks = (chunk + 1) * factor - (chunk * factor).max(gpu_run);
            count_tiers(&mut m, *tiers, blocks, weights);
        }
    }
    debug_assert_eq!(m.best_tier_blocks.iter().sum::<u32>(), m.matched_blocks);
    m.weigh(weights);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's `get_num_new_matched_tokens` (offloading connector), in
    /// blocks: `gpu_run` blocks hit on GPU, `held(k)` whether chunk `k` is
    /// offloaded; returns the blocks the request starts with.
    fn vllm(gpu_run: u32, held: impl Fn(u32) -> bool, blocks: u32, factor: u32) -> u32 {
        let num_blocks = blocks / factor;
        if (factor * num_blocks).saturating_sub(gpu_run) < factor {
            return gpu_run;
        }
        let start = gpu_run / factor;
        let hits = (start..num_blocks).take_while(|k| held(*k)).count() as u32;
        if hits == 0 {
            return gpu_run;
        }
        let hit = factor * (start + hits) - gpu_run;
        if hit < factor {
            gpu_run
        } else {
            gpu_run + hit
        }
    }

    /// A pod's tiers at each position of a prompt, set block by block.
    struct Prompt(Vec<TierMask>);

    impl Prompt {
        fn new(blocks: u32) -> Prompt {
            Prompt(vec![TierMask::default(); blocks as usize])
        }

        fn hold(&mut self, block: u32, tier: Tier) {
            self.0[block as usize].0 |= 1 << tier.index();
        }

        fn chunked(&self, factor: u32, gpu_run: u32) -> PrefixMatch {
            let n = self.0.len() as u32;
            chunked_match(n, factor, gpu_run, &TierWeights::default(), |i| {
                self.0[i as usize]
            })
        }
    }

    /// Random GPU runs and offloaded chunks, held as the connector's
    /// default events leave them (the chunk's last block) or as its
    /// self-describing ones do (every block), against vLLM's rule; and the
    /// tiers add up.
    #[test]
    fn chunked_matches_are_what_vllm_loads() {
        let mut rnd = crate::test_rng::xorshift(0x0ff1_0ad5);
        for case in 0..3000 {
            let factor = [2, 4, 8][rnd(3) as usize];
            let blocks = rnd(40) as u32;
            let gpu_run = rnd(u64::from(blocks) + 1) as u32;
            let every_block = rnd(2) == 0;
            let mut prompt = Prompt::new(blocks);
            for k in 0..gpu_run {
                prompt.hold(k, Tier::Gpu);
            }
            let chunks = blocks.div_ceil(factor);
            let held: Vec<bool> = (0..chunks).map(|_| rnd(4) > 0).collect();
            for (k, on) in held.iter().enumerate() {
                if !on {
                    continue;
                }
                let k = k as u32;
                let tier = if rnd(5) == 0 {
                    Tier::Storage
                } else {
                    Tier::Cpu
                };
                let from = if every_block {
                    k * factor
                } else {
                    (k + 1) * factor - 1
                };
                for b in from..((k + 1) * factor).min(blocks) {
                    prompt.hold(b, tier);
                }
            }
            // A GPU copy of a chunk's last block (past the GPU run) does
            // not make the chunk offloaded.
            if let Some(k) = (0..chunks).rev().find(|k| !held[*k as usize]) {
                let last = (k + 1) * factor - 1;
                if last < blocks && rnd(2) == 0 {
                    prompt.hold(last, Tier::Gpu);
                }
            }
            let m = prompt.chunked(factor, gpu_run);
            let want = vllm(gpu_run, |k| held[k as usize], blocks, factor);
            assert_eq!(
                m.matched_blocks, want,
                "case {case}: {factor} {blocks} {gpu_run} {held:?}"
            );
            assert_eq!(m.best_tier_blocks.iter().sum::<u32>(), want, "case {case}");
        }
    }

    /// A chunk larger than any prompt loads nothing, whatever its size.
    #[test]
    fn a_chunk_larger_than_the_prompt_loads_nothing() {
        let prompt = Prompt::new(8);
        for factor in [9, u32::MAX - 3] {
            assert_eq!(prompt.chunked(factor, 8).matched_blocks, 8);
        }
    }

    /// A chunk on CPU and storage counts on both and is served from CPU.
    #[test]
    fn a_chunk_counts_on_each_tier_it_is_held_on() {
        let mut prompt = Prompt::new(8);
        prompt.hold(0, Tier::Gpu);
        for b in [3, 7] {
            prompt.hold(b, Tier::Cpu);
        }
        prompt.hold(7, Tier::Storage);
        let m = prompt.chunked(4, 1);
        assert_eq!(m.matched_blocks, 8);
        assert_eq!(m.blocks_per_tier, [1, 7, 4]);
        assert_eq!(m.best_tier_blocks, [1, 7, 0]);
        assert!((m.weighted_blocks - (1.0 + 7.0 * 0.8)).abs() < 1e-9);
    }
}

//! `Indexer::score`, the index's part of a `Score` request, in the end-to-end
//! bench's shape: a 2,048-block prompt (32K token ids) and 64 pods holding
//! its first 32, 64, ... 2,048 blocks (every pod ends at a different depth,
//! the most probes a search can take), against 64 pods all holding the same
//! 1,024 blocks, and a one-block prompt (the per-request cost of naming and
//! sorting 64 pods); also the first case with the pods' ids 150 apart, among
//! 9,536 pods of another model; and the first case with every pod's first
//! block also offloaded to CPU (pods on two tiers are walked, not searched),
//! or the 16 blocks past each pod's depth offloaded in chunks of 4 as vLLM's
//! offloading connector names them (`--offload-block-size 64`: walked, then
//! counted by chunks).
//! `cargo bench -p indexer --bench score` prints medians.
//! The search is timed twice: repeated (the index in cache) and "cold",
//! each lookup after 64 MB of other data were written (the index in
//! memory, as a service finds it between requests); "cold score" is the
//! whole `score` so (keys, search, speculative entries and the answer).

#[path = "common/measure.rs"]
mod measure;

use std::hint::black_box;
use std::time::Duration;

use indexer::event::{BlockStored, EngineHash, EventBatch, KvEvent};
use indexer::{Indexer, IndexerConfig, ScoreQuery};
use measure::measure;

const BLOCK: usize = 16;
const BLOCKS: usize = 2048;
const PODS: usize = 64;

fn fleet(depth: impl Fn(usize) -> usize, tokens: &[u32]) -> Indexer {
    fleet_among(0, depth, tokens, IndexerConfig::default())
}

/// `fleet`, with `others` pods of another model registered before each of
/// its pods, so its pod ids lie that far apart (a fleet of many models).
fn fleet_among(
    others: usize,
    depth: impl Fn(usize) -> usize,
    tokens: &[u32],
    config: IndexerConfig,
) -> Indexer {
    let ix = Indexer::new(config);
    for i in 0..PODS {
        for j in 0..others {
            ix.pod("other", &format!("other-{i:02}-{j:03}"), None);
        }
        let pod = ix.pod("m", &format!("pod-{i:02}"), None);
        let d = depth(i);
        let stored = KvEvent::Stored(BlockStored {
            block_hashes: (0..d as u64).map(|h| EngineHash(0x5c0e_0000 + h)).collect(),
            token_ids: tokens[..d * BLOCK].to_vec(),
            block_size: Some(BLOCK as u32),
            ..Default::default()
        });
        let batch = EventBatch {
            events: vec![stored],
            ..Default::default()
        };
        ix.apply(&pod, 0, &batch);
    }
    ix
}

/// `ix` with each pod's first block also offloaded to CPU: pods on two
/// tiers are walked block by block, not binary-searched.
fn offloaded(ix: Indexer) -> Indexer {
    for i in 0..PODS {
        let pod = ix.pod("m", &format!("pod-{i:02}"), None);
        let offload = KvEvent::Stored(BlockStored {
            block_hashes: vec![EngineHash(0x5c0e_0000)],
            medium: Some("CPU".into()),
            ..Default::default()
        });
        let batch = EventBatch {
            events: vec![offload],
            ..Default::default()
        };
        ix.apply(&pod, 1, &batch);
    }
    ix
}

/// A `fleet` offloading in chunks of 4 blocks, each pod holding on CPU the
/// 4 chunks past its depth, named by their last blocks (vLLM's default
/// offload events).
fn chunked(depth: impl Fn(usize) -> usize, tokens: &[u32]) -> Indexer {
    let config = IndexerConfig {
        offload_block_size: 4 * BLOCK as u32,
        ..IndexerConfig::default()
    };
    let ix = fleet_among(0, &depth, tokens, config);
    for i in 0..PODS {
        let pod = ix.pod("m", &format!("pod-{i:02}"), None);
        let d = depth(i) as u64;
        let offload = KvEvent::Stored(BlockStored {
            block_hashes: (1..=4)
                .map(|c| d + 4 * c - 1)
                .filter(|b| *b < BLOCKS as u64)
                .map(|b| EngineHash(0x5c0e_0000 + b))
                .collect(),
            medium: Some("CPU".into()),
            ..Default::default()
        });
        // The chunks' blocks were on GPU first (their hashes known), then
        // evicted there.
        let stored = KvEvent::Stored(BlockStored {
            block_hashes: (d..(d + 16).min(BLOCKS as u64))
                .map(|b| EngineHash(0x5c0e_0000 + b))
                .collect(),
            parent_block_hash: d.checked_sub(1).map(|b| EngineHash(0x5c0e_0000 + b)),
            token_ids: tokens[d as usize * BLOCK..(d as usize + 16).min(BLOCKS) * BLOCK].to_vec(),
            block_size: Some(BLOCK as u32),
            ..Default::default()
        });
        let evicted = KvEvent::Removed(indexer::event::BlockRemoved {
            block_hashes: (d..(d + 16).min(BLOCKS as u64))
                .rev()
                .map(|b| EngineHash(0x5c0e_0000 + b))
                .collect(),
            ..Default::default()
        });
        let batch = EventBatch {
            events: vec![stored, offload, evicted],
            ..Default::default()
        };
        ix.apply(&pod, 1, &batch);
    }
    ix
}

/// `ix` with 8 of its pods (and 8 that never published) sent the whole
/// prompt by `RecordRouting`: Score's extra walk over speculative entries.
fn with_speculation(ix: Indexer, tokens: &[u32]) -> Indexer {
    let keys = ix.request_keys("m", None, None, tokens, BLOCK as u32, &[]);
    let now = std::time::Instant::now();
    let until = now + Duration::from_secs(3600);
    for i in 0..8 {
        ix.speculate("m", &format!("pod-{i:02}"), &keys, until, now);
        ix.speculate("m", &format!("new-{i:02}"), &keys, until, now);
    }
    ix
}

fn main() {
    // `cargo test --all-targets` runs benches without `--bench`: keep that short.
    let quick = std::env::args().any(|a| a == "--quick" || a == "--test")
        || !std::env::args().any(|a| a == "--bench");
    let budget = Duration::from_millis(if quick { 300 } else { 3000 });
    let mut x = 42u64;
    let tokens: Vec<u32> = (0..BLOCKS * BLOCK)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((x >> 33) % 150_000) as u32
        })
        .collect();
    println!("Indexer::score, {PODS} pods, block size {BLOCK}; median (p90) per request");
    let cases: [(&str, Indexer, usize, usize); 7] = [
        (
            "2048 blocks, 64 different depths",
            fleet(|i| (i + 1) * BLOCKS / PODS, &tokens),
            BLOCKS,
            BLOCKS * PODS / 2 + BLOCKS / 2,
        ),
        (
            "the same, pod ids 150 apart",
            fleet_among(
                149,
                |i| (i + 1) * BLOCKS / PODS,
                &tokens,
                IndexerConfig::default(),
            ),
            BLOCKS,
            BLOCKS * PODS / 2 + BLOCKS / 2,
        ),
        (
            "the same, on two tiers (walked)",
            offloaded(fleet(|i| (i + 1) * BLOCKS / PODS, &tokens)),
            BLOCKS,
            BLOCKS * PODS / 2 + BLOCKS / 2,
        ),
        (
            "the same, offloaded in chunks",
            chunked(|i| (i + 1) * BLOCKS / PODS, &tokens),
            BLOCKS,
            BLOCKS * PODS / 2 + BLOCKS / 2 + 16 * (PODS - 1),
        ),
        (
            "2048 blocks, one depth (1024)",
            fleet(|_| BLOCKS / 2, &tokens),
            BLOCKS,
            BLOCKS * PODS / 2,
        ),
        (
            "2048 blocks, 64 depths, 16 speculative",
            with_speculation(fleet(|i| (i + 1) * BLOCKS / PODS, &tokens), &tokens),
            BLOCKS,
            BLOCKS * PODS / 2 + BLOCKS / 2,
        ),
        (
            "1 block",
            fleet(|i| (i + 1) * BLOCKS / PODS, &tokens),
            1,
            PODS,
        ),
    ];
    for (name, ix, blocks, expect) in &cases {
        let q = ScoreQuery {
            model: "m",
            tokens: &tokens[..blocks * BLOCK],
            lora_name: None,
            cache_salt: None,
            mm_items: &[],
            pods: &[],
        };
        let matched: usize = ix
            .score(&q)
            .pods
            .iter()
            .map(|p| p.matched.matched_blocks as usize)
            .sum();
        assert_eq!(matched, *expect, "{name}: wrong answer");
        let (med, p90) = measure(budget, || {
            black_box(ix.score(black_box(&q)));
        });
        let keys = ix.request_keys("m", None, None, q.tokens, BLOCK as u32, &[]);
        let (kmed, _) = measure(budget, || {
            black_box(ix.request_keys("m", None, None, black_box(q.tokens), BLOCK as u32, &[]));
        });
        let (mmed, _) = measure(budget, || {
            black_box(ix.prefix_matches("m", black_box(&keys)));
        });
        let cold = cold_median(if quick { 20 } else { 200 }, || {
            black_box(ix.prefix_matches("m", black_box(&keys)));
        });
        let cold_score = cold_median(if quick { 20 } else { 200 }, || {
            black_box(ix.score(black_box(&q)));
        });
        println!(
            "  {name:<34} {:>8.1} us ({:>8.1})   keys {:>6.1} us, search {:>6.1} us, cold {:>6.1} us, cold score {:>6.1} us",
            med.as_secs_f64() * 1e6,
            p90.as_secs_f64() * 1e6,
            kmed.as_secs_f64() * 1e6,
            mmed.as_secs_f64() * 1e6,
            cold.as_secs_f64() * 1e6,
            cold_score.as_secs_f64() * 1e6,
        );
    }
}

/// Median of `runs` calls of `f`, each after the caches were filled with
/// other data (a buffer larger than the last-level cache written over): a
/// service's lookup, between whose requests ingest and the transport run,
/// finds the index's lines in memory, not in cache.
fn cold_median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut other = vec![0u64; 64 << 17];
    let mut samples: Vec<Duration> = (0..runs)
        .map(|r| {
            for (i, w) in other.iter_mut().enumerate().step_by(8) {
                *w = w.wrapping_add((r + i) as u64);
            }
            black_box(&other);
            let t = std::time::Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    samples.sort();
    samples[samples.len() / 2]
}

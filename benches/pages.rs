//! What SGLang's page sizes cost: ingest (decoding SGLang-form batches and
//! applying them to the index) in tokens per second, and `Score` of a
//! 32K-token prompt, at page sizes 1 (SGLang's default: a hash per token),
//! 16 and 64, in one run, rounds interleaved. `cargo bench --bench pages`
//! prints the numbers; nothing is asserted.
//!
//! - Ingest: 8 pods, each storing 32 distinct 2,048-token prompts, one
//!   `BlockStored` per prompt (SGLang stores a node's pages in one event:
//!   2,048 hashes at page size 1), as SGLang's publisher encodes it (tagged
//!   maps, signed 64-bit hashes, `[ts, events, rank]`). Median tokens/s of
//!   the rounds; beside it, decoding alone (the batches decoded and
//!   dropped: the most ingest could reach at that page size with an index
//!   that cost nothing), the wire bytes per token, and what applying costs
//!   a page (ingest's time less decoding's, per page: keying its tokens and
//!   indexing it). The summary also gives decoding and keying alone
//!   (decoding, plus the prompt's keys' time a token): an index that cost
//!   nothing would still pay both.
//! - Score: the same 8 pods also hold the first 24,576 tokens of one
//!   32,768-token prompt; `Score` of that prompt (keys from its tokens and
//!   the lookup), p50 / p99 / p99.9 over the rounds' calls, beside the keys
//!   alone (`request_keys`): what the lookup adds is the difference.

use std::hint::black_box;
use std::time::{Duration, Instant};

use indexer::wire::decode_batch;
use indexer::{Indexer, IndexerConfig, ScoreQuery};
use serde::Serialize;

const MODEL: &str = "Qwen/Qwen3-8B";
const PODS: usize = 8;
const PROMPTS_PER_POD: usize = 32;
const PROMPT: usize = 2_048;
const LONG: usize = 32_768;
const HELD: usize = 24_576;
const PAGES: [usize; 3] = [1, 16, 64];

#[derive(Serialize)]
struct Stored<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    block_hashes: Vec<i64>,
    parent_block_hash: Option<i64>,
    token_ids: &'a [u32],
    block_size: usize,
    lora_id: Option<i64>,
    medium: &'static str,
}

/// One SGLang batch storing `tokens` at page size `page` (its pages'
/// hashes made up, distinct per `salt`).
fn batch(tokens: &[u32], page: usize, salt: u64) -> Vec<u8> {
    let pages = tokens.len() / page;
    let event = Stored {
        kind: "BlockStored",
        block_hashes: (0..pages as u64)
            .map(|i| (salt << 32 | i).wrapping_mul(0x9e37_79b9_7f4a_7c15) as i64)
            .collect(),
        parent_block_hash: None,
        token_ids: &tokens[..pages * page],
        block_size: page,
        lora_id: None,
        medium: "GPU",
    };
    rmp_serde::to_vec_named(&(1_767_225_600.0f64, [event], 0u32)).expect("encode")
}

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 150_000) as u32
        })
        .collect()
}

/// Decodes every batch and drops it; tokens per second. What ingest at a
/// page size can at best reach, with an index that cost nothing.
fn decode_only(batches: &[(usize, Vec<u8>)]) -> f64 {
    let started = Instant::now();
    for (_, payload) in batches {
        black_box(decode_batch(payload).expect("decodes"));
    }
    (batches.len() * PROMPT) as f64 / started.elapsed().as_secs_f64()
}

/// Decodes and applies every batch to a fresh index; tokens per second.
fn ingest(batches: &[(usize, Vec<u8>)]) -> (f64, Indexer) {
    let ix = Indexer::new(IndexerConfig::default());
    let pods: Vec<_> = (0..PODS)
        .map(|p| ix.pod(MODEL, &format!("pod-{p}"), Some(0)))
        .collect();
    let mut stored = 0usize;
    let started = Instant::now();
    for (seq, (pod, payload)) in batches.iter().enumerate() {
        let batch = decode_batch(payload).expect("decodes");
        let stats = ix.apply(&pods[*pod], seq as u64, &batch);
        black_box(stats);
        stored += PROMPT;
    }
    (stored as f64 / started.elapsed().as_secs_f64(), ix)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p) as usize).min(sorted.len() - 1);
    sorted[i].as_secs_f64() * 1e6
}

fn main() {
    // `cargo test --all-targets` runs benches without `--bench`: keep that short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let (rounds, calls) = if quick { (1, 20) } else { (5, 400) };
    let long = tokens(7, LONG);
    // Per page size: the ingest batches (every pod's prompts, then the held
    // part of the long prompt, stored as one node per pod).
    let inputs: Vec<Vec<(usize, Vec<u8>)>> = PAGES
        .iter()
        .map(|&page| {
            let mut out = Vec::new();
            for p in 0..PODS {
                for i in 0..PROMPTS_PER_POD {
                    let salt = (p * PROMPTS_PER_POD + i) as u64 + 1;
                    out.push((p, batch(&tokens(salt, PROMPT), page, salt)));
                }
            }
            out
        })
        .collect();
    let held: Vec<Vec<u8>> = PAGES
        .iter()
        .map(|&page| batch(&long[..HELD], page, 1 << 20))
        .collect();

    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); PAGES.len()];
    let mut decodes: Vec<Vec<f64>> = vec![Vec::new(); PAGES.len()];
    let mut scores: Vec<Vec<Duration>> = vec![Vec::new(); PAGES.len()];
    let mut keys: Vec<Vec<Duration>> = vec![Vec::new(); PAGES.len()];
    let mut matched = vec![0u32; PAGES.len()];
    // Probes of the run heads' table per Score (every pod's match).
    let mut probes = vec![0u64; PAGES.len()];
    for _ in 0..rounds {
        for (k, &page) in PAGES.iter().enumerate() {
            decodes[k].push(decode_only(&inputs[k]));
            let (rate, ix) = ingest(&inputs[k]);
            rates[k].push(rate);
            for p in 0..PODS {
                let pod = ix.pod(MODEL, &format!("pod-{p}"), Some(0));
                let batch = decode_batch(&held[k]).expect("decodes");
                ix.apply(&pod, 1 << 20, &batch);
            }
            let query = ScoreQuery {
                model: MODEL,
                tokens: &long,
                lora_name: None,
                cache_salt: None,
                mm_items: &[],
                pods: &[],
            };
            for _ in 0..calls {
                let before = indexer::index::head_probes();
                let t = Instant::now();
                let out = black_box(ix.score(&query));
                scores[k].push(t.elapsed());
                probes[k] = indexer::index::head_probes() - before;
                matched[k] = out.pods[0].matched.matched_blocks * page as u32;
                let t = Instant::now();
                black_box(ix.request_keys(MODEL, None, None, &long, page as u32, &[]));
                keys[k].push(t.elapsed());
            }
        }
    }
    println!(
        "SGLang page sizes: ingest of {PODS} pods x {PROMPTS_PER_POD} prompts of {PROMPT} tokens (one BlockStored each), Score of a {LONG}-token prompt {HELD} of whose tokens every pod holds; {rounds} rounds"
    );
    println!(
        "{:>5} {:>8} {:>14} {:>14} {:>14} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10} {:>8}",
        "page",
        "B/token",
        "decode tok/s",
        "ingest tok/s",
        "apply ns/page",
        "score p50 us",
        "p99 us",
        "p99.9 us",
        "keys p50 us",
        "pages",
        "matched",
        "probes"
    );
    let mut rows = Vec::new();
    for (k, &page) in PAGES.iter().enumerate() {
        rates[k].sort_by(f64::total_cmp);
        decodes[k].sort_by(f64::total_cmp);
        scores[k].sort();
        keys[k].sort();
        let rate = rates[k][rates[k].len() / 2];
        let decode = decodes[k][decodes[k].len() / 2];
        let bytes: usize = inputs[k].iter().map(|(_, b)| b.len()).sum();
        // Decoding and then keying every token, as a prompt's are keyed.
        let floor = 1.0 / (1.0 / decode + percentile(&keys[k], 0.5) * 1e-6 / LONG as f64);
        rows.push((page, rate, decode, floor, percentile(&scores[k], 0.5)));
        println!(
            "{page:>5} {:>8.1} {:>14.0} {:>14.0} {:>14.1} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>12} {:>10} {:>8}",
            bytes as f64 / (inputs[k].len() * PROMPT) as f64,
            decode,
            rate,
            (1.0 / rate - 1.0 / decode) * 1e9 * page as f64,
            percentile(&scores[k], 0.5),
            percentile(&scores[k], 0.99),
            percentile(&scores[k], 0.999),
            percentile(&keys[k], 0.5),
            LONG / page,
            matched[k],
            probes[k],
        );
    }
    let (_, base_rate, _, _, base_score) = rows[1];
    for (page, rate, decode, floor, score) in rows {
        println!(
            "page {page}: ingest {:.2}x page 16's tokens/s (decoding alone {:.2}x, decoding and keying alone {:.2}x), Score p50 {:.2}x page 16's",
            rate / base_rate,
            decode / base_rate,
            floor / base_rate,
            score / base_score
        );
    }
}

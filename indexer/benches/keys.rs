//! Key computation for a 32K-token prompt: our token keys (AES rounds) and vLLM's
//! engine hashes (sha256 over pickle, sha256 over CBOR, xxh3-128).
//! `cargo bench -p indexer --bench keys` prints medians of repeated runs.

#[path = "common/measure.rs"]
mod measure;

use std::hint::black_box;
use std::time::Duration;

use indexer::keys::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo, DEFAULT_SEED};
use indexer::keys::{prompt_keys, request_root_seed};
use measure::measure;

fn main() {
    // `cargo test --all-targets` runs benches without `--bench`: keep that short.
    let quick = std::env::args().any(|a| a == "--quick" || a == "--test")
        || !std::env::args().any(|a| a == "--bench");
    let budget = Duration::from_millis(if quick { 300 } else { 2000 });
    let tokens: Vec<u32> = (0..32_768u32).map(|i| (i * 7919) % 151_000).collect();
    let block_size = 16;
    let blocks = tokens.len() / block_size;
    println!(
        "32768-token prompt, block size {block_size} ({blocks} blocks); median (p90) per prompt"
    );

    let seed = request_root_seed("Qwen/Qwen3-8B", None, None);
    let (med, p90) = measure(budget, || {
        black_box(prompt_keys(seed, black_box(&tokens), block_size));
    });
    report("token keys (AES rounds, rotate-add)", med, p90, blocks);
    per_ns(med, blocks * 64);

    // The previous scheme (token-keys/v3), beside it in the same run: the
    // same rounds, folded by a 128-bit multiply.
    let (med, p90) = measure(budget, || {
        let mut keys = Vec::new();
        indexer::keys::chain_blocks(
            seed,
            black_box(&tokens),
            block_size,
            |prev, h| {
                let p = u128::from(prev ^ 0x9e37_79b9_7f4a_7c15)
                    * u128::from(h ^ 0xd6e8_feb8_6659_fd93);
                (p as u64) ^ ((p >> 64) as u64)
            },
            &mut keys,
        );
        black_box(keys);
    });
    report("same rounds, mum fold (v3)", med, p90, blocks);

    from_memory(budget, quick, seed);

    for algo in [
        HashAlgo::Sha256,
        HashAlgo::Sha256Cbor,
        HashAlgo::Xxhash,
        HashAlgo::XxhashCbor,
    ] {
        let h = EngineHasher::new(algo, DEFAULT_SEED, ExtraKeyStyle::Tagged);
        let (med, p90) = measure(budget, || {
            black_box(h.prompt_digests(black_box(&tokens), block_size, &[], &[]));
        });
        report(
            &format!("engine hashes ({})", algo.name()),
            med,
            p90,
            blocks,
        );
    }
}

/// What bounds a long prompt's keys when its token ids are not in cache:
/// 8,192-block prompts taken in turn from a set larger than the last-level
/// cache (the comparison bench's 8,192-block queries are so), hashed,
/// against the same prompts only read (each word xored in, the least a
/// pass over them can do). Bytes per ns of token ids.
fn from_memory(budget: Duration, quick: bool, seed: u64) {
    let (blocks, prompts) = (8192usize, if quick { 4 } else { 100 });
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let set: Vec<Vec<u32>> = (0..prompts)
        .map(|_| {
            (0..blocks * 16)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 151_000) as u32
                })
                .collect()
        })
        .collect();
    println!(
        "{blocks}-block prompts, {prompts} in turn ({} MiB of token ids); median (p90) per prompt",
        (prompts * blocks * 64) >> 20
    );
    let mut next = 0;
    let (med, p90) = measure(budget, || {
        next = (next + 1) % set.len();
        black_box(prompt_keys(seed, black_box(&set[next]), 16));
    });
    report("token keys", med, p90, blocks);
    per_ns(med, blocks * 64);
    let (med, p90) = measure(budget, || {
        next = (next + 1) % set.len();
        let words: &[u64] = bytemuck::cast_slice(black_box(&set[next]));
        black_box(words.iter().fold(0, |a, w| a ^ w));
    });
    report("read only", med, p90, blocks);
    per_ns(med, blocks * 64);
}

fn per_ns(med: Duration, bytes: usize) {
    println!(
        "  {:<32} {:>9.1} bytes/ns",
        "",
        bytes as f64 / (med.as_secs_f64() * 1e9)
    );
}

fn report(name: &str, med: Duration, p90: Duration, blocks: usize) {
    println!(
        "  {name:<32} {:>9.1} us ({:>9.1} us)  {:>6.2} ns/block",
        med.as_secs_f64() * 1e6,
        p90.as_secs_f64() * 1e6,
        med.as_secs_f64() * 1e9 / blocks as f64
    );
}

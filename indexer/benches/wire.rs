//! Decoding vLLM `KVEventBatch` payloads (`wire::decode_batch`) in the shapes
//! ingest sees: one-block decode stores, 16-block turns and 2,048-block
//! (32K-token) prefills, each in vLLM 0.33's map form, the 0.23 positional
//! array form and with raw 32-byte hashes. `cargo bench -p indexer --bench
//! wire` prints medians (p90) of repeated runs: `decode_batch` (the one-pass
//! fast path) next to `decode_batch_reference` (the serde decoder it falls
//! back to), same payloads, same run.

#[path = "common/measure.rs"]
mod measure;
#[path = "../src/wire/vllm_encode.rs"]
#[allow(dead_code)]
mod vllm_encode;

use std::hint::black_box;
use std::time::Duration;

use indexer::wire::{decode_batch, decode_batch_reference};
use measure::measure;
use vllm_encode::{encode_batch, Event, Form, Hash, Stored};

fn main() {
    // `cargo test --all-targets` runs benches without `--bench`: keep that short.
    let quick = std::env::args().any(|a| a == "--quick" || a == "--test")
        || !std::env::args().any(|a| a == "--bench");
    let budget = Duration::from_millis(if quick { 100 } else { 1500 });
    let mut rnd = lcg(42);
    println!("median (p90) per payload");
    for (shape, blocks) in [("decode", 1usize), ("turn", 16), ("prefill", 2048)] {
        for (hashes, form) in [
            ("int", Form::Map),
            ("int", Form::ArrayV023),
            ("bytes", Form::Map),
        ] {
            let payload = batch(&mut rnd, blocks, hashes == "bytes", form);
            let name = format!("{shape} {blocks} blk, {form:?}, {hashes} hashes");
            assert_eq!(decode_batch(&payload), decode_batch_reference(&payload));
            let (fast, fast_p90) = measure(budget, || {
                black_box(decode_batch(black_box(&payload)).unwrap());
            });
            let (serde, serde_p90) = measure(budget, || {
                black_box(decode_batch_reference(black_box(&payload)).unwrap());
            });
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            println!(
                "  {name:<40} {:>6} B  fast {:>8.2} us ({:>8.2})  reference {:>8.2} us ({:>8.2})  {:>5.1}x",
                payload.len(),
                us(fast),
                us(fast_p90),
                us(serde),
                us(serde_p90),
                serde.as_secs_f64() / fast.as_secs_f64(),
            );
        }
    }
}

/// One `BlockStored` of `blocks` 16-token blocks, as vLLM 0.33 publishes a
/// prompt's (or a decode step's) new blocks: random ids of a 150K vocabulary.
fn batch(rnd: &mut impl FnMut() -> u64, blocks: usize, bytes: bool, form: Form) -> Vec<u8> {
    let hash = |rnd: &mut dyn FnMut() -> u64| {
        if bytes {
            Hash::Bytes((0..4).flat_map(|_| rnd().to_be_bytes()).collect())
        } else {
            Hash::Int(rnd())
        }
    };
    let stored = Stored {
        hashes: (0..blocks).map(|_| hash(rnd)).collect(),
        parent: Some(hash(rnd)),
        tokens: (0..blocks * 16).map(|_| (rnd() % 150_000) as u32).collect(),
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: Some(vec![None; blocks]),
        group_idx: 0,
        kind: "full_attention".into(),
    };
    encode_batch(1.795e9, &[Event::Stored(stored)], form, Some(0))
}

fn lcg(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        x ^ (x >> 29)
    }
}

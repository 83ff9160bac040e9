//! Arbitrary bytes as a ZeroMQ message: topic, then payload. Decoding must
//! never panic or allocate what the input does not contain, the one-pass
//! decoder must give exactly what the serde reference gives (batch,
//! counters or error), and applying whatever decodes must never panic.
#![no_main]

use indexer::topic::parse_topic;
use indexer::wire::{decode_batch, decode_batch_reference};
use indexer::{Indexer, IndexerConfig, ScoreQuery};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First byte: topic length; then the topic; the rest is the payload.
    let (topic, payload) = match data.split_first() {
        Some((&n, rest)) if (n as usize) <= rest.len() => rest.split_at(n as usize),
        _ => (&b"kv@pod@model"[..], data),
    };
    let topic = parse_topic(topic).unwrap_or(indexer::topic::Topic {
        pod: "pod",
        model: "model",
    });
    let decoded = decode_batch(payload);
    // Printed, so that a NaN timestamp equals itself.
    assert_eq!(
        format!("{decoded:?}"),
        format!("{:?}", decode_batch_reference(payload)),
        "the one-pass decoder and the reference disagree"
    );
    if let Ok(batch) = decoded {
        let ix = Indexer::new(IndexerConfig::default());
        let pod = ix.pod(topic.model, topic.pod, batch.data_parallel_rank);
        ix.apply(&pod, 0, &batch);
        ix.apply(&pod, 1, &batch);
        let tokens: Vec<u32> = payload.iter().map(|b| u32::from(*b)).collect();
        let _ = ix.score(&ScoreQuery {
            model: topic.model,
            tokens: &tokens,
            lora_name: None,
            cache_salt: None,
            pods: &[],
        });
    }
});

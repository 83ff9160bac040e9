//! The run layout (`indexer::runs`) on every recorded vLLM stream: fed the
//! same events the service's index applies, keyed as the service keys them,
//! it answers every probe with the blocks vLLM says each pod had cached,
//! and as the service's index does. Then it is evicted down, dumped and
//! restored, and still answers as it did.

use std::collections::HashMap;

use indexer::event::{EventBatch, KvEvent};
use indexer::runs::RunIndex;
use indexer::{Indexer, IndexerConfig};
use serde_json::Value;

use super::{answers, expected, frames, probe_tokens, Frame};

/// The service's index and the run layout, fed one stream, and each pod's
/// name by its id.
fn replay(stream: &str) -> (Indexer, RunIndex, HashMap<u32, String>) {
    let ix = Indexer::new(IndexerConfig::default());
    let runs = RunIndex::with_token_keys().bounded();
    let mut names = HashMap::new();
    for Frame {
        model,
        pod,
        seq,
        batch,
    } in frames(stream)
    {
        let pod = ix.pod(&model, &pod, batch.data_parallel_rank);
        names.insert(pod.id.0, pod.name.clone());
        // One event at a time: a block the batch removes again after
        // storing it still has its key when its store is fed.
        for event in &batch.events {
            let one = EventBatch {
                events: vec![event.clone()],
                ts: batch.ts,
                data_parallel_rank: batch.data_parallel_rank,
                skipped: batch.skipped,
            };
            ix.apply(&pod, seq, &one);
            match event {
                KvEvent::Stored(s) => {
                    let keys = ix.keys_of(&pod, &s.block_hashes);
                    let blocks: Vec<(u64, u64)> = s
                        .block_hashes
                        .iter()
                        .zip(&keys)
                        .map(|(h, k)| (h.0, k.expect("the service keyed it").0))
                        .collect();
                    let skipped = runs.store_keyed(
                        pod.id.0,
                        s.tier(),
                        s.parent_block_hash.map(|p| p.0),
                        &blocks,
                    );
                    assert_eq!(skipped, 0, "{stream}: a store the service took");
                }
                KvEvent::Removed(r) => {
                    let hashes: Vec<u64> = r.block_hashes.iter().map(|h| h.0).collect();
                    runs.remove(pod.id.0, r.tier(), &hashes);
                }
                KvEvent::AllCleared => runs.clear(pod.id.0),
            }
        }
    }
    (ix, runs, names)
}

/// The run layout's leading blocks for every probe and pod, in the order
/// `super::answers` lists the service's.
fn run_answers(
    ix: &Indexer,
    runs: &RunIndex,
    names: &HashMap<u32, String>,
    expected: &Value,
) -> Vec<u64> {
    let model = expected["meta"]["model"].as_str().unwrap();
    let mut out = Vec::new();
    for probe in expected["probes"].as_array().unwrap() {
        let (lora, salt) = (probe["lora_name"].as_str(), probe["cache_salt"].as_str());
        let keys: Vec<u64> = ix
            .request_keys(
                model,
                lora,
                salt,
                &probe_tokens(probe),
                ix.model_block_size(model),
            )
            .into_iter()
            .map(|k| k.0)
            .collect();
        let ours: HashMap<&str, u32> = runs
            .prefix_matches(&keys)
            .into_iter()
            .map(|m| (names[&m.pod].as_str(), m.blocks))
            .collect();
        for pod in probe["expected_cached_blocks"].as_object().unwrap().keys() {
            out.push(ours.get(pod.as_str()).copied().unwrap_or(0).into());
        }
    }
    out
}

#[test]
fn runs_answer_every_recorded_stream_as_vllm_and_the_service_do() {
    for stream in [
        "qwen3-sha256-int",
        "qwen3-sha256-int.array-v0.23",
        "qwen3-sha256-int.array-v0.11",
        "qwen3-sha256cbor-bytes",
        "qwen3-sha256cbor-bytes.array-v0.23",
        "qwen3-sha256cbor-bytes.array-v0.11",
        "qwen3-lora-salt",
    ] {
        let expected = expected(stream);
        let (ix, runs, names) = replay(stream);
        let service = answers(&ix, &expected);
        let got = run_answers(&ix, &runs, &names, &expected);
        assert_eq!(got.len(), service.len());
        assert!(got.len() >= expected["probes"].as_array().unwrap().len());
        let mut cached = 0;
        for ((what, service, vllm), ours) in service.iter().zip(&got) {
            assert_eq!(
                (ours, service),
                (vllm, vllm),
                "{stream}: {what} (runs, service)"
            );
            cached += vllm;
        }
        assert!(cached > 0, "{stream}: the probes find cached blocks");

        // Dumped and restored: the same answers.
        let restored = RunIndex::from_dump(runs.dump(), true)
            .expect("its own dump")
            .bounded();
        let again = run_answers(&ix, &restored, &names, &expected);
        for (((what, ..), ours), again) in service.iter().zip(&got).zip(again) {
            assert_eq!(*ours, again, "{stream}: {what} after a restore");
        }

        // Evicted down to half its entries, pods in turn: answers only
        // shorten, and each pod keeps a prefix of what it had.
        let pods: Vec<u32> = names.keys().copied().collect();
        let total: u64 = pods.iter().map(|p| runs.entries(*p)).sum();
        let mut left = total;
        while left > total / 2 {
            let round: u64 = pods
                .iter()
                .map(|&pod| runs.evict(pod, 64).len() as u64)
                .sum();
            assert!(
                round > 0,
                "{stream}: entries left ({left}) that nothing evicts"
            );
            left -= round;
        }
        let counted: u64 = pods.iter().map(|p| runs.entries(*p)).sum();
        assert_eq!(counted, left, "{stream}: entries counted as evicted");
        let after = run_answers(&ix, &runs, &names, &expected);
        for (((what, ..), before), after) in service.iter().zip(&got).zip(after) {
            assert!(after <= *before, "{stream}: {what} grew under eviction");
        }
        println!(
            "{stream}: {} probe/pod pairs, {cached} cached blocks, runs = service = vLLM; \
             {} distinct blocks, {total} entries",
            got.len(),
            restored.blocks(),
        );
    }
}

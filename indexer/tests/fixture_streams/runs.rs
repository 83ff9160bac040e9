//! The run layout (`indexer::index`) on every recorded vLLM stream: fed the
//! same batches the service's index applies, through `PodFeed` (the pod
//! rules without a per-block map), it counts them as the service does and
//! answers every probe with the blocks vLLM says each pod had cached, and
//! as the service's index does. Then it is evicted down, dumped and
//! restored, and still answers as it did.

use std::collections::HashMap;

use indexer::index::RunIndex;
use indexer::keys::engine_hash::{HashAlgo, DEFAULT_SEED};
use indexer::pod::{KeyedRuns, PodFeed};
use indexer::{Indexer, IndexerConfig};
use serde_json::Value;

use super::{answers, expected, frames, probe_tokens, Frame};

/// The service's index and the run layout (each pod fed by a `PodFeed`,
/// which keys the blocks itself), fed one stream under `config`, and each
/// pod's name by its id.
fn replay(stream: &str, config: IndexerConfig) -> (Indexer, KeyedRuns, HashMap<u32, String>) {
    let ix = Indexer::new(config);
    let runs = KeyedRuns::new(&ix.config().tier_weights, true);
    let mut feeds: HashMap<u32, PodFeed> = HashMap::new();
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
        let service = ix.apply(&pod, seq, &batch);
        let feed = feeds
            .entry(pod.id.0)
            .or_insert_with(|| PodFeed::new(pod.id.0, model.as_str()));
        let ours = feed.apply(&runs, &batch, ix.config().keys.for_model(&model));
        assert_eq!(ours, service, "{stream}: seq {seq} applied alike");
    }
    (ix, runs, names)
}

/// The run layout's leading blocks for every probe and pod, in the order
/// `super::answers` lists the service's.
fn run_answers(
    ix: &Indexer,
    runs: &KeyedRuns,
    names: &HashMap<u32, String>,
    expected: &Value,
) -> Vec<u64> {
    let model = expected["meta"]["model"].as_str().unwrap();
    let mode = ix.config().keys.for_model(model);
    let mut out = Vec::new();
    for probe in expected["probes"].as_array().unwrap() {
        let (lora, salt) = (probe["lora_name"].as_str(), probe["cache_salt"].as_str());
        let (keys, engine_keys) = mode.request_keys(
            model,
            lora,
            salt,
            &probe_tokens(probe),
            ix.model_block_size(model) as usize,
            &super::probe_mm(probe),
        );
        let keys: Vec<u64> = keys.into_iter().map(|k| k.0).collect();
        let ours: HashMap<&str, u32> = runs
            .for_request(engine_keys)
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

/// `pod`'s entries over both keyings.
fn entries(runs: &KeyedRuns, pod: u32) -> u64 {
    runs.engine.entries(pod) + runs.token.entries(pod)
}

#[test]
fn runs_answer_every_recorded_stream_as_vllm_and_the_service_do() {
    let token = IndexerConfig::default;
    let engine = |algo| super::engine_config(algo, DEFAULT_SEED, false);
    for (stream, config) in [
        ("qwen3-sha256-int", token()),
        ("qwen3-sha256-int.array-v0.23", token()),
        ("qwen3-sha256-int.array-v0.11", token()),
        ("qwen3-sha256cbor-bytes", token()),
        ("qwen3-sha256cbor-bytes.array-v0.23", token()),
        ("qwen3-sha256cbor-bytes.array-v0.11", token()),
        ("qwen3-lora-salt", token()),
        ("qwen3-sha256-int", engine(HashAlgo::Sha256)),
        ("qwen3-sha256-int.array-v0.23", engine(HashAlgo::Sha256)),
        ("qwen3-sha256-int.array-v0.11", engine(HashAlgo::Sha256)),
        ("qwen3-sha256cbor-bytes", engine(HashAlgo::Sha256Cbor)),
        (
            "qwen3-sha256cbor-bytes.array-v0.11",
            engine(HashAlgo::Sha256Cbor),
        ),
        // LoRA blocks are token keyed (no --lora-path), salted ones engine
        // keyed: both indexes in use.
        ("qwen3-lora-salt", engine(HashAlgo::Sha256)),
    ] {
        let mode = config.keys.for_model("").name();
        let expected = expected(stream);
        let (ix, runs, names) = replay(stream, config);
        let service = answers(&ix, &expected);
        let got = run_answers(&ix, &runs, &names, &expected);
        assert_eq!(got.len(), service.len());
        assert!(got.len() >= expected["probes"].as_array().unwrap().len());
        let mut cached = 0;
        for ((what, service, vllm), ours) in service.iter().zip(&got) {
            assert_eq!(
                (ours, service),
                (vllm, vllm),
                "{stream} ({mode} keys): {what} (runs, service)"
            );
            cached += vllm;
        }
        assert!(cached > 0, "{stream}: the probes find cached blocks");
        let (engine_blocks, token_blocks) = (runs.engine.blocks(), runs.token.blocks());
        if mode == "token" {
            assert_eq!(engine_blocks, 0, "{stream}: token keys only");
        } else if stream == "qwen3-lora-salt" {
            assert!(
                engine_blocks > 0 && token_blocks > 0,
                "{stream}: both keyings"
            );
        }

        // Dumped and restored: the same answers.
        let restored = KeyedRuns {
            engine: RunIndex::from_dump(runs.engine.dump(), false)
                .expect("its own dump")
                .bounded(),
            token: RunIndex::from_dump(runs.token.dump(), true)
                .expect("its own dump")
                .bounded(),
        };
        let again = run_answers(&ix, &restored, &names, &expected);
        for (((what, ..), ours), again) in service.iter().zip(&got).zip(again) {
            assert_eq!(
                *ours, again,
                "{stream} ({mode} keys): {what} after a restore"
            );
        }

        // Evicted down to half its entries, pods in turn: answers only
        // shorten, and each pod keeps a prefix of what it had.
        let pods: Vec<u32> = names.keys().copied().collect();
        let total: u64 = pods.iter().map(|p| entries(&runs, *p)).sum();
        let mut left = total;
        while left > total / 2 {
            let round: u64 = pods
                .iter()
                .map(|&pod| {
                    (runs.engine.evict(pod, 32).len() + runs.token.evict(pod, 32).len()) as u64
                })
                .sum();
            assert!(
                round > 0,
                "{stream}: entries left ({left}) that nothing evicts"
            );
            left -= round;
        }
        let counted: u64 = pods.iter().map(|p| entries(&runs, *p)).sum();
        assert_eq!(counted, left, "{stream}: entries counted as evicted");
        let after = run_answers(&ix, &runs, &names, &expected);
        for (((what, ..), before), after) in service.iter().zip(&got).zip(after) {
            assert!(after <= *before, "{stream}: {what} grew under eviction");
        }
        println!(
            "{stream} ({mode} keys): {} probe/pod pairs, {cached} cached blocks, \
             runs = service = vLLM; {engine_blocks} engine-keyed and {token_blocks} token-keyed \
             distinct blocks, {total} entries",
            got.len(),
        );
    }
}

//! Replays every recorded vLLM stream straight into the core (no sockets) and
//! checks every probe against the truth vLLM computed. The service-level
//! tests in the workspace root do the same over ZeroMQ and gRPC.

use std::collections::HashMap;
use std::path::PathBuf;

use base64::Engine;
use indexer::topic::parse_topic;
use indexer::wire::decode_batch;
use indexer::{Indexer, IndexerConfig, ScoreQuery};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm-events")
}

fn replay(stream: &str) -> Indexer {
    let ix = Indexer::new(IndexerConfig::default());
    let text = std::fs::read_to_string(fixtures().join(format!("{stream}.frames.jsonl"))).unwrap();
    for line in text.lines() {
        let frame: Value = serde_json::from_str(line).unwrap();
        let topic = parse_topic(frame["topic"].as_str().unwrap().as_bytes()).unwrap();
        let payload = base64::engine::general_purpose::STANDARD
            .decode(frame["payload_b64"].as_str().unwrap())
            .unwrap();
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(
            batch.skipped,
            Default::default(),
            "{stream}: skipped events"
        );
        let pod = ix.pod(topic.model, topic.pod, batch.data_parallel_rank);
        let stats = ix.apply(&pod, frame["seq"].as_u64().unwrap(), &batch);
        assert_eq!(stats.parent_unknown_blocks, 0, "{stream}");
        assert_eq!(stats.malformed_stores, 0, "{stream}");
    }
    ix
}

fn check(stream: &str) {
    let base = stream.split('.').next().unwrap();
    let expected: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(format!("{base}.expected.json"))).unwrap(),
    )
    .unwrap();
    let ix = replay(stream);
    let model = expected["meta"]["model"].as_str().unwrap();
    let probes = expected["probes"].as_array().unwrap();
    assert!(!probes.is_empty());
    let mut checked = 0;
    for probe in probes {
        let tokens: Vec<u32> = probe["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let out = ix.score(&ScoreQuery {
            model,
            tokens: &tokens,
            lora_name: probe["lora_name"].as_str(),
            cache_salt: probe["cache_salt"].as_str(),
            pods: &[],
        });
        let got: HashMap<&str, u32> = out
            .pods
            .iter()
            .map(|p| (p.pod.as_str(), p.matched.matched_blocks))
            .collect();
        for (pod, want) in probe["expected_cached_blocks"].as_object().unwrap() {
            assert_eq!(
                got.get(pod.as_str()).copied().unwrap_or(0) as u64,
                want.as_u64().unwrap(),
                "{stream}: probe {} pod {pod}",
                probe["id"]
            );
            checked += 1;
        }
    }
    assert!(checked >= probes.len());
}

#[test]
fn sha256_int_stream_map_form() {
    check("qwen3-sha256-int");
}

#[test]
fn sha256_int_stream_array_v0_23() {
    check("qwen3-sha256-int.array-v0.23");
}

#[test]
fn sha256_int_stream_array_v0_11() {
    check("qwen3-sha256-int.array-v0.11");
}

#[test]
fn sha256cbor_bytes_stream_map_form() {
    check("qwen3-sha256cbor-bytes");
}

#[test]
fn sha256cbor_bytes_stream_array_v0_23() {
    check("qwen3-sha256cbor-bytes.array-v0.23");
}

#[test]
fn sha256cbor_bytes_stream_array_v0_11() {
    check("qwen3-sha256cbor-bytes.array-v0.11");
}

#[test]
fn lora_and_salt_stream() {
    check("qwen3-lora-salt");
}

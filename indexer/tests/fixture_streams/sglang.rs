//! SGLang's recorded streams (`tests/fixtures/sglang-events`, from SGLang
//! 0.5.23's own trees, event recorder and publisher) straight into the
//! core: every probe's matched tokens per pod against what SGLang's
//! `match_prefix` answered. The pods publish no topic; each frame names
//! its pod (as a dial target's `pod=` does in the service).

use std::collections::HashMap;
use std::path::PathBuf;

use base64::Engine;
use indexer::event::Engine as PodEngine;
use indexer::keys::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo};
use indexer::keys::scheme::KeySchemes;
use indexer::wire::decode_batch;
use indexer::{Indexer, IndexerConfig, ScoreQuery};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/sglang-events")
}

fn read(name: &str) -> String {
    std::fs::read_to_string(fixtures().join(name)).unwrap()
}

/// A recorded pod key (`pod-0`, or `pod-0/dp1` for an attention-DP rank)
/// as the index names that cache domain.
fn domain(key: &str) -> String {
    match key.split_once("/dp") {
        Some((pod, rank)) => indexer::pod_id(pod, Some(rank.parse().unwrap())),
        None => key.to_owned(),
    }
}

/// Which keys a replay uses.
#[derive(Clone, Copy, PartialEq)]
enum Keys {
    Token,
    /// SGLang's own hashes (`--key-mode engine --engine-hash-algo sglang`
    /// or `sglang_dynamo`, as the stream's format), its adapters' paths
    /// given.
    Engine,
}

fn config(keys: Keys, expected: &Value) -> IndexerConfig {
    if keys == Keys::Token {
        return IndexerConfig::default();
    }
    let algo = match expected["meta"]["hash_format"].as_str().unwrap() {
        "dynamo" => HashAlgo::SglangDynamo,
        _ => HashAlgo::Sglang,
    };
    let mut schemes =
        KeySchemes::engine(EngineHasher::new(algo, "", ExtraKeyStyle::Tagged), false, 1);
    if let indexer::keys::scheme::KeyMode::Engine(e) = &mut schemes.default {
        for (name, path) in expected["meta"]["lora_paths"]
            .as_object()
            .into_iter()
            .flatten()
        {
            e.lora_paths
                .insert(name.clone(), path.as_str().unwrap().to_owned());
        }
    }
    IndexerConfig {
        keys: schemes,
        ..Default::default()
    }
}

/// Replays `stream` into a fresh index; (index, expected answers).
fn replay(stream: &str, keys: Keys) -> (Indexer, Value) {
    let expected: Value = serde_json::from_str(&read(&format!("{stream}.expected.json"))).unwrap();
    let model = expected["meta"]["model"].as_str().unwrap().to_owned();
    let ix = Indexer::new(config(keys, &expected));
    let mut checks = 0;
    for line in read(&format!("{stream}.frames.jsonl")).lines() {
        let frame: Value = serde_json::from_str(line).unwrap();
        assert_eq!(frame["topic"], "", "SGLang publishes no topic by default");
        let payload = base64::engine::general_purpose::STANDARD
            .decode(frame["payload_b64"].as_str().unwrap())
            .unwrap();
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(
            batch.skipped,
            Default::default(),
            "{stream}: skipped events"
        );
        let pod = ix.pod(
            &model,
            frame["pod"].as_str().unwrap(),
            batch.data_parallel_rank,
        );
        let stats = ix.apply(&pod, frame["seq"].as_u64().unwrap(), &batch);
        assert_eq!(stats.malformed_stores, 0, "{stream}");
        assert_eq!(stats.parent_unknown_blocks, 0, "{stream}");
        assert_eq!(
            stats.engine_hash_mismatches, 0,
            "{stream}: our hashes differ"
        );
        checks += stats.engine_hash_checks;
    }
    // SGLang's dynamo format hashes extra keys its events do not name:
    // its stores are never self-checked.
    let dynamo = expected["meta"]["hash_format"] == "dynamo";
    assert!(
        keys == Keys::Token || dynamo || checks > 0,
        "{stream}: nothing self-checked"
    );
    (ix, expected)
}

/// Every (probe, pod) whose matched tokens differ from SGLang's, and how
/// many were compared.
fn misses(stream: &str, keys: Keys) -> (Vec<String>, usize) {
    let (ix, expected) = replay(stream, keys);
    misses_in(stream, &ix, &expected, keys)
}

/// `misses` of an index that holds `stream`.
fn misses_in(stream: &str, ix: &Indexer, expected: &Value, keys: Keys) -> (Vec<String>, usize) {
    let dynamo = expected["meta"]["hash_format"] == "dynamo";
    let model = expected["meta"]["model"].as_str().unwrap();
    let page = expected["meta"]["page_size"].as_u64().unwrap() as u32;
    for p in ix.list_pods(Some(model)) {
        assert_eq!(p.engine, PodEngine::Sglang.name(), "{stream}: {}", p.pod);
        assert!(
            p.block_size == page || p.blocks_per_tier == [0; 3],
            "{stream}: {}",
            p.pod
        );
    }
    let (mut wrong, mut compared) = (Vec::new(), 0);
    for probe in expected["probes"].as_array().unwrap() {
        // SGLang's dynamo format namespaces a bare extra key's stores:
        // engine keys keep them apart (a request naming one is still out
        // of reach: the API has no extra key).
        let apart = keys == Keys::Engine && dynamo && probe["extra_key"].is_null();
        if bare_extra_key(probe) && !apart {
            continue;
        }
        let scored = score_probe(ix, model, probe);
        let got: HashMap<&str, u32> = scored
            .pods
            .iter()
            .map(|p| (p.pod.as_str(), p.matched.matched_blocks * p.block_size))
            .collect();
        // Of those, the device's: SGLang's device prefix (its host tier
        // holds only what follows it).
        let on_gpu: HashMap<&str, u32> = scored
            .pods
            .iter()
            .map(|p| (p.pod.as_str(), p.matched.blocks_per_tier[0] * p.block_size))
            .collect();
        for (key, want) in probe["expected_cached_tokens"].as_object().unwrap() {
            compared += 1;
            let got = got.get(domain(key).as_str()).copied().unwrap_or(0);
            // HiCache: the device prefix, then what the host tier holds
            // past it; Score counts leading blocks on any tier.
            let host = probe["expected_host_cached_tokens"][key]
                .as_u64()
                .unwrap_or(0);
            let device = want.as_u64().unwrap();
            let gpu = on_gpu.get(domain(key).as_str()).copied().unwrap_or(0);
            if u64::from(gpu) != device {
                wrong.push(format!(
                    "{}: {key} {gpu} tokens on GPU, SGLang {device}",
                    probe["id"]
                ));
            }
            let want = device + host;
            if u64::from(got) != want {
                wrong.push(format!(
                    "{}: {key} got {got} tokens, SGLang {want}",
                    probe["id"]
                ));
            }
        }
    }
    (wrong, compared)
}

/// `Score` of a recorded probe: its token ids, adapter and cache salt.
fn score_probe(ix: &Indexer, model: &str, probe: &Value) -> indexer::ScoreOutcome {
    let tokens: Vec<u32> = probe["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    ix.score(&ScoreQuery {
        model,
        tokens: &tokens,
        lora_name: probe["lora_name"].as_str(),
        cache_salt: probe["cache_salt"].as_str(),
        mm_items: &[],
        pods: &[],
    })
}

/// A probe sent under a bare `extra_key` (not a LoRA's), or of a prompt
/// stored under one (ids `req<N>:<lora>:<salt>:<extra key>:...`): SGLang
/// keys its tree by it, but its events name it nowhere and (in its own
/// hash format) hash alike, so no reader of the events can tell such a
/// store from one without it. Token keys answer as if there were none.
fn bare_extra_key(probe: &Value) -> bool {
    let id = probe["id"].as_str().unwrap();
    !probe["extra_key"].is_null() || id.split(':').nth(3).is_some_and(|e| e != "-")
}

fn check(stream: &str) {
    for keys in [Keys::Token, Keys::Engine] {
        let (wrong, compared) = misses(stream, keys);
        let mode = if keys == Keys::Token {
            "token keys"
        } else {
            "engine keys"
        };
        assert!(compared >= 40, "{stream}, {mode}: {compared} answers");
        assert!(
            wrong.is_empty(),
            "{stream}, {mode}: {} of {compared} differ:\n{}",
            wrong.len(),
            wrong.join("\n")
        );
    }
}

#[test]
fn page_size_1() {
    check("sglang-page1");
}

/// At page size 1 a prompt's pages are its tokens, and SGLang's events
/// name every one; a Score still looks up runs, not pages: one probe of
/// the run heads per run it crosses. Over the stream's probes the table is
/// probed far fewer times than the pages matched (a probe per page would
/// make the two equal).
#[test]
fn page_size_1_is_scored_by_runs_not_pages() {
    let (ix, expected) = replay("sglang-page1", Keys::Token);
    let model = expected["meta"]["model"].as_str().unwrap();
    let (mut probes, mut matched, mut scores) = (0, 0u64, 0);
    for probe in expected["probes"].as_array().unwrap() {
        let before = indexer::index::head_probes();
        let scored = score_probe(&ix, model, probe);
        probes += indexer::index::head_probes() - before;
        matched += scored
            .pods
            .iter()
            .map(|p| u64::from(p.matched.matched_blocks))
            .max()
            .unwrap_or(0);
        scores += 1;
    }
    println!("{scores} scores: {matched} pages matched (deepest pod), {probes} head probes");
    assert!(matched > 10 * scores, "the probes match little: {matched}");
    assert!(probes > 0, "nothing counted");
    assert!(
        probes * 10 < matched,
        "{probes} head probes for {matched} matched pages"
    );
}

#[test]
fn page_size_16() {
    check("sglang-page16");
}

#[test]
fn page_size_64() {
    check("sglang-page64");
}

#[test]
fn radix_cache_page_size_16() {
    check("sglang-radixcache-page16");
}

#[test]
fn lora_and_cache_salt() {
    check("sglang-lora-salt");
}

#[test]
fn dynamo_format() {
    check("sglang-dynamo");
}

#[test]
fn hicache_tiers() {
    check("sglang-hicache");
}

#[test]
fn eviction_heavy_page_size_1() {
    check("sglang-evict-page1");
}

#[test]
fn eviction_heavy_page_size_16() {
    check("sglang-evict-page16");
}

#[test]
fn a_pod_restart() {
    check("sglang-restart");
}

/// EAGLE speculative decoding: pages of bigrams, `token_ids` as pairs.
#[test]
fn eagle_bigram_pages() {
    check("sglang-eagle");
}

/// A snapshot keeps what a pod's pages are: a restored EAGLE pod is still
/// scored by the prompt's bigrams.
#[test]
fn eagle_pods_survive_a_snapshot() {
    let (ix, expected) = replay("sglang-eagle", Keys::Token);
    let file = ix.export(Vec::new()).unwrap();
    let restored = Indexer::new(config(Keys::Token, &expected));
    assert_eq!(restored.import(std::io::Cursor::new(file)).unwrap(), 2);
    let (wrong, compared) = misses_in("sglang-eagle", &restored, &expected, Keys::Token);
    assert!(compared >= 40 && wrong.is_empty(), "{compared}: {wrong:?}");
}

#[test]
fn attention_dp_ranks() {
    check("sglang-dp-attention");
}

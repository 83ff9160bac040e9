//! Replays every recorded vLLM stream straight into the core (no sockets) and
//! checks every probe against the truth vLLM computed. The service-level
//! tests in the workspace root do the same over ZeroMQ and gRPC.

use std::collections::HashMap;
use std::path::PathBuf;

use base64::Engine;
use indexer::event::EventBatch;
use indexer::keys::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo, DEFAULT_SEED};
use indexer::keys::scheme::KeySchemes;
use indexer::topic::parse_topic;
use indexer::wire::decode_batch;
use indexer::{Indexer, IndexerConfig, ScoreQuery};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm-events")
}

fn engine_config(algo: HashAlgo, seed: &str, closed: bool) -> IndexerConfig {
    IndexerConfig {
        keys: KeySchemes::engine(
            EngineHasher::new(algo, seed, ExtraKeyStyle::Tagged),
            closed,
            1,
        ),
        ..Default::default()
    }
}

/// One recorded message: its topic's model and pod, its seq, its batch.
pub struct Frame {
    pub model: String,
    pub pod: String,
    pub seq: u64,
    pub batch: EventBatch,
}

/// A stream's messages, decoded.
pub fn frames(stream: &str) -> Vec<Frame> {
    let text = std::fs::read_to_string(fixtures().join(format!("{stream}.frames.jsonl"))).unwrap();
    text.lines()
        .map(|line| {
            let frame: Value = serde_json::from_str(line).unwrap();
            let topic = parse_topic(frame["topic"].as_str().unwrap().as_bytes()).unwrap();
            let payload = base64::engine::general_purpose::STANDARD
                .decode(frame["payload_b64"].as_str().unwrap())
                .unwrap();
            Frame {
                model: topic.model.to_owned(),
                pod: topic.pod.to_owned(),
                seq: frame["seq"].as_u64().unwrap(),
                batch: decode_batch(&payload).unwrap(),
            }
        })
        .collect()
}

/// Applies a stream, minus its first `skip` messages (an indexer that
/// started late).
fn replay_with(stream: &str, config: IndexerConfig, skip: usize) -> Indexer {
    let ix = Indexer::new(config);
    for Frame {
        model,
        pod,
        seq,
        batch,
    } in frames(stream).into_iter().skip(skip)
    {
        assert_eq!(
            batch.skipped,
            Default::default(),
            "{stream}: skipped events"
        );
        let pod = ix.pod(&model, &pod, batch.data_parallel_rank);
        let stats = ix.apply(&pod, seq, &batch);
        if skip == 0 {
            assert_eq!(stats.parent_unknown_blocks, 0, "{stream}");
        }
        assert_eq!(stats.malformed_stores, 0, "{stream}");
        assert_eq!(stats.engine_hash_mismatches, 0, "{stream}");
    }
    ix
}

fn expected(stream: &str) -> Value {
    let base = stream.split('.').next().unwrap();
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(format!("{base}.expected.json"))).unwrap(),
    )
    .unwrap()
}

/// A probe's prompt.
fn probe_tokens(probe: &Value) -> Vec<u32> {
    probe["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// A probe's multimodal items (recorded with the requests' `mm_features`),
/// in prompt order.
fn probe_mm(probe: &Value) -> Vec<indexer::keys::multimodal::MmItem> {
    let items = probe["mm_items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|i| indexer::keys::multimodal::MmItem {
                    identifier: i["identifier"].as_str().unwrap().to_owned(),
                    offset: i["offset"].as_u64().unwrap() as u32,
                    length: i["length"].as_u64().unwrap() as u32,
                })
                .collect()
        })
        .unwrap_or_default();
    indexer::keys::multimodal::sorted_items(items, probe_tokens(probe).len()).unwrap()
}

/// (got, want) for every probe and pod.
fn answers(ix: &Indexer, expected: &Value) -> Vec<(String, u64, u64)> {
    let model = expected["meta"]["model"].as_str().unwrap();
    let mut out = Vec::new();
    for probe in expected["probes"].as_array().unwrap() {
        let tokens = probe_tokens(probe);
        let mm = probe_mm(probe);
        let scored = ix.score(&ScoreQuery {
            model,
            tokens: &tokens,
            lora_name: probe["lora_name"].as_str(),
            cache_salt: probe["cache_salt"].as_str(),
            mm_items: &mm,
            pods: &[],
        });
        let got: HashMap<&str, u32> = scored
            .pods
            .iter()
            .map(|p| (p.pod.as_str(), p.matched.matched_blocks))
            .collect();
        for (pod, want) in probe["expected_cached_blocks"].as_object().unwrap() {
            out.push((
                format!("probe {} pod {pod}", probe["id"]),
                got.get(pod.as_str()).copied().unwrap_or(0) as u64,
                want.as_u64().unwrap(),
            ));
        }
    }
    out
}

fn check(stream: &str) {
    check_with(stream, IndexerConfig::default());
}

fn check_with(stream: &str, config: IndexerConfig) {
    let expected = expected(stream);
    let ix = replay_with(stream, config, 0);
    let answers = answers(&ix, &expected);
    assert!(answers.len() >= expected["probes"].as_array().unwrap().len());
    for (what, got, want) in answers {
        assert_eq!(got, want, "{stream}: {what}");
    }
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

/// Requests with images (vLLM's `mm_features`), with and without LoRA and
/// a cache salt: every probe, with its items, scores what vLLM holds; the
/// same token ids without the items, or with another image, match only up
/// to the first block an image touches.
#[test]
fn multimodal_stream() {
    check("qwen3-multimodal");
}

#[test]
fn engine_mode_full_replays_match_vllm_exactly() {
    for (stream, algo) in [
        ("qwen3-sha256-int", HashAlgo::Sha256),
        ("qwen3-sha256-int.array-v0.23", HashAlgo::Sha256),
        ("qwen3-sha256-int.array-v0.11", HashAlgo::Sha256),
        ("qwen3-sha256cbor-bytes", HashAlgo::Sha256Cbor),
        ("qwen3-sha256cbor-bytes.array-v0.11", HashAlgo::Sha256Cbor),
        // LoRA blocks fall back to token keys (no --lora-path), salted ones
        // use engine keys.
        ("qwen3-lora-salt", HashAlgo::Sha256),
    ] {
        for closed in [false, true] {
            check_with(stream, engine_config(algo, DEFAULT_SEED, closed));
        }
        // The self-check ran and agreed.
        let ix = replay_with(stream, engine_config(algo, DEFAULT_SEED, true), 0);
        let checks: u64 = ix
            .list_pods(None)
            .iter()
            .map(|p| p.applied.engine_hash_checks)
            .sum();
        // vLLM 0.11's form has no extra keys: nothing is safely checkable.
        assert_eq!(checks > 0, !stream.ends_with("v0.11"), "{stream}");
    }
    // Prompts with images: their blocks' engine hashes, `("mm", ...)` keys
    // pickled as vLLM does, salted ones included (LoRA ones fall back to
    // token keys, as above).
    for closed in [false, true] {
        check_with(
            "qwen3-multimodal",
            engine_config(HashAlgo::Sha256, DEFAULT_SEED, closed),
        );
    }
}

#[test]
fn engine_mode_self_check_flags_a_wrong_seed() {
    let ix = Indexer::new(engine_config(HashAlgo::Sha256, "not-the-pods-seed", true));
    for f in frames("qwen3-sha256-int").into_iter().take(50) {
        let pod = ix.pod(&f.model, &f.pod, f.batch.data_parallel_rank);
        ix.apply(&pod, f.seq, &f.batch);
    }
    let mismatches: u64 = ix
        .list_pods(None)
        .iter()
        .map(|p| p.applied.engine_hash_mismatches)
        .sum();
    assert!(mismatches > 0);
}

/// An indexer that joins late (the first third, half or two thirds of a
/// stream dropped): answers never exceed the truth, and each rule recovers
/// exactly the cached blocks it did when these fixtures were recorded.
///
/// Why the figures are what they are (the fixtures are fixed, so they are
/// exact): both streams churn their caches, so what the probes at the end
/// find cached was mostly stored late. Dropping the first third loses
/// nothing a probe asks for: every rule recovers all of it, in both
/// streams. sha256cbor-bytes stored everything its probes find in its last
/// third, so it stays at 100% however deep the cut. In sha256-int, cuts at
/// one half and two thirds drop the stores of some blocks that are still
/// cached at the end (123 and 247 of 5,336 probed blocks): token keys cannot
/// key a block stored under an unseen parent and the engine first-miss walk
/// stops at the first unseen block, so those two recover the same; the
/// prefix-closure rule counts unseen leading blocks once a later block of
/// the prompt is held, so it gets 16 and 27 of them back. A change in these
/// numbers is a change in what a late indexer answers: look at why, then
/// update the table.
#[test]
fn engine_mode_late_start_never_overclaims_and_closure_recovers_more() {
    // (stream, hash, [(batches dropped of 6ths, truth, token, first-miss,
    // closure)]): blocks recovered, summed over every probe and pod.
    let table = [
        (
            "qwen3-sha256-int",
            HashAlgo::Sha256,
            [
                (2, 5336, 5336, 5336, 5336),
                (3, 5336, 5213, 5213, 5229),
                (4, 5336, 5089, 5089, 5116),
            ],
        ),
        (
            "qwen3-sha256cbor-bytes",
            HashAlgo::Sha256Cbor,
            [
                (2, 4619, 4619, 4619, 4619),
                (3, 4619, 4619, 4619, 4619),
                (4, 4619, 4619, 4619, 4619),
            ],
        ),
    ];
    for (stream, algo, cases) in table {
        let expected = expected(stream);
        let total = std::fs::read_to_string(fixtures().join(format!("{stream}.frames.jsonl")))
            .unwrap()
            .lines()
            .count();
        let run = |config, skip| answers(&replay_with(stream, config, skip), &expected);
        for (sixths, want_truth, want_token, want_walk, want_closed) in cases {
            let skip = total * sixths / 6;
            let token = run(IndexerConfig::default(), skip);
            let walk = run(engine_config(algo, DEFAULT_SEED, false), skip);
            let closed = run(engine_config(algo, DEFAULT_SEED, true), skip);
            let truth: u64 = closed.iter().map(|a| a.2).sum();
            let sum = |a: &[(String, u64, u64)]| a.iter().map(|a| a.1).sum::<u64>();
            for ((w, c), t) in walk.iter().zip(&closed).zip(&token) {
                assert!(
                    w.1 <= w.2,
                    "{stream}: first-miss overclaims {}: {} > {}",
                    w.0,
                    w.1,
                    w.2
                );
                assert!(
                    c.1 <= c.2,
                    "{stream}: closure overclaims {}: {} > {}",
                    c.0,
                    c.1,
                    c.2
                );
                assert!(t.1 <= t.2, "{stream}: token mode overclaims {}", t.0);
                assert!(c.1 >= w.1, "{stream}: closure lost blocks {}", c.0);
            }
            let pct = |n: u64| 100.0 * n as f64 / truth as f64;
            println!(
                "{stream}: late start (first {skip} of {total} batches dropped), {} probe/pod pairs, \
                 {truth} cached blocks: token keys recover {} ({:.1}%), engine first-miss {} ({:.1}%), \
                 engine + prefix closure {} ({:.1}%)",
                closed.len(),
                sum(&token),
                pct(sum(&token)),
                sum(&walk),
                pct(sum(&walk)),
                sum(&closed),
                pct(sum(&closed)),
            );
            assert_eq!(
                (truth, sum(&token), sum(&walk), sum(&closed)),
                (want_truth, want_token, want_walk, want_closed),
                "{stream}, first {sixths}/6 dropped: (truth, token, first-miss, closure)"
            );
        }
    }
}

/// The run layout on the same streams.
mod runs;
mod sglang;

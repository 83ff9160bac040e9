//! Decoding a Score request with 32K token ids (~95 KB of packed varints):
//! the service's hand-written `TokenIds` against what prost generates for
//! the same message. `cargo bench --bench decode` prints medians of
//! repeated runs, both measured in the same run.

#[path = "../indexer/benches/common/measure.rs"]
mod measure;

use std::hint::black_box;
use std::time::Duration;

use kv_indexer::proto::kvindexer::v1 as pb;
use measure::measure;
use prost::Message;

/// `ScoreRequest` with just the fields used here, as prost generates it.
#[derive(Clone, PartialEq, prost::Message)]
struct GeneratedRequest {
    #[prost(string, tag = "1")]
    model: String,
    #[prost(message, optional, tag = "3")]
    token_ids: Option<GeneratedIds>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct GeneratedIds {
    #[prost(uint32, repeated, tag = "1")]
    ids: Vec<u32>,
}

fn main() {
    // `cargo test --all-targets` runs benches without `--bench`: keep that short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let budget = Duration::from_millis(if quick { 200 } else { 2000 });
    // Random ids of a 150K vocabulary: 1 to 3 bytes each, as real prompts.
    let mut x = 42u64;
    let ids: Vec<u32> = (0..32_768)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 33) % 150_000) as u32
        })
        .collect();
    let request = pb::ScoreRequest {
        model: "Qwen/Qwen3-8B".into(),
        input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
            ids: ids.clone(),
        })),
        ..Default::default()
    };
    let bytes = request.encode_to_vec();
    // Same bytes, same answer.
    let generated = GeneratedRequest::decode(&bytes[..]).expect("decodes");
    assert_eq!(generated.token_ids.map(|t| t.ids), Some(ids));
    assert_eq!(
        pb::ScoreRequest::decode(&bytes[..]).expect("decodes"),
        request
    );

    let (ours, _) = measure(budget, || {
        black_box(pb::ScoreRequest::decode(black_box(&bytes[..])).expect("decodes"));
    });
    let (prost, _) = measure(budget, || {
        black_box(GeneratedRequest::decode(black_box(&bytes[..])).expect("decodes"));
    });
    println!(
        "ScoreRequest with 32768 token ids ({} bytes), median per decode",
        bytes.len()
    );
    for (name, t) in [
        ("ours (TokenIds by hand)", ours),
        ("prost generated", prost),
    ] {
        println!(
            "  {name:<26} {:>8.1} us  {:>5.2} ns/token",
            t.as_secs_f64() * 1e6,
            t.as_secs_f64() * 1e9 / 32_768.0
        );
    }
    println!(
        "  ours / prost: {:.2}x",
        ours.as_secs_f64() / prost.as_secs_f64()
    );
}

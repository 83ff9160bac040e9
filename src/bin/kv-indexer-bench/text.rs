//! The `text` part: Score with prompts as text through the service's
//! tokenizer, cold (every prompt new) and warm-prefix (a shared prefix, a
//! new suffix).

use std::time::Instant;

use pb::kv_indexer_client::KvIndexerClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

use super::{lcg, pb, percentile, TEXT_MODEL};

const WORDS: &[&str] = &[
    "the",
    "cache",
    "of",
    "a",
    "model",
    "routing",
    "request",
    "prefix",
    "block",
    "token",
    "pod",
    "latency",
    "memory",
    "events",
    "index",
    "score",
    "prompt",
    "system",
    "user",
    "assistant",
    "document",
    "question",
    "answer",
    "throughput",
    "cluster",
    "gateway",
    "kernel",
    "attention",
    "layer",
    "vector",
    "batch",
    "queue",
    "replica",
    "inference",
    "deploy",
    "metric",
    "graph",
    "network",
    "storage",
    "compute",
    "policy",
    "schedule",
];

fn text(seed: u64, words: usize) -> String {
    let mut x = seed;
    let mut s = String::with_capacity(words * 8);
    for i in 0..words {
        if i > 0 {
            s.push(if i % 17 == 0 { '\n' } else { ' ' });
        }
        s.push_str(WORDS[(lcg(&mut x) % WORDS.len() as u64) as usize]);
        if i % 11 == 10 {
            s.push_str(&format!(" {}", lcg(&mut x) % 10_000));
        }
    }
    s
}

pub(crate) async fn score_text(client: &mut KvIndexerClient<Channel>, quick: bool) -> Value {
    let tokenize = |c: &mut KvIndexerClient<Channel>, prompt: String| {
        let mut c = c.clone();
        async move {
            c.tokenize(pb::TokenizeRequest {
                model: TEXT_MODEL.into(),
                input: Some(pb::tokenize_request::Input::Prompt(prompt)),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().token_ids.len())
        }
    };
    // Words per target size, measured with the real tokenizer.
    let probe = match tokenize(client, text(1, 1000)).await {
        Ok(n) => n as f64 / 1000.0,
        Err(e) => {
            println!("\nScore, text: skipped ({})", e.message());
            return json!({"skipped": e.message()});
        }
    };
    let n = if quick { 8 } else { 30 };
    println!("\nScore, text (Qwen3 tokenizer in-process), sequential requests");
    println!(
        "{:>8} {:>8} {:>12} {:>10} {:>10}",
        "tokens", "prefix", "requests", "p50 us", "p99 us"
    );
    let mut rows = Vec::new();
    for target in [8192usize, 32768] {
        let words = (target as f64 / probe) as usize;
        let shared = text(7 + target as u64, words * 9 / 10);
        for warm in [false, true] {
            if warm {
                // The shared prefix once, untimed: what the warm requests reuse.
                let _ = client
                    .score(pb::ScoreRequest {
                        model: TEXT_MODEL.into(),
                        input: Some(pb::score_request::Input::Prompt(shared.clone())),
                        ..Default::default()
                    })
                    .await;
            }
            let mut lat = Vec::new();
            let mut tokens = 0;
            for i in 0..n {
                let prompt = if warm {
                    format!("{shared} {}", text(1000 + i as u64, words / 10))
                } else {
                    text(50_000 + target as u64 * 1000 + i as u64, words)
                };
                let t = Instant::now();
                let r = client
                    .score(pb::ScoreRequest {
                        model: TEXT_MODEL.into(),
                        input: Some(pb::score_request::Input::Prompt(prompt)),
                        ..Default::default()
                    })
                    .await
                    .expect("Score text")
                    .into_inner();
                lat.push(t.elapsed());
                tokens = r.prompt_tokens;
            }
            lat.sort_unstable();
            let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
            let kind = if warm { "warm" } else { "cold" };
            println!("{tokens:>8} {kind:>8} {n:>12} {p50:>10.0} {p99:>10.0}");
            rows.push(json!({"target_tokens": target, "prompt_tokens": tokens,
                "prefix": kind, "requests": n, "p50_us": p50, "p99_us": p99}));
        }
    }
    Value::Array(rows)
}

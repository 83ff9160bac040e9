//! Tokenization with the Qwen3 tokenizer: our cached path against raw
//! `tokenizers` encode. `cargo bench -p tokenizer --bench tokenize`
//! (`-- --quick` for a short run) prints medians (p90).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokenizer::chat::{ChatRequest, RenderBounds};
use tokenizer::load::{locate, Sources};
use tokenizer::ModelTokenizer;

/// The service's default `--max-prompt`.
const BOUNDS: RenderBounds = RenderBounds {
    max_output_bytes: 8 << 20,
    deadline: None,
};

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "that",
    "for",
    "on",
    "are",
    "with",
    "cache",
    "router",
    "prefix",
    "block",
    "token",
    "model",
    "request",
    "latency",
    "memory",
    "GPU",
    "pod",
    "server",
    "index",
    "event",
    "stream",
    "batch",
    "score",
    "match",
    "prompt",
    "chat",
    "turn",
    "document",
    "question",
    "answer",
    "policy",
    "cluster",
    "replica",
    "network",
    "throughput",
];

/// Deterministic prose: words, numbers, punctuation, paragraphs.
fn prose(seed: u64, words: usize) -> String {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        let r = next();
        if i > 0 {
            out.push_str(if r % 97 == 0 { "\n\n" } else { " " });
        }
        if r % 23 == 0 {
            out.push_str(&(r % 100_000).to_string());
        } else {
            out.push_str(WORDS[(r as usize / 7) % WORDS.len()]);
        }
        if r % 13 == 0 {
            out.push(['.', ',', ';', '?'][(r as usize / 3) % 4]);
        }
    }
    out
}

fn load(cache_bytes: usize) -> ModelTokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers/qwen3");
    let mut sources = Sources::default();
    sources.explicit.insert("qwen3".into(), dir);
    let files = locate("qwen3", &sources).expect("files");
    ModelTokenizer::load("qwen3", &files, cache_bytes).expect("load")
}

/// Median and p90 of `f` over about `budget`, each call given a fresh index.
fn measure(budget: Duration, mut f: impl FnMut(usize)) -> (Duration, Duration) {
    f(0);
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || samples.len() < 7 {
        let t = Instant::now();
        f(samples.len() + 1);
        samples.push(t.elapsed());
    }
    samples.sort();
    (samples[samples.len() / 2], samples[samples.len() * 9 / 10])
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    // `cargo test --all-targets` runs benches without `--bench`: keep that short.
    let quick = std::env::args().any(|a| a == "--quick" || a == "--test")
        || !std::env::args().any(|a| a == "--bench");
    let budget = Duration::from_millis(if quick { 400 } else { 3000 });
    let cold = load(0); // a zero-byte cache never hits: every call is cold
    let warm = load(256 << 20);

    println!("Qwen3 tokenizer; median (p90) per call");
    for target in [8_192usize, 32_768] {
        // Calibrate the word count to the token target.
        let probe = prose(1, target);
        let per_word = cold.encode_uncached(&probe, true).unwrap().len() as f64 / target as f64;
        let words = (target as f64 / per_word) as usize;
        let texts: Vec<String> = (0..16).map(|s| prose(s + 10, words)).collect();
        let tokens = cold.encode_uncached(&texts[0], true).unwrap().len();

        let (raw, raw90) = measure(budget, |i| {
            black_box(cold.encode_uncached(&texts[i % texts.len()], true).unwrap());
        });
        let (ours, ours90) = measure(budget, |i| {
            black_box(cold.encode(&texts[i % texts.len()], true).unwrap());
        });
        println!(
            "  cold {tokens:>6} tokens: raw tokenizers {:>7.2} ms ({:.2}), ours {:>7.2} ms ({:.2}): overhead {:+.1}%",
            ms(raw),
            ms(raw90),
            ms(ours),
            ms(ours90),
            100.0 * (ours.as_secs_f64() / raw.as_secs_f64() - 1.0)
        );

        if target == 32_768 {
            // Multi-turn: a cached 32K prefix plus ~1K new tokens each turn.
            let prefix = &texts[0];
            warm.encode(prefix, true).unwrap();
            let new_words = (1024.0 / per_word) as usize;
            let turns: Vec<String> = (0..64)
                .map(|s| format!("{prefix}\n\nUser: {}", prose(1000 + s, new_words)))
                .collect();
            let new_tokens = cold.encode_uncached(&turns[0], true).unwrap().len() - tokens;
            let (w, w90) = measure(budget, |i| {
                // A turn not seen before: only its tail is tokenized.
                black_box(warm.encode(&turns[i % turns.len()], true).unwrap());
            });
            let (full, _) = measure(budget / 2, |i| {
                black_box(cold.encode_uncached(&turns[i % turns.len()], true).unwrap());
            });
            println!(
                "  warm +{new_tokens} tokens on a cached {tokens}-token prefix: {:>6.2} ms ({:.2}) = {:.1}% of cold ({:.2} ms)",
                ms(w),
                ms(w90),
                100.0 * w.as_secs_f64() / full.as_secs_f64(),
                ms(full)
            );
        }
    }

    // Chat: a long multi-turn conversation rendered with Qwen3's template.
    let mut messages = vec![serde_json::json!({"role": "system", "content": "You are helpful."})];
    for i in 0..24 {
        messages.push(serde_json::json!({"role": "user", "content": prose(200 + i, 180)}));
        messages.push(serde_json::json!({"role": "assistant", "content": prose(300 + i, 120)}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "Summarize."}));
    let body = serde_json::json!({ "messages": messages }).to_string();
    let req = ChatRequest::parse(&body).unwrap();
    let rendered = cold.render_chat(&req, None, &BOUNDS).unwrap();
    let tokens = cold.encode_uncached(&rendered, false).unwrap().len();
    let (render, _) = measure(budget, |_| {
        black_box(
            cold.render_chat(&ChatRequest::parse(&body).unwrap(), None, &BOUNDS)
                .unwrap(),
        );
    });
    let (chat_cold, _) = measure(budget, |_| {
        let r = cold
            .render_chat(&ChatRequest::parse(&body).unwrap(), None, &BOUNDS)
            .unwrap();
        black_box(cold.encode(&r, false).unwrap());
    });
    warm.encode(&rendered, false).unwrap();
    let (chat_warm, _) = measure(budget, |_| {
        let r = warm
            .render_chat(&ChatRequest::parse(&body).unwrap(), None, &BOUNDS)
            .unwrap();
        black_box(warm.encode(&r, false).unwrap());
    });
    println!(
        "  chat (49 messages, {tokens} tokens): parse+render {:.2} ms, +tokenize cold {:.2} ms, warm {:.2} ms",
        ms(render),
        ms(chat_cold),
        ms(chat_warm)
    );
}

//! Parity with Hugging Face `transformers` on the golden corpus
//! (`tests/fixtures/tokenization/`), and exactness of piecewise (cached)
//! tokenization over random cuts.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizer::chat::{ChatRequest, RenderBounds};
use tokenizer::load::{locate, Sources};
use tokenizer::pieces::pieces;
use tokenizer::ModelTokenizer;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The vendored tokenizers. (Only Qwen3, Apache-2.0: the Llama 3.1
/// community license asks more of a redistributor than attribution, so no
/// Llama tokenizer is in the repository, and no test reads one from outside
/// it.)
fn tokenizers() -> Vec<(&'static str, PathBuf)> {
    vec![("qwen3", root().join("tests/fixtures/tokenizers/qwen3"))]
}

fn load(name: &str, dir: &Path) -> ModelTokenizer {
    let mut sources = Sources::default();
    sources.explicit.insert(name.into(), dir.to_owned());
    let files = locate(name, &sources).expect("tokenizer files");
    ModelTokenizer::load(name, &files, 64 << 20).expect("load")
}

fn golden(name: &str) -> Vec<Value> {
    let path = root().join(format!("tests/fixtures/tokenization/{name}.golden.json"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// Every golden case, text and chat, cached and uncached: 100% identical.
#[test]
fn golden_corpus_is_reproduced_exactly() {
    for (name, dir) in tokenizers() {
        let tok = load(name, &dir);
        assert!(tok.is_piecewise(), "{name} should be piece-safe");
        let cases = golden(name);
        assert!(cases.len() > 40, "{name}");
        let (mut texts, mut chats) = (0, 0);
        for case in &cases {
            let id = case["id"].as_str().unwrap();
            let want = ids(&case["ids"]);
            match case["kind"].as_str().unwrap() {
                "text" => {
                    let text = case["text"].as_str().unwrap();
                    let add = case["add_special_tokens"].as_bool().unwrap();
                    assert_eq!(
                        tok.encode_uncached(text, add).unwrap(),
                        want,
                        "{name} {id} (uncached)"
                    );
                    // Twice: cold, then served from the cache.
                    assert_eq!(tok.encode(text, add).unwrap(), want, "{name} {id} (cold)");
                    assert_eq!(tok.encode(text, add).unwrap(), want, "{name} {id} (warm)");
                    texts += 1;
                }
                "chat" => {
                    let body = case["request"].to_string();
                    let req = ChatRequest::parse(&body).unwrap();
                    let rendered = tok
                        .render_chat(&req, None, &RenderBounds::output(8 << 20))
                        .unwrap_or_else(|e| panic!("{name} {id}: {e}"));
                    assert_eq!(
                        rendered,
                        case["rendered"].as_str().unwrap(),
                        "{name} {id} rendering"
                    );
                    assert_eq!(tok.encode(&rendered, false).unwrap(), want, "{name} {id}");
                    chats += 1;
                }
                other => panic!("unknown case kind {other}"),
            }
        }
        println!("{name}: {texts} text cases and {chats} chat cases identical to transformers");
        assert!(
            tok.cache()
                .stats
                .hits
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0
        );
    }
}

/// A tiny deterministic PRNG (xorshift64*): reproducible random cuts.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn char_floor(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The safety argument, tested: for random texts built from the corpus
/// (random prefixes, suffixes and splices of texts and rendered chats),
/// tokenizing piece by piece at every safe cut, with random minimum piece
/// sizes, gives exactly the whole text's tokens; and the cached path agrees
/// whatever the cache already holds.
#[test]
fn piecewise_tokenization_is_exact_over_random_cuts() {
    for (name, dir) in tokenizers() {
        let tok = load(name, &dir);
        let corpus: Vec<String> = golden(name)
            .iter()
            .map(|c| {
                c["text"]
                    .as_str()
                    .or(c["rendered"].as_str())
                    .unwrap()
                    .chars()
                    .take(6000)
                    .collect()
            })
            .collect();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut checked = 0;
        for _ in 0..300 {
            let a = &corpus[rng.below(corpus.len())];
            let b = &corpus[rng.below(corpus.len())];
            // A prefix of one text spliced onto a suffix of another.
            let cut_a = char_floor(a, rng.below(a.len() + 1));
            let cut_b = char_floor(b, rng.below(b.len() + 1));
            let text = format!("{}{}", &a[..cut_a], &b[cut_b..]);
            let whole = tok.encode_uncached(&text, false).unwrap();
            let min = 1 + rng.below(512);
            let mut pieced = Vec::new();
            for p in pieces(&text, min) {
                pieced.extend(tok.encode_uncached(p, false).unwrap());
            }
            assert_eq!(
                pieced, whole,
                "{name}: pieces of min {min} differ for {text:?}"
            );
            // The cached path, after a prefix of this text was cached.
            let _ = tok.encode(&text[..char_floor(&text, rng.below(text.len() + 1))], true);
            assert_eq!(
                tok.encode(&text, true).unwrap(),
                tok.encode_uncached(&text, true).unwrap(),
                "{name}: cached encode differs for {text:?}"
            );
            checked += 1;
        }
        println!("{name}: {checked} random splices tokenized piecewise exactly");
    }
}

/// Multi-turn: each turn extends the previous prompt; all but the tail is
/// served from the cache, and the ids are those of a fresh tokenization.
#[test]
fn extending_a_prompt_reuses_the_cache_exactly() {
    let (name, dir) = &tokenizers()[0];
    let tok = load(name, dir);
    let doc = golden(name)
        .iter()
        .find(|c| c["id"] == "text:long_document:plain")
        .unwrap()["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut prompt = String::new();
    for (turn, chunk) in doc.as_bytes().chunks(9000).enumerate() {
        prompt.push_str(&String::from_utf8_lossy(chunk));
        prompt.push_str(&format!("\nTurn {turn} question: why?\n"));
        let before = tok
            .cache()
            .stats
            .miss_bytes
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            tok.encode(&prompt, false).unwrap(),
            tok.encode_uncached(&prompt, false).unwrap()
        );
        let missed = tok
            .cache()
            .stats
            .miss_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
            - before;
        if turn > 0 {
            // Only the new text and at most a couple of pieces were tokenized.
            assert!(
                missed < 9000 + 2 * 2048 + 4096,
                "turn {turn}: {missed} bytes tokenized"
            );
        }
    }
}

#[test]
fn unknown_models_say_what_was_tried() {
    let sources = Sources {
        models_dir: Some(root().join("tests/fixtures/tokenizers")),
        hf_cache: Some(root().join("tests/fixtures/no-such-cache")),
        hub: None,
        ..Default::default()
    };
    let err = locate("org/missing", &sources).unwrap_err().to_string();
    assert!(err.contains("models dir"), "{err}");
    assert!(err.contains("Hugging Face cache"), "{err}");
    assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
    // The models dir layout: DIR/<model>/tokenizer.json.
    assert!(locate("qwen3", &sources).is_ok());
}

#[test]
fn hf_cache_layout_is_found() {
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--Qwen--Qwen3-8B");
    let snap = repo.join("snapshots/abc123");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "abc123").unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            root().join("tests/fixtures/tokenizers/qwen3").join(f),
            snap.join(f),
        )
        .unwrap();
    }
    let sources = Sources {
        hf_cache: Some(cache.path().to_owned()),
        ..Default::default()
    };
    let files = locate("Qwen/Qwen3-8B", &sources).unwrap();
    assert_eq!(files.tokenizer_json, snap.join("tokenizer.json"));
    assert!(files.config_json.is_some());
    let tok = ModelTokenizer::load("Qwen/Qwen3-8B", &files, 1 << 20).unwrap();
    assert_eq!(tok.encode("Hello", false).unwrap(), vec![9707]);
}

//! Our reproduction of vLLM's block hashes against hashes computed by vLLM
//! 0.33's own code, a real vLLM recording (older LoRA key form) and CPython
//! serialisation edge cases. All must match, bit for bit.

use std::path::PathBuf;

use indexer::keys::engine_hash::{Digest, EngineHasher, ExtraKeyStyle, HashAlgo, PyValue};
use serde_json::Value;

fn load(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hash-vectors")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A JSON array of numbers, as token ids.
fn u32s(v: &Value) -> Vec<u32> {
    u64s(v).into_iter().map(|t| t as u32).collect()
}

/// A JSON array of numbers.
fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect()
}

fn hex(d: &Digest) -> String {
    d.as_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

fn py(v: &Value) -> PyValue {
    match v {
        Value::Null => PyValue::None,
        Value::String(s) => PyValue::Str(s.clone()),
        Value::Number(n) => PyValue::Int(n.as_i64().unwrap()),
        Value::Array(items) => PyValue::Tuple(items.iter().map(py).collect()),
        other => panic!("unexpected extra key {other}"),
    }
}

fn extras(v: &Value) -> Vec<PyValue> {
    match v {
        Value::Null => Vec::new(),
        Value::Array(items) => items.iter().map(py).collect(),
        other => panic!("unexpected extra keys {other}"),
    }
}

/// Chains blocks with per-block extra keys, as vLLM's request hashing does.
fn chain(h: &EngineHasher, blocks: &[Vec<u32>], extra_keys: &[Value]) -> Vec<Digest> {
    let mut buf = Vec::new();
    let mut parent = h.none_hash();
    blocks
        .iter()
        .zip(extra_keys)
        .map(|(b, e)| {
            parent = h.block_digest(&mut buf, &parent, b, &extras(e));
            parent
        })
        .collect()
}

#[test]
fn vllm_0_33_engine_hash_vectors_all_match() {
    let doc = load("vllm-0.33-engine-hashes.json");
    let vectors = doc["vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), 48);
    let mut blocks_checked = 0;
    for v in vectors {
        let algo = HashAlgo::parse(v["algo"].as_str().unwrap()).unwrap();
        let h = EngineHasher::new(algo, v["seed"].as_str().unwrap(), ExtraKeyStyle::Tagged);
        let what = format!("{} seed={} case={}", v["algo"], v["seed"], v["case"]);
        assert_eq!(
            hex(&h.none_hash()),
            v["none_hash_hex"].as_str().unwrap(),
            "{what}"
        );
        let blocks: Vec<Vec<u32>> = v["blocks"].as_array().unwrap().iter().map(u32s).collect();
        let digests = chain(&h, &blocks, v["extra_keys"].as_array().unwrap());
        for (i, d) in digests.iter().enumerate() {
            assert_eq!(
                hex(d),
                v["digests_hex"][i].as_str().unwrap(),
                "{what} block {i}"
            );
            assert_eq!(
                d.wire().0,
                v["wire_u64"][i].as_u64().unwrap(),
                "{what} block {i}"
            );
            blocks_checked += 1;
        }
    }
    assert_eq!(blocks_checked, 96);
}

/// The request-side helper builds exactly the extra keys the vectors use.
#[test]
fn request_extras_reproduce_lora_and_salt_vectors() {
    let doc = load("vllm-0.33-engine-hashes.json");
    for v in doc["vectors"].as_array().unwrap() {
        let algo = HashAlgo::parse(v["algo"].as_str().unwrap()).unwrap();
        let h = EngineHasher::new(algo, v["seed"].as_str().unwrap(), ExtraKeyStyle::Tagged);
        let (first, rest) = match v["case"].as_str().unwrap() {
            "lora" => h.request_extras(Some(("sql-lora", "/loras/sql")), None),
            "cache_salt" => h.request_extras(None, Some("tenant-a")),
            _ => h.request_extras(None, None),
        };
        let bs = v["block_size"].as_u64().unwrap() as usize;
        let tokens: Vec<u32> = v["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(u32s)
            .collect();
        let wire: Vec<u64> = h
            .prompt_digests(&tokens, bs, &first, &rest)
            .iter()
            .map(|d| d.wire().0)
            .collect();
        let want = u64s(&v["wire_u64"]);
        assert_eq!(wire, want, "{} {} {}", v["algo"], v["seed"], v["case"]);
    }
}

/// Real vLLM (older release, PYTHONHASHSEED=42, sha256_cbor): the LoRA extra
/// key is the bare adapter name.
#[test]
fn real_vllm_recordings_match_including_bare_lora_name() {
    for name in [
        "llmd-vllm-sha256cbor-seed42.json",
        "llmd-vllm-sha256cbor-seed42-lora.json",
    ] {
        let rec = load(name);
        let h = EngineHasher::new(
            HashAlgo::Sha256Cbor,
            rec["hash_seed"].as_str().unwrap(),
            ExtraKeyStyle::Bare,
        );
        let tokens = u32s(&rec["token_ids"]);
        let bs = rec["block_size"].as_u64().unwrap() as usize;
        let lora = rec["lora_name"]
            .as_str()
            .map(|n| (n, rec["lora_path"].as_str().unwrap()));
        let (first, rest) = h.request_extras(lora, None);
        let got: Vec<u64> = h
            .prompt_digests(&tokens, bs, &first, &rest)
            .iter()
            .map(|d| d.wire().0)
            .collect();
        let want = u64s(&rec["block_hashes"]);
        assert_eq!(got.len(), 25, "{name}");
        assert_eq!(got, want, "{name}");
    }
}

/// Pickles over 64 KiB are split in frames exactly where CPython splits them;
/// tuple extra keys (multimodal) serialise as CPython/cbor2 do.
#[test]
fn large_blocks_and_tuple_extras_match_cpython() {
    let doc = load("large-blocks.json");
    for v in doc["vectors"].as_array().unwrap() {
        let algo = HashAlgo::parse(v["algo"].as_str().unwrap()).unwrap();
        let h = EngineHasher::new(algo, v["seed"].as_str().unwrap(), ExtraKeyStyle::Tagged);
        let bs = v["block_size"].as_u64().unwrap() as u32;
        let blocks: Vec<Vec<u32>> = (0..v["num_blocks"].as_u64().unwrap() as u32)
            .map(|b| (0..bs).map(|i| (i * 7919 + b * 104729) % 200000).collect())
            .collect();
        let digests = chain(&h, &blocks, v["extra_keys"].as_array().unwrap());
        for (i, d) in digests.iter().enumerate() {
            assert_eq!(
                hex(d),
                v["digests_hex"][i].as_str().unwrap(),
                "{} {} block {i}",
                v["algo"],
                v["case"]
            );
        }
    }
}

/// Prompts with multimodal items, hashed by vLLM 0.33's own request block
/// hasher in every algorithm (`vllm-0.33-mm-hashes.json`, made by
/// `gen_mm_hashes.py`): the request path (`KeyMode::request_keys`) gives
/// the same hashes, two items in a block and the same image twice included
/// (the `"mm"` tag written once per block, then referred back to).
#[test]
fn vllm_0_33_multimodal_hash_vectors_all_match() {
    use indexer::keys::multimodal::{sorted_items, MmItem};
    use indexer::keys::scheme::{EngineKeys, KeyMode};
    let doc = load("vllm-0.33-mm-hashes.json");
    let vectors = doc["vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), 24);
    let mut blocks = 0;
    for v in vectors {
        let algo = HashAlgo::parse(v["algo"].as_str().unwrap()).unwrap();
        let hasher = EngineHasher::new(algo, v["seed"].as_str().unwrap(), ExtraKeyStyle::Tagged);
        assert_eq!(
            hex(&hasher.none_hash()),
            v["none_hash_hex"].as_str().unwrap()
        );
        let lora = v["lora"].as_object();
        let mode = KeyMode::Engine(Box::new(EngineKeys {
            hasher,
            lora_paths: lora
                .map(|l| {
                    [(
                        l["name"].as_str().unwrap().to_owned(),
                        l["path"].as_str().unwrap().to_owned(),
                    )]
                    .into()
                })
                .unwrap_or_default(),
            assume_prefix_closed: false,
            self_check_every: 0,
        }));
        let tokens = u32s(&v["token_ids"]);
        let items: Vec<MmItem> = v["mm_items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| MmItem {
                identifier: i["identifier"].as_str().unwrap().to_owned(),
                offset: i["offset"].as_u64().unwrap() as u32,
                length: i["length"].as_u64().unwrap() as u32,
            })
            .collect();
        let items = sorted_items(items, tokens.len()).unwrap();
        let (keys, engine) = mode.request_keys(
            "m",
            lora.map(|l| l["name"].as_str().unwrap()),
            v["cache_salt"].as_str(),
            &tokens,
            v["block_size"].as_u64().unwrap() as usize,
            &items,
        );
        assert!(engine);
        let want = u64s(&v["wire_u64"]);
        let got: Vec<u64> = keys.iter().map(|k| k.0).collect();
        assert_eq!(got, want, "{} {}", v["algo"], v["case"]);
        blocks += got.len();
    }
    assert_eq!(blocks, 60);
}

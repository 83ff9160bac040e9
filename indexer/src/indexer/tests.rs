use std::collections::HashMap;

use super::*;
use crate::event::{BlockStored, EngineHash, KvEvent};

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> KvEvent {
    KvEvent::Stored(BlockStored {
        block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
        parent_block_hash: parent.map(EngineHash),
        token_ids: tokens.to_vec(),
        block_size: Some(bs),
        ..Default::default()
    })
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        events,
        ..Default::default()
    }
}

/// An offload as vLLM's connectors publish it: no parent, no tokens,
/// medium CPU, the chunk size in `block_size` (0 in newer releases).
fn offloaded(hashes: &[u64], block_size: u32) -> KvEvent {
    let mut e = stored(hashes, None, &[], block_size);
    if let KvEvent::Stored(s) = &mut e {
        s.medium = Some("CPU".into());
    }
    e
}

/// Score for every pod of model "m".
fn score_m(ix: &Indexer, tokens: &[u32]) -> ScoreOutcome {
    ix.score(&ScoreQuery {
        model: "m",
        tokens,
        lora_name: None,
        cache_salt: None,
        mm_items: &[],
        pods: &[],
    })
}

/// An engine-mode indexer with prefix closure and 64-token offloaded
/// chunks, and the wire hashes of `tokens`' blocks (vLLM's SHA-256).
fn chunking_engine_indexer(tokens: &[u32]) -> (Indexer, Vec<u64>) {
    use crate::keys::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo, DEFAULT_SEED};
    let hasher = EngineHasher::new(HashAlgo::Sha256, DEFAULT_SEED, ExtraKeyStyle::Tagged);
    let hashes = hasher
        .prompt_digests(tokens, 16, &[], &[])
        .iter()
        .map(|d| d.wire().0)
        .collect();
    let ix = Indexer::new(IndexerConfig {
        keys: KeySchemes::engine(hasher, true, 0),
        offload_block_size: 64,
        ..IndexerConfig::default()
    });
    (ix, hashes)
}

#[test]
fn scores_every_candidate_best_first() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..40).collect();
    let a = ix.pod("m", "a", None);
    let b = ix.pod("m", "b", Some(0));
    ix.apply(
        &a,
        0,
        &batch(vec![stored(&[1, 2], None, &tokens[..32], 16)]),
    );
    ix.apply(&b, 0, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
    let out = ix.score(&ScoreQuery {
        model: "m",
        tokens: &tokens,
        lora_name: None,
        cache_salt: None,
        mm_items: &[],
        pods: &[],
    });
    assert_eq!(out.block_size, 16);
    assert_eq!(out.total_blocks, 2);
    let got: Vec<(&str, u32, f64)> = out
        .pods
        .iter()
        .map(|p| (p.pod.as_str(), p.matched.matched_blocks, p.score))
        .collect();
    assert_eq!(got, vec![("a", 2, 1.0), ("b", 1, 0.5)]);

    // Named candidates, one unknown, one duplicated.
    let names = ["zz".to_string(), "b".to_string(), "b".to_string()];
    let out = ix.score(&ScoreQuery {
        pods: &names,
        ..ScoreQuery {
            model: "m",
            tokens: &tokens,
            lora_name: None,
            cache_salt: None,
            mm_items: &[],
            pods: &[],
        }
    });
    let got: Vec<(&str, u32)> = out
        .pods
        .iter()
        .map(|p| (p.pod.as_str(), p.matched.matched_blocks))
        .collect();
    assert_eq!(got, vec![("b", 1), ("zz", 0)]);
}

#[test]
fn pods_with_different_block_sizes_are_each_scored_in_their_own_blocks() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..64).collect();
    let small = ix.pod("m", "small", None);
    let large = ix.pod("m", "large", None);
    ix.apply(
        &small,
        0,
        &batch(vec![stored(&[1, 2, 3], None, &tokens[..48], 16)]),
    );
    ix.apply(
        &large,
        0,
        &batch(vec![stored(&[7], None, &tokens[..32], 32)]),
    );
    let out = ix.score(&ScoreQuery {
        model: "m",
        tokens: &tokens,
        lora_name: None,
        cache_salt: None,
        mm_items: &[],
        pods: &[],
    });
    let get = |n: &str| out.pods.iter().find(|p| p.pod == n).unwrap().clone();
    assert_eq!(get("small").matched.matched_blocks, 3);
    assert_eq!(get("small").total_blocks, 4);
    assert_eq!(get("large").matched.matched_blocks, 1);
    assert_eq!(get("large").block_size, 32);
    assert_eq!(get("large").total_blocks, 2);
}

/// New pods appearing while others ask about named pods: `try_pod`
/// holds the pod table and inserts a name; a named lookup must not hold
/// a name-map guard while it waits for the table (it used to: the
/// process froze within seconds of a fleet's first minute).
#[test]
fn new_pods_during_named_lookups_do_not_deadlock() {
    let ix = Arc::new(Indexer::new(IndexerConfig::default()));
    let names: Vec<String> = (0..64).map(|i| format!("named-{i}")).collect();
    for n in &names {
        ix.pod("m", n, None);
    }
    let (done_tx, done) = std::sync::mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    {
        let (ix, stop, done_tx) = (ix.clone(), stop.clone(), done_tx.clone());
        threads.push(std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                ix.pod("m", &format!("new-{i}"), None);
                i += 1;
            }
            let _ = done_tx.send(());
        }));
    }
    for _ in 0..3 {
        let (ix, stop, done_tx, names) = (ix.clone(), stop.clone(), done_tx.clone(), names.clone());
        threads.push(std::thread::spawn(move || {
            let tokens: Vec<u32> = (0..32).collect();
            while !stop.load(Ordering::Relaxed) {
                ix.score(&ScoreQuery {
                    model: "m",
                    tokens: &tokens,
                    lora_name: None,
                    cache_salt: None,
                    mm_items: &[],
                    pods: &names,
                });
            }
            let _ = done_tx.send(());
        }));
    }
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    for _ in 0..threads.len() {
        // Each loop iteration is microseconds: a thread that does not
        // finish within this long is stuck for good.
        done.recv_timeout(Duration::from_secs(20))
            .expect("deadlock: a thread never finished");
    }
    for t in threads {
        t.join().unwrap();
    }
}

/// A snapshot is kept across restarts only if the fingerprint is the
/// same in every process: with several LoRA paths it used to follow a
/// `HashMap`'s per-process order, so every restart started empty.
#[test]
fn the_key_fingerprint_is_stable_and_only_about_keys() {
    use crate::keys::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo};
    use crate::keys::scheme::{EngineKeys, KeyMode, KeySchemes};
    let indexer = |loras: &[(usize, &str)], self_check_every: u32| {
        let lora_paths = loras
            .iter()
            .map(|(i, path)| (format!("adapter-{i}"), (*path).to_owned()))
            .collect();
        let mode = KeyMode::Engine(Box::new(EngineKeys {
            hasher: EngineHasher::new(HashAlgo::Sha256, "vllm-none-hash", ExtraKeyStyle::Tagged),
            lora_paths,
            assume_prefix_closed: true,
            self_check_every,
        }));
        Indexer::new(IndexerConfig {
            keys: KeySchemes {
                default: mode.clone(),
                per_model: [("m".to_owned(), mode)].into_iter().collect(),
            },
            ..Default::default()
        })
    };
    let forward: Vec<(usize, &str)> = (0..16).map(|i| (i, "/adapters/x")).collect();
    let backward: Vec<(usize, &str)> = forward.iter().rev().copied().collect();
    // Each map gets its own random hasher state, as in another process.
    let first = indexer(&forward, 64).keys_fingerprint();
    for _ in 0..8 {
        assert_eq!(indexer(&backward, 64).keys_fingerprint(), first);
    }
    // The self-check changes no key; an adapter's path does.
    assert_eq!(indexer(&forward, 0).keys_fingerprint(), first);
    let mut moved = forward.clone();
    moved[3].1 = "/adapters/y";
    assert_ne!(indexer(&moved, 64).keys_fingerprint(), first);
}

#[test]
fn pod_and_model_bounds_refuse_new_ones_only() {
    let ix = Indexer::new(IndexerConfig {
        max_pods: Some(3),
        max_models: Some(2),
        ..Default::default()
    });
    ix.try_pod("a", "p1", None).unwrap();
    ix.try_pod("a", "p2", None).unwrap();
    ix.try_pod("b", "p1", None).unwrap();
    assert_eq!(ix.try_pod("a", "p3", None).err(), Some(Refused::Pods));
    // Existing pods are unaffected.
    assert!(ix.try_pod("a", "p1", None).is_ok());
    ix.remove_pod(&ix.find_pod("a", "p2").unwrap()).unwrap();
    assert_eq!(ix.try_pod("c", "p1", None).err(), Some(Refused::Models));
    ix.try_pod("a", "p3", None).unwrap();
    assert_eq!(ix.live_pods(), 3);
    // A model whose last pod left frees its place.
    ix.remove_pod(&ix.find_pod("b", "p1").unwrap()).unwrap();
    ix.try_pod("c", "p1", None).unwrap();
}

#[test]
fn pods_fixed_cost_takes_at_most_half_the_memory_budget() {
    let ix = Indexer::new(IndexerConfig {
        max_entries: Some(1000),
        pod_cost_entries: 10,
        ..Default::default()
    });
    for i in 0..50 {
        ix.try_pod("m", &format!("p{i}"), None).unwrap();
    }
    assert_eq!(ix.try_pod("m", "p50", None).err(), Some(Refused::Memory));
    // Blocks get what the pods leave: 1000 - 50 * 10 = 500 entries.
    let pod = ix.pod("m", "p0", None);
    let tokens: Vec<u32> = (0..16 * 600).collect();
    let hashes: Vec<u64> = (1..=600).collect();
    ix.apply(&pod, 0, &batch(vec![stored(&hashes, None, &tokens, 16)]));
    assert!(ix.enforce_capacity(|_| true).is_none());
    assert!(ix.entries() <= 500, "{} entries", ix.entries());
}

#[test]
fn dp_ranks_are_separate_pods_and_models_do_not_mix() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..16).collect();
    let r1 = ix.pod("m", "p", Some(1));
    let other = ix.pod("other", "p", None);
    assert_eq!(r1.name, "p#dp1");
    ix.apply(&r1, 0, &batch(vec![stored(&[1], None, &tokens, 16)]));
    ix.apply(&other, 0, &batch(vec![stored(&[1], None, &tokens, 16)]));
    let q = |model| {
        ix.score(&ScoreQuery {
            model,
            tokens: &tokens,
            lora_name: None,
            cache_salt: None,
            mm_items: &[],
            pods: &[],
        })
    };
    let m = q("m");
    assert_eq!(m.pods.len(), 1);
    assert_eq!(
        (m.pods[0].pod.as_str(), m.pods[0].matched.matched_blocks),
        ("p#dp1", 1)
    );
    assert_eq!(q("other").pods[0].matched.matched_blocks, 1);
    assert!(q("nobody").pods.is_empty());
}

#[test]
fn a_publisher_restart_drops_the_pods_blocks_and_is_counted() {
    let ix = Indexer::new(IndexerConfig::default());
    let p = ix.pod("m", "p", None);
    let tokens: Vec<u32> = (0..32).collect();
    let q = ScoreQuery {
        model: "m",
        tokens: &tokens,
        lora_name: None,
        cache_salt: None,
        mm_items: &[],
        pods: &[],
    };
    ix.apply(&p, 0, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
    ix.apply(
        &p,
        1,
        &batch(vec![stored(&[2], Some(1), &tokens[16..], 16)]),
    );
    ix.count_stream(&p, StreamCount::Duplicate);
    ix.mark_incomplete(&p, 2);
    assert_eq!(ix.score(&q).pods[0].matched.matched_blocks, 2);
    // vLLM restarted: cache empty, new blocks only, fully known again.
    ix.restart_pod(&p);
    let other: Vec<u32> = (100..116).collect();
    ix.apply(&p, 0, &batch(vec![stored(&[9], None, &other, 16)]));
    assert_eq!(ix.score(&q).pods[0].matched.matched_blocks, 0);
    let s = &ix.list_pods(None)[0];
    assert_eq!((s.publisher_restarts, s.duplicate_batches), (1, 1));
    assert_eq!(s.blocks_per_tier, [1, 0, 0]);
    assert!(!s.incomplete);
}

#[test]
fn removed_pods_drop_their_blocks_and_come_back_fresh() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..16).collect();
    assert!(!ix.has_model("m"));
    let p = ix.pod("m", "p", None);
    assert!(ix.has_model("m") && !ix.has_model("other"));
    ix.apply(&p, 0, &batch(vec![stored(&[1], None, &tokens, 16)]));
    assert_eq!(ix.remove_pod(&p), Some(1));
    assert_eq!(ix.remove_pod(&p), None);
    assert!(!ix.has_model("m"), "no pod publishes it any more");
    assert!(p.is_removed());
    assert!(ix.list_pods(None).is_empty());
    assert_eq!(ix.indexed_keys(), 0);
    let again = ix.pod("m", "p", None);
    assert!(!again.is_removed());
    assert_eq!(again.id, p.id, "a removed pod's id is reused");
    assert_eq!(ix.list_pods(None)[0].batches, 0);
    // A late batch through the old handle is dropped, never applied.
    ix.apply(&p, 1, &batch(vec![stored(&[1], None, &tokens, 16)]));
    assert_eq!(ix.entries(), 0);
    assert_eq!(ix.indexed_keys(), 0);
}

#[test]
fn capacity_evicts_from_the_largest_pod_oldest_first() {
    // Every block is stored alone (its own run): it costs its entry and
    // its holding's `HOLDING_ENTRIES`.
    let ix = Indexer::new(IndexerConfig {
        max_entries: Some(300),
        ..Default::default()
    });
    let big = ix.pod("m", "big", None);
    let small = ix.pod("m", "small", None);
    let tokens: Vec<u32> = (0..16).collect();
    let block = |h: u64| -> Vec<u32> { tokens.iter().map(|x| x + h as u32 * 100).collect() };
    for h in 0..20u64 {
        ix.apply(
            &small,
            h,
            // Its own hashes: one model's pods name different blocks
            // differently (a hash naming two blocks is a conflict).
            &batch(vec![stored(&[1000 + h], None, &block(1000 + h), 16)]),
        );
        assert!(ix.enforce_capacity(|_| true).is_none());
    }
    for h in 0..150u64 {
        ix.apply(&big, h, &batch(vec![stored(&[h], None, &block(h), 16)]));
        assert!(ix.enforce_capacity(|_| true).is_none());
    }
    assert!(ix.entries() <= 300, "{}", ix.entries());
    assert!(ix.evictions() >= 70, "{}", ix.evictions());
    let pods = ix.list_pods(None);
    let held = |n: &str| pods.iter().find(|p| p.pod == n).unwrap().blocks_per_tier[0];
    // Only the largest pod paid.
    assert_eq!(held("small"), 20);
    let per_block = 1 + crate::pod::HOLDING_ENTRIES;
    assert_eq!(per_block * (held("big") + 20), ix.entries());
    // The most recent blocks survive.
    let last = block(149);
    let q = ScoreQuery {
        model: "m",
        tokens: &last,
        lora_name: None,
        cache_salt: None,
        mm_items: &[],
        pods: &[],
    };
    let out = ix.score(&q);
    assert_eq!(
        out.pods
            .iter()
            .find(|p| p.pod == "big")
            .unwrap()
            .matched
            .matched_blocks,
        1
    );
    let first = block(0);
    let out = ix.score(&ScoreQuery {
        tokens: &first,
        ..q
    });
    assert_eq!(
        out.pods
            .iter()
            .find(|p| p.pod == "big")
            .unwrap()
            .matched
            .matched_blocks,
        0
    );
}

#[test]
fn a_snapshot_restores_every_pod_exactly() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..48).collect();
    let a = ix.pod("m", "a", None);
    let b = ix.pod("m", "b", Some(1));
    ix.apply(&a, 4, &batch(vec![stored(&[1, 2, 3], None, &tokens, 16)]));
    ix.apply(&b, 9, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
    ix.apply(&b, 10, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
    let bytes = ix.export(Vec::new()).unwrap();
    let snap = || std::io::Cursor::new(&bytes);
    let restored = Indexer::new(IndexerConfig::default());
    assert_eq!(restored.import(snap()).unwrap(), 2);
    let q = ScoreQuery {
        model: "m",
        tokens: &tokens,
        lora_name: None,
        cache_salt: None,
        mm_items: &[],
        pods: &[],
    };
    assert_eq!(ix.score(&q), restored.score(&q));
    let rb = restored.pod("m", "b", Some(1));
    assert_eq!(restored.last_seq(&rb), Some(10));
    // Counts survive: b stored hash 1 twice, so one removal keeps it.
    restored.apply(
        &rb,
        11,
        &batch(vec![KvEvent::Removed(crate::event::BlockRemoved {
            block_hashes: vec![EngineHash(1)],
            ..Default::default()
        })]),
    );
    assert_eq!(
        restored
            .score(&q)
            .pods
            .iter()
            .find(|p| p.pod == "b#dp1")
            .unwrap()
            .matched
            .matched_blocks,
        1
    );
    // Another key configuration cannot use these keys.
    let engine = Indexer::new(IndexerConfig {
        keys: KeySchemes::engine(
            crate::keys::engine_hash::EngineHasher::new(
                crate::keys::engine_hash::HashAlgo::Sha256,
                "x",
                crate::keys::engine_hash::ExtraKeyStyle::Tagged,
            ),
            true,
            0,
        ),
        ..Default::default()
    });
    assert_eq!(engine.import(snap()), Err(SnapshotError::KeysChanged));
    assert_eq!(engine.entries(), 0);
}

/// A snapshot file of format 2 (each pod's blocks with their keys, stores
/// per tier and parents, as older releases wrote it) restores into the runs: the
/// same answers, and the counts (a block stored twice needs two removals).
#[test]
fn a_version_2_snapshot_is_stored_into_the_runs() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..48).collect();
    let a = ix.pod("m", "a", None);
    ix.apply(&a, 4, &batch(vec![stored(&[1, 2, 3], None, &tokens, 16)]));
    ix.apply(&a, 5, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
    ix.apply(&a, 6, &batch(vec![offloaded(&[2], 16)]));
    let keys = ix.keys_of(&a, &[EngineHash(1), EngineHash(2), EngineHash(3)]);
    let key = |i: usize| keys[i].expect("held").0;
    // As format 2 lists them: least recently stored first.
    let record = PodSnapshot {
        model: "m".into(),
        pod: "a".into(),
        dp_rank: None,
        block_size: Some(16),
        last_seq: Some(6),
        incomplete: false,
        non_full_groups: vec![],
        blocks: vec![
            (1, key(0), [2, 0, 0]),
            (2, key(1), [1, 1, 0]),
            (3, key(2), [1, 0, 0]),
        ],
        parents: vec![None, Some(1), Some(2)],
        offload_block_size: None,
        last_fingerprint: None,
        runs_id: None,
        bigram: false,
        engine: 0,
    };
    let mut w = SnapshotWriter::new(Vec::new(), ix.keys_fingerprint()).unwrap();
    w.pod(&record).unwrap();
    let mut bytes = w.finish().unwrap();
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    let body = bytes.len() - 8;
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes[..body]);
    bytes[body..].copy_from_slice(&sum.to_le_bytes());
    let restored = Indexer::new(IndexerConfig::default());
    assert_eq!(restored.import(std::io::Cursor::new(&bytes)).unwrap(), 1);
    let q = ScoreQuery {
        model: "m",
        tokens: &tokens,
        lora_name: None,
        cache_salt: None,
        mm_items: &[],
        pods: &[],
    };
    assert_eq!(restored.score(&q), ix.score(&q));
    assert_eq!(restored.list_pods(None)[0].blocks_per_tier, [3, 1, 0]);
    let ra = restored.pod("m", "a", None);
    assert_eq!(restored.last_seq(&ra), Some(6));
    let remove_1 = batch(vec![KvEvent::Removed(crate::event::BlockRemoved {
        block_hashes: vec![EngineHash(1)],
        ..Default::default()
    })]);
    restored.apply(&ra, 7, &remove_1);
    assert_eq!(restored.score(&q).pods[0].matched.matched_blocks, 3);
    restored.apply(&ra, 8, &remove_1);
    assert_eq!(restored.score(&q).pods[0].matched.matched_blocks, 0);
}

/// A pod the restarted service refuses (its bounds were lowered) is not
/// restored, and neither are its blocks, whether the runs it held are
/// shared with a pod that is or its own.
#[test]
fn a_snapshot_drops_the_blocks_of_pods_it_cannot_restore() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..64).collect();
    let a = ix.pod("m", "a", None);
    let b = ix.pod("m", "b", None);
    ix.apply(
        &a,
        0,
        &batch(vec![stored(&[1, 2], None, &tokens[..32], 16)]),
    );
    ix.apply(
        &b,
        0,
        &batch(vec![stored(&[1, 2, 3], None, &tokens[..48], 16)]),
    );
    ix.apply(&b, 1, &batch(vec![stored(&[9], None, &tokens[48..], 16)]));
    let bytes = ix.export(Vec::new()).unwrap();
    let restored = Indexer::new(IndexerConfig {
        max_pods: Some(1),
        ..Default::default()
    });
    assert_eq!(restored.import(std::io::Cursor::new(&bytes)).unwrap(), 1);
    let pods = restored.list_pods(None);
    assert_eq!(pods.len(), 1);
    assert_eq!(
        (pods[0].pod.as_str(), pods[0].blocks_per_tier),
        ("a", [2, 0, 0])
    );
    let q = ScoreQuery {
        model: "m",
        tokens: &tokens[..48],
        lora_name: None,
        cache_salt: None,
        mm_items: &[],
        pods: &[],
    };
    let scored = restored.score(&q);
    assert_eq!(scored.pods.len(), 1);
    assert_eq!(scored.pods[0].matched.matched_blocks, 2);
    // b's blocks past a's went with it.
    assert_eq!(restored.indexed_keys(), 2);
    assert_eq!(restored.entries(), restored_cost(&restored));
}

/// Capacity units the restored pods account (`Indexer::entries`), from
/// their own runs.
fn restored_cost(ix: &Indexer) -> u64 {
    ix.list_pod_handles()
        .iter()
        .map(|p| p.inner.lock().state.cost(&p.runs))
        .sum()
}

/// Runs that break the index's rules under a valid checksum (what a
/// writer bug would leave) refuse the snapshot, and leave the indexer
/// empty, as any refused snapshot does.
#[test]
fn a_snapshot_whose_runs_break_the_rules_leaves_the_indexer_empty() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..32).collect();
    let a = ix.pod("m", "a", None);
    ix.apply(&a, 0, &batch(vec![stored(&[1, 2], None, &tokens, 16)]));
    let record = PodSnapshot {
        model: "m".into(),
        pod: "a".into(),
        dp_rank: None,
        block_size: Some(16),
        last_seq: Some(0),
        incomplete: false,
        non_full_groups: vec![],
        blocks: vec![],
        parents: vec![],
        offload_block_size: None,
        last_fingerprint: None,
        runs_id: Some(a.id.0),
        bigram: false,
        engine: 0,
    };
    let mut dump = a.runs.token.dump();
    // A span past its run's end.
    dump.runs[0].holdings[0].spans = vec![(0, 5)];
    let mut w = SnapshotWriter::new(Vec::new(), ix.keys_fingerprint()).unwrap();
    w.pod(&record).unwrap();
    w.runs("m", &dump).unwrap();
    let bytes = w.finish().unwrap();
    let restored = Indexer::new(IndexerConfig::default());
    assert!(matches!(
        restored.import(std::io::Cursor::new(&bytes)),
        Err(SnapshotError::Decode(_))
    ));
    assert_eq!(restored.live_pods(), 0);
    assert_eq!(restored.entries(), 0);
    assert_eq!(restored.indexed_keys(), 0);
}

#[test]
fn list_pods_reports_progress_and_gaps() {
    let ix = Indexer::new(IndexerConfig::default());
    let p = ix.pod("m", "p", None);
    let tokens: Vec<u32> = (0..16).collect();
    ix.apply(&p, 0, &batch(vec![stored(&[1], None, &tokens, 16)]));
    ix.count_stream(&p, StreamCount::Gap);
    ix.apply(&p, 2, &batch(vec![KvEvent::AllCleared]));
    let s = &ix.list_pods(Some("m"))[0];
    assert_eq!(s.last_seq, Some(2));
    assert_eq!(s.seq_gaps, 1);
    assert_eq!(s.batches, 2);
    assert_eq!(s.applied.clears, 1);
    assert_eq!(s.blocks_per_tier, [0, 0, 0]);
    assert!(ix.list_pods(Some("x")).is_empty());
    let keys = ix.request_keys("m", None, None, &tokens, 16, &[]);
    assert!(ix.lookup(&keys)[0].pods.is_empty());
}

fn engine_indexer() -> Indexer {
    Indexer::new(IndexerConfig {
        keys: KeySchemes::engine(
            crate::keys::engine_hash::EngineHasher::new(
                crate::keys::engine_hash::HashAlgo::Sha256,
                crate::keys::engine_hash::DEFAULT_SEED,
                crate::keys::engine_hash::ExtraKeyStyle::Tagged,
            ),
            false,
            0,
        ),
        ..Default::default()
    })
}

/// A lookup (run by run, binary search within each) must give exactly
/// the block-by-block walk over who holds each key, whatever the events
/// did to the index: chains stored under held parents, under unknown
/// parents, middle blocks removed (holes), CPU copies, clears, and (the
/// last round) pods holding mostly what offloads stored as vLLM's
/// connectors publish it (no parent, pieces of several chains in one
/// event), with GPU stores that adopt those blocks and removals from
/// either tier. Random histories, checked after every batch.
#[test]
fn prefix_matches_equal_the_first_miss_walk_on_random_histories() {
    let mut rnd = crate::test_rng::xorshift(0x1234_5678_9abc_def1u64);
    // Chains: node i's parent is node parent[i] (or none); hash = i + 1.
    let mut parent: Vec<Option<u64>> = Vec::new();
    for i in 0..400u64 {
        parent.push(match i % 40 {
            0 => None,
            _ => Some(i),
        });
    }
    // A few branches off the first chain.
    for i in 400..480u64 {
        parent.push(Some(if i % 20 == 0 { 1 + rnd(30) } else { i }));
    }
    let path_to = |mut node: u64, parent: &[Option<u64>]| -> Vec<u64> {
        let mut path = vec![node + 1];
        while let Some(p) = parent[node as usize] {
            path.push(p);
            node = p - 1;
        }
        path.reverse();
        path
    };
    let tokens = [7u32; 16];
    for round in 0..7 {
        let offloads = round == 6;
        let ix = engine_indexer();
        let pods: Vec<_> = (0..5)
            .map(|p| ix.pod("m", &format!("p{p}"), None))
            .collect();
        let mut seqs = [0u64; 5];
        for step in 0..300 {
            let p = rnd(5) as usize;
            let node = rnd(parent.len() as u64);
            let ev = match rnd(10) {
                // Pieces of one or two paths, offloaded with no parent.
                0..=3 if offloads => {
                    let mut hashes = Vec::new();
                    for _ in 0..1 + rnd(2) {
                        let path = path_to(rnd(parent.len() as u64), &parent);
                        let from = rnd(path.len() as u64) as usize;
                        let to = from + 1 + rnd((path.len() - from) as u64) as usize;
                        hashes.extend_from_slice(&path[from..to]);
                    }
                    let mut e = stored(&hashes, None, &[], 16);
                    if let KvEvent::Stored(s) = &mut e {
                        s.medium = Some("CPU".into());
                    }
                    e
                }
                // Store a whole path from its root, the usual case.
                0..=4 => {
                    let path = path_to(node, &parent);
                    // Mostly from the root; sometimes under a parent
                    // the pod may not hold.
                    let cut = match rnd(4) {
                        0 => rnd(path.len() as u64) as usize,
                        _ => 0,
                    };
                    let parent = cut.checked_sub(1).map(|i| path[i]);
                    let hashes = &path[cut..];
                    stored(hashes, parent, &tokens.repeat(hashes.len()), 16)
                }
                // Removals: any block (holes) in the early rounds; a
                // path's tail, deepest first as vLLM evicts, later.
                5..=7 if round < 3 => KvEvent::Removed(crate::event::BlockRemoved {
                    block_hashes: vec![EngineHash(node + 1)],
                    ..Default::default()
                }),
                5..=7 => {
                    let path = path_to(node, &parent);
                    let cut = rnd(path.len() as u64) as usize;
                    KvEvent::Removed(crate::event::BlockRemoved {
                        block_hashes: path[cut..].iter().rev().map(|h| EngineHash(*h)).collect(),
                        medium: (offloads && rnd(2) == 0).then(|| "CPU".into()),
                        ..Default::default()
                    })
                }
                8 if round < 2 => {
                    let mut e = stored(&[node + 1], Some(node), &[], 16);
                    if let KvEvent::Stored(s) = &mut e {
                        s.medium = Some(if round == 0 { "CPU" } else { "GPU" }.into());
                    }
                    e
                }
                9 if rnd(3) == 0 => KvEvent::AllCleared,
                _ => continue,
            };
            ix.apply(&pods[p], seqs[p], &batch(vec![ev]));
            seqs[p] += 1;
            let ids: Vec<PodId> = pods.iter().map(|p| p.id).collect();
            for probe in 0..6 {
                let path = path_to(rnd(parent.len() as u64), &parent);
                let keys: Vec<BlockKey> = path.iter().map(|h| BlockKey(*h)).collect();
                let want = walked(&ix, &ids, &keys);
                let got = ix.prefix_matches("m", &keys);
                assert_eq!(got, want, "round {round} step {step} probe {probe}");
            }
        }
    }
}

/// Each of `pods`' first-miss match for `keys`, from who holds each key
/// (`lookup`): the index's own state, read another way than
/// `prefix_matches` reads it.
fn walked(ix: &Indexer, pods: &[PodId], keys: &[BlockKey]) -> Vec<(PodId, PrefixMatch)> {
    let holders = ix.lookup(keys);
    let weights = &ix.config.tier_weights;
    let names: HashMap<PodId, String> = ix
        .list_pods(None)
        .into_iter()
        .filter_map(|p| Some((ix.find_pod(&p.model, &p.pod)?.id, p.pod)))
        .collect();
    let mut out = Vec::new();
    for id in pods {
        let held: Vec<TierMask> = holders
            .iter()
            .map(|held| {
                held.pods
                    .iter()
                    .find(|(name, _)| Some(name) == names.get(id))
                    .map_or(TierMask::default(), |(_, tiers)| *tiers)
            })
            .collect();
        let m = crate::model::pod_match(&held, 1, false, weights);
        if m.matched_blocks > 0 {
            out.push((*id, m));
        }
    }
    out
}

/// Readers binary-search pods while their writer applies events. The
/// writer repeats: store a 100-block chain (match 100); remove its
/// 50th block, a hole (match 49: the pod is no longer prefix-closed, and
/// a binary search would see the last block and answer 100); remove the
/// orphaned tail (49); remove the rest (0). A read that overlapped
/// states `k0..=k1` must answer within their matches; a read made wholly
/// inside the hole must answer 49. The writer waits for such a read in
/// every state.
#[test]
fn concurrent_reads_stay_between_the_states_they_overlap() {
    use std::sync::atomic::AtomicU64;
    let ix = engine_indexer();
    let pod = ix.pod("m", "p", None);
    let tokens = vec![7u32; 100 * 16];
    let chain: Vec<u64> = (1..=100).collect();
    let keys: Vec<BlockKey> = chain.iter().map(|h| BlockKey(*h)).collect();
    let removed = |hashes: Vec<u64>| {
        KvEvent::Removed(crate::event::BlockRemoved {
            block_hashes: hashes.into_iter().map(EngineHash).collect(),
            ..Default::default()
        })
    };
    let script = [
        (stored(&chain, None, &tokens, 16), 100),
        (removed(vec![50]), 49),
        (removed((51..=100).rev().collect()), 49),
        (removed((1..=49).rev().collect()), 0),
    ];
    const ROUNDS: u64 = 300;
    let total = ROUNDS * script.len() as u64;
    let match_after = |k: u64| match k {
        0 => 0,
        k => script[((k - 1) % script.len() as u64) as usize].1,
    };
    // Events applied so far, and the last state read cleanly.
    let applied = AtomicU64::new(0);
    let read_in = AtomicU64::new(u64::MAX);
    let reader_failed = AtomicBool::new(false);
    // Set if the reader panics, so the writer stops waiting for it.
    struct Flag<'a>(&'a AtomicBool);
    impl Drop for Flag<'_> {
        fn drop(&mut self) {
            self.0.store(std::thread::panicking(), Ordering::Release);
        }
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            for k in 0..total {
                let (event, _) = &script[(k % script.len() as u64) as usize];
                ix.apply(&pod, k, &batch(vec![event.clone()]));
                applied.store(k + 1, Ordering::Release);
                let since = Instant::now();
                while read_in.load(Ordering::Acquire) != k + 1
                    && since.elapsed() < Duration::from_secs(10)
                    && !reader_failed.load(Ordering::Acquire)
                {
                    std::hint::spin_loop();
                }
            }
        });
        let _flag = Flag(&reader_failed);
        let mut clean_reads = 0u64;
        loop {
            let k0 = applied.load(Ordering::Acquire);
            let got = ix
                .prefix_matches("m", &keys)
                .first()
                .map_or(0, |(_, m)| m.matched_blocks);
            let k1 = applied.load(Ordering::Acquire);
            // States k0..=k1 were visible, and state k1 + 1 in flight.
            let last = (k1 + 1).min(total);
            let range = (k0..=last).map(match_after);
            let (lo, hi) = (range.clone().min().unwrap(), range.max().unwrap());
            assert!(
                (lo..=hi).contains(&got),
                "read over states {k0}..={last} answered {got}, not in {lo}..={hi}"
            );
            if k0 == k1 {
                if k0 % 4 == 2 {
                    // Inside the hole, with only the tail's removal after it.
                    assert_eq!(got, 49, "read inside the hole (state {k0})");
                }
                clean_reads += 1;
                read_in.store(k0, Ordering::Release);
            }
            if k0 == total {
                break;
            }
        }
        assert!(clean_reads >= total, "{clean_reads}");
    });
}

fn query<'a>(tokens: &'a [u32], pods: &'a [String]) -> ScoreQuery<'a> {
    ScoreQuery {
        model: "m",
        tokens,
        lora_name: None,
        cache_salt: None,
        mm_items: &[],
        pods,
    }
}

/// (pod, matched, speculative, score) per candidate, best first.
fn spec_scores(ix: &Indexer, tokens: &[u32], pods: &[String]) -> Vec<(String, u32, u32, f64)> {
    ix.score(&query(tokens, pods))
        .pods
        .into_iter()
        .map(|p| {
            (
                p.pod,
                p.matched.matched_blocks,
                p.speculative_blocks,
                p.score,
            )
        })
        .collect()
}

#[test]
fn speculative_entries_count_beside_exact_ones_and_never_in_them() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..64).collect();
    let keys = ix.request_keys("m", None, None, &tokens, 16, &[]);
    let a = ix.pod("m", "a", None);
    ix.apply(&a, 0, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
    let now = Instant::now();
    let later = now + Duration::from_secs(5);
    // `a` holds block 0 and was sent the prompt; `new` has not published.
    ix.speculate("m", "a", &keys[1..], later, now);
    ix.speculate("m", "new", &keys[..2], later, now);
    assert_eq!(
        spec_scores(&ix, &tokens, &[]),
        vec![("a".into(), 1, 4, 1.0), ("new".into(), 0, 2, 0.5),]
    );
    // Only an unbroken run counts: a hole ends it.
    ix.speculate("m", "gap", &[keys[0], keys[2]], later, now);
    let named = ["gap".to_string()];
    assert_eq!(spec_scores(&ix, &tokens, &named)[0].2, 1);
    // A block the pod holds exactly bridges its speculative ones.
    ix.apply(
        &a,
        1,
        &batch(vec![stored(&[2, 3, 4], Some(1), &tokens[16..], 16)]),
    );
    ix.speculative().supersede("m", "a", &keys[1..]);
    assert_eq!(
        spec_scores(&ix, &tokens, &["a".to_string()])[0],
        ("a".into(), 4, 4, 1.0)
    );
    // The exact index never saw a speculative key.
    assert!(ix
        .lookup(&keys[..2])
        .iter()
        .all(|k| k.pods.iter().all(|(p, _)| p == "a")));
}

#[test]
fn a_pods_cache_changing_drops_its_speculative_entries() {
    let ix = Indexer::new(IndexerConfig {
        speculative_weight: 0.5,
        ..Default::default()
    });
    let tokens: Vec<u32> = (0..64).collect();
    let keys = ix.request_keys("m", None, None, &tokens, 16, &[]);
    let now = Instant::now();
    let later = now + Duration::from_secs(5);
    let a = ix.pod("m", "a", None);
    ix.apply(&a, 0, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
    let named = ["a".to_string()];
    let check = |what: &str, change: &dyn Fn()| {
        ix.speculate("m", "a", &keys, later, now);
        let (_, matched, spec, score) = spec_scores(&ix, &tokens, &named).remove(0);
        assert_eq!(spec, 4, "{what}");
        // Tier-weighted exact, plus half a block per speculative one.
        assert_eq!(
            score,
            (f64::from(matched) + 0.5 * f64::from(4 - matched)) / 4.0
        );
        change();
        let (_, matched, spec, _) = spec_scores(&ix, &tokens, &named).remove(0);
        assert_eq!(spec, matched, "{what}");
        assert_eq!(ix.speculative().len(), 0, "{what}");
    };
    check("AllBlocksCleared", &|| {
        ix.apply(&a, 1, &batch(vec![KvEvent::AllCleared]));
    });
    check("publisher restart", &|| ix.restart_pod(&a));
    check("eviction", &|| {
        ix.apply(&a, 0, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
        ix.evict(&a, 1);
    });
    check("removal", &|| {
        ix.remove_pod(&a);
    });
}

/// vLLM's offloading connector publishes what it stored as `BlockStored`
/// with no parent and no tokens (`medium` "CPU"), each event naming the
/// blocks one step stored: a later event's first block is often the middle
/// of a chain whose parent the event does not name. A pod holding such a
/// block without its parent is not prefix-closed, so its match must come
/// from the walk: blocks 1-4 and 7-8 held, 5-6 not, match 4.
#[test]
fn an_offloaded_block_without_a_named_parent_is_not_taken_for_a_chain_start() {
    let ix = engine_indexer();
    let pod = ix.pod("m", "p", None);
    ix.apply(&pod, 0, &batch(vec![offloaded(&[1, 2, 3, 4], 16)]));
    ix.apply(&pod, 1, &batch(vec![offloaded(&[7, 8], 16)]));
    let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
    let want = walked(&ix, &[pod.id], &keys);
    assert_eq!(want[0].1.matched_blocks, 4);
    assert_eq!(ix.prefix_matches("m", &keys), want);
}

/// vLLM's offloading events carry `locality` on stores and removals alike
/// (map form, as msgspec encodes them): a `REMOTE` copy's removal (medium
/// "CPU", locality "REMOTE") releases the storage tier its store took, not
/// the pod's own CPU copy.
#[test]
fn a_remote_copys_removal_releases_the_tier_its_store_took() {
    #[derive(serde::Serialize)]
    struct Stored {
        #[serde(rename = "type")]
        ty: &'static str,
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        medium: &'static str,
        locality: Option<&'static str>,
    }
    #[derive(serde::Serialize)]
    struct Removed {
        #[serde(rename = "type")]
        ty: &'static str,
        block_hashes: Vec<u64>,
        medium: &'static str,
        locality: Option<&'static str>,
    }
    let offload = |medium, locality| Stored {
        ty: "BlockStored",
        block_hashes: vec![1],
        parent_block_hash: None,
        token_ids: vec![],
        block_size: 0,
        medium,
        locality,
    };
    let decode = |payload: Vec<u8>| crate::wire::decode_batch(&payload).expect("decodes");
    let ix = engine_indexer();
    let pod = ix.pod("m", "p", None);
    let tokens = [7u32; 16];
    ix.apply(&pod, 0, &batch(vec![stored(&[1], None, &tokens, 16)]));
    let offloads = (
        0.0f64,
        (offload("CPU", None), offload("CPU", Some("REMOTE"))),
    );
    ix.apply(
        &pod,
        1,
        &decode(rmp_serde::to_vec_named(&offloads).unwrap()),
    );
    assert_eq!(ix.list_pods(Some("m"))[0].blocks_per_tier, [1, 1, 1]);
    let removal = Removed {
        ty: "BlockRemoved",
        block_hashes: vec![1],
        medium: "CPU",
        locality: Some("REMOTE"),
    };
    ix.apply(
        &pod,
        2,
        &decode(rmp_serde::to_vec_named(&(0.0f64, (removal,))).unwrap()),
    );
    assert_eq!(ix.list_pods(Some("m"))[0].blocks_per_tier, [1, 1, 0]);
}

/// Offloading in chunks of 4 blocks (64 tokens against 16), as vLLM's
/// usage guide configures it, with the connector's default events: each
/// names a chunk by its last block's hash, and gives the chunk's size
/// (older vLLM) or 0 (newer: then `--offload-block-size` gives it). Score
/// counts what vLLM would load: whole chunks past the GPU hit, only when
/// they reach a chunk past it.
#[test]
fn offloaded_chunks_count_as_vllm_loads_them() {
    for (configured, in_events) in [(0, 64), (64, 0)] {
        let ix = Indexer::new(IndexerConfig {
            offload_block_size: configured,
            ..IndexerConfig::default()
        });
        let tokens: Vec<u32> = (0..12 * 16).collect();
        let hashes: Vec<u64> = (1..=12).collect();
        let gpu_removal = |hashes: &[u64]| {
            KvEvent::Removed(crate::event::BlockRemoved {
                block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
                ..Default::default()
            })
        };
        // a: GPU keeps blocks 1-6, chunks 2 and 3 (blocks 8 and 12)
        // offloaded: 6 on GPU, then 6 loaded (chunk 2 from block 7 on, and
        // chunk 3). b: GPU keeps 1-3, chunk 1 (block 4) offloaded: one block
        // past the GPU hit is less than a chunk, nothing loads: 3. c:
        // nothing on GPU, chunks 1 and 2 offloaded: 8, though block 1 is
        // not held at all.
        for (pod, keep, chunks) in [
            ("a", 6, vec![8, 12]),
            ("b", 3, vec![4]),
            ("c", 0, vec![4, 8]),
        ] {
            let p = ix.pod("m", pod, None);
            ix.apply(&p, 0, &batch(vec![stored(&hashes, None, &tokens, 16)]));
            ix.apply(&p, 1, &batch(vec![offloaded(&chunks, in_events)]));
            let gone: Vec<u64> = hashes[keep..].iter().rev().copied().collect();
            ix.apply(&p, 2, &batch(vec![gpu_removal(&gone)]));
        }
        let mut got: Vec<_> = score_m(&ix, &tokens)
            .pods
            .iter()
            .map(|p| {
                (
                    p.pod.clone(),
                    p.matched.matched_blocks,
                    p.matched.blocks_per_tier,
                )
            })
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                ("a".to_string(), 12, [6, 6, 0]),
                ("b".to_string(), 3, [3, 0, 0]),
                ("c".to_string(), 8, [0, 8, 0]),
            ],
            "configured {configured}, in events {in_events}"
        );
    }
}

/// In engine mode with prefix closure, a GPU hit inferred from the
/// deepest GPU block is where vLLM's offloaded chunks start: the index saw
/// only block 6 on GPU (it joined late), and chunks 2 and 3 offloaded.
#[test]
fn offloaded_chunks_count_from_an_inferred_gpu_hit() {
    let tokens: Vec<u32> = (0..12 * 16).collect();
    let (ix, hashes) = chunking_engine_indexer(&tokens);
    let p = ix.pod("m", "p", None);
    let block_6 = stored(&hashes[5..6], Some(hashes[4]), &tokens[5 * 16..6 * 16], 16);
    let offload = offloaded(&[hashes[7], hashes[11]], 0);
    ix.apply(&p, 0, &batch(vec![block_6, offload]));
    let m = score_m(&ix, &tokens).pods[0].matched;
    assert_eq!((m.matched_blocks, m.blocks_per_tier), (12, [6, 6, 0]));
}

/// With prefix closure, vLLM's GPU hit reaches the deepest block held on
/// GPU, even inside the walked run: blocks 1-3 and 5-6 on GPU (block 4's
/// GPU store lost, its offload seen), chunk 2 (block 8) offloaded. The GPU
/// hit is 6 and chunk 2 would end 2 blocks past it: nothing loads, 6.
#[test]
fn a_gpu_hit_by_closure_inside_the_walked_run_starts_the_chunks() {
    let tokens: Vec<u32> = (0..8 * 16).collect();
    let (ix, h) = chunking_engine_indexer(&tokens);
    let p = ix.pod("m", "p", None);
    ix.apply(
        &p,
        0,
        &batch(vec![
            stored(&h[..3], None, &tokens[..48], 16),
            stored(&h[4..6], Some(h[3]), &tokens[64..96], 16),
            offloaded(&[h[3]], 0),
            offloaded(&[h[7]], 0),
        ]),
    );
    let m = score_m(&ix, &tokens).pods[0].matched;
    assert_eq!((m.matched_blocks, m.blocks_per_tier), (6, [6, 0, 0]));
}

/// Pods of one model whose events give different chunk sizes each count
/// by their own: a (64 tokens, chunks of 4) and then b (32, chunks of 2),
/// both with blocks 1-6 on GPU and the chunks ending at blocks 8 and 12
/// (and 10 for b) offloaded, match all 12.
#[test]
fn each_pod_counts_chunks_of_the_size_its_events_give() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..12 * 16).collect();
    let hashes: Vec<u64> = (1..=12).collect();
    for (pod, size, chunks) in [("a", 64, vec![8, 12]), ("b", 32, vec![8, 10, 12])] {
        let p = ix.pod("m", pod, None);
        let evicted = KvEvent::Removed(crate::event::BlockRemoved {
            block_hashes: (7..=12).rev().map(EngineHash).collect(),
            ..Default::default()
        });
        let events = vec![
            stored(&hashes, None, &tokens, 16),
            offloaded(&chunks, size),
            evicted,
        ];
        ix.apply(&p, 0, &batch(events));
    }
    let got: Vec<(String, u32)> = score_m(&ix, &tokens)
        .pods
        .iter()
        .map(|p| (p.pod.clone(), p.matched.matched_blocks))
        .collect();
    assert_eq!(got, vec![("a".to_string(), 12), ("b".to_string(), 12)]);
    let sizes: Vec<u32> = ix
        .list_pods(Some("m"))
        .iter()
        .map(|p| p.offload_block_size)
        .collect();
    assert_eq!(sizes, vec![64, 32]);
}

/// A chunk size learned from a pod's events survives a snapshot: restored,
/// the pod of `each_pod_counts_chunks_of_the_size_its_events_give` still
/// counts its offloaded chunks (12 blocks), where counting them one by one
/// (the size forgotten) gives 6.
#[test]
fn a_snapshot_keeps_the_chunk_size_learned_from_events() {
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..12 * 16).collect();
    let hashes: Vec<u64> = (1..=12).collect();
    let p = ix.pod("m", "a", None);
    let evicted = KvEvent::Removed(crate::event::BlockRemoved {
        block_hashes: (7..=12).rev().map(EngineHash).collect(),
        ..Default::default()
    });
    let events = vec![
        stored(&hashes, None, &tokens, 16),
        offloaded(&[8, 12], 64),
        evicted,
    ];
    ix.apply(&p, 0, &batch(events));
    assert_eq!(score_m(&ix, &tokens).pods[0].matched.matched_blocks, 12);
    let bytes = ix.export(Vec::new()).unwrap();
    let restored = Indexer::new(IndexerConfig::default());
    assert_eq!(restored.import(std::io::Cursor::new(&bytes)).unwrap(), 1);
    assert_eq!(
        score_m(&restored, &tokens).pods[0].matched.matched_blocks,
        12
    );
    let sizes: Vec<u32> = restored
        .list_pods(Some("m"))
        .iter()
        .map(|p| p.offload_block_size)
        .collect();
    assert_eq!(sizes, vec![64]);
}

/// `AllBlocksCleared` inside a batch clears what came before it in the
/// batch, and only that: stores after it in the same batch stand.
#[test]
fn a_clear_in_the_middle_of_a_batch_drops_only_what_came_before_it() {
    let tokens: Vec<u32> = (0..4 * 16).collect();
    let ix = Indexer::new(IndexerConfig::default());
    let p = ix.pod("m", "p", None);
    ix.apply(
        &p,
        0,
        &batch(vec![
            stored(&[1, 2, 3, 4], None, &tokens, 16),
            KvEvent::AllCleared,
            stored(&[1, 2], None, &tokens[..32], 16),
        ]),
    );
    assert_eq!(score_m(&ix, &tokens).pods[0].matched.matched_blocks, 2);
    let summary = &ix.list_pods(Some("m"))[0];
    assert_eq!((summary.blocks_per_tier[0], summary.applied.clears), (2, 1));
    // A clear last in a batch leaves nothing, also of the same batch.
    ix.apply(
        &p,
        1,
        &batch(vec![
            stored(&[1, 2, 3, 4], None, &tokens, 16),
            KvEvent::AllCleared,
        ]),
    );
    assert_eq!(score_m(&ix, &tokens).pods[0].matched.matched_blocks, 0);
    assert_eq!(ix.list_pods(Some("m"))[0].blocks_per_tier[0], 0);
}

#[test]
fn a_store_with_an_adapter_keys_its_blocks_from_its_tokens_not_from_their_hashes() {
    // Older vLLM hashes an adapter by a number each pod gives it: two pods
    // of one model may name different adapters' blocks alike. A store
    // without one takes the keys of the blocks the index has by its
    // hashes; one with an adapter must not.
    let ix = Indexer::new(IndexerConfig::default());
    let tokens: Vec<u32> = (0..32).collect();
    let (a, b) = (ix.pod("m", "a", None), ix.pod("m", "b", None));
    let with_lora = |name: &str| {
        let mut e = stored(&[1, 2], None, &tokens, 16);
        if let KvEvent::Stored(s) = &mut e {
            s.lora_name = Some(name.into());
        }
        e
    };
    ix.apply(&a, 0, &batch(vec![with_lora("x")]));
    ix.apply(&b, 0, &batch(vec![with_lora("y")]));
    let score = |lora: &str| {
        let out = ix.score(&ScoreQuery {
            model: "m",
            tokens: &tokens,
            lora_name: Some(lora),
            cache_salt: None,
            mm_items: &[],
            pods: &[],
        });
        out.pods
            .iter()
            .filter(|p| p.matched.matched_blocks > 0)
            .map(|p| (p.pod.clone(), p.matched.matched_blocks))
            .collect::<Vec<_>>()
    };
    assert_eq!(score("x"), vec![("a".to_string(), 2)]);
    assert!(score("y").iter().all(|(pod, _)| pod != "a"));
}

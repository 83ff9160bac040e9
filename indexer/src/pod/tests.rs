//! The run layout fed by `PodFeed` against the tests' model of the index
//! (`model`: each pod's blocks in a map by engine hash, answered block by
//! block) fed by the same events: random
//! vLLM-shaped histories (chains stored under parents held or not,
//! repeats, removals of held and unknown blocks, offloads by hash alone,
//! adapters, groups that are not full attention, malformed stores,
//! clears), in both key modes. After every event both must count the
//! same, key every name alike, and give every prompt of the history's
//! chains the same answers for every pod: its first-miss match (blocks,
//! per tier, per best tier), every stretch it holds, and its match under
//! Score's rules (prefix closure, offloaded chunks; drawn per history).

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::event::{EngineHash, TierMask};
use crate::index::HeldAlong;
use crate::keys::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo};
use crate::keys::scheme::KeySchemes;
use crate::model;
use crate::score::{match_pods, Candidate, MatchRules, PrefixMatch};

const BS: usize = 4;
const MODEL: &str = "m";
const PODS: u32 = 3;

/// A forest of blocks: each node's parent (an earlier node) or none.
#[derive(Clone, Debug)]
struct Forest(Vec<Option<usize>>);

impl Forest {
    fn path(&self, mut n: usize) -> Vec<usize> {
        let mut p = vec![n];
        while let Some(up) = self.0[n] {
            p.push(up);
            n = up;
        }
        p.reverse();
        p
    }

    fn tokens(&self, nodes: &[usize]) -> Vec<u32> {
        nodes
            .iter()
            .flat_map(|&n| (0..BS as u32).map(move |i| n as u32 * 16 + i))
            .collect()
    }
}

/// A node's engine hash as `pod` names it (`lora`: under the adapter).
/// Engine keys need every pod to name a block alike (one hash seed: else
/// their blocks would match no other pod's prompt), the adapter's blocks
/// too; token keys are tested with pods of two hash seeds, so that one
/// block has two names.
fn engine_hash(engine_mode: bool, pod: u32, node: usize, lora: bool) -> u64 {
    let family = if engine_mode { 0 } else { u64::from(pod % 2) };
    let x = (node as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ family << 40
        ^ u64::from(lora) << 50;
    crate::keys::chain(x, &[7]).0 | 1
}

#[derive(Clone, Debug)]
enum Op {
    /// `pod` stores the path to `node` from its `from`-th block (under
    /// the block before it, if any), on `tier` (0 GPU, 1 CPU, 2 storage),
    /// with tokens unless `hash_only`; `lora`: under an adapter.
    Store {
        pod: u32,
        node: usize,
        from: usize,
        tier: u8,
        hash_only: bool,
        lora: bool,
    },
    /// `pod` removes these nodes' blocks (held or not) from `tier`, the
    /// adapter's if `lora`.
    Remove {
        pod: u32,
        nodes: Vec<usize>,
        tier: u8,
        lora: bool,
    },
    /// `pod` offloads these nodes' blocks (the adapter's if `lora`) to
    /// `tier` by hash alone, with no parent and no adapter named, as
    /// vLLM's offloading connectors do: from several chains' middles.
    Offload {
        pod: u32,
        nodes: Vec<usize>,
        tier: u8,
        lora: bool,
    },
    Clear {
        pod: u32,
    },
    /// A store or removal of a sliding-window group (ignored).
    OtherGroup {
        pod: u32,
        node: usize,
        store: bool,
    },
    /// A store whose tokens do not fit its blocks (counted, ignored).
    Malformed {
        pod: u32,
        node: usize,
    },
}

fn op(nodes: usize) -> impl Strategy<Value = Op> {
    let pod = 0..PODS;
    let node = 0..nodes;
    prop_oneof![
        6 => (pod.clone(), node.clone(), 0..4usize, prop::sample::select(vec![0u8, 0, 0, 1, 2]), prop::bool::weighted(0.2), prop::bool::weighted(0.15))
            .prop_map(|(pod, node, from, tier, hash_only, lora)| Op::Store { pod, node, from, tier, hash_only, lora }),
        3 => (pod.clone(), prop::collection::vec(node.clone(), 1..4), 0..3u8, prop::bool::weighted(0.15))
            .prop_map(|(pod, nodes, tier, lora)| Op::Remove { pod, nodes, tier, lora }),
        2 => (pod.clone(), prop::collection::vec(node.clone(), 1..5), 1..3u8, prop::bool::weighted(0.2))
            .prop_map(|(pod, nodes, tier, lora)| Op::Offload { pod, nodes, tier, lora }),
        1 => pod.clone().prop_map(|pod| Op::Clear { pod }),
        1 => (pod.clone(), node.clone(), any::<bool>()).prop_map(|(pod, node, store)| Op::OtherGroup { pod, node, store }),
        1 => (pod, node).prop_map(|(pod, node)| Op::Malformed { pod, node }),
    ]
}

fn forest() -> impl Strategy<Value = Forest> {
    (2..14usize)
        .prop_flat_map(|n| {
            (0..n)
                .map(|i| {
                    if i == 0 {
                        Just(None).boxed()
                    } else {
                        prop::option::weighted(0.8, 0..i).boxed()
                    }
                })
                .collect::<Vec<_>>()
        })
        .prop_map(Forest)
}

fn medium(tier: u8) -> Option<String> {
    match tier {
        0 => None,
        1 => Some("CPU".into()),
        _ => Some("DISK".into()),
    }
}

/// The event `op` sends, as vLLM would.
fn event(forest: &Forest, engine_mode: bool, op: &Op) -> KvEvent {
    let name = |pod, n, lora| EngineHash(engine_hash(engine_mode, pod, n, lora));
    match *op {
        Op::Store {
            pod,
            node,
            from,
            tier,
            hash_only,
            lora,
        } => {
            let path = forest.path(node);
            let from = from.min(path.len() - 1);
            let blocks = &path[from..];
            KvEvent::Stored(BlockStored {
                block_hashes: blocks.iter().map(|&n| name(pod, n, lora)).collect(),
                parent_block_hash: from.checked_sub(1).map(|p| name(pod, path[p], lora)),
                token_ids: if hash_only {
                    Vec::new()
                } else {
                    forest.tokens(blocks)
                },
                block_size: Some(BS as u32),
                medium: medium(tier),
                lora_name: lora.then(|| "sql".to_owned()),
                extra_keys: Some(vec![None; blocks.len()]),
                ..BlockStored::default()
            })
        }
        Op::Remove {
            pod,
            ref nodes,
            tier,
            lora,
        } => KvEvent::Removed(BlockRemoved {
            block_hashes: nodes.iter().map(|&n| name(pod, n, lora)).collect(),
            medium: medium(tier),
            group_idx: None,
            locality: None,
        }),
        Op::Offload {
            pod,
            ref nodes,
            tier,
            lora,
        } => KvEvent::Stored(BlockStored {
            block_hashes: nodes.iter().map(|&n| name(pod, n, lora)).collect(),
            medium: medium(tier),
            ..BlockStored::default()
        }),
        Op::Clear { .. } => KvEvent::AllCleared,
        Op::OtherGroup { pod, node, store } => {
            let hashes = vec![name(pod, node, false)];
            if store {
                KvEvent::Stored(BlockStored {
                    block_hashes: hashes,
                    token_ids: forest.tokens(&[node]),
                    block_size: Some(BS as u32),
                    group_idx: Some(1),
                    kv_cache_spec_kind: Some("sliding_window".into()),
                    ..BlockStored::default()
                })
            } else {
                KvEvent::Removed(BlockRemoved {
                    block_hashes: hashes,
                    medium: None,
                    group_idx: Some(1),
                    locality: None,
                })
            }
        }
        Op::Malformed { pod, node } => KvEvent::Stored(BlockStored {
            block_hashes: vec![name(pod, node, false)],
            token_ids: vec![1; BS + 1],
            block_size: Some(BS as u32),
            ..BlockStored::default()
        }),
    }
}

fn pod_of(op: &Op) -> u32 {
    match *op {
        Op::Store { pod, .. }
        | Op::Remove { pod, .. }
        | Op::Offload { pod, .. }
        | Op::Clear { pod }
        | Op::OtherGroup { pod, .. }
        | Op::Malformed { pod, .. } => pod,
    }
}

fn schemes(engine_mode: bool) -> KeySchemes {
    if engine_mode {
        // Tagged extra keys and no adapter paths: an adapter's blocks
        // cannot be engine keyed, so they are token keyed, in both.
        let hasher = EngineHasher::new(HashAlgo::Sha256, "seed", ExtraKeyStyle::Tagged);
        KeySchemes::engine(hasher, false, 4)
    } else {
        KeySchemes::default()
    }
}

/// Every pod's (blocks, per tier, best tier) for a prompt.
type Answers = HashMap<u32, (u32, [u32; TIERS], [u32; TIERS])>;

/// Pods' matches, by pod.
type Matches = Vec<(u32, PrefixMatch)>;

/// The keys of the prompt of the path to `node` (`lora`: under the
/// adapter), and whether they are engine keys.
fn prompt_keys(
    mode: &KeyMode,
    forest: &Forest,
    engine_mode: bool,
    node: usize,
    lora: bool,
) -> (Vec<u64>, bool) {
    let path = forest.path(node);
    let lora_name = lora.then_some("sql");
    let (keys, engine_keys) =
        mode.request_keys(MODEL, lora_name, None, &forest.tokens(&path), BS, &[]);
    // Engine keys are the pods' own hashes (the test's are not sha256's).
    let keys: Vec<u64> = if engine_keys {
        path.iter()
            .map(|&n| engine_hash(engine_mode, 0, n, lora))
            .collect()
    } else {
        keys.into_iter().map(|k| k.0).collect()
    };
    (keys, engine_keys)
}

/// The tests' model of the index (`model::Pod` per pod, a map by engine
/// hash), answered block by block: what the runs must answer alike.
struct Reference {
    pods: Vec<model::Pod>,
    weights: TierWeights,
}

impl Reference {
    fn new() -> Self {
        Reference {
            pods: (0..PODS).map(|_| model::Pod::new(MODEL)).collect(),
            weights: TierWeights::default(),
        }
    }

    fn apply(&mut self, pod: u32, batch: &EventBatch, mode: &KeyMode) -> ApplyStats {
        self.pods[pod as usize].apply(batch, mode)
    }

    /// The tiers holding each of `keys` on `pod`.
    fn held(&self, pod: u32, keys: &[u64]) -> Vec<TierMask> {
        keys.iter()
            .map(|k| self.pods[pod as usize].tiers(*k))
            .collect()
    }

    /// Each pod's first-miss match.
    fn prefix(&self, keys: &[u64]) -> Answers {
        (0..PODS)
            .filter_map(|pod| {
                let m = model::pod_match(&self.held(pod, keys), 1, false, &self.weights);
                (m.matched_blocks > 0).then_some((
                    pod,
                    (m.matched_blocks, m.blocks_per_tier, m.best_tier_blocks),
                ))
            })
            .collect()
    }

    /// Every stretch of the prompt each pod holds.
    fn along(&self, keys: &[u64]) -> Vec<HeldAlong> {
        (0..PODS)
            .filter_map(|pod| {
                let held = self.held(pod, keys);
                let mut spans: Vec<(Tier, u32, u32)> = Vec::new();
                for tier in Tier::ALL {
                    for (j, mask) in held.iter().enumerate() {
                        let j = j as u32;
                        if !mask.contains(tier) {
                            continue;
                        }
                        match spans.last_mut() {
                            Some((t, _, end)) if *t == tier && *end == j => *end += 1,
                            _ => spans.push((tier, j, j + 1)),
                        }
                    }
                }
                (!spans.is_empty()).then_some(HeldAlong { pod, spans })
            })
            .collect()
    }

    /// Each pod's match under Score's rules: a candidate if it holds block
    /// 0, or with closure any pod, or without it and with chunks a pod
    /// holding the first chunk's last block.
    fn rules(&self, keys: &[u64], closure: bool, chunk: u32) -> Matches {
        let mut out = Vec::new();
        for pod in 0..PODS {
            let held = self.held(pod, keys);
            let first_chunk = !closure
                && chunk > 1
                && keys.len() >= chunk as usize
                && !held[chunk as usize - 1].is_empty();
            let candidate = closure || held.first().is_some_and(|m| !m.is_empty()) || first_chunk;
            if !candidate || keys.is_empty() {
                continue;
            }
            let m = model::pod_match(&held, chunk, closure, &self.weights);
            if m.matched_blocks > 0 {
                out.push((pod, m));
            }
        }
        out
    }
}

/// The runs' answers for a prompt: each pod's first-miss match, every
/// stretch each holds, and each one's match under Score's rules (prefix
/// closure if `closure` and the keys are engine keys, offloaded chunks of
/// `chunk` blocks).
fn runs_answers(
    runs: &KeyedRuns,
    keys: &[u64],
    engine_keys: bool,
    rules: Rules,
) -> (Answers, Vec<HeldAlong>, Matches) {
    let index = runs.for_request(engine_keys);
    let prefix = index
        .prefix_matches(keys)
        .into_iter()
        .map(|m| (m.pod, (m.blocks, m.per_tier, m.best_tier)))
        .collect();
    let candidates: Vec<Candidate> = (0..PODS)
        .map(|pod| Candidate {
            pod,
            chunk: rules.chunk,
        })
        .collect();
    let matched = match_pods(
        index,
        keys,
        &candidates,
        MatchRules {
            closure: rules.closure && engine_keys,
            model_chunk: rules.chunk,
        },
        &TierWeights::default(),
    )
    .into_iter()
    .map(|(at, m)| (candidates[at].pod, m))
    .collect();
    (prefix, index.held_along(keys), matched)
}

/// Score's rules a history's prompts are also matched under.
#[derive(Clone, Copy, Debug)]
struct Rules {
    /// Prefix closure (on engine keys).
    closure: bool,
    /// Blocks per offloaded chunk (1: none).
    chunk: u32,
}

fn rules() -> impl Strategy<Value = Rules> {
    (any::<bool>(), prop::sample::select(vec![1u32, 1, 2, 3]))
        .prop_map(|(closure, chunk)| Rules { closure, chunk })
}

fn check_history(
    engine_mode: bool,
    forest: &Forest,
    ops: &[Op],
    rules: Rules,
) -> Result<(), TestCaseError> {
    let keys = schemes(engine_mode);
    let mode = keys.for_model(MODEL).clone();
    let mut reference = Reference::new();
    let runs = KeyedRuns::new(&TierWeights::default(), false);
    let mut feeds: Vec<PodFeed> = (0..PODS).map(|p| PodFeed::new(p, MODEL)).collect();
    for (seq, op) in ops.iter().enumerate() {
        let p = pod_of(op);
        let batch = EventBatch {
            events: vec![event(forest, engine_mode, op)],
            ..EventBatch::default()
        };
        let want = reference.apply(p, &batch, &mode);
        let got = feeds[p as usize].apply(&runs, &batch, &mode);
        prop_assert_eq!(got, want, "event {}: {:?}", seq, op);
        for (p, feed) in feeds.iter().enumerate() {
            let state = &reference.pods[p];
            prop_assert_eq!(
                feed.held_per_tier(&runs),
                state.held_per_tier(),
                "p{}'s blocks per tier after {:?}",
                p,
                op
            );
            // Every name the pod could give a block keys as the reference.
            for n in 0..forest.0.len() {
                for lora in [false, true] {
                    let h = engine_hash(engine_mode, p as u32, n, lora);
                    prop_assert_eq!(
                        feed.key_of(&runs, h),
                        state.key_of(h).map(BlockKey),
                        "p{}'s key of node {} (adapter: {}) after {:?}",
                        p,
                        n,
                        lora,
                        op
                    );
                }
            }
        }
        for node in 0..forest.0.len() {
            for lora in [false, true] {
                let (keys, engine_keys) = prompt_keys(&mode, forest, engine_mode, node, lora);
                let want = (
                    reference.prefix(&keys),
                    reference.along(&keys),
                    reference.rules(&keys, rules.closure && engine_keys, rules.chunk),
                );
                let got = runs_answers(&runs, &keys, engine_keys, rules);
                prop_assert_eq!(
                    got,
                    want,
                    "the path to {} (adapter: {}, {:?}) after {:?}",
                    node,
                    lora,
                    rules,
                    op
                );
            }
        }
    }
    Ok(())
}

/// A forest, up to 40 events over it, and Score's rules.
fn history() -> impl Strategy<Value = (Forest, Vec<Op>, Rules)> {
    forest().prop_flat_map(|f| {
        let n = f.0.len();
        (Just(f), prop::collection::vec(op(n), 1..40), rules())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn token_keyed_pods_feed_the_runs_as_the_model((forest, ops, rules) in history()) {
        check_history(false, &forest, &ops, rules)?;
    }

    #[test]
    fn engine_keyed_pods_feed_the_runs_as_the_model((forest, ops, rules) in history()) {
        check_history(true, &forest, &ops, rules)?;
    }
}

/// Hand-made histories: one model's pods sharing one `KeyedRuns`.
mod rules {
    use super::*;
    use crate::event::ExtraKey;
    use crate::keys::{prompt_keys, request_root_seed};

    /// Pods of model "m", token keys unless a test says otherwise.
    struct Pods {
        runs: KeyedRuns,
        feeds: Vec<PodFeed>,
        stats: ApplyStats,
    }

    impl Pods {
        fn new(n: u32) -> Pods {
            Pods {
                runs: KeyedRuns::new(&TierWeights::default(), false),
                feeds: (0..n).map(|p| PodFeed::new(p, "m")).collect(),
                stats: ApplyStats::default(),
            }
        }

        fn apply_as(&mut self, pod: u32, event: KvEvent, mode: &KeyMode) {
            let batch = EventBatch {
                events: vec![event],
                ..EventBatch::default()
            };
            let stats = self.feeds[pod as usize].apply(&self.runs, &batch, mode);
            self.stats.add(&stats);
        }

        fn store(&mut self, pod: u32, ev: BlockStored) {
            self.apply_as(pod, KvEvent::Stored(ev), &KeyMode::Token);
        }

        fn remove(&mut self, pod: u32, ev: BlockRemoved) {
            self.apply_as(pod, KvEvent::Removed(ev), &KeyMode::Token);
        }

        /// `pod`'s leading blocks of a token-keyed prompt, and on which
        /// tiers.
        fn held(&self, pod: u32, keys: &[BlockKey]) -> (u32, [u32; TIERS]) {
            self.runs
                .token
                .prefix_matches(BlockKey::as_raw(keys))
                .into_iter()
                .find(|m| m.pod == pod)
                .map_or((0, [0; TIERS]), |m| (m.blocks, m.per_tier))
        }
    }

    const BS: usize = 4;

    fn tokens(n: usize, base: u32) -> Vec<u32> {
        (0..n as u32).map(|i| base + i).collect()
    }

    fn plain(t: &[u32]) -> Vec<BlockKey> {
        prompt_keys(request_root_seed("m", None, None), t, BS)
    }

    fn store(hashes: &[u64], parent: Option<u64>, toks: &[u32]) -> BlockStored {
        BlockStored {
            block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids: toks.to_vec(),
            block_size: Some(BS as u32),
            ..Default::default()
        }
    }

    fn removed(hashes: &[u64]) -> BlockRemoved {
        BlockRemoved {
            block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn stored_blocks_match_request_keys_across_batches() {
        let mut pods = Pods::new(1);
        let t = tokens(12, 100);
        pods.store(0, store(&[1, 2], None, &t[..8]));
        pods.store(0, store(&[3], Some(2), &t[8..]));
        assert_eq!(pods.held(0, &plain(&t)).0, 3);
        assert_eq!(pods.stats.stored_blocks, 3);
        assert_eq!(pods.feeds[0].block_size(), Some(BS as u32));
    }

    #[test]
    fn double_store_needs_double_remove() {
        let mut pods = Pods::new(1);
        let t = tokens(4, 0);
        pods.store(0, store(&[1], None, &t));
        pods.store(0, store(&[1], None, &t));
        pods.remove(0, removed(&[1]));
        assert_eq!(pods.held(0, &plain(&t)).0, 1);
        pods.remove(0, removed(&[1]));
        assert_eq!(pods.held(0, &plain(&t)).0, 0);
        pods.remove(0, removed(&[1]));
        assert_eq!(pods.stats.unknown_removals, 1);
        assert_eq!(pods.runs.token.blocks(), 0);
    }

    #[test]
    fn unknown_parent_is_counted_and_touches_nothing() {
        let mut pods = Pods::new(1);
        pods.store(0, store(&[5, 6], Some(99), &tokens(8, 0)));
        assert_eq!(pods.stats.parent_unknown_blocks, 2);
        assert_eq!(pods.runs.token.blocks(), 0);
        pods.remove(0, removed(&[5]));
        assert_eq!(pods.stats.unknown_removals, 1);
    }

    /// An engine-keyed model with an adapter it cannot engine key: a block
    /// offloaded by hash alone is keyed by its hash, so a store under it
    /// with the adapter (token keyed) has no token key to chain from. Its
    /// blocks would get keys no prompt has; they are counted as under an
    /// unknown parent instead.
    #[test]
    fn an_adapter_store_under_a_hash_keyed_parent_is_under_an_unknown_parent() {
        let hasher = EngineHasher::new(
            HashAlgo::Sha256,
            crate::keys::engine_hash::DEFAULT_SEED,
            ExtraKeyStyle::Tagged,
        );
        let mode = KeySchemes::engine(hasher, false, 0).default;
        let mut pods = Pods::new(1);
        let offload = BlockStored {
            block_hashes: vec![EngineHash(5)],
            medium: Some("CPU".into()),
            ..Default::default()
        };
        pods.apply_as(0, KvEvent::Stored(offload), &mode);
        assert_eq!(pods.feeds[0].key_of(&pods.runs, 5), Some(BlockKey(5)));
        let mut child = store(&[6], Some(5), &tokens(4, 0));
        child.lora_name = Some("sql".into());
        pods.apply_as(0, KvEvent::Stored(child), &mode);
        assert_eq!(pods.stats.parent_unknown_blocks, 1);
        assert_eq!(pods.stats.stored_blocks, 1, "the offload only");
        assert_eq!(pods.feeds[0].key_of(&pods.runs, 6), None);
    }

    #[test]
    fn tier_only_store_adds_a_tier_to_known_hashes() {
        let mut pods = Pods::new(1);
        let t = tokens(4, 0);
        pods.store(0, store(&[1], None, &t));
        let mut offload = store(&[1, 2], None, &[]);
        offload.medium = Some("CPU".into());
        pods.store(0, offload);
        assert_eq!(pods.stats.unkeyable_blocks, 1);
        assert_eq!(pods.feeds[0].held_per_tier(&pods.runs), [1, 1, 0]);
        pods.remove(0, removed(&[1]));
        // Still on CPU, only.
        assert_eq!(pods.held(0, &plain(&t)), (1, [0, 1, 0]));
    }

    #[test]
    fn clear_drops_only_this_pod() {
        let mut pods = Pods::new(2);
        let t = tokens(8, 0);
        pods.store(0, store(&[1, 2], None, &t));
        pods.store(1, store(&[1, 2], None, &t));
        pods.apply_as(0, KvEvent::AllCleared, &KeyMode::Token);
        assert_eq!(pods.held(0, &plain(&t)).0, 0);
        assert_eq!(pods.held(1, &plain(&t)).0, 2);
        assert_eq!(pods.feeds[0].held_per_tier(&pods.runs), [0; TIERS]);
        // Stores after a clear start from scratch again.
        pods.store(0, store(&[3], Some(1), &t[4..]));
        assert_eq!(pods.stats.parent_unknown_blocks, 1);
    }

    #[test]
    fn non_full_attention_groups_are_ignored_including_their_removals() {
        let mut pods = Pods::new(1);
        let t = tokens(4, 0);
        let mut full = store(&[1], None, &t);
        full.group_idx = Some(0);
        full.kv_cache_spec_kind = Some("full_attention".into());
        let mut swa = full.clone();
        swa.group_idx = Some(1);
        swa.kv_cache_spec_kind = Some("sliding_window".into());
        pods.store(0, full);
        pods.store(0, swa);
        let mut rm = removed(&[1]);
        rm.group_idx = Some(1);
        pods.remove(0, rm);
        assert_eq!(pods.stats.non_full_attention_events, 2);
        assert_eq!(pods.feeds[0].held_per_tier(&pods.runs), [1, 0, 0]);
    }

    #[test]
    fn lora_and_salt_extra_keys_make_request_compatible_keys() {
        let mut pods = Pods::new(1);
        let t = tokens(8, 0);
        // Bare form (as vLLM 0.33 events carry it): salt on block 0, LoRA
        // on all.
        let mut ev = store(&[1, 2], None, &t);
        ev.lora_name = Some("sql".into());
        ev.extra_keys = Some(vec![
            Some(vec![
                ExtraKey::Str("sql".into()),
                ExtraKey::Str("tenant".into()),
            ]),
            Some(vec![ExtraKey::Str("sql".into())]),
        ]);
        pods.store(0, ev);
        // Tagged form (0.31+ hashing tuples), no lora_name field.
        let mut tagged = store(&[3, 4], None, &t);
        let lora = ExtraKey::List(vec![
            ExtraKey::Str("lora".into()),
            ExtraKey::Str("chat".into()),
            ExtraKey::Str("/p".into()),
        ]);
        tagged.extra_keys = Some(vec![
            Some(vec![
                lora.clone(),
                ExtraKey::List(vec![
                    ExtraKey::Str("cache_salt".into()),
                    ExtraKey::Str("t2".into()),
                ]),
            ]),
            Some(vec![lora]),
        ]);
        pods.store(0, tagged);
        let want = |lora, salt| prompt_keys(request_root_seed("m", lora, salt), &t, BS);
        assert_eq!(pods.held(0, &want(Some("sql"), Some("tenant"))).0, 2);
        assert_eq!(pods.held(0, &want(Some("chat"), Some("t2"))).0, 2);
        assert_eq!(pods.held(0, &want(Some("sql"), None)).0, 0);
        assert_eq!(pods.held(0, &want(None, Some("tenant"))).0, 0);
        assert_eq!(pods.held(0, &want(None, None)).0, 0);
    }

    #[test]
    fn id_only_lora_never_matches_a_plain_prompt() {
        let mut pods = Pods::new(1);
        let t = tokens(4, 0);
        let mut ev = store(&[1], None, &t);
        ev.lora_id = Some(3);
        pods.store(0, ev);
        assert_eq!(pods.stats.stored_blocks, 1);
        assert_eq!(pods.held(0, &plain(&t)).0, 0);
    }

    #[test]
    fn malformed_token_counts_are_rejected() {
        let mut pods = Pods::new(1);
        pods.store(0, store(&[1, 2], None, &tokens(7, 0)));
        let mut zero = store(&[1], None, &tokens(4, 0));
        zero.block_size = Some(0);
        pods.store(0, zero);
        assert_eq!(pods.stats.malformed_stores, 2);
        assert_eq!(pods.runs.token.blocks(), 0);
    }
}

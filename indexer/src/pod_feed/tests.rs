//! The run layout fed by `PodFeed` against the index the service kept
//! before it (`pod::PodState` per pod over a `BlockIndex`, answered by
//! `score`'s and `offload`'s walks) fed by the same events: random
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
use crate::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo};
use crate::event::{EngineHash, EventBatch};
use crate::index::{BlockIndex, PodId};
use crate::offload::chunked_match;
use crate::pod::PodState;
use crate::run_score::{match_pods, Candidate, MatchRules};
use crate::runs::HeldAlong;
use crate::scheme::KeySchemes;
use crate::score::{extend_prefix_closed, walk, walk_with_gpu_runs, PrefixMatch};

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
    let (keys, engine_keys) = mode.request_keys(MODEL, lora_name, None, &forest.tokens(&path), BS);
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

/// The index the service kept before the runs: each pod's `PodState` (a
/// map by engine hash) over one `BlockIndex` of holders per key, answered
/// by `score`'s and `offload`'s walks over the holders of each key. What
/// the runs must answer alike.
struct Reference {
    index: BlockIndex,
    pods: Vec<PodState>,
    weights: TierWeights,
}

impl Reference {
    fn new() -> Self {
        Reference {
            index: BlockIndex::new(),
            pods: (0..PODS).map(|p| PodState::new(PodId(p), MODEL)).collect(),
            weights: TierWeights::default(),
        }
    }

    fn apply(&mut self, pod: u32, batch: &EventBatch, mode: &KeyMode) -> ApplyStats {
        let mut stats = ApplyStats::default();
        let state = &mut self.pods[pod as usize];
        for event in &batch.events {
            match event {
                KvEvent::Stored(ev) => state.store(&self.index, ev, mode, &mut stats),
                KvEvent::Removed(ev) => state.remove(&self.index, ev, &mut stats),
                KvEvent::AllCleared => state.clear(&self.index, &mut stats),
            }
        }
        stats
    }

    fn ids(&self) -> Vec<PodId> {
        (0..PODS).map(PodId).collect()
    }

    fn block_keys(keys: &[u64]) -> Vec<BlockKey> {
        keys.iter().map(|k| BlockKey(*k)).collect()
    }

    /// Each pod's first-miss match.
    fn prefix(&self, keys: &[u64]) -> Answers {
        let ids = self.ids();
        walk(&self.index, &Self::block_keys(keys), &ids, &self.weights)
            .into_iter()
            .zip(ids)
            .filter(|(m, _)| m.matched_blocks > 0)
            .map(|(m, id)| {
                (
                    id.0,
                    (m.matched_blocks, m.blocks_per_tier, m.best_tier_blocks),
                )
            })
            .collect()
    }

    /// Every stretch of the prompt each pod holds, from the holders of
    /// each key.
    fn along(&self, keys: &[u64]) -> Vec<HeldAlong> {
        let mut on: HashMap<(u32, Tier), Vec<u32>> = HashMap::new();
        for (j, key) in keys.iter().enumerate() {
            self.index.with_holders(BlockKey(*key), |holders| {
                for h in holders.iter() {
                    for tier in h.tiers().tiers() {
                        on.entry((h.pod().0, tier)).or_default().push(j as u32);
                    }
                }
            });
        }
        let mut pods: Vec<u32> = on.keys().map(|(p, _)| *p).collect();
        pods.sort_unstable();
        pods.dedup();
        pods.into_iter()
            .map(|pod| {
                let mut spans: Vec<(Tier, u32, u32)> = Vec::new();
                for tier in Tier::ALL {
                    for &j in on.get(&(pod, tier)).map_or(&[][..], Vec::as_slice) {
                        match spans.last_mut() {
                            Some((t, _, end)) if *t == tier && *end == j => *end += 1,
                            _ => spans.push((tier, j, j + 1)),
                        }
                    }
                }
                HeldAlong { pod, spans }
            })
            .collect()
    }

    /// Each pod's match under Score's rules, as the service's lookup gave
    /// it: the holders of block 0 (every pod with closure, and the holders
    /// of the first chunk's last block without) walked, extended to the
    /// deepest GPU block by closure, counted by chunks.
    fn rules(&self, keys: &[u64], closure: bool, chunk: u32) -> Matches {
        let keys = Self::block_keys(keys);
        let holds = |key: BlockKey, pod: PodId| {
            self.index
                .with_holders(key, |h| h.get(pod).is_some_and(|t| !t.is_empty()))
        };
        let mut out = Vec::new();
        for pod in self.ids() {
            let first_chunk = !closure
                && chunk > 1
                && keys.len() >= chunk as usize
                && holds(keys[chunk as usize - 1], pod);
            let candidate = closure || keys.first().is_some_and(|k| holds(*k, pod)) || first_chunk;
            if !candidate || keys.is_empty() {
                continue;
            }
            let (mut walked, mut gpu_runs) =
                walk_with_gpu_runs(&self.index, &keys, &[pod], &self.weights);
            if closure {
                extend_prefix_closed(
                    &self.index,
                    &keys,
                    &[pod],
                    &mut walked,
                    &mut gpu_runs,
                    &[chunk > 1],
                    &self.weights,
                );
            }
            if chunk > 1 {
                walked[0] =
                    chunked_match(&self.index, &keys, pod, chunk, gpu_runs[0], &self.weights);
            }
            if walked[0].matched_blocks > 0 {
                out.push((pod.0, walked[0]));
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
                        state.key_of(EngineHash(h)),
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
    fn token_keyed_pods_feed_the_runs_as_the_service_index((forest, ops, rules) in history()) {
        check_history(false, &forest, &ops, rules)?;
    }

    #[test]
    fn engine_keyed_pods_feed_the_runs_as_the_service_index((forest, ops, rules) in history()) {
        check_history(true, &forest, &ops, rules)?;
    }
}

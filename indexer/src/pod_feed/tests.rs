//! The run layout fed by `PodFeed` against the service's index fed by the
//! same events: random vLLM-shaped histories (chains stored under parents
//! held or not, repeats, removals of held and unknown blocks, offloads by
//! hash alone, adapters, groups that are not full attention, malformed
//! stores, clears), in both key modes. After every event both must count
//! the same, and every prompt of the history's chains must get the same
//! answer from both for every pod: blocks, and blocks per tier and per
//! best tier; every stretch of it each pod holds; and each pod's match
//! under Score's rules (prefix closure, offloaded chunks: `run_score`
//! against the service's lookup), with the rules drawn per history.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo};
use crate::event::{EngineHash, EventBatch};
use crate::run_score::{match_pods, Candidate, MatchRules};
use crate::runs::HeldAlong;
use crate::scheme::KeySchemes;
use crate::score::PrefixMatch;
use crate::{Indexer, IndexerConfig};

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

/// Every pod's (blocks, per tier, best tier) for the prompt of the path to
/// `node`, and every stretch of it each pod holds, from the service's index
/// and from the runs.
type Answers = HashMap<u32, (u32, [u32; TIERS], [u32; TIERS])>;

/// The keys of the prompt of the path to `node` (`lora`: under the
/// adapter), and whether they are engine keys.
fn prompt_keys(
    ix: &Indexer,
    forest: &Forest,
    engine_mode: bool,
    node: usize,
    lora: bool,
) -> (Vec<u64>, bool) {
    let path = forest.path(node);
    let mode = ix.config().keys.for_model(MODEL);
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

fn answers(
    ix: &Indexer,
    runs: &KeyedRuns,
    keys: &[u64],
    engine_keys: bool,
) -> ((Answers, Vec<HeldAlong>), (Answers, Vec<HeldAlong>)) {
    let service = ix
        .prefix_matches(
            MODEL,
            &keys.iter().map(|k| BlockKey(*k)).collect::<Vec<_>>(),
        )
        .into_iter()
        .map(|(id, m)| {
            (
                id.0,
                (m.matched_blocks, m.blocks_per_tier, m.best_tier_blocks),
            )
        })
        .collect();
    let ours = runs
        .for_request(engine_keys)
        .prefix_matches(keys)
        .into_iter()
        .map(|m| (m.pod, (m.blocks, m.per_tier, m.best_tier)))
        .collect();
    // Every stretch each pod holds, from the service's holders of each key.
    let ids: HashMap<String, u32> = ix
        .list_pods(Some(MODEL))
        .into_iter()
        .filter_map(|p| Some((p.pod.clone(), ix.find_pod(MODEL, &p.pod)?.id.0)))
        .collect();
    let mut on: HashMap<(u32, Tier), Vec<u32>> = HashMap::new();
    let holders = ix.lookup(&keys.iter().map(|k| BlockKey(*k)).collect::<Vec<_>>());
    for (j, held) in holders.iter().enumerate() {
        for (name, tiers) in &held.pods {
            for tier in tiers.tiers() {
                on.entry((ids[name], tier)).or_default().push(j as u32);
            }
        }
    }
    let mut pods: Vec<u32> = on.keys().map(|(p, _)| *p).collect();
    pods.sort_unstable();
    pods.dedup();
    let service_along = pods
        .into_iter()
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
        .collect();
    let ours_along = runs.for_request(engine_keys).held_along(keys);
    ((service, service_along), (ours, ours_along))
}

/// Pods' matches, by pod.
type Matches = Vec<(u32, PrefixMatch)>;

/// Every pod's match under Score's rules (prefix closure if `closure` and
/// the keys are engine keys, offloaded chunks of `chunk` blocks), by pod:
/// from the service's index and from the runs (`run_score`).
fn rule_answers(
    ix: &Indexer,
    runs: &KeyedRuns,
    keys: &[u64],
    engine_keys: bool,
    closure: bool,
    chunk: u32,
) -> (Matches, Matches) {
    let closure = closure && engine_keys;
    let block_keys: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
    let service = ix
        .matches_by_rules(MODEL, &block_keys, closure, BS as u32)
        .into_iter()
        .map(|(id, m)| (id.0, m))
        .collect();
    let mut candidates: Vec<Candidate> = (0..PODS)
        .map(|p| Candidate {
            pod: ix.find_pod(MODEL, &format!("p{p}")).expect("known").id.0,
            chunk,
        })
        .collect();
    candidates.sort_unstable_by_key(|c| c.pod);
    let rules = MatchRules {
        closure,
        model_chunk: chunk,
    };
    let weights = &ix.config().tier_weights;
    let ours = match_pods(
        runs.for_request(engine_keys),
        keys,
        &candidates,
        rules,
        weights,
    )
    .into_iter()
    .map(|(at, m)| (candidates[at].pod, m))
    .collect();
    (service, ours)
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
    let ix = Indexer::new(IndexerConfig {
        default_block_size: BS as u32,
        keys: schemes(engine_mode),
        offload_block_size: if rules.chunk > 1 {
            rules.chunk * BS as u32
        } else {
            0
        },
        ..IndexerConfig::default()
    });
    let runs = KeyedRuns::new(&ix.config().tier_weights, false);
    let pods: Vec<_> = (0..PODS)
        .map(|p| ix.pod(MODEL, &format!("p{p}"), None))
        .collect();
    let mut feeds: Vec<PodFeed> = pods.iter().map(|p| PodFeed::new(p.id.0, MODEL)).collect();
    let mode = ix.config().keys.for_model(MODEL).clone();
    let mut adapter_offloaded = false;
    for (seq, op) in ops.iter().enumerate() {
        let p = pod_of(op) as usize;
        let batch = EventBatch {
            events: vec![event(forest, engine_mode, op)],
            ..EventBatch::default()
        };
        let service = ix.apply(&pods[p], seq as u64, &batch);
        let ours = feeds[p].apply(&runs, &batch, &mode);
        prop_assert_eq!(ours, service, "{:?}", op);
        for (pod, feed) in pods.iter().zip(&feeds) {
            let summary = ix
                .list_pods(Some(MODEL))
                .into_iter()
                .find(|s| s.pod == pod.name)
                .expect("listed");
            prop_assert_eq!(
                feed.held_per_tier(&runs),
                summary.blocks_per_tier,
                "{}'s blocks per tier after {:?}",
                &pod.name,
                op
            );
            // Every name the pod could give a block keys as the service's.
            let p = pod.id.0;
            let names: Vec<EngineHash> = (0..forest.0.len())
                .flat_map(|n| [false, true].map(|l| EngineHash(engine_hash(engine_mode, p, n, l))))
                .collect();
            let keys: Vec<Option<BlockKey>> =
                names.iter().map(|h| feed.key_of(&runs, h.0)).collect();
            prop_assert_eq!(
                keys,
                ix.keys_of(pod, &names),
                "{}'s keys after {:?}",
                &pod.name,
                op
            );
        }
        // An engine-keyed model's adapter block offloaded by hash before
        // its store is keyed by its hash in both, and the token chain
        // stored through it then has a block keyed unlike the prompt's.
        // The service's index binary-searches such a pod as if its linked
        // blocks were keyed as a chain (its closure is by links, not
        // keys), so its answer to the adapter's prompts is then not its
        // own first-miss walk: compared only until that happens.
        adapter_offloaded |= engine_mode && matches!(op, Op::Offload { lora: true, .. });
        for node in 0..forest.0.len() {
            for lora in [false, true] {
                if lora && adapter_offloaded {
                    continue;
                }
                let (keys, engine_keys) = prompt_keys(&ix, forest, engine_mode, node, lora);
                let (service, ours) = answers(&ix, &runs, &keys, engine_keys);
                prop_assert_eq!(
                    ours,
                    service,
                    "the path to {} (adapter: {}) after {:?}",
                    node,
                    lora,
                    op
                );
                let (service, ours) =
                    rule_answers(&ix, &runs, &keys, engine_keys, rules.closure, rules.chunk);
                prop_assert_eq!(
                    ours,
                    service,
                    "Score's matches for the path to {} (adapter: {}, {:?}) after {:?}",
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

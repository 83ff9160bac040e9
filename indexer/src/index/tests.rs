use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::published::{hash, tier_of, RUN_CAP, TIER_BITS};
use super::write::Loc;
use super::*;
use crate::event::{Tier, TIERS};

/// A forest of chained blocks: node `n`'s hash mixes its parent's hash
/// with its own id, so two paths that part at a node differ at every node
/// after it (what `prefix_matches` relies on), as engine hashes do.
struct Forest {
    parent: Vec<Option<usize>>,
    hash: Vec<u64>,
}

impl Forest {
    /// Node `i`'s parent is `parents[i] % i` (or a root, when that is `None`
    /// or `i == 0`).
    fn new(parents: &[Option<usize>]) -> Forest {
        let mut f = Forest {
            parent: Vec::new(),
            hash: Vec::new(),
        };
        for (i, p) in parents.iter().enumerate() {
            let parent = p.filter(|_| i > 0).map(|p| p % i);
            let base = parent.map_or(0x9e37_79b9, |p| f.hash[p]);
            f.hash.push(hash(
                base ^ (i as u64 + 1).wrapping_mul(0xff51_afd7_ed55_8ccd),
            ));
            f.parent.push(parent);
        }
        f
    }

    /// The nodes from `n`'s root down to `n`.
    fn path(&self, mut n: usize) -> Vec<usize> {
        let mut p = vec![n];
        while let Some(up) = self.parent[n] {
            p.push(up);
            n = up;
        }
        p.reverse();
        p
    }

    fn hashes(&self, nodes: &[usize]) -> Vec<u64> {
        nodes.iter().map(|n| self.hash[*n]).collect()
    }
}

/// `v`, checked to be in pod order, as `prefix_matches` answers.
fn in_pod_order(v: Vec<RunMatch>) -> Vec<RunMatch> {
    let pods: Vec<u32> = v.iter().map(|m| m.pod).collect();
    assert!(
        pods.windows(2).all(|w| w[0] < w[1]),
        "answers out of pod order: {pods:?}"
    );
    v
}

/// (pod, blocks) of each answer.
fn blocks(v: Vec<RunMatch>) -> Vec<(u32, u32)> {
    in_pod_order(v).iter().map(|m| (m.pod, m.blocks)).collect()
}

/// What one pod holds on one tier: how many stores of each block are not
/// removed yet.
#[derive(Clone, Debug, Default, PartialEq)]
struct Held(HashMap<u64, u32>);

impl Held {
    fn extend<'a>(&mut self, keys: impl IntoIterator<Item = &'a u64>) {
        for k in keys {
            *self.0.entry(*k).or_default() += 1;
        }
    }

    /// One store of `k` removed; false if none was left.
    fn take(&mut self, k: &u64) -> bool {
        match self.0.get_mut(k) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.0.remove(k);
            }
            None => return false,
        }
        true
    }

    fn contains(&self, k: &u64) -> bool {
        self.0.contains_key(k)
    }
}

/// The model: what each pod holds on each tier, with repeated stores
/// counted.
#[derive(Clone, Debug, Default, PartialEq)]
struct Model(HashMap<(u32, usize), Held>);

impl Model {
    /// `better`: tier indices, best first.
    fn prefix_matches(&self, keys: &[u64], better: &[usize; TIERS]) -> Vec<RunMatch> {
        let pods: HashSet<u32> = self.0.keys().map(|(pod, _)| *pod).collect();
        let mut out: Vec<RunMatch> = pods
            .into_iter()
            .map(|pod| {
                let on =
                    |tier: usize, k: &u64| self.0.get(&(pod, tier)).is_some_and(|s| s.contains(k));
                let n = keys
                    .iter()
                    .take_while(|k| (0..TIERS).any(|t| on(t, k)))
                    .count();
                let best = |k: &u64| better.iter().copied().find(|t| on(*t, k));
                RunMatch {
                    pod,
                    blocks: n as u32,
                    per_tier: std::array::from_fn(|t| {
                        keys[..n].iter().filter(|k| on(t, k)).count() as u32
                    }),
                    best_tier: std::array::from_fn(|t| {
                        keys[..n].iter().filter(|k| best(k) == Some(t)).count() as u32
                    }),
                }
            })
            .filter(|m| m.blocks > 0)
            .collect();
        out.sort_unstable();
        out
    }

    /// Every stretch of `keys` each pod holds per tier, as
    /// `RunIndex::held_along` lists them.
    fn held_along(&self, keys: &[u64]) -> Vec<HeldAlong> {
        let mut pods: Vec<u32> = self.0.keys().map(|(pod, _)| *pod).collect();
        pods.sort_unstable();
        pods.dedup();
        pods.into_iter()
            .map(|pod| {
                let mut spans = Vec::new();
                for tier in Tier::ALL {
                    let Some(held) = self.0.get(&(pod, tier.index())) else {
                        continue;
                    };
                    let mut start = None;
                    for (j, k) in keys.iter().chain([&u64::MAX]).enumerate() {
                        let on = j < keys.len() && held.contains(k);
                        match (on, start) {
                            (true, None) => start = Some(j as u32),
                            (false, Some(s)) => {
                                spans.push((tier, s, j as u32));
                                start = None;
                            }
                            _ => {}
                        }
                    }
                }
                HeldAlong { pod, spans }
            })
            .filter(|h| !h.spans.is_empty())
            .collect()
    }

    fn clear(&mut self, pod: u32) {
        self.0.retain(|(p, _), _| *p != pod);
    }

    /// The (tier, block) entries `pod` has.
    fn entries(&self, pod: u32) -> u64 {
        self.0
            .iter()
            .filter(|((p, _), _)| *p == pod)
            .map(|(_, held)| held.0.len() as u64)
            .sum()
    }

    /// `ix` evicts up to `n` of `pod`'s entries: as many as it has, each
    /// one it had, every store of it gone (later removals of it are
    /// unknown, as after a removal).
    fn evict(&mut self, ix: &RunIndex, pod: u32, n: usize) -> Result<(), TestCaseError> {
        let had = self.entries(pod);
        let dropped = ix.evict(pod, n);
        prop_assert_eq!(dropped.len() as u64, had.min(n as u64));
        for (tier, key) in dropped {
            let held = self.0.entry((pod, tier.index())).or_default();
            prop_assert!(held.0.remove(&key).is_some(), "evicted what it held");
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// The path to `node`, from its `from`-th block on (under the block
    /// before it).
    Store {
        pod: u32,
        tier: usize,
        node: usize,
        from: usize,
    },
    /// The path to `node` from its `from`-th block on, leaf first (as vLLM
    /// evicts) or root first.
    Remove {
        pod: u32,
        tier: usize,
        node: usize,
        from: usize,
        leaf_first: bool,
    },
    Clear {
        pod: u32,
    },
    Evict {
        pod: u32,
        n: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..4, 0..TIERS, any::<usize>(), 0usize..12)
            .prop_map(|(pod, tier, node, from)| Op::Store { pod, tier, node, from }),
        4 => (0u32..4, 0..TIERS, any::<usize>(), 0usize..12, any::<bool>())
            .prop_map(|(pod, tier, node, from, leaf_first)| Op::Remove { pod, tier, node, from, leaf_first }),
        1 => (0u32..4).prop_map(|pod| Op::Clear { pod }),
        1 => (0u32..4, 0usize..12).prop_map(|(pod, n)| Op::Evict { pod, n }),
    ]
}

/// What must hold whatever was applied: the table names each run block
/// once, every count is its holders' spans, no run ends in a dead block,
/// and readers see each run as the writer has it.
fn check_invariants(ix: &RunIndex) {
    let w = ix.writer.lock();
    let mut blocks = 0;
    for (id, run) in w.runs.iter().enumerate() {
        let seen = ix
            .published
            .get(id as u32)
            .read(|v| {
                let hashes: Vec<u64> = (0..v.len()).filter_map(|k| v.hash(k)).collect();
                let pods: Vec<(u32, [u32; TIERS])> =
                    v.pods().map(|p| (p.pod, p.held_below(u32::MAX))).collect();
                (hashes, pods)
            })
            .unwrap_or_default();
        // What the writer has: blocks held per pod and tier.
        let mut pods: Vec<(u32, [u32; TIERS])> = Vec::new();
        for h in &run.holdings {
            let (pod, tier) = (h.holder >> TIER_BITS, usize::from(tier_of(h.holder)));
            if pods.last().is_none_or(|(p, _)| *p != pod) {
                pods.push((pod, [0; TIERS]));
            }
            let held: u32 = h.spans.iter().map(|s| s.end - s.start).sum();
            pods.last_mut().expect("pushed").1[tier] = held;
        }
        let hashes: Vec<u64> = (0..run.len()).filter_map(|k| run.hash(k)).collect();
        assert_eq!(seen, (hashes.clone(), pods), "run {id} as published");
        if w.free.contains(&(id as u32)) {
            assert!(run.is_empty());
            continue;
        }
        assert!(!run.is_empty(), "a live run is not empty");
        assert_ne!(run.holders_of.last(), Some(&0), "dead tail left");
        let mut count = vec![0u32; hashes.len()];
        for h in &run.holdings {
            assert!(!h.spans.is_empty());
            for w in h.spans.windows(2) {
                assert!(w[0].end < w[1].start, "spans sorted, apart");
            }
            for s in &h.spans {
                assert!(s.start < s.end && s.end <= run.len());
                for off in s.start..s.end {
                    count[off as usize] += 1;
                }
            }
        }
        assert_eq!(count, run.holders_of);
        for h in &run.holdings {
            assert!(
                w.is_queued(h.holder, id as u32, h.stamp),
                "holder {} of run {id} queued",
                h.holder
            );
        }
        for (off, h) in hashes.iter().enumerate() {
            let loc = Loc {
                run: id as u32,
                off: off as u32,
            };
            let named = if w.token_keys {
                run.engine(off as u32)
            } else {
                *h
            };
            assert_eq!(w.table.find(named), Some(loc));
            if off == 0 {
                assert_eq!(ix.heads.find(*h), Some(id as u32), "a run's head");
            }
        }
        assert!(
            run.aliases().windows(2).all(|w| w[0].0 <= w[1].0),
            "aliases by offset"
        );
        blocks += hashes.len() + run.aliases().len();
    }
    assert_eq!(w.table.len(), blocks);
}

/// After an operation: the invariants, the index holding at least what
/// the model does, and every chain (from its root, as prompts are, and one
/// step further into a block nobody has) answered as the model answers.
fn check_every_chain(
    ix: &RunIndex,
    model: &Model,
    chains: impl Iterator<Item = Vec<u64>>,
) -> Result<(), TestCaseError> {
    check_invariants(ix);
    let held: HashSet<u64> = model.0.values().flat_map(|h| h.0.keys()).copied().collect();
    prop_assert!(ix.blocks() >= held.len());
    let engine_keys = !ix.writer.lock().token_keys;
    // Holdings as counted, against the runs' own lists.
    let mut holdings = [0u64; 4];
    for r in &ix.writer.lock().runs {
        for h in &r.holdings {
            holdings[(h.holder >> TIER_BITS) as usize] += 1;
        }
    }
    for pod in 0..4 {
        prop_assert_eq!(ix.entries(pod), model.entries(pod), "pod {}'s entries", pod);
        prop_assert_eq!(
            ix.usage(pod),
            (model.entries(pod), holdings[pod as usize]),
            "pod {}'s usage",
            pod
        );
        let per_tier: [u64; TIERS] =
            std::array::from_fn(|t| model.0.get(&(pod, t)).map_or(0, |h| h.0.len() as u64));
        prop_assert_eq!(ix.held_per_tier(pod), per_tier, "pod {}'s tiers", pod);
        if engine_keys {
            for &k in &held {
                let its =
                    (0..TIERS).any(|t| model.0.get(&(pod, t)).is_some_and(|h| h.contains(&k)));
                prop_assert_eq!(
                    ix.key_held_by(pod, k),
                    its.then_some(k),
                    "pod {} holds {}",
                    pod,
                    k
                );
            }
        }
    }
    for mut q in chains {
        prop_assert_eq!(
            in_pod_order(ix.prefix_matches(&q)),
            model.prefix_matches(&q, &ix.better)
        );
        prop_assert_eq!(ix.held_along(&q), model.held_along(&q));
        q.push(hash(q[q.len() - 1] ^ 7));
        prop_assert_eq!(
            in_pod_order(ix.prefix_matches(&q)),
            model.prefix_matches(&q, &ix.better)
        );
    }
    Ok(())
}

/// Every pod cleared: nothing stays indexed.
fn check_cleared(ix: &RunIndex) -> Result<(), TestCaseError> {
    for pod in 0..4 {
        ix.clear(pod);
    }
    check_invariants(ix);
    prop_assert_eq!(ix.blocks(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// After any stores (from a chain's root or from a later block, under
    /// a parent the index may not have, the same blocks again and again),
    /// removals (of held blocks or not, in either order) and clears, every
    /// chain matches as the model of counted stores does, and the index
    /// keeps only what is held.
    #[test]
    fn answers_as_counted_stores_do(
        parents in prop::collection::vec(prop::option::weighted(0.9, any::<usize>()), 1..40),
        ops in prop::collection::vec(op(), 1..60),
        better in prop::sample::select(vec![[0, 1, 2], [2, 1, 0], [1, 2, 0]]),
        near_wrap in any::<bool>(),
        bounded in any::<bool>(),
    ) {
        let ix = RunIndex::new().with_best_tiers(better.map(|t| Tier::ALL[t]));
        let ix = if bounded { ix.bounded() } else { ix };
        if near_wrap {
            // The store clock wraps within the history: stamps renumbered
            // among stale queue entries and reused runs.
            ix.writer.lock().clock = u32::MAX - 30;
        }
        check_history(&ix, Keying::Engine, &parents, &ops)?;
    }
}

/// Applies `ops` one by one, checking every chain after each, then clears
/// every pod.
fn check_history(
    ix: &RunIndex,
    keying: Keying,
    parents: &[Option<usize>],
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let forest = Forest::new(parents);
    let mut model = Model::default();
    for op in ops {
        apply(ix, &mut model, &forest, keying, op)?;
        check_every_chain(ix, &model, keying.chains(&forest))?;
    }
    check_cleared(ix)
}

/// Token keys: which hash seed a pod's engine has. Pods 0 and 1 share
/// one; pods 2 and 3 each have their own (engines whose seed differs name
/// the same blocks otherwise), so a block can have two aliases.
fn family(pod: u32) -> u64 {
    u64::from(pod.max(1) - 1)
}

/// What `pod` names a node by.
fn engine_of(forest: &Forest, pod: u32, node: usize) -> u64 {
    match family(pod) {
        0 => forest.hash[node],
        f => hash(forest.hash[node] ^ 0x5eed ^ f),
    }
}

const ROOT_SEED: u64 = 0x0dd5_eed0;
const TOKENS_PER_BLOCK: usize = 4;

fn tokens_of(path: &[usize]) -> Vec<u32> {
    path.iter()
        .flat_map(|n| (0..TOKENS_PER_BLOCK as u32).map(move |t| *n as u32 * 8 + t))
        .collect()
}

fn keys_of(path: &[usize]) -> Vec<u64> {
    crate::keys::prompt_keys(ROOT_SEED, &tokens_of(path), TOKENS_PER_BLOCK)
        .into_iter()
        .map(|k| k.0)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Keys from tokens, removals by engine hash, pods of three hash seeds
    /// naming the same blocks three ways: every chain matches as the model
    /// of counted stores does, and the index keeps only what is held.
    #[test]
    fn token_keys_answer_as_counted_stores_do(
        parents in prop::collection::vec(prop::option::weighted(0.9, any::<usize>()), 1..30),
        ops in prop::collection::vec(op(), 1..50),
    ) {
        check_history(&RunIndex::with_token_keys(), Keying::Tokens, &parents, &ops)?;
    }
}

/// What a test's pods name blocks by, and what the index keys them by.
#[derive(Clone, Copy, PartialEq)]
enum Keying {
    /// Engine hashes, the keys too.
    Engine,
    /// Keys from tokens; pods of three hash seeds (see `family`).
    Tokens,
}

impl Keying {
    fn index(self) -> RunIndex {
        match self {
            Keying::Engine => RunIndex::new(),
            Keying::Tokens => RunIndex::with_token_keys(),
        }
    }

    /// What `pod` names `node` by.
    fn name(self, forest: &Forest, pod: u32, node: usize) -> u64 {
        match self {
            Keying::Engine => forest.hash[node],
            Keying::Tokens => engine_of(forest, pod, node),
        }
    }

    /// The keys of a chain from its root.
    fn keys(self, forest: &Forest, path: &[usize]) -> Vec<u64> {
        match self {
            Keying::Engine => forest.hashes(path),
            Keying::Tokens => keys_of(path),
        }
    }

    /// Every chain from its root.
    fn chains(self, forest: &Forest) -> impl Iterator<Item = Vec<u64>> + '_ {
        (0..forest.hash.len()).map(move |n| self.keys(forest, &forest.path(n)))
    }
}

/// Applies `op` to the index and to the model, checking what the index
/// returns.
fn apply(
    ix: &RunIndex,
    model: &mut Model,
    forest: &Forest,
    keying: Keying,
    op: &Op,
) -> Result<(), TestCaseError> {
    let nodes = forest.hash.len();
    let names = |pod: u32, part: &[usize]| -> Vec<u64> {
        part.iter().map(|n| keying.name(forest, pod, *n)).collect()
    };
    match *op {
        Op::Store {
            pod,
            tier,
            node,
            from,
        } => {
            let path = forest.path(node % nodes);
            let from = from.min(path.len() - 1);
            let parent = from
                .checked_sub(1)
                .map(|i| keying.name(forest, pod, path[i]));
            let part = &path[from..];
            let engines = names(pod, part);
            let keys = keying.keys(forest, &path);
            let tier_of = Tier::ALL[tier];
            let skipped = match keying {
                Keying::Engine => {
                    ix.store(pod, tier_of, parent, &engines);
                    0
                }
                // A third of the stores keyed by the caller.
                Keying::Tokens if (node + from) % 3 == 0 => {
                    let blocks: Vec<(u64, u64)> = engines
                        .iter()
                        .copied()
                        .zip(keys[from..].iter().copied())
                        .collect();
                    ix.store_keyed(pod, tier_of, parent, &blocks)
                }
                Keying::Tokens => ix.store_tokens(
                    pod,
                    tier_of,
                    parent,
                    &engines,
                    &tokens_of(part),
                    TOKENS_PER_BLOCK,
                    ROOT_SEED,
                ),
            };
            // A parent some pod naming blocks as this one does holds is
            // known; one nobody holds may not be.
            let family = |p: u32| (keying == Keying::Tokens).then(|| family(p));
            let parent_held = from == 0
                || model.0.iter().any(|((p, _), held)| {
                    family(*p) == family(pod) && held.contains(&keys[from - 1])
                });
            if parent_held {
                prop_assert_eq!(skipped, 0);
            } else {
                prop_assert!(skipped == 0 || skipped == part.len());
            }
            if skipped == 0 {
                model
                    .0
                    .entry((pod, tier))
                    .or_default()
                    .extend(&keys[from..]);
            }
        }
        Op::Remove {
            pod,
            tier,
            node,
            from,
            leaf_first,
        } => {
            let path = forest.path(node % nodes);
            let mut part = path[from.min(path.len() - 1)..].to_vec();
            if leaf_first {
                part.reverse();
            }
            let keys = keying.keys(forest, &path);
            let held = model.0.entry((pod, tier)).or_default();
            let unknown = part
                .iter()
                .map(|n| path.iter().position(|p| p == n).expect("on the path"))
                .filter(|i| !held.take(&keys[*i]))
                .count();
            prop_assert_eq!(ix.remove(pod, Tier::ALL[tier], &names(pod, &part)), unknown);
        }
        Op::Clear { pod } => {
            ix.clear(pod);
            model.clear(pod);
        }
        Op::Evict { pod, n } => model.evict(ix, pod, n)?,
    }
    Ok(())
}

/// A dump of any index restores to one that answers as it does, dumps the
/// same, and goes on as it would (stores, removals, evictions alike).
fn check_restored(
    keying: Keying,
    bounded: bool,
    parents: &[Option<usize>],
    before: &[Op],
    after: &[Op],
) -> Result<(), TestCaseError> {
    let forest = Forest::new(parents);
    let bound = |ix: RunIndex| if bounded { ix.bounded() } else { ix };
    let ix = bound(keying.index());
    let token_keys = keying == Keying::Tokens;
    let mut model = Model::default();
    for op in before {
        apply(&ix, &mut model, &forest, keying, op)?;
    }
    let dump = ix.dump();
    prop_assert!(
        RunIndex::from_dump(dump.clone(), !token_keys).is_err(),
        "the other key mode"
    );
    let restored = bound(RunIndex::from_dump(dump.clone(), token_keys).expect("a dump restores"));
    prop_assert_eq!(restored.dump(), dump);
    check_every_chain(&restored, &model, keying.chains(&forest))?;
    let mut twin = model.clone();
    for op in after {
        apply(&ix, &mut model, &forest, keying, op)?;
        apply(&restored, &mut twin, &forest, keying, op)?;
        prop_assert_eq!(&model, &twin, "after {:?}", op);
        check_every_chain(&restored, &twin, keying.chains(&forest))?;
    }
    check_cleared(&restored)
}

proptest! {
    // Both keyings: as many cases as the two tests this was.
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn a_dump_restores_the_index(
        parents in prop::collection::vec(prop::option::weighted(0.9, any::<usize>()), 1..30),
        before in prop::collection::vec(op(), 1..40),
        after in prop::collection::vec(op(), 1..20),
        token_keys in any::<bool>(),
        bounded in any::<bool>(),
    ) {
        let keying = if token_keys { Keying::Tokens } else { Keying::Engine };
        check_restored(keying, bounded, &parents, &before, &after)?;
    }
}

/// A pod storing what another pod holds widens its span in the same run:
/// no new run, no new table entry. A branch is a run of its own.
#[test]
fn a_shared_prefix_is_one_run() {
    // Nodes 0..100 are one chain; 100..130 branch off it after node 39.
    let parents: Vec<Option<usize>> = (0..130)
        .map(|i| Some(if i == 100 { 39 } else { i.max(1) - 1 }))
        .collect();
    let forest = Forest::new(&parents);
    let chain = forest.hashes(&forest.path(99));
    let branch = forest.hashes(&forest.path(129));
    let ix = RunIndex::new();
    ix.store(0, Tier::Gpu, None, &chain);
    ix.store(1, Tier::Gpu, None, &chain[..60]);
    ix.store(2, Tier::Gpu, Some(chain[9]), &chain[10..30]);
    // One run, but for the cap on a run's length (a few blocks in tests).
    let runs = |blocks: usize| blocks.div_ceil(RUN_CAP as usize);
    assert_eq!(ix.writer.lock().runs.len(), runs(100));
    assert_eq!(ix.blocks(), 100);
    assert_eq!(
        blocks(ix.prefix_matches(&chain)),
        vec![(0, 100), (1, 60)],
        "pod 2 lacks the first block"
    );
    ix.store(3, Tier::Gpu, Some(chain[39]), &branch[40..]);
    assert_eq!(ix.writer.lock().runs.len(), runs(100) + runs(30));
    assert_eq!(blocks(ix.prefix_matches(&branch)), vec![(0, 40), (1, 40)]);
    ix.store(3, Tier::Gpu, None, &branch[..40]);
    assert_eq!(
        blocks(ix.prefix_matches(&branch)),
        vec![(0, 40), (1, 40), (3, 70)]
    );
    // Evicted leaf first, the tail is cut as it dies.
    let mut tail = chain[60..].to_vec();
    tail.reverse();
    assert_eq!(ix.remove(0, Tier::Gpu, &tail), 0);
    assert_eq!(ix.blocks(), 90);
    // Blocks another pod holds stay.
    assert_eq!(ix.remove(1, Tier::Gpu, &chain[40..60]), 0);
    assert_eq!(ix.blocks(), 90);
    let mut tail = chain[40..60].to_vec();
    tail.reverse();
    assert_eq!(ix.remove(0, Tier::Gpu, &tail), 0);
    assert_eq!(ix.blocks(), 70);
}

/// Readers run while a writer churns other pods' blocks in the same runs,
/// on every tier (stores, leaf-first evictions, clears, runs freed and
/// reused): what a
/// pod nobody writes holds is answered exactly every time, and no answer
/// names more blocks than the query has.
#[test]
fn readers_see_untouched_pods_exactly_while_a_writer_churns() {
    use std::sync::atomic::{AtomicBool, Ordering};

    // Chains of 64 blocks branching off each other every 16.
    let parents: Vec<Option<usize>> = (0..1024)
        .map(|i| Some(if i % 64 == 0 { (i / 64) * 16 } else { i - 1 }))
        .collect();
    let forest = Forest::new(&parents);
    let paths: Vec<Vec<u64>> = (0..16)
        .map(|c| forest.hashes(&forest.path(c * 64 + 63)))
        .collect();
    let ix = RunIndex::new();
    // Pod 9 holds the first half of every chain, for good.
    let mut ninth: HashSet<u64> = HashSet::new();
    for p in &paths {
        ix.store(9, Tier::Gpu, None, &p[..p.len() / 2]);
        ninth.extend(&p[..p.len() / 2]);
    }
    let want: Vec<u32> = paths
        .iter()
        .map(|p| p.iter().take_while(|h| ninth.contains(*h)).count() as u32)
        .collect();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut rng = 0x2545_f491_4f6c_dd1du64;
            for round in 0..3000 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let pod = (rng % 4) as u32;
                let p = &paths[(rng >> 8) as usize % paths.len()];
                let cut = (rng >> 16) as usize % p.len();
                let tier = Tier::ALL[(rng >> 32) as usize % TIERS];
                match round % 6 {
                    0..=2 => ix.store(pod, tier, None, p),
                    3 => {
                        let tail: Vec<u64> = p[cut..].iter().rev().copied().collect();
                        ix.remove(pod, tier, &tail);
                    }
                    4 => drop(ix.evict(pod, cut)),
                    _ => ix.clear(pod),
                }
            }
            stop.store(true, Ordering::Release);
        });
        for _ in 0..2 {
            s.spawn(|| {
                let want = &want;
                let mut asked = 0;
                while !stop.load(Ordering::Acquire) || asked < 100 {
                    let p = &paths[asked % paths.len()];
                    let got = blocks(ix.prefix_matches(p));
                    let ninth = got.iter().find(|(pod, _)| *pod == 9).map(|m| m.1);
                    assert_eq!(
                        ninth,
                        Some(want[asked % paths.len()]),
                        "pod 9, path {asked}"
                    );
                    assert!(got.iter().all(|(_, n)| *n as usize <= p.len()));
                    asked += 1;
                }
            });
        }
    });
    check_invariants(&ix);
}

/// Eviction takes the holding stored into least recently first, from its
/// end; a store into a holding makes it the newest; a block stored twice
/// goes at once (its repeat with it).
#[test]
fn eviction_takes_the_least_recently_stored_leaves_first() {
    let parents: Vec<Option<usize>> = (0..40).map(|i| (i % 8 != 0).then(|| i - 1)).collect();
    let forest = Forest::new(&parents);
    // Five chains of 8 blocks (each longer than a run in tests).
    let chain = |c: usize| forest.hashes(&forest.path(c * 8 + 7));
    let ix = RunIndex::new();
    for c in 0..4 {
        ix.store(0, Tier::Gpu, None, &chain(c));
    }
    ix.store(0, Tier::Cpu, None, &chain(4));
    // Chain 0 again: now the newest; its first block stored twice.
    ix.store(0, Tier::Gpu, None, &chain(0)[..1]);
    ix.store(1, Tier::Gpu, None, &chain(1));
    assert_eq!(ix.entries(0), 40);
    let dropped = ix.evict(0, 10);
    let want: Vec<(Tier, u64)> = chain(1)
        .iter()
        .rev()
        .chain(chain(2).iter().rev().take(2))
        .map(|k| (Tier::Gpu, *k))
        .collect();
    assert_eq!(dropped, want);
    assert_eq!(ix.entries(0), 30);
    // Pod 1 still holds chain 1; pod 0 holds chain 2 but its last two.
    let answer = |c: usize| blocks(ix.prefix_matches(&chain(c)));
    assert_eq!(answer(1), vec![(1, 8)]);
    assert_eq!(answer(2), vec![(0, 6)]);
    // Then chain 2's rest, chain 3, chain 4 (Cpu), chain 0 last.
    let dropped = ix.evict(0, 30);
    assert_eq!(dropped.len(), 30);
    assert_eq!(
        dropped[6..14].iter().map(|d| d.0).collect::<Vec<_>>(),
        [Tier::Gpu; 8]
    );
    assert!(dropped[14..22].iter().all(|d| d.0 == Tier::Cpu));
    assert_eq!(dropped[29], (Tier::Gpu, chain(0)[0]));
    assert_eq!(ix.entries(0), 0);
    // The repeat went with the block: removing it again is unknown.
    assert_eq!(ix.remove(0, Tier::Gpu, &chain(0)[..1]), 1);
    assert_eq!(ix.blocks(), 8, "pod 1's chain");
}

/// The store clock wraps after 2^32 stores: stamps are renumbered in the
/// same order first.
#[test]
fn the_store_clock_wraps_keeping_the_order() {
    let forest = Forest::new(&[None, None, None]);
    let ix = RunIndex::new();
    ix.store(0, Tier::Gpu, None, &forest.hashes(&[0]));
    ix.writer.lock().clock = u32::MAX - 1;
    ix.store(0, Tier::Gpu, None, &forest.hashes(&[1]));
    ix.store(0, Tier::Gpu, None, &forest.hashes(&[2]));
    assert!(ix.writer.lock().clock < 8, "renumbered");
    let order: Vec<u64> = ix.evict(0, 3).into_iter().map(|d| d.1).collect();
    assert_eq!(order, forest.hashes(&[0, 1, 2]));
}

/// A dump comes from a file: one that breaks a rule the index keeps is
/// refused as a whole, whichever rule.
#[test]
fn a_dump_that_breaks_a_rule_is_refused() {
    let forest = Forest::new(
        &(0..12)
            .map(|i| (i != 6).then(|| i.max(1) - 1))
            .collect::<Vec<_>>(),
    );
    let ix = RunIndex::new();
    ix.store(0, Tier::Gpu, None, &forest.hashes(&forest.path(5)));
    ix.store(1, Tier::Cpu, None, &forest.hashes(&forest.path(11)));
    ix.store(1, Tier::Cpu, None, &forest.hashes(&forest.path(7)));
    let dump = ix.dump();
    assert_eq!(dump.runs.len(), 2);
    assert_eq!(dump.repeats.len(), 2);
    assert!(RunIndex::from_dump(dump.clone(), false).is_ok());
    let refused = |what: &str, change: &dyn Fn(&mut Dump)| {
        let mut bad = dump.clone();
        change(&mut bad);
        assert!(RunIndex::from_dump(bad, false).is_err(), "{what}");
    };
    refused("a key in two runs", &|d| {
        d.runs[1].keys[3] = d.runs[0].keys[2]
    });
    refused("a run with no blocks", &|d| {
        d.runs[1].keys.clear();
        d.runs[1].holdings.clear();
    });
    refused("other names with engine keys", &|d| {
        d.runs[0].aliases.push((0, 5))
    });
    refused("a span past the run", &|d| {
        d.runs[0].holdings[0].spans[0].1 = 7
    });
    refused("an empty span", &|d| {
        d.runs[0].holdings[0].spans[0] = (2, 2)
    });
    refused("spans that touch", &|d| {
        d.runs[0].holdings[0].spans = vec![(0, 2), (2, 6)];
    });
    refused("holdings out of order", &|d| {
        let h = d.runs[0].holdings[0].clone();
        d.runs[0].holdings.push(h);
    });
    refused("a tier that is not one", &|d| {
        d.runs[0].holdings[0].tier = TIERS as u8
    });
    refused("a dead last block", &|d| {
        d.runs[0].holdings[0].spans[0].1 = 5
    });
    refused("a repeat of a block not held", &|d| d.repeats[0].pod = 0);
    refused("a repeat of nothing", &|d| d.repeats[0].count = 0);
    refused("a repeat no engine made", &|d| {
        d.repeats[0].count = u32::MAX
    });
    refused("a repeat of no block", &|d| d.repeats[0].name = 1);
    refused("two holdings stamped alike", &|d| {
        d.runs[1].holdings[0].stamp = d.runs[0].holdings[0].stamp;
    });
}

/// A chain longer than a run is evicted leaf first across its runs too:
/// one store stamps its deepest run oldest.
#[test]
fn a_chain_across_runs_is_evicted_leaf_first() {
    let len = 3 * RUN_CAP as usize - 2;
    let forest = Forest::new(&(0..len).map(|i| i.checked_sub(1)).collect::<Vec<_>>());
    let chain = forest.hashes(&forest.path(len - 1));
    let ix = RunIndex::new();
    ix.store(0, Tier::Gpu, None, &chain);
    let n = RUN_CAP as usize + 2;
    let dropped: Vec<u64> = ix.evict(0, n).into_iter().map(|d| d.1).collect();
    let leaves: Vec<u64> = chain.iter().rev().take(n).copied().collect();
    assert_eq!(dropped, leaves);
    assert_eq!(
        blocks(ix.prefix_matches(&chain)),
        vec![(0, (len - n) as u32)]
    );
}

/// Keys other than engine hashes go only into an index made for them.
#[test]
fn an_engine_key_index_refuses_other_keys() {
    let ix = RunIndex::new();
    assert_eq!(ix.store_keyed(0, Tier::Gpu, None, &[(1, 100)]), 1);
    assert_eq!(
        ix.store_tokens(0, Tier::Gpu, None, &[1], &[7; 4], 4, ROOT_SEED),
        1
    );
    assert_eq!(ix.blocks(), 0);
    ix.store(0, Tier::Gpu, None, &[1]);
    assert_eq!(ix.blocks(), 1);
}

/// A store under a prefix uses the prefix again: the pod's holding of it
/// is restamped newer than the branch, so eviction takes the branch (and
/// older leaves) before the prefix, not the prefix's end first.
#[test]
fn a_prefix_stored_under_again_outlives_its_branches() {
    // s1 s2 s3 u1 u2 in one run; v1 v2 branch off after s3.
    let parents = [None, Some(0), Some(1), Some(2), Some(3), Some(2), Some(5)];
    let forest = Forest::new(&parents);
    let h = |nodes: &[usize]| forest.hashes(nodes);
    let ix = RunIndex::new().bounded();
    ix.store(0, Tier::Gpu, None, &h(&[0, 1, 2, 3, 4]));
    ix.store(0, Tier::Gpu, Some(forest.hash[2]), &h(&[5, 6]));
    let evicted = |n| ix.evict(0, n).into_iter().map(|d| d.1).collect::<Vec<_>>();
    assert_eq!(evicted(3), h(&[6, 5, 4]), "the older branch, then a leaf");
    assert_eq!(evicted(2), h(&[3, 2]));
    assert_eq!(blocks(ix.prefix_matches(&h(&[0, 1, 2, 3]))), vec![(0, 2)]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// A pod that stores whole chains from their roots (as vLLM does) and
    /// is evicted at any point keeps every block it holds reachable: all
    /// of its entries are leading blocks of some chain.
    #[test]
    fn eviction_never_strands_a_pods_blocks(
        parents in prop::collection::vec(prop::option::weighted(0.9, any::<usize>()), 1..40),
        ops in prop::collection::vec((any::<usize>(), 0usize..6), 1..60),
    ) {
        let forest = Forest::new(&parents);
        let nodes = forest.hash.len();
        let ix = RunIndex::new().bounded();
        for (node, evict) in ops {
            let path = forest.path(node % nodes);
            // Stored under its parent, as a pod's next turn is: the part it
            // did not have yet.
            let held = blocks(ix.prefix_matches(&forest.hashes(&path)))
                .first()
                .map_or(0, |m| m.1 as usize);
            let parent = held.checked_sub(1).map(|i| forest.hash[path[i]]);
            ix.store(0, Tier::Gpu, parent, &forest.hashes(&path[held..]));
            ix.evict(0, evict);
            let reachable = (0..nodes)
                .filter(|&n| {
                    let path = forest.path(n);
                    blocks(ix.prefix_matches(&forest.hashes(&path))).first().map(|m| m.1)
                        == Some(path.len() as u32)
                })
                .count();
            prop_assert_eq!(ix.entries(0), reachable as u64);
        }
    }
}

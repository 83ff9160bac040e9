use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;

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

/// The model: what each pod holds, as a set.
#[derive(Default)]
struct Model(HashMap<u32, HashSet<u64>>);

impl Model {
    fn prefix_matches(&self, keys: &[u64]) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = self
            .0
            .iter()
            .map(|(pod, held)| {
                (
                    *pod,
                    keys.iter().take_while(|k| held.contains(k)).count() as u32,
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        out.sort_unstable();
        out
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// The path to `node`, from its `from`-th block on (under the block
    /// before it).
    Store {
        pod: u32,
        node: usize,
        from: usize,
    },
    /// The path to `node` from its `from`-th block on, leaf first (as vLLM
    /// evicts) or root first.
    Remove {
        pod: u32,
        node: usize,
        from: usize,
        leaf_first: bool,
    },
    Clear {
        pod: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..4, any::<usize>(), 0usize..12)
            .prop_map(|(pod, node, from)| Op::Store { pod, node, from }),
        4 => (0u32..4, any::<usize>(), 0usize..12, any::<bool>())
            .prop_map(|(pod, node, from, leaf_first)| Op::Remove { pod, node, from, leaf_first }),
        1 => (0u32..4).prop_map(|pod| Op::Clear { pod }),
    ]
}

/// What must hold whatever was applied: the table names each run block
/// once, every count is its holders' spans, no run ends in a dead block.
fn check_invariants(ix: &RunIndex) {
    let mut blocks = 0;
    for (id, run) in ix.runs.iter().enumerate() {
        if ix.free.contains(&(id as u32)) {
            assert!(run.hashes.is_empty());
            continue;
        }
        assert!(!run.hashes.is_empty(), "a live run is not empty");
        assert_ne!(run.holders_of.last(), Some(&0), "dead tail left");
        let mut count = vec![0u32; run.hashes.len()];
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
        for (off, h) in run.hashes.iter().enumerate() {
            let loc = Loc {
                run: id as u32,
                off: off as u32,
            };
            assert_eq!(ix.locate(*h), Some(loc));
        }
        blocks += run.hashes.len();
    }
    assert_eq!(ix.table.len(), blocks);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// After any stores, removals (of held blocks or not, in either
    /// order) and clears, every path and its every suffix matches as the
    /// model of sets does, and the index keeps only what is held.
    #[test]
    fn answers_as_sets_of_held_blocks_do(
        parents in prop::collection::vec(prop::option::weighted(0.9, any::<usize>()), 1..40),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let forest = Forest::new(&parents);
        let nodes = forest.hash.len();
        let mut ix = RunIndex::new();
        let mut model = Model::default();
        for op in ops {
            match op {
                Op::Store { pod, node, from } => {
                    let path = forest.path(node % nodes);
                    let from = from.min(path.len() - 1);
                    let parent = from.checked_sub(1).map(|i| forest.hash[path[i]]);
                    let hashes = forest.hashes(&path[from..]);
                    ix.store(pod, parent, &hashes);
                    model.0.entry(pod).or_default().extend(hashes);
                }
                Op::Remove { pod, node, from, leaf_first } => {
                    let path = forest.path(node % nodes);
                    let mut hashes = forest.hashes(&path[from.min(path.len() - 1)..]);
                    if leaf_first {
                        hashes.reverse();
                    }
                    let held = model.0.entry(pod).or_default();
                    let unknown = hashes.iter().filter(|h| !held.remove(*h)).count();
                    prop_assert_eq!(ix.remove(pod, &hashes), unknown);
                }
                Op::Clear { pod } => {
                    ix.clear(pod);
                    model.0.remove(&pod);
                }
            }
            check_invariants(&ix);
            let held: HashSet<u64> = model.0.values().flatten().copied().collect();
            prop_assert!(ix.blocks() >= held.len());
            for n in 0..nodes {
                let path = forest.hashes(&forest.path(n));
                for from in 0..path.len() {
                    let mut q = path[from..].to_vec();
                    prop_assert_eq!(ix.prefix_matches(&q), model.prefix_matches(&q));
                    q.push(hash(q[q.len() - 1] ^ 7));
                    prop_assert_eq!(ix.prefix_matches(&q), model.prefix_matches(&q));
                }
            }
        }
        // Everything cleared: nothing stays indexed.
        for pod in 0..4 {
            ix.clear(pod);
        }
        check_invariants(&ix);
        prop_assert_eq!(ix.blocks(), 0);
    }
}

/// A pod storing what another pod holds widens its span in the same run:
/// no new run, no new table entry.
#[test]
fn a_shared_prefix_is_one_run() {
    let forest = Forest::new(&(0..100).map(|i| Some(i.max(1) - 1)).collect::<Vec<_>>());
    let chain = forest.hashes(&forest.path(99));
    let mut ix = RunIndex::new();
    ix.store(0, None, &chain);
    ix.store(1, None, &chain[..60]);
    ix.store(2, Some(chain[9]), &chain[10..30]);
    assert_eq!(ix.runs.len(), 1);
    assert_eq!(ix.blocks(), 100);
    assert_eq!(
        ix.prefix_matches(&chain),
        vec![(0, 100), (1, 60)],
        "pod 2 lacks the first block"
    );
    assert_eq!(
        ix.prefix_matches(&chain[10..]),
        vec![(0, 90), (1, 50), (2, 20)]
    );
    // Evicted leaf first, the tail is cut as it dies.
    let mut tail = chain[60..].to_vec();
    tail.reverse();
    assert_eq!(ix.remove(0, &tail), 0);
    assert_eq!(ix.blocks(), 60);
}

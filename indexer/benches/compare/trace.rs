//! The comparison trace: a fleet of simulated vLLM pods serving a realistic
//! request mix, and the KV events they publish.
//!
//! Every distinct block on a chain is a `Node` (parent, 16 tokens, the
//! engine's chained hash, a content hash). Requests are sequences of nodes;
//! each pod keeps a vLLM-like prefix cache of bounded size that evicts the
//! least recently used *leaf* first (vLLM frees a request's blocks tail
//! first, so descendants go before their ancestors) and publishes
//! `BlockRemoved` for what it evicted and `BlockStored` for what it added.
//! The pods' final caches are the ground truth every indexer must match.

use std::collections::{BTreeSet, HashMap};

use dynamo_kv_router::compute_block_hash_for_seq;
use dynamo_kv_router::protocols::compute_next_seq_hash;

pub const BLOCK_SIZE: usize = 16;
const NO_PARENT: u32 = u32::MAX;

/// SplitMix64: deterministic, seedable, dependency-free.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

pub struct Nodes {
    pub parent: Vec<u32>,
    /// `BLOCK_SIZE` tokens per node.
    pub tokens: Vec<u32>,
    /// What vLLM puts on the wire: a hash chained through the parent's.
    pub engine: Vec<u64>,
    /// Hash of the block's tokens alone (the peers' "local" hash), for the
    /// pre-hashed runs.
    pub content: Vec<u64>,
}

impl Nodes {
    fn add(&mut self, parent: u32, rng: &mut Rng) -> u32 {
        let id = self.parent.len() as u32;
        let start = self.tokens.len();
        for _ in 0..BLOCK_SIZE {
            self.tokens.push((rng.next() % 151_000) as u32);
        }
        let tokens = &self.tokens[start..];
        // Hashes as Dynamo computes them (xxh3 per block, chained): the
        // engine hash is one its PositionalIndexer can recompute, as that
        // indexer requires; the others treat it as opaque.
        let local = compute_block_hash_for_seq(tokens, BLOCK_SIZE as u32, Default::default())[0];
        let engine = if parent == NO_PARENT {
            local.0
        } else {
            compute_next_seq_hash(self.engine[parent as usize], local)
        };
        self.engine.push(engine);
        self.content.push(local.0);
        self.parent.push(parent);
        id
    }

    /// `n` new nodes chained after `after` (or from the root).
    fn extend(&mut self, path: &mut Vec<u32>, n: usize, rng: &mut Rng) {
        for _ in 0..n {
            let parent = path.last().copied().unwrap_or(NO_PARENT);
            let id = self.add(parent, rng);
            path.push(id);
        }
    }

    pub fn tokens_of(&self, node: u32) -> &[u32] {
        let s = node as usize * BLOCK_SIZE;
        &self.tokens[s..s + BLOCK_SIZE]
    }

    pub fn len(&self) -> usize {
        self.parent.len()
    }
}

/// One event as a pod published it; nodes are resolved per indexer.
pub enum Event {
    Stored {
        parent: Option<u32>,
        nodes: Vec<u32>,
    },
    Removed {
        nodes: Vec<u32>,
    },
}

/// One pod's batch (one scheduler step).
pub struct Batch {
    pub pod: u32,
    pub events: Vec<Event>,
}

pub struct Query {
    pub nodes: Vec<u32>,
    /// Ground truth: leading blocks each pod holds, pods with none omitted.
    pub expected: Vec<(u32, u32)>,
}

pub struct Trace {
    pub pods: usize,
    pub nodes: Nodes,
    pub batches: Vec<Batch>,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// (pod, block) entries held at the end.
    pub live_entries: u64,
    /// Query sets by size in blocks.
    pub queries: Vec<(usize, Vec<Query>)>,
}

#[derive(Clone, Copy)]
pub struct Params {
    pub pods: usize,
    /// Generate requests until the pods stored this many blocks.
    pub target_stored: u64,
    /// Blocks each pod's KV cache holds.
    pub capacity: usize,
    pub queries_per_size: usize,
    pub seed: u64,
}

struct PodEntry {
    stamp: u64,
    children: u32,
}

/// A pod's prefix cache: leaf-first LRU eviction keeps it prefix-closed.
struct PodCache {
    held: HashMap<u32, PodEntry>,
    leaves: BTreeSet<(u64, u32)>,
}

impl PodCache {
    fn new() -> PodCache {
        PodCache {
            held: HashMap::new(),
            leaves: BTreeSet::new(),
        }
    }

    fn touch(&mut self, node: u32, stamp: u64) {
        let e = self.held.get_mut(&node).expect("held");
        if e.children == 0 {
            self.leaves.remove(&(e.stamp, node));
            self.leaves.insert((stamp, node));
        }
        e.stamp = stamp;
    }

    fn store(&mut self, nodes: &Nodes, node: u32, stamp: u64) {
        let parent = nodes.parent[node as usize];
        if parent != NO_PARENT {
            let p = self.held.get_mut(&parent).expect("parent held");
            if p.children == 0 {
                self.leaves.remove(&(p.stamp, parent));
            }
            p.children += 1;
        }
        self.held.insert(node, PodEntry { stamp, children: 0 });
        self.leaves.insert((stamp, node));
    }

    fn evict_one(&mut self, nodes: &Nodes) -> u32 {
        let (_, node) = self.leaves.pop_first().expect("a leaf");
        self.held.remove(&node);
        let parent = nodes.parent[node as usize];
        if parent != NO_PARENT {
            let p = self.held.get_mut(&parent).expect("parent held");
            p.children -= 1;
            if p.children == 0 {
                self.leaves.insert((p.stamp, parent));
            }
        }
        node
    }

    fn matched(&self, path: &[u32]) -> usize {
        path.iter()
            .take_while(|n| self.held.contains_key(n))
            .count()
    }
}

/// A request of `prefix` plus fresh blocks (`new` = min, max), sent to a
/// random pod and answered with fresh blocks (`out`): (prompt, pod, output).
fn one_shot(
    nodes: &mut Nodes,
    rng: &mut Rng,
    pods: usize,
    mut prompt: Vec<u32>,
    new: (usize, usize),
    out: (usize, usize),
) -> (Vec<u32>, usize, Vec<u32>) {
    let n = rng.range(new.0, new.1);
    nodes.extend(&mut prompt, n, rng);
    let mut full = prompt.clone();
    let o = rng.range(out.0, out.1);
    nodes.extend(&mut full, o, rng);
    let pod = rng.range(0, pods - 1);
    let output = full[full.len() - o..].to_vec();
    (prompt, pod, output)
}

struct Conversation {
    history: Vec<u32>,
    pod: usize,
}

impl Trace {
    pub fn generate(p: Params) -> Trace {
        let mut rng = Rng::new(p.seed);
        let mut nodes = Nodes {
            parent: Vec::new(),
            tokens: Vec::new(),
            engine: Vec::new(),
            content: Vec::new(),
        };
        // Shared system prompts (1K-4K tokens) and long documents (8K-128K).
        let systems: Vec<Vec<u32>> = (0..8)
            .map(|_| {
                let mut path = Vec::new();
                let n = rng.range(64, 256);
                nodes.extend(&mut path, n, &mut rng);
                path
            })
            .collect();
        let docs: Vec<Vec<u32>> = (0..24)
            .map(|i| {
                let mut path = Vec::new();
                let n = if i < 4 { 8192 } else { rng.range(512, 6144) };
                nodes.extend(&mut path, n, &mut rng);
                path
            })
            .collect();
        let mut convs: Vec<Conversation> = Vec::new();
        let mut caches: Vec<PodCache> = (0..p.pods).map(|_| PodCache::new()).collect();
        let mut batches = Vec::new();
        let (mut stored, mut removed, mut stamp) = (0u64, 0u64, 0u64);

        while stored < p.target_stored {
            stamp += 1;
            let kind = rng.range(0, 99);
            let (prompt, pod, output) = if kind < 40 {
                // A turn of a multi-turn conversation: the whole history
                // again, plus the new user message; mostly the same pod.
                if convs.len() < p.pods * 4 || rng.chance(0.1) {
                    let sys = &systems[rng.range(0, systems.len() - 1)];
                    let c = Conversation {
                        history: sys.clone(),
                        pod: rng.range(0, p.pods - 1),
                    };
                    if convs.len() < p.pods * 4 {
                        convs.push(c);
                    } else {
                        let i = rng.range(0, convs.len() - 1);
                        convs[i] = c;
                    }
                }
                let i = rng.range(0, convs.len() - 1);
                let c = &mut convs[i];
                let n = rng.range(4, 32);
                nodes.extend(&mut c.history, n, &mut rng);
                let prompt = c.history.clone();
                let pod = if rng.chance(0.9) {
                    c.pod
                } else {
                    rng.range(0, p.pods - 1)
                };
                let out = rng.range(2, 16);
                nodes.extend(&mut c.history, out, &mut rng);
                let output = c.history[prompt.len()..].to_vec();
                if c.history.len() > 4096 {
                    c.history.truncate(systems[0].len().min(64));
                }
                (prompt, pod, output)
            } else if kind < 55 {
                // A question about a long document (popular ones more often).
                let popular = rng.range(0, docs.len() - 1);
                let d = rng.range(0, popular);
                one_shot(
                    &mut nodes,
                    &mut rng,
                    p.pods,
                    docs[d].clone(),
                    (2, 8),
                    (1, 4),
                )
            } else if kind < 85 {
                // A one-shot request under a shared system prompt.
                let sys = systems[rng.range(0, systems.len() - 1)].clone();
                one_shot(&mut nodes, &mut rng, p.pods, sys, (8, 128), (1, 8))
            } else {
                // A prompt nobody shares.
                one_shot(&mut nodes, &mut rng, p.pods, Vec::new(), (8, 256), (1, 8))
            };

            let cache = &mut caches[pod];
            let hit = cache.matched(&prompt);
            for n in &prompt[..hit] {
                cache.touch(*n, stamp);
            }
            let new = prompt.len() - hit + output.len();
            let mut evicted = Vec::new();
            while cache.held.len() + new > p.capacity {
                evicted.push(cache.evict_one(&nodes));
            }
            let mut events = Vec::new();
            if !evicted.is_empty() {
                removed += evicted.len() as u64;
                events.push(Event::Removed { nodes: evicted });
            }
            // Prefill stores the prompt's missing blocks, decode the output's.
            let mut parent = hit.checked_sub(1).map(|i| prompt[i]);
            for part in [&prompt[hit..], &output[..]] {
                if part.is_empty() {
                    continue;
                }
                for n in part {
                    cache.store(&nodes, *n, stamp);
                }
                stored += part.len() as u64;
                events.push(Event::Stored {
                    parent,
                    nodes: part.to_vec(),
                });
                parent = part.last().copied();
            }
            batches.push(Batch {
                pod: pod as u32,
                events,
            });
        }

        // Queries: mostly prompts that share a prefix with what the fleet
        // served (conversations, documents, system prompts), some that share
        // nothing; each padded with fresh blocks to its size.
        let mut queries = Vec::new();
        for size in [128usize, 2048, 8192] {
            let mut set = Vec::new();
            for q in 0..p.queries_per_size {
                let mut path: Vec<u32> = match q % 5 {
                    0 if size < 8192 => convs[rng.range(0, convs.len() - 1)].history.clone(),
                    1 if size < 8192 => systems[rng.range(0, systems.len() - 1)].clone(),
                    4 => Vec::new(),
                    _ => docs[rng.range(0, if size == 8192 { 3 } else { docs.len() - 1 })].clone(),
                };
                path.truncate(size);
                let n = size - path.len();
                nodes.extend(&mut path, n, &mut rng);
                let expected = caches
                    .iter()
                    .enumerate()
                    .map(|(pod, c)| (pod as u32, c.matched(&path) as u32))
                    .filter(|(_, m)| *m > 0)
                    .collect();
                set.push(Query {
                    nodes: path,
                    expected,
                });
            }
            queries.push((size, set));
        }
        let live_entries = caches.iter().map(|c| c.held.len() as u64).sum();
        Trace {
            pods: p.pods,
            nodes,
            batches,
            stored_blocks: stored,
            removed_blocks: removed,
            live_entries,
            queries,
        }
    }

    pub fn block_ops(&self) -> u64 {
        self.stored_blocks + self.removed_blocks
    }
}

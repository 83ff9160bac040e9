//! The op log (`--ops-out`): each pod's `KVCacheManager` calls, and the
//! request changes between them, in the order the pod made them, with what
//! the pod answered. [`replay`] runs a log through simulated pods, as
//! `tests/fixtures/simulator/vllm_answers.py` runs it through vLLM's own
//! class: the two sets of answers must be the same.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::pod_cache::{Allocation, CacheEvent, PodCache, Sequence};

/// One line of the op log (`--ops-out`): a pod's `KVCacheManager` calls and
/// the request changes between them, in the order the pod ran them. The
/// file starts each pod with a [`Header`]; every line names its pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpLine {
    /// A request reaches the pod's waiting queue (a new `Request`).
    Add { req: String, token_ids: Vec<u32> },
    /// `get_computed_blocks` (its answer, `hit_blocks`), then
    /// `allocate_slots` with them and `full_sequence_must_fit`: a waiting
    /// request's admission attempt, `ok` whether it was admitted.
    Admit {
        req: String,
        hit_blocks: usize,
        new_tokens: usize,
        ok: bool,
    },
    /// `allocate_slots` for a running request's next `new_tokens`.
    Allocate {
        req: String,
        new_tokens: usize,
        ok: bool,
    },
    /// `append_output_token_ids`: a token sampled at the end of a step.
    Append { req: String, token_ids: Vec<u32> },
    /// `free`: the request finished, or was preempted (then its computed
    /// tokens go back to 0 and it waits again).
    Free { req: String, preempted: bool },
}

impl OpLine {
    /// The request the line is about.
    pub fn req(&self) -> &str {
        match self {
            OpLine::Add { req, .. }
            | OpLine::Admit { req, .. }
            | OpLine::Allocate { req, .. }
            | OpLine::Append { req, .. }
            | OpLine::Free { req, .. } => req,
        }
    }
}

/// The first line of a pod in the op log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub pod: String,
    /// Usable blocks (vLLM's `num_gpu_blocks` less its null block).
    pub capacity_blocks: usize,
    pub block_size: usize,
}

/// What a pod answered to one `admit` or `allocate` line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    /// 1-based line of the op log.
    pub line: usize,
    /// `get_computed_blocks` in blocks (`admit` only, else 0).
    pub hit_blocks: usize,
    /// Whether `allocate_slots` gave the blocks.
    pub ok: bool,
    /// The events the call queued, in order.
    pub events: Vec<Seen>,
}

/// An event as both sides can name it: a block by a digest of its tokens
/// ([`digest`]), since vLLM's block hashes and ours differ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Seen {
    Stored(Vec<String>),
    Removed(String),
}

/// FNV-1a 64 over the tokens as little-endian u32, in hex (the same
/// function as `vllm_answers.py`'s).
pub fn digest(tokens: &[u32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tokens.iter().flat_map(|t| t.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The cache's events since the last call, blocks named by their tokens;
/// `digests` remembers each stored block's digest by our hash.
fn seen(cache: &mut PodCache, block_size: usize, digests: &mut HashMap<u64, String>) -> Vec<Seen> {
    cache
        .take_events()
        .into_iter()
        .map(|e| match e {
            CacheEvent::Stored { hashes, tokens, .. } => Seen::Stored(
                hashes
                    .iter()
                    .zip(tokens.chunks_exact(block_size))
                    .map(|(h, t)| digests.entry(*h).or_insert_with(|| digest(t)).clone())
                    .collect(),
            ),
            CacheEvent::Removed { hash } => {
                Seen::Removed(digests.get(&hash).cloned().unwrap_or_default())
            }
        })
        .collect()
}

/// Runs an op log through simulated pods, as the pods that wrote it ran
/// it, and gives every `admit` and `allocate` line's answer. The log's own
/// `hit_blocks` and `ok` are not read: they are what is being checked.
/// Blocks are told apart by their tokens' chained hashes, so any root seed
/// gives the same answers.
pub fn replay(log: &str) -> anyhow::Result<Vec<Answer>> {
    use anyhow::Context;
    const ROOT_SEED: u64 = 0;

    struct Replayed {
        cache: PodCache,
        block_size: usize,
        /// Request name -> (id, tokens, computed tokens).
        reqs: HashMap<String, (u32, Sequence, usize)>,
        next_id: u32,
        /// Our block hash -> its tokens' digest.
        digests: HashMap<u64, String>,
    }
    let mut pods: HashMap<String, Replayed> = HashMap::new();
    let mut answers = Vec::new();
    for (n, line) in log.lines().enumerate().map(|(i, l)| (i + 1, l)) {
        let value: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("line {n}: not JSON"))?;
        let pod = value["pod"]
            .as_str()
            .with_context(|| format!("line {n}: no pod"))?
            .to_owned();
        if value.get("capacity_blocks").is_some() {
            let h: Header = serde_json::from_value(value)?;
            let replayed = Replayed {
                cache: PodCache::new(h.capacity_blocks, h.block_size),
                block_size: h.block_size,
                reqs: HashMap::new(),
                next_id: 0,
                digests: HashMap::new(),
            };
            pods.insert(pod, replayed);
            continue;
        }
        let p = pods
            .get_mut(&pod)
            .with_context(|| format!("line {n}: pod {pod} has no header"))?;
        let op: OpLine =
            serde_json::from_value(value).with_context(|| format!("line {n}: not an op"))?;
        if let OpLine::Add { req, token_ids } = op {
            let mut seq = Sequence::default();
            seq.append(&token_ids, p.block_size, ROOT_SEED);
            p.next_id += 1;
            p.reqs.insert(req, (p.next_id, seq, 0));
            continue;
        }
        let name = op.req().to_owned();
        let (id, seq, computed) = p
            .reqs
            .get_mut(&name)
            .with_context(|| format!("line {n}: unknown request {name}"))?;
        let id = *id;
        let (hit_blocks, alloc) = match op {
            OpLine::Add { .. } => unreachable!("handled above"),
            OpLine::Append { token_ids, .. } => {
                seq.append(&token_ids, p.block_size, ROOT_SEED);
                continue;
            }
            OpLine::Free { preempted, .. } => {
                p.cache.free(id);
                *computed = 0;
                if !preempted {
                    p.reqs.remove(&name);
                }
                continue;
            }
            OpLine::Admit { new_tokens, .. } => {
                let hit_blocks = p.cache.computed(seq);
                let alloc = Allocation {
                    computed: 0,
                    new_tokens,
                    hit_blocks,
                    whole_sequence: true,
                };
                (hit_blocks, alloc)
            }
            OpLine::Allocate { new_tokens, .. } => {
                let alloc = Allocation {
                    computed: *computed,
                    new_tokens,
                    hit_blocks: 0,
                    whole_sequence: false,
                };
                (0, alloc)
            }
        };
        let ok = p.cache.allocate(id, seq, alloc);
        if ok {
            *computed = alloc.computed + hit_blocks * p.block_size + alloc.new_tokens;
        }
        answers.push(Answer {
            line: n,
            hit_blocks,
            ok,
            events: seen(&mut p.cache, p.block_size, &mut p.digests),
        });
    }
    Ok(answers)
}

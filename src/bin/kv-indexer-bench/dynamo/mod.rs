//! `--peer dynamo`: the ingest and Score workloads against Dynamo's
//! standalone indexer (`dynamo-kv-router` 1.6.1, `services::indexer`, the
//! `peer-dynamo-indexer` binary of `peers/dynamo`) and against ours, in the
//! same run, taking turns step by step (ours, Dynamo, ours, Dynamo, ...) so
//! that the machine's drift hits both.
//!
//! Like for like:
//! - Both run as their own process on loopback, and both *dial* the pods:
//!   every simulated pod binds a ZeroMQ PUB socket per indexer (Dynamo
//!   only dials; ours runs with `--zmq-bind none --zmq-connect ...`).
//! - Both receive the same bytes: vLLM 0.33's msgpack batches
//!   `[ts, [event, ...], dp_rank]` with map events, which both decoders
//!   read, pre-encoded before a step starts, published by one thread per
//!   pod. Each indexer's pods get their own stream from the same seed, so
//!   the bytes match as long as both ran the same steps.
//! - Both hash token ids into their keys themselves (16-token blocks) and
//!   answer Score from token ids: ours over gRPC (`Score`, 8 HTTP/2
//!   connections), Dynamo over its HTTP `/query` (JSON token ids, HTTP/1.1
//!   keep-alive connections, one request in flight on each, as HTTP/1.1
//!   allows).
//!
//! Applied counts: ours from `ListPods` (stored + removed blocks per pod);
//! Dynamo's from its `/metrics` (`dynamo_kvrouter_kv_cache_events_applied`,
//! events by status). Every event of a step carries the same number of
//! blocks, so events applied `ok` times that number is its blocks applied.

mod http;
mod ingest;
mod processes;
mod score;

use std::collections::VecDeque;

use serde_json::{json, Value};

use crate::{lcg, random_tokens, store_batch, Opts, ZmqMessage};
use ingest::{pod_prefix, POD_SETS};
use processes::{bind_pods, register, start, Pods};

/// The binary `peers/dynamo` builds.
pub const BINARY: &str = "peer-dynamo-indexer";
/// Dynamo's event threads: its `ThreadPoolIndexer` with two, what its own
/// services and tests run and what the compare bench gives it; ours has
/// two ingest workers. Its CLI's default is one.
const DYNAMO_THREADS: usize = 2;

const INGEST_PODS: usize = 8;
const SCORE_PODS: usize = 64;
const PROMPT_BLOCKS: usize = 2048;
/// Blocks a pod holds before each batch also evicts as many as it stores
/// (its oldest request's blocks, last block first, as vLLM frees them):
/// bounds both indexes and makes removals as frequent as stores.
const KEEP_BLOCKS: usize = 16_384;
/// Dynamo's instance ids: ingest pods from here, score pods from
/// `SCORE_ID`.
const INGEST_ID: u64 = 1;
const SCORE_ID: u64 = 1000;
/// Pods that publish while Score is measured (`--ingest-rate` stored
/// blocks/s, turn-shaped batches), from this instance id.
const BACKGROUND_PODS: usize = 8;
const BACKGROUND_ID: u64 = 2000;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Ours,
    Dynamo,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Ours => "ours",
            Side::Dynamo => "dynamo",
        }
    }
}

const SIDES: [Side; 2] = [Side::Ours, Side::Dynamo];

/// One batch shape vLLM publishes, each over its own 8 pods (so that a
/// loss in one shape's steps cannot turn into removals of unknown blocks
/// in the next).
struct Shape {
    name: &'static str,
    /// Blocks each `BlockStored` carries (and each `BlockRemoved`, once the
    /// pod is full).
    blocks: usize,
    /// Blocks of one request: a new one starts (no parent) after that many.
    request: usize,
    /// Offered block operations (stored + removed) per second, in turn.
    rates: &'static [f64],
}

const SHAPES: [Shape; 3] = [
    // A decode step stores the one block a running request just filled,
    // chained to its previous block.
    Shape {
        name: "decode",
        blocks: 1,
        request: 128,
        rates: &[50e3, 100e3, 200e3, 400e3, 800e3],
    },
    // A chat turn: 16 new blocks on the conversation so far.
    Shape {
        name: "turn",
        blocks: 16,
        request: 128,
        rates: &[250e3, 500e3, 1e6, 2e6, 4e6],
    },
    // A 32K-token prompt's prefill in one step.
    Shape {
        name: "prefill",
        blocks: 2048,
        request: 2048,
        rates: &[500e3, 1e6, 2e6, 4e6],
    },
];

/// One simulated pod's stream: what it holds, its next seq, its random
/// state. Deterministic from its seed.
struct PodStream {
    name: String,
    seq: u64,
    rng: u64,
    /// Finished requests' blocks, oldest first.
    held: VecDeque<Vec<u64>>,
    held_blocks: usize,
    /// The running request's blocks.
    current: Vec<u64>,
}

impl PodStream {
    fn new(name: String, seed: u64) -> PodStream {
        PodStream {
            name,
            seq: 0,
            rng: seed,
            held: VecDeque::new(),
            held_blocks: 0,
            current: Vec::new(),
        }
    }

    /// Ends the running request (the next batch starts a new one).
    fn end_request(&mut self) {
        if !self.current.is_empty() {
            self.held.push_back(std::mem::take(&mut self.current));
        }
    }

    /// The next batch: `shape.blocks` stored on the running request (a new
    /// one when it is complete), and as many of the oldest blocks removed
    /// once the pod holds `KEEP_BLOCKS`. Returns the frames and the block
    /// operations it carries.
    fn batch(&mut self, shape: &Shape) -> (ZmqMessage, u64) {
        let n = shape.blocks;
        if self.current.len() >= shape.request {
            self.end_request();
        }
        let parent = self.current.last().copied();
        let hashes: Vec<u64> = (0..n).map(|_| lcg(&mut self.rng) << 17 | 1).collect();
        let tokens = random_tokens(&mut self.rng, n);
        let mut removed = Vec::new();
        if self.held_blocks + n > KEEP_BLOCKS {
            while removed.len() < n {
                let Some(oldest) = self.held.front_mut() else {
                    break;
                };
                match oldest.pop() {
                    Some(h) => removed.push(h),
                    None => {
                        self.held.pop_front();
                    }
                }
            }
        }
        self.held_blocks = self.held_blocks + n - removed.len();
        let ops = (n + removed.len()) as u64;
        let msg = store_batch(&self.name, self.seq, &hashes, parent, &tokens, &removed);
        self.seq += 1;
        self.current.extend_from_slice(&hashes);
        (msg, ops)
    }
}

// ------------------------------------------------------------------ driver

/// Runs the peer comparison; its JSON goes under `peer` in `e2e.json`.
pub async fn run(o: &Opts) -> Value {
    let context = zmq::Context::new();
    let mut shape_pods: Vec<Vec<Pods>> = SHAPES
        .iter()
        .map(|s| {
            (0..POD_SETS)
                .map(|set| {
                    let prefix = pod_prefix(s, set);
                    bind_pods(
                        &context,
                        (0..INGEST_PODS).map(|i| format!("{prefix}{i}")).collect(),
                    )
                })
                .collect()
        })
        .collect();
    let score_pods = bind_pods(
        &context,
        (0..SCORE_PODS)
            .map(|i| format!("peer-score-{i:02}"))
            .collect(),
    );
    let mut background_pods = bind_pods(
        &context,
        (0..BACKGROUND_PODS)
            .map(|i| format!("peer-bg-{i}"))
            .collect(),
    );
    let ours_endpoints: Vec<String> = shape_pods
        .iter()
        .flatten()
        .chain([&score_pods, &background_pods])
        .flat_map(|p| p.endpoints[Side::Ours as usize].iter().cloned())
        .collect();
    let mut peers = start(o, &ours_endpoints).await;
    for (set_i, pods) in shape_pods.iter().flatten().enumerate() {
        for (i, e) in pods.endpoints[Side::Dynamo as usize].iter().enumerate() {
            let id = INGEST_ID + (set_i * INGEST_PODS + i) as u64;
            register(&peers.dynamo, id, e).await;
        }
    }
    for (i, e) in score_pods.endpoints[Side::Dynamo as usize]
        .iter()
        .enumerate()
    {
        register(&peers.dynamo, SCORE_ID + i as u64, e).await;
    }
    for (i, e) in background_pods.endpoints[Side::Dynamo as usize]
        .iter()
        .enumerate()
    {
        register(&peers.dynamo, BACKGROUND_ID + i as u64, e).await;
    }
    let (ingest_rows, ingest_best) = ingest::ingest(&mut peers, &mut shape_pods, o.quick).await;
    let score = score::score(
        &mut peers,
        &score_pods,
        &mut background_pods,
        o.under_ingest.ingest_rate,
        o.quick,
    )
    .await;
    json!({
        "peer": "dynamo",
        "dynamo": {"crate": "dynamo-kv-router 1.6.1 (standalone-indexer, metrics)",
            "threads": DYNAMO_THREADS, "binary": BINARY},
        "ours": {"mode": "dial (--zmq-bind none --zmq-connect per pod)"},
        "ingest": ingest_rows,
        "ingest_best_zero_loss": ingest_best,
        "score_token_ids": score,
    })
}

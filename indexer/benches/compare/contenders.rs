//! The three indexers behind one interface, each fed through its own public
//! API in its own recommended configuration:
//! - ours: `indexer::Indexer` (engine keys for pre-hashed input, token keys
//!   from token ids), applied on the caller's thread as the service's
//!   per-pod workers do;
//! - dynamo: `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>` with 2 event
//!   threads (its README's default backend; 2 is what its own tests and
//!   services use), or `<PositionalIndexer>` (jump 32, its default search);
//!   reads run inline on the caller's thread, as its `find_matches` does;
//! - smg: `kv_index::ChainIndex` (2.0's index), applied on the caller's
//!   thread with one `ChainBlockMap` per worker, as its lanes do;
//! - runs: `indexer::index::RunIndex`, the bare index, fed through its own
//!   API;
//! - feed: the same layout fed vLLM's events through `pod::PodFeed`,
//!   the service's rules, as the service would feed it.

use std::sync::Arc;

use dynamo_kv_router::protocols::{
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::{
    compute_block_hash_for_seq, ConcurrentRadixTreeCompressed, PositionalIndexer, SyncIndexer,
    ThreadPoolIndexer,
};
use indexer::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Tier};
use indexer::keys::scheme::KeySchemes;
use indexer::keys::BlockKey;
use indexer::{Indexer, IndexerConfig, Pod};
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};
use parking_lot::Mutex;

use crate::trace::{Batch, Event, Nodes, Trace, BLOCK_SIZE};

/// What the indexers are given: hashes computed up front (the index alone),
/// or token ids they hash themselves (what a Score pays).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Input {
    PreHashed,
    Tokens,
}

impl Input {
    pub fn name(self) -> &'static str {
        match self {
            Input::PreHashed => "pre-hashed",
            Input::Tokens => "token ids",
        }
    }
}

pub trait Contender: Sync + Sized {
    type Batch: Send;
    type Query: Sync;
    type Out;
    fn name() -> &'static str;
    fn new(trace: &Trace, input: Input) -> Self;
    fn prepare_batch(&self, nodes: &Nodes, batch: &Batch) -> Self::Batch;
    fn prepare_query(&self, nodes: &Nodes, path: &[u32]) -> Self::Query;
    fn apply(&self, batch: Self::Batch);
    /// Waits until everything applied so far is visible to readers.
    fn flush(&self) {}
    fn find(&self, query: &Self::Query) -> Self::Out;
    /// A token-id query's prompt (`None` for pre-hashed keys).
    fn prompt(query: &Self::Query) -> Option<&[u32]>;
    /// (pod, leading blocks) for pods with at least one, sorted by pod.
    fn normalize(&self, out: &Self::Out) -> Vec<(u32, u32)>;
}

fn tokens_of(nodes: &Nodes, path: &[u32]) -> Vec<u32> {
    path.iter()
        .flat_map(|n| nodes.tokens_of(*n).iter().copied())
        .collect()
}

/// A trace batch as vLLM sends it: what ours and `feed` apply.
fn event_batch(nodes: &Nodes, batch: &Batch) -> EventBatch {
    let hashes = |ns: &[u32]| -> Vec<EngineHash> {
        ns.iter()
            .map(|n| EngineHash(nodes.engine[*n as usize]))
            .collect()
    };
    let events = batch
        .events
        .iter()
        .map(|e| match e {
            Event::Stored { parent, nodes: ns } => KvEvent::Stored(BlockStored {
                block_hashes: hashes(ns),
                parent_block_hash: parent.map(|p| EngineHash(nodes.engine[p as usize])),
                token_ids: tokens_of(nodes, ns),
                block_size: Some(BLOCK_SIZE as u32),
                ..Default::default()
            }),
            Event::Removed { nodes: ns } => KvEvent::Removed(BlockRemoved {
                block_hashes: hashes(ns),
                ..Default::default()
            }),
        })
        .collect();
    EventBatch {
        events,
        ..Default::default()
    }
}

/// The key schemes ours and `feed` use: engine hashes as keys for
/// pre-hashed input (nothing to compute per block), token keys otherwise.
fn schemes(input: Input) -> KeySchemes {
    match input {
        Input::PreHashed => KeySchemes::engine(
            indexer::keys::engine_hash::EngineHasher::new(
                indexer::keys::engine_hash::HashAlgo::Sha256,
                indexer::keys::engine_hash::DEFAULT_SEED,
                indexer::keys::engine_hash::ExtraKeyStyle::Tagged,
            ),
            false,
            0,
        ),
        Input::Tokens => KeySchemes::default(),
    }
}

const MODEL: &str = "bench/model";

// ---------------------------------------------------------------- ours

pub struct Ours {
    ix: Indexer,
    pods: Vec<Arc<Pod>>,
    input: Input,
    seqs: Mutex<Vec<u64>>,
}

pub enum OursQuery {
    Keys(Vec<BlockKey>),
    Tokens(Vec<u32>),
}

impl Contender for Ours {
    type Batch = (u32, EventBatch);
    type Query = OursQuery;
    type Out = Vec<(indexer::pod::PodId, indexer::score::PrefixMatch)>;

    fn name() -> &'static str {
        "ours"
    }

    fn new(trace: &Trace, input: Input) -> Self {
        let ix = Indexer::new(IndexerConfig {
            keys: schemes(input),
            ..IndexerConfig::default()
        });
        // Pods in order, so pod i is PodId(i).
        let pods = (0..trace.pods)
            .map(|i| ix.pod(MODEL, &format!("pod-{i}"), None))
            .collect();
        Ours {
            ix,
            pods,
            input,
            seqs: Mutex::new(vec![0; trace.pods]),
        }
    }

    fn prepare_batch(&self, nodes: &Nodes, batch: &Batch) -> Self::Batch {
        (batch.pod, event_batch(nodes, batch))
    }

    fn prepare_query(&self, nodes: &Nodes, path: &[u32]) -> Self::Query {
        match self.input {
            Input::PreHashed => OursQuery::Keys(
                path.iter()
                    .map(|n| BlockKey(nodes.engine[*n as usize]))
                    .collect(),
            ),
            Input::Tokens => OursQuery::Tokens(tokens_of(nodes, path)),
        }
    }

    fn apply(&self, (pod, batch): Self::Batch) {
        let seq = {
            let mut seqs = self.seqs.lock();
            let s = seqs[pod as usize];
            seqs[pod as usize] += 1;
            s
        };
        self.ix.apply(&self.pods[pod as usize], seq, &batch);
    }

    fn prompt(query: &Self::Query) -> Option<&[u32]> {
        match query {
            OursQuery::Tokens(tokens) => Some(tokens),
            _ => None,
        }
    }

    fn find(&self, query: &Self::Query) -> Self::Out {
        match query {
            OursQuery::Keys(keys) => self.ix.prefix_matches(MODEL, keys),
            OursQuery::Tokens(tokens) => {
                let keys = self
                    .ix
                    .request_keys(MODEL, None, None, tokens, BLOCK_SIZE as u32, &[]);
                self.ix.prefix_matches(MODEL, &keys)
            }
        }
    }

    fn normalize(&self, out: &Self::Out) -> Vec<(u32, u32)> {
        out.iter()
            .filter(|(_, m)| m.matched_blocks > 0)
            .map(|(id, m)| (id.0, m.matched_blocks))
            .collect()
    }
}

// ---------------------------------------------------------------- runs

/// `indexer::index::RunIndex`, the bare index: engine hashes as keys for pre-hashed input, keys from token ids
/// otherwise (as ours). Applied on the caller's thread; readers never wait
/// for it.
pub struct Runs {
    ix: indexer::index::RunIndex,
    input: Input,
    root_seed: u64,
}

pub enum RunsEvent {
    Stored {
        parent: Option<u64>,
        hashes: Vec<u64>,
        /// Token ids input only.
        tokens: Vec<u32>,
    },
    Removed {
        hashes: Vec<u64>,
    },
}

pub enum RunsQuery {
    Keys(Vec<u64>),
    Tokens(Vec<u32>),
}

impl RunsQuery {
    /// The prompt of `path`: its engine hashes, or its token ids.
    fn new(input: Input, nodes: &Nodes, path: &[u32]) -> Self {
        match input {
            Input::PreHashed => {
                RunsQuery::Keys(path.iter().map(|n| nodes.engine[*n as usize]).collect())
            }
            Input::Tokens => RunsQuery::Tokens(tokens_of(nodes, path)),
        }
    }
}

impl Runs {
    /// Drops everything `pod` holds, as its restart does.
    pub fn clear(&self, pod: u32) {
        self.ix.clear(pod);
    }

    pub fn blocks(&self) -> usize {
        self.ix.blocks()
    }

    /// Evicts up to `n` of `pod`'s entries; returns how many.
    pub fn evict(&self, pod: u32, n: usize) -> usize {
        self.ix.evict(pod, n).len()
    }

    /// `RunIndex::held_along` of pre-hashed keys; returns how many pods.
    pub fn held_along(&self, keys: &[u64]) -> usize {
        self.ix.held_along(keys).len()
    }

    /// `RunIndex::prefix_matches` of pre-hashed keys; returns how many pods.
    pub fn prefix_matches(&self, keys: &[u64]) -> usize {
        self.ix.prefix_matches(keys).len()
    }
}

impl Contender for Runs {
    type Batch = (u32, Vec<RunsEvent>);
    type Query = RunsQuery;
    type Out = Vec<indexer::index::RunMatch>;

    fn name() -> &'static str {
        "runs"
    }

    fn new(_: &Trace, input: Input) -> Self {
        Runs {
            ix: match input {
                Input::PreHashed => indexer::index::RunIndex::new(),
                Input::Tokens => indexer::index::RunIndex::with_token_keys(),
            },
            input,
            root_seed: indexer::keys::request_root_seed(MODEL, None, None),
        }
    }

    fn prepare_batch(&self, nodes: &Nodes, batch: &Batch) -> Self::Batch {
        let hashes = |ns: &[u32]| ns.iter().map(|n| nodes.engine[*n as usize]).collect();
        let events = batch
            .events
            .iter()
            .map(|e| match e {
                Event::Stored { parent, nodes: ns } => RunsEvent::Stored {
                    parent: parent.map(|p| nodes.engine[p as usize]),
                    hashes: hashes(ns),
                    tokens: match self.input {
                        Input::PreHashed => Vec::new(),
                        Input::Tokens => tokens_of(nodes, ns),
                    },
                },
                Event::Removed { nodes: ns } => RunsEvent::Removed { hashes: hashes(ns) },
            })
            .collect();
        (batch.pod, events)
    }

    fn prepare_query(&self, nodes: &Nodes, path: &[u32]) -> Self::Query {
        RunsQuery::new(self.input, nodes, path)
    }

    fn apply(&self, (pod, events): Self::Batch) {
        for e in &events {
            match e {
                RunsEvent::Stored {
                    parent,
                    hashes,
                    tokens,
                } => match self.input {
                    Input::PreHashed => self.ix.store(pod, Tier::Gpu, *parent, hashes),
                    Input::Tokens => {
                        self.ix.store_tokens(
                            pod,
                            Tier::Gpu,
                            *parent,
                            hashes,
                            tokens,
                            BLOCK_SIZE,
                            self.root_seed,
                        );
                    }
                },
                RunsEvent::Removed { hashes } => {
                    self.ix.remove(pod, Tier::Gpu, hashes);
                }
            }
        }
    }

    fn prompt(query: &Self::Query) -> Option<&[u32]> {
        match query {
            RunsQuery::Tokens(tokens) => Some(tokens),
            _ => None,
        }
    }

    fn find(&self, query: &Self::Query) -> Self::Out {
        match query {
            RunsQuery::Keys(keys) => self.ix.prefix_matches(keys),
            RunsQuery::Tokens(tokens) => {
                let keys: Vec<u64> = indexer::keys::prompt_keys(self.root_seed, tokens, BLOCK_SIZE)
                    .into_iter()
                    .map(|k| k.0)
                    .collect();
                self.ix.prefix_matches(&keys)
            }
        }
    }

    fn normalize(&self, out: &Self::Out) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = out.iter().map(|m| (m.pod, m.blocks)).collect();
        out.sort_unstable();
        out
    }
}

// ---------------------------------------------------------------- feed

/// `runs` as the service would use it: each pod's batches, as vLLM sends
/// them (ours' input), through `indexer::pod::PodFeed`, which applies
/// the service's event rules and keys token ids itself.
pub struct Feed {
    runs: indexer::pod::KeyedRuns,
    feeds: Vec<Mutex<indexer::pod::PodFeed>>,
    mode: indexer::keys::scheme::KeyMode,
    input: Input,
}

impl Contender for Feed {
    type Batch = (u32, EventBatch);
    type Query = RunsQuery;
    type Out = Vec<indexer::index::RunMatch>;

    fn name() -> &'static str {
        "feed"
    }

    fn new(trace: &Trace, input: Input) -> Self {
        let mode = schemes(input).for_model(MODEL).clone();
        Feed {
            runs: indexer::pod::KeyedRuns::new(&Default::default(), false),
            feeds: (0..trace.pods as u32)
                .map(|pod| Mutex::new(indexer::pod::PodFeed::new(pod, MODEL)))
                .collect(),
            mode,
            input,
        }
    }

    fn prepare_batch(&self, nodes: &Nodes, batch: &Batch) -> Self::Batch {
        (batch.pod, event_batch(nodes, batch))
    }

    fn prepare_query(&self, nodes: &Nodes, path: &[u32]) -> Self::Query {
        RunsQuery::new(self.input, nodes, path)
    }

    fn apply(&self, (pod, batch): Self::Batch) {
        self.feeds[pod as usize]
            .lock()
            .apply(&self.runs, &batch, &self.mode);
    }

    fn prompt(query: &Self::Query) -> Option<&[u32]> {
        match query {
            RunsQuery::Tokens(tokens) => Some(tokens),
            _ => None,
        }
    }

    fn find(&self, query: &Self::Query) -> Self::Out {
        match query {
            RunsQuery::Keys(keys) => self.runs.engine.prefix_matches(keys),
            RunsQuery::Tokens(tokens) => {
                let (keys, engine) =
                    self.mode
                        .request_keys(MODEL, None, None, tokens, BLOCK_SIZE, &[]);
                let keys: Vec<u64> = keys.into_iter().map(|k| k.0).collect();
                self.runs.for_request(engine).prefix_matches(&keys)
            }
        }
    }

    fn normalize(&self, out: &Self::Out) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = out.iter().map(|m| (m.pod, m.blocks)).collect();
        out.sort_unstable();
        out
    }
}

// ---------------------------------------------------------------- dynamo

pub struct Dynamo<T: SyncIndexer> {
    ix: ThreadPoolIndexer<T>,
    rt: tokio::runtime::Runtime,
    input: Input,
}

pub type DynamoRadix = Dynamo<ConcurrentRadixTreeCompressed>;
pub type DynamoPositional = Dynamo<PositionalIndexer>;

pub trait DynamoBackend: SyncIndexer + Sized {
    fn build() -> Self;
    fn label() -> &'static str;
}

impl DynamoBackend for ConcurrentRadixTreeCompressed {
    fn build() -> Self {
        ConcurrentRadixTreeCompressed::new()
    }
    fn label() -> &'static str {
        "dynamo"
    }
}

impl DynamoBackend for PositionalIndexer {
    fn build() -> Self {
        PositionalIndexer::new(32)
    }
    fn label() -> &'static str {
        "dynamo_positional"
    }
}

pub enum DynamoBatch {
    Ready(Vec<RouterEvent>),
    /// Token ids per stored event, hashed at apply time.
    Tokens(u32, Vec<(Option<u64>, Vec<u64>, Vec<u32>)>, Vec<Vec<u64>>),
}

pub enum DynamoQuery {
    Hashes(Vec<LocalBlockHash>),
    Tokens(Vec<u32>),
}

fn dynamo_store(worker: u32, parent: Option<u64>, engine: &[u64], local: &[u64]) -> RouterEvent {
    RouterEvent::new(
        u64::from(worker),
        KvCacheEvent {
            event_id: 0,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: engine
                    .iter()
                    .zip(local)
                    .map(|(e, l)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(*e),
                        tokens_hash: LocalBlockHash(*l),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
            dp_rank: 0,
        },
    )
}

fn dynamo_remove(worker: u32, engine: &[u64]) -> RouterEvent {
    RouterEvent::new(
        u64::from(worker),
        KvCacheEvent {
            event_id: 0,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: engine
                    .iter()
                    .map(|e| ExternalSequenceBlockHash(*e))
                    .collect(),
            }),
            dp_rank: 0,
        },
    )
}

impl<T: DynamoBackend> Contender for Dynamo<T> {
    type Batch = DynamoBatch;
    type Query = DynamoQuery;
    type Out = dynamo_kv_router::OverlapScores;

    fn name() -> &'static str {
        T::label()
    }

    fn new(_trace: &Trace, input: Input) -> Self {
        Dynamo {
            ix: ThreadPoolIndexer::new(T::build(), 2, BLOCK_SIZE as u32),
            rt: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime"),
            input,
        }
    }

    fn prepare_batch(&self, nodes: &Nodes, batch: &Batch) -> Self::Batch {
        let engine =
            |ns: &[u32]| -> Vec<u64> { ns.iter().map(|n| nodes.engine[*n as usize]).collect() };
        match self.input {
            Input::PreHashed => DynamoBatch::Ready(
                batch
                    .events
                    .iter()
                    .map(|e| match e {
                        Event::Stored { parent, nodes: ns } => {
                            let local: Vec<u64> =
                                ns.iter().map(|n| nodes.content[*n as usize]).collect();
                            dynamo_store(
                                batch.pod,
                                parent.map(|p| nodes.engine[p as usize]),
                                &engine(ns),
                                &local,
                            )
                        }
                        Event::Removed { nodes: ns } => dynamo_remove(batch.pod, &engine(ns)),
                    })
                    .collect(),
            ),
            Input::Tokens => {
                let mut stores = Vec::new();
                let mut removes = Vec::new();
                for e in &batch.events {
                    match e {
                        Event::Stored { parent, nodes: ns } => stores.push((
                            parent.map(|p| nodes.engine[p as usize]),
                            engine(ns),
                            tokens_of(nodes, ns),
                        )),
                        Event::Removed { nodes: ns } => removes.push(engine(ns)),
                    }
                }
                DynamoBatch::Tokens(batch.pod, stores, removes)
            }
        }
    }

    fn prepare_query(&self, nodes: &Nodes, path: &[u32]) -> Self::Query {
        match self.input {
            Input::PreHashed => DynamoQuery::Hashes(
                path.iter()
                    .map(|n| LocalBlockHash(nodes.content[*n as usize]))
                    .collect(),
            ),
            Input::Tokens => DynamoQuery::Tokens(tokens_of(nodes, path)),
        }
    }

    fn apply(&self, batch: Self::Batch) {
        match batch {
            DynamoBatch::Ready(events) => {
                for e in events {
                    self.ix.enqueue_event(e).expect("enqueue");
                }
            }
            DynamoBatch::Tokens(pod, stores, removes) => {
                // Removals first, as in the batch (vLLM evicts, then stores).
                for r in removes {
                    self.ix
                        .enqueue_event(dynamo_remove(pod, &r))
                        .expect("enqueue");
                }
                for (parent, engine, tokens) in stores {
                    let local: Vec<u64> = compute_block_hash_for_seq(
                        &tokens,
                        BLOCK_SIZE as u32,
                        BlockHashOptions::default(),
                    )
                    .into_iter()
                    .map(|h| h.0)
                    .collect();
                    self.ix
                        .enqueue_event(dynamo_store(pod, parent, &engine, &local))
                        .expect("enqueue");
                }
            }
        }
    }

    fn flush(&self) {
        self.rt.block_on(self.ix.flush_and_wait()).expect("flush");
    }

    fn prompt(query: &Self::Query) -> Option<&[u32]> {
        match query {
            DynamoQuery::Tokens(tokens) => Some(tokens),
            _ => None,
        }
    }

    fn find(&self, query: &Self::Query) -> Self::Out {
        match query {
            DynamoQuery::Hashes(h) => self.ix.backend().find_matches(h, false),
            // What its `find_matches_for_request` does inline.
            DynamoQuery::Tokens(tokens) => {
                let h = compute_block_hash_for_seq(
                    tokens,
                    BLOCK_SIZE as u32,
                    BlockHashOptions::default(),
                );
                self.ix.backend().find_matches(&h, false)
            }
        }
    }

    fn normalize(&self, out: &Self::Out) -> Vec<(u32, u32)> {
        let mut v: Vec<(u32, u32)> = out
            .scores
            .iter()
            .filter(|(_, s)| **s > 0)
            .map(|(w, s)| (w.worker_id as u32, *s))
            .collect();
        v.sort_unstable();
        v
    }
}

// ---------------------------------------------------------------- smg

pub struct Smg {
    ix: ChainIndex,
    /// Worker id in the index, per pod, and each worker's block map (the
    /// lane's state: only the writer touches it).
    workers: Vec<u32>,
    pods_of: Vec<u32>,
    maps: Mutex<Vec<ChainBlockMap>>,
    input: Input,
}

pub enum SmgBatch {
    Ready(u32, Vec<SmgEvent>),
    Tokens(u32, Vec<SmgTokens>),
}

pub enum SmgEvent {
    Stored(Option<SequenceHash>, Vec<StoredBlock>),
    Removed(Vec<SequenceHash>),
}

pub enum SmgTokens {
    Stored(Option<u64>, Vec<u64>, Vec<u32>),
    Removed(Vec<SequenceHash>),
}

pub enum SmgQuery {
    Hashes(Vec<ContentHash>),
    Tokens(Vec<u32>),
}

impl Contender for Smg {
    type Batch = SmgBatch;
    type Query = SmgQuery;
    type Out = kv_index::OverlapScores;

    fn name() -> &'static str {
        "smg"
    }

    fn new(trace: &Trace, input: Input) -> Self {
        let ix = ChainIndex::new();
        let workers: Vec<u32> = (0..trace.pods)
            .map(|i| ix.intern_worker(&format!("pod-{i}")).expect("worker"))
            .collect();
        let mut pods_of = vec![u32::MAX; workers.iter().max().map_or(0, |m| *m as usize + 1)];
        for (pod, w) in workers.iter().enumerate() {
            pods_of[*w as usize] = pod as u32;
        }
        let maps = (0..trace.pods).map(|_| ChainBlockMap::default()).collect();
        Smg {
            ix,
            workers,
            pods_of,
            maps: Mutex::new(maps),
            input,
        }
    }

    fn prepare_batch(&self, nodes: &Nodes, batch: &Batch) -> Self::Batch {
        let seq = |ns: &[u32]| -> Vec<SequenceHash> {
            ns.iter()
                .map(|n| SequenceHash(nodes.engine[*n as usize]))
                .collect()
        };
        match self.input {
            Input::PreHashed => SmgBatch::Ready(
                batch.pod,
                batch
                    .events
                    .iter()
                    .map(|e| match e {
                        Event::Stored { parent, nodes: ns } => SmgEvent::Stored(
                            parent.map(|p| SequenceHash(nodes.engine[p as usize])),
                            ns.iter()
                                .map(|n| StoredBlock {
                                    seq_hash: SequenceHash(nodes.engine[*n as usize]),
                                    content_hash: ContentHash(nodes.content[*n as usize]),
                                })
                                .collect(),
                        ),
                        Event::Removed { nodes: ns } => SmgEvent::Removed(seq(ns)),
                    })
                    .collect(),
            ),
            Input::Tokens => SmgBatch::Tokens(
                batch.pod,
                batch
                    .events
                    .iter()
                    .map(|e| match e {
                        Event::Stored { parent, nodes: ns } => SmgTokens::Stored(
                            parent.map(|p| nodes.engine[p as usize]),
                            ns.iter().map(|n| nodes.engine[*n as usize]).collect(),
                            tokens_of(nodes, ns),
                        ),
                        Event::Removed { nodes: ns } => SmgTokens::Removed(seq(ns)),
                    })
                    .collect(),
            ),
        }
    }

    fn prepare_query(&self, nodes: &Nodes, path: &[u32]) -> Self::Query {
        match self.input {
            Input::PreHashed => SmgQuery::Hashes(
                path.iter()
                    .map(|n| ContentHash(nodes.content[*n as usize]))
                    .collect(),
            ),
            Input::Tokens => SmgQuery::Tokens(tokens_of(nodes, path)),
        }
    }

    fn apply(&self, batch: Self::Batch) {
        let mut maps = self.maps.lock();
        match batch {
            SmgBatch::Ready(pod, events) => {
                let (w, map) = (self.workers[pod as usize], &mut maps[pod as usize]);
                for e in events {
                    match e {
                        SmgEvent::Stored(parent, blocks) => self
                            .ix
                            .apply_stored(w, &blocks, parent, map)
                            .expect("store"),
                        SmgEvent::Removed(hashes) => self.ix.apply_removed(w, &hashes, map),
                    }
                }
            }
            SmgBatch::Tokens(pod, events) => {
                let (w, map) = (self.workers[pod as usize], &mut maps[pod as usize]);
                for e in events {
                    match e {
                        SmgTokens::Stored(parent, engine, tokens) => {
                            let blocks: Vec<StoredBlock> = engine
                                .iter()
                                .zip(tokens.chunks_exact(BLOCK_SIZE))
                                .map(|(e, t)| StoredBlock {
                                    seq_hash: SequenceHash(*e),
                                    content_hash: kv_index::compute_content_hash(t),
                                })
                                .collect();
                            self.ix
                                .apply_stored(w, &blocks, parent.map(SequenceHash), map)
                                .expect("store")
                        }
                        SmgTokens::Removed(hashes) => self.ix.apply_removed(w, &hashes, map),
                    }
                }
            }
        }
    }

    fn prompt(query: &Self::Query) -> Option<&[u32]> {
        match query {
            SmgQuery::Tokens(tokens) => Some(tokens),
            _ => None,
        }
    }

    fn find(&self, query: &Self::Query) -> Self::Out {
        match query {
            SmgQuery::Hashes(h) => self.ix.find_matches(h, false),
            SmgQuery::Tokens(tokens) => {
                let h = kv_index::compute_request_content_hashes(tokens, BLOCK_SIZE);
                self.ix.find_matches(&h, false)
            }
        }
    }

    fn normalize(&self, out: &Self::Out) -> Vec<(u32, u32)> {
        let mut v: Vec<(u32, u32)> = out
            .scores
            .iter()
            .filter(|(_, s)| **s > 0)
            .map(|(w, s)| (self.pods_of[*w as usize], *s))
            .collect();
        v.sort_unstable();
        v
    }
}

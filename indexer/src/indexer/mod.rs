//! The indexer: the pod table, the block index, and the queries on them.
//!
//! - `table`: which pods exist (one lock for ids, names and models).
//! - `apply`: a pod's batches into the index, restarts, removal of blocks,
//!   capacity eviction.
//! - `query`: scoring and lookups.
//! - `persist`: snapshots.
//!
//! Each pod has one writer: the service's ingest worker that owns its
//! topic applies its batches, restarts, evicts and removes it (capacity
//! eviction of another worker's pod is asked of that worker). A pod's
//! `inner` mutex is therefore uncontended; it exists so that readers of
//! its state (`ListPods`, snapshots) see it whole. Queries (`score`,
//! `lookup`) never take a pod lock: they read the sharded block index.
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::event::TierMask;
use crate::event::{DecodeSkips, EventBatch, KvEvent, TIERS};
use crate::index::MAX_POD;
use crate::keys::scheme::{KeyMode, KeySchemes};
use crate::keys::BlockKey;
use crate::pod::PodId;
use crate::pod::{ApplyStats, KeyedRuns, PodFeed};
use crate::routing::speculative::Speculative;
use crate::score::chunk_factor;
use crate::score::{self, Candidate, Held, MatchRules, PrefixMatch, TierWeights};
use crate::snapshot::{PodSnapshot, SnapshotError, SnapshotReader, SnapshotWriter};
use table::PodTable;

// A pod's id is its holder id in the runs.

#[derive(Clone, Debug)]
pub struct IndexerConfig {
    /// Block size assumed for a model until its pods' events say otherwise.
    pub default_block_size: u32,
    pub tier_weights: TierWeights,
    /// Token or engine keys, per model.
    pub keys: KeySchemes,
    /// Pods with unrepaired gaps score 0 instead of what the index shows.
    pub drop_incomplete: bool,
    /// Most (pod, block) entries held; beyond it the largest pods lose
    /// their least recently stored blocks. `None`: unbounded.
    pub max_entries: Option<usize>,
    /// Most cache domains held at once; a new one beyond is refused.
    /// `None`: unbounded.
    pub max_pods: Option<usize>,
    /// Most models with pods at once; a new one beyond is refused.
    pub max_models: Option<usize>,
    /// What a pod costs before it holds any block, in entries of
    /// `max_entries` (0: not counted). Set when the budget is memory: a
    /// flood of pod names must not grow the process past it with the
    /// pods' fixed cost alone.
    pub pod_cost_entries: usize,
    /// Most speculative entries (`RecordRouting`) held at once.
    pub max_speculative_entries: usize,
    /// Weight of a speculatively held block in `score` (0: exact only).
    pub speculative_weight: f64,
    /// The pods' offloaded block size in tokens (their offloading
    /// connector's `block_size`); 0: as their offload events say, if they
    /// do. Above a model's block size, offloaded blocks count in whole
    /// chunks (`offload`).
    pub offload_block_size: u32,
}

/// Why a new pod was not admitted. Existing pods are never affected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the index holds --max-pods cache domains already")]
    Pods,
    #[error("the index holds pods of --max-models models already")]
    Models,
    #[error("pods' fixed cost would take more than half of --max-memory")]
    Memory,
    #[error("every pod id is taken")]
    Ids,
}

impl Refused {
    /// The `what` label it is counted under.
    pub fn what(self) -> &'static str {
        match self {
            Refused::Pods | Refused::Ids => "pod",
            Refused::Models => "model",
            Refused::Memory => "pod_memory",
        }
    }
}

impl Default for IndexerConfig {
    fn default() -> Self {
        IndexerConfig {
            default_block_size: 16,
            tier_weights: TierWeights::default(),
            keys: KeySchemes::default(),
            drop_incomplete: false,
            max_entries: None,
            max_pods: None,
            max_models: None,
            pod_cost_entries: 0,
            max_speculative_entries: 1 << 20,
            speculative_weight: 1.0,
            offload_block_size: 0,
        }
    }
}

/// The id a cache domain is known by. A vLLM data-parallel rank is its own
/// cache: rank 0 (or no rank) is the pod name itself, rank `r > 0` is
/// `<pod>#dp<r>`.
pub fn pod_id(pod: &str, dp_rank: Option<u32>) -> String {
    match dp_rank {
        None | Some(0) => pod.to_owned(),
        Some(r) => format!("{pod}#dp{r}"),
    }
}

/// One cache domain (a pod, or one DP rank of it) of one model.
pub struct Pod {
    pub id: PodId,
    /// `pod_id(pod, dp_rank)`.
    pub name: String,
    pub model: String,
    /// The pod name from the topic (`name` without the DP rank suffix).
    pub topic_pod: String,
    pub dp_rank: Option<u32>,
    /// The model's key mode, resolved once.
    mode: KeyMode,
    /// Its model's blocks, where its writer stores them.
    runs: Arc<KeyedRuns>,
    /// Learned block size; 0 until the first store.
    block_size: AtomicU32,
    /// The offloaded block size its events last gave (0: none).
    offload_block_size: AtomicU32,
    /// Events were lost beyond repair since the pod (re)started: its
    /// answers may be too low. Cleared when its publisher restarts.
    incomplete: AtomicBool,
    /// Removed by an admin: no longer a candidate; holders of this handle
    /// must look the pod up again.
    removed: AtomicBool,
    /// Its stream's connection, as its ingest worker last saw it
    /// (a [`Connection`]).
    connection: AtomicU8,
    /// (tier, block) entries held (the pod's share of the capacity).
    entries: AtomicU64,
    /// The engine its last store showed (an `Engine`).
    engine: AtomicU8,
    /// Its pages are EAGLE's bigrams: a prompt is keyed by its bigrams
    /// for it (`keys::bigram_words`).
    bigram: AtomicBool,
    inner: Mutex<PodInner>,
}

impl Pod {
    /// The engine its last store showed.
    pub fn engine(&self) -> crate::event::Engine {
        crate::event::Engine::from_u8(self.engine.load(Ordering::Relaxed))
    }
}

struct PodInner {
    /// Its rules' state; its blocks are in the indexer's runs.
    state: PodFeed,
    progress: Progress,
}

#[derive(Clone, Copy, Debug, Default)]
struct Progress {
    last_seq: Option<u64>,
    /// The fingerprint of the batch `last_seq` named, if its writer gave it.
    last_fingerprint: Option<u64>,
    batches: u64,
    events: u64,
    seq_gaps: u64,
    publisher_restarts: u64,
    duplicate_batches: u64,
    unrecovered_batches: u64,
    last_event: Option<Instant>,
    applied: ApplyStats,
    skipped: DecodeSkips,
}

/// What `ListPods` shows about a pod.
#[derive(Clone, Debug, PartialEq)]
pub struct PodSummary {
    pub pod: String,
    pub model: String,
    pub dp_rank: Option<u32>,
    pub block_size: u32,
    /// The offloaded chunk size in tokens Score counts this pod's
    /// offloaded blocks by (0: block by block): `--offload-block-size`,
    /// else its events', else its model's.
    pub offload_block_size: u32,
    pub blocks_per_tier: [u64; TIERS],
    pub last_seq: Option<u64>,
    pub batches: u64,
    pub events: u64,
    pub seq_gaps: u64,
    /// Times the pod's seq went backwards: vLLM restarted, its cache empty.
    pub publisher_restarts: u64,
    /// Batches seen twice (same seq as the last one), skipped.
    pub duplicate_batches: u64,
    /// Batches lost beyond repair (replay could not fill the gap).
    pub unrecovered_batches: u64,
    /// Lost batches since the last (re)start: answers may be too low.
    pub incomplete: bool,
    pub last_event_age: Option<Duration>,
    pub connection: Connection,
    pub applied: ApplyStats,
    pub skipped: DecodeSkips,
    pub key_mode: &'static str,
    /// The engine its stores show: "vllm", "sglang", or "" before one.
    pub engine: &'static str,
}

/// A prompt to score.
#[derive(Clone, Copy, Debug)]
pub struct ScoreQuery<'a> {
    pub model: &'a str,
    pub tokens: &'a [u32],
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    /// The prompt's multimodal items, sorted (`keys::multimodal::sorted_items`).
    pub mm_items: &'a [crate::keys::multimodal::MmItem],
    /// Candidate pod ids; empty = every pod seen for the model.
    pub pods: &'a [String],
}

#[derive(Clone, Debug, PartialEq)]
pub struct PodScore {
    pub pod: String,
    pub matched: PrefixMatch,
    /// `weighted_blocks / total_blocks`, in [0, 1].
    pub score: f64,
    pub block_size: u32,
    pub total_blocks: u32,
    /// The pod lost events beyond repair; see `IndexerConfig::drop_incomplete`.
    pub incomplete: bool,
    /// Leading blocks held exactly or speculatively (routed to the pod,
    /// not yet stored): at least `matched.matched_blocks`.
    pub speculative_blocks: u32,
    /// The engine its stores show ("" before one, or for a pod only
    /// routed to).
    pub engine: &'static str,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ScoreOutcome {
    pub block_size: u32,
    pub total_blocks: u32,
    /// Every candidate, best first.
    pub pods: Vec<PodScore>,
    /// The prompt's keys, per block size scored (for `RecordRouting`).
    pub keys: Vec<(u32, Vec<BlockKey>)>,
    /// Its keys per page size for the pods that page its bigrams (EAGLE).
    pub bigram_keys: Vec<(u32, Vec<BlockKey>)>,
}

/// Who holds one key.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyHolders {
    pub key: BlockKey,
    pub pods: Vec<(String, TierMask)>,
}

pub struct Indexer {
    config: IndexerConfig,
    /// (pod, block) entries held, summed over pods.
    entries: AtomicU64,
    evictions: AtomicU64,
    /// One evictor at a time; others skip (the capacity is soft by a batch).
    evicting: Mutex<()>,
    /// Which pods exist (see `table`): one lock, never held while taking
    /// another table's.
    table: RwLock<PodTable>,
    /// Pods not removed, copied out of the table for lock-free reads.
    live_pods: AtomicUsize,
    /// Routed-to blocks not stored yet, beside the exact index (see
    /// `routing::speculative`).
    speculative: Speculative,
}

/// Whether a pod's events arrive over a connection that is up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Connection {
    /// Restored from a snapshot, not heard from since.
    Unknown = 0,
    Connected = 1,
    Disconnected = 2,
}

impl Pod {
    /// Removed by `Indexer::remove_pod`: get a fresh handle with `Indexer::pod`.
    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Relaxed)
    }

    /// Set by the pod's ingest worker, shown by `ListPods`.
    pub fn set_connection(&self, state: Connection) {
        self.connection.store(state as u8, Ordering::Relaxed);
    }

    pub fn connection(&self) -> Connection {
        match self.connection.load(Ordering::Relaxed) {
            1 => Connection::Connected,
            2 => Connection::Disconnected,
            _ => Connection::Unknown,
        }
    }
}

impl Indexer {
    pub fn new(config: IndexerConfig) -> Self {
        let config_max_spec = config.max_speculative_entries;
        Indexer {
            config,
            entries: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            evicting: Mutex::new(()),
            table: RwLock::new(PodTable::default()),
            live_pods: AtomicUsize::new(0),
            speculative: Speculative::new(config_max_spec),
        }
    }

    /// Cache domains held now (removed ones not counted).
    pub fn live_pods(&self) -> usize {
        self.live_pods.load(Ordering::Relaxed)
    }

    pub fn config(&self) -> &IndexerConfig {
        &self.config
    }

    /// Blocks evicted to stay within capacity, so far.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// (pod, block) entries held.
    pub fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    /// The last seq applied for `pod` (restored from a snapshot too).
    pub fn last_seq(&self, pod: &Pod) -> Option<u64> {
        self.lock(pod).progress.last_seq
    }

    /// The last seq applied and, if known, its batch's fingerprint (what
    /// a restored pod's stream starts from).
    pub fn last_batch(&self, pod: &Pod) -> (Option<u64>, Option<u64>) {
        let progress = self.lock(pod).progress;
        (progress.last_seq, progress.last_fingerprint)
    }

    fn lock<'a>(&self, pod: &'a Pod) -> parking_lot::MutexGuard<'a, PodInner> {
        pod.inner.lock()
    }
}

mod apply;
pub use apply::StreamCount;
mod persist;
mod query;
mod speculate;
mod table;
#[cfg(test)]
mod tests;

//! The indexer: the pod table, the block index, and the queries on them.
//!
//! Writers are per pod: `apply` locks only that pod's state (its events must
//! be applied in order anyway) and touches the shared `BlockIndex`, which is
//! sharded. Readers (`score`, `lookup`) never take a pod lock.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use parking_lot::{Mutex, RwLock};

use crate::closure::{ClosedView, Closure};
use crate::event::{DecodeSkips, EventBatch, KvEvent, TIERS};
use crate::index::{BlockIndex, PodId, TierMask, MAX_PODS};
use crate::keys::BlockKey;
use crate::pod::{ApplyStats, PodState};
use crate::scheme::{KeyMode, KeySchemes};
use crate::score::{extend_prefix_closed, holding, jump, walk, PrefixMatch, Scratch, TierWeights};
use crate::snapshot::{PodSnapshot, SnapshotError, SnapshotReader, SnapshotWriter};

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
    /// Learned block size; 0 until the first store.
    block_size: AtomicU32,
    /// Events were lost beyond repair since the pod (re)started: its
    /// answers may be too low. Cleared when its publisher restarts.
    incomplete: AtomicBool,
    /// Removed by an admin: no longer a candidate; holders of this handle
    /// must look the pod up again.
    removed: AtomicBool,
    /// Distinct blocks held (the pod's share of the capacity).
    entries: AtomicU64,
    /// Whether readers may binary-search this pod (published by its
    /// writer at each flush, see `closure`).
    closure: Arc<Closure>,
    inner: Mutex<PodInner>,
}

struct PodInner {
    state: PodState,
    progress: Progress,
}

#[derive(Clone, Copy, Debug, Default)]
struct Progress {
    last_seq: Option<u64>,
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
    pub applied: ApplyStats,
    pub skipped: DecodeSkips,
    pub key_mode: &'static str,
}

/// A prompt to score.
#[derive(Clone, Copy, Debug)]
pub struct ScoreQuery<'a> {
    pub model: &'a str,
    pub tokens: &'a [u32],
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
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
}

#[derive(Clone, Debug, PartialEq)]
pub struct ScoreOutcome {
    pub block_size: u32,
    pub total_blocks: u32,
    /// Every candidate, best first.
    pub pods: Vec<PodScore>,
}

/// Who holds one key.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyHolders {
    pub key: BlockKey,
    pub pods: Vec<(String, TierMask)>,
}

#[derive(Default)]
struct ModelEntry {
    /// Pods of this model, sorted by id; shared, so a lookup takes the list
    /// without copying it (pods come and go rarely).
    pods: Arc<[PodId]>,
    /// Last block size a pod of this model reported (0 = none yet).
    block_size: u32,
}

/// What a lookup reuses from the last one on its thread (see `Scratch`).
#[derive(Default)]
struct LookupScratch {
    search: Scratch,
    candidates: Vec<u32>,
    /// The candidates that may be searched: ids, and positions with views.
    closed: Vec<PodId>,
    views: Vec<(u32, ClosedView)>,
    /// Positions of the candidates that must be walked.
    open: Vec<u32>,
}

thread_local! {
    static LOOKUP_SCRATCH: RefCell<LookupScratch> = RefCell::new(LookupScratch::default());
}

pub struct Indexer {
    config: IndexerConfig,
    blocks: BlockIndex,
    /// (pod, block) entries held, summed over pods.
    entries: AtomicU64,
    evictions: AtomicU64,
    /// One evictor at a time; others skip (the capacity is soft by a batch).
    evicting: Mutex<()>,
    /// Lock order, everywhere: `pods`, then `models`, then a `by_name`
    /// shard; a `by_name` guard (`Ref`) is never held while taking
    /// another (copy the id out first).
    pods: RwLock<Vec<Arc<Pod>>>,
    by_name: DashMap<(String, String), PodId>,
    models: RwLock<BTreeMap<String, ModelEntry>>,
    /// Pods not removed: what `max_pods` and `pod_cost_entries` count.
    live_pods: AtomicUsize,
}

impl Pod {
    /// Removed by `Indexer::remove_pod`: get a fresh handle with `Indexer::pod`.
    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Relaxed)
    }
}

impl Indexer {
    pub fn new(config: IndexerConfig) -> Self {
        let blocks = config
            .max_entries
            .map_or_else(BlockIndex::new, BlockIndex::with_max_keys);
        Indexer {
            config,
            blocks,
            entries: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            evicting: Mutex::new(()),
            pods: RwLock::new(Vec::new()),
            by_name: DashMap::new(),
            models: RwLock::new(BTreeMap::new()),
            live_pods: AtomicUsize::new(0),
        }
    }

    /// Cache domains held now (removed ones not counted).
    pub fn live_pods(&self) -> usize {
        self.live_pods.load(Ordering::Relaxed)
    }

    /// The id `by_name` has for `key`, its shard guard released at once.
    fn id_of(&self, key: &(String, String)) -> Option<PodId> {
        self.by_name.get(key).map(|id| *id)
    }

    pub fn config(&self) -> &IndexerConfig {
        &self.config
    }

    /// The pod for a topic's pod name, model and DP rank, created on first
    /// use. For indexers without pod bounds (tests, benches); the service
    /// uses [`Indexer::try_pod`].
    pub fn pod(&self, model: &str, pod: &str, dp_rank: Option<u32>) -> Arc<Pod> {
        self.try_pod(model, pod, dp_rank)
            .expect("a pod refused by an indexer configured without pod bounds")
    }

    /// The pod for a topic's pod name, model and DP rank, created on first
    /// use unless a bound refuses it (`max_pods`, `max_models`, the pods'
    /// share of a memory budget). Callers on the hot path keep the handle.
    pub fn try_pod(
        &self,
        model: &str,
        pod: &str,
        dp_rank: Option<u32>,
    ) -> Result<Arc<Pod>, Refused> {
        let name = pod_id(pod, dp_rank);
        let key = (model.to_owned(), name);
        if let Some(id) = self.id_of(&key) {
            return Ok(self.pods.read()[id.0 as usize].clone());
        }
        let mut pods = self.pods.write();
        // Re-check under the table lock: another thread may have won.
        if let Some(id) = self.id_of(&key) {
            return Ok(pods[id.0 as usize].clone());
        }
        let live = self.live_pods.load(Ordering::Relaxed);
        if self.config.max_pods.is_some_and(|max| live >= max) {
            return Err(Refused::Pods);
        }
        if let (Some(cap), cost @ 1..) = (self.config.max_entries, self.config.pod_cost_entries) {
            if (live + 1).saturating_mul(cost) > cap / 2 {
                return Err(Refused::Memory);
            }
        }
        if pods.len() >= MAX_PODS as usize {
            return Err(Refused::Ids);
        }
        let mut models = self.models.write();
        if !models.contains_key(model)
            && self
                .config
                .max_models
                .is_some_and(|max| models.len() >= max)
        {
            return Err(Refused::Models);
        }
        let id = PodId(pods.len() as u32);
        let state = if self.config.max_entries.is_some() {
            PodState::new(id, model).bounded()
        } else {
            PodState::new(id, model)
        };
        let slot = Arc::new(Pod {
            id,
            name: key.1.clone(),
            model: model.to_owned(),
            topic_pod: pod.to_owned(),
            dp_rank,
            mode: self.config.keys.for_model(model).clone(),
            block_size: AtomicU32::new(0),
            incomplete: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            entries: AtomicU64::new(0),
            closure: state.closure(),
            inner: Mutex::new(PodInner {
                state,
                progress: Progress::default(),
            }),
        });
        pods.push(slot.clone());
        let entry = models.entry(model.to_owned()).or_default();
        entry.pods = entry.pods.iter().copied().chain([id]).collect();
        self.by_name.insert(key, id);
        self.live_pods.fetch_add(1, Ordering::Relaxed);
        Ok(slot)
    }

    /// Applies one decoded batch of `pod`'s events, published with `seq`.
    ///
    /// A pod's batches arrive in order over one connection, so a `seq` that
    /// goes backwards means the publisher restarted (vLLM's cache starts
    /// empty): the pod's blocks are dropped before the batch is applied. The
    /// same `seq` twice is a duplicate and is skipped.
    pub fn apply(&self, pod: &Pod, seq: u64, batch: &EventBatch) -> ApplyStats {
        let mut stats = ApplyStats::default();
        // A removed pod's late batches would hold entries no query sees
        // (and that capacity eviction, which skips removed pods, never
        // frees): dropped.
        if pod.is_removed() {
            return stats;
        }
        let mut inner = pod.inner.lock();
        let PodInner { state, progress } = &mut *inner;
        match progress.last_seq {
            Some(last) if seq == last => {
                progress.duplicate_batches += 1;
                return stats;
            }
            Some(last) if seq < last => {
                progress.publisher_restarts += 1;
                state.clear(&self.blocks, &mut stats);
                // A fresh cache is fully known again.
                pod.incomplete.store(false, Ordering::Relaxed);
            }
            Some(last) if seq != last.wrapping_add(1) => progress.seq_gaps += 1,
            _ => {}
        }
        progress.last_seq = Some(seq);
        progress.batches += 1;
        progress.events += batch.events.len() as u64;
        progress.last_event = Some(Instant::now());
        progress.skipped.unknown_event_types += batch.skipped.unknown_event_types;
        progress.skipped.malformed_events += batch.skipped.malformed_events;
        progress.skipped.unknown_fields += batch.skipped.unknown_fields;
        for event in &batch.events {
            match event {
                KvEvent::Stored(ev) => state.store(&self.blocks, ev, &pod.mode, &mut stats),
                KvEvent::Removed(ev) => state.remove(&self.blocks, ev, &mut stats),
                KvEvent::AllCleared => state.clear(&self.blocks, &mut stats),
            }
        }
        progress.applied.add(&stats);
        debug_assert!(state.closure_is_current());
        self.account(pod, state.entries());
        if let Some(bs) = state.block_size() {
            if pod.block_size.swap(bs, Ordering::Relaxed) != bs {
                if let Some(m) = self.models.write().get_mut(&pod.model) {
                    m.block_size = bs;
                }
            }
        }
        drop(inner);
        self.enforce_capacity();
        stats
    }

    /// Updates the entry counts after `pod` now holds `now` entries.
    fn account(&self, pod: &Pod, now: usize) {
        let before = pod.entries.swap(now as u64, Ordering::Relaxed);
        if now as u64 >= before {
            self.entries
                .fetch_add(now as u64 - before, Ordering::Relaxed);
        } else {
            self.entries
                .fetch_sub(before - now as u64, Ordering::Relaxed);
        }
    }

    /// Over capacity: evict down to 95% of it, always from the pod holding
    /// the most entries (so a pod's share shrinks only when it is the
    /// largest: fair), its least recently stored leaf blocks first (see
    /// `PodState::evict_oldest`). Evicting only ever shortens a pod's match
    /// from its end: answers stay conservative.
    fn enforce_capacity(&self) {
        let Some(cap) = self.config.max_entries else {
            return;
        };
        // The pods' fixed cost takes its share first (admission keeps it
        // at most half the budget).
        let cap = cap.saturating_sub(
            self.live_pods()
                .saturating_mul(self.config.pod_cost_entries),
        );
        if self.entries.load(Ordering::Relaxed) as usize <= cap {
            return;
        }
        let Some(_guard) = self.evicting.try_lock() else {
            return;
        };
        let target = cap - cap / 20;
        while self.entries.load(Ordering::Relaxed) as usize > target {
            let victim = self
                .pods
                .read()
                .iter()
                .filter(|p| !p.is_removed())
                .max_by_key(|p| p.entries.load(Ordering::Relaxed))
                .cloned();
            let Some(victim) = victim else { break };
            let excess = self.entries.load(Ordering::Relaxed) as usize - target;
            let mut inner = victim.inner.lock();
            // Chunks keep each pod lock short and the choice fair.
            let evicted = inner.state.evict_oldest(&self.blocks, excess.min(4096));
            debug_assert!(inner.state.closure_is_current());
            let now = inner.state.entries();
            drop(inner);
            self.account(&victim, now);
            self.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
            if evicted == 0 {
                break;
            }
        }
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

    /// Fingerprint of the key configuration: keys in a snapshot are only
    /// valid under the configuration that computed them.
    ///
    /// An explicit, sorted encoding of the settings that change keys (not a
    /// `Debug` dump: a `HashMap`'s order differs per process, and a
    /// fingerprint that differs across restarts throws every snapshot away).
    fn keys_fingerprint(&self) -> u64 {
        let keys = &self.config.keys;
        let mut per_model: Vec<String> = keys
            .per_model
            .iter()
            .map(|(m, k)| format!("{}={m}:{}", m.len(), k.key_fingerprint()))
            .collect();
        per_model.sort();
        let text = format!(
            "{}|{}|{}",
            crate::keys::SCHEME,
            keys.default.key_fingerprint(),
            per_model.join(",")
        );
        xxhash_rust::xxh3::xxh3_64(text.as_bytes())
    }

    /// Writes everything needed to restart where we are to `out`, one pod
    /// at a time: each pod is locked only while its blocks are copied out,
    /// and written unlocked, so no more than one pod's blocks are copied at
    /// once and ingest is never paused for the whole write.
    pub fn export<W: std::io::Write>(&self, out: W) -> std::io::Result<W> {
        let mut snapshot = SnapshotWriter::new(out, self.keys_fingerprint())?;
        let pods: Vec<Arc<Pod>> = self.pods.read().clone();
        for p in pods.iter().filter(|p| !p.is_removed()) {
            let pod = {
                let inner = self.lock(p);
                let export = inner.state.export();
                PodSnapshot {
                    model: p.model.clone(),
                    pod: p.topic_pod.clone(),
                    dp_rank: p.dp_rank,
                    block_size: inner.state.block_size(),
                    last_seq: inner.progress.last_seq,
                    incomplete: p.incomplete.load(Ordering::Relaxed),
                    non_full_groups: export.non_full_groups,
                    blocks: export.blocks,
                    parents: export.parents,
                }
            };
            snapshot.pod(&pod)?;
        }
        snapshot.finish()
    }

    /// Restores a snapshot into this (empty) indexer, one pod at a time,
    /// once all of it was checked. Returns the pods restored.
    pub fn import<R: std::io::Read + std::io::Seek>(
        &self,
        snapshot: R,
    ) -> Result<usize, SnapshotError> {
        let mut snapshot = SnapshotReader::open(snapshot)?;
        if snapshot.keys_fingerprint() != self.keys_fingerprint() {
            return Err(SnapshotError::KeysChanged);
        }
        let mut imported = 0;
        while let Some(ps) = snapshot.next_pod()? {
            // Bounds may have been lowered since the snapshot was written.
            let Ok(pod) = self.try_pod(&ps.model, &ps.pod, ps.dp_rank) else {
                continue;
            };
            imported += 1;
            let mut inner = pod.inner.lock();
            inner.state.import(
                &self.blocks,
                &ps.blocks,
                &ps.parents,
                &ps.non_full_groups,
                ps.block_size,
            );
            inner.progress.last_seq = ps.last_seq;
            let entries = inner.state.entries();
            drop(inner);
            pod.incomplete.store(ps.incomplete, Ordering::Relaxed);
            if let Some(bs) = ps.block_size {
                pod.block_size.store(bs, Ordering::Relaxed);
                if let Some(m) = self.models.write().get_mut(&ps.model) {
                    m.block_size = bs;
                }
            }
            self.account(&pod, entries);
        }
        self.enforce_capacity();
        Ok(imported)
    }

    /// Forgets a pod: drops its blocks and takes it out of the candidates.
    /// Returns the blocks it held (all tiers), or `None` if unknown.
    pub fn remove_pod(&self, model: &str, name: &str) -> Option<u64> {
        let (_, id) = self.by_name.remove(&(model.to_owned(), name.to_owned()))?;
        let pod = self.pods.read()[id.0 as usize].clone();
        pod.removed.store(true, Ordering::Relaxed);
        self.live_pods.fetch_sub(1, Ordering::Relaxed);
        {
            let mut models = self.models.write();
            if let Some(m) = models.get_mut(model) {
                m.pods = m.pods.iter().copied().filter(|p| *p != id).collect();
                // A model without pods is no longer held (`max_models`).
                if m.pods.is_empty() {
                    models.remove(model);
                }
            }
        }
        Some(self.clear_blocks(&pod))
    }

    /// Drops every block `pod` holds; returns how many it held (all tiers).
    fn clear_blocks(&self, pod: &Pod) -> u64 {
        let mut inner = self.lock(pod);
        let held: u64 = inner.state.held_per_tier().iter().sum();
        let mut stats = ApplyStats::default();
        inner.state.clear(&self.blocks, &mut stats);
        drop(inner);
        self.account(pod, 0);
        held
    }

    /// Forgets a pod with all its DP ranks (ids `pod` and `pod#dp<r>`).
    /// Returns (cache domains removed, blocks they held).
    pub fn remove_pod_domains(&self, model: &str, pod: &str) -> (usize, u64) {
        let names: Vec<String> = self
            .pods
            .read()
            .iter()
            .filter(|p| !p.is_removed() && p.model == model && p.topic_pod == pod)
            .map(|p| p.name.clone())
            .collect();
        let blocks = names.iter().filter_map(|n| self.remove_pod(model, n)).sum();
        (names.len(), blocks)
    }

    /// Drops everything `pod` holds and flags it incomplete: what is left
    /// of a pod after applying one of its batches failed part-way (its
    /// state may be half-updated; an empty pod is conservative, it only
    /// lowers its matches until its next stores).
    pub fn reset_pod(&self, pod: &Pod) {
        self.clear_blocks(pod);
        self.mark_incomplete(pod, 1);
    }

    /// Records `missing` batches lost beyond repair.
    pub fn mark_incomplete(&self, pod: &Pod, missing: u64) {
        self.lock(pod).progress.unrecovered_batches += missing;
        pod.incomplete.store(true, Ordering::Relaxed);
    }

    fn lock<'a>(&self, pod: &'a Pod) -> parking_lot::MutexGuard<'a, PodInner> {
        pod.inner.lock()
    }

    /// Whether some pod (not removed) publishes events for `model`: the
    /// service tokenizes prompts only for such models and configured ones.
    pub fn has_model(&self, model: &str) -> bool {
        self.models
            .read()
            .get(model)
            .is_some_and(|m| !m.pods.is_empty())
    }

    /// Block size prompts of `model` are chunked with, for the response header.
    pub fn model_block_size(&self, model: &str) -> u32 {
        match self.models.read().get(model) {
            Some(m) if m.block_size > 0 => m.block_size,
            _ => self.config.default_block_size,
        }
    }

    fn pod_block_size(&self, pod: Option<&Pod>, model: &str) -> u32 {
        match pod.map(|p| p.block_size.load(Ordering::Relaxed)) {
            Some(bs) if bs > 0 => bs,
            _ => self.model_block_size(model),
        }
    }

    /// Keys of a prompt's full blocks, as the model's key mode computes them.
    pub fn request_keys(
        &self,
        model: &str,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        tokens: &[u32],
        block_size: u32,
    ) -> Vec<BlockKey> {
        self.config
            .keys
            .for_model(model)
            .request_keys(model, lora_name, cache_salt, tokens, block_size as usize)
            .0
    }

    pub fn score(&self, q: &ScoreQuery<'_>) -> ScoreOutcome {
        // (candidate name, pod if known)
        let candidates: Vec<(String, Option<Arc<Pod>>)> = if q.pods.is_empty() {
            let ids = self
                .models
                .read()
                .get(q.model)
                .map(|m| m.pods.clone())
                .unwrap_or_default();
            let pods = self.pods.read();
            ids.iter()
                .map(|id| {
                    let p = pods[id.0 as usize].clone();
                    (p.name.clone(), Some(p))
                })
                .collect()
        } else {
            let mut seen = std::collections::HashSet::new();
            q.pods
                .iter()
                .filter(|name| seen.insert(name.as_str()))
                .map(|name| {
                    let pod = self
                        .id_of(&(q.model.to_owned(), name.clone()))
                        .map(|id| self.pods.read()[id.0 as usize].clone());
                    (name.clone(), pod)
                })
                .collect()
        };

        // Pods of one model may run different block sizes: chunk per size.
        let mut by_size: BTreeMap<u32, Vec<(PodId, usize)>> = BTreeMap::new();
        let mut scores: Vec<PodScore> = Vec::with_capacity(candidates.len());
        for (pos, (name, pod)) in candidates.into_iter().enumerate() {
            let bs = self.pod_block_size(pod.as_deref(), q.model);
            let total = (q.tokens.len() / bs as usize) as u32;
            let incomplete = pod
                .as_ref()
                .is_some_and(|p| p.incomplete.load(Ordering::Relaxed));
            scores.push(PodScore {
                pod: name,
                matched: PrefixMatch::default(),
                score: 0.0,
                block_size: bs,
                total_blocks: total,
                incomplete,
            });
            match pod {
                Some(_) if incomplete && self.config.drop_incomplete => {}
                Some(pod) => by_size.entry(bs).or_default().push((pod.id, pos)),
                None => {}
            }
        }
        let mode = self.config.keys.for_model(q.model);
        for (bs, mut group) in by_size {
            group.sort_unstable();
            let (keys, engine_keys) =
                mode.request_keys(q.model, q.lora_name, q.cache_salt, q.tokens, bs as usize);
            let ids: Vec<PodId> = group.iter().map(|(id, _)| *id).collect();
            // Closure is only sound on engine keys: token keys of a block
            // whose parent was never seen do not exist at all.
            let closure = engine_keys && mode.engine().is_some_and(|e| e.assume_prefix_closed);
            self.match_pods(&keys, &ids, closure, |at, m| {
                let s = &mut scores[group[at].1];
                s.matched = m;
                if s.total_blocks > 0 {
                    s.score = m.weighted_blocks / f64::from(s.total_blocks);
                }
            });
        }
        scores.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then(b.matched.matched_blocks.cmp(&a.matched.matched_blocks))
                .then_with(|| a.pod.cmp(&b.pod))
        });
        let block_size = self.model_block_size(q.model);
        ScoreOutcome {
            block_size,
            total_blocks: (q.tokens.len() / block_size as usize) as u32,
            pods: scores,
        }
    }

    /// The first-miss prefix match of the pods of `model` holding at least
    /// one block of a prompt already turned into keys (`request_keys`, or
    /// engine hashes in engine mode), in pod id order. No names, no zeros,
    /// no closure inference: the index alone, answering what the peers'
    /// indexes answer, as the comparison bench measures it.
    pub fn prefix_matches(&self, model: &str, keys: &[BlockKey]) -> Vec<(PodId, PrefixMatch)> {
        let ids = match self.models.read().get(model) {
            Some(m) => m.pods.clone(),
            None => return Vec::new(),
        };
        // Room for every pod up front (untouched memory costs nothing): a
        // growing vector's copies added 14% to a 128-pod lookup.
        let mut out = Vec::with_capacity(ids.len());
        let in_order = self.match_pods(keys, &ids, false, |pos, m| out.push((ids[pos], m)));
        if !in_order {
            out.sort_unstable_by_key(|(id, _)| *id);
        }
        out
    }

    /// Prefix matches of `ids` (sorted) with at least one block, each
    /// given to `emit` as (position in `ids`, match), in position order
    /// unless this returns false. Pods whose held set is prefix-closed and
    /// on one tier are binary-searched (`score::jump`); the others, and any
    /// whose closure a writer changed meanwhile, walk block by block (and
    /// come last). Both give the first-miss answer on the index's own
    /// state, or under concurrent events one between the states before and
    /// after them (see `closure`).
    ///
    /// Only pods holding the first block can match (closure inference
    /// aside, which credits blocks the index never saw): one probe picks
    /// them, so with a large fleet a prompt pays per pod that holds its
    /// start, not per pod of the model.
    fn match_pods(
        &self,
        keys: &[BlockKey],
        ids: &[PodId],
        closure: bool,
        mut emit: impl FnMut(usize, PrefixMatch),
    ) -> bool {
        debug_assert!(ids.windows(2).all(|w| w[0] < w[1]));
        if keys.is_empty() {
            return true;
        }
        LOOKUP_SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => self.match_pods_with(keys, ids, closure, &mut scratch, &mut emit),
            Err(_) => {
                self.match_pods_with(keys, ids, closure, &mut LookupScratch::default(), &mut emit)
            }
        })
    }

    /// `match_pods` with its buffers. Matches go straight to `emit`, not
    /// through a list of every candidate that was then filtered and
    /// re-keyed: 7% fewer instructions per lookup with 128 pods holding a
    /// 128-block prompt's start (callgrind).
    fn match_pods_with(
        &self,
        keys: &[BlockKey],
        ids: &[PodId],
        closure: bool,
        scratch: &mut LookupScratch,
        emit: &mut impl FnMut(usize, PrefixMatch),
    ) -> bool {
        let LookupScratch {
            search,
            candidates,
            closed,
            views,
            open,
        } = scratch;
        if closure {
            candidates.clear();
            candidates.extend(0..ids.len() as u32);
        } else {
            holding(&self.blocks, keys[0], ids, search, candidates);
        }
        let weights = &self.config.tier_weights;
        let pods = self.pods.read();
        closed.clear();
        views.clear();
        open.clear();
        for &pos in candidates.iter() {
            let id = ids[pos as usize];
            match pods[id.0 as usize].closure.view() {
                Some(view) => {
                    closed.push(id);
                    views.push((pos, view));
                }
                None => open.push(pos),
            }
        }
        // Without closure inference the candidates are the holders of
        // block 0, probed above.
        let depths = jump(&self.blocks, keys, closed, !closure, search);
        let mut searched_any = false;
        for ((&id, &(pos, view)), &depth) in closed.iter().zip(views.iter()).zip(depths) {
            if !pods[id.0 as usize].closure.unchanged(view) {
                open.push(pos);
            } else if depth > 0 {
                searched_any = true;
                emit(
                    pos as usize,
                    PrefixMatch::on_one_tier(depth, view.tier, weights),
                );
            }
        }
        drop(pods);
        if open.is_empty() {
            return true;
        }
        // Rare (pods not closed, or a writer changed their closure): walk.
        open.sort_unstable();
        let open_ids: Vec<PodId> = open.iter().map(|pos| ids[*pos as usize]).collect();
        let mut walked = walk(&self.blocks, keys, &open_ids, weights);
        if closure {
            extend_prefix_closed(&self.blocks, keys, &open_ids, &mut walked, weights);
        }
        for (pos, m) in open.iter().zip(walked) {
            if m.matched_blocks > 0 {
                emit(*pos as usize, m);
            }
        }
        // The walked ones came after any searched ones.
        !searched_any
    }

    /// Who holds each key (debugging).
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<KeyHolders> {
        let pods = self.pods.read();
        keys.iter()
            .map(|key| KeyHolders {
                key: *key,
                pods: self.blocks.with_holders(*key, |h| {
                    h.unwrap_or(&[])
                        .iter()
                        .map(|h| (pods[h.pod().0 as usize].name.clone(), h.tiers()))
                        .collect()
                }),
            })
            .collect()
    }

    /// Every pod (of `model`, if given), sorted by model then pod.
    pub fn list_pods(&self, model: Option<&str>) -> Vec<PodSummary> {
        let pods: Vec<Arc<Pod>> = self.pods.read().clone();
        let now = Instant::now();
        let mut out: Vec<PodSummary> = pods
            .iter()
            .filter(|p| !p.is_removed() && model.is_none_or(|m| p.model == m))
            .map(|p| {
                let inner = self.lock(p);
                PodSummary {
                    pod: p.name.clone(),
                    model: p.model.clone(),
                    dp_rank: p.dp_rank,
                    block_size: self.pod_block_size(Some(p), &p.model),
                    blocks_per_tier: inner.state.held_per_tier(),
                    last_seq: inner.progress.last_seq,
                    batches: inner.progress.batches,
                    events: inner.progress.events,
                    seq_gaps: inner.progress.seq_gaps,
                    publisher_restarts: inner.progress.publisher_restarts,
                    duplicate_batches: inner.progress.duplicate_batches,
                    unrecovered_batches: inner.progress.unrecovered_batches,
                    incomplete: p.incomplete.load(Ordering::Relaxed),
                    last_event_age: inner.progress.last_event.map(|t| now - t),
                    applied: inner.progress.applied,
                    skipped: inner.progress.skipped,
                    key_mode: p.mode.name(),
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.model, &a.pod).cmp(&(&b.model, &b.pod)));
        out
    }

    /// Distinct keys held by any pod.
    pub fn indexed_keys(&self) -> usize {
        self.blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{BlockStored, EngineHash, KvEvent};

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> KvEvent {
        KvEvent::Stored(BlockStored {
            block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids: tokens.to_vec(),
            block_size: Some(bs),
            ..Default::default()
        })
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            events,
            ..Default::default()
        }
    }

    #[test]
    fn scores_every_candidate_best_first() {
        let ix = Indexer::new(IndexerConfig::default());
        let tokens: Vec<u32> = (0..40).collect();
        let a = ix.pod("m", "a", None);
        let b = ix.pod("m", "b", Some(0));
        ix.apply(
            &a,
            0,
            &batch(vec![stored(&[1, 2], None, &tokens[..32], 16)]),
        );
        ix.apply(&b, 0, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
        let out = ix.score(&ScoreQuery {
            model: "m",
            tokens: &tokens,
            lora_name: None,
            cache_salt: None,
            pods: &[],
        });
        assert_eq!(out.block_size, 16);
        assert_eq!(out.total_blocks, 2);
        let got: Vec<(&str, u32, f64)> = out
            .pods
            .iter()
            .map(|p| (p.pod.as_str(), p.matched.matched_blocks, p.score))
            .collect();
        assert_eq!(got, vec![("a", 2, 1.0), ("b", 1, 0.5)]);

        // Named candidates, one unknown, one duplicated.
        let names = ["zz".to_string(), "b".to_string(), "b".to_string()];
        let out = ix.score(&ScoreQuery {
            pods: &names,
            ..ScoreQuery {
                model: "m",
                tokens: &tokens,
                lora_name: None,
                cache_salt: None,
                pods: &[],
            }
        });
        let got: Vec<(&str, u32)> = out
            .pods
            .iter()
            .map(|p| (p.pod.as_str(), p.matched.matched_blocks))
            .collect();
        assert_eq!(got, vec![("b", 1), ("zz", 0)]);
    }

    #[test]
    fn pods_with_different_block_sizes_are_each_scored_in_their_own_blocks() {
        let ix = Indexer::new(IndexerConfig::default());
        let tokens: Vec<u32> = (0..64).collect();
        let small = ix.pod("m", "small", None);
        let large = ix.pod("m", "large", None);
        ix.apply(
            &small,
            0,
            &batch(vec![stored(&[1, 2, 3], None, &tokens[..48], 16)]),
        );
        ix.apply(
            &large,
            0,
            &batch(vec![stored(&[7], None, &tokens[..32], 32)]),
        );
        let out = ix.score(&ScoreQuery {
            model: "m",
            tokens: &tokens,
            lora_name: None,
            cache_salt: None,
            pods: &[],
        });
        let get = |n: &str| out.pods.iter().find(|p| p.pod == n).unwrap().clone();
        assert_eq!(get("small").matched.matched_blocks, 3);
        assert_eq!(get("small").total_blocks, 4);
        assert_eq!(get("large").matched.matched_blocks, 1);
        assert_eq!(get("large").block_size, 32);
        assert_eq!(get("large").total_blocks, 2);
    }

    /// New pods appearing while others ask about named pods: `try_pod`
    /// holds the pod table and inserts a name; a named lookup must not hold
    /// a name-map guard while it waits for the table (it used to: the
    /// process froze within seconds of a fleet's first minute).
    #[test]
    fn new_pods_during_named_lookups_do_not_deadlock() {
        let ix = Arc::new(Indexer::new(IndexerConfig::default()));
        let names: Vec<String> = (0..64).map(|i| format!("named-{i}")).collect();
        for n in &names {
            ix.pod("m", n, None);
        }
        let (done_tx, done) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        {
            let (ix, stop, done_tx) = (ix.clone(), stop.clone(), done_tx.clone());
            threads.push(std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    ix.pod("m", &format!("new-{i}"), None);
                    i += 1;
                }
                let _ = done_tx.send(());
            }));
        }
        for _ in 0..3 {
            let (ix, stop, done_tx, names) =
                (ix.clone(), stop.clone(), done_tx.clone(), names.clone());
            threads.push(std::thread::spawn(move || {
                let tokens: Vec<u32> = (0..32).collect();
                while !stop.load(Ordering::Relaxed) {
                    ix.score(&ScoreQuery {
                        model: "m",
                        tokens: &tokens,
                        lora_name: None,
                        cache_salt: None,
                        pods: &names,
                    });
                }
                let _ = done_tx.send(());
            }));
        }
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        for _ in 0..threads.len() {
            // Each loop iteration is microseconds: a thread that does not
            // finish within this long is stuck for good.
            done.recv_timeout(Duration::from_secs(20))
                .expect("deadlock: a thread never finished");
        }
        for t in threads {
            t.join().unwrap();
        }
    }

    /// A snapshot is kept across restarts only if the fingerprint is the
    /// same in every process: with several LoRA paths it used to follow a
    /// `HashMap`'s per-process order, so every restart started empty.
    #[test]
    fn the_key_fingerprint_is_stable_and_only_about_keys() {
        use crate::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo};
        use crate::scheme::{EngineKeys, KeyMode, KeySchemes};
        let indexer = |loras: &[(usize, &str)], self_check_every: u32| {
            let lora_paths = loras
                .iter()
                .map(|(i, path)| (format!("adapter-{i}"), (*path).to_owned()))
                .collect();
            let mode = KeyMode::Engine(Box::new(EngineKeys {
                hasher: EngineHasher::new(
                    HashAlgo::Sha256,
                    "vllm-none-hash",
                    ExtraKeyStyle::Tagged,
                ),
                lora_paths,
                assume_prefix_closed: true,
                self_check_every,
            }));
            Indexer::new(IndexerConfig {
                keys: KeySchemes {
                    default: mode.clone(),
                    per_model: [("m".to_owned(), mode)].into_iter().collect(),
                },
                ..Default::default()
            })
        };
        let forward: Vec<(usize, &str)> = (0..16).map(|i| (i, "/adapters/x")).collect();
        let backward: Vec<(usize, &str)> = forward.iter().rev().copied().collect();
        // Each map gets its own random hasher state, as in another process.
        let first = indexer(&forward, 64).keys_fingerprint();
        for _ in 0..8 {
            assert_eq!(indexer(&backward, 64).keys_fingerprint(), first);
        }
        // The self-check changes no key; an adapter's path does.
        assert_eq!(indexer(&forward, 0).keys_fingerprint(), first);
        let mut moved = forward.clone();
        moved[3].1 = "/adapters/y";
        assert_ne!(indexer(&moved, 64).keys_fingerprint(), first);
    }

    #[test]
    fn pod_and_model_bounds_refuse_new_ones_only() {
        let ix = Indexer::new(IndexerConfig {
            max_pods: Some(3),
            max_models: Some(2),
            ..Default::default()
        });
        ix.try_pod("a", "p1", None).unwrap();
        ix.try_pod("a", "p2", None).unwrap();
        ix.try_pod("b", "p1", None).unwrap();
        assert_eq!(ix.try_pod("a", "p3", None).err(), Some(Refused::Pods));
        // Existing pods are unaffected.
        assert!(ix.try_pod("a", "p1", None).is_ok());
        ix.remove_pod("a", "p2").unwrap();
        assert_eq!(ix.try_pod("c", "p1", None).err(), Some(Refused::Models));
        ix.try_pod("a", "p3", None).unwrap();
        assert_eq!(ix.live_pods(), 3);
        // A model whose last pod left frees its place.
        ix.remove_pod("b", "p1").unwrap();
        ix.try_pod("c", "p1", None).unwrap();
    }

    #[test]
    fn pods_fixed_cost_takes_at_most_half_the_memory_budget() {
        let ix = Indexer::new(IndexerConfig {
            max_entries: Some(1000),
            pod_cost_entries: 10,
            ..Default::default()
        });
        for i in 0..50 {
            ix.try_pod("m", &format!("p{i}"), None).unwrap();
        }
        assert_eq!(ix.try_pod("m", "p50", None).err(), Some(Refused::Memory));
        // Blocks get what the pods leave: 1000 - 50 * 10 = 500 entries.
        let pod = ix.pod("m", "p0", None);
        let tokens: Vec<u32> = (0..16 * 600).collect();
        let hashes: Vec<u64> = (1..=600).collect();
        ix.apply(&pod, 0, &batch(vec![stored(&hashes, None, &tokens, 16)]));
        assert!(ix.entries() <= 500, "{} entries", ix.entries());
    }

    #[test]
    fn dp_ranks_are_separate_pods_and_models_do_not_mix() {
        let ix = Indexer::new(IndexerConfig::default());
        let tokens: Vec<u32> = (0..16).collect();
        let r1 = ix.pod("m", "p", Some(1));
        let other = ix.pod("other", "p", None);
        assert_eq!(r1.name, "p#dp1");
        ix.apply(&r1, 0, &batch(vec![stored(&[1], None, &tokens, 16)]));
        ix.apply(&other, 0, &batch(vec![stored(&[1], None, &tokens, 16)]));
        let q = |model| {
            ix.score(&ScoreQuery {
                model,
                tokens: &tokens,
                lora_name: None,
                cache_salt: None,
                pods: &[],
            })
        };
        let m = q("m");
        assert_eq!(m.pods.len(), 1);
        assert_eq!(
            (m.pods[0].pod.as_str(), m.pods[0].matched.matched_blocks),
            ("p#dp1", 1)
        );
        assert_eq!(q("other").pods[0].matched.matched_blocks, 1);
        assert!(q("nobody").pods.is_empty());
    }

    #[test]
    fn a_publisher_restart_drops_the_pods_blocks_and_duplicates_are_skipped() {
        let ix = Indexer::new(IndexerConfig::default());
        let p = ix.pod("m", "p", None);
        let tokens: Vec<u32> = (0..32).collect();
        let q = ScoreQuery {
            model: "m",
            tokens: &tokens,
            lora_name: None,
            cache_salt: None,
            pods: &[],
        };
        ix.apply(&p, 0, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
        ix.apply(
            &p,
            1,
            &batch(vec![stored(&[2], Some(1), &tokens[16..], 16)]),
        );
        // The same batch again: skipped, no double count.
        ix.apply(
            &p,
            1,
            &batch(vec![stored(&[2], Some(1), &tokens[16..], 16)]),
        );
        assert_eq!(ix.score(&q).pods[0].matched.matched_blocks, 2);
        // vLLM restarted: seq 0 again, cache empty, new blocks only.
        let other: Vec<u32> = (100..116).collect();
        ix.apply(&p, 0, &batch(vec![stored(&[9], None, &other, 16)]));
        assert_eq!(ix.score(&q).pods[0].matched.matched_blocks, 0);
        let s = &ix.list_pods(None)[0];
        assert_eq!((s.publisher_restarts, s.duplicate_batches), (1, 1));
        assert_eq!(s.blocks_per_tier, [1, 0, 0]);
    }

    #[test]
    fn removed_pods_drop_their_blocks_and_come_back_fresh() {
        let ix = Indexer::new(IndexerConfig::default());
        let tokens: Vec<u32> = (0..16).collect();
        assert!(!ix.has_model("m"));
        let p = ix.pod("m", "p", None);
        assert!(ix.has_model("m") && !ix.has_model("other"));
        ix.apply(&p, 0, &batch(vec![stored(&[1], None, &tokens, 16)]));
        assert_eq!(ix.remove_pod("m", "p"), Some(1));
        assert_eq!(ix.remove_pod("m", "p"), None);
        assert!(!ix.has_model("m"), "no pod publishes it any more");
        assert!(p.is_removed());
        assert!(ix.list_pods(None).is_empty());
        assert_eq!(ix.indexed_keys(), 0);
        let again = ix.pod("m", "p", None);
        assert!(!again.is_removed());
        assert_eq!(ix.list_pods(None)[0].batches, 0);
    }

    #[test]
    fn capacity_evicts_from_the_largest_pod_oldest_first() {
        let ix = Indexer::new(IndexerConfig {
            max_entries: Some(100),
            ..Default::default()
        });
        let big = ix.pod("m", "big", None);
        let small = ix.pod("m", "small", None);
        let tokens: Vec<u32> = (0..16).collect();
        let block = |h: u64| -> Vec<u32> { tokens.iter().map(|x| x + h as u32 * 100).collect() };
        for h in 0..20u64 {
            ix.apply(
                &small,
                h,
                &batch(vec![stored(&[h], None, &block(1000 + h), 16)]),
            );
        }
        for h in 0..150u64 {
            ix.apply(&big, h, &batch(vec![stored(&[h], None, &block(h), 16)]));
        }
        assert!(ix.entries() <= 100, "{}", ix.entries());
        assert!(ix.evictions() >= 70, "{}", ix.evictions());
        let pods = ix.list_pods(None);
        let held = |n: &str| pods.iter().find(|p| p.pod == n).unwrap().blocks_per_tier[0];
        // Only the largest pod paid.
        assert_eq!(held("small"), 20);
        assert_eq!(held("big") + 20, ix.entries());
        // The most recent blocks survive.
        let last = block(149);
        let q = ScoreQuery {
            model: "m",
            tokens: &last,
            lora_name: None,
            cache_salt: None,
            pods: &[],
        };
        let out = ix.score(&q);
        assert_eq!(
            out.pods
                .iter()
                .find(|p| p.pod == "big")
                .unwrap()
                .matched
                .matched_blocks,
            1
        );
        let first = block(0);
        let out = ix.score(&ScoreQuery {
            tokens: &first,
            ..q
        });
        assert_eq!(
            out.pods
                .iter()
                .find(|p| p.pod == "big")
                .unwrap()
                .matched
                .matched_blocks,
            0
        );
    }

    #[test]
    fn a_snapshot_restores_every_pod_exactly() {
        let ix = Indexer::new(IndexerConfig::default());
        let tokens: Vec<u32> = (0..48).collect();
        let a = ix.pod("m", "a", None);
        let b = ix.pod("m", "b", Some(1));
        ix.apply(&a, 4, &batch(vec![stored(&[1, 2, 3], None, &tokens, 16)]));
        ix.apply(&b, 9, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
        ix.apply(&b, 10, &batch(vec![stored(&[1], None, &tokens[..16], 16)]));
        let bytes = ix.export(Vec::new()).unwrap();
        let snap = || std::io::Cursor::new(&bytes);
        let restored = Indexer::new(IndexerConfig::default());
        assert_eq!(restored.import(snap()).unwrap(), 2);
        let q = ScoreQuery {
            model: "m",
            tokens: &tokens,
            lora_name: None,
            cache_salt: None,
            pods: &[],
        };
        assert_eq!(ix.score(&q), restored.score(&q));
        let rb = restored.pod("m", "b", Some(1));
        assert_eq!(restored.last_seq(&rb), Some(10));
        // Counts survive: b stored hash 1 twice, so one removal keeps it.
        restored.apply(
            &rb,
            11,
            &batch(vec![KvEvent::Removed(crate::event::BlockRemoved {
                block_hashes: vec![EngineHash(1)],
                ..Default::default()
            })]),
        );
        assert_eq!(
            restored
                .score(&q)
                .pods
                .iter()
                .find(|p| p.pod == "b#dp1")
                .unwrap()
                .matched
                .matched_blocks,
            1
        );
        // Another key configuration cannot use these keys.
        let engine = Indexer::new(IndexerConfig {
            keys: KeySchemes::engine(
                crate::engine_hash::EngineHasher::new(
                    crate::engine_hash::HashAlgo::Sha256,
                    "x",
                    crate::engine_hash::ExtraKeyStyle::Tagged,
                ),
                true,
                0,
            ),
            ..Default::default()
        });
        assert_eq!(engine.import(snap()), Err(SnapshotError::KeysChanged));
        assert_eq!(engine.entries(), 0);
    }

    #[test]
    fn list_pods_reports_progress_and_gaps() {
        let ix = Indexer::new(IndexerConfig::default());
        let p = ix.pod("m", "p", None);
        let tokens: Vec<u32> = (0..16).collect();
        ix.apply(&p, 0, &batch(vec![stored(&[1], None, &tokens, 16)]));
        ix.apply(&p, 2, &batch(vec![KvEvent::AllCleared]));
        let s = &ix.list_pods(Some("m"))[0];
        assert_eq!(s.last_seq, Some(2));
        assert_eq!(s.seq_gaps, 1);
        assert_eq!(s.batches, 2);
        assert_eq!(s.applied.clears, 1);
        assert_eq!(s.blocks_per_tier, [0, 0, 0]);
        assert!(ix.list_pods(Some("x")).is_empty());
        let keys = ix.request_keys("m", None, None, &tokens, 16);
        assert!(ix.lookup(&keys)[0].pods.is_empty());
    }

    fn engine_indexer() -> Indexer {
        Indexer::new(IndexerConfig {
            keys: KeySchemes::engine(
                crate::engine_hash::EngineHasher::new(
                    crate::engine_hash::HashAlgo::Sha256,
                    crate::engine_hash::DEFAULT_SEED,
                    crate::engine_hash::ExtraKeyStyle::Tagged,
                ),
                false,
                0,
            ),
            ..Default::default()
        })
    }

    /// The binary search over prefix-closed pods must give exactly what the
    /// block-by-block walk gives, whatever the events did to the index:
    /// chains stored under held parents, under unknown parents, middle
    /// blocks removed (holes), CPU copies, clears. Random histories, checked
    /// after every batch against `walk` on the same index.
    #[test]
    fn jump_search_equals_the_first_miss_walk_on_random_histories() {
        let mut rnd = crate::test_rng::xorshift(0x1234_5678_9abc_def1u64);
        // Chains: node i's parent is node parent[i] (or none); hash = i + 1.
        let mut parent: Vec<Option<u64>> = Vec::new();
        for i in 0..400u64 {
            parent.push(match i % 40 {
                0 => None,
                _ => Some(i),
            });
        }
        // A few branches off the first chain.
        for i in 400..480u64 {
            parent.push(Some(if i % 20 == 0 { 1 + rnd(30) } else { i }));
        }
        let path_to = |mut node: u64, parent: &[Option<u64>]| -> Vec<u64> {
            let mut path = vec![node + 1];
            while let Some(p) = parent[node as usize] {
                path.push(p);
                node = p - 1;
            }
            path.reverse();
            path
        };
        let tokens = [7u32; 16];
        let mut closed_seen = 0;
        for round in 0..6 {
            let ix = engine_indexer();
            let pods: Vec<_> = (0..5)
                .map(|p| ix.pod("m", &format!("p{p}"), None))
                .collect();
            let mut seqs = [0u64; 5];
            for step in 0..300 {
                let p = rnd(5) as usize;
                let node = rnd(parent.len() as u64);
                let ev = match rnd(10) {
                    // Store a whole path from its root, the usual case.
                    0..=4 => {
                        let path = path_to(node, &parent);
                        // Mostly from the root; sometimes under a parent
                        // the pod may not hold.
                        let cut = match rnd(4) {
                            0 => rnd(path.len() as u64) as usize,
                            _ => 0,
                        };
                        let parent = cut.checked_sub(1).map(|i| path[i]);
                        let hashes = &path[cut..];
                        stored(hashes, parent, &tokens.repeat(hashes.len()), 16)
                    }
                    // Removals: any block (holes) in the early rounds; a
                    // path's tail, deepest first as vLLM evicts, later.
                    5..=7 if round < 3 => KvEvent::Removed(crate::event::BlockRemoved {
                        block_hashes: vec![EngineHash(node + 1)],
                        ..Default::default()
                    }),
                    5..=7 => {
                        let path = path_to(node, &parent);
                        let cut = rnd(path.len() as u64) as usize;
                        KvEvent::Removed(crate::event::BlockRemoved {
                            block_hashes: path[cut..]
                                .iter()
                                .rev()
                                .map(|h| EngineHash(*h))
                                .collect(),
                            ..Default::default()
                        })
                    }
                    8 if round < 2 => {
                        let mut e = stored(&[node + 1], Some(node), &[], 16);
                        if let KvEvent::Stored(s) = &mut e {
                            s.medium = Some(if round == 0 { "CPU" } else { "GPU" }.into());
                        }
                        e
                    }
                    9 if rnd(3) == 0 => KvEvent::AllCleared,
                    _ => continue,
                };
                ix.apply(&pods[p], seqs[p], &batch(vec![ev]));
                seqs[p] += 1;
                let ids: Vec<PodId> = pods.iter().map(|p| p.id).collect();
                for probe in 0..6 {
                    let path = path_to(rnd(parent.len() as u64), &parent);
                    let keys: Vec<BlockKey> = path.iter().map(|h| BlockKey(*h)).collect();
                    let want: Vec<(PodId, PrefixMatch)> = ids
                        .iter()
                        .copied()
                        .zip(walk(&ix.blocks, &keys, &ids, &ix.config.tier_weights))
                        .filter(|(_, m)| m.matched_blocks > 0)
                        .collect();
                    let got = ix.prefix_matches("m", &keys);
                    assert_eq!(got, want, "round {round} step {step} probe {probe}");
                }
                closed_seen += pods.iter().filter(|p| p.closure.is_closed()).count();
            }
        }
        // The fast path was taken, and not always.
        assert!(closed_seen > 1000, "{closed_seen}");
        assert!(closed_seen < 6 * 300 * 5, "{closed_seen}");
    }

    /// Readers binary-search pods while their writer applies events. The
    /// writer repeats: store a 100-block chain (match 100); remove its
    /// 50th block, a hole (match 49: the pod is no longer prefix-closed, and
    /// a binary search would see the last block and answer 100); remove the
    /// orphaned tail (49); remove the rest (0). A read that overlapped
    /// states `k0..=k1` must answer within their matches; a read made wholly
    /// inside the hole must answer 49. The writer waits for such a read in
    /// every state.
    #[test]
    fn concurrent_reads_stay_between_the_states_they_overlap() {
        use std::sync::atomic::AtomicU64;
        let ix = engine_indexer();
        let pod = ix.pod("m", "p", None);
        let tokens = vec![7u32; 100 * 16];
        let chain: Vec<u64> = (1..=100).collect();
        let keys: Vec<BlockKey> = chain.iter().map(|h| BlockKey(*h)).collect();
        let removed = |hashes: Vec<u64>| {
            KvEvent::Removed(crate::event::BlockRemoved {
                block_hashes: hashes.into_iter().map(EngineHash).collect(),
                ..Default::default()
            })
        };
        let script = [
            (stored(&chain, None, &tokens, 16), 100),
            (removed(vec![50]), 49),
            (removed((51..=100).rev().collect()), 49),
            (removed((1..=49).rev().collect()), 0),
        ];
        const ROUNDS: u64 = 300;
        let total = ROUNDS * script.len() as u64;
        let match_after = |k: u64| match k {
            0 => 0,
            k => script[((k - 1) % script.len() as u64) as usize].1,
        };
        // Events applied so far, and the last state read cleanly.
        let applied = AtomicU64::new(0);
        let read_in = AtomicU64::new(u64::MAX);
        let reader_failed = AtomicBool::new(false);
        // Set if the reader panics, so the writer stops waiting for it.
        struct Flag<'a>(&'a AtomicBool);
        impl Drop for Flag<'_> {
            fn drop(&mut self) {
                self.0.store(std::thread::panicking(), Ordering::Release);
            }
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                for k in 0..total {
                    let (event, _) = &script[(k % script.len() as u64) as usize];
                    ix.apply(&pod, k, &batch(vec![event.clone()]));
                    applied.store(k + 1, Ordering::Release);
                    let since = Instant::now();
                    while read_in.load(Ordering::Acquire) != k + 1
                        && since.elapsed() < Duration::from_secs(10)
                        && !reader_failed.load(Ordering::Acquire)
                    {
                        std::hint::spin_loop();
                    }
                }
            });
            let _flag = Flag(&reader_failed);
            let mut clean_reads = 0u64;
            loop {
                let k0 = applied.load(Ordering::Acquire);
                let got = ix
                    .prefix_matches("m", &keys)
                    .first()
                    .map_or(0, |(_, m)| m.matched_blocks);
                let k1 = applied.load(Ordering::Acquire);
                // States k0..=k1 were visible, and state k1 + 1 in flight.
                let last = (k1 + 1).min(total);
                let range = (k0..=last).map(match_after);
                let (lo, hi) = (range.clone().min().unwrap(), range.max().unwrap());
                assert!(
                    (lo..=hi).contains(&got),
                    "read over states {k0}..={last} answered {got}, not in {lo}..={hi}"
                );
                if k0 == k1 {
                    if k0 % 4 == 2 {
                        // Inside the hole, with only the tail's removal after it.
                        assert_eq!(got, 49, "read inside the hole (state {k0})");
                    }
                    clean_reads += 1;
                    read_in.store(k0, Ordering::Release);
                }
                if k0 == total {
                    break;
                }
            }
            assert!(clean_reads >= total, "{clean_reads}");
        });
    }
}

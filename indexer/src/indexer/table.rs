//! The pod table: which pods exist, by id, by name and by model.
//!
//! One lock guards all of it. The name map, the model map and the id slots
//! used to be three structures with three locks, taken in an order every
//! caller had to remember; one caller that held a name-map guard while it
//! waited for the slots froze the process. With one lock there is no order
//! to get wrong: nothing here takes another lock while it holds this one
//! (the block index's shards are taken under a read guard by queries, and
//! never the other way round).
//!
//! A removed pod's id is reused once its blocks are gone: the table grows
//! with the pods that exist, not with every pod that ever did.

use std::collections::HashMap;

use smallvec::SmallVec;

use super::*;

#[derive(Default)]
pub(super) struct PodTable {
    /// By id; `None` for a free id.
    slots: Vec<Option<Arc<Pod>>>,
    /// Ids of removed pods whose blocks are gone: handed out again.
    free: Vec<PodId>,
    /// (model, pod id with DP rank suffix) -> id.
    by_name: HashMap<(String, String), PodId>,
    /// (model, topic pod name) -> the ids of its DP ranks.
    by_topic: HashMap<(String, String), SmallVec<[PodId; 1]>>,
    models: BTreeMap<String, ModelEntry>,
}

pub(super) struct ModelEntry {
    /// The model's blocks. Per model: engine hashes do not say the model
    /// (two models fed one prompt name its blocks alike), and the runs
    /// find a block by its engine hash.
    pub(super) runs: Arc<KeyedRuns>,
    /// Pods of this model, sorted by id; shared, so a lookup takes the list
    /// without copying it. Changed in place (`Arc::make_mut`) unless a
    /// lookup holds it just then: a fleet's first minute adds thousands of
    /// pods a second, and a copy of the whole list per new pod, under the
    /// table's write lock, starved every reader.
    pub(super) pods: Arc<Vec<PodId>>,
    /// Last block size a pod of this model reported (0 = none yet).
    pub(super) block_size: u32,
    /// Last offloaded block size in tokens a pod of this model reported
    /// (0 = none yet).
    pub(super) offload_block_size: u32,
}

impl PodTable {
    pub(super) fn get(&self, id: PodId) -> Option<&Arc<Pod>> {
        self.slots.get(id.0 as usize).and_then(Option::as_ref)
    }

    pub(super) fn by_name(&self, model: &str, name: &str) -> Option<&Arc<Pod>> {
        // The key is owned: one allocation per named lookup, no lock held.
        let id = self.by_name.get(&(model.to_owned(), name.to_owned()))?;
        self.get(*id)
    }

    pub(super) fn model(&self, model: &str) -> Option<&ModelEntry> {
        self.models.get(model)
    }

    pub(super) fn model_mut(&mut self, model: &str) -> Option<&mut ModelEntry> {
        self.models.get_mut(model)
    }

    pub(super) fn models(&self) -> impl Iterator<Item = (&String, &ModelEntry)> {
        self.models.iter()
    }

    pub(super) fn pods(&self) -> impl Iterator<Item = &Arc<Pod>> {
        self.slots.iter().flatten()
    }

    pub(super) fn live(&self) -> usize {
        self.by_name.len()
    }
}

impl Indexer {
    /// The pod for a topic's pod name, model and DP rank, created on first
    /// use. For indexers without pod bounds (tests, benches); the service
    /// uses [`Indexer::try_pod`].
    pub fn pod(&self, model: &str, pod: &str, dp_rank: Option<u32>) -> Arc<Pod> {
        self.try_pod(model, pod, dp_rank)
            .expect("a pod refused by an indexer configured without pod bounds")
    }

    /// A pod that exists, by model and id (`pod_id(pod, rank)`).
    pub fn find_pod(&self, model: &str, name: &str) -> Option<Arc<Pod>> {
        self.table.read().by_name(model, name).cloned()
    }

    /// Every pod, for their writers to adopt (pods restored from a snapshot).
    pub fn list_pod_handles(&self) -> Vec<Arc<Pod>> {
        self.table.read().pods().cloned().collect()
    }

    /// Every DP rank of a topic's pod.
    pub fn pod_domains(&self, model: &str, pod: &str) -> Vec<Arc<Pod>> {
        let table = self.table.read();
        table
            .by_topic
            .get(&(model.to_owned(), pod.to_owned()))
            .map(|ids| {
                ids.iter()
                    .filter_map(|id| table.get(*id).cloned())
                    .collect()
            })
            .unwrap_or_default()
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
        if let Some(found) = self.table.read().by_name(model, &name) {
            return Ok(found.clone());
        }
        let mut table = self.table.write();
        // Re-check under the write guard: another thread may have won.
        if let Some(found) = table.by_name(model, &name) {
            return Ok(found.clone());
        }
        let live = table.live();
        if self.config.max_pods.is_some_and(|max| live >= max) {
            return Err(Refused::Pods);
        }
        if let (Some(cap), cost @ 1..) = (self.config.max_entries, self.config.pod_cost_entries) {
            if (live + 1).saturating_mul(cost) > cap / 2 {
                return Err(Refused::Memory);
            }
        }
        if !table.models.contains_key(model)
            && self
                .config
                .max_models
                .is_some_and(|max| table.models.len() >= max)
        {
            return Err(Refused::Models);
        }
        let id = match table.free.pop() {
            Some(id) => id,
            None if table.slots.len() < MAX_POD as usize => {
                table.slots.push(None);
                PodId(table.slots.len() as u32 - 1)
            }
            None => return Err(Refused::Ids),
        };
        let runs = table
            .models
            .entry(model.to_owned())
            .or_insert_with(|| ModelEntry {
                runs: Arc::new(KeyedRuns::new(
                    &self.config.tier_weights,
                    self.config.max_entries.is_some(),
                )),
                pods: Arc::default(),
                block_size: 0,
                offload_block_size: 0,
            })
            .runs
            .clone();
        let state = PodFeed::new(id.0, model);
        let slot = Arc::new(Pod {
            id,
            name: name.clone(),
            model: model.to_owned(),
            topic_pod: pod.to_owned(),
            dp_rank,
            mode: self.config.keys.for_model(model).clone(),
            runs,
            block_size: AtomicU32::new(0),
            offload_block_size: AtomicU32::new(0),
            incomplete: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            connection: AtomicU8::new(Connection::Unknown as u8),
            entries: AtomicU64::new(0),
            engine: AtomicU8::new(0),
            bigram: AtomicBool::new(false),
            inner: Mutex::new(PodInner {
                state,
                progress: Progress::default(),
            }),
        });
        table.slots[id.0 as usize] = Some(slot.clone());
        let entry = table.models.get_mut(model).expect("made above");
        let ids = Arc::make_mut(&mut entry.pods);
        // A reused id may be lower than the others.
        let at = ids.partition_point(|p| *p < id);
        ids.insert(at, id);
        table.by_name.insert((model.to_owned(), name), id);
        table
            .by_topic
            .entry((model.to_owned(), pod.to_owned()))
            .or_default()
            .push(id);
        self.live_pods.store(table.live(), Ordering::Relaxed);
        Ok(slot)
    }

    /// Forgets a pod: takes it out of the candidates, drops its blocks and
    /// frees its id. O(its blocks). Returns the blocks it held (all tiers),
    /// or `None` if it was removed already. The service calls this only
    /// from the pod's own ingest worker (its single writer).
    pub fn remove_pod(&self, pod: &Pod) -> Option<u64> {
        if pod.removed.swap(true, Ordering::Relaxed) {
            return None;
        }
        {
            let mut table = self.table.write();
            table.by_name.remove(&(pod.model.clone(), pod.name.clone()));
            let topic = (pod.model.clone(), pod.topic_pod.clone());
            if let Some(ids) = table.by_topic.get_mut(&topic) {
                ids.retain(|id| *id != pod.id);
                if ids.is_empty() {
                    table.by_topic.remove(&topic);
                }
            }
            if let Some(m) = table.models.get_mut(&pod.model) {
                let ids = Arc::make_mut(&mut m.pods);
                if let Ok(at) = ids.binary_search(&pod.id) {
                    ids.remove(at);
                }
                // A model without pods is no longer held (`max_models`).
                if m.pods.is_empty() {
                    table.models.remove(&pod.model);
                }
            }
            self.live_pods.store(table.live(), Ordering::Relaxed);
        }
        // No query can pick it any more; its blocks go, then its id.
        let held = self.clear_blocks(pod);
        let mut table = self.table.write();
        table.slots[pod.id.0 as usize] = None;
        table.free.push(pod.id);
        Some(held)
    }

    /// Whether some pod publishes events for `model`: the service
    /// tokenizes prompts only for such models and configured ones.
    pub fn has_model(&self, model: &str) -> bool {
        self.table
            .read()
            .model(model)
            .is_some_and(|m| !m.pods.is_empty())
    }

    /// Block size prompts of `model` are chunked with, for the response header.
    pub fn model_block_size(&self, model: &str) -> u32 {
        match self.table.read().model(model) {
            Some(m) if m.block_size > 0 => m.block_size,
            _ => self.config.default_block_size,
        }
    }

    /// How pod `name` of `model` pages a prompt, from one lookup of it:
    /// the block size it chunks prompts with (one not seen yet: the
    /// model's), and whether its pages are EAGLE's bigrams (keyed by
    /// `bigram_request_keys`).
    pub fn pod_paging(&self, model: &str, name: &str) -> (u32, bool) {
        let pod = self.find_pod(model, name);
        let bigram = pod
            .as_ref()
            .is_some_and(|p| p.bigram.load(Ordering::Relaxed));
        (self.pod_block_size(pod.as_deref(), model), bigram)
    }

    pub(super) fn pod_block_size(&self, pod: Option<&Pod>, model: &str) -> u32 {
        match pod.map(|p| p.block_size.load(Ordering::Relaxed)) {
            Some(bs) if bs > 0 => bs,
            _ => self.model_block_size(model),
        }
    }

    /// Records a model's offloaded block size, as `learn_block_size` does.
    pub(super) fn learn_offload_block_size(&self, model: &str, size: u32) {
        self.learn_model_size(
            model,
            size,
            |m| m.offload_block_size,
            |m, s| m.offload_block_size = s,
        );
    }

    /// Records a model's block size (a pod's events said so).
    pub(super) fn learn_block_size(&self, model: &str, block_size: u32) {
        self.learn_model_size(model, block_size, |m| m.block_size, |m, s| m.block_size = s);
    }

    /// Records a size a pod's events gave for its model (read by `get`,
    /// written by `set`). Every new pod says so once: the write lock only
    /// when it changes.
    fn learn_model_size(
        &self,
        model: &str,
        size: u32,
        get: impl Fn(&ModelEntry) -> u32,
        set: impl FnOnce(&mut ModelEntry, u32),
    ) {
        let known = self.table.read().model(model).map(get);
        if known.is_none_or(|s| s == size) {
            return;
        }
        if let Some(m) = self.table.write().model_mut(model) {
            set(m, size);
        }
    }
}

//! The approximate index, for models whose pods publish no events: where
//! requests were *sent* (`RecordRouting`), kept per pod in an LRU, as
//! llm-d's approximate prefix producer keeps it.
//!
//! Its answers are a guess from routing history, never what a pod holds,
//! and responses say so (`approximate: true`). A model whose pods start
//! publishing switches to the exact index on its own.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::keys::BlockKey;
use crate::keys::KeyBuildHasher;

/// Text chunking for prompts without a tokenizer: 64 pseudo-tokens of 4
/// bytes per block (llm-d's approximate producer's defaults).
pub const TEXT_BLOCK_BYTES: usize = 256;
/// The block size such a block stands for, in pseudo-tokens of 4 bytes.
pub const TEXT_BLOCK_TOKENS: u32 = (TEXT_BLOCK_BYTES / 4) as u32;

/// Keys of a text prompt's 256-byte blocks, the partial tail included,
/// chained from a seed over the model name and cache salt.
pub fn text_block_keys(model: &str, cache_salt: Option<&str>, text: &[u8]) -> Vec<BlockKey> {
    let mut seed_bytes = Vec::with_capacity(model.len() + 32);
    seed_bytes.extend_from_slice(b"kv-indexer/approximate/v1\0");
    seed_bytes.extend_from_slice(model.as_bytes());
    seed_bytes.push(0);
    if let Some(salt) = cache_salt {
        seed_bytes.extend_from_slice(salt.as_bytes());
    }
    let mut prev = xxh3_64_with_seed(&seed_bytes, 0);
    text.chunks(TEXT_BLOCK_BYTES)
        .map(|chunk| {
            prev = xxh3_64_with_seed(chunk, prev);
            BlockKey(prev)
        })
        .collect()
}

/// One pod's recently routed blocks, least recently used dropped first.
struct Lru {
    used: HashMap<BlockKey, u64, KeyBuildHasher>,
    by_use: BTreeMap<u64, BlockKey>,
    clock: u64,
}

impl Lru {
    fn new() -> Self {
        Lru {
            used: HashMap::default(),
            by_use: BTreeMap::new(),
            clock: 0,
        }
    }

    fn touch(&mut self, keys: &[BlockKey], capacity: usize) -> isize {
        let before = self.used.len() as isize;
        for key in keys {
            self.clock += 1;
            if let Some(old) = self.used.insert(*key, self.clock) {
                self.by_use.remove(&old);
            }
            self.by_use.insert(self.clock, *key);
        }
        while self.used.len() > capacity {
            let Some((_, key)) = self.by_use.pop_first() else {
                break;
            };
            self.used.remove(&key);
        }
        self.used.len() as isize - before
    }
}

struct ApproximateModel {
    /// Its pods published events: the exact index answers now.
    precise: AtomicBool,
    pods: RwLock<HashMap<String, Arc<RwLock<Lru>>>>,
}

/// Every approximate model's routing history.
pub struct Approximate {
    models: HashMap<String, ApproximateModel>,
    /// Blocks kept per pod, and in all.
    capacity: usize,
    max_entries: usize,
    entries: std::sync::atomic::AtomicIsize,
}

impl Approximate {
    /// `models`: `--approximate-model`; `capacity`: `--approximate-capacity`
    /// (per pod); `max_entries`: over all pods (beyond it, a pod's history
    /// only turns over, it does not grow).
    pub fn new(
        models: impl IntoIterator<Item = String>,
        capacity: usize,
        max_entries: usize,
    ) -> Self {
        Approximate {
            models: models
                .into_iter()
                .map(|m| {
                    let model = ApproximateModel {
                        precise: AtomicBool::new(false),
                        pods: RwLock::default(),
                    };
                    (m, model)
                })
                .collect(),
            capacity: capacity.max(1),
            max_entries,
            entries: Default::default(),
        }
    }

    /// Whether `model` is answered from routing history now.
    pub fn serves(&self, model: &str) -> bool {
        self.models
            .get(model)
            .is_some_and(|m| !m.precise.load(Ordering::Relaxed))
    }

    /// Configured approximate, whether or not it switched.
    pub fn configured(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    /// Blocks held over all pods.
    pub fn entries(&self) -> usize {
        self.entries.load(Ordering::Relaxed).max(0) as usize
    }

    /// The model's pods published events: from now on the exact index
    /// answers. Returns true the first time (for the log). Its history is
    /// dropped.
    pub fn switch_to_precise(&self, model: &str) -> bool {
        let Some(m) = self.models.get(model) else {
            return false;
        };
        if m.precise.swap(true, Ordering::Relaxed) {
            return false;
        }
        let pods = std::mem::take(&mut *m.pods.write());
        let dropped: usize = pods.values().map(|p| p.read().used.len()).sum();
        self.entries.fetch_sub(dropped as isize, Ordering::Relaxed);
        true
    }

    /// Writer (the pod's owner): `pod` was sent a prompt with these keys.
    pub fn record(&self, model: &str, pod: &str, keys: &[BlockKey]) {
        let Some(m) = self
            .models
            .get(model)
            .filter(|m| !m.precise.load(Ordering::Relaxed))
        else {
            return;
        };
        let room = self.max_entries.saturating_sub(self.entries());
        let existing = m.pods.read().get(pod).cloned();
        // With nothing left, a new pod gets nothing, not even its record
        // (one block each let the total grow by one per pod past the
        // bound, and an empty record per name would grow without one).
        let lru = match existing {
            Some(lru) => lru,
            None if room == 0 || keys.is_empty() => return,
            None => m
                .pods
                .write()
                .entry(pod.to_owned())
                .or_insert_with(|| Arc::new(RwLock::new(Lru::new())))
                .clone(),
        };
        let mut lru = lru.write();
        let capacity = self.capacity.min(lru.used.len() + room);
        let grown = lru.touch(keys, capacity);
        self.entries.fetch_add(grown, Ordering::Relaxed);
    }

    /// Writer: forgets a pod's history.
    pub fn forget_pod(&self, model: &str, pod: &str) {
        let Some(m) = self.models.get(model) else {
            return;
        };
        let removed = m.pods.write().remove(pod);
        if let Some(lru) = removed {
            let n = lru.read().used.len();
            self.entries.fetch_sub(n as isize, Ordering::Relaxed);
        }
    }

    /// Pods of `model` with history.
    pub fn pods_of(&self, model: &str) -> Vec<String> {
        self.models
            .get(model)
            .map(|m| m.pods.read().keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Per candidate (all pods with history when `pods` is empty): leading
    /// blocks of `keys` in its history. The walk stops at the first block
    /// no candidate has (the global first-miss break).
    pub fn matches(&self, model: &str, keys: &[BlockKey], pods: &[String]) -> Vec<(String, u32)> {
        let Some(m) = self.models.get(model) else {
            return Vec::new();
        };
        let lrus: Vec<(String, Option<Arc<RwLock<Lru>>>)> = {
            let table = m.pods.read();
            if pods.is_empty() {
                table
                    .iter()
                    .map(|(p, l)| (p.clone(), Some(l.clone())))
                    .collect()
            } else {
                let mut seen = std::collections::HashSet::new();
                pods.iter()
                    .filter(|p| seen.insert(p.as_str()))
                    .map(|p| (p.clone(), table.get(p).cloned()))
                    .collect()
            }
        };
        let guards: Vec<_> = lrus
            .iter()
            .map(|(_, l)| l.as_ref().map(|l| l.read()))
            .collect();
        let mut matched = vec![0u32; lrus.len()];
        let mut running: Vec<usize> = (0..lrus.len()).filter(|i| guards[*i].is_some()).collect();
        for key in keys {
            running.retain(|&i| guards[i].as_ref().is_some_and(|g| g.used.contains_key(key)));
            if running.is_empty() {
                break;
            }
            for &i in &running {
                matched[i] += 1;
            }
        }
        drop(guards);
        lrus.into_iter().map(|(p, _)| p).zip(matched).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(r: std::ops::Range<u64>) -> Vec<BlockKey> {
        r.map(BlockKey).collect()
    }

    #[test]
    fn text_blocks_keep_the_tail_and_depend_on_model_and_salt() {
        let text = vec![b'x'; 600];
        let k = text_block_keys("m", None, &text);
        assert_eq!(k.len(), 3);
        // A longer text shares the full blocks, not the tail.
        let k2 = text_block_keys("m", None, &[b'x'; 700]);
        assert_eq!(k[..2], k2[..2]);
        assert_ne!(k[2], k2[2]);
        assert_ne!(text_block_keys("m", Some("s"), &text)[0], k[0]);
        assert_ne!(text_block_keys("n", None, &text)[0], k[0]);
    }

    #[test]
    fn history_answers_with_a_first_miss_walk_and_a_global_break() {
        let a = Approximate::new(["m".to_string()], 100, 1000);
        a.record("m", "p1", &keys(0..10));
        a.record("m", "p2", &keys(0..4));
        let mut got = a.matches("m", &keys(0..12), &[]);
        got.sort();
        assert_eq!(got, vec![("p1".to_string(), 10), ("p2".to_string(), 4)]);
        let named = a.matches("m", &keys(0..3), &["p2".into(), "p3".into(), "p2".into()]);
        assert_eq!(named, vec![("p2".to_string(), 3), ("p3".to_string(), 0)]);
        assert!(a.matches("other", &keys(0..3), &[]).is_empty());
    }

    #[test]
    fn the_total_bound_holds_however_many_pods() {
        let a = Approximate::new(["m".to_string()], 100, 10);
        for p in 0..20 {
            a.record("m", &format!("p{p}"), &keys(0..4));
        }
        assert_eq!(a.entries(), 10);
        // Nor does a name minted past the bound keep a record.
        assert_eq!(a.pods_of("m").len(), 3);
    }

    #[test]
    fn each_pod_keeps_its_most_recent_blocks_and_the_model_can_switch() {
        let a = Approximate::new(["m".to_string()], 5, 1000);
        a.record("m", "p", &keys(0..4));
        a.record("m", "p", &keys(10..13));
        // 0 and 1 went first.
        assert_eq!(a.entries(), 5);
        assert_eq!(a.matches("m", &keys(2..4), &[])[0].1, 2);
        assert_eq!(a.matches("m", &keys(0..4), &[])[0].1, 0);
        assert!(a.serves("m"));
        assert!(a.switch_to_precise("m"));
        assert!(!a.switch_to_precise("m"));
        assert!(!a.serves("m") && a.configured("m"));
        assert_eq!(a.entries(), 0);
        a.record("m", "p", &keys(0..4));
        assert_eq!(a.entries(), 0);
    }
}

//! Speculative entries: blocks a pod was *sent* (the router picked it for a
//! prompt and said so with `RecordRouting`), not blocks it is known to hold.
//!
//! They live beside the exact index, never in it: `matched_blocks` keeps
//! meaning what vLLM holds, and a speculative entry only ever adds to a
//! pod's `speculative_blocks`. An entry ends when its TTL passes (readers
//! ignore it from that instant; its writer frees it at its next sweep), when
//! the pod's real store of that block arrives, or when the pod's cache is
//! cleared, restarted, evicted from or removed.
//!
//! Each pod's entries are written only by the pod's writer (the ingest
//! worker that owns it, as for its exact state); readers take a pod's read
//! lock after releasing the table's, never both at once.
//!
//! One pod's entries are a log in the order they were written (`log`):
//! a prompt's walk reads them in order, not one probe per block.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::RwLock;

pub use log::PodSpeculation;

use crate::keys::BlockKey;

mod log;

type Pods = HashMap<String, Arc<RwLock<PodSpeculation>>>;

/// One pod's live entries: (key, end), in the order they were written.
pub struct LiveEntries {
    pub model: String,
    pub pod: String,
    pub entries: Vec<(BlockKey, Instant)>,
}

/// Every pod's speculative entries, bounded in total.
pub struct Speculative {
    /// model -> pod name -> entries.
    models: RwLock<HashMap<String, Pods>>,
    entries: AtomicUsize,
    max_entries: usize,
}

impl Speculative {
    pub fn new(max_entries: usize) -> Self {
        Speculative {
            models: RwLock::default(),
            entries: AtomicUsize::new(0),
            max_entries,
        }
    }

    /// Entries held (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.entries.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    /// A pod's entries, for reading (`None`: it has none).
    pub fn pod(&self, model: &str, pod: &str) -> Option<Arc<RwLock<PodSpeculation>>> {
        self.models.read().get(model)?.get(pod).cloned()
    }

    /// Every pod's entries live at `now`, in write order with their ends.
    pub fn live(&self, now: Instant) -> Vec<LiveEntries> {
        let pods: Vec<(String, String, Arc<RwLock<PodSpeculation>>)> = self
            .models
            .read()
            .iter()
            .flat_map(|(model, pods)| {
                pods.iter()
                    .map(move |(pod, p)| (model.clone(), pod.clone(), p.clone()))
            })
            .collect();
        // Each pod's lock after the table's is released (see the module doc).
        pods.into_iter()
            .map(|(model, pod, p)| {
                let entries = p.read().live(now);
                LiveEntries {
                    model,
                    pod,
                    entries,
                }
            })
            .filter(|l| !l.entries.is_empty())
            .collect()
    }

    /// Pods of `model` with speculative entries.
    pub fn pods_of(&self, model: &str) -> Vec<String> {
        self.models
            .read()
            .get(model)
            .map(|pods| pods.keys().cloned().collect())
            .unwrap_or_default()
    }

    fn pod_or_insert(&self, model: &str, pod: &str) -> Arc<RwLock<PodSpeculation>> {
        if let Some(p) = self.pod(model, pod) {
            return p;
        }
        self.models
            .write()
            .entry(model.to_owned())
            .or_default()
            .entry(pod.to_owned())
            .or_default()
            .clone()
    }

    /// Writer: `keys` become speculative for `pod` until `until` (an entry
    /// already there keeps the later end). Past the bound, the pod's
    /// expired entries are swept first; what still does not fit is not
    /// written. Returns how many of `keys` are speculative now.
    pub fn insert(
        &self,
        model: &str,
        pod: &str,
        keys: &[BlockKey],
        until: Instant,
        now: Instant,
    ) -> usize {
        if keys.is_empty() {
            return 0;
        }
        let entries = self.pod_or_insert(model, pod);
        let mut spec = entries.write();
        if self.len() + keys.len() > self.max_entries {
            self.sweep_locked(&mut spec, now);
        }
        // Room reserved up front, the unused part given back: pods'
        // writers run on several workers at once, and each reading the
        // room left and then adding could together pass the bound.
        let want = keys.len();
        let before = self.entries.fetch_add(want, Ordering::Relaxed);
        let room = self.max_entries.saturating_sub(before).min(want);
        let (written, new) = spec.insert(keys, until, room);
        self.entries.fetch_sub(want - new, Ordering::Relaxed);
        written
    }

    /// Writer: the pod's real stores of `keys` arrived.
    pub fn supersede(&self, model: &str, pod: &str, keys: &[BlockKey]) {
        let Some(entries) = self.pod(model, pod) else {
            return;
        };
        let ended = entries.write().supersede(keys);
        self.entries.fetch_sub(ended, Ordering::Relaxed);
    }

    /// Writer: the pod's cache was cleared, restarted, evicted from or
    /// removed: what it was sent is no longer a good guess either.
    pub fn clear_pod(&self, model: &str, pod: &str) {
        let entries = {
            let mut models = self.models.write();
            let Some(pods) = models.get_mut(model) else {
                return;
            };
            let Some(entries) = pods.remove(pod) else {
                return;
            };
            if pods.is_empty() {
                models.remove(model);
            }
            entries
        };
        let n = entries.read().len();
        self.entries.fetch_sub(n, Ordering::Relaxed);
    }

    /// Writer: frees `pod`'s expired entries (and the pod's record once empty).
    pub fn sweep(&self, model: &str, pod: &str, now: Instant) {
        let Some(entries) = self.pod(model, pod) else {
            return;
        };
        let empty = {
            let mut spec = entries.write();
            self.sweep_locked(&mut spec, now);
            spec.is_empty()
        };
        if empty {
            // Only this writer adds to the pod, so it is still empty.
            let mut models = self.models.write();
            if let Some(pods) = models.get_mut(model) {
                pods.remove(pod);
                if pods.is_empty() {
                    models.remove(model);
                }
            }
        }
    }

    fn sweep_locked(&self, spec: &mut PodSpeculation, now: Instant) {
        let ended = spec.sweep(now);
        self.entries.fetch_sub(ended, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn keys(r: std::ops::Range<u64>) -> Vec<BlockKey> {
        r.map(BlockKey).collect()
    }

    #[test]
    fn entries_end_at_their_ttl_and_are_freed_by_a_sweep() {
        let s = Speculative::new(100);
        let now = Instant::now();
        assert_eq!(
            s.insert("m", "a", &keys(0..4), now + Duration::from_secs(1), now),
            4
        );
        let pod = s.pod("m", "a").unwrap();
        assert!(pod.read().holds(BlockKey(3), now));
        assert!(!pod.read().holds(BlockKey(3), now + Duration::from_secs(1)));
        s.sweep("m", "a", now + Duration::from_secs(2));
        assert_eq!(s.len(), 0);
        assert!(s.pod("m", "a").is_none());
        assert!(s.pods_of("m").is_empty());
    }

    #[test]
    fn a_real_store_supersedes_and_a_clear_drops_everything() {
        let s = Speculative::new(100);
        let now = Instant::now();
        let until = now + Duration::from_secs(5);
        s.insert("m", "a", &keys(0..4), until, now);
        s.insert("m", "b", &keys(0..2), until, now);
        s.supersede("m", "a", &keys(0..2));
        assert_eq!(s.len(), 4);
        let a = s.pod("m", "a").unwrap();
        assert!(!a.read().holds(BlockKey(1), now) && a.read().holds(BlockKey(2), now));
        s.clear_pod("m", "a");
        assert_eq!(s.len(), 2);
        assert_eq!(s.pods_of("m"), vec!["b".to_string()]);
    }

    #[test]
    fn the_bound_holds_and_expired_entries_make_room() {
        let s = Speculative::new(10);
        let now = Instant::now();
        assert_eq!(
            s.insert("m", "a", &keys(0..8), now + Duration::from_millis(10), now),
            8
        );
        // Only 2 fit while the first 8 live.
        assert_eq!(
            s.insert("m", "a", &keys(100..108), now + Duration::from_secs(1), now),
            2
        );
        assert_eq!(s.len(), 10);
        // Once they expired, a sweep on insert makes room.
        let later = now + Duration::from_millis(20);
        assert_eq!(
            s.insert(
                "m",
                "a",
                &keys(200..208),
                later + Duration::from_secs(1),
                later
            ),
            8
        );
        assert_eq!(s.len(), 10);
        // A key written again keeps the later end, and costs nothing.
        assert_eq!(s.insert("m", "a", &keys(200..201), later, later), 1);
        assert!(s
            .pod("m", "a")
            .unwrap()
            .read()
            .holds(BlockKey(200), later + Duration::from_millis(500)));
    }
}

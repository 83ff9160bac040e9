//! Speculative entries through the indexer: written by the pod's writer
//! (as its exact state is), dropped with the pod's cache (clear, restart,
//! eviction, removal), read by `score`.

use super::*;
use crate::event::EngineHash;

impl Indexer {
    /// Routed-to blocks not stored yet (see `routing::speculative`).
    pub fn speculative(&self) -> &Speculative {
        &self.speculative
    }

    /// Writer: `keys` become speculative for the pod (by model and name; it
    /// need not have published yet) until `until`. Returns how many are.
    pub fn speculate(
        &self,
        model: &str,
        pod: &str,
        keys: &[BlockKey],
        until: Instant,
        now: Instant,
    ) -> usize {
        self.speculative.insert(model, pod, keys, until, now)
    }

    /// Leading blocks of `keys[from..]` that `pod` holds exactly (any tier).
    pub fn exact_run(&self, pod: &Pod, keys: &[BlockKey], from: usize) -> usize {
        if pod.is_removed() {
            return 0;
        }
        keys.get(from..)
            .unwrap_or(&[])
            .iter()
            .take_while(|key| self.holds_exactly(pod.id, **key))
            .count()
    }

    /// Whether the pod holds `key` exactly (any tier).
    pub(super) fn holds_exactly(&self, pod: PodId, key: BlockKey) -> bool {
        self.blocks.with_holders(key, |h| h.get(pod).is_some())
    }

    /// Our keys of blocks `pod` holds, by engine hash (`None`: not held).
    pub fn keys_of(&self, pod: &Pod, hashes: &[EngineHash]) -> Vec<Option<BlockKey>> {
        let inner = self.lock(pod);
        hashes.iter().map(|h| inner.state.key_of(*h)).collect()
    }

    /// The pod's cache changed under its speculative entries (cleared,
    /// restarted, evicted from, removed): they go too.
    pub(super) fn drop_speculation(&self, pod: &Pod) {
        if !self.speculative.is_empty() {
            self.speculative.clear_pod(&pod.model, &pod.name);
        }
    }
}

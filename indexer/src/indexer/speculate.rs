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

    /// Leading blocks of `keys[from..]` that `pod` holds exactly (any
    /// tier). `keys` are a prompt's, from its first block.
    pub fn exact_run(&self, pod: &Pod, keys: &[BlockKey], from: usize) -> usize {
        if pod.is_removed() || from >= keys.len() {
            return 0;
        }
        let held = held_by(&pod.runs, pod.id.0, BlockKey::as_raw(keys));
        (from..keys.len())
            .take_while(|i| !held.at(*i as u32).is_empty())
            .count()
    }

    /// Our keys of blocks `pod` holds, by engine hash (`None`: not held).
    pub fn keys_of(&self, pod: &Pod, hashes: &[EngineHash]) -> Vec<Option<BlockKey>> {
        let inner = self.lock(pod);
        hashes
            .iter()
            .map(|h| inner.state.key_of(&pod.runs, h.0))
            .collect()
    }

    /// The pod's cache changed under its speculative entries (cleared,
    /// restarted, evicted from, removed): they go too.
    pub(super) fn drop_speculation(&self, pod: &Pod) {
        if !self.speculative.is_empty() {
            self.speculative.clear_pod(&pod.model, &pod.name);
        }
    }
}

/// What `pod` holds of a prompt's `keys` in its model's `runs`, on any
/// tier, in either key kind's runs (a prompt's keys are of one kind: the
/// other holds none of them).
fn held_by(runs: &KeyedRuns, pod: u32, keys: &[u64]) -> Held {
    let mut spans = Vec::new();
    for runs in [&runs.engine, &runs.token] {
        if let Some(along) = runs.held_along(keys).into_iter().find(|a| a.pod == pod) {
            spans.extend(along.spans);
        }
    }
    Held::of(&crate::index::HeldAlong { pod, spans })
}

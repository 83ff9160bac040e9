//! Writing a pod: its batches, its restarts, its removal and its share of
//! capacity eviction. Every function here is called by the pod's single
//! writer (the service's ingest worker that owns its topic; in tests and
//! benches, the one thread that feeds it). Seq rules are not here: they
//! live in [`crate::stream`], whose actions the writer turns into these
//! calls.

use super::*;

/// What a pod's stream reported, counted in `ListPods`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamCount {
    Gap,
    Duplicate,
}

impl Indexer {
    /// Applies one decoded batch of `pod`'s events, published with `seq`,
    /// in the order its stream decided (see [`crate::stream`]).
    pub fn apply(&self, pod: &Pod, seq: u64, batch: &EventBatch) -> ApplyStats {
        self.apply_fingerprinted(pod, seq, None, batch)
    }

    /// `apply`, with the batch's fingerprint (`stream::Fingerprint`, a
    /// hash of its payload) when the caller has it: a snapshot keeps it
    /// beside the seq, so that after a restart the pod's buffer can show
    /// whether that batch is still the pod's (see
    /// `stream::Stream::restored_batch`).
    pub fn apply_fingerprinted(
        &self,
        pod: &Pod,
        seq: u64,
        fingerprint: Option<u64>,
        batch: &EventBatch,
    ) -> ApplyStats {
        let mut stats = ApplyStats::default();
        // A removed pod's late batches would hold entries no query sees:
        // dropped.
        if pod.is_removed() {
            return stats;
        }
        let mut cleared = false;
        let mut inner = pod.inner.lock();
        let PodInner { state, progress } = &mut *inner;
        progress.last_seq = Some(seq);
        progress.last_fingerprint = fingerprint;
        progress.batches += 1;
        progress.events += batch.events.len() as u64;
        progress.last_event = Some(Instant::now());
        progress.skipped.unknown_event_types += batch.skipped.unknown_event_types;
        progress.skipped.malformed_events += batch.skipped.malformed_events;
        progress.skipped.unknown_fields += batch.skipped.unknown_fields;
        for event in &batch.events {
            match event {
                KvEvent::Stored(ev) => {
                    pod.engine.store(ev.engine as u8, Ordering::Relaxed);
                    state.store(&pod.runs, ev, &pod.mode, &mut stats)
                }
                KvEvent::Removed(ev) => state.remove(&pod.runs, ev, &pod.mode, &mut stats),
                KvEvent::AllCleared => {
                    state.clear(&pod.runs, &mut stats);
                    cleared = true;
                }
            }
        }
        progress.applied.add(&stats);
        self.account(pod, state.cost(&pod.runs));
        let learned = state.block_size();
        pod.bigram.store(state.bigram(), Ordering::Relaxed);
        let offload = state.offload_block_size();
        drop(inner);
        if cleared {
            self.drop_speculation(pod);
        }
        if let Some(bs) = learned {
            if pod.block_size.swap(bs, Ordering::Relaxed) != bs {
                self.learn_block_size(&pod.model, bs);
            }
        }
        if let Some(size) = offload {
            if pod.offload_block_size.swap(size, Ordering::Relaxed) != size {
                self.learn_offload_block_size(&pod.model, size);
            }
        }
        stats
    }

    /// The publisher restarted (vLLM's cache starts empty): drops what the
    /// pod holds and counts the restart. A fresh cache is fully known again.
    pub fn restart_pod(&self, pod: &Pod) {
        self.clear_blocks(pod);
        let mut inner = self.lock(pod);
        inner.progress.publisher_restarts += 1;
        inner.progress.last_seq = None;
        inner.progress.last_fingerprint = None;
        pod.incomplete.store(false, Ordering::Relaxed);
    }

    /// Counts what the pod's stream reported.
    pub fn count_stream(&self, pod: &Pod, what: StreamCount) {
        let mut inner = self.lock(pod);
        match what {
            StreamCount::Gap => inner.progress.seq_gaps += 1,
            StreamCount::Duplicate => inner.progress.duplicate_batches += 1,
        }
    }

    /// Updates the entry counts after `pod` now holds `now` entries.
    pub(super) fn account(&self, pod: &Pod, now: u64) {
        let before = pod.entries.swap(now, Ordering::Relaxed);
        if now >= before {
            self.entries.fetch_add(now - before, Ordering::Relaxed);
        } else {
            self.entries.fetch_sub(before - now, Ordering::Relaxed);
        }
    }

    /// Over capacity: evicts down to 95% of it, always from the pod holding
    /// the most entries (so a pod's share shrinks only when it is the
    /// largest: fair), its least recently stored leaf blocks first (see
    /// `PodFeed::evict`). Evicting only ever shortens a pod's match
    /// from its end: answers stay conservative.
    ///
    /// Only pods for which `owns` is true are evicted here (the caller is
    /// their writer); when the largest pod is another writer's, it is
    /// returned, with the entries still to evict, for the caller to ask
    /// that writer (which calls this again). A single-threaded user passes
    /// `|_| true`.
    ///
    /// The service serves such requests before queued batches; should the
    /// owner still lag, a writer that finds the index 1% over capacity
    /// evicts from its own largest pod meanwhile, so the bound holds within
    /// that slack whatever the queues hold. (Evicting anything but the
    /// largest pod is a last resort: pods whose shares swing grow their
    /// own tables, which never shrink.)
    pub fn enforce_capacity(&self, owns: impl Fn(&Pod) -> bool) -> Option<(Arc<Pod>, usize)> {
        let cap = self.config.max_entries?;
        // The pods' fixed cost takes its share first (admission keeps it
        // at most half the budget).
        let cap = cap.saturating_sub(
            self.live_pods()
                .saturating_mul(self.config.pod_cost_entries),
        );
        let (target, slack) = (cap - cap / 20, cap + cap / 100);
        if self.entries.load(Ordering::Relaxed) as usize <= cap {
            return None;
        }
        let _guard = self.evicting.try_lock()?;
        let mut ask = None;
        loop {
            let entries = self.entries.load(Ordering::Relaxed) as usize;
            if entries <= target || (ask.is_some() && entries <= slack) {
                break;
            }
            let size = |p: &Pod| p.entries.load(Ordering::Relaxed);
            let (largest, largest_owned) = {
                let table = self.table.read();
                let live = || table.pods().filter(|p| !p.is_removed());
                (
                    live().max_by_key(|p| size(p)).cloned(),
                    live().filter(|p| owns(p)).max_by_key(|p| size(p)).cloned(),
                )
            };
            let Some(largest) = largest else { break };
            // Pods of about the same size are equally fair victims: taking
            // this writer's own keeps the shares level without asking (a
            // share that swings grows its pod's tables for good).
            let tied = largest_owned
                .as_ref()
                .filter(|own| size(own) * 100 >= size(&largest) * 99);
            let victim = if owns(&largest) {
                largest
            } else if let Some(own) = tied {
                own.clone()
            } else if entries <= slack {
                // Its owner evicts, as soon as it reads its control queue.
                ask = Some((largest, entries - target));
                break;
            } else {
                ask = Some((largest, entries - target));
                match largest_owned {
                    Some(own) => own,
                    None => break,
                }
            };
            // Chunks keep each pod lock short and the choice fair; on
            // another writer's behalf, at least 1% of capacity at a time
            // (an eviction pass costs more than its blocks: not per batch).
            let n = if ask.is_some() {
                entries - slack
            } else {
                entries - target
            };
            if self.evict(&victim, n.clamp(1, 4096)) == 0 {
                break;
            }
        }
        ask
    }

    /// Evicts up to `n` of `pod`'s (tier, block) entries (leaves first,
    /// least recently stored holdings first). Returns how many went.
    pub fn evict(&self, pod: &Pod, n: usize) -> usize {
        if pod.is_removed() {
            return 0;
        }
        let mut inner = self.lock(pod);
        let evicted = inner.state.evict(&pod.runs, n);
        let now = inner.state.cost(&pod.runs);
        drop(inner);
        self.drop_speculation(pod);
        self.account(pod, now);
        self.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
        evicted
    }

    /// Drops every block `pod` holds; returns how many it held (all tiers).
    pub(super) fn clear_blocks(&self, pod: &Pod) -> u64 {
        let mut inner = self.lock(pod);
        let held = inner.state.entries(&pod.runs);
        let mut stats = ApplyStats::default();
        inner.state.clear(&pod.runs, &mut stats);
        drop(inner);
        self.account(pod, 0);
        self.drop_speculation(pod);
        held
    }

    /// Drops everything `pod` holds and flags it incomplete: what is left
    /// of a pod after applying one of its batches failed part-way (its
    /// state may be half-updated; an empty pod is conservative, it only
    /// lowers its matches until its next stores).
    pub fn reset_pod(&self, pod: &Pod) {
        self.clear_blocks(pod);
        self.mark_incomplete(pod, 1);
    }

    /// Records `missing` batches lost beyond repair (0: continuity could
    /// not be checked).
    pub fn mark_incomplete(&self, pod: &Pod, missing: u64) {
        self.lock(pod).progress.unrecovered_batches += missing;
        pod.incomplete.store(true, Ordering::Relaxed);
    }
}

//! Live batches: which worker owns a topic, decoding, and applying a
//! batch to the index (with capacity eviction asked of the other writers).

use super::*;

impl Worker<'_> {
    pub(super) fn live(&mut self, frame: Frame) {
        let Some(batch) = self.numbered(&frame.topic, frame.seq, &frame.payload) else {
            return;
        };
        let key = (frame.topic.clone(), batch.batch.data_parallel_rank);
        if !self.streams.contains_key(&key) {
            if let Some(to) = self.owner_elsewhere(&frame.topic) {
                self.forward_live(to, frame);
                return;
            }
        }
        let now = Instant::now();
        let Some(stream) = self.stream_entry(&key, frame.replay, now) else {
            return;
        };
        stream.named |= frame.named;
        self.attach(&key, frame.conn, now);
        self.feed(&key, Input::Live(batch), now);
    }

    /// Claims the pod of a stream's `topic` before the stream is created
    /// (see `Owners`): `Err(owner)` if another worker owns it. Claimed and
    /// released by the same topic, so a pod's spellings cannot unbalance
    /// its count.
    pub(super) fn claim(&self, topic: &Bytes) -> Result<(), usize> {
        match parse_topic(topic) {
            Ok(t) => self.config.owners.claim(t.pod, t.model, self.index),
            // Not routable by pod, so not routed by it either.
            Err(_) => Ok(()),
        }
    }

    /// Gives back what `claim` took for a stream of `topic`.
    pub(super) fn release(&self, topic: &Bytes) {
        if let Ok(t) = parse_topic(topic) {
            self.config.owners.release(t.pod, t.model, self.index);
        }
    }

    /// The worker that owns the pod of `topic`, if not this one (work for
    /// it reached this worker just before the pod moved: see `Owners`).
    pub(super) fn owner_elsewhere(&self, topic: &Bytes) -> Option<usize> {
        let topic = parse_topic(topic).ok()?;
        self.config
            .owners
            .find(topic.pod, topic.model)
            .filter(|w| *w != self.index)
    }

    /// Hands a live batch to its pod's owner, as the receive loop would
    /// have: within that worker's queue bounds, never waiting on them.
    pub(super) fn forward_live(&self, to: usize, frame: Frame) {
        if !offer_live(&self.config.workers, &self.config.queue_budget, to, frame) {
            self.metrics.messages_dropped.inc();
        }
    }

    /// Whether this worker writes `pod`: it has a stream of it (see
    /// `Owners`). Its own map, no lock: eviction asks this while it holds
    /// the index's pod table.
    pub(super) fn owns(&self, pod: &Pod) -> bool {
        self.by_pod.contains_key(&pod.id.0)
    }

    pub(super) fn decode(&self, topic: &Bytes, seq: u64, payload: &[u8]) -> Option<EventBatch> {
        match decode_batch(payload) {
            Ok(batch) => Some(batch),
            Err(e) => {
                self.metrics.skip_message("decode");
                self.warn.warn(|suppressed| {
                    let topic = String::from_utf8_lossy(topic);
                    tracing::warn!(%topic, seq, error = %e, suppressed, "skipping undecodable event batch")
                });
                None
            }
        }
    }

    pub(super) fn numbered(
        &self,
        topic: &Bytes,
        seq: u64,
        payload: &[u8],
    ) -> Option<Numbered<EventBatch>> {
        let batch = self.decode(topic, seq, payload)?;
        Some(Numbered {
            seq,
            fingerprint: xxhash_rust::xxh3::xxh3_64(payload),
            batch,
        })
    }

    pub(super) fn apply(
        &mut self,
        key: &StreamKey,
        pod: &Arc<Pod>,
        seq: u64,
        fingerprint: Fingerprint,
        batch: &EventBatch,
    ) {
        // Supervised: a bug that panics on one batch costs that pod its
        // state (reset, flagged incomplete), never the worker and the
        // other pods it serves.
        let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            #[cfg(debug_assertions)]
            fault::inject(&pod.name);
            self.indexer
                .apply_fingerprinted(pod, seq, Some(fingerprint), batch)
        }));
        let stats = match applied {
            Ok(stats) => stats,
            Err(_) => {
                self.metrics.ingest_panics.inc();
                tracing::error!(pod = %pod.name, model = %pod.model, seq, "applying a batch panicked: the pod is reset and flagged incomplete");
                let reset = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.indexer.reset_pod(pod)
                }));
                if reset.is_err() {
                    tracing::error!(pod = %pod.name, "resetting the pod panicked too: removing it");
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.indexer.remove_pod(pod)
                    }));
                    self.remove_stream(key);
                }
                return;
            }
        };
        if self.tracker.watches(&pod.model, &pod.name) {
            self.routing_stores(pod, batch);
        }
        if stats.engine_hash_mismatches > 0 && self.mismatch_warned.insert(pod.name.clone()) {
            tracing::warn!(
                pod = %pod.name,
                model = %pod.model,
                "this pod's block hashes differ from ours: set --engine-hash-algo, --engine-hash-seed \
                 and --engine-extra-keys to the pods' --prefix-caching-hash-algo, PYTHONHASHSEED and vLLM \
                 release, or use --key-mode token; until then its blocks will not match"
            );
        }
        let m = self.metrics;
        let skipped = batch.skipped;
        m.batches_applied.inc();
        m.events_applied.inc_by(batch.events.len() as u64);
        m.blocks_stored.inc_by(stats.stored_blocks);
        m.blocks_removed.inc_by(stats.removed_blocks);
        m.engine_hash_mismatches
            .inc_by(stats.engine_hash_mismatches);
        for (reason, n) in [
            ("unknown_event_type", u64::from(skipped.unknown_event_types)),
            ("malformed_event", u64::from(skipped.malformed_events)),
            ("parent_unknown_block", stats.parent_unknown_blocks),
            ("unknown_removal", stats.unknown_removals),
            ("unkeyable_block", stats.unkeyable_blocks),
            ("non_full_attention", stats.non_full_attention_events),
            ("malformed_store", stats.malformed_stores),
        ] {
            m.skip_events(reason, n);
        }
        if skipped.unknown_event_types + skipped.malformed_events > 0 {
            self.warn.warn(|suppressed| {
                tracing::warn!(pod = %pod.name, ?skipped, suppressed, "skipped events in a batch")
            });
        }
    }

    /// Over capacity: evicts from this worker's pods, or asks the worker
    /// that owns the largest pod (one request in flight at a time).
    pub(super) fn enforce_capacity(&self) {
        let Some((victim, _)) = self.indexer.enforce_capacity(|p| self.owns(p)) else {
            return;
        };
        if self.config.evict_pending.swap(true, Ordering::Relaxed) {
            return;
        }
        let Some(to) = self.config.owners.find(&victim.topic_pod, &victim.model) else {
            // No worker writes it (its last stream ended as we looked):
            // none to ask; the next batch over capacity looks again.
            self.config.evict_pending.store(false, Ordering::Relaxed);
            return;
        };
        // Never wait on another worker's queue (two full queues waiting on
        // each other would freeze both): a full one is asked again at the
        // next batch applied.
        if self.config.control[to].try_send(Work::Evict).is_err() {
            self.config.evict_pending.store(false, Ordering::Relaxed);
        }
    }
}

//! Routing feedback in the pods' writer: a `RecordRouting` becomes
//! speculative entries and a tracked routing; a pod's stores confirm or end
//! the routings on it; expired ones are swept each tick.

use super::*;

impl Worker<'_> {
    /// A routing to one of this worker's pods: its blocks become
    /// speculative (or, for an approximate model, routing history).
    pub(super) fn record(&mut self, routing: Routing, approximate: bool) -> RecordReply {
        let feedback = &self.config.feedback;
        if approximate {
            feedback
                .approximate
                .record(&routing.model, &routing.pod, &routing.keys);
            self.metrics
                .approximate_entries
                .set(feedback.approximate.entries() as i64);
            return RecordReply {
                approximate: true,
                ..RecordReply::default()
            };
        }
        let now = Instant::now();
        let pod = self.indexer.find_pod(&routing.model, &routing.pod);
        let held = pod
            .as_ref()
            .map_or(0, |p| self.indexer.exact_run(p, &routing.keys, 0));
        let keys = routing.keys.clone();
        let (model, name) = (routing.model.clone(), routing.pod.clone());
        let (recorded, ended) = self.tracker.record(routing, held, now);
        feedback.ended(&ended);
        let confirmed = matches!(recorded.ended, Some(Outcome::Confirmed { .. }));
        let speculative = if confirmed {
            0
        } else {
            self.speculated.insert((model.clone(), name.clone()));
            self.indexer
                .speculate(&model, &name, &keys[held..], recorded.until, now)
        };
        if let Some(outcome) = recorded.ended {
            feedback.ended(&[Ended {
                model,
                pod: name,
                outcome,
            }]);
        }
        RecordReply {
            held: held as u32,
            speculative: speculative as u32,
            ttl: recorded.ttl,
            confirmed,
            approximate: false,
        }
    }

    /// A routing another replica accepted: the blocks of `keys` past what
    /// the pod holds exactly become speculative until `until`, as there.
    /// Not tracked here (its outcome is counted where it was recorded).
    pub(super) fn speculate_forwarded(
        &mut self,
        model: &str,
        pod: &str,
        keys: &[indexer::keys::BlockKey],
        until: Instant,
    ) {
        let now = Instant::now();
        if until <= now {
            return;
        }
        let Some(handle) = self.indexer.find_pod(model, pod) else {
            return;
        };
        let held = self.indexer.exact_run(&handle, keys, 0);
        self.speculated.insert((model.to_owned(), pod.to_owned()));
        self.indexer
            .speculate(model, pod, &keys[held..], until, now);
    }

    /// After a batch of `pod` with routings waiting: what its stores say
    /// about them (confirmed, or evidence of a mismatch).
    pub(super) fn routing_stores(&mut self, pod: &Pod, batch: &EventBatch) {
        let stores: Vec<&indexer::event::BlockStored> = batch
            .events
            .iter()
            .filter_map(|e| match e {
                indexer::event::KvEvent::Stored(s) if !s.block_hashes.is_empty() => Some(s),
                _ => None,
            })
            .collect();
        if stores.is_empty() {
            return;
        }
        let mut hashes = Vec::with_capacity(stores.len() * 2);
        for s in &stores {
            hashes.push(s.parent_block_hash.unwrap_or(indexer::event::EngineHash(0)));
            hashes.push(s.block_hashes[0]);
        }
        let keys = self.indexer.keys_of(pod, &hashes);
        let seen: Vec<SeenStore> = stores
            .iter()
            .zip(keys.chunks_exact(2))
            .filter(|(s, _)| !s.token_ids.is_empty())
            .map(|(s, k)| SeenStore {
                parent: match (s.parent_block_hash, k[0]) {
                    (None, _) => SeenParent::Root,
                    (Some(_), Some(key)) => SeenParent::Key(key),
                    (Some(_), None) => SeenParent::Unknown,
                },
                first_key: k[1],
                tokens: s.token_ids[..s.token_ids.len().min(SEEN_TOKENS)].to_vec(),
                block_size: s
                    .block_size
                    .unwrap_or((s.token_ids.len() / s.block_hashes.len()) as u32),
            })
            .collect();
        let stored = self.tracker.stored(
            &pod.model,
            &pod.name,
            &seen,
            |keys, from| self.indexer.exact_run(pod, keys, from),
            Instant::now(),
        );
        if !stored.superseded.is_empty() {
            self.indexer
                .speculative()
                .supersede(&pod.model, &pod.name, &stored.superseded);
        }
        self.config.feedback.ended(&stored.ended);
    }

    /// Frees expired speculative entries of this worker's pods.
    pub(super) fn sweep_speculation(&mut self, now: Instant) {
        let spec = self.indexer.speculative();
        self.speculated.retain(|(model, pod)| {
            spec.sweep(model, pod, now);
            spec.pod(model, pod).is_some()
        });
    }

    /// A pod is gone: its routings end as they stand.
    pub(super) fn forget_routings(&mut self, pod: &Pod) {
        let ended = self.tracker.forget_pod(&pod.model, &pod.name);
        self.config.feedback.ended(&ended);
        self.config
            .feedback
            .approximate
            .forget_pod(&pod.model, &pod.name);
    }
}

//! The streams a worker owns: each pod stream's state machine fed its
//! inputs, its actions executed, and the tables that find a stream by key,
//! connection, pod or topic kept in step.

use super::*;
use crate::first_catch_ups::Pending;

impl Worker<'_> {
    /// Records that `key` arrives on `conn`; a stream that moved to a new
    /// connection is up again.
    pub(super) fn attach(&mut self, key: &StreamKey, conn: ConnId, now: Instant) {
        let Some(stream) = self.streams.get_mut(key) else {
            return;
        };
        if stream.conn == Some(conn) && stream.machine.connected() {
            return;
        }
        stream.pod.set_connection(Connection::Connected);
        if let Some(old) = stream.conn.replace(conn).filter(|old| *old != conn) {
            self.detach(key, old);
        }
        self.by_conn.entry(conn).or_default().insert(key.clone());
        self.feed(key, Input::Connection { up: true }, now);
    }

    /// Takes `key` out of `conn`'s streams.
    pub(super) fn detach(&mut self, key: &StreamKey, conn: ConnId) {
        if let Some(keys) = self.by_conn.get_mut(&conn) {
            keys.remove(key);
            if keys.is_empty() {
                self.by_conn.remove(&conn);
            }
        }
    }

    /// Feeds one input to a stream and executes what it returns; returns
    /// the batches it applied.
    pub(super) fn feed(
        &mut self,
        key: &StreamKey,
        input: Input<EventBatch>,
        now: Instant,
    ) -> usize {
        let mut actions = std::mem::take(&mut self.actions);
        if let Some(stream) = self.streams.get_mut(key) {
            stream.machine.handle(input, now, &mut actions);
        }
        let applied = actions
            .iter()
            .filter(|a| matches!(a, Action::Apply { .. }))
            .count();
        for action in actions.drain(..) {
            self.execute(key, action);
        }
        self.actions = actions;
        if applied > 0 {
            self.enforce_capacity();
        }
        applied
    }

    pub(super) fn execute(&mut self, key: &StreamKey, action: Action<EventBatch>) {
        let Some(stream) = self.streams.get(key) else {
            return;
        };
        let pod = stream.pod.clone();
        match action {
            Action::Apply {
                seq,
                fingerprint,
                batch,
            } => self.apply(key, &pod, seq, fingerprint, &batch),
            Action::Restart => {
                tracing::info!(pod = %pod.name, model = %pod.model, "publisher restarted: its blocks are dropped");
                self.indexer.restart_pod(&pod);
            }
            Action::Lost { missing } => {
                // A gap left in the applied seqs (repaired ones leave none).
                self.indexer.count_stream(&pod, StreamCount::Gap);
                self.metrics.unrecoverable_gaps.inc();
                self.indexer.mark_incomplete(&pod, missing);
                self.lost_warn.warn(|suppressed| {
                    tracing::warn!(pod = %pod.name, missing, suppressed, "batches lost for good: this pod's answers may be incomplete")
                });
            }
            Action::Unverified => {
                self.indexer.mark_incomplete(&pod, 0);
                self.unverified_warn.warn(|suppressed| {
                    tracing::warn!(pod = %pod.name, suppressed, "the pod's replay buffer no longer holds our last batch: whether it restarted cannot be told; its answers may be wrong until it does")
                });
            }
            Action::Fetch {
                from,
                ticket,
                delay,
            } => match stream.replay.clone() {
                Some(endpoint) => {
                    self.metrics.replays_requested.inc();
                    self.fetch(key.clone(), endpoint, from, ticket, delay);
                }
                // Cannot happen (only replayable streams fetch); a reply
                // that never comes would leave the repair pending.
                None => {
                    self.feed(
                        key,
                        Input::Replayed {
                            ticket,
                            result: Err("no replay endpoint".into()),
                        },
                        Instant::now(),
                    );
                }
            },
            Action::Forget => {
                tracing::info!(pod = %pod.name, model = %pod.model, "pod expired: disconnected and silent for --pod-expiry; forgotten with its blocks");
                self.forget(key);
            }
            Action::Note(note) => self.note(&pod, note),
        }
    }

    pub(super) fn note(&self, pod: &Pod, note: Note) {
        match note {
            Note::Gap { from, to } => {
                tracing::debug!(pod = %pod.name, from, to, "seq gap");
            }
            Note::Duplicate => self.indexer.count_stream(pod, StreamCount::Duplicate),
            Note::BufferFull => {
                self.metrics.messages_dropped.inc();
            }
            Note::ReplayRetry { attempt } => self.replay_warn.warn(|suppressed| {
                tracing::warn!(pod = %pod.name, attempt, suppressed, "replay failed; retrying")
            }),
            Note::ReplayFailed => self.replay_warn.warn(|suppressed| {
                tracing::warn!(pod = %pod.name, suppressed, "replay failed for good")
            }),
            Note::Replayed { batches } => {
                self.metrics.replay_batches.inc_by(batches);
            }
            Note::NextRound { from, round } => {
                tracing::info!(pod = %pod.name, from, round, "replay reply ended before the gap: asking again")
            }
        }
    }

    pub(super) fn insert_stream(&mut self, key: StreamKey, stream: Stream) {
        self.by_pod
            .entry(stream.pod.id.0)
            .or_default()
            .push(key.clone());
        self.by_topic.entry(key.0.clone()).or_default().push(key.1);
        self.streams.insert(key, stream);
    }

    pub(super) fn remove_stream(&mut self, key: &StreamKey) -> Option<Stream> {
        let stream = self.streams.remove(key)?;
        self.release(&key.0);
        if let Some(conn) = stream.conn {
            self.detach(key, conn);
        }
        if let Some(keys) = self.by_pod.get_mut(&stream.pod.id.0) {
            keys.retain(|k| k != key);
            if keys.is_empty() {
                self.by_pod.remove(&stream.pod.id.0);
            }
        }
        if let Some(ranks) = self.by_topic.get_mut(&key.0) {
            ranks.retain(|r| *r != key.1);
            if ranks.is_empty() {
                self.by_topic.remove(&key.0);
            }
        }
        Some(stream)
    }

    /// The stream for `key`, created for a new pod. `None` when a bound
    /// refuses the pod.
    pub(super) fn stream_entry(
        &mut self,
        key: &StreamKey,
        replay: Option<Arc<str>>,
        now: Instant,
    ) -> Option<&mut Stream> {
        if !self.streams.contains_key(key) {
            if self.claim(&key.0).is_err() {
                // Given to another worker since the caller looked (a race
                // of microseconds): this work is skipped, as a dropped
                // message is, and repaired by replay where it can be.
                self.metrics.messages_dropped.inc();
                return None;
            }
            let Some(stream) = self.stream_for(&key.0, replay.clone(), key.1, now) else {
                self.release(&key.0);
                return None;
            };
            self.insert_stream(key.clone(), stream);
        }
        let stream = self.streams.get_mut(key)?;
        // A dialed pod's socket knows its replay endpoint.
        if stream.replay.is_none() && replay.is_some() {
            stream.replay = replay;
            stream.machine.set_replayable(true);
        }
        Some(stream)
    }

    /// A stream for a new pod, or `None` (counted, logged at most once per
    /// interval) when a bound refuses the pod: its batches are skipped and
    /// nothing is kept for it.
    pub(super) fn stream_for(
        &self,
        raw_topic: &Bytes,
        replay: Option<Arc<str>>,
        rank: Option<u32>,
        now: Instant,
    ) -> Option<Stream> {
        // Checked by the receive loop.
        let topic = parse_topic(raw_topic).ok()?;
        let pod = match self.indexer.try_pod(topic.model, topic.pod, rank) {
            Ok(pod) => pod,
            Err(refused) => {
                self.metrics.refuse(refused.what());
                self.refused_warn.warn(|suppressed| {
                    tracing::warn!(pod = %topic.pod, model = %topic.model, reason = %refused, suppressed, "new pod refused; its events are skipped")
                });
                return None;
            }
        };
        let replay = replay.or_else(|| {
            self.config
                .replay_endpoints
                .get(topic.pod)
                .map(|e| Arc::from(e.as_str()))
        });
        if self
            .config
            .feedback
            .approximate
            .switch_to_precise(&pod.model)
        {
            tracing::info!(model = %pod.model, pod = %pod.name, "an --approximate-model's pod publishes KV events: the model is served from the exact index from now on");
        }
        // A pod restored from a snapshot continues after its last seq, if
        // its buffer shows that batch is still its own.
        let machine = self.restored_machine(&pod, replay.is_some(), now);
        let upto = machine.last_seq();
        self.new_pod_log.warn(|suppressed| {
            tracing::info!(pod = %pod.name, model = %pod.model, replay = ?replay, ?upto, suppressed, "new pod")
        });
        Some(Stream {
            machine,
            pod,
            replay,
            conn: None,
            named: false,
        })
    }

    /// `pod`'s stream state machine, continuing after the last seq the
    /// index has for it (a snapshot's; none for a new pod) and remembering
    /// that batch's fingerprint, when the snapshot has it, as applied.
    pub(super) fn restored_machine(
        &self,
        pod: &Pod,
        replayable: bool,
        now: Instant,
    ) -> StreamMachine<EventBatch> {
        let (upto, last) = self.indexer.last_batch(pod);
        let machine = StreamMachine::new(self.config.stream_limits, replayable, upto, now);
        match last {
            Some(fingerprint) => machine.restored_batch(fingerprint),
            None => machine,
        }
    }

    /// A pod restored from a snapshot, not heard from yet: disconnected
    /// until it publishes.
    pub(super) fn adopt(&mut self, pod: Arc<Pod>, first: Option<Arc<Pending>>) {
        let topic = Bytes::from(format!("kv@{}@{}", pod.topic_pod, pod.model));
        let key = (topic, pod.dp_rank);
        if self.streams.contains_key(&key) {
            return;
        }
        if let Err(to) = self.claim(&key.0) {
            // Never wait on another worker's queue (see `enforce_capacity`).
            let _ = self.config.control[to].try_send(Work::Adopt(pod, first));
            return;
        }
        let now = Instant::now();
        let replay = self
            .config
            .replay_endpoints
            .get(&pod.topic_pod)
            .map(|e| Arc::from(e.as_str()));
        let mut machine = self.restored_machine(&pod, replay.is_some(), now);
        machine.handle(Input::Connection { up: false }, now, &mut Vec::new());
        pod.set_connection(Connection::Disconnected);
        // Readiness waits for what its buffer holds (it may not publish
        // for a while); without a replay endpoint there is nothing to
        // catch up from, and nothing to wait for.
        if let (Some(first), Some(endpoint)) = (first, replay.clone()) {
            self.fetch_restored(key.clone(), endpoint, first);
        }
        self.insert_stream(
            key,
            Stream {
                pod,
                replay,
                machine,
                conn: None,
                named: false,
            },
        );
    }

    /// Drops a stream and, unless another stream of this worker feeds the
    /// same pod, the pod.
    pub(super) fn forget(&mut self, key: &StreamKey) {
        let Some(stream) = self.remove_stream(key) else {
            return;
        };
        if !self.by_pod.contains_key(&stream.pod.id.0) {
            self.indexer.remove_pod(&stream.pod);
            self.forget_routings(&stream.pod);
        }
    }

    /// Forgets every DP rank of `pod`; returns (domains, blocks they held).
    pub(super) fn remove(&mut self, model: &str, pod: &str, why: &str) -> (usize, u64) {
        let domains = self.indexer.pod_domains(model, pod);
        let mut blocks = 0;
        for domain in &domains {
            for key in self.by_pod.get(&domain.id.0).cloned().unwrap_or_default() {
                self.remove_stream(&key);
            }
            blocks += self.indexer.remove_pod(domain).unwrap_or(0);
            self.forget_routings(domain);
        }
        tracing::info!(%model, %pod, domains = domains.len(), blocks, why, "pod removed");
        (domains.len(), blocks)
    }
}

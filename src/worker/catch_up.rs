//! Repairing gaps: a stream's `Fetch` action asks the pod's replay socket
//! (off the worker's thread), the reply comes back as a catch-up, and
//! batches a full queue refused are fetched once the queue is empty.

use super::*;
use crate::first_catch_ups::Pending;

impl Worker<'_> {
    /// Fetches what this worker's full queue refused (see
    /// `DroppedBatches`); called with the queue empty.
    pub(super) fn fetch_dropped(&mut self) {
        let dropped = self.config.queue_budget.take_dropped(self.index);
        for ((topic, conn), seq) in dropped {
            self.dropped(&topic, seq, conn);
        }
    }

    /// A live batch of `topic` was dropped on its way here: the topic's
    /// stream on that connection is told. The notice names no DP rank (that
    /// is in the payload, not decoded when dropping): where several ranks'
    /// streams share the topic and the connection (bind mode), which one
    /// lost the batch is unknown, and none is told (the gap shows on that
    /// rank's next batch, as before). Telling all of them would send ranks
    /// that lost nothing to fetch with another rank's seq.
    pub(super) fn dropped(&mut self, topic: &Bytes, seq: u64, conn: ConnId) {
        let Some(ranks) = self.by_topic.get(topic) else {
            // No stream yet: its first batch (or a dialed pod's catch-up)
            // starts from the pod's buffer anyway.
            return;
        };
        let keys: Vec<StreamKey> = ranks
            .iter()
            .map(|rank| (topic.clone(), *rank))
            .filter(|key| {
                self.streams
                    .get(key)
                    .is_some_and(|s| s.conn.is_none_or(|c| c == conn))
            })
            .collect();
        if let [key] = keys.as_slice() {
            self.feed(key, Input::Dropped { seq }, Instant::now());
        }
    }

    pub(super) fn fetch(
        &self,
        stream: StreamKey,
        endpoint: Arc<str>,
        from: u64,
        ticket: u32,
        delay: Duration,
    ) {
        self.spawn_fetch(endpoint, from, delay, move |result| Work::Replayed {
            stream,
            ticket,
            result,
        });
    }

    /// Fetches `endpoint`'s buffer from `from` on, after `delay`, within
    /// the replays in flight, off this thread; its result comes back to
    /// this worker as `work(result)`.
    fn spawn_fetch(
        &self,
        endpoint: Arc<str>,
        from: u64,
        delay: Duration,
        work: impl FnOnce(Result<Vec<Replayed>, String>) -> Work + Send + 'static,
    ) {
        let tx = self.config.control[self.index].clone();
        let timeout = self.config.replay_timeout;
        let (context, limits) = (self.config.context.clone(), self.config.limits);
        let slots = self.config.replay_slots.clone();
        self.runtime.spawn(async move {
            tokio::time::sleep(delay).await;
            let Ok(_slot) = slots.acquire_owned().await else {
                return;
            };
            // libzmq blocks: the fetch takes a blocking-pool thread for at
            // most `timeout`.
            let result = tokio::task::spawn_blocking(move || {
                replay::fetch(&context, &endpoint, from, timeout, limits)
            })
            .await
            .unwrap_or_else(|e| Err(format!("replay task failed: {e}")));
            // Waits for room in the queue (this is no receive loop): a
            // replay result is never dropped.
            let _ = tx.send_async(work(result)).await;
        });
    }

    /// A connection's catch-up: the pod's buffered batches for `topic`, by
    /// DP rank; streams of the topic the buffer has nothing for get an
    /// empty one (which still tells whether the pod restarted).
    /// `first` is dropped once it is applied (see `first_catch_ups`).
    pub(super) fn catch_up(
        &mut self,
        topic: &Bytes,
        replay: &Arc<str>,
        items: Vec<Replayed>,
        conn: ConnId,
        first: Option<Arc<crate::first_catch_ups::Pending>>,
    ) {
        if !self.streams.keys().any(|k| k.0 == topic) {
            if let Some(to) = self.owner_elsewhere(topic) {
                let work = Work::CatchUp {
                    topic: topic.clone(),
                    replay: replay.clone(),
                    items,
                    conn,
                    first,
                };
                // Never wait on another worker's queue; the control queue,
                // served first, has room unless that worker is stuck.
                if self.config.control[to].try_send(work).is_err() {
                    self.metrics.messages_dropped.inc();
                }
                return;
            }
        }
        let mut by_rank: HashMap<Option<u32>, Vec<Numbered<EventBatch>>> = HashMap::new();
        for item in items {
            if item.topic.as_ref().is_some_and(|t| t != topic) {
                continue;
            }
            if let Some(b) = self.numbered(topic, item.seq, &item.payload) {
                by_rank
                    .entry(b.batch.data_parallel_rank)
                    .or_default()
                    .push(b);
            }
        }
        for key in self.streams.keys().filter(|k| k.0 == topic) {
            by_rank.entry(key.1).or_default();
        }
        let now = Instant::now();
        for (rank, batches) in by_rank {
            let key = (topic.clone(), rank);
            if batches.is_empty() && !self.streams.contains_key(&key) {
                continue;
            }
            if self.stream_entry(&key, Some(replay.clone()), now).is_none() {
                continue;
            }
            // A pod that only ever catches up (idle since) still leaves
            // with its socket.
            self.attach(&key, conn, now);
            let applied = self.feed(&key, Input::CatchUp(batches), now);
            if let Some(stream) = self.streams.get(&key) {
                tracing::info!(pod = %stream.pod.name, applied, "caught up from the replay buffer");
            }
        }
    }

    /// Fetches a restored pod's whole replay buffer (see
    /// `Work::RestoredCatchUp`).
    pub(super) fn fetch_restored(
        &self,
        stream: StreamKey,
        endpoint: Arc<str>,
        first: Arc<Pending>,
    ) {
        self.spawn_fetch(endpoint, 0, Duration::ZERO, move |result| {
            Work::RestoredCatchUp {
                stream,
                result,
                first,
            }
        });
    }

    /// A restored pod's buffer, fetched at adoption, fed as a catch-up
    /// (its connection unknown: it is not attached to one). A failed
    /// fetch leaves the stream to repair on its next batch.
    pub(super) fn restored_caught_up(
        &mut self,
        key: StreamKey,
        result: Result<Vec<Replayed>, String>,
        first: Arc<Pending>,
    ) {
        let items = match result {
            Ok(items) => items,
            Err(e) => {
                tracing::warn!(error = %e, "a restored pod's catch-up replay failed; relying on gap repair");
                return;
            }
        };
        if !self.streams.contains_key(&key) {
            return;
        }
        let batches = self.stream_batches(&key, items);
        let applied = self.feed(&key, Input::CatchUp(batches), Instant::now());
        if let Some(stream) = self.streams.get(&key) {
            tracing::info!(pod = %stream.pod.name, applied, "restored pod caught up from its replay buffer");
        }
        drop(first);
    }

    /// The batches of a replay reply that are stream `key`'s: its topic
    /// (any, for a pod its dial target names) and its DP rank, decoded.
    fn stream_batches(&self, key: &StreamKey, items: Vec<Replayed>) -> Vec<Numbered<EventBatch>> {
        let named = self.streams.get(key).is_some_and(|s| s.named);
        items
            .into_iter()
            .filter(|item| named || item.topic.as_ref().is_none_or(|t| *t == key.0))
            .filter_map(|item| self.numbered(&key.0, item.seq, &item.payload))
            .filter(|b| b.batch.data_parallel_rank == key.1)
            .collect()
    }

    pub(super) fn replayed(
        &mut self,
        key: StreamKey,
        ticket: u32,
        result: Result<Vec<Replayed>, String>,
    ) {
        if !self.streams.contains_key(&key) {
            return;
        }
        let result = result.map(|items| self.stream_batches(&key, items));
        if let Err(e) = &result {
            if let Some(stream) = self.streams.get(&key) {
                tracing::debug!(pod = %stream.pod.name, error = %e, "replay fetch failed");
            }
        }
        self.feed(&key, Input::Replayed { ticket, result }, Instant::now());
    }
}

//! An ingest worker: decodes the batches of the pods hashed to it and
//! applies them in seq order, repairing gaps through the pods' replay
//! sockets.
//!
//! Per stream (topic and DP rank) the worker knows the next seq it expects.
//! A batch further ahead (a gap: ZeroMQ PUB drops on overflow), or a first
//! batch with seq > 0 (the indexer started after the pod), starts a repair
//! when the pod's replay endpoint is known: live batches are buffered, the
//! missing range is fetched (bounded retries with backoff), replayed and
//! buffered batches are merged by seq and applied once each, in order. What
//! the pod's buffer no longer has is counted and the pod marked incomplete.
//! Without a replay endpoint, batches are applied as they come and gaps are
//! counted.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use indexer::event::EventBatch;
use indexer::topic::parse_topic;
use indexer::wire::decode_batch;
use indexer::{Indexer, Pod};

use crate::metrics::Metrics;
use crate::ratelimit::RateLimited;
use crate::replay::{self, Replayed};

/// A message that passed the shape checks, on its way to a worker.
pub struct Frame {
    pub topic: Bytes,
    pub seq: u64,
    pub payload: Bytes,
    /// The replay endpoint of the socket it came from (dial mode).
    pub replay: Option<Arc<str>>,
}

pub enum Work {
    Live(Frame),
    /// A dialed pod's replay buffer, fetched when the connection came up:
    /// catch-up before (or without) any live batch.
    CatchUp {
        topic: Bytes,
        replay: Arc<str>,
        items: Vec<Replayed>,
    },
    Replayed {
        stream: StreamKey,
        attempt: u32,
        result: Result<Vec<Replayed>, String>,
    },
}

/// A pod's topic and DP rank: one seq space.
pub type StreamKey = (Bytes, Option<u32>);

/// Live batches held per stream while its gap is repaired: vLLM's replay
/// buffer holds 10,000 batches by default, so more could not be replayed
/// either.
const MAX_BUFFERED: usize = 10_000;

/// Replay fetches per repair before giving up on the missing range.
const MAX_ATTEMPTS: u32 = 4;
/// Replay rounds per repair (each covers up to what the pod had published
/// when it answered) before missing seqs are taken as lost.
const MAX_ROUNDS: u32 = 8;

pub struct WorkerConfig {
    /// Replay endpoints for pods that connect to us (bind mode), by pod name.
    pub replay_endpoints: HashMap<String, String>,
    pub replay_timeout: Duration,
    /// For replay sockets: the process's libzmq context and frame limits.
    pub context: zmq::Context,
    pub limits: crate::zmq_io::ReceiveLimits,
    /// Replay fetches in flight at once, process-wide.
    pub replay_slots: Arc<tokio::sync::Semaphore>,
}

struct Stream {
    pod: Arc<Pod>,
    replay: Option<Arc<str>>,
    /// The next seq expected; `None` before the first batch.
    next: Option<u64>,
    repair: Option<Repair>,
    /// Replay applied batches up to here that may still arrive live: live
    /// copies at or below it are duplicates, not a publisher restart.
    stale_upto: Option<u64>,
}

struct Repair {
    from: u64,
    attempt: u32,
    /// Replay rounds so far: a reply only covers what the pod had published
    /// when it answered, so live batches past it may need another round.
    round: u32,
    /// Live batches that arrived meanwhile.
    buffered: BTreeMap<u64, EventBatch>,
}

pub struct Worker<'a> {
    indexer: &'a Indexer,
    metrics: &'a Metrics,
    config: &'a WorkerConfig,
    runtime: tokio::runtime::Handle,
    /// To send replay results back to this worker.
    tx: flume::Sender<Work>,
    streams: HashMap<StreamKey, Stream>,
    warn: RateLimited,
    refused_warn: RateLimited,
    /// A fleet's first minute logs every pod; a flood of names must not.
    new_pod_log: RateLimited,
    mismatch_warned: HashSet<u32>,
}

impl<'a> Worker<'a> {
    pub fn new(
        indexer: &'a Indexer,
        metrics: &'a Metrics,
        config: &'a WorkerConfig,
        runtime: tokio::runtime::Handle,
        tx: flume::Sender<Work>,
    ) -> Self {
        Worker {
            indexer,
            metrics,
            config,
            runtime,
            tx,
            streams: HashMap::new(),
            warn: RateLimited::new(Duration::from_secs(10)),
            refused_warn: RateLimited::new(Duration::from_secs(10)),
            new_pod_log: RateLimited::new(Duration::from_millis(100)),
            mismatch_warned: HashSet::new(),
        }
    }

    /// Runs until `stop` is set and the queue is drained. (`self.tx` keeps
    /// the channel open for replay results, so closing alone cannot end it.)
    /// `dead` is set if the thread ends any other way (a panic outside the
    /// supervised apply): readiness and gRPC health then report it.
    pub fn run(mut self, rx: flume::Receiver<Work>, stop: &AtomicBool, dead: &AtomicBool) {
        struct Watch<'a>(&'a AtomicBool, &'a AtomicBool);
        impl Drop for Watch<'_> {
            fn drop(&mut self) {
                if !self.0.load(Ordering::Relaxed) {
                    self.1.store(true, Ordering::Relaxed);
                }
            }
        }
        let _watch = Watch(stop, dead);
        self.serve(&rx, stop);
    }

    fn serve(&mut self, rx: &flume::Receiver<Work>, stop: &AtomicBool) {
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Work::Live(frame)) => self.live(frame),
                Ok(Work::CatchUp {
                    topic,
                    replay,
                    items,
                }) => self.catch_up(topic, replay, items),
                Ok(Work::Replayed {
                    stream,
                    attempt,
                    result,
                }) => self.replayed(stream, attempt, result),
                Err(flume::RecvTimeoutError::Disconnected) => return,
                Err(flume::RecvTimeoutError::Timeout) => {}
            }
            if stop.load(Ordering::Relaxed) && rx.is_empty() {
                return;
            }
        }
    }

    fn decode(&self, topic: &Bytes, seq: u64, payload: &[u8]) -> Option<EventBatch> {
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

    fn live(&mut self, frame: Frame) {
        let Some(batch) = self.decode(&frame.topic, frame.seq, &frame.payload) else {
            return;
        };
        let key = (frame.topic.clone(), batch.data_parallel_rank);
        let seq = frame.seq;
        let Some(stream) = self.stream_entry(&key, frame.replay) else {
            return;
        };
        if let Some(repair) = &mut stream.repair {
            // A replay endpoint that stalls must not make us hold its live
            // batches without limit: past vLLM's own replay buffer size,
            // later ones are dropped (the next repair round asks for them).
            if repair.buffered.len() >= MAX_BUFFERED {
                self.metrics.messages_dropped.inc();
                return;
            }
            repair.buffered.insert(seq, batch);
            return;
        }
        match stream.stale_upto {
            Some(upto) if seq <= upto => return, // already applied from replay
            Some(_) => stream.stale_upto = None,
            None => {}
        }
        let gap_from = match stream.next {
            None if seq > 0 => Some(0),
            Some(next) if seq > next => Some(next),
            _ => None,
        };
        match (gap_from, stream.replay.clone()) {
            (Some(from), Some(endpoint)) => {
                let mut buffered = BTreeMap::new();
                buffered.insert(seq, batch);
                stream.repair = Some(Repair {
                    from,
                    attempt: 1,
                    round: 1,
                    buffered,
                });
                tracing::info!(pod = %stream.pod.name, from, to = seq, %endpoint, "seq gap: requesting replay");
                self.metrics.replays_requested.inc();
                self.fetch(key, endpoint, from, 1, Duration::ZERO);
            }
            _ => self.apply(&key, seq, &batch),
        }
    }

    /// The stream for `key`, created for a new pod; a pod removed (by an
    /// admin, or expired) meanwhile starts over as a new pod. `None` when
    /// a bound refuses the pod.
    fn stream_entry(&mut self, key: &StreamKey, replay: Option<Arc<str>>) -> Option<&mut Stream> {
        if self.streams.get(key).is_some_and(|s| s.pod.is_removed()) {
            self.streams.remove(key);
        }
        if !self.streams.contains_key(key) {
            let stream = self.stream_for(&key.0, replay, key.1)?;
            self.streams.insert(key.clone(), stream);
        }
        self.streams.get_mut(key)
    }

    /// A stream for a new pod, or `None` (counted, logged at most once per
    /// interval) when a bound refuses the pod: its batches are skipped and
    /// nothing is kept for it.
    fn stream_for(
        &self,
        raw_topic: &Bytes,
        replay: Option<Arc<str>>,
        rank: Option<u32>,
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
        // A pod restored from a snapshot continues after its last seq.
        let next = self.indexer.last_seq(&pod).map(|s| s.wrapping_add(1));
        self.new_pod_log.warn(|suppressed| {
            tracing::info!(pod = %pod.name, model = %pod.model, replay = ?replay, ?next, suppressed, "new pod")
        });
        Some(Stream {
            pod,
            replay,
            next,
            repair: None,
            stale_upto: None,
        })
    }

    fn fetch(
        &self,
        stream: StreamKey,
        endpoint: Arc<str>,
        from: u64,
        attempt: u32,
        delay: Duration,
    ) {
        let tx = self.tx.clone();
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
            let _ = tx
                .send_async(Work::Replayed {
                    stream,
                    attempt,
                    result,
                })
                .await;
        });
    }

    /// A connection's catch-up: the pod's buffered batches for `topic`,
    /// applied from where each stream stands (seq 0, or after its snapshot
    /// seq). A stream under repair takes them as extra buffered batches.
    fn catch_up(&mut self, topic: Bytes, replay: Arc<str>, items: Vec<Replayed>) {
        let mut by_stream: BTreeMap<Option<u32>, BTreeMap<u64, EventBatch>> = BTreeMap::new();
        for item in items {
            if item.topic.as_ref().is_some_and(|t| *t != topic) {
                continue;
            }
            if let Some(batch) = self.decode(&topic, item.seq, &item.payload) {
                by_stream
                    .entry(batch.data_parallel_rank)
                    .or_default()
                    .insert(item.seq, batch);
            }
        }
        for (rank, batches) in by_stream {
            let key = (topic.clone(), rank);
            let Some(stream) = self.stream_entry(&key, Some(replay.clone())) else {
                continue;
            };
            if let Some(repair) = &mut stream.repair {
                for (seq, batch) in batches {
                    repair.buffered.entry(seq).or_insert(batch);
                }
                continue;
            }
            let mut from = stream.next.unwrap_or(0);
            // Every buffered seq below what we already applied: the pod
            // restarted (a reconnect often means that) and its new run
            // starts again at 0. Apply it from its start; the index sees
            // the seq go back and drops the old run's blocks first.
            if batches
                .keys()
                .next_back()
                .is_some_and(|&newest| newest.saturating_add(1) < from)
            {
                tracing::info!(pod = %stream.pod.name, from, "replay buffer is behind what was applied: the pod restarted");
                from = batches.keys().next().copied().unwrap_or(0);
            }
            let applied = batches.range(from..).count() as u64;
            let (missing, last) = self.apply_from(&key, from, batches.into_iter());
            self.metrics.replay_batches.inc_by(applied);
            if let Some(stream) = self.streams.get_mut(&key) {
                stream.stale_upto = last;
                tracing::info!(pod = %stream.pod.name, from, applied, missing, "caught up from the replay buffer");
            }
        }
    }

    fn replayed(&mut self, key: StreamKey, attempt: u32, result: Result<Vec<Replayed>, String>) {
        let Some(stream) = self.streams.get_mut(&key) else {
            return;
        };
        let Some(repair) = stream.repair.as_mut().filter(|r| r.attempt == attempt) else {
            return;
        };
        let items = match result {
            Ok(items) => items,
            Err(e) if attempt < MAX_ATTEMPTS => {
                let delay = Duration::from_millis(200) * 2u32.pow(attempt - 1);
                tracing::warn!(pod = %stream.pod.name, attempt, error = %e, retry_in = ?delay, "replay failed; retrying");
                repair.attempt += 1;
                let (endpoint, from) = (stream.replay.clone(), repair.from);
                if let Some(endpoint) = endpoint {
                    self.fetch(key, endpoint, from, attempt + 1, delay);
                }
                return;
            }
            Err(e) => {
                tracing::warn!(pod = %stream.pod.name, error = %e, "replay failed for good");
                Vec::new()
            }
        };
        let Some(repair) = stream.repair.take() else {
            return;
        };
        // Replayed batches past the newest buffered live one are still on
        // their way live; applying them now would make their live copies
        // look like a publisher restart.
        let upto = repair
            .buffered
            .keys()
            .next_back()
            .copied()
            .unwrap_or(repair.from);
        let mut merged: BTreeMap<u64, EventBatch> = BTreeMap::new();
        // The newest seq the pod had when it answered: gaps up to it are
        // really gone from its buffer; gaps past it were just not published
        // yet at that moment.
        let mut covered = None;
        for item in items {
            if item.topic.as_ref().is_some_and(|t| *t != key.0) {
                continue;
            }
            covered = covered.max(Some(item.seq));
            if item.seq < repair.from || item.seq > upto {
                continue;
            }
            if let Some(batch) = self.decode(&key.0, item.seq, &item.payload) {
                if batch.data_parallel_rank == key.1 {
                    merged.insert(item.seq, batch);
                }
            }
        }
        let recovered = merged.len() as u64;
        for (seq, batch) in repair.buffered {
            merged.entry(seq).or_insert(batch);
        }
        self.metrics.replay_batches.inc_by(recovered);
        // Apply up to the first gap past the reply's coverage; from there,
        // ask again (a bounded number of rounds).
        let covered = covered.unwrap_or(repair.from.saturating_sub(1));
        let mut expected = repair.from;
        let split = merged
            .keys()
            .find(|&&seq| {
                let uncovered_gap = seq > expected && expected > covered;
                expected = seq + 1;
                uncovered_gap
            })
            .copied();
        let (now, later) = match split {
            Some(at) if repair.round < MAX_ROUNDS => {
                let later = merged.split_off(&at);
                (merged, Some(later))
            }
            _ => (merged, None),
        };
        let (missing, last) = self.apply_from(&key, repair.from, now.into_iter());
        match later {
            Some(buffered) => {
                let from = last.map_or(repair.from, |l| l + 1);
                let Some(stream) = self.streams.get_mut(&key) else {
                    return;
                };
                stream.repair = Some(Repair {
                    from,
                    attempt: 1,
                    round: repair.round + 1,
                    buffered,
                });
                tracing::info!(pod = %stream.pod.name, from, round = repair.round + 1, "replay reply ended before the gap: asking again");
                self.metrics.replays_requested.inc();
                if let Some(endpoint) = stream.replay.clone() {
                    self.fetch(key, endpoint, from, 1, Duration::ZERO);
                }
            }
            None => {
                if let (Some(stream), 0) = (self.streams.get(&key), missing) {
                    tracing::info!(pod = %stream.pod.name, recovered, "seq gap repaired");
                }
            }
        }
    }

    /// Applies `batches` (sorted by seq) from seq `from` on, in order. Seqs
    /// missing from that range are lost for good: counted, and the pod is
    /// flagged incomplete. Returns (missing, last seq applied).
    fn apply_from(
        &mut self,
        key: &StreamKey,
        from: u64,
        batches: impl Iterator<Item = (u64, EventBatch)>,
    ) -> (u64, Option<u64>) {
        let mut expected = from;
        let (mut missing, mut last) = (0, None);
        for (seq, batch) in batches.filter(|(seq, _)| *seq >= from) {
            missing += seq - expected;
            self.apply(key, seq, &batch);
            expected = seq + 1;
            last = Some(seq);
        }
        if missing > 0 {
            if let Some(stream) = self.streams.get(key) {
                self.metrics.unrecoverable_gaps.inc();
                self.indexer.mark_incomplete(&stream.pod, missing);
                tracing::warn!(pod = %stream.pod.name, missing, "batches lost for good: this pod's answers may be incomplete");
            }
        }
        (missing, last)
    }

    fn apply(&mut self, key: &StreamKey, seq: u64, batch: &EventBatch) {
        let Some(stream) = self.streams.get_mut(key) else {
            return;
        };
        stream.next = Some(seq.wrapping_add(1));
        let pod = stream.pod.clone();
        // Supervised: a bug that panics on one batch costs that pod its
        // state (reset, flagged incomplete), never the worker and the
        // other pods it serves.
        let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.indexer.apply(&pod, seq, batch)
        }));
        let stats = match applied {
            Ok(stats) => stats,
            Err(_) => {
                self.metrics.ingest_panics.inc();
                tracing::error!(pod = %pod.name, model = %pod.model, seq, "applying a batch panicked: the pod is reset and flagged incomplete");
                let reset = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.indexer.reset_pod(&pod)
                }));
                if reset.is_err() {
                    tracing::error!(pod = %pod.name, "resetting the pod panicked too: removing it");
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.indexer.remove_pod(&pod.model, &pod.name)
                    }));
                    self.streams.remove(key);
                }
                return;
            }
        };
        if stats.engine_hash_mismatches > 0 && self.mismatch_warned.insert(pod.id.0) {
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
}

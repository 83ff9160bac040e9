//! An ingest worker: the single writer of the pods hashed to it.
//!
//! Everything that changes one of its pods reaches it as a [`Work`] message
//! on its queue: live batches, catch-ups and replay replies, connections
//! going up or down, `RemovePod`, capacity eviction asked by another worker,
//! pods restored from a snapshot to look after. Per stream (topic and DP
//! rank) it keeps an [`indexer::stream::Stream`], the pure state machine
//! that holds every seq and lifecycle rule; the worker feeds it and executes
//! the actions it returns (apply, restart, fetch a replay, flag incomplete,
//! forget the pod). No other thread writes these pods.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use indexer::event::EventBatch;
use indexer::index::KeyBuildHasher;
use indexer::routing::diagnose::{SeenParent, SeenStore, SEEN_TOKENS};
use indexer::routing::tracker::{Ended, Outcome, Routing, Tracker};
use indexer::stream::{
    Action, Fingerprint, Input, Note, Numbered, Stream as StreamMachine, StreamLimits,
};
use indexer::topic::parse_topic;
use indexer::wire::decode_batch;
use indexer::{Connection, Indexer, Pod, StreamCount};

use crate::feedback::Feedback;
use crate::metrics::Metrics;
use crate::owners::Owners;
use crate::ratelimit::RateLimited;
use crate::replay::{self, Replayed};

/// One connection (a dialed socket, or a pod's connection to the bind
/// socket); never reused within a process.
pub type ConnId = u64;

/// A message that passed the shape checks, on its way to a worker.
pub struct Frame {
    pub topic: Bytes,
    pub seq: u64,
    pub payload: Bytes,
    /// The replay endpoint of the socket it came from (dial mode).
    pub replay: Option<Arc<str>>,
    pub conn: ConnId,
}

pub enum Work {
    Live(Frame),
    /// A dialed pod's replay buffer for `topic`, fetched when its
    /// connection came up (possibly empty: the stream checks that too).
    CatchUp {
        topic: Bytes,
        replay: Arc<str>,
        items: Vec<Replayed>,
        /// The dialed socket's connection it was fetched for.
        conn: ConnId,
    },
    Replayed {
        stream: StreamKey,
        ticket: u32,
        result: Result<Vec<Replayed>, String>,
    },
    /// Sent to every worker: a connection went up or down.
    Connection {
        conn: ConnId,
        up: bool,
    },
    /// `RemovePod`: forget every DP rank of the pod; answers (cache
    /// domains removed, blocks they held).
    Remove {
        model: String,
        pod: String,
        reply: tokio::sync::oneshot::Sender<(usize, u64)>,
    },
    /// Another worker found the index over capacity with this worker's pod
    /// the largest.
    Evict,
    /// A pod restored from a snapshot: looked after (and forgotten after
    /// `--pod-expiry` if it never comes back) like any other.
    Adopt(Arc<Pod>),
    /// `RecordRouting`: the router sent this prompt to this pod.
    Record {
        routing: Routing,
        /// The model is served from routing history (`--approximate-model`).
        approximate: bool,
        reply: tokio::sync::oneshot::Sender<RecordReply>,
    },
}

/// What recording a routing did, for `RecordRoutingResponse`.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecordReply {
    pub held: u32,
    pub speculative: u32,
    pub ttl: Duration,
    /// The pod held the whole prompt already.
    pub confirmed: bool,
    pub approximate: bool,
}

/// What the ingest queues may hold, in bytes, per worker: a count alone is
/// either too shallow for a stream of 1-block decode batches (a worker
/// descheduled for 80 ms dropped 4,096 of them) or, times a 4 MiB message,
/// far more memory than anyone budgeted. And what each queue had to refuse
/// (see `DroppedBatches`).
pub struct QueueBudget {
    queued: Vec<AtomicUsize>,
    max_bytes: usize,
    dropped: Vec<parking_lot::Mutex<DroppedBatches>>,
}

/// Live batches a worker's full queue refused, newest seq per (topic,
/// connection), for the worker to fetch from the pods' replay buffers
/// rather than wait for each pod's next batch to show the gap (which for a
/// pod gone quiet never comes).
///
/// Not a message on a queue: a notice must not overtake the pod's batches
/// still queued before it (a repair started then would ask for batches
/// that are on their way, and take them for another run when they come),
/// and under overload a notice per drop would fill any bounded queue. The
/// worker takes them only once its queue is empty, when every batch queued
/// before a drop has been seen; coalesced per topic, they are bounded.
pub type DroppedBatches = HashMap<(Bytes, ConnId), u64>;

/// Topics with drops noted per worker; past it, a drop is left for the
/// pod's next batch to show.
const MAX_DROPPED_TOPICS: usize = 4096;

impl QueueBudget {
    pub fn new(workers: usize, max_bytes: usize) -> Self {
        QueueBudget {
            queued: (0..workers).map(|_| AtomicUsize::new(0)).collect(),
            max_bytes,
            dropped: (0..workers).map(|_| Default::default()).collect(),
        }
    }

    /// What a queued frame holds: its bytes and its bookkeeping.
    pub fn cost(frame: &Frame) -> usize {
        frame.payload.len() + frame.topic.len() + 128
    }

    /// Room for `n` more bytes in `worker`'s queue, taken; false if full.
    pub fn take(&self, worker: usize, n: usize) -> bool {
        let queued = &self.queued[worker];
        let mut now = queued.load(Ordering::Relaxed);
        loop {
            if now + n > self.max_bytes {
                return false;
            }
            match queued.compare_exchange_weak(now, now + n, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(actual) => now = actual,
            }
        }
    }

    pub fn release(&self, worker: usize, n: usize) {
        self.queued[worker].fetch_sub(n, Ordering::Relaxed);
    }

    /// Notes that `worker`'s queue refused `frame`.
    fn note_dropped(&self, worker: usize, frame: Frame) {
        let mut dropped = self.dropped[worker].lock();
        let at_bound = dropped.len() >= MAX_DROPPED_TOPICS;
        match dropped.entry((frame.topic, frame.conn)) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                *e.get_mut() = (*e.get()).max(frame.seq);
            }
            std::collections::hash_map::Entry::Vacant(e) if !at_bound => {
                e.insert(frame.seq);
            }
            std::collections::hash_map::Entry::Vacant(_) => {}
        }
    }

    /// The drops noted for `worker` so far, taken.
    fn take_dropped(&self, worker: usize) -> DroppedBatches {
        std::mem::take(&mut *self.dropped[worker].lock())
    }
}

/// Queues a live batch for `worker` within its queue's bounds in messages
/// and bytes, never waiting on them: false, with nothing queued and the
/// drop noted for the worker (see `DroppedBatches`), when either is full.
/// Disconnected only when shutting down: counted as queued.
pub fn offer_live(
    queues: &[flume::Sender<Work>],
    budget: &QueueBudget,
    worker: usize,
    frame: Frame,
) -> bool {
    let cost = QueueBudget::cost(&frame);
    if !budget.take(worker, cost) {
        budget.note_dropped(worker, frame);
        return false;
    }
    match queues[worker].try_send(Work::Live(frame)) {
        Ok(()) | Err(flume::TrySendError::Disconnected(_)) => true,
        Err(flume::TrySendError::Full(work)) => {
            budget.release(worker, cost);
            if let Work::Live(frame) = work {
                budget.note_dropped(worker, frame);
            }
            false
        }
    }
}

/// A pod's topic and DP rank: one seq space.
pub type StreamKey = (Bytes, Option<u32>);

pub struct WorkerConfig {
    /// Replay endpoints for pods that connect to us (bind mode), by pod name.
    pub replay_endpoints: HashMap<String, String>,
    pub replay_timeout: Duration,
    /// For replay sockets: the process's libzmq context and frame limits.
    pub context: zmq::Context,
    pub limits: crate::zmq_io::ReceiveLimits,
    /// Replay fetches in flight at once, process-wide.
    pub replay_slots: Arc<tokio::sync::Semaphore>,
    pub stream_limits: StreamLimits,
    /// Every worker's queue of event batches, by index.
    pub workers: Arc<Vec<flume::Sender<Work>>>,
    /// Which worker owns each pod.
    pub owners: Arc<Owners>,
    /// Every worker's control queue (replay replies, connection changes,
    /// `RemovePod`, eviction requests, adoptions): served before the
    /// batches, so an eviction asked of a worker does not wait behind
    /// thousands of queued batches while every writer keeps storing.
    pub control: Arc<Vec<flume::Sender<Work>>>,
    /// Set while an eviction request waits in some worker's queue: one at a
    /// time, not one per batch applied over capacity.
    pub evict_pending: Arc<AtomicBool>,
    /// Routing feedback's shared state (outcomes, approximate history).
    pub feedback: Arc<Feedback>,
    /// Bytes queued per worker (`--ingest-queue-bytes`).
    pub queue_budget: Arc<QueueBudget>,
}

struct Stream {
    pod: Arc<Pod>,
    replay: Option<Arc<str>>,
    machine: StreamMachine<EventBatch>,
    /// The connection its last live batch came on.
    conn: Option<ConnId>,
}

pub struct Worker<'a> {
    indexer: &'a Indexer,
    metrics: &'a Metrics,
    config: &'a WorkerConfig,
    runtime: tokio::runtime::Handle,
    /// This worker's index in `config.workers`.
    index: usize,
    /// Looked up for every batch: foldhash, seeded per table, not SipHash
    /// (1-3% of a worker's samples with 1-block batches). Its weaker
    /// resistance to chosen keys is bounded here: a stream exists only for
    /// a pod the index admitted (`--max-pods`).
    streams: HashMap<StreamKey, Stream, foldhash::fast::RandomState>,
    /// Streams by the connection they arrive on.
    by_conn: HashMap<ConnId, HashSet<StreamKey>>,
    /// Streams by pod id (a pod may be fed by more than one topic spelling
    /// and has one stream per DP rank's id): what `RemovePod` and expiry
    /// look up, in O(the pod's streams).
    by_pod: HashMap<u32, Vec<StreamKey>, KeyBuildHasher>,
    /// Streams by topic: its DP ranks (what a dropped batch's notice,
    /// which names the topic alone, looks up).
    by_topic: HashMap<Bytes, Vec<Option<u32>>, foldhash::fast::RandomState>,
    actions: Vec<Action<EventBatch>>,
    warn: RateLimited,
    refused_warn: RateLimited,
    /// Stream faults (a batch lost for good, a pod whose replay buffer moved
    /// past us, a replay that failed) are counted each, in the metrics and
    /// ListPods, but logged at a bounded rate: a lossy link or an
    /// overloaded worker sees one per gap, thousands a second.
    lost_warn: RateLimited,
    unverified_warn: RateLimited,
    replay_warn: RateLimited,
    /// A fleet's first minute logs every pod; a flood of names must not.
    new_pod_log: RateLimited,
    mismatch_warned: HashSet<String>,
    /// This worker's pods' recorded routings, until each ends.
    tracker: Tracker,
    /// (model, pod) with speculative entries written by this worker, swept
    /// at each tick.
    speculated: HashSet<(String, String)>,
}

/// Queued batches a worker takes in a row before it looks at its control
/// queue again.
const DRAIN: usize = 64;

/// How often streams are checked for expiry.
const TICK: Duration = Duration::from_secs(1);
/// How often routings are checked for their TTL: an outcome is counted
/// this late at most (readers see a speculative entry end on time).
const ROUTING_TICK: Duration = Duration::from_millis(50);

impl<'a> Worker<'a> {
    pub fn new(
        indexer: &'a Indexer,
        metrics: &'a Metrics,
        config: &'a WorkerConfig,
        runtime: tokio::runtime::Handle,
        index: usize,
    ) -> Self {
        Worker {
            indexer,
            metrics,
            config,
            runtime,
            index,
            streams: HashMap::default(),
            by_conn: HashMap::new(),
            by_pod: HashMap::default(),
            by_topic: HashMap::default(),
            actions: Vec::new(),
            warn: RateLimited::new(Duration::from_secs(10)),
            refused_warn: RateLimited::new(Duration::from_secs(10)),
            lost_warn: RateLimited::new(Duration::from_secs(10)),
            unverified_warn: RateLimited::new(Duration::from_secs(10)),
            replay_warn: RateLimited::new(Duration::from_secs(10)),
            new_pod_log: RateLimited::new(Duration::from_millis(100)),
            mismatch_warned: HashSet::new(),
            tracker: Tracker::new(
                config.feedback.ttl,
                config.feedback.tracked_bytes_per_worker,
                crate::feedback::MAX_PENDING_PER_POD,
            ),
            speculated: HashSet::new(),
        }
    }

    /// Runs until `stop` is set and the queue is drained. (Every worker
    /// holds the senders of all queues, for replay results and eviction
    /// requests, so closing alone cannot end it.) `dead` is set if the
    /// thread ends any other way (a panic outside the supervised apply):
    /// readiness and gRPC health then report it.
    pub fn run(
        mut self,
        rx: flume::Receiver<Work>,
        control: flume::Receiver<Work>,
        stop: &AtomicBool,
        dead: &AtomicBool,
    ) {
        struct Watch<'a>(&'a AtomicBool, &'a AtomicBool);
        impl Drop for Watch<'_> {
            fn drop(&mut self) {
                if !self.0.load(Ordering::Relaxed) {
                    self.1.store(true, Ordering::Relaxed);
                }
            }
        }
        let _watch = Watch(stop, dead);
        self.serve(&rx, &control, stop);
    }

    fn serve(
        &mut self,
        rx: &flume::Receiver<Work>,
        control: &flume::Receiver<Work>,
        stop: &AtomicBool,
    ) {
        let mut last_tick = Instant::now();
        let mut last_routing_tick = Instant::now();
        loop {
            while let Ok(work) = control.try_recv() {
                self.handle(work);
            }
            // Queued batches first, without a selector: building one and
            // registering its two hooks per batch cost more than a small
            // batch's decode. Control work waits at most this many.
            let mut drained = 0;
            while drained < DRAIN {
                // Except an eviction asked of this worker: while it waits,
                // every writer keeps storing, and a pod whose share runs
                // ahead grows its tables for good. (Set while any worker is
                // asked; a look at an empty queue is cheap.)
                if self.config.evict_pending.load(Ordering::Relaxed) {
                    while let Ok(work) = control.try_recv() {
                        self.handle(work);
                    }
                }
                let Ok(work) = rx.try_recv() else { break };
                self.handle(work);
                drained += 1;
            }
            // Both queues empty: wait on either.
            if drained == 0 {
                // Every batch queued before a drop has been seen.
                self.fetch_dropped();
                let wait = if self.tracker.tracked() > 0 {
                    ROUTING_TICK
                } else {
                    Duration::from_millis(100)
                };
                let next = flume::Selector::new()
                    .recv(control, |r| r)
                    .recv(rx, |r| r)
                    .wait_timeout(wait);
                match next {
                    Ok(Ok(work)) => self.handle(work),
                    // Both queues' senders are held by every worker: only
                    // shutdown ends them.
                    Ok(Err(flume::RecvError::Disconnected)) => return,
                    Err(_) => {}
                }
            }
            if self.tracker.tracked() > 0 && last_routing_tick.elapsed() >= ROUTING_TICK {
                last_routing_tick = Instant::now();
                let ended = self.tracker.expire(last_routing_tick);
                self.config.feedback.ended(&ended);
            }
            if last_tick.elapsed() >= TICK {
                last_tick = Instant::now();
                self.tick();
                self.sweep_speculation(last_tick);
            }
            if stop.load(Ordering::Relaxed) && rx.is_empty() && control.is_empty() {
                return;
            }
        }
    }

    fn handle(&mut self, work: Work) {
        match work {
            Work::Live(frame) => {
                self.config
                    .queue_budget
                    .release(self.index, QueueBudget::cost(&frame));
                self.live(frame)
            }
            Work::CatchUp {
                topic,
                replay,
                items,
                conn,
            } => self.catch_up(&topic, &replay, items, conn),
            Work::Replayed {
                stream,
                ticket,
                result,
            } => self.replayed(stream, ticket, result),
            Work::Connection { conn, up } => self.connection(conn, up),
            Work::Remove { model, pod, reply } => {
                let _ = reply.send(self.remove(&model, &pod, "removed by admin"));
            }
            Work::Evict => {
                self.config.evict_pending.store(false, Ordering::Relaxed);
                self.enforce_capacity();
            }
            Work::Adopt(pod) => self.adopt(pod),
            Work::Record {
                routing,
                approximate,
                reply,
            } => {
                let _ = reply.send(self.record(routing, approximate));
            }
        }
    }

    /// A routing to one of this worker's pods: its blocks become
    /// speculative (or, for an approximate model, routing history).
    fn record(&mut self, routing: Routing, approximate: bool) -> RecordReply {
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

    /// After a batch of `pod` with routings waiting: what its stores say
    /// about them (confirmed, or evidence of a mismatch).
    fn routing_stores(&mut self, pod: &Pod, batch: &EventBatch) {
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
    fn sweep_speculation(&mut self, now: Instant) {
        let spec = self.indexer.speculative();
        self.speculated.retain(|(model, pod)| {
            spec.sweep(model, pod, now);
            spec.pod(model, pod).is_some()
        });
    }

    /// A pod is gone: its routings end as they stand.
    fn forget_routings(&mut self, pod: &Pod) {
        let ended = self.tracker.forget_pod(&pod.model, &pod.name);
        self.config.feedback.ended(&ended);
        self.config
            .feedback
            .approximate
            .forget_pod(&pod.model, &pod.name);
    }

    /// Whether this worker writes `pod`: it has a stream of it (see
    /// `Owners`). Its own map, no lock: eviction asks this while it holds
    /// the index's pod table.
    fn owns(&self, pod: &Pod) -> bool {
        self.by_pod.contains_key(&pod.id.0)
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

    fn numbered(&self, topic: &Bytes, seq: u64, payload: &[u8]) -> Option<Numbered<EventBatch>> {
        let batch = self.decode(topic, seq, payload)?;
        Some(Numbered {
            seq,
            fingerprint: xxhash_rust::xxh3::xxh3_64(payload),
            batch,
        })
    }

    fn live(&mut self, frame: Frame) {
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
        if self.stream_entry(&key, frame.replay, now).is_none() {
            return;
        }
        self.attach(&key, frame.conn, now);
        self.feed(&key, Input::Live(batch), now);
    }

    /// Claims the pod of a stream's `topic` before the stream is created
    /// (see `Owners`): `Err(owner)` if another worker owns it. Claimed and
    /// released by the same topic, so a pod's spellings cannot unbalance
    /// its count.
    fn claim(&self, topic: &Bytes) -> Result<(), usize> {
        match parse_topic(topic) {
            Ok(t) => self.config.owners.claim(t.pod, t.model, self.index),
            // Not routable by pod, so not routed by it either.
            Err(_) => Ok(()),
        }
    }

    /// Gives back what `claim` took for a stream of `topic`.
    fn release(&self, topic: &Bytes) {
        if let Ok(t) = parse_topic(topic) {
            self.config.owners.release(t.pod, t.model, self.index);
        }
    }

    /// The worker that owns the pod of `topic`, if not this one (work for
    /// it reached this worker just before the pod moved: see `Owners`).
    fn owner_elsewhere(&self, topic: &Bytes) -> Option<usize> {
        let topic = parse_topic(topic).ok()?;
        self.config
            .owners
            .find(topic.pod, topic.model)
            .filter(|w| *w != self.index)
    }

    /// Hands a live batch to its pod's owner, as the receive loop would
    /// have: within that worker's queue bounds, never waiting on them.
    fn forward_live(&self, to: usize, frame: Frame) {
        if !offer_live(&self.config.workers, &self.config.queue_budget, to, frame) {
            self.metrics.messages_dropped.inc();
        }
    }

    /// Fetches what this worker's full queue refused (see
    /// `DroppedBatches`); called with the queue empty.
    fn fetch_dropped(&mut self) {
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
    fn dropped(&mut self, topic: &Bytes, seq: u64, conn: ConnId) {
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

    /// Records that `key` arrives on `conn`; a stream that moved to a new
    /// connection is up again.
    fn attach(&mut self, key: &StreamKey, conn: ConnId, now: Instant) {
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
    fn detach(&mut self, key: &StreamKey, conn: ConnId) {
        if let Some(keys) = self.by_conn.get_mut(&conn) {
            keys.remove(key);
            if keys.is_empty() {
                self.by_conn.remove(&conn);
            }
        }
    }

    /// Feeds one input to a stream and executes what it returns; returns
    /// the batches it applied.
    fn feed(&mut self, key: &StreamKey, input: Input<EventBatch>, now: Instant) -> usize {
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

    fn execute(&mut self, key: &StreamKey, action: Action<EventBatch>) {
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

    fn note(&self, pod: &Pod, note: Note) {
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

    fn insert_stream(&mut self, key: StreamKey, stream: Stream) {
        self.by_pod
            .entry(stream.pod.id.0)
            .or_default()
            .push(key.clone());
        self.by_topic.entry(key.0.clone()).or_default().push(key.1);
        self.streams.insert(key, stream);
    }

    fn remove_stream(&mut self, key: &StreamKey) -> Option<Stream> {
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
    fn stream_entry(
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
    fn stream_for(
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
        })
    }

    /// `pod`'s stream state machine, continuing after the last seq the
    /// index has for it (a snapshot's; none for a new pod) and remembering
    /// that batch's fingerprint, when the snapshot has it, as applied.
    fn restored_machine(
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
    fn adopt(&mut self, pod: Arc<Pod>) {
        let topic = Bytes::from(format!("kv@{}@{}", pod.topic_pod, pod.model));
        let key = (topic, pod.dp_rank);
        if self.streams.contains_key(&key) {
            return;
        }
        if let Err(to) = self.claim(&key.0) {
            // Never wait on another worker's queue (see `enforce_capacity`).
            let _ = self.config.control[to].try_send(Work::Adopt(pod));
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
        self.insert_stream(
            key,
            Stream {
                pod,
                replay,
                machine,
                conn: None,
            },
        );
    }

    fn connection(&mut self, conn: ConnId, up: bool) {
        let Some(keys) = self.by_conn.get(&conn) else {
            return;
        };
        let keys: Vec<StreamKey> = keys.iter().cloned().collect();
        let now = Instant::now();
        for key in keys {
            if let Some(stream) = self.streams.get(&key) {
                stream.pod.set_connection(if up {
                    Connection::Connected
                } else {
                    Connection::Disconnected
                });
            }
            self.feed(&key, Input::Connection { up }, now);
        }
    }

    fn tick(&mut self) {
        if self.config.stream_limits.expiry.is_none() {
            return;
        }
        let now = Instant::now();
        let keys: Vec<StreamKey> = self
            .streams
            .iter()
            .filter(|(_, s)| !s.machine.connected())
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            self.feed(&key, Input::Tick, now);
        }
    }

    /// Drops a stream and, unless another stream of this worker feeds the
    /// same pod, the pod.
    fn forget(&mut self, key: &StreamKey) {
        let Some(stream) = self.remove_stream(key) else {
            return;
        };
        if !self.by_pod.contains_key(&stream.pod.id.0) {
            self.indexer.remove_pod(&stream.pod);
            self.forget_routings(&stream.pod);
        }
    }

    /// Forgets every DP rank of `pod`; returns (domains, blocks they held).
    fn remove(&mut self, model: &str, pod: &str, why: &str) -> (usize, u64) {
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

    /// Over capacity: evicts from this worker's pods, or asks the worker
    /// that owns the largest pod (one request in flight at a time).
    fn enforce_capacity(&self) {
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

    fn fetch(
        &self,
        stream: StreamKey,
        endpoint: Arc<str>,
        from: u64,
        ticket: u32,
        delay: Duration,
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
            let _ = tx
                .send_async(Work::Replayed {
                    stream,
                    ticket,
                    result,
                })
                .await;
        });
    }

    /// A connection's catch-up: the pod's buffered batches for `topic`, by
    /// DP rank; streams of the topic the buffer has nothing for get an
    /// empty one (which still tells whether the pod restarted).
    fn catch_up(&mut self, topic: &Bytes, replay: &Arc<str>, items: Vec<Replayed>, conn: ConnId) {
        if !self.streams.keys().any(|k| k.0 == topic) {
            if let Some(to) = self.owner_elsewhere(topic) {
                let work = Work::CatchUp {
                    topic: topic.clone(),
                    replay: replay.clone(),
                    items,
                    conn,
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

    fn replayed(&mut self, key: StreamKey, ticket: u32, result: Result<Vec<Replayed>, String>) {
        if !self.streams.contains_key(&key) {
            return;
        }
        let result = result.map(|items| {
            items
                .into_iter()
                .filter(|item| item.topic.as_ref().is_none_or(|t| *t == key.0))
                .filter_map(|item| self.numbered(&key.0, item.seq, &item.payload))
                .filter(|b| b.batch.data_parallel_rank == key.1)
                .collect()
        });
        if let Err(e) = &result {
            if let Some(stream) = self.streams.get(&key) {
                tracing::debug!(pod = %stream.pod.name, error = %e, "replay fetch failed");
            }
        }
        self.feed(&key, Input::Replayed { ticket, result }, Instant::now());
    }

    fn apply(
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
}

/// Fault injection for the supervision test (debug builds only): applying
/// a batch of the pod named by `KV_INDEXER_TEST_PANIC_POD` panics, as a bug
/// in the index would.
#[cfg(debug_assertions)]
mod fault {
    use std::sync::OnceLock;

    pub fn inject(pod: &str) {
        static POD: OnceLock<Option<String>> = OnceLock::new();
        let target = POD.get_or_init(|| std::env::var("KV_INDEXER_TEST_PANIC_POD").ok());
        if target.as_deref() == Some(pod) {
            panic!("injected fault while applying a batch of {pod}");
        }
    }
}

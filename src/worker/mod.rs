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
//!
//! Here: the messages, the worker's state and its loop (serve the control
//! queue first, then up to [`DRAIN`] batches, then the ticks). Its rooms:
//! `queue` (the bytes the queues may hold, and what a full one refused),
//! `batches` (a live batch: owner, decode, apply, capacity), `streams` (the
//! stream machines fed and their actions executed), `catch_up` (gaps
//! repaired from the pods' replay sockets), `routing` (routing feedback in
//! the writer).

mod batches;
mod catch_up;
mod queue;
mod routing;
mod streams;

pub use queue::{offer_live, QueueBudget};

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use indexer::event::EventBatch;
use indexer::keys::KeyBuildHasher;
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
    /// Its topic is the dial target's `pod=`/`model=`, not the wire's.
    pub named: bool,
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
        /// Readiness waits for it (a restored start's first catch-up).
        first: Option<Arc<crate::first_catch_ups::Pending>>,
    },
    Replayed {
        stream: StreamKey,
        ticket: u32,
        result: Result<Vec<Replayed>, String>,
    },
    /// A restored pod's replay buffer, fetched when it was adopted (bind
    /// mode: it may not publish for a while); `first` is dropped once it
    /// is applied.
    RestoredCatchUp {
        stream: StreamKey,
        result: Result<Vec<Replayed>, String>,
        first: Arc<crate::first_catch_ups::Pending>,
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
    /// A restored pod, and its first catch-up if readiness waits for it.
    Adopt(Arc<Pod>, Option<Arc<crate::first_catch_ups::Pending>>),
    /// A routing another replica accepted (`KvIndexerPeer/Routed`): the
    /// pod's blocks of the prompt speculative here too, until `until`.
    Speculate {
        model: String,
        pod: String,
        keys: Vec<indexer::keys::BlockKey>,
        until: Instant,
    },
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
    /// Named by its dial target: its replay endpoint's batches are all
    /// its own, whatever topic they carry.
    named: bool,
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
                first,
            } => self.catch_up(&topic, &replay, items, conn, first),
            Work::Replayed {
                stream,
                ticket,
                result,
            } => self.replayed(stream, ticket, result),
            Work::RestoredCatchUp {
                stream,
                result,
                first,
            } => self.restored_caught_up(stream, result, first),
            Work::Connection { conn, up } => self.connection(conn, up),
            Work::Remove { model, pod, reply } => {
                let _ = reply.send(self.remove(&model, &pod, "removed by admin"));
            }
            Work::Evict => {
                self.config.evict_pending.store(false, Ordering::Relaxed);
                self.enforce_capacity();
            }
            Work::Adopt(pod, first) => self.adopt(pod, first),
            Work::Record {
                routing,
                approximate,
                reply,
            } => {
                let _ = reply.send(self.record(routing, approximate));
            }
            Work::Speculate {
                model,
                pod,
                keys,
                until,
            } => self.speculate_forwarded(&model, &pod, &keys, until),
        }
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

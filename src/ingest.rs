//! ZeroMQ ingestion: SUB sockets in, decoded batches applied to the index.
//!
//! ```text
//! SUB socket (bind: one thread;              bounded queue     worker threads (N)
//!   dial: one thread polling every pod's) -> per worker   ---> decode -> Indexer::apply
//!   recv -> check frames/topic/seq -> hash(topic)
//! ```
//! The receive loops only check the frame shape and hand the message to the
//! worker that owns its topic: they never wait on index work, and one pod's
//! batches are applied in order by one worker. A worker's queue holds at
//! most `--ingest-queue` messages; when it is full, new messages are dropped
//! and counted, and the seq gap they leave is repaired through the pod's
//! replay socket like any other gap. Memory between the socket and the
//! index is therefore bounded by workers x queue x `--max-event-message`.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use indexer::topic::parse_topic;
use indexer::Indexer;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::dial::{DialContext, Dialer};
use crate::metrics::Metrics;
use crate::ratelimit::RateLimited;
use crate::worker::{Frame, Work, Worker, WorkerConfig};
use crate::zmq_io::{self, ReceiveLimits};

/// Why a ZeroMQ message failed the shape checks. Counted, logged
/// (rate-limited), skipped. (Undecodable payloads are counted by the worker.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameProblem {
    FrameCount,
    Topic,
    Seq,
}

impl FrameProblem {
    fn label(self) -> &'static str {
        match self {
            FrameProblem::FrameCount => "frame_count",
            FrameProblem::Topic => "topic",
            FrameProblem::Seq => "seq",
        }
    }
}

/// Checks `[topic, seq (8-byte big-endian), payload]`.
fn check_frames(mut frames: Vec<Vec<u8>>) -> Result<Frame, FrameProblem> {
    if frames.len() != 3 {
        return Err(FrameProblem::FrameCount);
    }
    let payload = frames.pop().unwrap_or_default();
    let seq = frames.pop().unwrap_or_default();
    let topic = frames.pop().unwrap_or_default();
    let seq: [u8; 8] = seq[..].try_into().map_err(|_| FrameProblem::Seq)?;
    parse_topic(&topic).map_err(|_| FrameProblem::Topic)?;
    Ok(Frame {
        topic: Bytes::from(topic),
        seq: u64::from_be_bytes(seq),
        payload: Bytes::from(payload),
        replay: None,
    })
}

/// Routes frames to workers by topic, so a pod always lands on the same one.
#[derive(Clone)]
pub struct Dispatcher {
    workers: Arc<Vec<flume::Sender<Work>>>,
    metrics: Arc<Metrics>,
    warn: Arc<RateLimited>,
    dropped: Arc<RateLimited>,
}

impl Dispatcher {
    fn worker_for(&self, topic: &[u8]) -> &flume::Sender<Work> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        topic.hash(&mut h);
        &self.workers[(h.finish() % self.workers.len() as u64) as usize]
    }

    /// Hands a pod's replay buffer (fetched on connect) to the workers that
    /// own its topics. Runs off the receive threads, so it may wait for
    /// room in a queue: a catch-up is never dropped.
    pub fn catch_up(&self, replay: &Arc<str>, items: Vec<crate::replay::Replayed>) {
        let mut by_topic: HashMap<Bytes, Vec<crate::replay::Replayed>> = HashMap::new();
        for item in items {
            // The older two-frame form names no topic: the pod's first live
            // batch triggers its catch-up instead.
            if let Some(topic) = item.topic.clone() {
                if parse_topic(&topic).is_ok() {
                    by_topic.entry(topic).or_default().push(item);
                }
            }
        }
        for (topic, items) in by_topic {
            self.metrics.replays_requested.inc();
            let _ = self.worker_for(&topic).send(Work::CatchUp {
                topic,
                replay: replay.clone(),
                items,
            });
        }
    }

    /// A peer's broken stream: counted and logged (rate-limited); the
    /// socket drops that peer and goes on.
    fn receive_error(&self, source: &str, error: &zmq::Error, warn: &RateLimited) {
        self.metrics.receive_errors.inc();
        warn.warn(|suppressed| tracing::warn!(%source, %error, suppressed, "ZeroMQ receive error"));
    }

    pub fn connection_opened(&self) {
        self.metrics.zmq_connections.inc();
    }

    pub fn connection_closed(&self) {
        self.metrics.zmq_connections.dec();
        self.metrics.zmq_disconnects.inc();
    }

    /// Reads up to `burst` waiting messages from `socket` without blocking
    /// and dispatches each; `each` sees a message's frames first (dial mode
    /// notes the pod's topics).
    pub fn receive_burst(
        &self,
        socket: &zmq::Socket,
        burst: usize,
        source: &str,
        replay: Option<&Arc<str>>,
        warn: &RateLimited,
        mut each: impl FnMut(&[Vec<u8>]),
    ) {
        for _ in 0..burst {
            match socket.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => {
                    each(&frames);
                    self.dispatch(frames, source, replay);
                }
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    self.receive_error(source, &e, warn);
                    return;
                }
            }
        }
    }

    fn dispatch(&self, frames: Vec<Vec<u8>>, source: &str, replay: Option<&Arc<str>>) {
        self.metrics.messages_received.inc();
        match check_frames(frames) {
            Ok(mut frame) => {
                frame.replay = replay.cloned();
                // Never wait on index work: a full queue drops (and the gap
                // is repaired through replay). Disconnected only when
                // shutting down.
                if let Err(flume::TrySendError::Full(_)) =
                    self.worker_for(&frame.topic).try_send(Work::Live(frame))
                {
                    self.metrics.messages_dropped.inc();
                    self.dropped.warn(|suppressed| {
                        tracing::warn!(%source, suppressed, "ingest queue full: dropping ZeroMQ messages (raise --ingest-workers or --ingest-queue)")
                    });
                }
            }
            Err(problem) => {
                self.metrics.skip_message(problem.label());
                self.warn.warn(|suppressed| {
                    tracing::warn!(%source, ?problem, suppressed, "skipping malformed ZeroMQ message")
                });
            }
        }
    }
}

/// Running ingestion; [`Ingest::shutdown`] stops the sockets and workers.
pub struct Ingest {
    tasks: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    receivers: Vec<std::thread::JoinHandle<()>>,
    dialer: Option<Arc<Dialer>>,
    workers: Vec<std::thread::JoinHandle<()>>,
    _zap: Option<crate::zap::ZapHandler>,
    /// Set when an ingest worker thread ended unexpectedly.
    dead: Arc<AtomicBool>,
    /// The endpoint the SUB socket actually bound (port 0 resolved).
    pub bound: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("cannot bind the ZeroMQ SUB socket: {0}")]
    Bind(String),
    #[error("cannot set up the ZeroMQ SUB socket: {0}")]
    Socket(zmq::Error),
    #[error("cannot start the ZeroMQ allow-list handler: {0}")]
    Zap(String),
    #[error("cannot start an ingest thread: {0}")]
    Thread(std::io::Error),
}

impl Ingest {
    /// Binds (if configured; failure is fatal) and starts dialing pods (in
    /// the background; libzmq retries until they are up).
    pub async fn start(
        config: &Config,
        indexer: Arc<Indexer>,
        metrics: Arc<Metrics>,
    ) -> Result<Ingest, IngestError> {
        let context = zmq::Context::new();
        let limits = ReceiveLimits {
            max_message_bytes: config.max_event_message_bytes,
            hwm: zmq_io::RECEIVE_HWM,
        };
        let mut senders = Vec::with_capacity(config.ingest_workers);
        let mut workers = Vec::with_capacity(config.ingest_workers);
        let stop = Arc::new(AtomicBool::new(false));
        let dead = Arc::new(AtomicBool::new(false));
        // Replay fetches in flight at once (gap repairs and catch-ups): each
        // holds a socket and up to a replay buffer in memory.
        let replay_slots = Arc::new(tokio::sync::Semaphore::new(MAX_REPLAYS_IN_FLIGHT));
        let worker_config = Arc::new(WorkerConfig {
            replay_endpoints: config.replay_endpoints.clone(),
            replay_timeout: config.replay_timeout,
            context: context.clone(),
            limits,
            replay_slots: replay_slots.clone(),
        });
        for i in 0..config.ingest_workers {
            let (tx, rx) = flume::bounded(config.ingest_queue);
            senders.push(tx.clone());
            let indexer = indexer.clone();
            let metrics = metrics.clone();
            let (stop, dead) = (stop.clone(), dead.clone());
            let worker_config = worker_config.clone();
            let runtime = tokio::runtime::Handle::current();
            let handle = std::thread::Builder::new()
                .name(format!("ingest-{i}"))
                .spawn(move || {
                    Worker::new(&indexer, &metrics, &worker_config, runtime, tx)
                        .run(rx, &stop, &dead)
                })
                .map_err(IngestError::Thread)?;
            workers.push(handle);
        }
        let dispatcher = Dispatcher {
            workers: Arc::new(senders),
            metrics: metrics.clone(),
            warn: Arc::new(RateLimited::new(Duration::from_secs(10))),
            dropped: Arc::new(RateLimited::new(Duration::from_secs(10))),
        };

        let mut receivers = Vec::new();
        let mut bound = None;
        let mut zap = None;
        if let Some(endpoint) = &config.zmq_bind {
            if !config.zmq_allow.is_empty() {
                zap = Some(
                    crate::zap::ZapHandler::start(&context, config.zmq_allow.clone(), metrics)
                        .map_err(IngestError::Zap)?,
                );
            }
            let socket = context.socket(zmq::SUB).map_err(IngestError::Socket)?;
            zmq_io::limit(&socket, limits).map_err(IngestError::Socket)?;
            if zap.is_some() {
                socket
                    .set_zap_domain(crate::zap::DOMAIN)
                    .map_err(IngestError::Socket)?;
            }
            socket
                .set_subscribe(config.topic_filter.as_bytes())
                .map_err(IngestError::Socket)?;
            let monitor =
                zmq_io::monitor(&context, &socket, "bind").map_err(IngestError::Socket)?;
            socket
                .bind(endpoint)
                .map_err(|e| IngestError::Bind(zmq_io::bind_error(endpoint, e)))?;
            let actual = zmq_io::last_endpoint(&socket).map_err(IngestError::Socket)?;
            tracing::info!(endpoint = %actual, topic_filter = %config.topic_filter, max_event_message = config.max_event_message_bytes, "ZeroMQ SUB socket bound; pods can connect");
            bound = Some(actual.clone());
            let (d, stop) = (dispatcher.clone(), stop.clone());
            receivers.push(
                std::thread::Builder::new()
                    .name("zmq-bind".into())
                    .spawn(move || bind_loop(&socket, &monitor, &actual, &d, &stop))
                    .map_err(IngestError::Thread)?,
            );
        }
        let dialer = Arc::new(
            Dialer::start(
                DialContext {
                    context,
                    replay_slots,
                    limits,
                    topic_filter: config.topic_filter.clone(),
                    dispatcher,
                    expiry: config.pod_expiry,
                    indexer,
                    runtime: tokio::runtime::Handle::current(),
                },
                stop.clone(),
            )
            .map_err(IngestError::Thread)?,
        );
        let mut tasks = Vec::new();
        if config.discovery.is_enabled() {
            let discovery = config.discovery.clone();
            let static_targets = config.zmq_connect.clone();
            let d = dialer.clone();
            tasks.push(tokio::spawn(crate::discovery::run(
                discovery,
                static_targets,
                move |targets| d.reconcile(targets),
            )));
        } else {
            dialer.reconcile(config.zmq_connect.clone());
        }
        Ok(Ingest {
            tasks,
            stop,
            receivers,
            dialer: Some(dialer),
            workers,
            _zap: zap,
            dead,
            bound,
        })
    }

    /// Set once an ingest worker died: its pods' events are no longer
    /// applied, and the process must say so (readiness, gRPC health).
    pub fn worker_died(&self) -> Arc<AtomicBool> {
        self.dead.clone()
    }

    /// Stops receiving, lets the workers drain what they already have.
    pub fn shutdown(mut self) {
        for task in &self.tasks {
            task.abort();
        }
        self.tasks.clear();
        self.stop.store(true, Ordering::Relaxed);
        for receiver in self.receivers.drain(..) {
            let _ = receiver.join();
        }
        // The discovery task held the other handle; aborted above.
        drop(self.dialer.take());
        // Workers drain what they have queued, then exit.
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// Replay fetches in flight at once.
const MAX_REPLAYS_IN_FLIGHT: usize = 32;

/// Messages read before the monitor and the stop flag are looked at again.
const BURST: usize = 4096;

/// The bind socket's receive loop: every pod that connects to us.
fn bind_loop(
    socket: &zmq::Socket,
    monitor: &zmq::Socket,
    source: &str,
    dispatcher: &Dispatcher,
    stop: &AtomicBool,
) {
    let warn = RateLimited::new(Duration::from_secs(10));
    while !stop.load(Ordering::Relaxed) {
        let mut items = [
            socket.as_poll_item(zmq::POLLIN),
            monitor.as_poll_item(zmq::POLLIN),
        ];
        // The timeout only bounds how late `stop` is seen.
        if zmq::poll(&mut items, 100).is_err() {
            continue;
        }
        let (messages, events) = (items[0].is_readable(), items[1].is_readable());
        if messages {
            dispatcher.receive_burst(socket, BURST, source, None, &warn, |_| {});
        }
        if events {
            for event in zmq_io::drain_monitor(monitor) {
                match event.event {
                    zmq::SocketEvent::ACCEPTED => dispatcher.connection_opened(),
                    zmq::SocketEvent::DISCONNECTED => dispatcher.connection_closed(),
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(frames: Vec<&[u8]>) -> Vec<Vec<u8>> {
        frames.into_iter().map(<[u8]>::to_vec).collect()
    }

    #[test]
    fn frame_shape_is_checked() {
        let seq = 7u64.to_be_bytes();
        let ok = check_frames(msg(vec![b"kv@p@m", &seq, b"x"])).unwrap();
        assert_eq!(ok.seq, 7);
        assert_eq!(
            check_frames(msg(vec![b"kv@p@m", &seq])).err(),
            Some(FrameProblem::FrameCount)
        );
        assert_eq!(
            check_frames(msg(vec![b"kv@p@m", b"1234", b"x"])).err(),
            Some(FrameProblem::Seq)
        );
        assert_eq!(
            check_frames(msg(vec![b"kv-pod-model", &seq, b"x"])).err(),
            Some(FrameProblem::Topic)
        );
    }
}

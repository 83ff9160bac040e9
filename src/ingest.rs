//! ZeroMQ ingestion: SUB sockets in, decoded batches applied to the index.
//!
//! ```text
//! SUB socket (bind and/or one per dialed pod)        worker threads (N)
//!   recv -> check frames/topic/seq -> hash(topic) ---> decode -> Indexer::apply
//! ```
//! The receive loops only check the frame shape and hand the message to the
//! worker that owns its topic over an unbounded channel: they never wait on
//! index work, and one pod's batches are applied in order by one worker.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use indexer::topic::parse_topic;
use indexer::Indexer;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SubSocket, ZmqMessage};

use crate::config::{Config, DialTarget};
use crate::metrics::Metrics;
use crate::ratelimit::RateLimited;
use crate::worker::{Frame, Work, Worker, WorkerConfig};

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
fn check_frames(msg: ZmqMessage) -> Result<Frame, FrameProblem> {
    let mut frames = msg.into_vec();
    if frames.len() != 3 {
        return Err(FrameProblem::FrameCount);
    }
    let payload = frames.pop().unwrap_or_default();
    let seq = frames.pop().unwrap_or_default();
    let topic = frames.pop().unwrap_or_default();
    let seq: [u8; 8] = seq.as_ref().try_into().map_err(|_| FrameProblem::Seq)?;
    parse_topic(&topic).map_err(|_| FrameProblem::Topic)?;
    Ok(Frame {
        topic,
        seq: u64::from_be_bytes(seq),
        payload,
        replay: None,
    })
}

/// Routes frames to workers by topic, so a pod always lands on the same one.
#[derive(Clone)]
struct Dispatcher {
    workers: Arc<Vec<flume::Sender<Work>>>,
    metrics: Arc<Metrics>,
    warn: Arc<RateLimited>,
}

impl Dispatcher {
    fn worker_for(&self, topic: &[u8]) -> &flume::Sender<Work> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        topic.hash(&mut h);
        &self.workers[(h.finish() % self.workers.len() as u64) as usize]
    }

    /// Hands a pod's replay buffer (fetched on connect) to the workers that
    /// own its topics.
    fn catch_up(&self, replay: &Arc<str>, items: Vec<crate::replay::Replayed>) {
        let mut by_topic: HashMap<Bytes, Vec<crate::replay::Replayed>> = HashMap::new();
        for item in items {
            // The older two-frame form names no topic: the pod's first live
            // batch triggers its catch-up instead.
            if let Some(topic) = item.topic.clone() {
                by_topic.entry(topic).or_default().push(item);
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
    fn receive_error(&self, source: &str, error: &zeromq::ZmqError, warn: &RateLimited) {
        self.metrics.receive_errors.inc();
        warn.warn(|suppressed| tracing::warn!(%source, %error, suppressed, "ZeroMQ receive error"));
    }

    fn dispatch(&self, msg: ZmqMessage, source: &str, replay: Option<&Arc<str>>) {
        self.metrics.messages_received.inc();
        match check_frames(msg) {
            Ok(mut frame) => {
                frame.replay = replay.cloned();
                // Unbounded: the socket loop must never wait on index work.
                // Fails only when shutting down.
                let _ = self.worker_for(&frame.topic).send(Work::Live(frame));
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

/// Running ingestion; dropping it stops the sockets and workers.
pub struct Ingest {
    tasks: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    workers: Vec<std::thread::JoinHandle<()>>,
    /// The endpoint the SUB socket actually bound (port 0 resolved).
    pub bound: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("cannot bind ZeroMQ SUB socket on {endpoint}: {source}")]
    Bind {
        endpoint: String,
        source: zeromq::ZmqError,
    },
    #[error("cannot subscribe: {0}")]
    Subscribe(zeromq::ZmqError),
    #[error("cannot start ingest worker thread: {0}")]
    Thread(std::io::Error),
}

impl Ingest {
    /// Binds (if configured; failure is fatal) and starts dialing pods (in
    /// the background, retrying until they are up).
    pub async fn start(
        config: &Config,
        indexer: Arc<Indexer>,
        metrics: Arc<Metrics>,
    ) -> Result<Ingest, IngestError> {
        let mut senders = Vec::with_capacity(config.ingest_workers);
        let mut workers = Vec::with_capacity(config.ingest_workers);
        let stop = Arc::new(AtomicBool::new(false));
        let worker_config = Arc::new(WorkerConfig {
            replay_endpoints: config.replay_endpoints.clone(),
            replay_timeout: config.replay_timeout,
        });
        for i in 0..config.ingest_workers {
            let (tx, rx) = flume::unbounded();
            senders.push(tx.clone());
            let indexer = indexer.clone();
            let metrics = metrics.clone();
            let stop = stop.clone();
            let worker_config = worker_config.clone();
            let runtime = tokio::runtime::Handle::current();
            let handle = std::thread::Builder::new()
                .name(format!("ingest-{i}"))
                .spawn(move || {
                    Worker::new(&indexer, &metrics, &worker_config, runtime, tx).run(rx, &stop)
                })
                .map_err(IngestError::Thread)?;
            workers.push(handle);
        }
        let dispatcher = Dispatcher {
            workers: Arc::new(senders),
            metrics,
            warn: Arc::new(RateLimited::new(Duration::from_secs(10))),
        };

        let mut tasks = Vec::new();
        let mut bound = None;
        if let Some(endpoint) = &config.zmq_bind {
            let mut socket = SubSocket::new();
            socket
                .subscribe(&config.topic_filter)
                .await
                .map_err(IngestError::Subscribe)?;
            let actual = socket
                .bind(endpoint)
                .await
                .map_err(|source| IngestError::Bind {
                    endpoint: endpoint.clone(),
                    source,
                })?;
            tracing::info!(endpoint = %actual, topic_filter = %config.topic_filter, "ZeroMQ SUB socket bound; pods can connect");
            bound = Some(actual.to_string());
            let d = dispatcher.clone();
            let source = actual.to_string();
            tasks.push(tokio::spawn(recv_loop(socket, source, d, None)));
        }
        let mut dialer = Dialer {
            running: HashMap::new(),
            topic_filter: config.topic_filter.clone(),
            dispatcher: dispatcher.clone(),
            expiry: config.pod_expiry.map(|after| Expiry {
                after,
                indexer: indexer.clone(),
            }),
        };
        if config.discovery.is_enabled() {
            let discovery = config.discovery.clone();
            let static_targets = config.zmq_connect.clone();
            tasks.push(tokio::spawn(crate::discovery::run(
                discovery,
                static_targets,
                move |targets| dialer.reconcile(&targets),
            )));
        } else {
            dialer.reconcile(&config.zmq_connect);
            tasks.push(tokio::spawn(async move {
                // Keeps the static dialers alive for as long as ingestion runs.
                let _dialer = dialer;
                std::future::pending::<()>().await;
            }));
        }
        Ok(Ingest {
            tasks,
            stop,
            workers,
            bound,
        })
    }

    /// Stops receiving, lets the workers drain what they already have.
    pub fn shutdown(self) {
        for task in &self.tasks {
            task.abort();
        }
        drop(self.tasks);
        // Workers drain what they have queued, then exit.
        self.stop.store(true, Ordering::Relaxed);
        for worker in self.workers {
            let _ = worker.join();
        }
    }
}

/// The pods being dialed, one task (and SUB socket) each.
struct Dialer {
    running: HashMap<DialTarget, JoinHandle<()>>,
    topic_filter: String,
    dispatcher: Dispatcher,
    expiry: Option<Expiry>,
}

/// Forgetting dialed pods that are gone: silent and disconnected.
#[derive(Clone)]
struct Expiry {
    after: Duration,
    indexer: Arc<Indexer>,
}

impl Dialer {
    /// Connects to targets not yet dialed and drops the ones no longer wanted.
    fn reconcile(&mut self, desired: &[DialTarget]) {
        let wanted: std::collections::HashSet<&DialTarget> = desired.iter().collect();
        self.running.retain(|target, task| {
            let keep = wanted.contains(target);
            if !keep {
                tracing::info!(endpoint = %target.endpoint, "pod no longer listed: disconnecting");
                task.abort();
            }
            keep
        });
        for target in desired {
            if !self.running.contains_key(target) {
                let task = tokio::spawn(dial(
                    target.clone(),
                    self.topic_filter.clone(),
                    self.dispatcher.clone(),
                    self.expiry.clone(),
                ));
                self.running.insert(target.clone(), task);
            }
        }
    }
}

impl Drop for Dialer {
    fn drop(&mut self) {
        for task in self.running.values() {
            task.abort();
        }
    }
}

/// Connects to one pod's PUB socket, retrying until it answers; the socket
/// then reconnects by itself if the pod goes away and comes back.
async fn dial(
    target: DialTarget,
    topic_filter: String,
    dispatcher: Dispatcher,
    expiry: Option<Expiry>,
) {
    let mut socket = SubSocket::new();
    let monitor = socket.monitor();
    if let Err(e) = socket.subscribe(&topic_filter).await {
        tracing::error!(endpoint = %target.endpoint, error = %e, "cannot subscribe");
        return;
    }
    let mut delay = Duration::from_millis(100);
    loop {
        match socket.connect(&target.endpoint).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(endpoint = %target.endpoint, error = %e, retry_in = ?delay, "cannot connect to pod yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(10));
            }
        }
    }
    tracing::info!(endpoint = %target.endpoint, replay = ?target.replay, "connected to pod");
    let replay: Option<Arc<str>> = target.replay.as_deref().map(Arc::from);
    if let Some(endpoint) = replay.clone() {
        // Catch up with what the pod did before we connected (it may stay
        // idle for a long time): its whole replay buffer.
        let d = dispatcher.clone();
        tokio::spawn(async move {
            match crate::replay::fetch(&endpoint, 0, REPLAY_ON_CONNECT_TIMEOUT).await {
                Ok(items) => d.catch_up(&endpoint, items),
                Err(e) => {
                    tracing::warn!(%endpoint, error = %e, "catch-up replay failed; relying on gap repair")
                }
            }
        });
    }
    match expiry {
        Some(expiry) => {
            dialed_recv_loop(socket, monitor, target.endpoint, dispatcher, replay, expiry).await
        }
        None => recv_loop(socket, target.endpoint, dispatcher, replay).await,
    }
}

/// A full replay buffer (10,000 batches by default) can take a while.
const REPLAY_ON_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// A dialed pod's receive loop, which also forgets its pods once the
/// connection has been down and nothing arrived for `expiry.after`.
async fn dialed_recv_loop(
    mut socket: SubSocket,
    mut monitor: futures::channel::mpsc::Receiver<zeromq::SocketEvent>,
    source: String,
    dispatcher: Dispatcher,
    replay: Option<Arc<str>>,
    expiry: Expiry,
) {
    use futures::StreamExt;
    let warn = RateLimited::new(Duration::from_secs(10));
    // Topics seen on this socket (copied once each, not per message).
    let mut seen: std::collections::HashSet<Vec<u8>> = Default::default();
    let mut last_message = std::time::Instant::now();
    let mut down_since: Option<std::time::Instant> = None;
    let mut check = tokio::time::interval((expiry.after / 4).max(Duration::from_millis(100)));
    loop {
        tokio::select! {
            msg = socket.recv() => match msg {
                Ok(msg) => {
                    last_message = std::time::Instant::now();
                    if let Some(topic) = msg.get(0) {
                        if !seen.contains(topic.as_ref()) {
                            seen.insert(topic.to_vec());
                        }
                    }
                    dispatcher.dispatch(msg, &source, replay.as_ref());
                }
                Err(e) => dispatcher.receive_error(&source, &e, &warn),
            },
            Some(event) = monitor.next() => match event {
                zeromq::SocketEvent::Disconnected(_) => {
                    down_since.get_or_insert_with(std::time::Instant::now);
                }
                zeromq::SocketEvent::Connected(..) => down_since = None,
                _ => {}
            },
            _ = check.tick() => {
                let gone = down_since.is_some_and(|t| t.elapsed() >= expiry.after)
                    && last_message.elapsed() >= expiry.after;
                if gone && !seen.is_empty() {
                    for raw in seen.drain() {
                        let Ok(topic) = parse_topic(&raw) else { continue };
                        let (domains, blocks) =
                            expiry.indexer.remove_pod_domains(topic.model, topic.pod);
                        tracing::info!(%source, model = %topic.model, pod = %topic.pod, domains, blocks, "pod expired: disconnected and silent");
                    }
                }
            }
        }
    }
}

async fn recv_loop(
    mut socket: SubSocket,
    source: String,
    dispatcher: Dispatcher,
    replay: Option<Arc<str>>,
) {
    let warn = RateLimited::new(Duration::from_secs(10));
    loop {
        match socket.recv().await {
            Ok(msg) => dispatcher.dispatch(msg, &source, replay.as_ref()),
            Err(e) => {
                dispatcher.receive_error(&source, &e, &warn);
                tokio::task::yield_now().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(frames: Vec<&[u8]>) -> ZmqMessage {
        ZmqMessage::try_from(
            frames
                .into_iter()
                .map(Bytes::copy_from_slice)
                .collect::<Vec<_>>(),
        )
        .unwrap()
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

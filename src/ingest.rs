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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indexer::stream::StreamLimits;
use indexer::Indexer;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::dial::{DialContext, Dialer};
use crate::dispatch::{Connections, Dispatcher, LastTopic, Source};
use crate::metrics::Metrics;
use crate::owners::Owners;
use crate::ratelimit::RateLimited;
use crate::worker::{Work, Worker, WorkerConfig};
use crate::zmq_io::{self, ReceiveLimits};

/// Control messages queued per worker (replay replies, connection changes,
/// `RemovePod`, `RecordRouting`, evictions, adoptions).
const CONTROL_QUEUE: usize = 4096;

/// `RemovePod`, executed by the worker that owns the pod.
#[derive(Clone)]
pub struct Control {
    workers: Arc<Vec<flume::Sender<Work>>>,
    owners: Arc<Owners>,
}

impl Control {
    /// Forgets every DP rank of `pod`; returns (cache domains, blocks).
    pub async fn remove_pod(&self, model: &str, pod: &str) -> (usize, u64) {
        let (reply, answer) = tokio::sync::oneshot::channel();
        // A pod no worker has a stream of may still be in the index (its
        // streams expired, or refused): any worker removes it.
        let owner = self.owners.find(pod, model).unwrap_or(0);
        let work = Work::Remove {
            model: model.to_owned(),
            pod: pod.to_owned(),
            reply,
        };
        if self.workers[owner].send_async(work).await.is_err() {
            return (0, 0);
        }
        answer.await.unwrap_or((0, 0))
    }

    /// `RecordRouting`: hands the routing to the pod's writer and waits for
    /// it to be recorded (so the next `Score` sees it). `None` if the
    /// ingest workers are gone.
    pub async fn record(
        &self,
        routing: indexer::routing::tracker::Routing,
        approximate: bool,
    ) -> Option<crate::worker::RecordReply> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let pod = crate::feedback::topic_pod(&routing.pod);
        let owner = self.owners.owner(pod, &routing.model);
        let work = Work::Record {
            routing,
            approximate,
            reply,
        };
        self.workers[owner].send_async(work).await.ok()?;
        answer.await.ok()
    }

    /// A routing another replica accepted, to its pod's writer here (a pod
    /// the index has: the caller checks); false when that worker's queue
    /// is full.
    pub fn speculate(
        &self,
        model: String,
        pod: String,
        keys: Vec<indexer::keys::BlockKey>,
        until: std::time::Instant,
    ) -> bool {
        let owner = self.owners.owner(crate::feedback::topic_pod(&pod), &model);
        let work = Work::Speculate {
            model,
            pod,
            keys,
            until,
        };
        self.workers[owner].try_send(work).is_ok()
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
    control: Control,
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
    #[error("--ingest-priority: cannot lower the ingest threads' CPU priority: {0}")]
    Priority(std::io::Error),
}

/// Starts `context`'s libzmq threads (its I/O thread and reaper, which
/// libzmq creates with the context's first socket) from a thread at the
/// ingest `priority`, so that they inherit it; fails if the system refuses
/// that priority.
fn start_context_threads(
    context: &zmq::Context,
    priority: crate::config::IngestPriority,
) -> Result<(), IngestError> {
    if priority == crate::config::IngestPriority::Normal {
        return Ok(());
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            crate::priority::apply(priority).map_err(IngestError::Priority)?;
            context.socket(zmq::PAIR).map_err(IngestError::Socket)?;
            tracing::info!(?priority, "ingest threads run at a lower CPU priority");
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err(IngestError::Thread(std::io::Error::other("panicked"))))
    })
}

impl Ingest {
    /// Binds (if configured; failure is fatal) and starts dialing pods (in
    /// the background; libzmq retries until they are up).
    pub async fn start(
        config: &Config,
        indexer: Arc<Indexer>,
        metrics: Arc<Metrics>,
        feedback: Arc<crate::feedback::Feedback>,
        owners: Arc<Owners>,
        first_catch_ups: Arc<crate::first_catch_ups::FirstCatchUps>,
    ) -> Result<Ingest, IngestError> {
        let context = zmq::Context::new();
        start_context_threads(&context, config.ingest_priority)?;
        let limits = ReceiveLimits {
            max_message_bytes: config.max_event_message_bytes,
            hwm: zmq_io::RECEIVE_HWM,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let dead = Arc::new(AtomicBool::new(false));
        // Replay fetches in flight at once (gap repairs and catch-ups): each
        // holds a socket and up to a replay buffer in memory.
        let replay_slots = Arc::new(tokio::sync::Semaphore::new(MAX_REPLAYS_IN_FLIGHT));
        // Every queue exists before any worker starts: each worker sends to
        // its own (replay results) and to the others (eviction requests).
        let (senders, receivers_of): (Vec<_>, Vec<_>) = (0..config.ingest_workers)
            .map(|_| flume::bounded(config.ingest_queue))
            .unzip();
        let senders = Arc::new(senders);
        // Control work is small and rare (catch-ups are bounded by the
        // replays in flight): its own bound, whatever the data queues'.
        let (controls, control_of): (Vec<_>, Vec<_>) = (0..config.ingest_workers)
            .map(|_| flume::bounded(CONTROL_QUEUE))
            .unzip();
        let controls = Arc::new(controls);
        let budget = Arc::new(crate::worker::QueueBudget::new(
            config.ingest_workers,
            config.ingest_queue_bytes,
        ));
        let worker_config = Arc::new(WorkerConfig {
            replay_endpoints: config.replay_endpoints.clone(),
            replay_timeout: config.replay_timeout,
            context: context.clone(),
            limits,
            replay_slots: replay_slots.clone(),
            stream_limits: StreamLimits {
                expiry: config.pod_expiry,
                ..StreamLimits::default()
            },
            workers: senders.clone(),
            control: controls.clone(),
            evict_pending: Arc::new(AtomicBool::new(false)),
            feedback,
            queue_budget: budget.clone(),
            owners: owners.clone(),
        });
        let mut workers = Vec::with_capacity(config.ingest_workers);
        for (i, (rx, control)) in receivers_of.into_iter().zip(control_of).enumerate() {
            let indexer = indexer.clone();
            let metrics = metrics.clone();
            let (stop, dead) = (stop.clone(), dead.clone());
            let worker_config = worker_config.clone();
            let runtime = tokio::runtime::Handle::current();
            let priority = config.ingest_priority;
            let handle = std::thread::Builder::new()
                .name(format!("ingest-{i}"))
                .spawn(move || {
                    crate::priority::apply_or_warn(priority);
                    Worker::new(&indexer, &metrics, &worker_config, runtime, i)
                        .run(rx, control, &stop, &dead)
                })
                .map_err(IngestError::Thread)?;
            workers.push(handle);
        }
        // Pods restored from a snapshot: each owner looks after its own
        // (they expire like any other pod that never comes back). In bind
        // mode readiness waits for each one's replay buffer, where it has
        // a replay endpoint.
        for pod in indexer.list_pod_handles() {
            let owner = owners.owner(&pod.topic_pod, &pod.model);
            let first = first_catch_ups.track_restored();
            let _ = controls[owner].send_async(Work::Adopt(pod, first)).await;
        }
        if first_catch_ups.waits_for_restored() {
            first_catch_ups.listed();
        }
        let dispatcher = Dispatcher {
            workers: senders.clone(),
            owners: owners.clone(),
            budget,
            control: controls.clone(),
            metrics: metrics.clone(),
            warn: Arc::new(RateLimited::new(Duration::from_secs(10))),
            dropped: Arc::new(RateLimited::new(Duration::from_secs(10))),
            topic_filter: bytes::Bytes::from(config.topic_filter.clone()),
            topicless_model: config.topicless_model.as_deref().map(Arc::from),
        };
        let control = Control {
            workers: controls,
            owners,
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
            // Every topic: an empty one (SGLang's default) is refused by
            // name and counted, not filtered out unseen; the dispatcher
            // applies `--topic-filter`.
            socket.set_subscribe(b"").map_err(IngestError::Socket)?;
            let monitor =
                zmq_io::monitor(&context, &socket, "bind").map_err(IngestError::Socket)?;
            socket
                .bind(endpoint)
                .map_err(|e| IngestError::Bind(zmq_io::bind_error(endpoint, e)))?;
            let actual = zmq_io::last_endpoint(&socket).map_err(IngestError::Socket)?;
            tracing::info!(endpoint = %actual, topic_filter = %config.topic_filter, max_event_message = config.max_event_message_bytes, "ZeroMQ SUB socket bound; pods can connect");
            bound = Some(actual.clone());
            let (d, stop) = (dispatcher.clone(), stop.clone());
            let priority = config.ingest_priority;
            receivers.push(
                std::thread::Builder::new()
                    .name("zmq-bind".into())
                    .spawn(move || {
                        crate::priority::apply_or_warn(priority);
                        bind_loop(&socket, &monitor, &actual, &d, &stop)
                    })
                    .map_err(IngestError::Thread)?,
            );
        }
        let dialer = Arc::new(
            Dialer::start(
                DialContext {
                    context,
                    replay_slots,
                    limits,
                    dispatcher,
                    runtime: tokio::runtime::Handle::current(),
                    priority: config.ingest_priority,
                    first_catch_ups,
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
            control,
        })
    }

    /// `RemovePod`'s way to the pods' workers.
    pub fn control(&self) -> Control {
        self.control.clone()
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
    let mut conns = Connections::default();
    let mut last_topic = LastTopic::default();
    while !stop.load(Ordering::Relaxed) {
        let mut items = [
            socket.as_poll_item(zmq::POLLIN),
            monitor.as_poll_item(zmq::POLLIN),
        ];
        // The timeout only bounds how late `stop` is seen.
        if zmq::poll(&mut items, 100).is_err() {
            continue;
        }
        // Connection events first: a message from a connection accepted on
        // a reused fd must not be taken for the closed one's.
        for event in zmq_io::drain_monitor(monitor) {
            match event.event {
                zmq::SocketEvent::ACCEPTED => {
                    dispatcher.connection_opened();
                    conns.accepted(i64::from(event.value));
                }
                zmq::SocketEvent::DISCONNECTED => {
                    dispatcher.connection_closed();
                    if let Some(conn) = conns.closed(i64::from(event.value)) {
                        dispatcher.connection(conn, false);
                    }
                }
                _ => {}
            }
        }
        dispatcher.receive_burst(
            socket,
            BURST,
            source,
            Source::Bound(&mut conns),
            &warn,
            &mut last_topic,
            |_| {},
        );
    }
}

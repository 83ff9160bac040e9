//! Dial mode: one thread owns a SUB socket per pod it dials (libzmq
//! reconnects each by itself), waits on an epoll set of their `ZMQ_FD`s,
//! and hands the messages of the sockets that have some to the dispatcher.
//!
//! Discovery tells it which pods to dial ([`Dialer::reconcile`]); the
//! thread connects new targets, closes the ones no longer listed, and runs
//! a catch-up replay each time a connection comes up (first connect and
//! every reconnect). Each socket is one connection to the workers: when it
//! goes down (or is closed because discovery dropped the pod) they are
//! told, and they forget its pods after `--pod-expiry` unless it comes back.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use indexer::topic::parse_topic;

use crate::config::DialTarget;
use crate::dispatch::{Dispatcher, LastTopic, Source};
use crate::first_catch_ups::{FirstCatchUps, Pending};
use crate::ratelimit::RateLimited;
use crate::worker::ConnId;
use crate::zmq_io::{self, ReceiveLimits};

/// What the dial thread needs besides its targets.
pub struct DialContext {
    /// For replay sockets (the dial sockets get contexts of their own, see
    /// [`ContextPool`]).
    pub context: zmq::Context,
    /// Replay fetches in flight at once, shared with the workers' repairs.
    pub replay_slots: Arc<tokio::sync::Semaphore>,
    pub limits: ReceiveLimits,
    pub dispatcher: Dispatcher,
    pub runtime: tokio::runtime::Handle,
    /// `--ingest-priority`, for this thread (and so for its contexts').
    pub priority: crate::config::IngestPriority,
    /// What readiness waits for after a restored start.
    pub first_catch_ups: Arc<FirstCatchUps>,
}

/// Handle to the dial thread: hands it target lists; the thread ends when
/// ingestion's `stop` flag is set, or when the last handle is dropped.
pub struct Dialer {
    commands: flume::Sender<Vec<DialTarget>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Dialer {
    pub fn start(ctx: DialContext, stop: Arc<AtomicBool>) -> std::io::Result<Dialer> {
        let (commands, rx) = flume::unbounded();
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("zmq-dial".into())
            .spawn(move || {
                // Its contexts' libzmq threads inherit this.
                crate::priority::apply_or_warn(ctx.priority);
                run(ctx, &rx, &stopping)
            })?;
        Ok(Dialer {
            commands,
            stop,
            thread: Some(thread),
        })
    }

    /// Dial exactly `desired`: connect new targets, close dropped ones.
    pub fn reconcile(&self, desired: Vec<DialTarget>) {
        let _ = self.commands.send(desired);
    }
}

impl Drop for Dialer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One dialed pod.
struct Dialed {
    socket: zmq::Socket,
    monitor: zmq::Socket,
    replay: Option<Arc<str>>,
    /// Topics seen on this socket (copied once each, not per message):
    /// what a catch-up reports on even when the buffer is empty.
    seen: HashSet<Vec<u8>>,
    /// What the workers know this socket's connection by.
    conn: ConnId,
    last_topic: LastTopic,
    /// Counted in `kv_indexer_zmq_connections` now.
    connected: bool,
    /// Which of the pool's contexts its sockets live in.
    context_slot: usize,
    /// Dialed at a restored start: readiness waits for its first catch-up.
    first: Option<Arc<Pending>>,
    /// `pod=`/`model=`: the topic every message here goes by.
    named: Option<Bytes>,
}

/// libzmq allows 1,023 sockets per context by default (`ZMQ_MAX_SOCKETS`,
/// which the `zmq` crate cannot change without `unsafe`), and each dialed
/// pod takes three (its SUB, the monitor's two ends). Dialed pods are
/// spread over as many contexts as that takes (each with one I/O thread).
struct ContextPool {
    contexts: Vec<(zmq::Context, usize)>,
}

const PODS_PER_CONTEXT: usize = 300;

impl ContextPool {
    fn acquire(&mut self) -> (usize, zmq::Context) {
        let slot = match self
            .contexts
            .iter()
            .position(|(_, n)| *n < PODS_PER_CONTEXT)
        {
            Some(slot) => slot,
            None => {
                self.contexts.push((zmq::Context::new(), 0));
                self.contexts.len() - 1
            }
        };
        self.contexts[slot].1 += 1;
        (slot, self.contexts[slot].0.clone())
    }

    fn release(&mut self, slot: usize) {
        if let Some((_, n)) = self.contexts.get_mut(slot) {
            *n = n.saturating_sub(1);
        }
    }
}

const RETRY_OPEN: Duration = Duration::from_secs(5);

/// Topics remembered per dialed pod.
const MAX_TOPICS_PER_POD: usize = 64;

/// Messages read from one socket before the others get their turn.
const BURST: usize = 1024;

/// A full replay buffer (10,000 batches by default) can take a while.
const REPLAY_ON_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

fn run(ctx: DialContext, commands: &flume::Receiver<Vec<DialTarget>>, stop: &AtomicBool) {
    let mut poll = match mio::Poll::new() {
        Ok(poll) => poll,
        Err(e) => {
            tracing::error!(error = %e, "cannot create the dial thread's epoll set: dial mode is off");
            return;
        }
    };
    let mut events = mio::Events::with_capacity(1024);
    let mut dialed: Vec<(DialTarget, Dialed)> = Vec::new();
    // Which entry of `dialed` a connection id is (rebuilt when it changes).
    let mut position: HashMap<ConnId, usize> = HashMap::new();
    // Sockets to read now: their fd fired, or they had more to give.
    let mut ready: Vec<Token> = Vec::new();
    let warn = RateLimited::new(Duration::from_secs(10));
    let mut pool = ContextPool {
        contexts: Vec::new(),
    };
    let mut desired: Vec<DialTarget> = Vec::new();
    let mut last_retry = Instant::now();
    let mut opened = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let changed = commands.try_iter().last();
        // A target that could not be opened is tried again every 5 s.
        let retry = dialed.len() < desired.len() && last_retry.elapsed() >= RETRY_OPEN;
        if changed.is_some() || retry {
            if let Some(list) = changed {
                desired = list;
            }
            last_retry = Instant::now();
            reconcile(
                &ctx,
                &mut pool,
                &mut dialed,
                &desired,
                &mut opened,
                poll.registry(),
            );
            ctx.first_catch_ups.listed();
            for (_, d) in &dialed {
                // A new socket's fd may have fired before it was registered.
                if !position.contains_key(&d.conn) {
                    ready.extend([Token::Socket(d.conn), Token::Monitor(d.conn)]);
                }
            }
            position = dialed
                .iter()
                .enumerate()
                .map(|(i, (_, d))| (d.conn, i))
                .collect();
        }
        // Nothing waits while a socket has more to give.
        let timeout = if ready.is_empty() { 100 } else { 0 };
        if let Err(e) = poll.poll(&mut events, Some(Duration::from_millis(timeout))) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                warn.warn(|_| tracing::warn!(error = %e, "dial thread: epoll wait failed"));
            }
            continue;
        }
        for event in &events {
            let token = Token::from(event.token());
            if !ready.contains(&token) {
                ready.push(token);
            }
        }
        // Each ready socket is read once per round (a burst at most), so a
        // busy pod cannot starve the others; those with more stay ready.
        ready.retain(|token| {
            let Some(&i) = position.get(&token.conn()) else {
                return false;
            };
            let (target, d) = &mut dialed[i];
            match token {
                Token::Socket(_) => {
                    receive_burst(&ctx, target, d, &warn);
                    has_input(&d.socket)
                }
                Token::Monitor(_) => {
                    for event in zmq_io::drain_monitor(&d.monitor) {
                        on_event(&ctx, target, d, &event);
                    }
                    has_input(&d.monitor)
                }
            }
        });
    }
}

/// A dialed socket or its monitor, as the epoll set names it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Token {
    Socket(ConnId),
    Monitor(ConnId),
}

impl Token {
    fn conn(self) -> ConnId {
        match self {
            Token::Socket(c) | Token::Monitor(c) => c,
        }
    }
}

impl From<Token> for mio::Token {
    fn from(t: Token) -> mio::Token {
        match t {
            Token::Socket(c) => mio::Token((c as usize) << 1),
            Token::Monitor(c) => mio::Token((c as usize) << 1 | 1),
        }
    }
}

impl From<mio::Token> for Token {
    fn from(t: mio::Token) -> Token {
        let conn = (t.0 >> 1) as ConnId;
        if t.0 & 1 == 0 {
            Token::Socket(conn)
        } else {
            Token::Monitor(conn)
        }
    }
}

/// Whether libzmq has a message for us on `socket`. Asked after every read:
/// a socket's `ZMQ_FD` only signals that its state may have changed, once,
/// so what it holds is known from `ZMQ_EVENTS` alone (libzmq's rule for
/// event loops), and a socket left with input is read again without a wait.
fn has_input(socket: &zmq::Socket) -> bool {
    socket.get_events().is_ok_and(|e| e.contains(zmq::POLLIN))
}

/// Adds a dialed pod's socket and monitor to the epoll set, by their
/// `ZMQ_FD`s (edge-triggered, as libzmq's signaller is).
fn register(registry: &mio::Registry, d: &Dialed) -> std::io::Result<()> {
    for (socket, token) in [
        (&d.socket, Token::Socket(d.conn)),
        (&d.monitor, Token::Monitor(d.conn)),
    ] {
        let fd = socket.get_fd().map_err(std::io::Error::other)?;
        registry.register(
            &mut mio::unix::SourceFd(&fd),
            token.into(),
            mio::Interest::READABLE,
        )?;
    }
    Ok(())
}

/// Takes a pod's sockets out of the epoll set before they close (a closed
/// fd's number can come back as another socket's).
fn deregister(registry: &mio::Registry, d: &Dialed) {
    for socket in [&d.socket, &d.monitor] {
        if let Ok(fd) = socket.get_fd() {
            let _ = registry.deregister(&mut mio::unix::SourceFd(&fd));
        }
    }
}

fn reconcile(
    ctx: &DialContext,
    pool: &mut ContextPool,
    dialed: &mut Vec<(DialTarget, Dialed)>,
    desired: &[DialTarget],
    opened: &mut u64,
    registry: &mio::Registry,
) {
    let wanted: HashSet<&DialTarget> = desired.iter().collect();
    dialed.retain_mut(|(target, d)| {
        let keep = wanted.contains(target);
        if !keep {
            deregister(registry, d);
            pool.release(d.context_slot);
            tracing::info!(endpoint = %target.endpoint, "pod no longer listed: disconnecting; forgotten after --pod-expiry unless it comes back");
            // Closing the socket closes its monitor too: no event follows.
            if d.connected {
                ctx.dispatcher.connection_closed();
            }
            ctx.dispatcher.connection(d.conn, false);
        }
        keep
    });
    let mut have: HashSet<DialTarget> = dialed.iter().map(|(t, _)| t.clone()).collect();
    for target in desired {
        if !have.insert(target.clone()) {
            continue;
        }
        *opened += 1;
        let (slot, context) = pool.acquire();
        let dialing = open(ctx, target, *opened, &context, slot).map_err(|e| e.to_string());
        match dialing.and_then(|d| match register(registry, &d) {
            Ok(()) => Ok(d),
            Err(e) => {
                deregister(registry, &d);
                Err(format!("cannot watch its socket: {e}"))
            }
        }) {
            Ok(d) => {
                tracing::info!(endpoint = %target.endpoint, replay = ?target.replay, "dialing pod");
                dialed.push((target.clone(), d));
            }
            Err(e) => {
                pool.release(slot);
                tracing::error!(endpoint = %target.endpoint, error = %e, "cannot dial pod; retrying in 5 s")
            }
        }
    }
}

fn open(
    ctx: &DialContext,
    target: &DialTarget,
    n: u64,
    context: &zmq::Context,
    context_slot: usize,
) -> zmq::Result<Dialed> {
    let socket = context.socket(zmq::SUB)?;
    zmq_io::limit(&socket, ctx.limits)?;
    // Every topic: a named pod's is ignored (SGLang's is empty), and an
    // empty one from a pod not named is refused by name, not filtered out
    // unseen (the dispatcher applies `--topic-filter`).
    socket.set_subscribe(b"")?;
    let monitor = zmq_io::monitor(context, &socket, &format!("dial-{n}"))?;
    socket.connect(&target.endpoint)?;
    Ok(Dialed {
        socket,
        monitor,
        replay: target.replay.as_deref().map(Arc::from),
        seen: HashSet::new(),
        last_topic: LastTopic::default(),
        conn: crate::dispatch::new_conn_id(),
        connected: false,
        context_slot,
        first: ctx.first_catch_ups.track(),
        named: target.named.as_ref().map(|t| Bytes::from(t.clone())),
    })
}

fn receive_burst(ctx: &DialContext, target: &DialTarget, d: &mut Dialed, warn: &RateLimited) {
    let seen = &mut d.seen;
    ctx.dispatcher.receive_burst(
        &d.socket,
        BURST,
        &target.endpoint,
        Source::Dialed {
            conn: d.conn,
            replay: d.replay.as_ref(),
            named: d.named.as_ref(),
        },
        warn,
        &mut d.last_topic,
        |topic| {
            // One pod publishes one topic per model it serves; a peer
            // inventing topics must not grow this set.
            if seen.len() < MAX_TOPICS_PER_POD
                && !seen.contains(topic)
                && parse_topic(topic).is_ok()
            {
                seen.insert(topic.to_vec());
            }
        },
    );
}

fn on_event(ctx: &DialContext, target: &DialTarget, d: &mut Dialed, event: &zmq_io::MonitorEvent) {
    match event.event {
        zmq::SocketEvent::CONNECTED => {
            tracing::info!(endpoint = %target.endpoint, "connected to pod");
            if !d.connected {
                d.connected = true;
                ctx.dispatcher.connection_opened();
            }
            ctx.dispatcher.connection(d.conn, true);
            // Without a replay endpoint there is nothing to catch up from.
            let first = d.first.take();
            if let Some(endpoint) = d.replay.clone() {
                catch_up(
                    ctx,
                    endpoint,
                    d.seen.iter().cloned().collect(),
                    d.conn,
                    first,
                    d.named.clone(),
                );
            }
        }
        zmq::SocketEvent::DISCONNECTED => {
            tracing::info!(endpoint = %target.endpoint, "pod connection lost; libzmq reconnects");
            if d.connected {
                d.connected = false;
                ctx.dispatcher.connection_closed();
            }
            ctx.dispatcher.connection(d.conn, false);
        }
        _ => {}
    }
}

/// Catches up with what the pod did before this connection came up (it
/// may stay idle for a long time): its whole replay buffer, fetched off
/// this thread. `seen`: the topics this socket carried so far; `first`:
/// held until the workers applied it (see `first_catch_ups`).
fn catch_up(
    ctx: &DialContext,
    endpoint: Arc<str>,
    seen: Vec<Vec<u8>>,
    conn: ConnId,
    first: Option<Arc<Pending>>,
    named: Option<Bytes>,
) {
    let (context, limits, dispatcher) = (ctx.context.clone(), ctx.limits, ctx.dispatcher.clone());
    let slots = ctx.replay_slots.clone();
    let runtime = ctx.runtime.clone();
    ctx.runtime.spawn(async move {
        // Bounded: a flapping pod, or a thousand connecting at once, must
        // not stack up fetches (each may bring a whole replay buffer).
        let Ok(_slot) = slots.acquire_owned().await else {
            return;
        };
        let fetched = runtime
            .spawn_blocking(move || {
                crate::replay::fetch(&context, &endpoint, 0, REPLAY_ON_CONNECT_TIMEOUT, limits)
                    .map(|items| (endpoint, items))
            })
            .await;
        match fetched {
            Ok(Ok((endpoint, mut items))) => {
                // A named pod's buffer is its own, whatever its topic.
                if let Some(named) = named {
                    for item in &mut items {
                        item.topic = Some(named.clone());
                    }
                }
                let _ = tokio::task::spawn_blocking(move || {
                    dispatcher.catch_up(&endpoint, items, &seen, conn, first)
                })
                .await;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "catch-up replay failed; relying on gap repair")
            }
            Err(e) => tracing::warn!(error = %e, "catch-up task failed"),
        }
    });
}

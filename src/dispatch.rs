//! From a socket's message to the worker that owns its topic: the shape
//! checks (three frames, a topic some worker owns, an 8-byte seq), the
//! owner, and the offer to its bounded queue (`worker::offer_live`). The
//! receive loops of both modes (`ingest`'s bind loop, `dial`'s poll loop)
//! hand every message through a [`Dispatcher`]; neither waits on index work.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use crate::metrics::Metrics;
use crate::owners::Owners;
use crate::ratelimit::RateLimited;
use crate::worker::{ConnId, Frame, Work};
use crate::zmq_io;

/// Why a ZeroMQ message failed the shape checks. Counted, logged
/// (rate-limited), skipped. (Undecodable payloads are counted by the worker.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameProblem {
    FrameCount,
    Topic,
    Seq,
    /// An empty topic (SGLang's default) from a pod its dial target does
    /// not name: nothing tells which pod sent it.
    NoTopic,
    /// A topic outside `--topic-filter`.
    Filtered,
}

impl FrameProblem {
    fn label(self) -> &'static str {
        match self {
            FrameProblem::FrameCount => "frame_count",
            FrameProblem::Topic => "topic",
            FrameProblem::Seq => "seq",
            FrameProblem::NoTopic => "no_topic",
            FrameProblem::Filtered => "filtered",
        }
    }
}

/// Checks `[topic, seq (8-byte big-endian), payload]` (`None`: another
/// number of frames); returns the frame and the index of the worker that
/// owns its pod. The payload is copied, the topic only when it is not the
/// socket's last one.
fn check_frames(
    frames: Option<[&[u8]; 3]>,
    conn: ConnId,
    owners: &Owners,
    last_topic: &mut LastTopic,
) -> Result<(Frame, usize), FrameProblem> {
    let [topic, seq, payload] = frames.ok_or(FrameProblem::FrameCount)?;
    let seq: [u8; 8] = seq.try_into().map_err(|_| FrameProblem::Seq)?;
    let owner = owner_of_topic(owners, topic).ok_or(FrameProblem::Topic)?;
    Ok((
        Frame {
            topic: last_topic.get(topic),
            seq: u64::from_be_bytes(seq),
            payload: Bytes::copy_from_slice(payload),
            replay: None,
            conn,
            named: false,
        },
        owner,
    ))
}

/// The last topic a socket carried, shared by the frames that repeat it
/// (a pod publishes one topic per model: nearly every message repeats).
#[derive(Default)]
pub struct LastTopic(Option<Bytes>);

impl LastTopic {
    fn repeats(&self, topic: &[u8]) -> bool {
        self.0.as_deref() == Some(topic)
    }

    /// `topic` as shared bytes, copied only if it is not the last one.
    fn get(&mut self, topic: &[u8]) -> Bytes {
        match &self.0 {
            Some(last) if last[..] == *topic => last.clone(),
            _ => {
                let bytes = Bytes::copy_from_slice(topic);
                self.0 = Some(bytes.clone());
                bytes
            }
        }
    }
}

/// Connection ids, unique for the process's life.
static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

pub fn new_conn_id() -> ConnId {
    NEXT_CONN.fetch_add(1, Ordering::Relaxed)
}

/// Which connection a message came on. The bind socket serves every pod
/// that connects: libzmq tags each received message with its connection's
/// file descriptor (the `__fd` metadata property, what `ZMQ_SRCFD` reads),
/// and its monitor reports each accept and disconnect with the fd; a fd
/// that is closed and reused by a new connection gets a new id.
#[derive(Default)]
pub struct Connections {
    /// Each connection's id, and (`--topicless-model`) the topic its
    /// messages without one go by, once the first of them named its peer.
    by_fd: HashMap<i64, (ConnId, Option<Bytes>)>,
}

impl Connections {
    pub fn accepted(&mut self, fd: i64) -> ConnId {
        let id = new_conn_id();
        self.by_fd.insert(fd, (id, None));
        id
    }

    pub fn closed(&mut self, fd: i64) -> Option<ConnId> {
        self.by_fd.remove(&fd).map(|(id, _)| id)
    }

    fn of(&mut self, fd: i64) -> ConnId {
        match self.by_fd.get(&fd) {
            Some((id, _)) => *id,
            None => self.accepted(fd),
        }
    }

    /// The topic a topic-less message on `fd` goes by: `kv@<peer
    /// address>@<model>`, the address read once per connection (`peer`).
    fn topicless(
        &mut self,
        fd: i64,
        model: &str,
        peer: impl FnOnce() -> Option<String>,
    ) -> Option<Bytes> {
        self.of(fd);
        let (_, named) = self.by_fd.get_mut(&fd).expect("just added");
        if named.is_none() {
            let topic = format!("kv@{}@{model}", peer()?);
            // Bounded and checked as any topic (an address is short).
            indexer::topic::parse_topic(topic.as_bytes()).ok()?;
            *named = Some(Bytes::from(topic));
        }
        named.clone()
    }
}

/// Where a receive loop's messages come from.
pub enum Source<'a> {
    /// A dialed socket: one connection, the pod's replay endpoint, and the
    /// topic every message goes by if the target names its pod.
    Dialed {
        conn: ConnId,
        replay: Option<&'a Arc<str>>,
        named: Option<&'a Bytes>,
    },
    /// The bind socket: many, told apart by fd.
    Bound(&'a mut Connections),
}

/// The worker that owns a topic's pod (assigned now if new); `None` for a
/// topic that is not `<prefix>@<pod>@<model>`.
fn owner_of_topic(owners: &Owners, topic: &[u8]) -> Option<usize> {
    let topic = indexer::topic::parse_topic(topic).ok()?;
    Some(owners.owner(topic.pod, topic.model))
}

/// Routes frames to workers by pod, so a pod always lands on the same one.
#[derive(Clone)]
pub struct Dispatcher {
    pub workers: Arc<Vec<flume::Sender<Work>>>,
    pub owners: Arc<Owners>,
    pub budget: Arc<crate::worker::QueueBudget>,
    /// The workers' control queues (connection changes).
    pub control: Arc<Vec<flume::Sender<Work>>>,
    pub metrics: Arc<Metrics>,
    pub warn: Arc<RateLimited>,
    pub dropped: Arc<RateLimited>,
    /// `--topic-filter`: sockets take every topic (to tell an empty one,
    /// which is refused by name, from another consumer's) and filter here.
    pub topic_filter: Bytes,
    /// `--topicless-model`: the model bound pods with an empty topic serve,
    /// each named by its address.
    pub topicless_model: Option<Arc<str>>,
}

impl Dispatcher {
    fn worker_for_topic(&self, topic: &[u8]) -> Option<&flume::Sender<Work>> {
        self.workers.get(owner_of_topic(&self.owners, topic)?)
    }

    /// Hands a pod's replay buffer (fetched on connect) to the workers that
    /// own its topics; topics seen on the connection that the buffer has
    /// nothing for get an empty catch-up (an empty buffer says the pod
    /// restarted). Runs off the receive threads, so it may wait for room in
    /// a queue: a catch-up is never dropped. `first` goes with each part.
    pub fn catch_up(
        &self,
        replay: &Arc<str>,
        items: Vec<crate::replay::Replayed>,
        seen: &[Vec<u8>],
        conn: ConnId,
        first: Option<Arc<crate::first_catch_ups::Pending>>,
    ) {
        let mut by_topic: HashMap<Bytes, Vec<crate::replay::Replayed>> = seen
            .iter()
            .map(|t| (Bytes::copy_from_slice(t), Vec::new()))
            .collect();
        for item in items {
            // The older two-frame form names no topic: the pod's first live
            // batch triggers its repair instead. Malformed topics find no
            // worker below.
            if let Some(topic) = item.topic.clone() {
                by_topic.entry(topic).or_default().push(item);
            }
        }
        for (topic, items) in by_topic {
            let Some(worker) = self.worker_for_topic(&topic) else {
                continue;
            };
            self.metrics.replays_requested.inc();
            let _ = worker.send(Work::CatchUp {
                topic,
                replay: replay.clone(),
                items,
                conn,
                first: first.clone(),
            });
        }
    }

    /// Tells every worker that a connection went up or down. Waits for room
    /// (rare, and a lost "down" would keep a departed pod forever).
    pub fn connection(&self, conn: ConnId, up: bool) {
        for worker in self.control.iter() {
            let _ = worker.send(Work::Connection { conn, up });
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
    /// and dispatches each; `new_topic` sees each first frame that is not
    /// the socket's last topic (dial mode notes the pod's topics).
    #[allow(clippy::too_many_arguments)]
    pub fn receive_burst(
        &self,
        socket: &zmq::Socket,
        burst: usize,
        label: &str,
        mut source: Source<'_>,
        warn: &RateLimited,
        last_topic: &mut LastTopic,
        mut new_topic: impl FnMut(&[u8]),
    ) {
        let want_fd = matches!(source, Source::Bound(_));
        for _ in 0..burst {
            match zmq_io::recv_message(socket, zmq::DONTWAIT, want_fd) {
                Ok(mut received) => {
                    // A bound pod with no topic, named by its address.
                    let mut by_address = None;
                    if let (Source::Bound(conns), Some(model), Some(fd)) =
                        (&mut source, &self.topicless_model, received.fd)
                    {
                        if received.count == 3 && received.parts[0].is_empty() {
                            by_address = conns.topicless(i64::from(fd), model, || {
                                received.parts[0].gets("Peer-Address").map(str::to_owned)
                            });
                        }
                    }
                    let mut frames = received.three();
                    let given = match &source {
                        Source::Dialed { named, .. } => *named,
                        Source::Bound(_) => by_address.as_ref(),
                    };
                    let named = given.is_some();
                    if let (Some([topic, ..]), Some(n)) = (&mut frames, given) {
                        *topic = n;
                    }
                    if let (Some([topic, ..]), false) = (frames, named) {
                        if let Some(problem) = self.unusable_topic(topic) {
                            self.skip(label, problem);
                            continue;
                        }
                    }
                    if let Some([topic, ..]) = frames {
                        if !last_topic.repeats(topic) {
                            new_topic(topic);
                        }
                    }
                    let (conn, replay) = match &mut source {
                        Source::Dialed { conn, replay, .. } => (*conn, *replay),
                        Source::Bound(conns) => {
                            (conns.of(i64::from(received.fd.unwrap_or(-1))), None)
                        }
                    };
                    self.dispatch(frames, label, conn, replay, named, last_topic);
                }
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    self.receive_error(label, &e, warn);
                    return;
                }
            }
        }
    }

    fn dispatch(
        &self,
        frames: Option<[&[u8]; 3]>,
        source: &str,
        conn: ConnId,
        replay: Option<&Arc<str>>,
        named: bool,
        last_topic: &mut LastTopic,
    ) {
        self.metrics.messages_received.inc();
        match check_frames(frames, conn, &self.owners, last_topic) {
            Ok((mut frame, owner)) => {
                frame.replay = replay.cloned();
                frame.named = named;
                // Never wait on index work: a full queue (in messages or
                // bytes) drops, notes the drop for the owner, and the gap
                // is repaired through replay.
                if !crate::worker::offer_live(&self.workers, &self.budget, owner, frame) {
                    self.metrics.messages_dropped.inc();
                    self.dropped.warn(|suppressed| {
                        tracing::warn!(%source, suppressed, "ingest queue full: dropping ZeroMQ messages (raise --ingest-workers or --ingest-queue)")
                    });
                }
            }
            Err(problem) => self.skip(source, problem),
        }
    }

    /// Why a message of `topic` from a pod its dial target does not name
    /// cannot be taken, if it cannot.
    fn unusable_topic(&self, topic: &[u8]) -> Option<FrameProblem> {
        if topic.is_empty() {
            Some(FrameProblem::NoTopic)
        } else if !topic.starts_with(&self.topic_filter) {
            Some(FrameProblem::Filtered)
        } else {
            None
        }
    }

    fn skip(&self, source: &str, problem: FrameProblem) {
        self.metrics.skip_message(problem.label());
        match problem {
            // Not a peer's mistake: another consumer's topic.
            FrameProblem::Filtered => {}
            FrameProblem::NoTopic => self.warn.warn(|suppressed| {
                tracing::warn!(%source, suppressed, "skipping ZeroMQ messages with an empty topic (SGLang's default): nothing tells which pod sent them; dial the pod naming it (--zmq-connect tcp://POD:PORT,pod=NAME,model=MODEL), name pods connecting here by their address (--topicless-model MODEL), or have it publish on kv@POD@MODEL")
            }),
            _ => self.warn.warn(|suppressed| {
                tracing::warn!(%source, ?problem, suppressed, "skipping malformed ZeroMQ message")
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(frames: Vec<&[u8]>) -> Option<[&[u8]; 3]> {
        frames.try_into().ok()
    }

    #[test]
    fn frame_shape_is_checked() {
        let seq = 7u64.to_be_bytes();
        let owners = Owners::new(4);
        let mut last = LastTopic::default();
        let mut check = |frames| check_frames(frames, 1, &owners, &mut last).map(|(f, _)| f.seq);
        assert_eq!(check(msg(vec![b"kv@p@m", &seq, b"x"])), Ok(7));
        assert_eq!(
            check(msg(vec![b"kv@p@m", &seq])).err(),
            Some(FrameProblem::FrameCount)
        );
        assert_eq!(
            check(msg(vec![b"kv@p@m", b"1234", b"x"])).err(),
            Some(FrameProblem::Seq)
        );
        assert_eq!(
            check(msg(vec![b"kv-pod-model", &seq, b"x"])).err(),
            Some(FrameProblem::Topic)
        );
    }

    #[test]
    fn frames_that_repeat_the_last_topic_share_its_bytes() {
        let seq = 7u64.to_be_bytes();
        let owners = Owners::new(2);
        let mut last = LastTopic::default();
        let topic = |last: &mut LastTopic, t: &[u8]| {
            let (frame, _) = check_frames(msg(vec![t, &seq, b"x"]), 1, &owners, last).unwrap();
            frame.topic
        };
        let a = topic(&mut last, b"kv@a@m");
        let again = topic(&mut last, b"kv@a@m");
        assert_eq!(a.as_ptr(), again.as_ptr());
        let b = topic(&mut last, b"kv@b@m");
        assert_eq!(&b[..], b"kv@b@m");
        let a2 = topic(&mut last, b"kv@a@m");
        assert_eq!(&a2[..], b"kv@a@m");
        assert_ne!(
            a2.as_ptr(),
            a.as_ptr(),
            "a new copy once another topic came between"
        );
        // A malformed message leaves the last topic as it was.
        assert!(check_frames(msg(vec![b"kv@c@m", b"1", b"x"]), 1, &owners, &mut last).is_err());
        assert_eq!(topic(&mut last, b"kv@a@m").as_ptr(), a2.as_ptr());
    }
}

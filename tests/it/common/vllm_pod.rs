//! A stand-in for vLLM's `ZmqEventPublisher`, on libzmq as vLLM's pyzmq
//! is: a PUB socket for live batches and a ROUTER socket that replays its
//! buffer. It publishes a recorded stream's real payloads, byte for byte.
//!
//! Replay protocol (vLLM's legacy form, which every release answers): the
//! client's DEALER sends `["", start_seq (8 bytes, big-endian)]`; the ROUTER
//! answers every buffered batch with seq >= start_seq as
//! `[client, "", topic, seq, payload]` (vLLM >= 0.26; the old format has no
//! topic), then `[client, "", ("",) END_SEQ, ""]`.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use super::{
    batches_per_pod, free_port, load_expected, load_frames, zmq_context, Expected, Service,
    WARMUP_MODEL,
};

const END_SEQ: u64 = u64::MAX;

/// One batch as published: (topic, seq, payload).
pub type Batch = (Bytes, u64, Bytes);

/// How a pod is set up.
#[derive(Clone, Copy, Debug)]
pub struct PodOptions {
    /// Batches the replay buffer keeps (vLLM's default: 10,000).
    pub buffer: usize,
    /// Replies without the topic frame (vLLM < 0.26).
    pub old_format: bool,
    /// How long each replay reply waits before it is sent (a busy engine).
    pub reply_delay: Duration,
}

impl Default for PodOptions {
    fn default() -> Self {
        PodOptions {
            buffer: 10_000,
            old_format: false,
            reply_delay: Duration::ZERO,
        }
    }
}

pub struct VllmPod {
    publisher: kv_indexer::zmq_io::Publisher,
    buffer: Arc<Mutex<VecDeque<Batch>>>,
    capacity: usize,
    frames: Vec<Batch>,
    stop: Arc<AtomicBool>,
    router: Option<std::thread::JoinHandle<()>>,
    /// (PUB port, ROUTER port).
    ports: (u16, u16),
    /// `tcp://127.0.0.1:P,replay=tcp://127.0.0.1:R`, for `--zmq-connect`.
    pub target: String,
}

impl VllmPod {
    /// Pod `pod` of the recorded `stream`, bound on free ports.
    pub fn start(stream: &str, pod: &str, options: PodOptions) -> VllmPod {
        let frames = load_frames(stream)
            .into_iter()
            .filter(|f| f.topic.split('@').nth(1) == Some(pod))
            .map(|f| {
                (
                    Bytes::from(f.topic.clone()),
                    f.seq,
                    Bytes::from(f.payload.clone()),
                )
            })
            .collect();
        VllmPod::with_batches(frames, options)
    }

    /// A pod publishing `frames` (by position).
    pub fn with_batches(frames: Vec<Batch>, options: PodOptions) -> VllmPod {
        VllmPod::on_ports(frames, options, free_port(), free_port()).expect("bind on free ports")
    }

    /// The engine restarts on the same endpoints: its sockets close, its
    /// replay buffer starts empty, its seq at 0, and it publishes `frames`
    /// from now on.
    pub fn restart(self, frames: Vec<Batch>, options: PodOptions) -> VllmPod {
        let (p, r) = self.ports;
        drop(self);
        // libzmq closes listeners asynchronously: the ports free up soon.
        let deadline = std::time::Instant::now() + crate::common::budget(10);
        loop {
            match VllmPod::on_ports(frames.clone(), options, p, r) {
                Some(pod) => return pod,
                None if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                None => panic!("ports {p} and {r} stayed taken"),
            }
        }
    }

    /// This pod's recorded batches.
    pub fn frames(&self) -> &[Batch] {
        &self.frames
    }

    fn on_ports(frames: Vec<Batch>, options: PodOptions, p: u16, r: u16) -> Option<VllmPod> {
        let router = zmq_context().socket(zmq::ROUTER).expect("ROUTER");
        router.set_linger(0).unwrap();
        router.set_rcvtimeo(50).unwrap();
        router.bind(&format!("tcp://127.0.0.1:{r}")).ok()?;
        let (publisher, _) =
            kv_indexer::zmq_io::Publisher::bind(zmq_context(), &format!("tcp://127.0.0.1:{p}"))
                .ok()?;
        let buffer: Arc<Mutex<VecDeque<Batch>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (buffer, stop) = (buffer.clone(), stop.clone());
            std::thread::spawn(move || serve_replay(&router, &buffer, &stop, options))
        };
        Some(VllmPod {
            publisher,
            buffer,
            capacity: options.buffer,
            frames,
            stop,
            router: Some(thread),
            ports: (p, r),
            target: format!("tcp://127.0.0.1:{p},replay=tcp://127.0.0.1:{r}"),
        })
    }

    /// Recorded batches of this pod.
    pub fn batches(&self) -> usize {
        self.frames.len()
    }

    /// An empty batch on `kv@<name>@warmup-model` (not buffered).
    pub fn marker(&self, name: &str) {
        let empty = rmp_serde::to_vec(&(0.0f64, Vec::<u8>::new(), 0u32)).expect("encode");
        self.send(&(
            Bytes::from(format!("kv@{name}@{WARMUP_MODEL}")),
            0,
            Bytes::from(empty),
        ));
    }

    /// Publishes recorded batches `from..to` (by position); those whose seq
    /// is in `skip` are only buffered, as if PUB had dropped them.
    pub fn publish(&self, from: usize, to: usize, skip: &HashSet<u64>) {
        for batch in &self.frames[from..to] {
            {
                let mut buffer = self.buffer.lock().unwrap();
                buffer.push_back(batch.clone());
                while buffer.len() > self.capacity {
                    buffer.pop_front();
                }
            }
            if !skip.contains(&batch.1) {
                self.send(batch);
            }
        }
    }

    /// Sends recorded batch `at` (by position) again, without buffering it
    /// again (a publisher's retransmission, as a test's).
    pub fn resend(&self, at: usize) {
        self.send(&self.frames[at]);
    }

    fn send(&self, (topic, seq, payload): &Batch) {
        self.publisher
            .send(&[
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ])
            .expect("PUB send");
    }

    /// PUB drops everything until the subscription has arrived: publish a
    /// marker until the indexer lists it.
    pub async fn wait_subscribed(&self, service: &Service, marker: &str) {
        for _ in 0..200 {
            self.marker(marker);
            tokio::time::sleep(Duration::from_millis(50)).await;
            if service
                .list_pods(WARMUP_MODEL)
                .await
                .iter()
                .any(|p| p.pod == marker)
            {
                return;
            }
        }
        panic!("subscription never arrived");
    }
}

impl Drop for VllmPod {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.router.take() {
            let _ = thread.join();
        }
    }
}

fn serve_replay(
    router: &zmq::Socket,
    buffer: &Mutex<VecDeque<Batch>>,
    stop: &AtomicBool,
    options: PodOptions,
) {
    let old_format = options.old_format;
    while !stop.load(Ordering::Relaxed) {
        let Ok(request) = router.recv_multipart(0) else {
            continue; // timeout: check `stop`
        };
        let [client, _, start] = &request[..] else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        std::thread::sleep(options.reply_delay);
        let items: Vec<Batch> = buffer
            .lock()
            .unwrap()
            .iter()
            .filter(|b| b.1 >= start)
            .cloned()
            .collect();
        for (topic, seq, payload) in items {
            let seq = seq.to_be_bytes();
            let mut reply: Vec<&[u8]> = vec![client, b""];
            if !old_format {
                reply.push(&topic);
            }
            reply.extend([&seq[..], &payload[..]]);
            let _ = router.send_multipart(reply, 0);
        }
        let end = END_SEQ.to_be_bytes();
        let mut tail: Vec<&[u8]> = vec![client, b""];
        if !old_format {
            tail.push(b"");
        }
        tail.extend([&end[..], b""]);
        let _ = router.send_multipart(tail, 0);
    }
}

/// A recorded stream served by one publisher per pod.
pub struct Fleet {
    pub expected: Expected,
    /// Recorded batches per pod.
    pub per_pod: BTreeMap<String, u64>,
    pub pubs: Vec<(String, VllmPod)>,
}

impl Fleet {
    /// `extra(i)` gives pod i's flags.
    pub fn start(stream: &str, options: impl Fn(usize) -> PodOptions) -> Fleet {
        let expected = load_expected(stream);
        let pubs = expected
            .pods
            .iter()
            .enumerate()
            .map(|(i, pod)| (pod.clone(), VllmPod::start(stream, pod, options(i))))
            .collect();
        Fleet {
            per_pod: batches_per_pod(&load_frames(stream)),
            expected,
            pubs,
        }
    }

    /// What the indexer dials (`--zmq-connect`).
    pub fn targets(&self) -> Vec<String> {
        self.pubs.iter().map(|(_, p)| p.target.clone()).collect()
    }

    /// Waits until `service` receives every pod (markers `<tag>-<pod>`).
    pub async fn wait_subscribed(&self, service: &Service, tag: &str) {
        for (pod, p) in &self.pubs {
            p.wait_subscribed(service, &format!("{tag}-{pod}")).await;
        }
    }

    /// Each pod publishes its recorded batches `range(n)` (n: how many it
    /// has).
    pub fn publish(&self, range: impl Fn(u64) -> (u64, u64)) {
        for (pod, p) in &self.pubs {
            let (from, to) = range(self.per_pod[pod.as_str()]);
            p.publish(from as usize, to as usize, &HashSet::new());
        }
    }
}

//! `--peer dynamo`: the ingest and Score workloads against Dynamo's
//! standalone indexer (`dynamo-kv-router` 1.6.1, `services::indexer`, the
//! `peer-dynamo-indexer` binary of `peers/dynamo`) and against ours, in the
//! same run, taking turns step by step (ours, Dynamo, ours, Dynamo, ...) so
//! that the machine's drift hits both.
//!
//! Like for like:
//! - Both run as their own process on loopback, and both *dial* the pods:
//!   every simulated pod binds a ZeroMQ PUB socket per indexer (Dynamo
//!   only dials; ours runs with `--zmq-bind none --zmq-connect ...`).
//! - Both receive the same bytes: vLLM 0.33's msgpack batches
//!   `[ts, [event, ...], dp_rank]` with map events, which both decoders
//!   read, pre-encoded before a step starts, published by one thread per
//!   pod. Each indexer's pods get their own stream from the same seed, so
//!   the bytes match as long as both ran the same steps.
//! - Both hash token ids into their keys themselves (16-token blocks) and
//!   answer Score from token ids: ours over gRPC (`Score`, 8 HTTP/2
//!   connections), Dynamo over its HTTP `/query` (JSON token ids, HTTP/1.1
//!   keep-alive connections, one request in flight on each, as HTTP/1.1
//!   allows).
//!
//! Applied counts: ours from `ListPods` (stored + removed blocks per pod);
//! Dynamo's from its `/metrics` (`dynamo_kvrouter_kv_cache_events_applied`,
//! events by status). Every event of a step carries the same number of
//! blocks, so events applied `ok` times that number is its blocks applied.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_indexer::proto::kvindexer::v1 as pb;
use kv_indexer::zmq_io::Publisher;
use pb::kv_indexer_client::KvIndexerClient;
use serde_json::{json, Value};
use simulator::vllm_wire::{encode_batch, frames, WireEvent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::transport::Channel;

use super::{
    applied, connect, free_port, lcg, percentile, pods_named, random_tokens, score_step,
    store_batch, Opts, Spawned, Step, ZmqMessage, BLOCK, MODEL,
};

/// The binary `peers/dynamo` builds.
pub const BINARY: &str = "peer-dynamo-indexer";
/// Dynamo's event threads: its `ThreadPoolIndexer` with two, what its own
/// services and tests run and what the compare bench gives it; ours has
/// two ingest workers. Its CLI's default is one.
const DYNAMO_THREADS: usize = 2;

const INGEST_PODS: usize = 8;
const SCORE_PODS: usize = 64;
const PROMPT_BLOCKS: usize = 2048;
/// Blocks a pod holds before each batch also evicts as many as it stores
/// (its oldest request's blocks, last block first, as vLLM frees them):
/// bounds both indexes and makes removals as frequent as stores.
const KEEP_BLOCKS: usize = 16_384;
/// Dynamo's instance ids: ingest pods from here, score pods from
/// `SCORE_ID`.
const INGEST_ID: u64 = 1;
const SCORE_ID: u64 = 1000;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Ours,
    Dynamo,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Ours => "ours",
            Side::Dynamo => "dynamo",
        }
    }
}

const SIDES: [Side; 2] = [Side::Ours, Side::Dynamo];

/// One batch shape vLLM publishes, each over its own 8 pods (so that a
/// loss in one shape's steps cannot turn into removals of unknown blocks
/// in the next).
struct Shape {
    name: &'static str,
    /// Blocks each `BlockStored` carries (and each `BlockRemoved`, once the
    /// pod is full).
    blocks: usize,
    /// Blocks of one request: a new one starts (no parent) after that many.
    request: usize,
    /// Offered block operations (stored + removed) per second, in turn.
    rates: &'static [f64],
}

const SHAPES: [Shape; 3] = [
    // A decode step stores the one block a running request just filled,
    // chained to its previous block.
    Shape {
        name: "decode",
        blocks: 1,
        request: 128,
        rates: &[50e3, 100e3, 200e3, 400e3, 800e3],
    },
    // A chat turn: 16 new blocks on the conversation so far.
    Shape {
        name: "turn",
        blocks: 16,
        request: 128,
        rates: &[250e3, 500e3, 1e6, 2e6, 4e6],
    },
    // A 32K-token prompt's prefill in one step.
    Shape {
        name: "prefill",
        blocks: 2048,
        request: 2048,
        rates: &[500e3, 1e6, 2e6, 4e6],
    },
];

/// One simulated pod's stream: what it holds, its next seq, its random
/// state. Deterministic from its seed.
struct PodStream {
    name: String,
    seq: u64,
    rng: u64,
    /// Finished requests' blocks, oldest first.
    held: VecDeque<Vec<u64>>,
    held_blocks: usize,
    /// The running request's blocks.
    current: Vec<u64>,
}

impl PodStream {
    fn new(name: String, seed: u64) -> PodStream {
        PodStream {
            name,
            seq: 0,
            rng: seed,
            held: VecDeque::new(),
            held_blocks: 0,
            current: Vec::new(),
        }
    }

    /// Ends the running request (the next batch starts a new one).
    fn end_request(&mut self) {
        if !self.current.is_empty() {
            self.held.push_back(std::mem::take(&mut self.current));
        }
    }

    /// The next batch: `shape.blocks` stored on the running request (a new
    /// one when it is complete), and as many of the oldest blocks removed
    /// once the pod holds `KEEP_BLOCKS`. Returns the frames and the block
    /// operations it carries.
    fn batch(&mut self, shape: &Shape) -> (ZmqMessage, u64) {
        let n = shape.blocks;
        if self.current.len() >= shape.request {
            self.end_request();
        }
        let parent = self.current.last().copied();
        let hashes: Vec<u64> = (0..n).map(|_| lcg(&mut self.rng) << 17 | 1).collect();
        let tokens = random_tokens(&mut self.rng, n);
        let mut removed = Vec::new();
        if self.held_blocks + n > KEEP_BLOCKS {
            while removed.len() < n {
                let Some(oldest) = self.held.front_mut() else {
                    break;
                };
                match oldest.pop() {
                    Some(h) => removed.push(h),
                    None => {
                        self.held.pop_front();
                    }
                }
            }
        }
        self.held_blocks = self.held_blocks + n - removed.len();
        let ops = (n + removed.len()) as u64;
        let msg = store_batch(&self.name, self.seq, &hashes, parent, &tokens, &removed);
        self.seq += 1;
        self.current.extend_from_slice(&hashes);
        (msg, ops)
    }
}

// ---------------------------------------------------------------- processes

/// The two indexers under test and how to reach them.
struct Peers {
    _ours: Spawned,
    _dynamo: Spawned,
    ours: KvIndexerClient<Channel>,
    ours_grpc: String,
    ours_metrics: String,
    dynamo: Arc<Http>,
}

fn dynamo_binary(o: &Opts) -> PathBuf {
    let bin = o.peer_bin.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .expect("own path")
            .with_file_name(BINARY)
    });
    assert!(
        bin.exists(),
        "{} not found: build it first (cargo build --release --manifest-path peers/dynamo/Cargo.toml \
         --target-dir target), or name it with --peer-bin",
        bin.display()
    );
    bin
}

/// Starts ours in dial mode on `endpoints` and Dynamo with nothing
/// registered yet.
async fn start(o: &Opts, endpoints: &[String]) -> Peers {
    let exe = std::env::current_exe().expect("own path");
    let (grpc, metrics) = (free_port(), free_port());
    let mut ours = Command::new(exe.with_file_name("kv-indexer"));
    ours.args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .args(["--zmq-bind", "none"])
        .args(["--log-level", "warn"]);
    for e in endpoints {
        ours.args(["--zmq-connect", e]);
    }
    ours.args(&o.ours_args);
    let ours = Spawned(
        ours.env("HF_HUB_OFFLINE", "1")
            .stdout(Stdio::null())
            .spawn()
            .expect("start kv-indexer"),
    );
    let port = free_port();
    let dynamo = Spawned(
        Command::new(dynamo_binary(o))
            .args(["--addr", &format!("127.0.0.1:{port}")])
            .args(["--threads", &DYNAMO_THREADS.to_string()])
            .env("HF_HUB_OFFLINE", "1")
            .stdout(Stdio::null())
            .spawn()
            .expect("start peer-dynamo-indexer"),
    );
    let ours_grpc = format!("127.0.0.1:{grpc}");
    let client = connect(&ours_grpc).await;
    let http = Arc::new(Http::new(
        format!("127.0.0.1:{port}").parse().expect("address"),
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !matches!(http.get("/health").await, Ok((200, _))) {
        assert!(Instant::now() < deadline, "Dynamo's indexer not answering");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Peers {
        _ours: ours,
        _dynamo: dynamo,
        ours: client,
        ours_grpc,
        ours_metrics: format!("127.0.0.1:{metrics}"),
        dynamo: http,
    }
}

/// Registers a worker with Dynamo, as a Dynamo deployment does.
async fn register(http: &Http, instance_id: u64, endpoint: &str) {
    let body = json!({"instance_id": instance_id, "endpoint": endpoint,
        "model_name": MODEL, "block_size": BLOCK});
    let (status, reply) = http
        .post("/register", body.to_string().as_bytes())
        .await
        .expect("POST /register");
    assert_eq!(
        status,
        201,
        "register {instance_id}: {}",
        String::from_utf8_lossy(&reply)
    );
}

/// One bound PUB socket per pod and indexer: `[ours, dynamo]`.
struct Pods {
    names: Vec<String>,
    publishers: [Vec<Option<Publisher>>; 2],
    endpoints: [Vec<String>; 2],
}

fn bind_pods(context: &zmq::Context, names: Vec<String>) -> Pods {
    let mut publishers: [Vec<Option<Publisher>>; 2] = [Vec::new(), Vec::new()];
    let mut endpoints: [Vec<String>; 2] = [Vec::new(), Vec::new()];
    for side in 0..2 {
        for _ in &names {
            let (p, e) = Publisher::bind(context, "tcp://127.0.0.1:0").expect("bind PUB");
            publishers[side].push(Some(p));
            endpoints[side].push(e);
        }
    }
    Pods {
        names,
        publishers,
        endpoints,
    }
}

// -------------------------------------------------------------- Dynamo HTTP

/// A minimal HTTP/1.1 client for Dynamo's API: keep-alive connections
/// (`TCP_NODELAY`), one request in flight on each, idle ones reused.
struct Http {
    addr: SocketAddr,
    idle: parking_lot::Mutex<Vec<TcpStream>>,
}

fn http_request(method: &str, path: &str, body: &[u8]) -> bytes::Bytes {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nHost: peer\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r.into()
}

impl Http {
    fn new(addr: SocketAddr) -> Http {
        Http {
            addr,
            idle: parking_lot::Mutex::new(Vec::new()),
        }
    }

    async fn get(&self, path: &str) -> std::io::Result<(u16, Vec<u8>)> {
        self.send(&http_request("GET", path, b"")).await
    }

    async fn post(&self, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        self.send(&http_request("POST", path, body)).await
    }

    /// Opens `n` connections ahead of the load, so that requests do not pay
    /// a connect.
    async fn warm(&self, n: usize) -> std::io::Result<()> {
        let open = self.idle.lock().len();
        for _ in open..n {
            let s = self.open().await?;
            self.idle.lock().push(s);
        }
        Ok(())
    }

    async fn open(&self) -> std::io::Result<TcpStream> {
        let s = TcpStream::connect(self.addr).await?;
        s.set_nodelay(true)?;
        Ok(s)
    }

    /// Sends a request written whole by [`http_request`]; returns the
    /// status and the body (which must come with a `Content-Length`).
    async fn send(&self, request: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        let idle = self.idle.lock().pop();
        let mut s = match idle {
            Some(s) => s,
            None => self.open().await?,
        };
        s.write_all(request).await?;
        let bad =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
        let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
        let head_end = loop {
            if s.read_buf(&mut buf).await? == 0 {
                return Err(bad("connection closed before the response"));
            }
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
        };
        let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| bad("head not UTF-8"))?;
        let mut lines = head.split("\r\n");
        let status: u16 = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| bad("no status"))?;
        let mut length = None;
        let mut close = false;
        for l in lines {
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim(), v.trim());
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.parse::<usize>().ok();
                } else if k.eq_ignore_ascii_case("connection") {
                    close = v.eq_ignore_ascii_case("close");
                }
            }
        }
        let length = length.ok_or_else(|| bad("no Content-Length"))?;
        let start = head_end + 4;
        while buf.len() < start + length {
            if s.read_buf(&mut buf).await? == 0 {
                return Err(bad("connection closed inside the body"));
            }
        }
        if !close && buf.len() == start + length {
            self.idle.lock().push(s);
        }
        Ok((status, buf[start..start + length].to_vec()))
    }

    /// Dynamo's Prometheus text.
    async fn metrics(&self) -> String {
        let (status, body) = self.get("/metrics").await.expect("GET /metrics");
        assert_eq!(status, 200, "GET /metrics");
        String::from_utf8_lossy(&body).into_owned()
    }
}

/// Sum of a metric's samples whose labels contain every `label`.
fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Dynamo's applied events: `(ok, any other status)`.
async fn dynamo_events(http: &Http) -> (u64, u64) {
    const NAME: &str = "dynamo_kvrouter_kv_cache_events_applied";
    let text = http.metrics().await;
    let all = metric_sum(&text, NAME, &[]);
    let ok = metric_sum(&text, NAME, &["status=\"ok\""]);
    (ok as u64, (all - ok) as u64)
}

/// Dynamo's own time in `/query` so far (seconds, requests): its request
/// middleware, which includes reading and parsing the JSON body.
async fn dynamo_query_time(http: &Http) -> (f64, f64) {
    const NAME: &str = "dynamo_kvindexer_request_duration_seconds";
    let text = http.metrics().await;
    let on = ["endpoint=\"/query\""];
    (
        metric_sum(&text, &format!("{NAME}_sum"), &on),
        metric_sum(&text, &format!("{NAME}_count"), &on),
    )
}

// ------------------------------------------------------------------ ingest

/// Where a side's applied work is read, in the unit its counter counts:
/// block operations (ours) or events (Dynamo).
async fn progress(peers: &mut Peers, side: Side, prefix: &str) -> (u64, u64) {
    match side {
        Side::Ours => applied(&mut peers.ours, prefix).await,
        Side::Dynamo => dynamo_events(&peers.dynamo).await,
    }
}

struct IngestStep {
    sent_ops: u64,
    sent_seconds: f64,
    applied_ops: u64,
    seconds: f64,
    /// Ours: seq gaps; Dynamo: events applied with a status other than ok.
    faults: u64,
}

/// Publishes `batches` (per pod) to one side at `rate` block operations/s
/// in total, one thread per pod, and waits for the side to apply them (or
/// stop making progress for a second).
async fn ingest_step(
    peers: &mut Peers,
    side: Side,
    prefix: &str,
    publishers: &mut [Option<Publisher>],
    batches: Vec<Vec<(ZmqMessage, u64)>>,
    blocks_per_event: u64,
    rate: f64,
) -> IngestStep {
    let sent_ops: u64 = batches.iter().flatten().map(|(_, ops)| ops).sum();
    let sent_events: u64 = batches
        .iter()
        .flatten()
        .map(|(_, ops)| ops / blocks_per_event)
        .sum();
    // In the unit of the side's counter.
    let sent = match side {
        Side::Ours => sent_ops,
        Side::Dynamo => sent_events,
    };
    let (before, faults_before) = progress(peers, side, prefix).await;
    let per_pod = rate / batches.len() as f64;
    let start = Instant::now();
    let mut threads = Vec::new();
    for (slot, pod) in publishers.iter_mut().zip(batches) {
        let socket = slot.take().expect("publisher returned by its last step");
        threads.push(tokio::task::spawn_blocking(move || {
            let mut done = 0u64;
            for (msg, ops) in &pod {
                // Open loop: a batch leaves at (operations so far) / rate.
                let due = start + Duration::from_secs_f64(done as f64 / per_pod);
                let now = Instant::now();
                if due > now + Duration::from_micros(100) {
                    std::thread::sleep(due - now);
                }
                socket.send(msg).expect("publish");
                done += ops;
            }
            (socket, Instant::now())
        }));
    }
    let mut last_send = start;
    for (slot, t) in publishers.iter_mut().zip(threads) {
        let (socket, at) = t.await.expect("publisher thread");
        *slot = Some(socket);
        last_send = last_send.max(at);
    }
    let mut last = (before, Instant::now());
    let mut finished = start;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (now, _) = progress(peers, side, prefix).await;
        if now != last.0 {
            last = (now, Instant::now());
            finished = last.1;
        }
        if now - before >= sent
            || last.1.elapsed() > Duration::from_secs(1)
            || Instant::now() > deadline
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (after, faults_after) = progress(peers, side, prefix).await;
    let applied_ops = match side {
        Side::Ours => after - before,
        Side::Dynamo => (after - before) * blocks_per_event,
    };
    IngestStep {
        sent_ops,
        sent_seconds: (last_send - start).as_secs_f64(),
        applied_ops,
        seconds: (finished - start).as_secs_f64(),
        faults: faults_after - faults_before,
    }
}

/// Sends each pod's first batch (seq 0, one block) until every pod's is
/// applied: subscriptions reach a PUB socket asynchronously, and a re-sent
/// seq 0 is a duplicate both indexers skip.
async fn warm_up(peers: &mut Peers, side: Side, prefix: &str, pods: &Pods, first: &[ZmqMessage]) {
    let (base, _) = progress(peers, side, prefix).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for (p, msg) in pods.publishers[side as usize].iter().zip(first) {
            p.as_ref().expect("publisher").send(msg).expect("publish");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        // One block (ours) or one event (Dynamo) per pod.
        if progress(peers, side, prefix).await.0 - base >= first.len() as u64 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{}: pods never subscribed",
            side.name()
        );
    }
}

/// Rounds of refinement after the doubling ladder: each runs a side at the
/// geometric middle of the last rate it kept up with and the first it did
/// not, so the bracket narrows from 2x to 1.41x and then 1.19x (a ratio
/// between the sides that the doubling alone cannot show); a side that
/// kept up with the ladder's top goes 1.41x above it instead.
const REFINE_ROUNDS: usize = 2;

/// Pod sets per shape: the ladder's, then one fresh set per refinement
/// round (a side that lost batches leaves its pods' streams broken, so a
/// round never reuses them).
const POD_SETS: usize = 1 + REFINE_ROUNDS;

/// The names of a shape's pods of one set start with this (and no other
/// set's do: each side's applied counter is summed over it).
fn pod_prefix(shape: &Shape, set: usize) -> String {
    format!("peer-{}-s{set}-", shape.name)
}

/// Each side's pods of one set, as streams from the same seeds, warmed up
/// (both indexers have every pod's first batch).
async fn fresh_streams(
    peers: &mut Peers,
    prefix: &str,
    pods: &Pods,
    shape: &Shape,
    seed: u64,
) -> Vec<Vec<PodStream>> {
    let mut streams: Vec<Vec<PodStream>> = SIDES
        .iter()
        .map(|_| {
            pods.names
                .iter()
                .enumerate()
                .map(|(i, n)| PodStream::new(n.clone(), seed + i as u64))
                .collect()
        })
        .collect();
    let warm_shape = Shape {
        name: "warm-up",
        blocks: 1,
        request: shape.request,
        rates: &[],
    };
    for side in SIDES {
        let first: Vec<ZmqMessage> = streams[side as usize]
            .iter_mut()
            .map(|s| s.batch(&warm_shape).0)
            .collect();
        warm_up(peers, side, prefix, pods, &first).await;
    }
    for s in streams.iter_mut().flatten() {
        s.end_request();
    }
    streams
}

/// One side's step: `secs` of `shape` at `rate` from its streams.
struct Stepped {
    step: IngestStep,
    absorbed: f64,
    /// Nothing lost, no faults, and kept up (see `ingest`).
    kept_up: bool,
    row: Value,
}

#[allow(clippy::too_many_arguments)]
async fn side_step(
    peers: &mut Peers,
    side: Side,
    prefix: &str,
    pods: &mut Pods,
    streams: &mut [PodStream],
    shape: &Shape,
    rate: f64,
    secs: f64,
) -> Stepped {
    let s = side as usize;
    let per_pod_ops = rate * secs / INGEST_PODS as f64;
    let batches: Vec<Vec<(ZmqMessage, u64)>> = streams
        .iter_mut()
        .map(|pod| {
            let mut out = Vec::new();
            let mut ops = 0u64;
            while (ops as f64) < per_pod_ops {
                let b = pod.batch(shape);
                ops += b.1;
                out.push(b);
            }
            out
        })
        .collect();
    let r = ingest_step(
        peers,
        side,
        prefix,
        &mut pods.publishers[s],
        batches,
        shape.blocks as u64,
        rate,
    )
    .await;
    let absorbed = r.applied_ops as f64 / r.seconds.max(1e-9);
    let lost = r.sent_ops.saturating_sub(r.applied_ops);
    // A step's absorbed rate includes the last batch's own latency, so
    // keeping up reads as 0.9-1.0x: well under that is falling behind.
    let kept_up = lost == 0 && r.faults == 0 && absorbed >= 0.8 * rate;
    let mut row = json!({"shape": shape.name, "blocks_per_event": shape.blocks,
        "side": side.name(), "offered_blocks_per_s": rate,
        "sent_blocks": r.sent_ops, "sent_blocks_per_s": r.sent_ops as f64 / r.sent_seconds.max(1e-9),
        "applied_blocks": r.applied_ops, "absorbed_blocks_per_s": absorbed,
        "lost_blocks": lost, "kept_up": kept_up});
    let faults = match side {
        Side::Ours => "seq_gaps",
        Side::Dynamo => "error_events",
    };
    row[faults] = json!(r.faults);
    Stepped {
        step: r,
        absorbed,
        kept_up,
        row,
    }
}

fn print_cells(label: &str, rates: [Option<f64>; 2], cells: &[Option<Stepped>; 2]) {
    let cell = |c: &Option<Stepped>, rate: Option<f64>| match (c, rate) {
        (Some(c), Some(rate)) => format!(
            "{:>10.0} {:>10.0} {:>10.0} {:>8} {:>6}",
            rate,
            c.step.sent_ops as f64 / c.step.sent_seconds.max(1e-9),
            c.absorbed,
            c.step.sent_ops.saturating_sub(c.step.applied_ops),
            c.step.faults
        ),
        _ => format!("{:>10} {:>10} {:>10} {:>8} {:>6}", "-", "-", "-", "-", "-"),
    };
    println!(
        "{label:>14} | {} | {}",
        cell(&cells[0], rates[0]),
        cell(&cells[1], rates[1])
    );
}

async fn ingest(
    peers: &mut Peers,
    shape_pods: &mut [Vec<Pods>],
    quick: bool,
) -> (Vec<Value>, Value) {
    let secs = if quick { 1.0 } else { 2.0 };
    println!(
        "\npeer ingest: {INGEST_PODS} pods per shape, 16 token ids per block, a pod evicts as much as it stores once it holds {KEEP_BLOCKS} blocks; \
         offered/absorbed = stored + removed blocks/s; ours and Dynamo take turns at each rate; \
         after the doubling, {REFINE_ROUNDS} rounds on fresh pods narrow each side's bracket \
         (a warm step at the first rate, then the middle rate)"
    );
    println!(
        "{:>14} | {:>10} {:>10} {:>10} {:>8} {:>6} | {:>10} {:>10} {:>10} {:>8} {:>6}",
        "shape step",
        "ours off/s",
        "sent/s",
        "absorbed/s",
        "lost",
        "gaps",
        "dyn off/s",
        "sent/s",
        "absorbed/s",
        "lost",
        "errors"
    );
    let mut rows = Vec::new();
    let mut best = serde_json::Map::new();
    for (shape_i, (shape, sets)) in SHAPES.iter().zip(shape_pods.iter_mut()).enumerate() {
        let seed = |set: usize| 7_000 + 1_000 * set as u64 + 100 * shape_i as u64;
        let prefix = pod_prefix(shape, 0);
        let mut streams = fresh_streams(peers, &prefix, &sets[0], shape, seed(0)).await;
        let mut running = [true, true];
        let mut best_rate = [0f64, 0f64];
        // Per side: the highest offered rate kept up with, the lowest not.
        let mut kept: [Option<f64>; 2] = [None, None];
        let mut missed: [Option<f64>; 2] = [None, None];
        for &rate in shape.rates {
            let mut cells: [Option<Stepped>; 2] = [None, None];
            for side in SIDES {
                let s = side as usize;
                if !running[s] {
                    continue;
                }
                let r = side_step(
                    peers,
                    side,
                    &prefix,
                    &mut sets[0],
                    &mut streams[s],
                    shape,
                    rate,
                    secs,
                )
                .await;
                if r.kept_up {
                    best_rate[s] = best_rate[s].max(r.absorbed);
                    kept[s] = Some(rate);
                } else {
                    // A side stops at its first loss, or once it falls
                    // well behind.
                    running[s] = false;
                    missed[s] = Some(rate);
                }
                rows.push(r.row.clone());
                cells[s] = Some(r);
            }
            print_cells(&format!("{} ladder", shape.name), [Some(rate); 2], &cells);
        }
        for (round, set) in sets.iter_mut().enumerate().skip(1) {
            let middle: [Option<f64>; 2] = std::array::from_fn(|s| match (kept[s], missed[s]) {
                (Some(lo), Some(hi)) => Some((lo * hi).sqrt()),
                // Kept up with the ladder's top: a step above it.
                (Some(lo), None) => Some(lo * std::f64::consts::SQRT_2),
                _ => None,
            });
            if middle.iter().all(Option::is_none) {
                break;
            }
            let prefix = pod_prefix(shape, round);
            let mut streams = fresh_streams(peers, &prefix, set, shape, seed(round)).await;
            let mut cells: [Option<Stepped>; 2] = [None, None];
            for side in SIDES {
                let s = side as usize;
                let Some(rate) = middle[s] else { continue };
                // Warm: the pods fill at the ladder's first rate, as they
                // did on the ladder, before the step that counts.
                let mut last = None;
                for (counts, step_rate) in [(false, shape.rates[0]), (true, rate)] {
                    let step = side_step(
                        peers,
                        side,
                        &prefix,
                        set,
                        &mut streams[s],
                        shape,
                        step_rate,
                        secs,
                    )
                    .await;
                    let kept_up = step.kept_up;
                    last = Some((counts, step));
                    if !kept_up {
                        break;
                    }
                }
                let Some((counted, step)) = last else {
                    continue;
                };
                if counted && step.kept_up {
                    best_rate[s] = best_rate[s].max(step.absorbed);
                    kept[s] = Some(rate);
                } else {
                    missed[s] = Some(rate);
                }
                let mut row = step.row.clone();
                row["refine_round"] = json!(round);
                if !counted {
                    row["warm_step_failed"] = json!(true);
                }
                rows.push(row);
                cells[s] = counted.then_some(step);
            }
            print_cells(&format!("{} round {round}", shape.name), middle, &cells);
        }
        best.insert(
            shape.name.into(),
            json!({"blocks_per_event": shape.blocks, "ours": best_rate[0], "dynamo": best_rate[1],
                "ours_over_dynamo": best_rate[0] / best_rate[1],
                "ours_bracket": [kept[0], missed[0]], "dynamo_bracket": [kept[1], missed[1]]}),
        );
    }
    println!("\npeer ingest, highest absorbed with nothing lost (blocks/s):");
    println!(
        "{:>8} {:>12} {:>12} {:>12} {:>14}",
        "shape", "ours", "dynamo", "ours/dynamo", "goal >= 1.5x"
    );
    for (name, b) in &best {
        let ratio = b["ours_over_dynamo"].as_f64().unwrap_or(f64::NAN);
        println!(
            "{name:>8} {:>12.0} {:>12.0} {:>11.2}x {:>14}",
            b["ours"].as_f64().unwrap_or(0.0),
            b["dynamo"].as_f64().unwrap_or(0.0),
            ratio,
            if ratio >= 1.5 { "met" } else { "missed" }
        );
    }
    (rows, Value::Object(best))
}

// ------------------------------------------------------------------ score

/// Like `score_at_rate`, against Dynamo's `/query`.
async fn dynamo_score_at_rate(
    http: &Arc<Http>,
    request: bytes::Bytes,
    rate: f64,
    seconds: f64,
) -> (Vec<Duration>, f64) {
    super::open_loop(rate, seconds, |_| {
        let http = http.clone();
        let req = request.clone();
        async move {
            let (status, _) = http.send(&req).await.expect("POST /query");
            assert_eq!(status, 200, "POST /query");
        }
    })
    .await
}

async fn dynamo_score_step(
    http: &Arc<Http>,
    request: &bytes::Bytes,
    rate: f64,
    seconds: f64,
) -> Step {
    let (s0, n0) = dynamo_query_time(http).await;
    let (lat, achieved) = dynamo_score_at_rate(http, request.clone(), rate, seconds).await;
    let (s1, n1) = dynamo_query_time(http).await;
    Step {
        achieved,
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        p999: percentile(&lat, 0.999),
        service_us: (n1 > n0).then(|| (s1 - s0) / (n1 - n0) * 1e6),
    }
}

/// Dynamo's answer to `/query`, as matched blocks per instance id.
fn dynamo_matched(body: &[u8]) -> Vec<(u64, u32)> {
    let v: Value = serde_json::from_slice(body).expect("/query answer is JSON");
    let mut out: Vec<(u64, u32)> = v["scores"]
        .as_object()
        .map(|workers| {
            workers
                .iter()
                .filter_map(|(id, ranks)| {
                    let tokens: u64 = ranks.as_object()?.values().filter_map(Value::as_u64).sum();
                    Some((id.parse().ok()?, (tokens / BLOCK as u64) as u32))
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out
}

async fn score(peers: &mut Peers, pods: &Pods, quick: bool) -> Value {
    // The e2e Score shape: 64 pods hold the first 32, 64, ... 2048 blocks
    // of one 2048-block prompt.
    let mut x = 42u64;
    let tokens = random_tokens(&mut x, PROMPT_BLOCKS);
    let hashes: Vec<u64> = (0..PROMPT_BLOCKS as u64)
        .map(|i| 0x5c0e_0000_0000 + i)
        .collect();
    let depth = |i: usize| (i + 1) * PROMPT_BLOCKS / SCORE_PODS;
    let msgs: Vec<ZmqMessage> = pods
        .names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let payload = encode_batch(&[WireEvent::Stored {
                hashes: &hashes[..depth(i)],
                parent: None,
                tokens: &tokens[..depth(i) * BLOCK],
                block_size: BLOCK,
            }]);
            frames(name, MODEL, 0, payload)
        })
        .collect();
    let expected: Vec<(u64, u32)> = (0..SCORE_PODS)
        .map(|i| (SCORE_ID + i as u64, depth(i) as u32))
        .collect();
    let request = pb::ScoreRequest {
        model: MODEL.into(),
        input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
            ids: tokens.clone(),
        })),
        ..Default::default()
    };
    let query = http_request(
        "POST",
        "/query",
        json!({"token_ids": tokens, "model_name": MODEL})
            .to_string()
            .as_bytes(),
    );
    // Publish until both hold every pod's blocks (same seq every time:
    // re-sends are duplicates), and check each answer once.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for side in SIDES {
            for (p, msg) in pods.publishers[side as usize].iter().zip(&msgs) {
                p.as_ref().expect("publisher").send(msg).expect("publish");
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let ours_ready = pods_named(&mut peers.ours, "peer-score-").await.len() == SCORE_PODS;
        let (status, body) = peers.dynamo.send(&query).await.expect("POST /query");
        if ours_ready && status == 200 && dynamo_matched(&body) == expected {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "score pods never indexed (Dynamo answered {status}: {:?})",
            dynamo_matched(&body)
        );
    }
    let answer = peers
        .ours
        .score(request.clone())
        .await
        .expect("Score")
        .into_inner();
    let mut ours_matched: Vec<(String, u32)> = answer
        .pods
        .iter()
        .filter(|p| p.pod.starts_with("peer-score-"))
        .map(|p| (p.pod.clone(), p.matched_blocks))
        .collect();
    ours_matched.sort();
    let ours_expected: Vec<(String, u32)> = pods
        .names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.clone(), depth(i) as u32))
        .collect();
    assert_eq!(ours_matched, ours_expected, "ours: wrong scores");

    let scores = super::ScoreClient::connect(&peers.ours_grpc, 8)
        .await
        .expect("connect");
    let connections = 64;
    peers
        .dynamo
        .warm(connections)
        .await
        .expect("connect to Dynamo");
    let message = super::grpc_message(&prost::Message::encode_to_vec(&request));
    let (seconds, repeats) = if quick { (1.0, 1) } else { (3.0, 3) };
    let _ = super::score_at_rate(&scores, message.clone(), 200.0, 0.5).await;
    let _ = dynamo_score_at_rate(&peers.dynamo, query.clone(), 200.0, 0.5).await;
    // One request at a time, alternating: each side's cost per request
    // without queueing behind the others.
    let rounds = if quick { 30 } else { 100 };
    let mut alone: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..rounds {
        let t = Instant::now();
        scores.score(0, message.clone()).await.expect("Score");
        alone[0].push(t.elapsed());
        let t = Instant::now();
        let (status, _) = peers.dynamo.send(&query).await.expect("POST /query");
        assert_eq!(status, 200, "POST /query");
        alone[1].push(t.elapsed());
    }
    let mut alone_json = serde_json::Map::new();
    println!("\npeer Score, one request at a time ({rounds} each, alternating):");
    for (side, mut lat) in SIDES.into_iter().zip(alone) {
        lat.sort_unstable();
        let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
        println!("{:>8}: p50 {p50:.0} us, p99 {p99:.0} us", side.name());
        alone_json.insert(side.name().into(), json!({"p50_us": p50, "p99_us": p99}));
    }
    alone_json.insert("requests".into(), json!(rounds));
    println!(
        "\npeer Score, token ids: 2048 blocks (32768 tokens), 64 pods at 64 depths, open loop; \
         ours: gRPC, 8 HTTP/2 connections; dynamo: HTTP/1.1 POST /query (JSON), {connections} keep-alive connections; \
         {repeats} run(s) each, taking turns; per rate the run with the median p99"
    );
    println!(
        "{:>9} | {:>8} {:>8} {:>8} {:>8} {:>7} | {:>8} {:>8} {:>8} {:>8} {:>7} | {:>9} {:>6}",
        "offered/s",
        "ours/s",
        "p50 us",
        "p99 us",
        "p999 us",
        "svc us",
        "dyn/s",
        "p50 us",
        "p99 us",
        "p999 us",
        "svc us",
        "p99 ratio",
        "<=0.3"
    );
    let mut rows = Vec::new();
    let mut all_met = true;
    // The rate at which a side fell behind (achieved < 80% of offered, or
    // p99 over a second): it sits out its remaining runs and higher rates,
    // which would only measure its queue.
    let mut saturated: [Option<f64>; 2] = [None, None];
    for rate in [500.0, 1000.0, 2000.0] {
        let mut runs: [Vec<Step>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..repeats {
            for side in SIDES {
                let i = side as usize;
                if saturated[i].is_some() {
                    continue;
                }
                let step = match side {
                    Side::Ours => {
                        score_step(
                            &scores,
                            &message,
                            Some(peers.ours_metrics.as_str()),
                            rate,
                            seconds,
                        )
                        .await
                    }
                    Side::Dynamo => dynamo_score_step(&peers.dynamo, &query, rate, seconds).await,
                };
                if step.achieved < 0.8 * rate || step.p99 > 1e6 {
                    saturated[i] = Some(rate);
                }
                runs[i].push(step);
            }
        }
        let mut picked: Vec<Option<Step>> = Vec::new();
        let mut row = serde_json::Map::new();
        row.insert("offered_per_s".into(), json!(rate));
        for (side, mut r) in SIDES.into_iter().zip(runs) {
            if r.is_empty() {
                row.insert(side.name().into(), Value::Null);
                picked.push(None);
                continue;
            }
            r.sort_by(|a, b| a.p99.total_cmp(&b.p99));
            let p99_runs: Vec<f64> = r.iter().map(|s| s.p99).collect();
            let s = r.swap_remove(r.len() / 2);
            row.insert(
                side.name().into(),
                json!({"achieved_per_s": s.achieved, "p50_us": s.p50, "p99_us": s.p99,
                    "p999_us": s.p999, "service_mean_us": s.service_us, "p99_us_runs": p99_runs,
                    "fell_behind": saturated[side as usize] == Some(rate)}),
            );
            picked.push(Some(s));
        }
        let cell = |s: &Option<Step>| match s {
            Some(s) => format!(
                "{:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>7}",
                s.achieved,
                s.p50,
                s.p99,
                s.p999,
                s.service_us.map_or("-".into(), |u| format!("{u:.0}"))
            ),
            None => format!("{:>8} {:>8} {:>8} {:>8} {:>7}", "-", "-", "-", "-", "-"),
        };
        let ratio = match (&picked[0], &picked[1]) {
            (Some(a), Some(b)) => Some(a.p99 / b.p99),
            _ => None,
        };
        // Against a peer that cannot sustain the rate at all, ours is
        // ahead by more than any ratio; a fallen-behind ours is not.
        let met = match (ratio, saturated[0], saturated[1]) {
            (_, Some(r), _) if r <= rate => false,
            (Some(x), _, _) => x <= 0.3,
            (None, _, Some(_)) => true,
            (None, _, None) => false,
        };
        all_met &= met;
        println!(
            "{rate:>9.0} | {} | {} | {:>9} {:>6}",
            cell(&picked[0]),
            cell(&picked[1]),
            ratio.map_or("-".into(), |x| format!("{x:.2}x")),
            if met { "met" } else { "missed" }
        );
        row.insert("p99_ours_over_dynamo".into(), json!(ratio));
        row.insert("goal_met".into(), json!(met));
        rows.push(Value::Object(row));
    }
    for (side, at) in SIDES.iter().zip(saturated) {
        if let Some(at) = at {
            println!(
                "{} fell behind at {at:.0}/s (not run above it)",
                side.name()
            );
        }
    }
    json!({"one_at_a_time": alone_json, "rates": rows, "dynamo_connections": connections,
        "fell_behind_at": {"ours": saturated[0], "dynamo": saturated[1]},
        "goal_p99_at_most_0_3x_met": all_met})
}

// ------------------------------------------------------------------ driver

/// Runs the peer comparison; its JSON goes under `peer` in `e2e.json`.
pub async fn run(o: &Opts) -> Value {
    let context = zmq::Context::new();
    let mut shape_pods: Vec<Vec<Pods>> = SHAPES
        .iter()
        .map(|s| {
            (0..POD_SETS)
                .map(|set| {
                    let prefix = pod_prefix(s, set);
                    bind_pods(
                        &context,
                        (0..INGEST_PODS).map(|i| format!("{prefix}{i}")).collect(),
                    )
                })
                .collect()
        })
        .collect();
    let score_pods = bind_pods(
        &context,
        (0..SCORE_PODS)
            .map(|i| format!("peer-score-{i:02}"))
            .collect(),
    );
    let ours_endpoints: Vec<String> = shape_pods
        .iter()
        .flatten()
        .chain([&score_pods])
        .flat_map(|p| p.endpoints[Side::Ours as usize].iter().cloned())
        .collect();
    let mut peers = start(o, &ours_endpoints).await;
    for (set_i, pods) in shape_pods.iter().flatten().enumerate() {
        for (i, e) in pods.endpoints[Side::Dynamo as usize].iter().enumerate() {
            let id = INGEST_ID + (set_i * INGEST_PODS + i) as u64;
            register(&peers.dynamo, id, e).await;
        }
    }
    for (i, e) in score_pods.endpoints[Side::Dynamo as usize]
        .iter()
        .enumerate()
    {
        register(&peers.dynamo, SCORE_ID + i as u64, e).await;
    }
    let (ingest_rows, ingest_best) = ingest(&mut peers, &mut shape_pods, o.quick).await;
    let score = score(&mut peers, &score_pods, o.quick).await;
    json!({
        "peer": "dynamo",
        "dynamo": {"crate": "dynamo-kv-router 1.6.1 (standalone-indexer, metrics)",
            "threads": DYNAMO_THREADS, "binary": BINARY},
        "ours": {"mode": "dial (--zmq-bind none --zmq-connect per pod)"},
        "ingest": ingest_rows,
        "ingest_best_zero_loss": ingest_best,
        "score_token_ids": score,
    })
}

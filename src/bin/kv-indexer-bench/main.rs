//! `kv-indexer-bench`: end-to-end load against the running service, over its
//! real sockets.
//!
//! ```text
//! cargo build --release && target/release/kv-indexer-bench [--quick]
//! ```
//!
//! It starts `kv-indexer` (the binary next to it) on loopback ports, unless
//! `--grpc ADDR --zmq ENDPOINT` name one already running, then:
//! 1. ingest: 8 pods publish pre-encoded vLLM batches (map form, 32-block
//!    stores of 16 token ids each, and removals) over ZeroMQ PUB at offered
//!    rates, then as fast as they can; absorbed = blocks the service applied
//!    (ListPods counters) per second, lost = sent - applied;
//! 2. Score with token ids (2048 blocks, 64 pods holding different depths of
//!    the prompt) at increasing request rates over many concurrent streams:
//!    p50/p99/p999, and the highest rate whose p99 stays within 1 ms;
//! 3. Score with text (Qwen3 tokenizer, ~8K and ~32K tokens), cold (every
//!    prompt new) and warm-prefix (a shared prefix, new suffix).
//! 4. Score under ingest (`under_ingest`): the token-id Score at fixed
//!    rates, alone and while pods publish vLLM-shaped batches at a fixed
//!    block rate, alternating; latencies, events sent vs applied, and each
//!    thread group's CPU and run-queue wait.
//!
//! Prints tables, writes `target/bench/e2e.json`. The client shares the
//! machine's cores with the service: on 2 cores every number here includes
//! the load generator's own cost.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kv_indexer::proto::kvindexer::v1 as pb;
use pb::kv_indexer_client::KvIndexerClient;
use serde_json::{json, Value};
use simulator::vllm_wire::{encode_batch, frames, WireEvent};
use tonic::transport::Channel;

/// `--peer dynamo`: Dynamo's standalone indexer, driven alike.
mod bootstrap;
mod dynamo;
mod ingest;
mod score;
mod score_client;
mod text;
mod under_ingest;

type ZmqMessage = Vec<bytes::Bytes>;

const MODEL: &str = "bench/model";
const TEXT_MODEL: &str = "bench/qwen3";
const BLOCK: usize = 16;
const PARTS: [&str; 6] = [
    "ingest",
    "score",
    "text",
    "under-ingest",
    "bootstrap",
    "peer",
];

struct Opts {
    quick: bool,
    /// Parts to run (`ingest`, `score`, `text`); all when empty.
    only: Vec<String>,
    grpc: Option<String>,
    zmq: Option<String>,
    metrics: Option<String>,
    tokenizer: PathBuf,
    /// `--peer dynamo`: the peer part runs against Dynamo's standalone
    /// indexer (`dynamo`), at `peer_bin` if given.
    peer: bool,
    peer_bin: Option<PathBuf>,
    /// `--ours-arg ARG` (repeatable): passed to the service this starts (for
    /// every part, and for the peer part's own).
    ours_args: Vec<String>,
    under_ingest: under_ingest::Options,
}

fn opts() -> Opts {
    let mut o = Opts {
        quick: false,
        only: Vec::new(),
        grpc: None,
        zmq: None,
        metrics: None,
        tokenizer: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/qwen3"),
        peer: false,
        peer_bin: None,
        ours_args: Vec::new(),
        under_ingest: Default::default(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--only" => {
                o.only = args
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .map(str::to_string)
                    .collect();
                if let Some(bad) = o.only.iter().find(|p| !PARTS.contains(&p.as_str())) {
                    eprintln!("--only: unknown part {bad:?} (parts: {})", PARTS.join(","));
                    std::process::exit(2);
                }
            }
            "--grpc" => o.grpc = args.next(),
            "--zmq" => o.zmq = args.next(),
            "--metrics" => o.metrics = args.next(),
            "--tokenizer" => o.tokenizer = args.next().map(PathBuf::from).unwrap_or(o.tokenizer),
            "--peer" => match args.next().as_deref() {
                Some("dynamo") => o.peer = true,
                other => {
                    eprintln!("--peer: unknown peer {other:?} (peers: dynamo)");
                    std::process::exit(2);
                }
            },
            "--peer-bin" => o.peer_bin = args.next().map(PathBuf::from),
            "--ours-arg" => o.ours_args.extend(args.next()),
            "--bench" => {}
            other if o.under_ingest.parse_arg(other, &mut args) => {}
            "-h" | "--help" => {
                println!(
                    "kv-indexer-bench [--quick] [--only ingest,score,text,under-ingest,bootstrap,peer] [--grpc HOST:PORT --zmq tcp://HOST:PORT [--metrics HOST:PORT]] [--tokenizer DIR] {} [--ours-arg ARG]... [--peer dynamo [--peer-bin PATH]]\n\
                     Without --grpc/--zmq it starts the kv-indexer binary next to it. A running\n\
                     service must serve {TEXT_MODEL} with the Qwen3 tokenizer for the text runs.\n\
                     --peer dynamo adds the peer part: ours and Dynamo's standalone indexer\n\
                     ({}, built by peers/dynamo, next to this binary unless --peer-bin),\n\
                     each started on loopback, taking turns on the same ingest and Score loads.",
                    under_ingest::Options::HELP,
                    dynamo::BINARY
                );
                std::process::exit(0);
            }
            other => {
                eprintln!("unknown argument {other:?} (try --help)");
                std::process::exit(2);
            }
        }
    }
    if o.only.iter().any(|p| p == "peer") && !o.peer {
        eprintln!("--only peer needs --peer dynamo");
        std::process::exit(2);
    }
    o
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The service under test, killed on drop.
struct Spawned(Child);

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_service(o: &Opts, extra: &[&str]) -> (Spawned, String, String, String) {
    spawn_service_on(o, free_port(), extra)
}

/// `spawn_service` with its gRPC port given (a replica its peers know in
/// advance).
fn spawn_service_on(o: &Opts, grpc: u16, extra: &[&str]) -> (Spawned, String, String, String) {
    let exe = std::env::current_exe().expect("own path");
    let bin = exe.with_file_name("kv-indexer");
    assert!(
        bin.exists(),
        "{} not found: build it first (cargo build --release)",
        bin.display()
    );
    let (metrics, zmq) = (free_port(), free_port());
    let child = Command::new(&bin)
        .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .args(["--zmq-bind", &format!("tcp://127.0.0.1:{zmq}")])
        .args([
            "--tokenizer",
            &format!("{TEXT_MODEL}={}", o.tokenizer.display()),
        ])
        .args(["--log-level", "warn"])
        .args(&o.ours_args)
        .args(extra)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .spawn()
        .expect("start kv-indexer");
    (
        Spawned(child),
        format!("127.0.0.1:{grpc}"),
        format!("tcp://127.0.0.1:{zmq}"),
        format!("127.0.0.1:{metrics}"),
    )
}

/// The service's own Score time for token-id requests so far, from one
/// read of its `/metrics`: what the handler spent, without the client, the
/// transport or message decoding.
struct ServerScore {
    /// Seconds, over `count` requests.
    sum: f64,
    count: f64,
    /// (bucket bound in seconds, requests at or under it), cumulative.
    buckets: Vec<(f64, f64)>,
}

fn server_score(metrics: Option<&str>) -> Option<ServerScore> {
    let body = metrics_text(metrics)?;
    let token_ids = |name: &'static str| {
        body.lines()
            .filter(move |l| l.starts_with(name) && l.contains("input=\"token_ids\""))
    };
    let value = |name: &'static str| -> Option<f64> {
        token_ids(name).next()?.rsplit(' ').next()?.parse().ok()
    };
    let buckets = token_ids("kv_indexer_score_seconds_bucket")
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect();
    Some(ServerScore {
        sum: value("kv_indexer_score_seconds_sum")?,
        count: value("kv_indexer_score_seconds_count")?,
        buckets,
    })
}

impl ServerScore {
    /// The handler's mean time (us) between two readings, if it answered
    /// any request meanwhile.
    fn mean_us_since(&self, before: &ServerScore) -> Option<f64> {
        (self.count > before.count)
            .then(|| (self.sum - before.sum) / (self.count - before.count) * 1e6)
    }
}

/// The bucket bound (us) at or under which a `q` share of the requests
/// between two readings' buckets (`ServerScore`) fell: the handler's
/// quantile, to the histogram's resolution (bounds 2.5x apart).
fn bucket_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let diff: Vec<(f64, f64)> = after
        .iter()
        .map(|&(le, n)| {
            let was = before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, n - was)
        })
        .collect();
    let total = diff.last()?.1;
    (total > 0.0)
        .then(|| {
            diff.iter()
                .find(|(_, n)| *n >= q * total)
                .map(|(le, _)| le * 1e6)
        })
        .flatten()
}

/// The service's `/metrics` text (`None` without an address or an answer).
fn metrics_text(metrics: Option<&str>) -> Option<String> {
    http_get(metrics?, "/metrics")
}

/// A plain HTTP/1.1 GET of `path` at `addr`: the whole answer, status line
/// and headers included (`None` without one).
fn http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

async fn connect(grpc: &str) -> KvIndexerClient<Channel> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut c) = KvIndexerClient::connect(format!("http://{grpc}")).await {
            if c.list_pods(pb::ListPodsRequest::default()).await.is_ok() {
                return c;
            }
        }
        assert!(Instant::now() < deadline, "service at {grpc} not answering");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The service's pods of `MODEL` whose name starts with `prefix`.
async fn pods_named(client: &mut KvIndexerClient<Channel>, prefix: &str) -> Vec<pb::PodInfo> {
    let mut pods = client
        .list_pods(pb::ListPodsRequest {
            model: MODEL.into(),
        })
        .await
        .expect("ListPods")
        .into_inner()
        .pods;
    pods.retain(|p| p.pod.starts_with(prefix));
    pods
}

/// Stored + removed blocks the service applied, and seq gaps, for pods
/// whose name starts with `prefix`.
async fn applied(client: &mut KvIndexerClient<Channel>, prefix: &str) -> (u64, u64) {
    pods_named(client, prefix)
        .await
        .iter()
        .fold((0, 0), |(b, g), p| {
            (b + p.stored_blocks + p.removed_blocks, g + p.seq_gaps)
        })
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    percentile_at(sorted.len(), p).map_or(f64::NAN, |i| sorted[i].as_secs_f64() * 1e6)
}

/// Where the `p` quantile of `len` sorted values is (nearest rank).
fn percentile_at(len: usize, p: f64) -> Option<usize> {
    (len > 0).then(|| ((len as f64 * p).ceil() as usize).clamp(1, len) - 1)
}

fn lcg(x: &mut u64) -> u64 {
    *x = x
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    *x >> 17
}

/// `blocks` blocks' worth of random token ids of a 150K vocabulary.
fn random_tokens(rng: &mut u64, blocks: usize) -> Vec<u32> {
    (0..blocks * BLOCK)
        .map(|_| (lcg(rng) % 150_000) as u32)
        .collect()
}

/// A load pod's batch as vLLM sends it: a store of `hashes` (under
/// `parent`) and, if there are any, the removal of `removed`, framed as
/// `pod`'s batch `seq`.
fn store_batch(
    pod: &str,
    seq: u64,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    removed: &[u64],
) -> ZmqMessage {
    let mut events = vec![WireEvent::Stored {
        hashes,
        parent,
        tokens,
        block_size: BLOCK,
    }];
    if !removed.is_empty() {
        events.push(WireEvent::Removed { hashes: removed });
    }
    frames(pod, MODEL, seq, encode_batch(&events))
}

fn main() {
    let o = opts();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (service, grpc, zmq, metrics) = match (&o.grpc, &o.zmq) {
            (Some(g), Some(z)) => (None, g.clone(), z.clone(), o.metrics.clone()),
            _ => {
                let (s, g, z, m) = spawn_service(&o, &[]);
                (Some(s), g, z, Some(m))
            }
        };
        let mut client = connect(&grpc).await;
        let started = Instant::now();
        let runs = |part: &str| o.only.is_empty() || o.only.iter().any(|p| p == part);
        let mut ingest_rows = Vec::new();
        if runs("ingest") {
            ingest_rows = ingest::ingest(&zmq, &mut client, o.quick).await;
        }
        let mut score = Value::Null;
        if runs("score") {
            score =
                score::score_tokens(&grpc, &zmq, metrics.as_deref(), &mut client, o.quick).await;
        }
        let mut text = Value::Null;
        if runs("text") {
            text = text::score_text(&mut client, o.quick).await;
        }
        let mut under = Value::Null;
        if runs("under-ingest") {
            let pid = service.as_ref().map(|s| s.0.id());
            under = under_ingest::run(
                &grpc,
                &zmq,
                metrics.as_deref(),
                &mut client,
                pid,
                &o.under_ingest,
                o.quick,
            )
            .await;
        }
        let mut bootstrap = Value::Null;
        if runs("bootstrap") {
            bootstrap = bootstrap::run(&o, o.quick).await;
        }
        let mut peer = Value::Null;
        if o.peer && runs("peer") {
            peer = dynamo::run(&o).await;
        }
        let out = json!({
            "mode": if o.quick { "quick" } else { "full" },
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "ingest": ingest_rows,
            "score_token_ids": score,
            "score_text": text,
            "peer": peer,
            "score_under_ingest": under,
            "bootstrap": bootstrap,
            "seconds": started.elapsed().as_secs_f64(),
        });
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
        std::fs::create_dir_all(&dir).expect("target/bench");
        let path = dir.join("e2e.json");
        std::fs::write(&path, serde_json::to_string_pretty(&out).expect("json")).expect("write");
        println!("\nwrote {}", path.display());
    });
}

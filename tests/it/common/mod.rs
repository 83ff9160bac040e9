//! Shared helpers for the service tests: start the real `kv-indexer` binary on
//! free ports, publish recorded vLLM streams over a real ZeroMQ PUB socket,
//! query over real gRPC.

pub mod vllm_pod;

/// How long a test waits for the service to do what it must: `secs` on a
/// quiet machine, times `KV_INDEXER_TEST_SLOWDOWN` (a number, default 1).
/// Every wait budget of the suite goes through here, so a slow or shared
/// machine raises all of them at once instead of one test at a time.
pub fn budget(secs: u64) -> std::time::Duration {
    let slowdown = std::env::var("KV_INDEXER_TEST_SLOWDOWN")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|f| f.is_finite() && *f >= 1.0)
        .unwrap_or(1.0);
    std::time::Duration::from_secs_f64(secs as f64 * slowdown)
}

use std::collections::{BTreeMap, HashMap};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use kv_indexer::proto::kvindexer::v1 as pb;
use pb::kv_indexer_client::KvIndexerClient;
use serde_json::Value;
use tonic::transport::Channel;

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A port to listen on, free when returned.
///
/// Not `bind(0)`: the kernel picks those from the ephemeral range, where any
/// outgoing connection (a gRPC client, a ZeroMQ dial) may take the port
/// between our release and the listener's bind. Ports below the ephemeral
/// range (Linux: 32768+) are never handed to outgoing connections, and a
/// per-process counter never hands one out twice; the start is spread by pid
/// so test binaries running one after another do not reuse each other's.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(2_654_435_761)) % SPAN,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..SPAN {
        let port = (LOW + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN)
}

/// A running `kv-indexer` process, killed on drop.
pub struct Service {
    child: Child,
    pub grpc_port: u16,
    pub metrics_port: u16,
    /// `tcp://127.0.0.1:PORT` the SUB socket is bound on, if bind mode is on.
    pub zmq_bind: Option<String>,
    log: PathBuf,
    /// How long a wait for events to be subscribed to or applied may take.
    ingest_wait: Duration,
}

impl Service {
    /// Starts the service with its SUB socket bound on a free port.
    pub async fn start(extra: &[&str]) -> Service {
        let zmq = format!("tcp://127.0.0.1:{}", free_port());
        let mut args = vec!["--zmq-bind", &zmq];
        args.extend_from_slice(extra);
        Service::start_raw(&args, Some(zmq.clone())).await
    }

    /// Starts the service in dial mode only, connecting to `endpoints`.
    pub async fn start_dialing(endpoints: &[String], extra: &[&str]) -> Service {
        let mut args: Vec<&str> = vec!["--zmq-bind", "none"];
        for e in endpoints {
            args.push("--zmq-connect");
            args.push(e);
        }
        args.extend_from_slice(extra);
        Service::start_raw(&args, None).await
    }

    pub async fn start_raw(args: &[&str], zmq_bind: Option<String>) -> Service {
        Service::start_with_env(args, zmq_bind, &[]).await
    }

    /// Starts the service with extra environment variables (they win over
    /// the test defaults, e.g. `HF_HUB_OFFLINE`).
    pub async fn start_with_env(
        args: &[&str],
        zmq_bind: Option<String>,
        env: &[(&str, String)],
    ) -> Service {
        Service::spawn(
            Command::new(env!("CARGO_BIN_EXE_kv-indexer")),
            args,
            zmq_bind,
            env,
        )
        .await
    }

    /// Starts the service under a soft open-files limit of `limit` (as a
    /// container runtime's default of 1,024 would), its hard limit unchanged.
    pub async fn start_with_soft_nofile(limit: u64, extra: &[&str]) -> Service {
        let zmq = format!("tcp://127.0.0.1:{}", free_port());
        let mut args = vec!["--zmq-bind", &zmq];
        args.extend_from_slice(extra);
        let mut sh = Command::new("sh");
        sh.arg("-c")
            .arg(format!("ulimit -Sn {limit} && exec \"$0\" \"$@\""))
            .arg(env!("CARGO_BIN_EXE_kv-indexer"));
        Service::spawn(sh, &args, Some(zmq.clone()), &[]).await
    }

    async fn spawn(
        mut command: Command,
        args: &[&str],
        zmq_bind: Option<String>,
        env: &[(&str, String)],
    ) -> Service {
        // A test that names the gRPC address (a replica its peers know in
        // advance) gets that one.
        let given = args
            .windows(2)
            .find(|w| w[0] == "--grpc-addr")
            .and_then(|w| w[1].rsplit(':').next()?.parse().ok());
        let grpc_port = given.unwrap_or_else(free_port);
        let metrics_port = free_port();
        let log = std::env::temp_dir().join(format!(
            "kv-indexer-test-{}-{grpc_port}.log",
            std::process::id()
        ));
        if given.is_none() {
            command
                .arg("--grpc-addr")
                .arg(format!("127.0.0.1:{grpc_port}"));
        }
        let child = command
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{metrics_port}"))
            .args(args)
            .env("KV_INDEXER_LOG_LEVEL", "info")
            .env_remove("RUST_LOG")
            // Tests never reach the Hugging Face Hub, nor a user's HF cache.
            .env("HF_HUB_OFFLINE", "1")
            .env(
                "HF_HOME",
                std::env::temp_dir().join("kv-indexer-test-no-hf-home"),
            )
            .env_remove("HF_HUB_CACHE")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start kv-indexer");
        // Under `--ingest-priority idle` the ingest threads run only when
        // the cores are otherwise idle, by design: beside a busy neighbour
        // (the other test the harness runs at the same time, other jobs on
        // a CI machine) they crawl. With four busy processes on two cores a
        // 560-batch stream was 88% applied after 30 s.
        let idle_ingest = args.windows(2).any(|w| w == ["--ingest-priority", "idle"]);
        let ingest_wait = budget(if idle_ingest { 120 } else { 30 });
        let service = Service {
            child,
            grpc_port,
            metrics_port,
            zmq_bind,
            log,
            ingest_wait,
        };
        if args.contains(&"--tls-cert") {
            service.wait_ready_http().await;
        } else {
            service.wait_serving().await;
        }
        service
    }

    pub fn grpc_addr(&self) -> String {
        format!("127.0.0.1:{}", self.grpc_port)
    }

    /// `GET path` on the metrics/health HTTP port: (status, body).
    pub fn http_get(&self, path: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let mut s =
            std::net::TcpStream::connect(("127.0.0.1", self.metrics_port)).expect("connect http");
        // A frozen service must fail the test, not hang it.
        s.set_read_timeout(Some(budget(10))).expect("timeout");
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .expect("write");
        let mut raw = String::new();
        s.read_to_string(&mut raw).expect("read");
        let status = raw
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = raw
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    /// Waits until the log contains `needle` (lines can be written just
    /// after the state they describe becomes visible).
    pub async fn wait_log(&self, needle: &str) {
        let deadline = Instant::now() + budget(20);
        while !self.logs().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in the log:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Score of a token-id prompt for every pod of `model`.
    pub async fn score_token_ids(&self, model: &str, ids: Vec<u32>) -> pb::ScoreResponse {
        self.client()
            .await
            .score(pb::ScoreRequest {
                model: model.into(),
                input: Some(pb::score_request::Input::TokenIds(pb::TokenIds { ids })),
                ..Default::default()
            })
            .await
            .expect("Score")
            .into_inner()
    }

    pub async fn client(&self) -> KvIndexerClient<Channel> {
        KvIndexerClient::connect(format!("http://{}", self.grpc_addr()))
            .await
            .expect("connect gRPC")
    }

    /// Readiness over plain HTTP (`/readyz`), for services that speak TLS.
    pub async fn wait_ready_http(&self) {
        let deadline = Instant::now() + budget(30);
        loop {
            let port = self.metrics_port;
            let ready = tokio::task::spawn_blocking(move || {
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            })
            .await
            .unwrap_or(false);
            if ready && self.http_get("/readyz").0 == 200 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not ready; logs:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_serving(&self) {
        use tonic_health::pb::health_client::HealthClient;
        use tonic_health::pb::HealthCheckRequest;
        let deadline = Instant::now() + budget(30);
        loop {
            let channel = Channel::from_shared(format!("http://{}", self.grpc_addr()))
                .expect("uri")
                .connect()
                .await;
            if let Ok(mut c) = channel.map(HealthClient::new) {
                if let Ok(r) = c
                    .check(HealthCheckRequest {
                        service: "kvindexer.v1.KvIndexer".into(),
                    })
                    .await
                {
                    if r.into_inner().status == 1 {
                        return;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "service did not become ready; logs:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn list_pods(&self, model: &str) -> Vec<pb::PodInfo> {
        self.client()
            .await
            .list_pods(pb::ListPodsRequest {
                model: model.into(),
            })
            .await
            .expect("ListPods")
            .into_inner()
            .pods
    }

    /// Each pod's last applied seq (a DP rank's as its own pod).
    pub async fn last_seqs(&self, model: &str) -> BTreeMap<String, Option<u64>> {
        self.list_pods(model)
            .await
            .into_iter()
            .map(|p| (p.pod, p.last_seq))
            .collect()
    }

    /// Waits until every pod of `model` applied `batches[pod]` batches.
    pub async fn wait_applied(&self, model: &str, batches: &BTreeMap<String, u64>) {
        let deadline = Instant::now() + self.ingest_wait;
        loop {
            let pods = self.list_pods(model).await;
            let got: BTreeMap<String, u64> =
                pods.iter().map(|p| (p.pod.clone(), p.batches)).collect();
            if &got == batches {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not all batches applied: got {got:?}, want {batches:?}; logs:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Resident memory of the service process, in KiB.
    pub fn rss_kib(&self) -> u64 {
        self.proc_status_kib("VmRSS:")
    }

    /// The most resident memory the process ever had (`VmHWM`): what an
    /// attack made it allocate, even if freed since.
    pub fn peak_rss_kib(&self) -> u64 {
        self.proc_status_kib("VmHWM:")
    }

    fn proc_status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    /// Each thread of the service: its id, name and scheduling policy
    /// (`/proc/PID/task/TID/stat`, field 41: 0 `SCHED_OTHER`, 5 `SCHED_IDLE`).
    pub fn threads(&self) -> Vec<(u32, String, u32)> {
        let pid = self.child.id();
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc/PID/task");
        let mut threads = Vec::new();
        for task in tasks {
            let path = task.expect("a task").path();
            let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
                continue; // ended since
            };
            // "tid (name) state ...": fields counted from the state, field 3.
            let (head, fields) = stat.rsplit_once(')').expect("stat format");
            let (tid, name) = head.split_once(" (").expect("stat format");
            let policy = fields.split_whitespace().nth(41 - 3).expect("field 41");
            threads.push((
                tid.parse().expect("tid"),
                name.to_string(),
                policy.parse().expect("policy"),
            ));
        }
        threads
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process is still running (not crashed, not exited).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The value of the `/metrics` line starting with `series` (name and
    /// labels, e.g. `kv_indexer_refused_total{what="pod"}`), 0 if absent.
    pub fn metric(&self, series: &str) -> f64 {
        let (_, body) = self.http_get("/metrics");
        body.lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }

    /// Polls `series` until `done(value)` holds (bounded).
    pub async fn wait_metric(&self, series: &str, done: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + budget(30);
        loop {
            let v = self.metric(series);
            if done(v) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{series} stayed at {v}; logs:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls `done` until it holds, for at most 20 s, then fails with
    /// `what` and the service's log: a wait for a condition, where a fixed
    /// sleep would either waste time or be too short on a loaded machine.
    pub async fn wait_until(&self, what: &str, mut done: impl AsyncFnMut() -> bool) {
        let deadline = Instant::now() + budget(20);
        while !done().await {
            assert!(
                Instant::now() < deadline,
                "{what}: not within 20 s; logs:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL: no shutdown, no cleanup, as a crash.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Exit status after SIGTERM.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + budget(20);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            assert!(Instant::now() < deadline, "service ignored SIGTERM");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        } else {
            eprintln!("--- kv-indexer log ---\n{}", self.logs());
        }
    }
}

/// One recorded ZeroMQ message.
#[derive(Clone, Debug)]
pub struct RecordedFrame {
    pub topic: String,
    pub seq: u64,
    pub payload: Vec<u8>,
}

impl RecordedFrame {
    pub fn message(&self) -> ZmqMessage {
        zmq_message(vec![
            Bytes::from(self.topic.clone()),
            Bytes::copy_from_slice(&self.seq.to_be_bytes()),
            Bytes::from(self.payload.clone()),
        ])
    }

    pub fn pod(&self) -> &str {
        self.topic.split('@').nth(1).unwrap_or_default()
    }
}

/// vLLM's map-form `BlockStored` event, as msgspec encodes it.
#[derive(serde::Serialize)]
pub struct Stored {
    #[serde(rename = "type")]
    pub ty: &'static str,
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub medium: &'static str,
}

/// vLLM's map-form `BlockRemoved` event, as msgspec encodes it.
#[derive(serde::Serialize)]
pub struct Removed {
    #[serde(rename = "type")]
    pub ty: &'static str,
    pub block_hashes: Vec<u64>,
    pub medium: &'static str,
}

/// A batch payload (`(timestamp, [event], dp rank)`) of one stored block:
/// `hash`, with 16 tokens of its own.
pub fn one_block_store(hash: u64) -> Vec<u8> {
    let event = Stored {
        ty: "BlockStored",
        block_hashes: vec![hash],
        parent_block_hash: None,
        // Tokens of its own: a hash names one block's content, as vLLM's
        // do (one content under several hashes is one block, held once).
        token_ids: (0..16).map(|t| t + 16 * hash as u32).collect(),
        block_size: 16,
        medium: "GPU",
    };
    rmp_serde::to_vec_named(&(0.0f64, vec![event], 0u32)).expect("encode")
}

/// A multipart ZeroMQ message, frame by frame.
pub type ZmqMessage = Vec<Bytes>;

pub fn zmq_message(frames: Vec<Bytes>) -> ZmqMessage {
    frames
}

/// `vllm-events/NAME.frames.jsonl`, in arrival order.
pub fn load_frames(name: &str) -> Vec<RecordedFrame> {
    let path = fixtures_dir().join(format!("vllm-events/{name}.frames.jsonl"));
    read(&path)
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).expect("frame json");
            RecordedFrame {
                topic: v["topic"].as_str().expect("topic").to_owned(),
                seq: v["seq"].as_u64().expect("seq"),
                payload: base64::engine::general_purpose::STANDARD
                    .decode(v["payload_b64"].as_str().expect("payload"))
                    .expect("base64"),
            }
        })
        .collect()
}

/// Batches per pod in a frame list.
pub fn batches_per_pod(frames: &[RecordedFrame]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for f in frames {
        *out.entry(f.pod().to_owned()).or_default() += 1;
    }
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A probe from `NAME.expected.json`.
#[derive(Clone, Debug)]
pub struct Probe {
    pub id: String,
    pub token_ids: Vec<u32>,
    pub text: Option<String>,
    pub messages: Option<Value>,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    /// The request's multimodal items (`mm_features`), if it had any.
    pub mm_items: Vec<pb::MultimodalItem>,
    /// The prompt as vLLM's render server answers it (`GenerateRequest`).
    pub generate_request_json: Option<String>,
    pub text_roundtrips: bool,
    pub chat_roundtrips: bool,
    pub expected: BTreeMap<String, u32>,
}

#[derive(Clone)]
pub struct Expected {
    pub model: String,
    pub block_size: u32,
    pub pods: Vec<String>,
    pub probes: Vec<Probe>,
}

pub fn load_expected(stream: &str) -> Expected {
    let base = stream.split('.').next().unwrap_or(stream);
    let path = fixtures_dir().join(format!("vllm-events/{base}.expected.json"));
    let v: Value = serde_json::from_str(&read(&path)).expect("expected json");
    let meta = &v["meta"];
    Expected {
        model: meta["model"].as_str().expect("model").to_owned(),
        block_size: meta["block_size"].as_u64().expect("block_size") as u32,
        pods: meta["pods"]
            .as_array()
            .expect("pods")
            .iter()
            .map(|p| p["name"].as_str().expect("pod name").to_owned())
            .collect(),
        probes: v["probes"]
            .as_array()
            .expect("probes")
            .iter()
            .map(|p| Probe {
                id: p["id"].as_str().unwrap_or_default().to_owned(),
                token_ids: p["token_ids"]
                    .as_array()
                    .expect("token_ids")
                    .iter()
                    .map(|t| t.as_u64().expect("token") as u32)
                    .collect(),
                text: p["text"].as_str().map(str::to_owned),
                messages: p.get("messages").filter(|m| !m.is_null()).cloned(),
                lora_name: p["lora_name"].as_str().map(str::to_owned),
                cache_salt: p["cache_salt"].as_str().map(str::to_owned),
                mm_items: p["mm_items"]
                    .as_array()
                    .map(|items| {
                        items
                            .iter()
                            .map(|i| pb::MultimodalItem {
                                identifier: i["identifier"].as_str().expect("identifier").into(),
                                offset: i["offset"].as_u64().expect("offset") as u32,
                                length: i["length"].as_u64().expect("length") as u32,
                                modality: i["modality"].as_str().unwrap_or_default().into(),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                generate_request_json: p["generate_request_json"].as_str().map(str::to_owned),
                text_roundtrips: p["text_roundtrips"].as_bool().unwrap_or(false),
                chat_roundtrips: p["chat_roundtrips"].as_bool().unwrap_or(false),
                expected: p["expected_cached_blocks"]
                    .as_object()
                    .expect("expected_cached_blocks")
                    .iter()
                    .map(|(k, n)| (k.clone(), n.as_u64().expect("count") as u32))
                    .collect(),
            })
            .collect(),
    }
}

/// The vendored Qwen3 tokenizer, mapped to the fixture streams' model name.
pub fn qwen3_tokenizer_arg() -> String {
    format!(
        "Qwen/Qwen3-8B={}",
        fixtures_dir().join("tokenizers/qwen3").display()
    )
}

/// Score request for a probe's token ids.
pub fn token_request(model: &str, probe: &Probe) -> pb::ScoreRequest {
    pb::ScoreRequest {
        model: model.into(),
        input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
            ids: probe.token_ids.clone(),
        })),
        lora_name: probe.lora_name.clone().unwrap_or_default(),
        cache_salt: probe.cache_salt.clone().unwrap_or_default(),
        mm_items: probe.mm_items.clone(),
        ..Default::default()
    }
}

/// Scores every probe of `expected` by token ids, in order.
pub async fn probe_answers<'a>(
    service: &Service,
    expected: &'a Expected,
) -> Vec<(&'a Probe, pb::ScoreResponse)> {
    let mut client = service.client().await;
    let mut answers = Vec::with_capacity(expected.probes.len());
    for probe in &expected.probes {
        let resp = client
            .score(token_request(&expected.model, probe))
            .await
            .expect("Score")
            .into_inner();
        answers.push((probe, resp));
    }
    answers
}

/// Scores every probe by token ids and checks every pod's matched blocks.
pub async fn check_probes(service: &Service, expected: &Expected) {
    for (probe, resp) in probe_answers(service, expected).await {
        assert_matches(&resp, probe);
    }
}

/// Every probe of `expected`: `pod` answers what the recording says
/// `as_pod` held (a pod whose engine restarted with another pod's run).
pub async fn assert_answers_as(service: &Service, expected: &Expected, pod: &str, as_pod: &str) {
    for (probe, resp) in probe_answers(service, expected).await {
        assert_answer_as(&resp, probe, pod, as_pod);
    }
}

/// `resp` gives `pod` the blocks the recording says `as_pod` held for
/// `probe` (`as_pod` = `pod`: its own).
pub fn assert_answer_as(resp: &pb::ScoreResponse, probe: &Probe, pod: &str, as_pod: &str) {
    let got = resp
        .pods
        .iter()
        .find(|p| p.pod == pod)
        .map_or(0, |p| p.matched_blocks);
    let want = probe.expected.get(as_pod).copied().unwrap_or(0);
    assert_eq!(got, want, "{pod} as {as_pod}, probe {}: {resp:?}", probe.id);
}

pub fn assert_matches(resp: &pb::ScoreResponse, probe: &Probe) {
    let got: HashMap<&str, u32> = resp
        .pods
        .iter()
        .map(|p| (p.pod.as_str(), p.matched_blocks))
        .collect();
    for (pod, want) in &probe.expected {
        assert_eq!(
            got.get(pod.as_str()).copied().unwrap_or(0),
            *want,
            "probe {} pod {pod}: response {resp:?}",
            probe.id
        );
    }
}

/// A ZeroMQ PUB socket (libzmq, as vLLM's pyzmq) standing in for vLLM's
/// publisher.
pub struct Publisher {
    pub socket: kv_indexer::zmq_io::Publisher,
}

/// One libzmq context for a test process's publishers.
pub fn zmq_context() -> &'static zmq::Context {
    static CONTEXT: std::sync::OnceLock<zmq::Context> = std::sync::OnceLock::new();
    CONTEXT.get_or_init(zmq::Context::new)
}

pub const WARMUP_MODEL: &str = "warmup-model";

impl Publisher {
    /// Connects to the indexer's bound SUB socket (vLLM's default mode).
    pub async fn connect(endpoint: &str) -> Publisher {
        let socket =
            kv_indexer::zmq_io::Publisher::connect(zmq_context(), endpoint).expect("PUB connect");
        Publisher { socket }
    }

    /// Binds for the indexer to dial; returns the endpoint.
    pub async fn bind() -> (Publisher, String) {
        Publisher::bind_on("tcp://127.0.0.1:0").await
    }

    pub async fn bind_on(endpoint: &str) -> (Publisher, String) {
        Publisher::try_bind_on(endpoint).expect("PUB bind")
    }

    /// `bind_on`, or `None` while the address is still taken (e.g. by a
    /// publisher just dropped: libzmq closes its listener asynchronously).
    pub fn try_bind_on(endpoint: &str) -> Option<(Publisher, String)> {
        let (socket, endpoint) =
            kv_indexer::zmq_io::Publisher::bind(zmq_context(), endpoint).ok()?;
        Some((Publisher { socket }, endpoint))
    }

    /// Publishes markers for a while and reports whether any arrived.
    pub async fn reaches(&mut self, service: &Service, marker_pod: &str) -> bool {
        let empty_batch = rmp_serde::to_vec(&(0.0f64, Vec::<u8>::new())).expect("encode");
        for _ in 0..20 {
            self.send(zmq_message(vec![
                Bytes::from(format!("kv@{marker_pod}@{WARMUP_MODEL}")),
                Bytes::copy_from_slice(&0u64.to_be_bytes()),
                Bytes::from(empty_batch.clone()),
            ]))
            .await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            if service
                .list_pods(WARMUP_MODEL)
                .await
                .iter()
                .any(|p| p.pod == marker_pod)
            {
                return true;
            }
        }
        false
    }

    pub async fn send(&mut self, msg: ZmqMessage) {
        self.socket.send(&msg).expect("PUB send");
    }

    /// PUB drops everything until the subscription has arrived (ZeroMQ's
    /// "slow joiner"): publish a marker batch until the indexer has seen it.
    pub async fn wait_subscribed(&mut self, service: &Service, marker_pod: &str) {
        let deadline = Instant::now() + service.ingest_wait;
        while !self.reaches(service, marker_pod).await {
            assert!(Instant::now() < deadline, "subscription never arrived");
        }
    }

    pub async fn publish_all<'a>(&mut self, frames: impl IntoIterator<Item = &'a RecordedFrame>) {
        for f in frames {
            self.send(f.message()).await;
        }
    }
}

impl Service {
    /// Connects a publisher to this (bind-mode) service, publishes `frames`
    /// once it is subscribed, and waits until every batch is applied. The
    /// publisher stays connected for more.
    pub async fn publish_recorded(&self, model: &str, frames: &[RecordedFrame]) -> Publisher {
        let mut publisher = Publisher::connect(self.zmq_bind.as_deref().unwrap()).await;
        publisher.wait_subscribed(self, "marker").await;
        publisher.publish_all(frames).await;
        self.wait_applied(model, &batches_per_pod(frames)).await;
        publisher
    }
}

/// Each request fails with its code, with a message that mentions the text.
pub async fn assert_score_errors(
    client: &mut KvIndexerClient<Channel>,
    cases: impl IntoIterator<Item = (pb::ScoreRequest, tonic::Code, &'static str)>,
) {
    for (req, code, mentions) in cases {
        let status = client.score(req).await.expect_err("must fail");
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(mentions), "{status:?}");
    }
}

/// The service (bind mode, `args`) with all of a recorded stream applied.
pub async fn serve_recorded(stream: &str, args: &[&str]) -> (Service, Expected, Publisher) {
    let expected = load_expected(stream);
    let service = Service::start(args).await;
    let publisher = service
        .publish_recorded(&expected.model, &load_frames(stream))
        .await;
    (service, expected, publisher)
}

/// A minimal Hugging Face Hub on loopback: serves `/{repo}/resolve/main/{file}`
/// from a directory the way hf-hub expects (ranges, `etag`,
/// `x-repo-commit`, `content-range`), and checks the bearer token.
pub struct FakeHub {
    pub endpoint: String,
    pub requests: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl FakeHub {
    pub fn serve(repo: &str, dir: PathBuf, token: &str) -> FakeHub {
        use std::io::{BufRead, BufReader, Write};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake hub");
        let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = requests.clone();
        let prefix = format!("/{repo}/resolve/main/");
        let auth = format!("bearer {token}");
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut request_line = String::new();
                if reader.read_line(&mut request_line).is_err() {
                    continue;
                }
                let (mut range_start, mut range_end, mut authorized) = (None, None, false);
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                        break;
                    }
                    let lower = line.to_ascii_lowercase();
                    if let Some(r) = lower.strip_prefix("range: bytes=") {
                        let (a, b) = r.trim().split_once('-').unwrap_or((r.trim(), ""));
                        range_start = a.parse::<usize>().ok();
                        range_end = b.parse::<usize>().ok();
                    }
                    if lower.trim() == format!("authorization: {auth}") {
                        authorized = true;
                    }
                }
                let path = request_line
                    .split_whitespace()
                    .nth(1)
                    .unwrap_or("")
                    .to_owned();
                log.lock().unwrap().push(path.clone());
                let file = path.strip_prefix(&prefix).map(|f| dir.join(f));
                let body = match (&file, authorized) {
                    (Some(f), true) => std::fs::read(f).ok(),
                    _ => None,
                };
                let response = match body {
                    None => {
                        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                            .to_vec()
                    }
                    Some(body) => {
                        let start = range_start.unwrap_or(0).min(body.len());
                        // Inclusive end (hf-hub's metadata probe asks for bytes=0-0).
                        let end = range_end.map_or(body.len(), |e| (e + 1).min(body.len()));
                        let chunk = &body[start..end.max(start)];
                        let mut r = format!(
                            "HTTP/1.1 206 Partial Content\r\netag: \"etag-{}\"\r\nx-repo-commit: 0123456789abcdef\r\ncontent-range: bytes {start}-{}/{}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                            body.len(),
                            end.max(start + 1) - 1,
                            body.len(),
                            chunk.len()
                        )
                        .into_bytes();
                        r.extend_from_slice(chunk);
                        r
                    }
                };
                let _ = stream.write_all(&response);
            }
        });
        FakeHub { endpoint, requests }
    }
}

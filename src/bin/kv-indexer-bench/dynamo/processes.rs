//! The two indexers as processes on loopback (ours dialing the pods,
//! Dynamo's standalone indexer with each pod registered over HTTP), and the
//! pods' bound PUB sockets.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_indexer::proto::kvindexer::v1::kv_indexer_client::KvIndexerClient;
use kv_indexer::zmq_io::Publisher;
use serde_json::json;
use tonic::transport::Channel;

use super::http::Http;
use super::{BINARY, DYNAMO_THREADS};
use crate::{connect, free_port, Opts, Spawned, BLOCK, MODEL};

/// The two indexers under test and how to reach them.
pub(super) struct Peers {
    _ours: Spawned,
    _dynamo: Spawned,
    pub(super) ours: KvIndexerClient<Channel>,
    pub(super) ours_grpc: String,
    pub(super) ours_metrics: String,
    pub(super) dynamo: Arc<Http>,
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
pub(super) async fn start(o: &Opts, endpoints: &[String]) -> Peers {
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
pub(super) async fn register(http: &Http, instance_id: u64, endpoint: &str) {
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
pub(super) struct Pods {
    pub(super) names: Vec<String>,
    pub(super) publishers: [Vec<Option<Publisher>>; 2],
    pub(super) endpoints: [Vec<String>; 2],
}

pub(super) fn bind_pods(context: &zmq::Context, names: Vec<String>) -> Pods {
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

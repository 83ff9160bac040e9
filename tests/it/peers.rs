//! Replicas of one fleet (`--peer`): a replica started late copies a Ready
//! peer's index before it reports Ready, and answers exactly what vLLM
//! holds, although the pods' replay buffers no longer reach back to the
//! prefixes their first batches stored; peers that are not of the fleet
//! (another secret, other keys) are refused by name; with no Ready peer a
//! replica starts after `--peer-wait`.

use std::collections::BTreeMap;

use crate::common::vllm_pod::{Fleet, PodOptions};
use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;

const STREAM: &str = "qwen3-sha256-int";

/// A file holding `secret`, as a mounted Secret would.
fn token_file(dir: &tempfile::TempDir, name: &str, secret: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Waits until `service` applied every pod's batches up to seq `n - 1`
/// (`n` per pod in `per_pod`).
async fn wait_last_seq(service: &Service, model: &str, per_pod: &BTreeMap<String, u64>) {
    let want: BTreeMap<String, Option<u64>> = per_pod
        .iter()
        .map(|(pod, n)| (pod.clone(), Some(n - 1)))
        .collect();
    service
        .wait_until("every pod's last batch applied", async || {
            service.last_seqs(model).await == want
        })
        .await;
}

/// The pods' replay buffers keep 4 batches. Replica A dials them from the
/// start; B starts after half of every pod's stream, when the buffers hold
/// only its last 4 batches, and copies A's index (`--peer`). Both then
/// follow the rest of the streams and answer every recorded probe as vLLM
/// held it. Without the copy, B would know only the batches still in the
/// buffers and miss the prefixes stored before them.
#[tokio::test]
async fn a_late_replica_copies_a_peer_and_answers_as_vllm_holds() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "token", "fleet-secret");
    let fleet = Fleet::start(STREAM, |_| PodOptions {
        buffer: 4,
        ..PodOptions::default()
    });
    let targets = fleet.targets();
    let model = fleet.expected.model.clone();
    let a = Service::start_dialing(&targets, &["--peer-token-file", &token]).await;
    fleet.wait_subscribed(&a, "a").await;
    fleet.publish(|n| (0, n / 2));
    let half: BTreeMap<String, u64> = fleet
        .per_pod
        .iter()
        .map(|(p, n)| (p.clone(), n / 2))
        .collect();
    a.wait_applied(&model, &half).await;

    let peer = a.grpc_addr();
    let b = Service::start_dialing(&targets, &["--peer", &peer, "--peer-token-file", &token]).await;
    assert!(
        b.logs().contains("index copied from a peer replica"),
        "{}",
        b.logs()
    );
    assert_eq!(b.metric("kv_indexer_started_from{from=\"peer\"}"), 1.0);
    assert!(a.metric("kv_indexer_peer_snapshot_bytes_sent_total") > 0.0);
    fleet.wait_subscribed(&b, "b").await;
    fleet.publish(|n| (n / 2, n));
    for service in [&a, &b] {
        wait_last_seq(service, &model, &fleet.per_pod).await;
        check_probes(service, &fleet.expected).await;
    }
    for pod in b.list_pods(&model).await {
        assert!(!pod.incomplete, "{} is exact: {pod:?}", pod.pod);
    }
}

/// A peer that is not of the fleet gives nothing: another secret, none at
/// all, other keys. Each refusal is logged by name and counted, and the
/// replica starts after `--peer-wait`, empty; so does one whose peers do
/// not answer.
#[tokio::test]
async fn peers_not_of_the_fleet_are_refused_and_the_replica_starts_alone() {
    let dir = tempfile::tempdir().unwrap();
    let secret = token_file(&dir, "secret", "fleet-secret");
    let other = token_file(&dir, "other", "another-fleet");
    let a = Service::start(&["--peer-token-file", &secret]).await;
    let open = Service::start(&[]).await;
    let (peer, no_token_peer) = (a.grpc_addr(), open.grpc_addr());
    let silent = format!("127.0.0.1:{}", free_port());

    let wrong = Service::start(&[
        "--peer",
        &peer,
        "--peer-token-file",
        &other,
        "--peer-wait",
        "1s",
    ])
    .await;
    wrong.wait_log("wrong or missing peer token").await;
    assert!(wrong.metric("kv_indexer_peer_bootstrap_failures_total{reason=\"auth\"}") >= 1.0);
    assert_eq!(wrong.metric("kv_indexer_started_from{from=\"empty\"}"), 1.0);
    assert!(a.metric("kv_indexer_peer_snapshots_served_total{outcome=\"refused\"}") >= 1.0);

    let off = Service::start(&[
        "--peer",
        &no_token_peer,
        "--peer-token-file",
        &secret,
        "--peer-wait",
        "1s",
    ])
    .await;
    off.wait_log("peer RPCs are off").await;

    let engine_keys = Service::start(&[
        "--peer",
        &peer,
        "--peer-token-file",
        &secret,
        "--peer-wait",
        "1s",
        "--key-mode",
        "engine",
    ])
    .await;
    engine_keys.wait_log("key configuration differs").await;
    assert!(engine_keys.metric("kv_indexer_peer_bootstrap_failures_total{reason=\"keys\"}") >= 1.0);

    // The secrets are never printed: not in logs, not by `check`.
    for service in [&a, &wrong, &off, &engine_keys] {
        let (_, metrics) = service.http_get("/metrics");
        for secret in ["fleet-secret", "another-fleet"] {
            assert!(!service.logs().contains(secret) && !metrics.contains(secret));
        }
    }
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args(["--peer-token-file", &secret, "check"])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{shown}");
    assert!(
        shown.contains("Secret(***)") && !shown.contains("fleet-secret"),
        "{shown}"
    );

    let alone = Service::start(&["--peer", &silent, "--peer-wait", "1s"]).await;
    alone
        .wait_log("no peer replica gave its index within --peer-wait")
        .await;
    assert_eq!(alone.metric("kv_indexer_started_from{from=\"empty\"}"), 1.0);
}

/// Ready means exact: a replica restored from a snapshot reports Ready only
/// once each dialed pod's replay buffer is applied. The pods published
/// three more batches while it was down, and answer replay requests 300 ms
/// late; the moment it is Ready, it has applied them (it used to be Ready
/// at once, its pods still where the snapshot left them).
#[tokio::test]
async fn a_restored_replica_is_ready_only_once_its_dialed_pods_are_caught_up() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().to_str().unwrap();
    let fleet = Fleet::start(STREAM, |_| PodOptions {
        buffer: 4,
        reply_delay: std::time::Duration::from_millis(300),
        ..PodOptions::default()
    });
    let targets = fleet.targets();
    let model = fleet.expected.model.clone();
    let first = Service::start_dialing(&targets, &["--snapshot-dir", snap]).await;
    fleet.wait_subscribed(&first, "first").await;
    let half = |n: u64| n / 2;
    fleet.publish(|n| (0, half(n)));
    let applied: BTreeMap<String, u64> = fleet
        .per_pod
        .iter()
        .map(|(p, n)| (p.clone(), half(*n)))
        .collect();
    first.wait_applied(&model, &applied).await;
    assert!(first.terminate().await.success());
    // While it is down: three batches more per pod, still in the buffers.
    let more = |n: u64| (half(n) + 3).min(n);
    fleet.publish(|n| (half(n), more(n)));

    let second = Service::start_dialing(&targets, &["--snapshot-dir", snap]).await;
    assert_caught_up(&second, &fleet, more).await;
    assert_eq!(
        second.metric("kv_indexer_started_from{from=\"snapshot\"}"),
        1.0
    );
}

/// The same in bind mode: the pods connect to the replica and their
/// replay endpoints are configured (`--replay-endpoint`). A restored
/// replica fetches each pod's buffer when it starts, without waiting for
/// the pod to publish (these stay idle), and is Ready only once it applied
/// them (they answer 300 ms late); it used to be Ready at once, its pods
/// where the snapshot left them until they next published.
#[tokio::test]
async fn a_restored_replica_in_bind_mode_is_ready_only_once_its_pods_are_caught_up() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().to_str().unwrap();
    let fleet = Fleet::start(STREAM, |_| PodOptions {
        reply_delay: std::time::Duration::from_millis(300),
        ..PodOptions::default()
    });
    let model = fleet.expected.model.clone();
    let replay: Vec<String> = fleet
        .pubs
        .iter()
        .map(|(pod, p)| format!("{pod}={}", p.target.split("replay=").nth(1).unwrap()))
        .collect();
    let zmq = format!("tcp://127.0.0.1:{}", free_port());
    let mut args = vec!["--zmq-bind", &zmq, "--snapshot-dir", snap];
    for r in &replay {
        args.extend(["--replay-endpoint", r.as_str()]);
    }
    let half = |n: u64| n / 2;
    let first = Service::start_raw(&args, Some(zmq.clone())).await;
    let mut publisher = Publisher::connect(&zmq).await;
    publisher.wait_subscribed(&first, "first").await;
    let frames = load_frames(STREAM);
    for (pod, p) in &fleet.pubs {
        let n = fleet.per_pod[pod.as_str()];
        p.publish(0, half(n) as usize, &Default::default());
        for f in frames
            .iter()
            .filter(|f| f.pod() == pod.as_str() && f.seq < half(n))
        {
            publisher.send(f.message()).await;
        }
    }
    let applied: BTreeMap<String, u64> = fleet
        .per_pod
        .iter()
        .map(|(p, n)| (p.clone(), half(*n)))
        .collect();
    wait_last_seq(&first, &model, &applied).await;
    assert!(first.terminate().await.success());
    // While it is down: three batches more per pod, in their buffers.
    let more = |n: u64| (half(n) + 3).min(n);
    fleet.publish(|n| (half(n), more(n)));

    let second = Service::start_raw(&args, Some(zmq.clone())).await;
    assert_caught_up(&second, &fleet, more).await;
}

/// `service`, just Ready, applied each pod's batches up to position
/// `upto(n)` (of its `n`), and none of them is incomplete.
async fn assert_caught_up(service: &Service, fleet: &Fleet, upto: impl Fn(u64) -> u64) {
    let pods = service.list_pods(&fleet.expected.model).await;
    for (pod, n) in &fleet.per_pod {
        let p = pods.iter().find(|p| &p.pod == pod).expect("restored");
        assert_eq!(
            p.last_seq,
            Some(upto(*n) - 1),
            "{pod} caught up before Ready: {p:?}"
        );
        assert!(!p.incomplete, "{p:?}");
    }
}

/// Every pod's matched blocks for every probe, by probe and pod.
async fn answers(service: &Service, expected: &Expected) -> Vec<BTreeMap<String, u32>> {
    probe_answers(service, expected)
        .await
        .into_iter()
        .map(|(_, resp)| {
            resp.pods
                .into_iter()
                .map(|p| (p.pod, p.matched_blocks))
                .collect()
        })
        .collect()
}

/// `pod`'s speculative blocks for the prompt `tokens`, as `service` scores
/// it.
async fn speculative_blocks(service: &Service, model: &str, tokens: &[u32], pod: &str) -> u32 {
    service
        .score_token_ids(model, tokens.to_vec())
        .await
        .pods
        .iter()
        .find(|p| p.pod == pod)
        .map_or(0, |p| p.speculative_blocks)
}

/// A rolling restart of three replicas while the pods publish at a steady
/// pace, buffers of 64 batches (3.2 s of it), from half of the streams on:
/// three times, a new replica
/// copies a live one (`--peer`, every other replica listed), reports Ready,
/// and the oldest stops. After each step, with publishing paused, the new
/// replica answers every probe as a replica that ran throughout; at the
/// end every replica answers as vLLM held.
#[tokio::test]
async fn a_rolling_restart_under_a_steady_stream_keeps_every_replica_exact() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "token", "fleet-secret");
    let fleet = Fleet::start(STREAM, |_| PodOptions {
        buffer: 64,
        ..PodOptions::default()
    });
    let targets = fleet.targets();
    let (model, expected, per_pod) = (
        fleet.expected.model.clone(),
        fleet.expected.clone(),
        fleet.per_pod.clone(),
    );
    let mut replicas = Vec::new();
    for _ in 0..3 {
        let r = Service::start_dialing(&targets, &["--peer-token-file", &token]).await;
        fleet.wait_subscribed(&r, "start").await;
        replicas.push(r);
    }
    let (paused, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let publisher = {
        let (paused, done) = (paused.clone(), done.clone());
        let longest = *per_pod.values().max().unwrap();
        std::thread::spawn(move || {
            for k in 0..longest {
                while paused.load(Ordering::Acquire) {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                fleet.publish(|n| (k.min(n), (k + 1).min(n)));
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            done.store(true, Ordering::Release);
        })
    };
    // The restarts begin once half of every stream went by: what the pods
    // stored first is then long out of their buffers.
    replicas[0]
        .wait_until("half of every stream applied", async || {
            let seqs = replicas[0].last_seqs(&model).await;
            per_pod
                .iter()
                .all(|(pod, n)| seqs.get(pod).copied().flatten() >= Some(n / 2))
        })
        .await;
    for step in 0..3 {
        let peers: Vec<String> = replicas.iter().map(|r| r.grpc_addr()).collect();
        let mut args = vec!["--peer-token-file", token.as_str()];
        for p in &peers {
            args.extend(["--peer", p.as_str()]);
        }
        let new = Service::start_dialing(&targets, &args).await;
        assert_eq!(
            new.metric("kv_indexer_started_from{from=\"peer\"}"),
            1.0,
            "step {step}: {}",
            new.logs()
        );
        // Quiet, then both where the pods are.
        paused.store(true, Ordering::Release);
        let reference = replicas.last().unwrap();
        new.wait_until("the new replica where the reference is", async || {
            let want = reference.last_seqs(&model).await;
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            want == reference.last_seqs(&model).await && want == new.last_seqs(&model).await
        })
        .await;
        assert_eq!(
            answers(&new, &expected).await,
            answers(reference, &expected).await,
            "step {step}: the new replica answers as one that ran throughout"
        );
        paused.store(false, Ordering::Release);
        let oldest = replicas.remove(0);
        assert!(oldest.terminate().await.success());
        replicas.push(new);
    }
    while !done.load(Ordering::Acquire) {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    publisher.join().unwrap();
    for r in &replicas {
        wait_last_seq(r, &model, &per_pod).await;
        check_probes(r, &expected).await;
    }
}

/// Routing feedback on every replica: a `RecordRouting` accepted by A is
/// forwarded to B (each lists the other with `--peer`), so a router
/// balancing per request finds its pick's speculative blocks on B's next
/// `Score`; a replica C started after it copies A's live entries with its
/// index; all end with the TTL A gave them. A prompt handle from A's
/// `Score` is unknown to B, which says to send the prompt.
#[tokio::test]
async fn a_routing_recorded_on_one_replica_is_speculative_on_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "token", "fleet-secret");
    let stream = load_frames(STREAM);
    let expected = load_expected(STREAM);
    let b_addr = format!("127.0.0.1:{}", free_port());
    let ttl = ["--speculative-ttl", "4s", "--peer-token-file", &token];
    let mut a_args = vec!["--peer", &b_addr, "--peer-wait", "1s"];
    a_args.extend(ttl);
    let a = Service::start(&a_args).await;
    let a_addr = a.grpc_addr();
    let mut b_args = vec!["--grpc-addr", &b_addr, "--peer", &a_addr];
    b_args.extend(ttl);
    let b = Service::start(&b_args).await;
    for service in [&a, &b] {
        let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
        publisher.wait_subscribed(service, "marker").await;
        publisher.publish_all(&stream).await;
        service
            .wait_applied(&expected.model, &batches_per_pod(&stream))
            .await;
    }
    // A prompt no pod holds: all 8 of its blocks become speculative.
    let tokens: Vec<u32> = (0..8 * expected.block_size).map(|i| 900_000 + i).collect();
    let pod = expected.pods[0].clone();
    let recorded = a
        .client()
        .await
        .record_routing(pb::RecordRoutingRequest {
            model: expected.model.clone(),
            pod: pod.clone(),
            input: Some(pb::record_routing_request::Input::TokenIds(pb::TokenIds {
                ids: tokens.clone(),
            })),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(recorded.speculative_blocks, 8, "{recorded:?}");
    let speculative = async |service: &Service| -> u32 {
        speculative_blocks(service, &expected.model, &tokens, &pod).await
    };
    b.wait_until("A's routing speculative on B", async || {
        speculative(&b).await == 8
    })
    .await;
    assert!(b.metric("kv_indexer_peer_routings_received_total{outcome=\"written\"}") >= 1.0);
    let c = Service::start(&["--peer", &a_addr, "--peer-token-file", &token]).await;
    c.wait_until("A's live routing on C, which copied A", async || {
        speculative(&c).await == 8
    })
    .await;
    // All end with A's TTL.
    for service in [&a, &b, &c] {
        service
            .wait_until("the speculative entries ended", async || {
                speculative(service).await == 0
            })
            .await;
    }

    let handle = a
        .score_token_ids(&expected.model, tokens.clone())
        .await
        .prompt_handle;
    let err = b
        .client()
        .await
        .record_routing(pb::RecordRoutingRequest {
            model: expected.model.clone(),
            pod,
            input: Some(pb::record_routing_request::Input::PromptHandle(handle)),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(err.message().contains("send the prompt"), "{err:?}");
}

/// A peer that sends the first half of a real snapshot, then ends the
/// stream as if it died: what a starting replica gets when its source goes
/// away mid-transfer.
struct HalfPeer(Vec<u8>);

#[tonic::async_trait]
impl pb::kv_indexer_peer_server::KvIndexerPeer for HalfPeer {
    type SnapshotStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::PeerSnapshotChunk, tonic::Status>>;

    async fn snapshot(
        &self,
        _: tonic::Request<pb::PeerSnapshotRequest>,
    ) -> Result<tonic::Response<Self::SnapshotStream>, tonic::Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let half = self.0[..self.0.len() / 2].to_vec();
        tokio::spawn(async move {
            let _ = tx.send(Ok(pb::PeerSnapshotChunk { data: half })).await;
            let _ = tx
                .send(Err(tonic::Status::unavailable("connection reset")))
                .await;
        });
        Ok(tonic::Response::new(rx.into()))
    }

    type LiveStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::PeerRoutedRequest, tonic::Status>>;

    async fn routed(
        &self,
        _: tonic::Request<pb::PeerRoutedRequest>,
    ) -> Result<tonic::Response<pb::PeerRoutedResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("a half peer"))
    }

    async fn live(
        &self,
        _: tonic::Request<pb::PeerSnapshotRequest>,
    ) -> Result<tonic::Response<Self::LiveStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("a half peer"))
    }
}

/// The first peer dies mid-transfer: nothing of its half is kept, the next
/// peer's index is copied whole, and the replica answers as that peer
/// does. With the dead peer alone, the replica starts empty after
/// `--peer-wait`, never with a half index.
#[tokio::test]
async fn a_peer_dying_mid_transfer_leaves_nothing_and_the_next_one_is_copied() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    let token = token_file(&dir, "token", "fleet-secret");
    let stream = load_frames(STREAM);
    let expected = load_expected(STREAM);
    let source = Service::start(&[
        "--peer-token-file",
        &token,
        "--snapshot-dir",
        snap.to_str().unwrap(),
    ])
    .await;
    let mut publisher = Publisher::connect(source.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&source, "marker").await;
    publisher.publish_all(&stream).await;
    source
        .wait_applied(&expected.model, &batches_per_pod(&stream))
        .await;
    // A real snapshot of that index, for the dying peer to send half of.
    let copy = Service::start(&[
        "--peer",
        &source.grpc_addr(),
        "--peer-token-file",
        &token,
        "--snapshot-dir",
        dir.path().join("copy").to_str().unwrap(),
    ])
    .await;
    assert!(copy.terminate().await.success());
    let bytes = std::fs::read(dir.path().join("copy/kv-indexer.snapshot")).unwrap();

    let dying = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dying_addr = dying.local_addr().unwrap().to_string();
    dying.set_nonblocking(true).unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(
        tokio::net::TcpListener::from_std(dying).unwrap(),
    );
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::kv_indexer_peer_server::KvIndexerPeerServer::new(
                HalfPeer(bytes),
            ))
            .serve_with_incoming(incoming),
    );

    let alone = Service::start(&[
        "--peer",
        &dying_addr,
        "--peer-token-file",
        &token,
        "--peer-wait",
        "1s",
    ])
    .await;
    alone.wait_log("connection reset").await;
    assert_eq!(alone.metric("kv_indexer_started_from{from=\"empty\"}"), 1.0);
    assert!(
        alone.list_pods(&expected.model).await.is_empty(),
        "no half index"
    );

    let next = Service::start(&[
        "--peer",
        &dying_addr,
        "--peer",
        &source.grpc_addr(),
        "--peer-token-file",
        &token,
    ])
    .await;
    assert_eq!(next.metric("kv_indexer_started_from{from=\"peer\"}"), 1.0);
    check_probes(&next, &expected).await;
}

/// Two replicas started together, each naming the other: neither serves
/// before it is Ready, so neither waits for the other past its
/// `--peer-wait`.
#[tokio::test]
async fn two_replicas_started_together_do_not_wait_on_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "token", "fleet-secret");
    let (pa, pb_) = (free_port(), free_port());
    let (a_addr, b_addr) = (format!("127.0.0.1:{pa}"), format!("127.0.0.1:{pb_}"));
    let started = std::time::Instant::now();
    let a_args = [
        "--grpc-addr",
        &a_addr,
        "--peer",
        &b_addr,
        "--peer-token-file",
        &token,
        "--peer-wait",
        "1s",
    ];
    let b_args = [
        "--grpc-addr",
        &b_addr,
        "--peer",
        &a_addr,
        "--peer-token-file",
        &token,
        "--peer-wait",
        "1s",
    ];
    let (a, b) = tokio::join!(Service::start(&a_args), Service::start(&b_args));
    // Each is up within its --peer-wait (and the machine's slack): empty,
    // or (if the other was Ready before its own last round) a copy of it.
    assert!(started.elapsed() < crate::common::budget(10));
    for r in [&a, &b] {
        let from = r.metric("kv_indexer_started_from{from=\"empty\"}")
            + r.metric("kv_indexer_started_from{from=\"peer\"}");
        assert_eq!(from, 1.0, "{}", r.logs());
    }
}

/// A replica copies a peer while the pods change under it, every change
/// after the copy's cut (the source writes its whole snapshot before it
/// sends a byte, and the changes wait for its first): one pod's engine
/// restarts (a new run from seq 0), one clears its cache
/// (`AllBlocksCleared`), one's batch is lost on the way (a gap its buffer
/// repairs). The new replica sees each itself, following the pods from
/// the cut's seqs, and ends answering every probe as the one that saw it
/// all live.
#[tokio::test]
async fn a_copy_taken_while_pods_restart_clear_and_lose_a_batch_ends_exact() {
    use crate::common::vllm_pod::{Batch, VllmPod};
    use std::collections::HashSet;

    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "token", "fleet-secret");
    let expected = load_expected(STREAM);
    let (px, py, pz) = (&expected.pods[0], &expected.pods[1], &expected.pods[2]);
    let options = PodOptions {
        buffer: 64,
        ..PodOptions::default()
    };
    let x = VllmPod::start(STREAM, px, options);
    let z = VllmPod::start(STREAM, pz, options);
    // pod y: its recorded batches with an AllBlocksCleared at its half.
    let recorded_y = VllmPod::start(STREAM, py, options).frames().to_vec();
    let half_y = recorded_y.len() / 2;
    let clear = bytes::Bytes::from(
        rmp_serde::to_vec(&(0.0f64, vec![("AllBlocksCleared",)], 0u32)).unwrap(),
    );
    let mut y_frames: Vec<Batch> = recorded_y[..half_y].to_vec();
    y_frames.push((recorded_y[0].0.clone(), half_y as u64, clear));
    for (topic, seq, payload) in &recorded_y[half_y..] {
        y_frames.push((topic.clone(), seq + 1, payload.clone()));
    }
    // The clears of y's batches from the inserted one on: what a replica
    // following y from before it sees.
    let y_clears = y_frames[half_y..]
        .iter()
        .flat_map(|(_, _, payload)| indexer::wire::decode_batch(payload).unwrap().events)
        .filter(|e| matches!(e, indexer::event::KvEvent::AllCleared))
        .count() as u64;
    let y = VllmPod::with_batches(y_frames, options);
    // pod x's engine restarts with pod z's run under its own topic.
    let new_run: Vec<Batch> = z
        .frames()
        .iter()
        .map(|(_, seq, payload)| (x.frames()[0].0.clone(), *seq, payload.clone()))
        .collect();
    let targets = vec![x.target.clone(), y.target.clone(), z.target.clone()];
    let a = Service::start_dialing(&targets, &["--peer-token-file", &token]).await;
    for (p, tag) in [(&x, "x"), (&y, "y"), (&z, "z")] {
        p.wait_subscribed(&a, tag).await;
    }
    let (nx, nz) = (x.batches(), z.batches());
    x.publish(0, nx / 2, &HashSet::new());
    y.publish(0, half_y, &HashSet::new());
    z.publish(0, nz / 2, &HashSet::new());
    let model = expected.model.clone();
    let half = BTreeMap::from([
        (px.clone(), (nx / 2) as u64),
        (py.clone(), half_y as u64),
        (pz.clone(), (nz / 2) as u64),
    ]);
    a.wait_applied(&model, &half).await;

    // B starts while the pods change.
    let peer = a.grpc_addr();
    let b_args = ["--peer", peer.as_str(), "--peer-token-file", token.as_str()];
    let changes = async {
        while a.metric("kv_indexer_peer_snapshot_bytes_sent_total") == 0.0 {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        let gap = HashSet::from([(nz / 2 + 1) as u64]);
        z.publish(nz / 2, nz / 2 + 4, &gap);
        y.publish(half_y, half_y + 3, &HashSet::new());
        let x = x.restart(new_run.clone(), options);
        x.wait_subscribed(&a, "x-again").await;
        x.publish(0, 5, &HashSet::new());
        x
    };
    let (b, x) = tokio::join!(Service::start_dialing(&targets, &b_args), changes);
    assert_eq!(b.metric("kv_indexer_started_from{from=\"peer\"}"), 1.0);
    x.wait_subscribed(&b, "x-b").await;
    x.publish(5, new_run.len(), &HashSet::new());
    y.publish(half_y + 3, y.batches(), &HashSet::new());
    z.publish(nz / 2 + 4, nz, &HashSet::new());
    let batches = BTreeMap::from([
        (px.clone(), new_run.len() as u64),
        (py.clone(), y.batches() as u64),
        (pz.clone(), nz as u64),
    ]);
    for service in [&a, &b] {
        wait_last_seq(service, &model, &batches).await;
    }
    assert_eq!(
        answers(&b, &expected).await,
        answers(&a, &expected).await,
        "the copy answers as the replica that saw everything live"
    );
    for pod in b.list_pods(&model).await {
        assert!(!pod.incomplete, "{pod:?}");
        // After the cut: not in the copy, seen by the new replica itself.
        if &pod.pod == px {
            assert_eq!(pod.publisher_restarts, 1, "{pod:?}");
        }
        if &pod.pod == py {
            assert_eq!(pod.clears, y_clears, "{pod:?}");
        }
    }
}

/// A forwarded routing ends when the replica that accepted it said, not a
/// TTL later here: sent straight to `Routed` with an end 1 s away, to a
/// replica whose own TTL is 60 s, it is speculative at once and gone once
/// that second has passed. Without the fleet's secret, `Routed` is refused,
/// and past its bounds too.
#[tokio::test]
async fn a_forwarded_routing_ends_at_the_instant_it_was_given() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "token", "fleet-secret");
    let stream = load_frames(STREAM);
    let expected = load_expected(STREAM);
    let b = Service::start(&["--speculative-ttl", "60s", "--peer-token-file", &token]).await;
    let mut publisher = Publisher::connect(b.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&b, "marker").await;
    publisher.publish_all(&stream).await;
    b.wait_applied(&expected.model, &batches_per_pod(&stream))
        .await;
    let tokens: Vec<u32> = (0..4 * expected.block_size).map(|i| 800_000 + i).collect();
    // Our token keys, as Score computes them for this model.
    let keys: Vec<u64> = indexer::keys::prompt_keys(
        indexer::keys::request_root_seed(&expected.model, None, None),
        &tokens,
        expected.block_size as usize,
    )
    .into_iter()
    .map(|k| k.0)
    .collect();
    assert_eq!(keys.len(), 4);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let pod = expected.pods[0].clone();
    let routed = || {
        tonic::Request::new(pb::PeerRoutedRequest {
            routings: vec![pb::PeerRouting {
                model: expected.model.clone(),
                pod: pod.clone(),
                keys: keys.clone(),
                expires_unix_ms: now_ms + 1_000,
            }],
        })
    };
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", b.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut peer = pb::kv_indexer_peer_client::KvIndexerPeerClient::new(channel);
    let denied = peer.routed(routed()).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    let mut request = routed();
    request
        .metadata_mut()
        .insert("authorization", "Bearer fleet-secret".parse().unwrap());
    assert_eq!(peer.routed(request).await.unwrap().into_inner().written, 1);
    // Past the bounds: more than 1,024 routings in one request is refused
    // whole; a routing of more than 65,536 keys is refused alone.
    let with_secret = |routings: Vec<pb::PeerRouting>| {
        let mut r = tonic::Request::new(pb::PeerRoutedRequest { routings });
        r.metadata_mut()
            .insert("authorization", "Bearer fleet-secret".parse().unwrap());
        r
    };
    let one = routed().into_inner().routings.remove(0);
    let too_many = peer
        .routed(with_secret(vec![one.clone(); 1_025]))
        .await
        .unwrap_err();
    assert_eq!(
        too_many.code(),
        tonic::Code::InvalidArgument,
        "{too_many:?}"
    );
    let long = pb::PeerRouting {
        keys: vec![1; (1 << 16) + 1],
        ..one
    };
    assert_eq!(
        peer.routed(with_secret(vec![long]))
            .await
            .unwrap()
            .into_inner()
            .written,
        0
    );
    assert_eq!(
        b.metric("kv_indexer_peer_routings_received_total{outcome=\"refused\"}"),
        1.0
    );
    let speculative =
        async || -> u32 { speculative_blocks(&b, &expected.model, &tokens, &pod).await };
    b.wait_until("the forwarded routing speculative", async || {
        speculative().await == 4
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    assert_eq!(
        speculative().await,
        0,
        "ended at the instant given, not 60 s on"
    );

    // An end an hour away (a wrong clock, a wrong peer) is held to ten
    // minutes: what the replica gives a copying peer says when it ends.
    let far = pb::PeerRouting {
        expires_unix_ms: now_ms + 3_600_000,
        ..routed().into_inner().routings.remove(0)
    };
    let sent_ms = unix_ms();
    assert_eq!(
        peer.routed(with_secret(vec![far]))
            .await
            .unwrap()
            .into_inner()
            .written,
        1
    );
    b.wait_until("the far routing speculative", async || {
        speculative().await == 4
    })
    .await;
    let mut live = tonic::Request::new(pb::PeerSnapshotRequest {
        keys: default_keys_configuration(),
        format: indexer::snapshot::VERSION,
        replica: 7,
    });
    live.metadata_mut()
        .insert("authorization", "Bearer fleet-secret".parse().unwrap());
    let mut stream = peer.live(live).await.expect("Live").into_inner();
    let mut ends = Vec::new();
    while let Some(m) = stream.message().await.expect("Live stream") {
        ends.extend(m.routings.iter().map(|r| r.expires_unix_ms));
    }
    assert_eq!(ends.len(), 1, "{ends:?}");
    let ten_minutes = 600_000;
    assert!(
        ends[0] <= unix_ms() + ten_minutes && ends[0] + 5_000 >= sent_ms + ten_minutes,
        "held to ten minutes from when it was received: ends at {}, sent at {sent_ms}",
        ends[0]
    );
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A replica's index with the default settings (empty).
fn default_index() -> indexer::Indexer {
    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        settings: kv_indexer::config::Settings,
    }
    let flags = <Flags as clap::Parser>::parse_from(["kv-indexer"]);
    let config = kv_indexer::config::Config::load(flags.settings, None).expect("defaults");
    indexer::Indexer::new(config.indexer)
}

/// The key configuration a replica with the default settings has, as a
/// copying peer presents it.
fn default_keys_configuration() -> String {
    default_index().keys_configuration()
}

/// A peer that accepts connections and never answers (a hung replica, a
/// partition that drops packets after the handshake): recording routings
/// goes on, every one accepted, while what cannot reach the peer waits in
/// a bounded queue; beyond it, routings are dropped and counted, and the
/// sends that time out are counted as failed.
#[tokio::test]
async fn a_peer_that_never_answers_neither_slows_nor_fails_recording() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "token", "fleet-secret");
    // Accepts, holds every connection, says nothing.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in silent.incoming() {
            held.extend(conn.ok());
        }
    });
    let a = Service::start(&[
        "--peer",
        &silent_addr,
        "--peer-wait",
        "1s",
        "--peer-token-file",
        &token,
    ])
    .await;
    let stream = load_frames(STREAM);
    let expected = load_expected(STREAM);
    let mut publisher = Publisher::connect(a.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&a, "marker").await;
    publisher.publish_all(&stream).await;
    a.wait_applied(&expected.model, &batches_per_pod(&stream))
        .await;
    // Four times the peer's queue (4,096) from 16 clients at once: more
    // than the queue holds while one send waits out its 1 s timeout.
    let mut clients = Vec::new();
    for c in 0..16u32 {
        let mut client = a.client().await;
        let (model, pod, bs) = (
            expected.model.clone(),
            expected.pods[0].clone(),
            expected.block_size,
        );
        clients.push(tokio::spawn(async move {
            for i in 0..1024u32 {
                let first = 700_000 + (c * 1024 + i) * 64;
                let tokens: Vec<u32> = (0..2 * bs).map(|t| first + t).collect();
                let recorded = client
                    .record_routing(pb::RecordRoutingRequest {
                        model: model.clone(),
                        pod: pod.clone(),
                        input: Some(pb::record_routing_request::Input::TokenIds(pb::TokenIds {
                            ids: tokens,
                        })),
                        ..Default::default()
                    })
                    .await
                    .expect("RecordRouting")
                    .into_inner();
                assert_eq!(recorded.speculative_blocks, 2);
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    let dropped = a.metric("kv_indexer_peer_routings_forwarded_total{outcome=\"dropped\"}");
    assert!(dropped > 0.0, "nothing dropped");
    a.wait_metric(
        "kv_indexer_peer_routings_forwarded_total{outcome=\"failed\"}",
        |failed| failed > 0.0,
    )
    .await;
    let sent = a.metric("kv_indexer_peer_routings_forwarded_total{outcome=\"sent\"}");
    assert_eq!(sent, 0.0);
}

/// One copy at a time. A caller that takes a copy and reads nothing holds
/// it (the source's file is written; its stream stalls once the channel
/// and the connection's buffers are full: the index's snapshot is about
/// 14 MB here); a second caller meanwhile is refused `RESOURCE_EXHAUSTED`,
/// told to try another peer, and counted `busy`. Once the first caller is
/// gone, the next copy is given whole.
#[tokio::test]
async fn a_second_copy_while_one_is_under_way_is_refused_as_busy() {
    use simulator::vllm_wire::{encode_batch, frames, WireEvent};

    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "token", "fleet-secret");
    let a = Service::start(&["--peer-token-file", &token]).await;
    let mut publisher = Publisher::connect(a.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&a, "marker").await;
    // 1M distinct blocks: one chain of 256-block batches.
    let (batches, per_batch, bs) = (4_096u64, 256usize, 16usize);
    let mut parent = None;
    for seq in 0..batches {
        let hashes: Vec<u64> = (0..per_batch as u64)
            .map(|i| seq * per_batch as u64 + i + 1)
            .collect();
        let tokens: Vec<u32> = (0..per_batch * bs)
            .map(|i| (seq as u32).wrapping_mul(7_919) ^ i as u32)
            .collect();
        let payload = encode_batch(&[WireEvent::Stored {
            hashes: &hashes,
            parent,
            tokens: &tokens,
            block_size: bs,
        }]);
        parent = hashes.last().copied();
        publisher
            .send(zmq_message(frames("busy", "m", seq, payload)))
            .await;
    }
    let want = BTreeMap::from([("busy".to_string(), batches)]);
    a.wait_applied("m", &want).await;

    let copy = || {
        let mut r = tonic::Request::new(pb::PeerSnapshotRequest {
            keys: default_keys_configuration(),
            format: indexer::snapshot::VERSION,
            replica: 7,
        });
        r.metadata_mut()
            .insert("authorization", "Bearer fleet-secret".parse().unwrap());
        r
    };
    let peer = || async {
        let channel = tonic::transport::Channel::from_shared(format!("http://{}", a.grpc_addr()))
            .unwrap()
            .connect()
            .await
            .unwrap();
        pb::kv_indexer_peer_client::KvIndexerPeerClient::new(channel)
    };
    let mut first = peer().await;
    let stalled = first.snapshot(copy()).await.expect("the first copy");
    // Long enough for the source to fill every buffer and stall.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let mut second = peer().await;
    let refused = second.snapshot(copy()).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(refused.message().contains("another peer"), "{refused:?}");
    assert_eq!(
        a.metric("kv_indexer_peer_snapshots_served_total{outcome=\"busy\"}"),
        1.0
    );
    drop(stalled);
    drop(first);
    a.wait_until("the stalled copy given up", async || {
        a.metric("kv_indexer_peer_snapshots_served_total{outcome=\"aborted\"}") == 1.0
    })
    .await;
    let mut stream = second.snapshot(copy()).await.expect("a copy").into_inner();
    let mut bytes = 0;
    while let Some(chunk) = stream.message().await.expect("the copy's stream") {
        bytes += chunk.data.len();
    }
    assert!(bytes > 12_000_000, "{bytes} bytes");
}

/// A peer that answers a copy with an empty index and more live
/// speculative entries than a starting replica takes (16M keys, what the
/// entries of ten minutes of routings to a large fleet come to): the
/// replica takes them up to the bound and no further, and starts.
#[tokio::test]
async fn a_peers_live_entries_are_taken_up_to_16m_keys() {
    use std::pin::Pin;
    use tokio_stream::Stream;
    use tonic::{Request, Response, Status};

    type Chunks = Pin<Box<dyn Stream<Item = Result<pb::PeerSnapshotChunk, Status>> + Send>>;
    type Routed = Pin<Box<dyn Stream<Item = Result<pb::PeerRoutedRequest, Status>> + Send>>;
    /// Routings of 65,536 keys (the most one may have), one a message.
    const MESSAGES: usize = 260;
    struct Flooding {
        snapshot: Vec<u8>,
    }
    #[tonic::async_trait]
    impl pb::kv_indexer_peer_server::KvIndexerPeer for Flooding {
        type SnapshotStream = Chunks;
        type LiveStream = Routed;
        async fn snapshot(
            &self,
            _: Request<pb::PeerSnapshotRequest>,
        ) -> Result<Response<Chunks>, Status> {
            let chunks: Vec<_> = self
                .snapshot
                .chunks(1 << 20)
                .map(|c| Ok(pb::PeerSnapshotChunk { data: c.to_vec() }))
                .collect();
            Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
        }
        async fn live(
            &self,
            _: Request<pb::PeerSnapshotRequest>,
        ) -> Result<Response<Routed>, Status> {
            let ends = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64
                + 60_000;
            let routing = pb::PeerRouting {
                model: "m".into(),
                pod: "p".into(),
                keys: (0..1u64 << 16).collect(),
                expires_unix_ms: ends,
            };
            let messages = (0..MESSAGES).map(move |_| {
                Ok(pb::PeerRoutedRequest {
                    routings: vec![routing.clone()],
                })
            });
            Ok(Response::new(Box::pin(tokio_stream::iter(messages))))
        }
        async fn routed(
            &self,
            _: Request<pb::PeerRoutedRequest>,
        ) -> Result<Response<pb::PeerRoutedResponse>, Status> {
            Ok(Response::new(pb::PeerRoutedResponse::default()))
        }
    }
    // A valid snapshot of an empty index under the replica's keys.
    let snapshot = default_index().export(Vec::new()).unwrap();
    let port = free_port();
    let server = tonic::transport::Server::builder()
        .add_service(pb::kv_indexer_peer_server::KvIndexerPeerServer::new(
            Flooding { snapshot },
        ))
        .serve(format!("127.0.0.1:{port}").parse().unwrap());
    tokio::spawn(server);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "token", "fleet-secret");
    let peer = format!("127.0.0.1:{port}");
    let replica = Service::start(&["--peer", &peer, "--peer-token-file", &token]).await;
    assert_eq!(
        replica.metric("kv_indexer_started_from{from=\"peer\"}"),
        1.0
    );
    // Its pod is unknown here, so each routing taken is counted so.
    assert_eq!(
        replica.metric("kv_indexer_peer_routings_received_total{outcome=\"unknown\"}"),
        256.0,
        "16M keys: 256 routings of 65,536"
    );
}

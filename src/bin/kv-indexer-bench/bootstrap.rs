//! The `bootstrap` part: a replica started with `--peer` copies a running
//! one's index. Per size (1M and 10M (pod, block) entries; 1M with
//! `--quick`): a source replica is filled over ZeroMQ (64 pods in 8 groups,
//! each group's pods storing one chain of 256-block batches, so the index
//! holds an eighth as many distinct blocks as entries), then a second
//! replica is started with `--peer` at the source while the source serves
//! token-id Score at a fixed rate. Measured: from the second replica's
//! spawn to its `/readyz`, the snapshot's bytes, and the source's Score
//! latency during the copy against the same load just before.

use std::time::{Duration, Instant};

use kv_indexer::zmq_io::Publisher;
use serde_json::{json, Value};
use simulator::vllm_wire::{encode_batch, frames, WireEvent};

use super::score::{score_step, Step};
use super::score_client::{grpc_message, ScoreClient};
use super::{
    connect, free_port, http_get, lcg, metrics_text, pb, spawn_service, spawn_service_on, Opts,
    BLOCK, MODEL,
};

const PODS: usize = 64;
const BATCH_BLOCKS: usize = 256;
/// Score load on the source, requests per second.
const RATE: f64 = 200.0;

pub(crate) async fn run(o: &Opts, quick: bool) -> Value {
    let sizes: &[u64] = if quick {
        &[1_000_000]
    } else {
        &[1_000_000, 10_000_000]
    };
    println!(
        "\nBootstrap: a replica started with --peer copies a running one ({PODS} pods, each group of pods storing one chain; Score on the source at {RATE:.0}/s, 2,048-block prompts)"
    );
    println!(
        "{:>11} {:>7} {:>10} {:>12} {:>13} {:>14} {:>14} {:>15} {:>11} {:>11} {:>11} {:>11} {:>13} {:>13}",
        "entries",
        "groups",
        "ready s",
        "snapshot MB",
        "idle p99 us",
        "during p99 us",
        "idle p999 us",
        "during p999 us",
        "source MB",
        "peak MB",
        "replica MB",
        "peak MB",
        "fwd p50 us",
        "fwd p99 us"
    );
    let mut rows = Vec::new();
    for groups in [8, PODS] {
        for &entries in sizes {
            rows.push(one(o, entries, groups).await);
        }
    }
    json!(rows)
}

async fn one(o: &Opts, entries: u64, groups: usize) -> Value {
    let dir = tempfile_dir();
    let token = dir.join("token");
    std::fs::write(&token, "bench-fleet-secret\n").expect("token file");
    let token = token.to_str().expect("utf-8 path").to_owned();
    // The source forwards routings to the replica: it lists it.
    let replica_port = free_port();
    let replica_addr = format!("127.0.0.1:{replica_port}");
    let (source, grpc, zmq, metrics) = spawn_service(
        o,
        &[
            "--peer-token-file",
            &token,
            "--peer",
            &replica_addr,
            "--peer-wait",
            "100ms",
        ],
    );
    let mut client = connect(&grpc).await;
    let prompt = fill(&zmq, &mut client, entries, groups).await;

    let scores = ScoreClient::connect(&grpc, 8).await.expect("connect");
    let request = pb::ScoreRequest {
        model: MODEL.into(),
        input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
            ids: prompt,
        })),
        ..Default::default()
    };
    let message = grpc_message(&prost::Message::encode_to_vec(&request));
    let window = if entries > 2_000_000 { 20.0 } else { 4.0 };
    let idle = score_step(&scores, &message, Some(&metrics), RATE, window).await;

    let bytes_before = sent_bytes(&metrics);
    let rss_before = memory_kb(source.0.id(), "VmRSS");
    reset_peak(source.0.id());
    let load = tokio::spawn({
        let (scores, message, metrics) = (scores.clone(), message.clone(), metrics.clone());
        async move { score_step(&scores, &message, Some(&metrics), RATE, window).await }
    });
    let started = Instant::now();
    let (replica, replica_grpc, _, replica_metrics) = spawn_service_on(
        o,
        replica_port,
        &["--peer", &grpc, "--peer-token-file", &token],
    );
    let ready = wait_ready(&replica_metrics, started).await;
    let during = load.await.expect("Score load");
    let bytes = sent_bytes(&metrics) - bytes_before;
    let peak = memory_kb(source.0.id(), "VmHWM");
    // The replica's RSS once Ready and its peak since it started: the
    // copy's load never holds the index twice.
    let replica_rss = memory_kb(replica.0.id(), "VmRSS");
    let replica_peak = memory_kb(replica.0.id(), "VmHWM");
    let mut replica_client = connect(&replica_grpc).await;
    let copied = held_entries(&mut replica_client).await;
    let visible = forwarding(&mut client, &mut replica_client).await;
    drop(replica);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(copied, entries, "the replica holds every entry");
    let mb = bytes / 1e6;
    println!(
        "{entries:>11} {groups:>7} {ready:>10.2} {mb:>12.1} {:>13.0} {:>14.0} {:>14.0} {:>15.0} {:>11.0} {:>11.0} {:>11.0} {:>11.0} {:>13.0} {:>13.0}",
        idle.p99,
        during.p99,
        idle.p999,
        during.p999,
        rss_before / 1024.0,
        peak / 1024.0,
        replica_rss / 1024.0,
        replica_peak / 1024.0,
        visible.0,
        visible.1
    );
    json!({
        "entries": entries,
        "groups": groups,
        "ready_seconds": ready,
        "snapshot_bytes": bytes,
        "score_rate_per_s": RATE,
        "source_rss_mb_before": rss_before / 1024.0,
        "source_peak_rss_mb_during": peak / 1024.0,
        "replica_rss_mb_ready": replica_rss / 1024.0,
        "replica_peak_rss_mb": replica_peak / 1024.0,
        "routing_visible_on_peer_p50_us": visible.0,
        "routing_visible_on_peer_p99_us": visible.1,
        "idle": step_json(&idle),
        "during_copy": step_json(&during),
    })
}

/// Routing feedback across replicas: 200 `RecordRouting`s on the source
/// (each a new 64-block prompt to pod `boot-0`), each followed by `Score`s
/// on the replica until its speculative blocks show. (p50, p99) in us from
/// the `RecordRouting`'s answer.
async fn forwarding(
    source: &mut pb::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>,
    replica: &mut pb::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>,
) -> (f64, f64) {
    let mut rng = 0xf0e1_d2c3_u64;
    let mut took = Vec::new();
    for _ in 0..200 {
        let tokens: Vec<u32> = (0..64 * BLOCK)
            .map(|_| (lcg(&mut rng) % 150_000) as u32)
            .collect();
        let ids = || pb::TokenIds {
            ids: tokens.clone(),
        };
        source
            .record_routing(pb::RecordRoutingRequest {
                model: MODEL.into(),
                pod: "boot-0".into(),
                input: Some(pb::record_routing_request::Input::TokenIds(ids())),
                ..Default::default()
            })
            .await
            .expect("RecordRouting");
        let started = Instant::now();
        loop {
            let resp = replica
                .score(pb::ScoreRequest {
                    model: MODEL.into(),
                    input: Some(pb::score_request::Input::TokenIds(ids())),
                    pods: vec!["boot-0".into()],
                    ..Default::default()
                })
                .await
                .expect("Score")
                .into_inner();
            if resp.pods.iter().any(|p| p.speculative_blocks > 0) {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the routing never reached the replica"
            );
        }
        took.push(started.elapsed());
    }
    took.sort();
    (
        super::percentile(&took, 0.5),
        super::percentile(&took, 0.99),
    )
}

/// A `/proc/PID/status` line's kB (`VmRSS`, `VmHWM`), 0 where unknown.
fn memory_kb(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0.0)
}

/// Starts `VmHWM` again from the current RSS (Linux: `clear_refs` 5).
fn reset_peak(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
}

fn step_json(s: &Step) -> Value {
    json!({"achieved_per_s": s.achieved, "p50_us": s.p50, "p99_us": s.p99, "p999_us": s.p999})
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kv-indexer-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Publishes `entries` (pod, block) entries: each of `groups` chains
/// stored by each pod of its group. Returns the first 2,048 blocks' tokens
/// of group 0's chain (a prompt its pods hold).
async fn fill(
    zmq: &str,
    client: &mut pb::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>,
    entries: u64,
    groups: usize,
) -> Vec<u32> {
    let per_pod = (entries / PODS as u64) as usize;
    let batches = per_pod.div_ceil(BATCH_BLOCKS);
    let context = zmq::Context::new();
    let publisher = Publisher::connect(&context, zmq).expect("PUB");
    // A fresh PUB drops messages until the subscription reached it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut prompt = Vec::new();
    let started = Instant::now();
    let mut sent = 0u64;
    for group in 0..groups {
        let mut rng = 0x600d_5eed_u64 ^ group as u64;
        let mut parent = None;
        for b in 0..batches {
            let n = BATCH_BLOCKS.min(per_pod - b * BATCH_BLOCKS);
            let tokens: Vec<u32> = (0..n * BLOCK)
                .map(|_| (lcg(&mut rng) % 150_000) as u32)
                .collect();
            if group == 0 && prompt.len() < 2048 * BLOCK {
                prompt.extend_from_slice(&tokens[..tokens.len().min(2048 * BLOCK - prompt.len())]);
            }
            let base = ((group as u64) << 40) | ((b * BATCH_BLOCKS) as u64);
            let hashes: Vec<u64> = (0..n as u64).map(|i| base + i + 1).collect();
            let payload = encode_batch(&[WireEvent::Stored {
                hashes: &hashes,
                parent,
                tokens: &tokens,
                block_size: BLOCK,
            }]);
            parent = hashes.last().copied();
            for p in 0..PODS / groups {
                let pod = format!("boot-{}", group * (PODS / groups) + p);
                publisher
                    .send(&frames(&pod, MODEL, b as u64, payload.clone()))
                    .expect("publish");
            }
            sent += (n * (PODS / groups)) as u64;
            // In step with the source, so that no queue fills and drops.
            if b % 32 == 31 || b + 1 == batches {
                wait_held(client, sent, started).await;
            }
        }
    }
    prompt
}

/// Waits until the source holds `want` entries.
async fn wait_held(
    client: &mut pb::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>,
    want: u64,
    started: Instant,
) {
    loop {
        let held = held_entries(client).await;
        if held >= want {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the source applied {held} of {want} entries"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// (pod, block) entries the service at `client` holds of the bench model.
async fn held_entries(
    client: &mut pb::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>,
) -> u64 {
    client
        .list_pods(pb::ListPodsRequest {
            model: MODEL.into(),
        })
        .await
        .map(|r| r.into_inner().pods.iter().map(|p| p.gpu_blocks).sum())
        .unwrap_or(0)
}

fn sent_bytes(metrics: &str) -> f64 {
    metrics_text(Some(metrics))
        .and_then(|body| {
            body.lines()
                .find(|l| l.starts_with("kv_indexer_peer_snapshot_bytes_sent_total "))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        })
        .unwrap_or(0.0)
}

/// Seconds from `started` until `/readyz` at `metrics` answers 200.
async fn wait_ready(metrics: &str, started: Instant) -> f64 {
    loop {
        if http_get(metrics, "/readyz").is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
            return started.elapsed().as_secs_f64();
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the replica never became ready"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

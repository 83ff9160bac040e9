//! `kv-indexer publish [FILE]`: publishes a stream that real vLLM recorded
//! (`tests/fixtures/vllm-events/`) to a running kv-indexer, the way a vLLM
//! pod does (ZeroMQ PUB connecting to the indexer's SUB socket), scores the
//! stream's first probe prompt next to vLLM's own answer, prints the
//! grpcurl command that asks the same question, and removes the pods it
//! created (which needs the service's `--admin`).
//!
//! It is part of the binary, not a cargo example: an example builds the
//! dev-dependencies, which re-resolves features and rebuilds much of the
//! dependency tree (minutes) for a few hundred lines.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use serde_json::Value;
use tonic::transport::Channel;

use kv_indexer::proto::kvindexer::v1 as pb;
use kv_indexer::zmq_io::Publisher;
use pb::kv_indexer_client::KvIndexerClient;

/// The model of the marker batch that tells us the subscription is up.
const MARKER_MODEL: &str = "replay-example";
const MARKER_POD: &str = "replay-marker";

/// Publishes `frames_path` to the indexer at `zmq` / `grpc`, then cleans up.
pub async fn run(frames_path: &str, zmq: &str, grpc: &str) -> anyhow::Result<()> {
    let client = KvIndexerClient::connect(grpc.to_owned())
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "no kv-indexer answers at {grpc} ({e}): start one first, e.g. \
             `cargo run --release -- --admin &` (--admin lets this command remove \
             the pods it creates), or point --grpc and --zmq at yours"
            )
        })?;
    let (mut client, model, pods) = publish_and_score(client, frames_path, zmq, grpc).await?;
    // Leave the service as it was: remove the stream's pods and the marker.
    let mut removals = vec![(MARKER_MODEL.to_owned(), MARKER_POD.to_owned())];
    removals.extend(pods.into_iter().map(|p| (model.clone(), p)));
    for (model, pod) in removals {
        match client.remove_pod(pb::RemovePodRequest { model, pod }).await {
            Ok(_) => {}
            Err(status) if status.code() == tonic::Code::PermissionDenied => {
                println!(
                    "\nthe published pods stay in the index: the service runs without --admin, \
                     so RemovePod is refused (restart it with --admin, or let --pod-expiry forget them)"
                );
                return Ok(());
            }
            Err(status) => return Err(status.into()),
        }
    }
    println!("\nremoved the pods this command created");
    Ok(())
}

async fn publish_and_score(
    mut client: KvIndexerClient<Channel>,
    frames_path: &str,
    zmq: &str,
    grpc: &str,
) -> anyhow::Result<(KvIndexerClient<Channel>, String, BTreeSet<String>)> {
    let mut frames = Vec::new();
    for line in std::fs::read_to_string(frames_path)?.lines() {
        let v: Value = serde_json::from_str(line)?;
        frames.push((
            v["topic"].as_str().unwrap_or_default().to_owned(),
            v["seq"].as_u64().unwrap_or_default(),
            base64::engine::general_purpose::STANDARD
                .decode(v["payload_b64"].as_str().unwrap_or_default())?,
        ));
    }
    let model = frames
        .first()
        .and_then(|(t, _, _)| t.splitn(3, '@').nth(2))
        .ok_or_else(|| anyhow::anyhow!("no frames in {frames_path}"))?
        .to_owned();

    let context = zmq::Context::new();
    let publisher = Publisher::connect(&context, zmq)?;
    // A fresh PUB drops messages until the subscriber's subscription reaches
    // it ("slow joiner"): send an empty marker batch until the indexer lists it.
    let marker = rmp_serde::to_vec(&(0.0f64, Vec::<u8>::new()))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        publisher.send(&message(
            &format!("kv@{MARKER_POD}@{MARKER_MODEL}"),
            0,
            &marker,
        ))?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let pods = client
            .list_pods(pb::ListPodsRequest {
                model: MARKER_MODEL.into(),
            })
            .await?
            .into_inner()
            .pods;
        if !pods.is_empty() {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the indexer at {zmq} never received the marker"
        );
    }

    let applied_before: u64 = client
        .list_pods(pb::ListPodsRequest {
            model: model.clone(),
        })
        .await?
        .into_inner()
        .pods
        .iter()
        .map(|p| p.batches)
        .sum();
    for (topic, seq, payload) in &frames {
        publisher.send(&message(topic, *seq, payload))?;
    }
    let expected_batches = applied_before + frames.len() as u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pods = client
            .list_pods(pb::ListPodsRequest {
                model: model.clone(),
            })
            .await?
            .into_inner()
            .pods;
        let applied: u64 = pods.iter().map(|p| p.batches).sum();
        anyhow::ensure!(
            Instant::now() < deadline,
            "the indexer applied {} of {} batches within 30 s: a stream published again \
             is skipped as duplicates while its pods are still indexed (see ListPods; \
             RemovePod them, or restart the service)",
            applied - applied_before,
            frames.len()
        );
        if applied >= expected_batches {
            println!("published {} batches; the indexer now knows:", frames.len());
            for p in &pods {
                println!(
                    "  {:<10} gpu_blocks={:<5} last_seq={:?}",
                    p.pod, p.gpu_blocks, p.last_seq
                );
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let expected_path = frames_path
        .replace(".array-v0.23", "")
        .replace(".array-v0.11", "");
    let expected_path = expected_path.replace(".frames.jsonl", ".expected.json");
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(&expected_path)?)?;
    let probe = &expected["probes"][0];
    let ids: Vec<u32> = probe["token_ids"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_u64())
                .map(|t| t as u32)
                .collect()
        })
        .unwrap_or_default();
    let request = serde_json::json!({
        "model": model,
        "token_ids": {"ids": ids},
        "lora_name": probe["lora_name"].as_str().unwrap_or_default(),
        "cache_salt": probe["cache_salt"].as_str().unwrap_or_default(),
    });
    let resp = client
        .score(pb::ScoreRequest {
            model: model.clone(),
            input: Some(pb::score_request::Input::TokenIds(pb::TokenIds { ids })),
            lora_name: probe["lora_name"].as_str().unwrap_or_default().into(),
            cache_salt: probe["cache_salt"].as_str().unwrap_or_default().into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    println!(
        "\nprobe {} ({} tokens, {} blocks of {}):",
        probe["id"], resp.prompt_tokens, resp.total_blocks, resp.block_size
    );
    for p in &resp.pods {
        println!(
            "  {:<10} matched_blocks={:<4} score={:.3}",
            p.pod, p.matched_blocks, p.score
        );
    }
    println!("vLLM's own answer: {}", probe["expected_cached_blocks"]);
    let addr = grpc.trim_start_matches("http://");
    println!("\nthe same with grpcurl:\n  grpcurl -plaintext -d '{request}' {addr} kvindexer.v1.KvIndexer/Score");
    Ok((client, model, pods_of(&frames)))
}

/// The pod names of a stream's topics (`kv@<pod>@<model>`).
fn pods_of(frames: &[(String, u64, Vec<u8>)]) -> BTreeSet<String> {
    frames
        .iter()
        .filter_map(|(t, _, _)| t.split('@').nth(1).map(str::to_owned))
        .collect()
}

fn message(topic: &str, seq: u64, payload: &[u8]) -> Vec<Bytes> {
    vec![
        Bytes::from(topic.to_owned()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::copy_from_slice(payload),
    ]
}

/// Publishes an empty batch (seq 0) for each of `pods` until the indexer
/// lists them all: a fresh PUB socket drops messages until the
/// subscription reached it ("slow joiner"). The pods' next seq is 1.
pub(crate) async fn announce_pods(
    publisher: &kv_indexer::zmq_io::Publisher,
    model: &str,
    pods: &[String],
    client: &mut pb::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        for pod in pods {
            publisher.send(&simulator::vllm_wire::frames(
                pod,
                model,
                0,
                simulator::vllm_wire::encode_batch(&[]),
            ))?;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        if listed(client, model).await?.len() >= pods.len() {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the pods' events never reached the indexer"
        );
    }
}

/// `model`'s pods as the indexer lists them.
pub(crate) async fn listed(
    client: &mut pb::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>,
    model: &str,
) -> anyhow::Result<Vec<pb::PodInfo>> {
    Ok(client
        .list_pods(pb::ListPodsRequest {
            model: model.into(),
        })
        .await?
        .into_inner()
        .pods)
}

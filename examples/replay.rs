//! Publishes a recorded vLLM event stream to a running kv-indexer, the way a
//! vLLM pod would (ZeroMQ PUB connecting to the indexer's SUB socket), then
//! scores one of the stream's probe prompts and prints the grpcurl command
//! that asks the same question.
//!
//! ```sh
//! cargo run --release &                      # the service
//! cargo run --example replay                 # publish + score
//! cargo run --example replay -- tests/fixtures/vllm-events/qwen3-sha256-int.frames.jsonl
//! ```
//! Options: `--zmq tcp://127.0.0.1:5557`, `--grpc http://127.0.0.1:50051`.

use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use kv_indexer::proto::kvindexer::v1 as pb;
use kv_indexer::zmq_io::Publisher;
use pb::kv_indexer_client::KvIndexerClient;
use serde_json::Value;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut frames_path = "tests/fixtures/vllm-events/qwen3-lora-salt.frames.jsonl".to_owned();
    let mut zmq = "tcp://127.0.0.1:5557".to_owned();
    let mut grpc = "http://127.0.0.1:50051".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--zmq" => {
                zmq = args
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("--zmq needs a value"))?
            }
            "--grpc" => {
                grpc = args
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("--grpc needs a value"))?
            }
            path => frames_path = path.to_owned(),
        }
    }
    let mut client = KvIndexerClient::connect(grpc.clone()).await?;

    let mut frames = Vec::new();
    for line in std::fs::read_to_string(&frames_path)?.lines() {
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
    let publisher = Publisher::connect(&context, &zmq)?;
    // A fresh PUB drops messages until the subscriber's subscription reaches
    // it ("slow joiner"): send an empty marker batch until the indexer lists it.
    let marker = rmp_serde::to_vec(&(0.0f64, Vec::<u8>::new()))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        publisher.send(&message("kv@replay-marker@replay-example", 0, &marker))?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let pods = client
            .list_pods(pb::ListPodsRequest {
                model: "replay-example".into(),
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

    for (topic, seq, payload) in &frames {
        publisher.send(&message(topic, *seq, payload))?;
    }
    let expected_batches = frames.len() as u64;
    loop {
        let pods = client
            .list_pods(pb::ListPodsRequest {
                model: model.clone(),
            })
            .await?
            .into_inner()
            .pods;
        if pods.iter().map(|p| p.batches).sum::<u64>() >= expected_batches {
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
    Ok(())
}

fn message(topic: &str, seq: u64, payload: &[u8]) -> Vec<Bytes> {
    vec![
        Bytes::from(topic.to_owned()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::copy_from_slice(payload),
    ]
}

//! `--key-mode engine`: vLLM's own block hashes as keys, over real sockets.

use std::collections::HashMap;

use crate::common::*;

async fn replay(stream: &str, args: &[&str], skip: usize) -> (Service, Expected) {
    let expected = load_expected(stream);
    let frames: Vec<RecordedFrame> = load_frames(stream).into_iter().skip(skip).collect();
    let service = Service::start(args).await;
    service.publish_recorded(&expected.model, &frames).await;
    (service, expected)
}

#[tokio::test]
async fn engine_keys_match_vllm_on_full_streams() {
    for (stream, algo) in [
        ("qwen3-sha256-int", "sha256"),
        ("qwen3-sha256cbor-bytes", "sha256_cbor"),
        ("qwen3-lora-salt", "sha256"),
    ] {
        let (service, expected) = replay(
            stream,
            &["--key-mode", "engine", "--engine-hash-algo", algo],
            0,
        )
        .await;
        check_probes(&service, &expected).await;
        let pods = service.list_pods(&expected.model).await;
        assert!(pods.iter().all(|p| p.key_mode == "engine"), "{pods:?}");
        assert!(pods.iter().map(|p| p.engine_hash_checks).sum::<u64>() > 0);
        assert!(
            pods.iter().all(|p| p.engine_hash_mismatches == 0),
            "{pods:?}"
        );
    }
}

/// Joining late: blocks are keyed the moment their event arrives, parents or
/// not; no answer exceeds what vLLM holds.
#[tokio::test]
async fn engine_keys_after_a_late_start_never_overclaim() {
    let stream = "qwen3-sha256-int";
    let skip = load_frames(stream).len() / 2;
    let (service, expected) = replay(stream, &["--key-mode", "engine"], skip).await;
    let (mut got_total, mut want_total) = (0u64, 0u64);
    for (probe, resp) in probe_answers(&service, &expected).await {
        let got: HashMap<String, u32> = resp
            .pods
            .into_iter()
            .map(|p| (p.pod, p.matched_blocks))
            .collect();
        for (pod, want) in &probe.expected {
            let g = got.get(pod).copied().unwrap_or(0);
            assert!(g <= *want, "probe {} pod {pod}: {g} > {want}", probe.id);
            got_total += u64::from(g);
            want_total += u64::from(*want);
        }
    }
    println!("late start (first half dropped): {got_total} of {want_total} cached blocks found");
    assert!(
        got_total * 10 >= want_total * 9,
        "{got_total} of {want_total}"
    );
}

#[tokio::test]
async fn a_wrong_engine_seed_is_detected_and_reported() {
    let (service, expected) = replay(
        "qwen3-sha256-int",
        &["--key-mode", "engine", "--engine-hash-seed", "12345"],
        0,
    )
    .await;
    let pods = service.list_pods(&expected.model).await;
    assert!(
        pods.iter().all(|p| p.engine_hash_mismatches > 0),
        "{pods:?}"
    );
    service.wait_log("block hashes differ from ours").await;
}

/// After a publisher restart (seq back to 0: vLLM restarted, cache empty) the
/// pod is never credited with a block, prefix closure or not.
#[tokio::test]
async fn nothing_is_claimed_for_a_pod_after_its_publisher_restarts() {
    let (service, expected) = replay("qwen3-sha256-int", &["--key-mode", "engine"], 0).await;
    let restarted = "pod-0";
    let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&service, "marker-2").await;
    let empty = rmp_serde::to_vec(&(0.0f64, Vec::<u8>::new(), 0u32)).unwrap();
    publisher
        .send(zmq_message(vec![
            bytes::Bytes::from(format!("kv@{restarted}@{}", expected.model)),
            bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()),
            bytes::Bytes::from(empty),
        ]))
        .await;
    let deadline = std::time::Instant::now() + crate::common::budget(20);
    loop {
        let pods = service.list_pods(&expected.model).await;
        if pods
            .iter()
            .any(|p| p.pod == restarted && p.publisher_restarts == 1)
        {
            assert_eq!(
                pods.iter().find(|p| p.pod == restarted).unwrap().gpu_blocks,
                0
            );
            break;
        }
        assert!(std::time::Instant::now() < deadline, "restart not seen");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut client = service.client().await;
    let mut others = 0;
    for probe in &expected.probes {
        let resp = client
            .score(token_request(&expected.model, probe))
            .await
            .unwrap()
            .into_inner();
        for p in &resp.pods {
            if p.pod == restarted {
                assert_eq!(p.matched_blocks, 0, "probe {}", probe.id);
            } else {
                assert_eq!(
                    Some(&p.matched_blocks),
                    probe.expected.get(&p.pod),
                    "probe {}",
                    probe.id
                );
                others += 1;
            }
        }
    }
    assert!(others > 0);
}

/// vLLM's offloading connector publishes what it copied to CPU as
/// `BlockStored` with no parent and no tokens, one event per step, so a
/// later event starts in the middle of a chain. A pod that holds blocks 1-4
/// and 7-8 of a prompt on CPU, and nothing on GPU, matches 4 blocks: not 8,
/// as a binary search that took block 7 for a chain's start would answer.
#[tokio::test]
async fn offloaded_pieces_of_a_chain_are_not_matched_past_their_hole() {
    use indexer::keys::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo, DEFAULT_SEED};
    let hasher = EngineHasher::new(HashAlgo::Sha256, DEFAULT_SEED, ExtraKeyStyle::Tagged);
    let hashes = |tokens: &[u32]| -> Vec<u64> {
        hasher
            .prompt_digests(tokens, 16, &[], &[])
            .iter()
            .map(|d| d.wire().0)
            .collect()
    };
    let prompt: Vec<u32> = (1000..1000 + 8 * 16).collect();
    let chain = hashes(&prompt);
    let other: Vec<u32> = (5000..5016).collect();
    let stored = |block_hashes: Vec<u64>, token_ids: Vec<u32>, medium| {
        let event = Stored {
            ty: "BlockStored",
            block_hashes,
            parent_block_hash: None,
            token_ids,
            block_size: 16,
            medium,
        };
        rmp_serde::to_vec_named(&(0.0f64, vec![event], 0u32)).unwrap()
    };
    let payloads = [
        // A GPU block of another prompt (the pod's block size, its hashes
        // checked), gone again below: then the pod holds CPU blocks only.
        stored(hashes(&other), other.clone(), "GPU"),
        stored(chain[..4].to_vec(), vec![], "CPU"),
        stored(chain[6..].to_vec(), vec![], "CPU"),
        rmp_serde::to_vec_named(&(
            0.0f64,
            vec![Removed {
                ty: "BlockRemoved",
                block_hashes: hashes(&other),
                medium: "GPU",
            }],
            0u32,
        ))
        .unwrap(),
    ];
    let frames: Vec<RecordedFrame> = payloads
        .into_iter()
        .enumerate()
        .map(|(seq, payload)| RecordedFrame {
            topic: "kv@offloader@m".into(),
            seq: seq as u64,
            payload,
        })
        .collect();
    let service = Service::start(&["--key-mode", "engine"]).await;
    service.publish_recorded("m", &frames).await;
    let pods = service.list_pods("m").await;
    assert_eq!((pods[0].gpu_blocks, pods[0].cpu_blocks), (0, 6), "{pods:?}");
    let resp = service.score_token_ids("m", prompt).await;
    let matched: Vec<(String, u32)> = resp
        .pods
        .iter()
        .map(|p| (p.pod.clone(), p.matched_blocks))
        .collect();
    assert_eq!(matched, vec![("offloader".to_string(), 4)]);
}

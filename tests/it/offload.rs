//! KV offloading in chunks, over real sockets: vLLM's usage guide runs its
//! offloading connector with `block_size` 64 against GPU blocks of 16, and
//! newer vLLM publishes each offloaded chunk as one hash (the chunk's last
//! block) with `block_size` 0. `--offload-block-size 64` makes Score count
//! what vLLM would load: whole chunks past the GPU hit.

use crate::common::*;

fn frame(seq: u64, payload: Vec<u8>) -> RecordedFrame {
    RecordedFrame {
        topic: "kv@offloader@m".into(),
        seq,
        payload,
    }
}

fn batch<T: serde::Serialize>(event: T) -> Vec<u8> {
    rmp_serde::to_vec_named(&(0.0f64, vec![event], 0u32)).unwrap()
}

/// Blocks 1-12 stored on GPU, chunks 2 and 3 (blocks 8 and 12) offloaded
/// (their `block_size` as the event gives it: 0 from newer vLLM, 64 from
/// older), blocks 7-12 then evicted from GPU: vLLM starts a request for the
/// prompt with 6 blocks from GPU and loads 6 from CPU.
fn offloading_frames(offload_block_size: u32) -> Vec<RecordedFrame> {
    vec![
        frame(
            0,
            batch(Stored {
                ty: "BlockStored",
                block_hashes: (1..=12).collect(),
                parent_block_hash: None,
                token_ids: prompt(),
                block_size: 16,
                medium: "GPU",
            }),
        ),
        frame(
            1,
            batch(Stored {
                ty: "BlockStored",
                block_hashes: vec![8, 12],
                parent_block_hash: None,
                token_ids: vec![],
                block_size: offload_block_size,
                medium: "CPU",
            }),
        ),
        frame(
            2,
            batch(Removed {
                ty: "BlockRemoved",
                block_hashes: (7..=12).rev().collect(),
                medium: "GPU",
            }),
        ),
    ]
}

fn prompt() -> Vec<u32> {
    (0..12 * 16).collect()
}

/// (matched, on GPU, on CPU, the chunk size the pod is counted by).
async fn score(service: &Service) -> (u32, u32, u32, u32) {
    let resp = service.score_token_ids("m", prompt()).await;
    assert_eq!(resp.pods.len(), 1, "{resp:?}");
    let p = &resp.pods[0];
    let chunk = service.list_pods("m").await[0].offload_block_size;
    (p.matched_blocks, p.gpu_blocks, p.cpu_blocks, chunk)
}

async fn matched(args: &[&str]) -> (u32, u32, u32, u32) {
    let service = Service::start(args).await;
    service.publish_recorded("m", &offloading_frames(0)).await;
    score(&service).await
}

#[tokio::test]
async fn offloaded_chunks_count_as_vllm_loads_them() {
    assert_eq!(
        matched(&["--offload-block-size", "64"]).await,
        (12, 6, 6, 64)
    );
    // Without it, one block per chunk is known: the offloaded run is not.
    assert_eq!(matched(&[]).await, (6, 6, 0, 0));
}

/// Offloaded blocks across restarts: a snapshot keeps them and the chunk
/// size the pod's events gave (older vLLM's), so the restored service
/// answers as before; then the pod's engine restarts (seq 0, two blocks on
/// GPU), and its offloaded blocks go with the rest.
#[tokio::test]
async fn offloaded_blocks_survive_a_snapshot_and_go_with_a_publisher_restart() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--snapshot-dir", dir.path().to_str().unwrap()];
    let first = Service::start(&args).await;
    first.publish_recorded("m", &offloading_frames(64)).await;
    assert_eq!(score(&first).await, (12, 6, 6, 64));
    assert!(first.terminate().await.success());

    let second = Service::start(&args).await;
    second
        .wait_until("the pod restored", async || {
            !second.list_pods("m").await.is_empty()
        })
        .await;
    assert_eq!(score(&second).await, (12, 6, 6, 64));
    let restarted = frame(
        0,
        batch(Stored {
            ty: "BlockStored",
            block_hashes: vec![101, 102],
            parent_block_hash: None,
            token_ids: prompt()[..32].to_vec(),
            block_size: 16,
            medium: "GPU",
        }),
    );
    second.publish_recorded("m", &[restarted]).await;
    let pod = &second.list_pods("m").await[0];
    assert_eq!(
        (pod.publisher_restarts, pod.gpu_blocks, pod.cpu_blocks),
        (1, 2, 0)
    );
    assert_eq!(score(&second).await.0, 2);
}

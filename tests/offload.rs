//! KV offloading in chunks, over real sockets: vLLM's usage guide runs its
//! offloading connector with `block_size` 64 against GPU blocks of 16, and
//! newer vLLM publishes each offloaded chunk as one hash (the chunk's last
//! block) with `block_size` 0. `--offload-block-size 64` makes Score count
//! what vLLM would load: whole chunks past the GPU hit.

mod common;

use common::*;

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

/// Blocks 1-12 stored on GPU, chunks 2 and 3 (blocks 8 and 12) offloaded,
/// blocks 7-12 then evicted from GPU: vLLM starts a request for the prompt
/// with 6 blocks from GPU and loads 6 from CPU.
async fn matched(args: &[&str]) -> (u32, u32, u32, u32) {
    let tokens: Vec<u32> = (0..12 * 16).collect();
    let frames = vec![
        frame(
            0,
            batch(Stored {
                ty: "BlockStored",
                block_hashes: (1..=12).collect(),
                parent_block_hash: None,
                token_ids: tokens.clone(),
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
                block_size: 0,
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
    ];
    let service = Service::start(args).await;
    service.publish_recorded("m", &frames).await;
    let resp = service.score_token_ids("m", tokens).await;
    assert_eq!(resp.pods.len(), 1, "{resp:?}");
    let p = &resp.pods[0];
    let chunk = service.list_pods("m").await[0].offload_block_size;
    (p.matched_blocks, p.gpu_blocks, p.cpu_blocks, chunk)
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

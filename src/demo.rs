//! `kv-indexer demo`: the real service, plus a built-in publisher that
//! behaves like a few vLLM pods serving multi-turn conversations that share a
//! system prompt. It publishes vLLM's own wire form (msgpack map events over
//! ZeroMQ PUB), routes each turn to the pod the indexer scores best (the way
//! an EPP would), evicts least recently used conversations when a pod is
//! full, and prints how the scores move.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::config::Config;
use crate::proto::kvindexer::v1 as pb;
use crate::vllm_wire::{self, WireEvent};

const MODEL: &str = "demo/model";
const BLOCK: usize = 16;
const POD_CAPACITY_BLOCKS: usize = 96;

/// A deterministic token stream per (conversation, turn).
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 150_000) as u32
        })
        .collect()
}

/// One fake pod's prefix cache: content-addressed blocks (shared between
/// conversations, as the system prompt is), and conversations in LRU order.
struct FakePod {
    name: String,
    seq: u64,
    /// Block hash -> number of cached conversations using it.
    refs: HashMap<u64, usize>,
    /// (conversation, its block hashes, deepest last), least recent first.
    lru: VecDeque<(usize, Vec<u64>)>,
}

pub async fn run(config: Config, pods: usize, turns: u32) -> anyhow::Result<()> {
    let zmq = config
        .zmq_bind
        .clone()
        .ok_or_else(|| {
            anyhow::anyhow!("the demo publishes to the bound SUB socket: set --zmq-bind")
        })?
        .replace("0.0.0.0", "127.0.0.1");
    let grpc = format!("http://127.0.0.1:{}", config.grpc_addr.port());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = tokio::spawn(crate::app::run(config, async {
        let _ = stopped.await;
    }));

    let mut client = loop {
        match pb::kv_indexer_client::KvIndexerClient::connect(grpc.clone()).await {
            Ok(c) => break c,
            Err(_) if !service.is_finished() => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => return Err(anyhow::anyhow!("the service did not start: {e}")),
        }
    };
    let context = zmq::Context::new();
    let mut publisher = crate::zmq_io::Publisher::connect(&context, &zmq)?;
    tokio::time::sleep(Duration::from_millis(300)).await; // subscription handshake

    let mut fake: Vec<FakePod> = (0..pods)
        .map(|i| FakePod {
            name: format!("pod-{i}"),
            seq: 0,
            refs: HashMap::new(),
            lru: VecDeque::new(),
        })
        .collect();
    let system = tokens(7, 4 * BLOCK); // shared system prompt: 4 blocks
    let conversations = pods * 2;
    let mut prompts: Vec<Vec<u32>> = vec![system.clone(); conversations];

    println!("kv-indexer demo: {pods} fake vLLM pods publishing to {zmq}; gRPC on {grpc}");
    let mut turn = 0u32;
    loop {
        turn += 1;
        let conv = (turn as usize * 7) % conversations;
        // The user's next message joins the conversation.
        let extra = tokens(
            turn as u64 * 31 + conv as u64,
            40 + (turn as usize * 13) % 90,
        );
        prompts[conv].extend_from_slice(&extra);
        let prompt = prompts[conv].clone();

        // Ask the indexer where this prompt's prefix is cached, like an EPP.
        let resp = client
            .score(pb::ScoreRequest {
                model: MODEL.into(),
                input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                    ids: prompt.clone(),
                })),
                pods: fake.iter().map(|p| p.name.clone()).collect(),
                ..Default::default()
            })
            .await?
            .into_inner();
        let best = &resp.pods[0];
        // Follow a conversation's own cache; only the shared system prompt
        // cached (a new conversation): spread the load, as an EPP balances.
        let target = if best.matched_blocks as usize > system.len() / BLOCK {
            fake.iter().position(|p| p.name == best.pod).unwrap_or(0)
        } else {
            conv % pods
        };
        let line: Vec<String> = resp
            .pods
            .iter()
            .map(|p| format!("{}={}/{}", p.pod, p.matched_blocks, resp.total_blocks))
            .collect();
        println!(
            "turn {turn:>3}: conversation {conv} ({} tokens) cached blocks: {}  -> routed to {}",
            prompt.len(),
            line.join("  "),
            fake[target].name
        );

        publish_turn(&mut publisher, &mut fake[target], conv, &prompt).await?;
        if turn == 1 {
            let ids: Vec<String> = prompt.iter().take(48).map(u32::to_string).collect();
            println!(
                "\ntry it while the demo runs (the shared system prompt's first 3 blocks):\n  grpcurl -plaintext -d '{{\"model\":\"{MODEL}\",\"token_ids\":{{\"ids\":[{}]}}}}' localhost:{} kvindexer.v1.KvIndexer/Score\n  grpcurl -plaintext -d '{{}}' localhost:{} kvindexer.v1.KvIndexer/ListPods\n",
                ids.join(","),
                grpc.rsplit(':').next().unwrap_or("50051"),
                grpc.rsplit(':').next().unwrap_or("50051"),
            );
        }
        if turns > 0 && turn >= turns {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(if turns > 0 { 150 } else { 1500 })) => {}
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    let _ = stop.send(());
    service.await??;
    Ok(())
}

/// vLLM-like chained block hashes of a prompt's full blocks.
fn block_hashes(prompt: &[u32]) -> Vec<u64> {
    let mut parent = 0u64;
    prompt
        .chunks_exact(BLOCK)
        .map(|block| {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            parent = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent);
            parent
        })
        .collect()
}

/// Publishes what a vLLM pod would after serving `prompt`: evictions of
/// least recently used conversations' blocks (deepest first, only blocks no
/// other cached conversation uses) to make room, then a store of the blocks
/// it did not have yet, chained to the cached prefix.
async fn publish_turn(
    publisher: &mut crate::zmq_io::Publisher,
    pod: &mut FakePod,
    conv: usize,
    prompt: &[u32],
) -> anyhow::Result<()> {
    let hashes = block_hashes(prompt);
    let mut evicted: Vec<u64> = Vec::new();
    // This conversation's earlier turn is a prefix of this one: release it.
    if let Some(i) = pod.lru.iter().position(|(c, _)| *c == conv) {
        if let Some((_, old)) = pod.lru.remove(i) {
            for h in old {
                if let Some(n) = pod.refs.get_mut(&h) {
                    *n -= 1;
                }
            }
        }
    }
    let needed = hashes.iter().filter(|h| !pod.refs.contains_key(h)).count();
    while pod.refs.len() + needed > POD_CAPACITY_BLOCKS {
        let Some((_, victim)) = pod.lru.pop_front() else {
            break;
        };
        for h in victim.iter().rev() {
            if let Some(n) = pod.refs.get_mut(h) {
                *n -= 1;
                if *n == 0 && !hashes.contains(h) {
                    pod.refs.remove(h);
                    evicted.push(*h);
                }
            }
        }
    }
    let first_new = hashes
        .iter()
        .position(|h| !pod.refs.contains_key(h))
        .unwrap_or(hashes.len());
    // One removal event per evicted block, deepest first, as vLLM frees them.
    let mut events: Vec<WireEvent<'_>> = evicted
        .chunks(1)
        .map(|h| WireEvent::Removed { hashes: h })
        .collect();
    if first_new < hashes.len() {
        events.push(WireEvent::Stored {
            hashes: &hashes[first_new..],
            parent: first_new.checked_sub(1).map(|i| hashes[i]),
            tokens: &prompt[first_new * BLOCK..hashes.len() * BLOCK],
            block_size: BLOCK,
        });
    }
    let msg = vllm_wire::frames(&pod.name, MODEL, pod.seq, vllm_wire::encode_batch(&events));
    for h in &hashes {
        *pod.refs.entry(*h).or_default() += 1;
    }
    pod.lru.push_back((conv, hashes));
    pod.seq += 1;
    publisher.send(&msg)?;
    Ok(())
}

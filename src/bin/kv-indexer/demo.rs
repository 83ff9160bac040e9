//! `kv-indexer demo`: the real service, plus a built-in publisher that
//! behaves like a few vLLM pods serving multi-turn conversations that share a
//! system prompt. It publishes vLLM's own wire form (msgpack map events over
//! ZeroMQ PUB), routes each turn to the pod the indexer scores best (the way
//! an EPP would), evicts least recently used conversations when a pod is
//! full, and prints how the scores move.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::publish::{announce_pods, listed};
use kv_indexer::config::Config;
use kv_indexer::proto::kvindexer::v1 as pb;
use simulator::vllm_wire::{self, WireEvent};

const MODEL: &str = "demo/model";
const BLOCK: usize = 16;
/// Blocks of the shared system prompt.
const SYSTEM_BLOCKS: usize = 4;
/// A conversation lives this many turns, then a new one takes its place.
const TURNS_PER_CONVERSATION: u32 = 6;
/// A conversation's history is at most 4 + 6 x 130 / 16 = 53 blocks: a pod
/// holds two or three, so evictions happen (and show) without erasing
/// every match.
const POD_CAPACITY_BLOCKS: usize = 128;

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

struct Conversation {
    id: usize,
    prompt: Vec<u32>,
    turns: u32,
}

/// `0.0.0.0:P` / `tcp://*:P` as a local client dials it.
fn local(addr: &str) -> String {
    addr.replace("0.0.0.0", "127.0.0.1")
        .replace("//*:", "//127.0.0.1:")
}

pub async fn run(
    config: Config,
    pods: usize,
    turns: u32,
    interval: Duration,
) -> anyhow::Result<()> {
    let bound_zmq = config.zmq_bind.clone().ok_or_else(|| {
        anyhow::anyhow!("the demo publishes to the bound SUB socket: set --zmq-bind")
    })?;
    let zmq = local(&bound_zmq.to_string());
    let grpc_bound = config.grpc_addr.to_string();
    let grpc_port = config.grpc_addr.port();
    let grpc = format!("http://{}", local(&grpc_bound));
    let metrics = config
        .metrics_addr
        .map_or_else(|| "off".to_owned(), |a| a.to_string());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = tokio::spawn(kv_indexer::app::run(config, async {
        let _ = stopped.await;
    }));

    let mut client = loop {
        match pb::kv_indexer_client::KvIndexerClient::connect(grpc.clone()).await {
            Ok(c) => break c,
            Err(_) if !service.is_finished() => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(_) => {
                // The service's own error says what failed (a taken port...).
                service.await??;
                return Err(anyhow::anyhow!("the service stopped before it answered"));
            }
        }
    };
    let context = zmq::Context::new();
    let mut publisher = kv_indexer::zmq_io::Publisher::connect(&context, &zmq)?;
    let mut fake: Vec<FakePod> = (0..pods)
        .map(|i| FakePod {
            name: format!("pod-{i}"),
            seq: 0,
            refs: HashMap::new(),
            lru: VecDeque::new(),
        })
        .collect();
    announce(&publisher, &mut fake, &mut client).await?;

    let system = tokens(7, SYSTEM_BLOCKS * BLOCK);
    let active = pods * 2;
    let mut next_id = 0;
    let mut conversations: Vec<Conversation> = (0..active)
        .map(|_| {
            next_id += 1;
            Conversation {
                id: next_id - 1,
                prompt: system.clone(),
                turns: 0,
            }
        })
        .collect();

    let until = match turns {
        0 => "until Ctrl-C".to_owned(),
        n => format!(
            "for {n} turns, {} apart",
            humantime::format_duration(interval)
        ),
    };
    println!(
        "kv-indexer demo: {pods} fake vLLM pods publishing to {bound_zmq}; gRPC on {grpc_bound}, \
         metrics on {metrics}; runs {until}"
    );
    let ids: Vec<String> = system.iter().take(48).map(u32::to_string).collect();
    println!(
        "\ntry it while the demo runs (the shared system prompt's first 3 blocks):\n  grpcurl -plaintext -d '{{\"model\":\"{MODEL}\",\"token_ids\":{{\"ids\":[{}]}}}}' localhost:{grpc_port} kvindexer.v1.KvIndexer/Score\n  grpcurl -plaintext -d '{{}}' localhost:{grpc_port} kvindexer.v1.KvIndexer/ListPods\n",
        ids.join(","),
    );
    let mut turn = 0u32;
    loop {
        turn += 1;
        let slot = (turn as usize * 7) % active;
        if conversations[slot].turns == TURNS_PER_CONVERSATION {
            let ended = conversations[slot].id;
            conversations[slot] = Conversation {
                id: next_id,
                prompt: system.clone(),
                turns: 0,
            };
            println!("conversation {ended} ended; conversation {next_id} begins");
            next_id += 1;
        }
        let conv = &mut conversations[slot];
        conv.turns += 1;
        // The user's next message joins the conversation.
        let extra = tokens(
            u64::from(turn) * 31 + conv.id as u64,
            40 + (turn as usize * 13) % 90,
        );
        conv.prompt.extend_from_slice(&extra);
        let prompt = conv.prompt.clone();

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
        let target = if best.matched_blocks as usize > SYSTEM_BLOCKS {
            fake.iter().position(|p| p.name == best.pod).unwrap_or(0)
        } else {
            conv.id % pods
        };
        let mut line: Vec<String> = resp
            .pods
            .iter()
            .map(|p| format!("{}={}/{}", p.pod, p.matched_blocks, resp.total_blocks))
            .collect();
        line.sort();
        let evicted = publish_turn(&mut publisher, &mut fake[target], conv.id, &prompt)?;
        let evicted = match evicted {
            0 => String::new(),
            n => format!(" (evicted {n} blocks to make room)"),
        };
        println!(
            "turn {turn:>3}: conversation {} turn {} ({} tokens) cached blocks: {}  -> routed to {}{evicted}",
            conv.id,
            conv.turns,
            prompt.len(),
            line.join("  "),
            fake[target].name
        );
        // As a real pod's events arrive within milliseconds, the next turn
        // sees this one's blocks.
        wait_applied(&mut client, &fake[target]).await?;
        if turns > 0 && turn >= turns {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    let _ = stop.send(());
    service.await??;
    Ok(())
}

/// Each fake pod publishes an empty batch (seq 0) until the indexer lists
/// it: a fresh PUB socket drops messages until the subscription reached it.
async fn announce(
    publisher: &kv_indexer::zmq_io::Publisher,
    fake: &mut [FakePod],
    client: &mut pb::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>,
) -> anyhow::Result<()> {
    let names: Vec<String> = fake.iter().map(|p| p.name.clone()).collect();
    announce_pods(publisher, MODEL, &names, client).await?;
    for pod in fake {
        pod.seq = 1;
    }
    Ok(())
}

/// Waits (bounded) until the indexer applied every batch `pod` published.
async fn wait_applied(
    client: &mut pb::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>,
    pod: &FakePod,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while std::time::Instant::now() < deadline {
        if listed(client, MODEL)
            .await?
            .iter()
            .any(|p| p.pod == pod.name && p.last_seq.is_some_and(|s| s + 1 >= pod.seq))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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
/// Returns how many blocks it evicted.
fn publish_turn(
    publisher: &mut kv_indexer::zmq_io::Publisher,
    pod: &mut FakePod,
    conv: usize,
    prompt: &[u32],
) -> anyhow::Result<usize> {
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
    Ok(evicted.len())
}

//! The `ingest` part: pods publish pre-encoded vLLM batches over ZeroMQ
//! PUB at offered block rates, then as fast as they can, and the service's
//! applied counters give what it absorbed and lost.

use std::time::{Duration, Instant};

use kv_indexer::zmq_io::Publisher;
use pb::kv_indexer_client::KvIndexerClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

use super::{applied, lcg, pb, random_tokens, store_batch, ZmqMessage};

const PUBLISHERS: usize = 8;
const STORE_BLOCKS: usize = 32;
/// Chains a pod keeps before removing the oldest: bounds the index.
const KEEP_CHAINS: usize = 16;

/// One pod's pre-encoded batches: each stores a new 32-block chain and,
/// once the pod holds `KEEP_CHAINS`, removes the oldest one. Returns the
/// frames and the block operations each carries.
fn pod_batches(pod: &str, first_seq: u64, n: usize, salt: u64) -> Vec<(ZmqMessage, u64)> {
    let mut x = salt;
    let mut chains: Vec<Vec<u64>> = Vec::new();
    (0..n)
        .map(|i| {
            let tokens = random_tokens(&mut x, STORE_BLOCKS);
            let hashes: Vec<u64> = (0..STORE_BLOCKS).map(|_| lcg(&mut x) << 17 | 1).collect();
            chains.push(hashes);
            let removed = if chains.len() > KEEP_CHAINS {
                chains.remove(0)
            } else {
                Vec::new()
            };
            let stored = chains.last().expect("just pushed");
            let seq = first_seq + i as u64;
            let ops = (STORE_BLOCKS + removed.len()) as u64;
            (store_batch(pod, seq, stored, None, &tokens, &removed), ops)
        })
        .collect()
}

struct IngestResult {
    offered: Option<f64>,
    sent_blocks: u64,
    applied_blocks: u64,
    seconds: f64,
    gaps: u64,
}

/// Publishes `batches_per_pod` batches from every pod at `rate` blocks/s in
/// total (`None`: as fast as possible) and waits for the service to apply
/// them (or stop making progress).
async fn ingest_step(
    client: &mut KvIndexerClient<Channel>,
    pods: &mut [(Option<Publisher>, String, u64)],
    batches_per_pod: usize,
    rate: Option<f64>,
    salt: u64,
) -> IngestResult {
    let prepared: Vec<Vec<(ZmqMessage, u64)>> = pods
        .iter()
        .enumerate()
        .map(|(i, (_, name, seq))| pod_batches(name, *seq, batches_per_pod, salt + i as u64))
        .collect();
    let sent_blocks: u64 = prepared.iter().flatten().map(|(_, ops)| ops).sum();
    let (before, gaps_before) = applied(client, "ingest-").await;
    let start = Instant::now();
    let per_pod_rate = rate.map(|r| r / pods.len() as f64);
    let mut tasks = Vec::new();
    for ((socket, name, seq), batches) in pods
        .iter_mut()
        .map(|(s, n, q)| {
            (
                s.take().expect("publisher returned by its last step"),
                n.clone(),
                *q,
            )
        })
        .zip(prepared)
    {
        let count = batches.len() as u64;
        tasks.push(tokio::spawn(async move {
            let mut done_ops = 0u64;
            for (msg, ops) in batches {
                if let Some(r) = per_pod_rate {
                    // Open loop: batch k leaves at (ops so far) / rate.
                    let due = start + Duration::from_secs_f64(done_ops as f64 / r);
                    let now = Instant::now();
                    if due > now + Duration::from_micros(200) {
                        tokio::time::sleep(due - now).await;
                    }
                }
                socket.send(&msg).expect("publish");
                done_ops += ops;
            }
            (Some(socket), name, seq + count)
        }));
    }
    for (slot, task) in pods.iter_mut().zip(tasks) {
        *slot = task.await.expect("publisher");
    }
    // Wait for the service to drain: done when everything sent is applied,
    // or nothing moved for a second (then the rest was lost).
    let mut last = (before, Instant::now());
    let mut finished = start;
    loop {
        let (now_applied, _) = applied(client, "ingest-").await;
        if now_applied != last.0 {
            last = (now_applied, Instant::now());
            finished = Instant::now();
        }
        if now_applied - before >= sent_blocks || last.1.elapsed() > Duration::from_secs(1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (after, gaps_after) = applied(client, "ingest-").await;
    IngestResult {
        offered: rate,
        sent_blocks,
        applied_blocks: after - before,
        seconds: (finished - start).as_secs_f64(),
        gaps: gaps_after - gaps_before,
    }
}

pub(crate) async fn ingest(
    zmq: &str,
    client: &mut KvIndexerClient<Channel>,
    quick: bool,
) -> Vec<Value> {
    let context = zmq::Context::new();
    let mut pods = Vec::new();
    for i in 0..PUBLISHERS {
        let s = Publisher::connect(&context, zmq).expect("connect PUB");
        pods.push((Some(s), format!("ingest-{i}"), 0u64));
    }
    // Subscriptions reach a PUB socket asynchronously: warm each pod up
    // until its first batch is applied, so nothing measured is dropped for
    // lack of a subscriber.
    loop {
        let r = ingest_step(client, &mut pods, 1, None, 1).await;
        if r.applied_blocks == r.sent_blocks {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let secs = if quick { 1.0 } else { 3.0 };
    println!("\ningest: {PUBLISHERS} pods, batches of {STORE_BLOCKS} stored + {STORE_BLOCKS} removed blocks (16 token ids each)");
    println!(
        "{:>14} {:>12} {:>12} {:>14} {:>8} {:>6}",
        "offered/s", "sent", "applied", "absorbed/s", "lost", "gaps"
    );
    let mut out = Vec::new();
    let rates: Vec<Option<f64>> = [250e3, 500e3, 1e6, 1.5e6, 2e6]
        .into_iter()
        .map(Some)
        .chain([None])
        .collect();
    for (i, rate) in rates.into_iter().enumerate() {
        let blocks = rate.unwrap_or(2e6) * secs;
        let per_pod = (blocks / (2 * STORE_BLOCKS * PUBLISHERS) as f64).ceil() as usize;
        let r = ingest_step(
            client,
            &mut pods,
            per_pod.max(1),
            rate,
            1000 + i as u64 * 97,
        )
        .await;
        let absorbed = r.applied_blocks as f64 / r.seconds.max(1e-9);
        println!(
            "{:>14} {:>12} {:>12} {:>14.0} {:>8} {:>6}",
            r.offered.map_or("max".to_string(), |o| format!("{o:.0}")),
            r.sent_blocks,
            r.applied_blocks,
            absorbed,
            r.sent_blocks - r.applied_blocks.min(r.sent_blocks),
            r.gaps
        );
        out.push(json!({
            "offered_blocks_per_s": r.offered,
            "sent_blocks": r.sent_blocks,
            "applied_blocks": r.applied_blocks,
            "absorbed_blocks_per_s": absorbed,
            "lost_blocks": r.sent_blocks.saturating_sub(r.applied_blocks),
            "seq_gaps": r.gaps,
        }));
    }
    out
}

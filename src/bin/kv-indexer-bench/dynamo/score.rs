//! The peer Score part: one 2,048-block prompt over 64 pods, both answers
//! checked, then ours (gRPC) and Dynamo (HTTP `/query`) one request at a
//! time and at open-loop rates, taking turns, each side's rate steps while
//! its own background pods publish (`--ingest-rate` stored blocks/s): a
//! router asks while the fleet's events stream in.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_indexer::proto::kvindexer::v1 as pb;
use serde_json::{json, Value};
use simulator::vllm_wire::{encode_batch, frames, WireEvent};

use super::http::{dynamo_query_time, http_request, Http};
use super::processes::{Peers, Pods};
use super::{Side, PROMPT_BLOCKS, SCORE_ID, SCORE_PODS, SIDES};
use crate::score::{open_loop, score_at_rate, score_step, Step};
use crate::score_client::{grpc_message, ScoreClient};
use crate::under_ingest::{publish, timeline, LoadPod};
use crate::{percentile, pods_named, random_tokens, ZmqMessage, BLOCK, MODEL};

/// Like `score_at_rate`, against Dynamo's `/query`.
async fn dynamo_score_at_rate(
    http: &Arc<Http>,
    request: bytes::Bytes,
    rate: f64,
    seconds: f64,
) -> (Vec<Duration>, f64) {
    let looped = open_loop(rate, seconds, |_| {
        let http = http.clone();
        let req = request.clone();
        async move {
            let (status, _) = http.send(&req).await.expect("POST /query");
            assert_eq!(status, 200, "POST /query");
            None
        }
    })
    .await;
    (looped.lat, looped.achieved)
}

async fn dynamo_score_step(
    http: &Arc<Http>,
    request: &bytes::Bytes,
    rate: f64,
    seconds: f64,
) -> Step {
    let (s0, n0) = dynamo_query_time(http).await;
    let (lat, achieved) = dynamo_score_at_rate(http, request.clone(), rate, seconds).await;
    let (s1, n1) = dynamo_query_time(http).await;
    Step {
        achieved,
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        p999: percentile(&lat, 0.999),
        service_us: (n1 > n0).then(|| (s1 - s0) / (n1 - n0) * 1e6),
        service_tail_us: None,
        slowest_us: None,
    }
}

/// Runs `during` while one side's background pods publish `blocks_per_s`
/// stored blocks/s for `seconds`: the under-ingest bench's load (each pod
/// a cycle of a 2,048-block prefill, 16-block turns and one-block decodes,
/// evicting its oldest chains), pre-encoded and paced on a thread of its
/// own. Returns its output and the stored blocks sent.
async fn streaming<T>(
    pods: &mut Pods,
    load: &mut [LoadPod],
    side: Side,
    blocks_per_s: f64,
    seconds: f64,
    during: impl std::future::Future<Output = T>,
) -> (T, u64) {
    let plan = timeline(load, blocks_per_s, seconds);
    let sockets = pods.publishers[side as usize]
        .iter_mut()
        .map(|p| p.take().expect("publisher"))
        .collect();
    let publisher = publish(sockets, plan.sends);
    let out = during.await;
    let (sockets, _late) = tokio::task::spawn_blocking(move || publisher.join())
        .await
        .expect("join")
        .expect("background publisher");
    pods.publishers[side as usize] = sockets.into_iter().map(Some).collect();
    (out, plan.stored)
}

/// Dynamo's answer to `/query`, as matched blocks per instance id.
fn dynamo_matched(body: &[u8]) -> Vec<(u64, u32)> {
    let v: Value = serde_json::from_slice(body).expect("/query answer is JSON");
    let mut out: Vec<(u64, u32)> = v["scores"]
        .as_object()
        .map(|workers| {
            workers
                .iter()
                .filter_map(|(id, ranks)| {
                    let tokens: u64 = ranks.as_object()?.values().filter_map(Value::as_u64).sum();
                    Some((id.parse().ok()?, (tokens / BLOCK as u64) as u32))
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out
}

pub(super) async fn score(
    peers: &mut Peers,
    pods: &Pods,
    background: &mut Pods,
    ingest_rate: f64,
    quick: bool,
) -> Value {
    // Each side's background pods stream from the same seeds: the same bytes.
    let mut load: [Vec<LoadPod>; 2] = SIDES.map(|_| {
        background
            .names
            .iter()
            .enumerate()
            .map(|(i, name)| LoadPod::named(name.clone(), i))
            .collect()
    });
    // The e2e Score shape: 64 pods hold the first 32, 64, ... 2048 blocks
    // of one 2048-block prompt.
    let mut x = 42u64;
    let tokens = random_tokens(&mut x, PROMPT_BLOCKS);
    let hashes: Vec<u64> = (0..PROMPT_BLOCKS as u64)
        .map(|i| 0x5c0e_0000_0000 + i)
        .collect();
    let depth = |i: usize| (i + 1) * PROMPT_BLOCKS / SCORE_PODS;
    let msgs: Vec<ZmqMessage> = pods
        .names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let payload = encode_batch(&[WireEvent::Stored {
                hashes: &hashes[..depth(i)],
                parent: None,
                tokens: &tokens[..depth(i) * BLOCK],
                block_size: BLOCK,
            }]);
            frames(name, MODEL, 0, payload)
        })
        .collect();
    let expected: Vec<(u64, u32)> = (0..SCORE_PODS)
        .map(|i| (SCORE_ID + i as u64, depth(i) as u32))
        .collect();
    let request = pb::ScoreRequest {
        model: MODEL.into(),
        input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
            ids: tokens.clone(),
        })),
        ..Default::default()
    };
    let query = http_request(
        "POST",
        "/query",
        json!({"token_ids": tokens, "model_name": MODEL})
            .to_string()
            .as_bytes(),
    );
    // Publish until both hold every pod's blocks (same seq every time:
    // re-sends are duplicates), and check each answer once.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for side in SIDES {
            for (p, msg) in pods.publishers[side as usize].iter().zip(&msgs) {
                p.as_ref().expect("publisher").send(msg).expect("publish");
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let ours_ready = pods_named(&mut peers.ours, "peer-score-").await.len() == SCORE_PODS;
        let (status, body) = peers.dynamo.send(&query).await.expect("POST /query");
        if ours_ready && status == 200 && dynamo_matched(&body) == expected {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "score pods never indexed (Dynamo answered {status}: {:?})",
            dynamo_matched(&body)
        );
    }
    let answer = peers
        .ours
        .score(request.clone())
        .await
        .expect("Score")
        .into_inner();
    let mut ours_matched: Vec<(String, u32)> = answer
        .pods
        .iter()
        .filter(|p| p.pod.starts_with("peer-score-"))
        .map(|p| (p.pod.clone(), p.matched_blocks))
        .collect();
    ours_matched.sort();
    let ours_expected: Vec<(String, u32)> = pods
        .names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.clone(), depth(i) as u32))
        .collect();
    assert_eq!(ours_matched, ours_expected, "ours: wrong scores");

    let scores = ScoreClient::connect(&peers.ours_grpc, 8)
        .await
        .expect("connect");
    let connections = 64;
    peers
        .dynamo
        .warm(connections)
        .await
        .expect("connect to Dynamo");
    let message = grpc_message(&prost::Message::encode_to_vec(&request));
    let (seconds, repeats) = if quick { (1.0, 1) } else { (3.0, 3) };
    let _ = score_at_rate(&scores, message.clone(), 200.0, 0.5).await;
    let _ = dynamo_score_at_rate(&peers.dynamo, query.clone(), 200.0, 0.5).await;
    // One request at a time, alternating: each side's cost per request
    // without queueing behind the others.
    let rounds = if quick { 30 } else { 100 };
    let mut alone: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..rounds {
        let t = Instant::now();
        scores.score(0, message.clone()).await.expect("Score");
        alone[0].push(t.elapsed());
        let t = Instant::now();
        let (status, _) = peers.dynamo.send(&query).await.expect("POST /query");
        assert_eq!(status, 200, "POST /query");
        alone[1].push(t.elapsed());
    }
    let mut alone_json = serde_json::Map::new();
    println!("\npeer Score, one request at a time ({rounds} each, alternating):");
    for (side, mut lat) in SIDES.into_iter().zip(alone) {
        lat.sort_unstable();
        let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
        println!("{:>8}: p50 {p50:.0} us, p99 {p99:.0} us", side.name());
        alone_json.insert(side.name().into(), json!({"p50_us": p50, "p99_us": p99}));
    }
    alone_json.insert("requests".into(), json!(rounds));
    println!(
        "\npeer Score, token ids: 2048 blocks (32768 tokens), 64 pods at 64 depths, open loop; \
         ours: gRPC, 8 HTTP/2 connections; dynamo: HTTP/1.1 POST /query (JSON), {connections} keep-alive connections; \
         {repeats} run(s) each, taking turns; per rate the run with the median p99; \
         while each side's 8 background pods publish {ingest_rate:.0} stored blocks/s (under-ingest's load)"
    );
    println!(
        "{:>9} | {:>8} {:>8} {:>8} {:>8} {:>11} | {:>8} {:>8} {:>8} {:>8} {:>11} | {:>9} {:>6}",
        "offered/s",
        "ours/s",
        "p50 us",
        "p99 us",
        "p999 us",
        "svc avg/p99",
        "dyn/s",
        "p50 us",
        "p99 us",
        "p999 us",
        "svc avg",
        "p99 ratio",
        "<=0.3"
    );
    let mut rows = Vec::new();
    // Ours' slowest requests per rate, for the line under the table.
    let mut slowest = Vec::new();
    let mut all_met = true;
    // The rate at which a side fell behind (achieved < 80% of offered, or
    // p99 over a second): it sits out its remaining runs and higher rates,
    // which would only measure its queue.
    let mut saturated: [Option<f64>; 2] = [None, None];
    // Stored blocks each side's background pods sent during its steps.
    let mut streamed = [0u64; 2];
    for rate in [500.0, 1000.0, 2000.0] {
        let mut runs: [Vec<Step>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..repeats {
            for side in SIDES {
                let i = side as usize;
                if saturated[i].is_some() {
                    continue;
                }
                let during = async {
                    match side {
                        Side::Ours => {
                            score_step(
                                &scores,
                                &message,
                                Some(peers.ours_metrics.as_str()),
                                rate,
                                seconds,
                            )
                            .await
                        }
                        Side::Dynamo => {
                            dynamo_score_step(&peers.dynamo, &query, rate, seconds).await
                        }
                    }
                };
                let (step, sent) =
                    streaming(background, &mut load[i], side, ingest_rate, seconds, during).await;
                streamed[i] += sent;
                if step.achieved < 0.8 * rate || step.p99 > 1e6 {
                    saturated[i] = Some(rate);
                }
                runs[i].push(step);
            }
        }
        let mut picked: Vec<Option<Step>> = Vec::new();
        let mut row = serde_json::Map::new();
        row.insert("offered_per_s".into(), json!(rate));
        for (side, mut r) in SIDES.into_iter().zip(runs) {
            if r.is_empty() {
                row.insert(side.name().into(), Value::Null);
                picked.push(None);
                continue;
            }
            r.sort_by(|a, b| a.p99.total_cmp(&b.p99));
            let p99_runs: Vec<f64> = r.iter().map(|s| s.p99).collect();
            let s = r.swap_remove(r.len() / 2);
            row.insert(
                side.name().into(),
                json!({"achieved_per_s": s.achieved, "p50_us": s.p50, "p99_us": s.p99,
                    "p999_us": s.p999, "service_mean_us": s.service_us, "service_tail_us": s.service_tail_us, "slowest_us": s.slowest_us, "p99_us_runs": p99_runs,
                    "fell_behind": saturated[side as usize] == Some(rate)}),
            );
            picked.push(Some(s));
        }
        let cell = |s: &Option<Step>| match s {
            Some(s) => format!(
                "{:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>11}",
                s.achieved,
                s.p50,
                s.p99,
                s.p999,
                s.service_column()
            ),
            None => format!("{:>8} {:>8} {:>8} {:>8} {:>11}", "-", "-", "-", "-", "-"),
        };
        let ratio = match (&picked[0], &picked[1]) {
            (Some(a), Some(b)) => Some(a.p99 / b.p99),
            _ => None,
        };
        // Against a peer that cannot sustain the rate at all, ours is
        // ahead by more than any ratio; a fallen-behind ours is not.
        let met = match (ratio, saturated[0], saturated[1]) {
            (_, Some(r), _) if r <= rate => false,
            (Some(x), _, _) => x <= 0.3,
            (None, _, Some(_)) => true,
            (None, _, None) => false,
        };
        all_met &= met;
        println!(
            "{rate:>9.0} | {} | {} | {:>9} {:>6}",
            cell(&picked[0]),
            cell(&picked[1]),
            ratio.map_or("-".into(), |x| format!("{x:.2}x")),
            if met { "met" } else { "missed" }
        );
        row.insert("p99_ours_over_dynamo".into(), json!(ratio));
        row.insert("goal_met".into(), json!(met));
        rows.push(Value::Object(row));
        if let Some(s) = picked[0].as_ref().and_then(|s| s.slowest_us) {
            slowest.push(format!(
                "{rate:.0}/s ({} requests): {:.0} us, the handler {:.0} us, its share {:.1}%",
                s.requests,
                s.total_us,
                s.handler_us,
                100.0 * s.handler_share
            ));
        }
    }
    if !slowest.is_empty() {
        println!(
            "ours, the requests at or past the p99, each on its own (medians of their times, of their handler's as each answer told it, and of each one's handler share): {}",
            slowest.join("; ")
        );
    }
    for (side, at) in SIDES.iter().zip(saturated) {
        if let Some(at) = at {
            println!(
                "{} fell behind at {at:.0}/s (not run above it)",
                side.name()
            );
        }
    }
    println!(
        "background during the rate steps: {ingest_rate:.0} stored blocks/s offered; sent ours {}, dynamo {}",
        streamed[0], streamed[1]
    );
    json!({"one_at_a_time": alone_json, "rates": rows, "dynamo_connections": connections,
        "background_stored_blocks_per_s": ingest_rate,
        "background_sent": {"ours": streamed[0], "dynamo": streamed[1]},
        "fell_behind_at": {"ours": saturated[0], "dynamo": saturated[1]},
        "goal_p99_at_most_0_3x_met": all_met})
}

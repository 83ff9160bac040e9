//! Routing feedback over real sockets: `RecordRouting` after the pick,
//! speculative entries beside the exact index, their TTL (fixed and
//! learned), real stores superseding them, the parity diagnosis, and the
//! approximate index for models whose pods publish nothing.

use std::time::{Duration, Instant};

use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;
use pb::kv_indexer_client::KvIndexerClient;
use simulator::vllm_wire::{encode_batch, frames, WireEvent};
use tonic::transport::Channel;

const BS: usize = 16;

/// A prompt of `blocks` full blocks no pod has seen (distinct per `seed`).
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32)
        .map(|i| 1000 + seed * 10_000 + i)
        .collect()
}

fn score_request(model: &str, tokens: &[u32], pods: &[&str]) -> pb::ScoreRequest {
    pb::ScoreRequest {
        model: model.into(),
        input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
            ids: tokens.to_vec(),
        })),
        pods: pods.iter().map(|p| p.to_string()).collect(),
        ..Default::default()
    }
}

fn record_request(
    model: &str,
    pod: &str,
    input: pb::record_routing_request::Input,
) -> pb::RecordRoutingRequest {
    pb::RecordRoutingRequest {
        model: model.into(),
        pod: pod.into(),
        input: Some(input),
        ..Default::default()
    }
}

fn by_tokens(tokens: &[u32]) -> pb::record_routing_request::Input {
    pb::record_routing_request::Input::TokenIds(pb::TokenIds {
        ids: tokens.to_vec(),
    })
}

async fn score(
    client: &mut KvIndexerClient<Channel>,
    model: &str,
    tokens: &[u32],
    pods: &[&str],
) -> pb::ScoreResponse {
    client
        .score(score_request(model, tokens, pods))
        .await
        .expect("Score")
        .into_inner()
}

fn pod<'a>(resp: &'a pb::ScoreResponse, name: &str) -> &'a pb::PodScore {
    resp.pods
        .iter()
        .find(|p| p.pod == name)
        .unwrap_or_else(|| panic!("{name} not in {resp:?}"))
}

/// The pod's `BlockStored` of `tokens` from the prompt's start, as vLLM
/// publishes it (map form, engine hashes of its own).
fn stored(pod: &str, seq: u64, tokens: &[u32], hash_base: u64) -> ZmqMessage {
    let hashes: Vec<u64> = (0..(tokens.len() / BS) as u64)
        .map(|i| hash_base + i)
        .collect();
    let payload = encode_batch(&[WireEvent::Stored {
        hashes: &hashes,
        parent: None,
        tokens,
        block_size: BS,
    }]);
    zmq_message(frames(pod, WARMUP_MODEL, seq, payload))
}

/// Bind-mode service with the named pods connected and known.
async fn service_with_pods(args: &[&str], pods: &[&str]) -> (Service, Vec<Publisher>) {
    let service = Service::start(args).await;
    let endpoint = service.zmq_bind.clone().unwrap();
    let mut publishers = Vec::new();
    for name in pods {
        let mut p = Publisher::connect(&endpoint).await;
        p.wait_subscribed(&service, name).await;
        publishers.push(p);
    }
    (service, publishers)
}

fn outcomes(service: &Service, outcome: &str) -> f64 {
    service.metric(&format!(
        "kv_indexer_routing_outcomes_total{{model=\"{WARMUP_MODEL}\",outcome=\"{outcome}\"}}"
    ))
}

async fn wait_outcomes(service: &Service, outcome: &str, n: f64) {
    let series = format!(
        "kv_indexer_routing_outcomes_total{{model=\"{WARMUP_MODEL}\",outcome=\"{outcome}\"}}"
    );
    service.wait_metric(&series, |got| got == n).await;
}

/// Ten parallel tool calls of an agent share a new prefix: the first is
/// sent to `c` (the router had its reasons), and every later Score, before
/// any event, sends the rest to `c` too. Without speculative entries all
/// three pods score 0 and the burst scatters.
#[tokio::test]
async fn a_burst_for_a_new_prefix_lands_on_the_first_picked_pod_before_any_event() {
    let (service, _pods) = service_with_pods(&["--speculative-ttl", "30s"], &["a", "b", "c"]).await;
    let mut client = service.client().await;
    let shared = prompt(1, 8);
    let mut picks = Vec::new();
    for call in 0..10u32 {
        // The shared prefix and a tail of its own.
        let mut tokens = shared.clone();
        tokens.extend((0..BS as u32).map(|i| 900_000 + call * 100 + i));
        let resp = score(&mut client, WARMUP_MODEL, &tokens, &["a", "b", "c"]).await;
        assert_ne!(resp.prompt_handle, 0);
        assert!(resp.pods.iter().all(|p| p.matched_blocks == 0), "{resp:?}");
        let pick = if call == 0 {
            "c".to_string()
        } else {
            let best = &resp.pods[0];
            assert_eq!(best.speculative_blocks, 8, "{resp:?}");
            best.pod.clone()
        };
        let rec = client
            .record_routing(record_request(
                WARMUP_MODEL,
                &pick,
                pb::record_routing_request::Input::PromptHandle(resp.prompt_handle),
            ))
            .await
            .expect("RecordRouting")
            .into_inner();
        assert_eq!((rec.total_blocks, rec.held_blocks), (9, 0), "{rec:?}");
        assert_eq!(rec.speculative_blocks, 9);
        assert_eq!(rec.ttl_seconds, 30.0);
        picks.push(pick);
    }
    assert!(picks.iter().all(|p| p == "c"), "{picks:?}");
    // The exact answer is untouched; the other pods have nothing.
    let resp = score(&mut client, WARMUP_MODEL, &shared, &["a", "b", "c"]).await;
    assert_eq!(pod(&resp, "c").matched_blocks, 0);
    assert_eq!(pod(&resp, "c").speculative_blocks, 8);
    assert_eq!(pod(&resp, "a").speculative_blocks, 0);
    assert_eq!(service.metric("kv_indexer_speculative_entries"), 8.0 + 10.0);
}

/// Nothing arrives: at the TTL the entries are gone from Score at once,
/// and the routing ends `unconfirmed`.
#[tokio::test]
async fn speculative_entries_vanish_at_the_ttl_when_no_event_comes() {
    let (service, _pods) = service_with_pods(&["--speculative-ttl", "600ms"], &["a"]).await;
    let mut client = service.client().await;
    let tokens = prompt(2, 4);
    let recorded = Instant::now();
    client
        .record_routing(record_request(WARMUP_MODEL, "a", by_tokens(&tokens)))
        .await
        .expect("RecordRouting");
    let resp = score(&mut client, WARMUP_MODEL, &tokens, &["a"]).await;
    // (Checked before the TTL, however slow the machine.)
    if recorded.elapsed() < Duration::from_millis(500) {
        assert_eq!(pod(&resp, "a").speculative_blocks, 4, "{resp:?}");
        assert_eq!(pod(&resp, "a").score, 1.0);
    }
    tokio::time::sleep(Duration::from_millis(650).saturating_sub(recorded.elapsed())).await;
    let resp = score(&mut client, WARMUP_MODEL, &tokens, &["a"]).await;
    assert_eq!(pod(&resp, "a").speculative_blocks, 0, "{resp:?}");
    assert_eq!(pod(&resp, "a").score, 0.0);
    wait_outcomes(&service, "unconfirmed", 1.0).await;
    // Swept within a tick.
    service
        .wait_metric("kv_indexer_speculative_entries", |n| n == 0.0)
        .await;
}

/// The pod's real stores arrive: they are the exact answer now, the
/// speculative entries go, the routing is `confirmed` with its delay, and
/// `--speculative-weight 0` scores exact blocks only.
#[tokio::test]
async fn real_events_supersede_speculative_entries() {
    let (service, mut pods) = service_with_pods(
        &["--speculative-ttl", "30s", "--speculative-weight", "0"],
        &["a"],
    )
    .await;
    let mut client = service.client().await;
    let tokens = prompt(3, 4);
    client
        .record_routing(record_request(WARMUP_MODEL, "a", by_tokens(&tokens)))
        .await
        .expect("RecordRouting");
    let resp = score(&mut client, WARMUP_MODEL, &tokens, &["a"]).await;
    assert_eq!(pod(&resp, "a").speculative_blocks, 4);
    assert_eq!(pod(&resp, "a").score, 0.0, "weight 0: exact only");
    // vLLM stores the first two blocks, then (chunked prefill) the rest.
    pods[0].send(stored("a", 1, &tokens[..2 * BS], 50)).await;
    service
        .wait_until("two blocks stored", async || {
            pod(
                &score(&mut client.clone(), WARMUP_MODEL, &tokens, &["a"]).await,
                "a",
            )
            .matched_blocks
                == 2
        })
        .await;
    // The writer drops the superseded entries just after the index shows
    // the stores: a reader may see the two blocks a moment before.
    service
        .wait_metric("kv_indexer_speculative_entries", |n| n == 2.0)
        .await;
    assert_eq!(outcomes(&service, "confirmed"), 0.0);
    let rest = WireEvent::Stored {
        hashes: &[52, 53],
        parent: Some(51),
        tokens: &tokens[2 * BS..],
        block_size: BS,
    };
    pods[0]
        .send(zmq_message(frames(
            "a",
            WARMUP_MODEL,
            2,
            encode_batch(&[rest]),
        )))
        .await;
    wait_outcomes(&service, "confirmed", 1.0).await;
    let resp = score(&mut client, WARMUP_MODEL, &tokens, &["a"]).await;
    assert_eq!(pod(&resp, "a").matched_blocks, 4);
    assert_eq!(pod(&resp, "a").speculative_blocks, 4);
    assert_eq!(service.metric("kv_indexer_speculative_entries"), 0.0);
    assert_eq!(
        service.metric("kv_indexer_routing_confirm_seconds_count"),
        1.0
    );
    // Routed again once held: confirmed at once, nothing speculative.
    let rec = client
        .record_routing(record_request(WARMUP_MODEL, "a", by_tokens(&tokens)))
        .await
        .expect("RecordRouting")
        .into_inner();
    assert_eq!((rec.held_blocks, rec.speculative_blocks), (4, 0));
    assert_eq!(rec.outcome, "confirmed");
    assert_eq!(outcomes(&service, "confirmed"), 2.0);
}

/// The router's tokens lack the BOS the engine adds: the pod stores the
/// prompt under other keys, and the routing ends `mismatch{cause="bos"}`,
/// with both token sequences in `Diagnose`.
#[tokio::test]
async fn a_pod_that_publishes_the_prompt_with_an_extra_bos_is_a_bos_mismatch() {
    let (service, mut pods) = service_with_pods(&["--speculative-ttl", "500ms"], &["a"]).await;
    let mut client = service.client().await;
    let ours = prompt(4, 4);
    client
        .record_routing(record_request(WARMUP_MODEL, "a", by_tokens(&ours)))
        .await
        .expect("RecordRouting");
    let mut engine = vec![151_643];
    engine.extend_from_slice(&ours[..ours.len() - 1]);
    pods[0].send(stored("a", 1, &engine, 70)).await;
    service
        .wait_metric(
            &format!(
                "kv_indexer_routing_mismatches_total{{model=\"{WARMUP_MODEL}\",cause=\"bos\"}}"
            ),
            |n| n == 1.0,
        )
        .await;
    assert_eq!(outcomes(&service, "mismatch"), 1.0);
    assert_eq!(outcomes(&service, "confirmed"), 0.0);
    let diag = client
        .diagnose(pb::DiagnoseRequest {
            model: WARMUP_MODEL.into(),
        })
        .await
        .expect("Diagnose")
        .into_inner();
    let m = &diag.mismatches[0];
    assert_eq!((m.pod.as_str(), m.cause.as_str()), ("a", "bos"));
    assert_eq!(m.our_tokens[..2], ours[..2]);
    assert_eq!(m.pod_tokens[..2], [151_643, ours[0]]);
    assert!(m.fix.contains("add_special_tokens"), "{m:?}");
}

/// With `auto`, each pod's TTL follows how long its stores take to come
/// after a routing: here a publisher that always stores 200 ms later.
#[tokio::test]
async fn auto_ttl_converges_near_the_publishers_delay() {
    let (service, mut pods) = service_with_pods(&[], &["a"]).await;
    let mut client = service.client().await;
    let delay = Duration::from_millis(200);
    let mut ttl = 0.0;
    for i in 0..10u32 {
        let tokens = prompt(10 + i, 2);
        let rec = client
            .record_routing(record_request(WARMUP_MODEL, "a", by_tokens(&tokens)))
            .await
            .expect("RecordRouting")
            .into_inner();
        ttl = rec.ttl_seconds;
        if i < 8 {
            assert_eq!(ttl, 2.0, "the start, until 8 delays are known");
        }
        tokio::time::sleep(delay).await;
        pods[0]
            .send(stored(
                "a",
                u64::from(i) + 1,
                &tokens,
                1000 * u64::from(i + 1),
            ))
            .await;
        wait_outcomes(&service, "confirmed", f64::from(i + 1)).await;
    }
    // 1.5x the 95th percentile of ~200 ms delays (plus delivery).
    let rec = client
        .record_routing(record_request(WARMUP_MODEL, "a", by_tokens(&prompt(99, 2))))
        .await
        .expect("RecordRouting")
        .into_inner();
    assert!(
        (0.3..=1.5).contains(&rec.ttl_seconds),
        "ttl {} after {ttl}",
        rec.ttl_seconds
    );
}

/// The fixture streams' exact answers do not move when routings to every
/// pod, for every probe, are recorded in the middle of the stream.
#[tokio::test]
async fn exact_matches_on_the_fixture_streams_are_unchanged_with_routings_interleaved() {
    for stream in ["qwen3-sha256-int", "qwen3-lora-salt"] {
        let expected = load_expected(stream);
        let frames = load_frames(stream);
        let service = Service::start(&["--speculative-ttl", "30s"]).await;
        let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
        publisher.wait_subscribed(&service, "marker").await;
        let mut client = service.client().await;
        let half = frames.len() / 2;
        publisher.publish_all(&frames[..half]).await;
        service
            .wait_applied(&expected.model, &batches_per_pod(&frames[..half]))
            .await;
        for probe in &expected.probes {
            for name in &expected.pods {
                let mut req = record_request(&expected.model, name, by_tokens(&probe.token_ids));
                req.lora_name = probe.lora_name.clone().unwrap_or_default();
                req.cache_salt = probe.cache_salt.clone().unwrap_or_default();
                client.record_routing(req).await.expect("RecordRouting");
            }
        }
        publisher.publish_all(&frames[half..]).await;
        service
            .wait_applied(&expected.model, &batches_per_pod(&frames))
            .await;
        check_probes(&service, &expected).await;
        // And every pod's speculative count covers at least its exact one.
        for (_, resp) in probe_answers(&service, &expected).await {
            for p in &resp.pods {
                assert!(p.speculative_blocks >= p.matched_blocks, "{p:?}");
            }
        }
    }
}

/// A model whose pods publish nothing: routing history is its index,
/// flagged `approximate`, with 256-byte text blocks where it has no
/// tokenizer. Once a pod publishes, the exact index answers.
#[tokio::test]
async fn an_approximate_model_is_answered_from_routing_history_until_it_publishes() {
    const MODEL: &str = "approx/model";
    let service = Service::start(&["--approximate-model", MODEL]).await;
    let mut client = service.client().await;
    let document = "a long shared document. ".repeat(40); // 960 bytes
    let text_request = |suffix: &str| pb::ScoreRequest {
        model: MODEL.into(),
        input: Some(pb::score_request::Input::Prompt(format!(
            "{document}{suffix}"
        ))),
        pods: vec!["p1".into(), "p2".into()],
        ..Default::default()
    };
    let first = client
        .score(text_request("first question"))
        .await
        .expect("Score")
        .into_inner();
    assert!(first.approximate);
    assert!(
        first.pods.iter().all(|p| p.matched_blocks == 0),
        "{first:?}"
    );
    assert_eq!(first.total_blocks, 4);
    let rec = client
        .record_routing(record_request(
            MODEL,
            "p1",
            pb::record_routing_request::Input::PromptHandle(first.prompt_handle),
        ))
        .await
        .expect("RecordRouting")
        .into_inner();
    assert!(rec.approximate);
    let second = client
        .score(text_request("second question, longer"))
        .await
        .expect("Score")
        .into_inner();
    assert!(second.approximate);
    // The document's three full 256-byte blocks; the tails differ.
    assert_eq!(pod(&second, "p1").matched_blocks, 3, "{second:?}");
    assert_eq!(pod(&second, "p2").matched_blocks, 0);
    assert!(service.metric("kv_indexer_approximate_entries") >= 4.0);

    // A pod starts publishing: precise from now on.
    let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
    let empty = rmp_serde::to_vec(&(0.0f64, Vec::<u8>::new())).unwrap();
    service
        .wait_until("the model's pod seen", async || {
            publisher
                .send(zmq_message(frames("p1", MODEL, 0, empty.clone())))
                .await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            !service.list_pods(MODEL).await.is_empty()
        })
        .await;
    service
        .wait_log("served from the exact index from now on")
        .await;
    let third = client
        .score(score_request(MODEL, &prompt(5, 2), &["p1"]))
        .await
        .expect("Score")
        .into_inner();
    assert!(!third.approximate, "{third:?}");
}

/// Handles are checked, and routings for models nobody publishes are
/// refused rather than counted under any name a client sends.
#[tokio::test]
async fn bad_routings_get_clear_errors() {
    let (service, _pods) = service_with_pods(&[], &["a"]).await;
    let mut client = service.client().await;
    let expired = client
        .record_routing(record_request(
            WARMUP_MODEL,
            "a",
            pb::record_routing_request::Input::PromptHandle(12345),
        ))
        .await
        .expect_err("unknown handle");
    assert_eq!(expired.code(), tonic::Code::NotFound);
    assert!(expired.message().contains("send the prompt"), "{expired:?}");
    let unknown = client
        .record_routing(record_request(
            "nobody/publishes",
            "a",
            by_tokens(&prompt(6, 1)),
        ))
        .await
        .expect_err("unknown model");
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    let no_pod = client
        .record_routing(record_request(WARMUP_MODEL, "", by_tokens(&prompt(6, 1))))
        .await
        .expect_err("no pod");
    assert_eq!(no_pod.code(), tonic::Code::InvalidArgument);
    // A handle from another model's Score is not this model's.
    let resp = score(&mut client, WARMUP_MODEL, &prompt(7, 2), &["a"]).await;
    let other = client
        .record_routing(record_request(
            "nobody/publishes",
            "a",
            pb::record_routing_request::Input::PromptHandle(resp.prompt_handle),
        ))
        .await
        .expect_err("other model");
    assert_eq!(other.code(), tonic::Code::NotFound);
}

/// Speculative entries live within --max-memory (routing feedback gets an
/// eighth of it): past the bound a routing writes what fits and says so.
#[tokio::test]
async fn speculative_entries_stay_within_max_memory() {
    let (service, _pods) = service_with_pods(
        &["--max-memory", "1MiB", "--speculative-ttl", "30s"],
        &["a"],
    )
    .await;
    let mut client = service.client().await;
    let mut written = 0;
    for i in 0..40u32 {
        let rec = client
            .record_routing(record_request(
                WARMUP_MODEL,
                "a",
                by_tokens(&prompt(200 + i, 64)),
            ))
            .await
            .expect("RecordRouting")
            .into_inner();
        assert_eq!(rec.total_blocks, 64);
        written += rec.speculative_blocks;
    }
    // 1 MiB / 8 for routing, 3/8 of that for speculative entries at 48 bytes.
    let bound = (1 << 20) / 8 / 8 * 3 / 48;
    assert_eq!(written, bound);
    assert_eq!(
        service.metric("kv_indexer_speculative_entries"),
        f64::from(bound)
    );
}

/// An approximate model with a tokenizer is chunked into the model's real
/// token blocks, not 256-byte text blocks.
#[tokio::test]
async fn an_approximate_model_with_a_tokenizer_uses_its_token_blocks() {
    let tokenizer = qwen3_tokenizer_arg();
    let service = Service::start(&[
        "--approximate-model",
        "Qwen/Qwen3-8B",
        "--tokenizer",
        &tokenizer,
    ])
    .await;
    let mut client = service.client().await;
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(30);
    let request = pb::ScoreRequest {
        model: "Qwen/Qwen3-8B".into(),
        input: Some(pb::score_request::Input::Prompt(text.clone())),
        pods: vec!["p1".into()],
        ..Default::default()
    };
    let first = client
        .score(request.clone())
        .await
        .expect("Score")
        .into_inner();
    assert!(first.approximate);
    assert_eq!(first.block_size, 16);
    assert_eq!(first.total_blocks, first.prompt_tokens / 16);
    client
        .record_routing(pb::RecordRoutingRequest {
            model: "Qwen/Qwen3-8B".into(),
            pod: "p1".into(),
            input: Some(pb::record_routing_request::Input::Prompt(text)),
            ..Default::default()
        })
        .await
        .expect("RecordRouting");
    let second = client.score(request).await.expect("Score").into_inner();
    assert_eq!(pod(&second, "p1").matched_blocks, first.total_blocks);
}

/// The pod's vLLM restarts (its seq starts over) while a routing's entries
/// live: its cache is empty, so what it was sent is no longer a good guess
/// either, and the entries go with its blocks.
#[tokio::test]
async fn a_publisher_restart_drops_the_pods_speculative_entries() {
    let (service, mut pods) = service_with_pods(&["--speculative-ttl", "30s"], &["a"]).await;
    let mut client = service.client().await;
    let held = prompt(30, 2);
    pods[0].send(stored("a", 5, &held, 500)).await;
    service
        .wait_until("stored", async || {
            pod(
                &score(&mut client.clone(), WARMUP_MODEL, &held, &["a"]).await,
                "a",
            )
            .matched_blocks
                == 2
        })
        .await;
    let routed = prompt(31, 4);
    client
        .record_routing(record_request(WARMUP_MODEL, "a", by_tokens(&routed)))
        .await
        .expect("RecordRouting");
    let resp = score(&mut client, WARMUP_MODEL, &routed, &["a"]).await;
    assert_eq!(pod(&resp, "a").speculative_blocks, 4);
    // A new run: seq 0 again, with other content.
    let other = prompt(32, 1);
    pods[0].send(stored("a", 0, &other, 900)).await;
    service
        .wait_until("the restart applied", async || {
            let info = service.list_pods(WARMUP_MODEL).await;
            info.iter()
                .any(|p| p.pod == "a" && p.publisher_restarts >= 1)
        })
        .await;
    let resp = score(&mut client, WARMUP_MODEL, &routed, &["a"]).await;
    assert_eq!(pod(&resp, "a").speculative_blocks, 0, "{resp:?}");
    let resp = score(&mut client, WARMUP_MODEL, &held, &["a"]).await;
    assert_eq!(pod(&resp, "a").matched_blocks, 0, "{resp:?}");
    assert_eq!(service.metric("kv_indexer_speculative_entries"), 0.0);
}

/// Approximate history lives within --max-memory too (a quarter of routing
/// feedback's eighth): more pods and blocks than fit only turn it over.
#[tokio::test]
async fn approximate_history_stays_within_max_memory() {
    const MODEL: &str = "approx/bounded";
    let service = Service::start(&["--max-memory", "1MiB", "--approximate-model", MODEL]).await;
    let mut client = service.client().await;
    for i in 0..10u32 {
        client
            .record_routing(record_request(
                MODEL,
                &format!("p{i}"),
                by_tokens(&prompt(300 + i, 64)),
            ))
            .await
            .expect("RecordRouting");
    }
    // 1 MiB / 8 for routing, a quarter of that at 96 bytes a block.
    let bound = f64::from((1u32 << 20) / 8 / 4 / 96);
    assert_eq!(service.metric("kv_indexer_approximate_entries"), bound);
}

/// Prompt handles live within --max-memory (an eighth of routing
/// feedback's eighth): past it the oldest go first and say so.
#[tokio::test]
async fn prompt_handles_stay_within_max_memory() {
    let (service, _pods) = service_with_pods(&["--max-memory", "1MiB"], &["a"]).await;
    let mut client = service.client().await;
    // 64-block prompts: a handle is ~4.7 KB of a 16 KiB budget.
    let mut handles = Vec::new();
    for i in 0..5u32 {
        let resp = score(&mut client, WARMUP_MODEL, &prompt(400 + i, 64), &["a"]).await;
        assert_ne!(resp.prompt_handle, 0);
        handles.push(resp.prompt_handle);
    }
    let record = |handle| {
        record_request(
            WARMUP_MODEL,
            "a",
            pb::record_routing_request::Input::PromptHandle(handle),
        )
    };
    let oldest = client
        .record_routing(record(handles[0]))
        .await
        .expect_err("the oldest handle was dropped");
    assert_eq!(oldest.code(), tonic::Code::NotFound, "{oldest:?}");
    let newest = client
        .record_routing(record(handles[4]))
        .await
        .expect("the newest handle is kept")
        .into_inner();
    assert_eq!(newest.total_blocks, 64);
}

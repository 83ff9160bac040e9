//! SGLang pods over real ZeroMQ and gRPC: SGLang 0.5.23's own recorded
//! streams (`tests/fixtures/sglang-events`: its trees, event recorder and
//! `ZmqEventPublisher`, at page sizes 1, 16 and 64, LoRA and cache salts,
//! the dynamo hash format, HiCache tiers, eviction, a restart and
//! attention-DP ranks), published by stand-in pods with SGLang's empty
//! topic and dialed as `--zmq-connect ...,pod=NAME,model=MODEL`. Every
//! probe's `matched_tokens` per pod must be what SGLang's `match_prefix`
//! answered.

use std::collections::{BTreeMap, HashSet};

use base64::Engine;
use bytes::Bytes;
use serde_json::Value;

use crate::common::vllm_pod::{Batch, PodOptions, VllmPod};
use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;

fn read(name: &str) -> String {
    std::fs::read_to_string(fixtures_dir().join("sglang-events").join(name)).unwrap()
}

/// A stream's recorded answers (`<stream>.expected.json`).
fn expected(stream: &str) -> Value {
    serde_json::from_str(&read(&format!("{stream}.expected.json"))).unwrap()
}

/// A stream's batches by pod key (`pod-0`, or `pod-0/dp1` for a rank),
/// each as its publisher sent it: `(topic, seq, payload)`.
fn batches(stream: &str) -> BTreeMap<String, Vec<Batch>> {
    let mut out: BTreeMap<String, Vec<Batch>> = BTreeMap::new();
    for line in read(&format!("{stream}.frames.jsonl")).lines() {
        let f: Value = serde_json::from_str(line).unwrap();
        let key = match f["dp_rank"].as_u64() {
            Some(rank) => format!("{}/dp{rank}", f["pod"].as_str().unwrap()),
            None => f["pod"].as_str().unwrap().to_owned(),
        };
        let payload = base64::engine::general_purpose::STANDARD
            .decode(f["payload_b64"].as_str().unwrap())
            .unwrap();
        out.entry(key).or_default().push((
            Bytes::from(f["topic"].as_str().unwrap().to_owned()),
            f["seq"].as_u64().unwrap(),
            Bytes::from(payload),
        ));
    }
    out
}

/// A recorded pod key as the service names that cache domain.
fn domain(key: &str) -> String {
    named_domain("", key)
}

/// `domain`, the pod named `<prefix><pod>`.
fn named_domain(prefix: &str, key: &str) -> String {
    match key.split_once("/dp") {
        Some((pod, rank)) => {
            indexer::pod_id(&format!("{prefix}{pod}"), Some(rank.parse().unwrap()))
        }
        None => format!("{prefix}{key}"),
    }
}

/// The pod name a key's dial target gives (`pod=`).
fn pod_name(key: &str) -> &str {
    key.split_once("/dp").map_or(key, |(pod, _)| pod)
}

/// See `indexer/tests/fixture_streams/sglang.rs`: SGLang's events name a
/// bare extra key nowhere.
fn bare_extra_key(probe: &Value) -> bool {
    let id = probe["id"].as_str().unwrap();
    !probe["extra_key"].is_null() || id.split(':').nth(3).is_some_and(|e| e != "-")
}

/// Every probe scored over gRPC against SGLang's answers; the misses.
async fn misses(service: &Service, expected: &Value) -> (Vec<String>, usize) {
    named_misses(service, expected, "").await
}

/// `misses`, the pods named `<prefix><pod>`.
async fn named_misses(service: &Service, expected: &Value, prefix: &str) -> (Vec<String>, usize) {
    misses_as(service, expected, |key| Some(named_domain(prefix, key))).await
}

/// `misses`, each recorded pod key scored under the name `name` gives it
/// (`None`: not compared).
async fn misses_as(
    service: &Service,
    expected: &Value,
    name: impl Fn(&str) -> Option<String>,
) -> (Vec<String>, usize) {
    let model = expected["meta"]["model"].as_str().unwrap();
    let page = expected["meta"]["page_size"].as_u64().unwrap() as u32;
    let mut client = service.client().await;
    let (mut wrong, mut compared) = (Vec::new(), 0);
    for probe in expected["probes"].as_array().unwrap() {
        if bare_extra_key(probe) {
            continue;
        }
        let ids = probe["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let resp = client
            .score(pb::ScoreRequest {
                model: model.into(),
                input: Some(pb::score_request::Input::TokenIds(pb::TokenIds { ids })),
                lora_name: probe["lora_name"].as_str().unwrap_or_default().into(),
                cache_salt: probe["cache_salt"].as_str().unwrap_or_default().into(),
                ..Default::default()
            })
            .await
            .expect("Score")
            .into_inner();
        for (key, device) in probe["expected_cached_tokens"].as_object().unwrap() {
            let Some(name) = name(key) else {
                continue;
            };
            compared += 1;
            let device = device.as_u64().unwrap() as u32;
            let host = probe["expected_host_cached_tokens"][key]
                .as_u64()
                .unwrap_or(0) as u32;
            let Some(p) = resp.pods.iter().find(|p| p.pod == name) else {
                if device + host > 0 {
                    wrong.push(format!("{}: {key} not scored", probe["id"]));
                }
                continue;
            };
            assert_eq!((p.engine.as_str(), p.block_size), ("sglang", page), "{p:?}");
            // Leading tokens on any tier; of them, the device's (SGLang's
            // host tier holds what follows its device prefix).
            if (p.matched_tokens, p.gpu_blocks * page) != (device + host, device) {
                wrong.push(format!(
                    "{}: {key} {} tokens ({} on GPU), SGLang {device} + {host} on host",
                    probe["id"],
                    p.matched_tokens,
                    p.gpu_blocks * page
                ));
            }
        }
    }
    (wrong, compared)
}

/// Every compared answer SGLang's (`misses`), and enough of them.
fn assert_exact(what: &str, (wrong, compared): (Vec<String>, usize)) {
    assert!(compared >= 40, "{what}: {compared} answers");
    assert!(
        wrong.is_empty(),
        "{what}: {} of {compared} differ:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

/// Stand-in pods for `stream`'s pod keys holding the first `upto(n)` of
/// their `n` batches in their replay buffers, and the dial targets naming
/// them.
fn pods(
    model: &str,
    frames: &BTreeMap<String, Vec<Batch>>,
    upto: impl Fn(usize) -> usize,
) -> (Vec<(String, VllmPod)>, Vec<String>) {
    named_pods("", model, frames, upto)
}

/// `pods`, named `<prefix><pod>`.
fn named_pods(
    prefix: &str,
    model: &str,
    frames: &BTreeMap<String, Vec<Batch>>,
    upto: impl Fn(usize) -> usize,
) -> (Vec<(String, VllmPod)>, Vec<String>) {
    let mut pods = Vec::new();
    let mut targets = Vec::new();
    for (key, batches) in frames {
        let pod = VllmPod::with_batches(batches.clone(), PodOptions::default());
        pod.publish(0, upto(pod.batches()), &HashSet::new());
        let name = pod_name(key);
        targets.push(format!("{},pod={prefix}{name},model={model}", pod.target));
        pods.push((key.clone(), pod));
    }
    (pods, targets)
}

/// Each domain's last seq once `upto(n)` of its `n` batches are applied.
fn seqs_upto(
    frames: &BTreeMap<String, Vec<Batch>>,
    upto: impl Fn(usize) -> usize,
) -> BTreeMap<String, Option<u64>> {
    frames
        .iter()
        .map(|(key, b)| (domain(key), upto(b.len()).checked_sub(1).map(|i| b[i].1)))
        .collect()
}

/// Pods publish the first half of their streams into their buffers; the
/// service dials them and catches up from the buffers. Then the rest
/// arrives live, every third batch lost on the way (only buffered: the
/// gap is repaired from the pod's buffer). Every probe is then answered
/// as SGLang's tree answers it.
async fn check(stream: &str) {
    check_with_topic(stream, None).await;
}

/// `check`, the pods publishing on `topic` instead of the recorded one.
async fn check_with_topic(stream: &str, topic: Option<&str>) {
    check_with(stream, topic, &[]).await;
}

/// `check_with_topic`, the service started with `args`.
async fn check_with(stream: &str, topic: Option<&str>, args: &[&str]) {
    let expected = expected(stream);
    let model = expected["meta"]["model"].as_str().unwrap();
    let mut frames = batches(stream);
    if let Some(topic) = topic {
        for b in frames.values_mut().flatten() {
            b.0 = Bytes::from(topic.to_owned());
        }
    }
    let half = |n: usize| n / 2;
    let (pods, targets) = pods(model, &frames, half);
    let service = Service::start_dialing(&targets, args).await;
    service
        .wait_until("every pod caught up from its buffer", async || {
            service.last_seqs(model).await == seqs_upto(&frames, half)
        })
        .await;
    for (_, pod) in &pods {
        let n = pod.batches();
        let lost: HashSet<u64> = pod.frames()[half(n)..n - 1]
            .iter()
            .step_by(3)
            .map(|b| b.1)
            .collect();
        pod.publish(half(n), n, &lost);
    }
    let all = seqs_upto(&frames, |n| n);
    service
        .wait_until("the rest applied live", async || {
            // Again until it is there: a PUB drops what it sends before
            // the subscription reached it; a duplicate is skipped.
            for (_, pod) in &pods {
                pod.resend(pod.batches() - 1);
            }
            service.last_seqs(model).await == all
        })
        .await;
    for p in service.list_pods(model).await {
        assert_eq!(p.engine, "sglang", "{p:?}");
        assert!(!p.incomplete && p.malformed_events == 0, "{p:?}");
        assert_eq!(p.engine_hash_mismatches, 0, "{p:?}");
    }
    assert_exact(stream, misses(&service, &expected).await);
    drop(pods);
}

#[tokio::test]
async fn page_sizes_1_16_and_64() {
    for stream in ["sglang-page1", "sglang-page16", "sglang-page64"] {
        check(stream).await;
    }
}

/// A pod given a topic of its own (`--kv-events-config`'s `topic`) is
/// still the one its target names: live batches and the batches its
/// buffer repairs gaps with alike.
#[tokio::test]
async fn a_named_pod_publishing_a_topic_of_its_own() {
    check_with_topic("sglang-page16", Some("sglang-kv")).await;
}

#[tokio::test]
async fn radix_cache_and_eviction_heavy_runs() {
    for stream in [
        "sglang-radixcache-page16",
        "sglang-evict-page1",
        "sglang-evict-page16",
    ] {
        check(stream).await;
    }
}

#[tokio::test]
async fn lora_cache_salts_and_the_dynamo_format() {
    for stream in ["sglang-lora-salt", "sglang-dynamo"] {
        check(stream).await;
    }
}

/// Engine key mode with SGLang's own hashes (`--engine-hash-algo sglang`,
/// `sglang_dynamo`; adapters' ids from `--lora-path`): a prompt's keys are
/// the hashes SGLang's events name, salts and adapters included.
#[tokio::test]
async fn engine_keys_are_sglangs_own_hashes() {
    for (stream, algo) in [
        ("sglang-page16", "sglang"),
        ("sglang-page1", "sglang"),
        ("sglang-lora-salt", "sglang"),
        ("sglang-dynamo", "sglang_dynamo"),
    ] {
        let paths = "sql-lora=/loras/sql-lora,chat-lora=/loras/chat-lora";
        let args = [
            "--key-mode",
            "engine",
            "--engine-hash-algo",
            algo,
            "--lora-path",
            paths,
        ];
        check_with(stream, None, &args).await;
    }
}

/// EAGLE speculative decoding: a pod's pages are bigrams of the prompt,
/// published as pairs; a `Score` of the prompt's ids keys its bigrams for
/// it.
#[tokio::test]
async fn eagle_bigram_pages() {
    check("sglang-eagle").await;
}

/// A routing to an EAGLE pod records the prompt's bigram pages, from a
/// `Score`'s prompt handle and from token ids alike: the next `Score`
/// counts them speculative for that pod.
#[tokio::test]
async fn routings_to_eagle_pods_record_bigram_pages() {
    let stream = "sglang-eagle";
    let expected = expected(stream);
    let model = expected["meta"]["model"].as_str().unwrap();
    let page = expected["meta"]["page_size"].as_u64().unwrap() as u32;
    let frames = batches(stream);
    let (pods, targets) = pods(model, &frames, |n| n);
    let service = Service::start_dialing(&targets, &["--speculative-ttl", "30s"]).await;
    service
        .wait_until("every pod caught up from its buffer", async || {
            service.last_seqs(model).await == seqs_upto(&frames, |n| n)
        })
        .await;
    let mut client = service.client().await;
    // Prompts no pod holds, of 12 pages of tokens: 11 pages of bigrams
    // (n tokens make n - 1), against 12 plain pages.
    let prompt = |seed: u32| -> Vec<u32> { (0..12 * page).map(|i| seed + i).collect() };
    let score = async |client: &mut pb::kv_indexer_client::KvIndexerClient<_>, ids: &[u32]| {
        client
            .score(pb::ScoreRequest {
                model: model.into(),
                input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                    ids: ids.to_vec(),
                })),
                ..Default::default()
            })
            .await
            .expect("Score")
            .into_inner()
    };
    let speculative = |resp: &pb::ScoreResponse, pod: &str| {
        let p = resp.pods.iter().find(|p| p.pod == pod).expect("scored");
        (p.matched_blocks, p.speculative_blocks)
    };
    for (pod, by_handle) in [("pod-0", true), ("pod-1", false)] {
        let tokens = prompt(if by_handle { 700_000 } else { 800_000 });
        let first = score(&mut client, &tokens).await;
        assert_eq!(speculative(&first, pod), (0, 0), "{first:?}");
        let input = if by_handle {
            pb::record_routing_request::Input::PromptHandle(first.prompt_handle)
        } else {
            pb::record_routing_request::Input::TokenIds(pb::TokenIds {
                ids: tokens.clone(),
            })
        };
        let rec = client
            .record_routing(pb::RecordRoutingRequest {
                model: model.into(),
                pod: pod.into(),
                input: Some(input),
                ..Default::default()
            })
            .await
            .expect("RecordRouting")
            .into_inner();
        assert_eq!(
            (rec.total_blocks, rec.speculative_blocks),
            (11, 11),
            "{rec:?}"
        );
        let next = score(&mut client, &tokens).await;
        assert_eq!(speculative(&next, pod), (0, 11), "{pod}: {next:?}");
    }
    // A handle from a Score that had no EAGLE pod among its candidates has
    // no bigram pages: routing it to one is refused, not recorded wrong.
    let elsewhere = client
        .score(pb::ScoreRequest {
            model: model.into(),
            input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                ids: prompt(900_000),
            })),
            pods: vec!["not-an-eagle-pod".into()],
            ..Default::default()
        })
        .await
        .expect("Score")
        .into_inner();
    let refused = client
        .record_routing(pb::RecordRoutingRequest {
            model: model.into(),
            pod: "pod-0".into(),
            input: Some(pb::record_routing_request::Input::PromptHandle(
                elsewhere.prompt_handle,
            )),
            ..Default::default()
        })
        .await
        .expect_err("no bigram pages in the handle");
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    drop(pods);
}

#[tokio::test]
async fn hicache_tiers() {
    check("sglang-hicache").await;
}

/// Attention-DP ranks publish on the base port plus the rank, each its
/// own cache: two targets naming one pod, told apart by the batch's rank.
#[tokio::test]
async fn attention_dp_ranks_are_caches_of_one_pod() {
    check("sglang-dp-attention").await;
}

/// pod-0's engine restarts mid-run (a new publisher on the same port, seq
/// from 0, an `AllBlocksCleared` first); pod-1's cache is flushed (seq
/// goes on). The service follows pod-0's old run, reconnects to the new
/// one and ends with only its blocks.
#[tokio::test]
async fn a_pod_restart_and_a_flush() {
    let stream = "sglang-restart";
    let expected = expected(stream);
    let model = expected["meta"]["model"].as_str().unwrap();
    let mut frames = batches(stream);
    // pod-0's runs: up to the seq going back to 0, and after.
    let all = frames.remove("pod-0").unwrap();
    let cut = (1..all.len())
        .find(|&i| all[i].1 < all[i - 1].1)
        .expect("a restart");
    let (old, new) = (all[..cut].to_vec(), all[cut..].to_vec());
    frames.insert("pod-0".into(), old);
    let (mut pods, targets) = pods(model, &frames, |n| n);
    let service = Service::start_dialing(&targets, &[]).await;
    let pod1_last = frames["pod-1"].last().unwrap().1;
    let before = BTreeMap::from([
        ("pod-0".to_string(), Some(cut as u64 - 1)),
        ("pod-1".to_string(), Some(pod1_last)),
    ]);
    service
        .wait_until("the old run applied", async || {
            service.last_seqs(model).await == before
        })
        .await;
    let i = pods.iter().position(|(k, _)| k == "pod-0").unwrap();
    let (key, old_pod) = pods.remove(i);
    let restarted = old_pod.restart(new.clone(), PodOptions::default());
    // Into its new buffer and out on its PUB, again until the service has
    // it (a PUB drops what it sends before the reconnect subscribed; the
    // buffer repairs any gap the next send shows).
    restarted.publish(0, new.len(), &HashSet::new());
    let after = BTreeMap::from([
        ("pod-0".to_string(), Some(new.last().unwrap().1)),
        ("pod-1".to_string(), Some(pod1_last)),
    ]);
    let last = new.len() - 1;
    service
        .wait_until("the new run applied", async || {
            restarted.resend(last);
            service.last_seqs(model).await == after
        })
        .await;
    pods.push((key, restarted));
    let p0 = service
        .list_pods(model)
        .await
        .into_iter()
        .find(|p| p.pod == "pod-0")
        .unwrap();
    assert_eq!(p0.publisher_restarts, 1, "{p0:?}");
    assert_exact("answers", misses(&service, &expected).await);
}

/// One model served by vLLM pods (16-token blocks, topics of their own)
/// and SGLang pods (page size 1, named by their targets), dialed by one
/// service: one `Score` answers both kinds, each pod as its own engine
/// holds the prompt, and `matched_tokens` compares them.
#[tokio::test]
async fn a_fleet_of_vllm_and_sglang_pods_is_scored_in_one_answer() {
    use crate::common::vllm_pod::Fleet;

    let stream = "sglang-page1";
    let expected = expected(stream);
    let model = expected["meta"]["model"].as_str().unwrap();
    let vllm = Fleet::start("qwen3-sha256-int", |_| PodOptions::default());
    assert_eq!(vllm.expected.model, model, "one model");
    let frames = batches(stream);
    let (sglang, mut targets) = named_pods("sg-", model, &frames, |n| n);
    targets.extend(vllm.targets());
    let service = Service::start_dialing(&targets, &[]).await;
    vllm.wait_subscribed(&service, "vllm").await;
    vllm.publish(|n| (0, n));
    let mut want: BTreeMap<String, Option<u64>> = vllm
        .per_pod
        .iter()
        .map(|(pod, n)| (pod.clone(), Some(n - 1)))
        .collect();
    for (key, b) in &frames {
        want.insert(named_domain("sg-", key), b.last().map(|b| b.1));
    }
    service
        .wait_until("every pod of both engines applied", async || {
            service.last_seqs(model).await == want
        })
        .await;
    let engines: BTreeMap<String, (String, u32)> = service
        .list_pods(model)
        .await
        .into_iter()
        .map(|p| (p.pod, (p.engine, p.block_size)))
        .collect();
    for (pod, (engine, block_size)) in &engines {
        let want = match pod.starts_with("sg-") {
            true => ("sglang", 1),
            false => ("vllm", 16),
        };
        assert_eq!((engine.as_str(), *block_size), want, "{pod}");
    }
    // vLLM's probes on its pods, SGLang's on its own, every answer one
    // response naming both engines' pods.
    for (probe, resp) in probe_answers(&service, &vllm.expected).await {
        assert_matches(&resp, probe);
        assert_eq!(resp.pods.len(), engines.len(), "{resp:?}");
        for p in &resp.pods {
            assert_eq!(p.matched_tokens, p.matched_blocks * p.block_size, "{p:?}");
        }
    }
    assert_exact("answers", named_misses(&service, &expected, "sg-").await);
    drop(sglang);
}

/// SGLang's default is to publish with no topic; pointed at the bound
/// socket (`"endpoint": "tcp://kv-indexer:5557"`, which it connects to),
/// its pods cannot be told apart by their messages. With
/// `--topicless-model`, each is the pod its connection's address names
/// (`127.0.0.1` here), serving that model; it is then scored exactly.
#[tokio::test]
async fn bound_pods_without_a_topic_are_named_by_their_address() {
    let stream = "sglang-page16";
    let expected = expected(stream);
    let model = expected["meta"]["model"].as_str().unwrap();
    let service = Service::start(&["--topicless-model", model]).await;
    let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&service, "marker").await;
    let pod0 = &batches(stream)["pod-0"];
    for (topic, seq, payload) in pod0 {
        assert!(topic.is_empty());
        publisher
            .send(zmq_message(vec![
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ]))
            .await;
    }
    let want = BTreeMap::from([("127.0.0.1".to_string(), pod0.last().map(|b| b.1))]);
    service
        .wait_until("the pod named by its address", async || {
            service.last_seqs(model).await == want
        })
        .await;
    assert_exact(
        "answers",
        misses_as(&service, &expected, |key| {
            (key == "pod-0").then(|| "127.0.0.1".to_string())
        })
        .await,
    );
    assert_eq!(
        service.metric(r#"kv_indexer_messages_skipped_total{reason="no_topic"}"#),
        0.0
    );
}

//! The service end to end: recorded vLLM streams published over real ZeroMQ,
//! answers checked over real gRPC against what vLLM itself computed.

use std::collections::BTreeMap;

use crate::common::*;
use bytes::Bytes;
use kv_indexer::proto::kvindexer::v1 as pb;
use tonic::Code;

/// Pods connect to the indexer's bound SUB socket (vLLM's default setup).
async fn replay_in_bind_mode(stream: &str) {
    let (service, expected, _publisher) = serve_recorded(stream, &[]).await;
    check_probes(&service, &expected).await;

    let pods = service.list_pods(&expected.model).await;
    assert_eq!(
        pods.iter().map(|p| p.pod.clone()).collect::<Vec<_>>(),
        expected.pods
    );
    for pod in &pods {
        assert_eq!(pod.seq_gaps, 0, "{pod:?}");
        assert_eq!(pod.parent_unknown_blocks, 0, "{pod:?}");
        assert_eq!(pod.malformed_events + pod.unknown_event_types, 0, "{pod:?}");
        assert_eq!(pod.block_size, expected.block_size);
        assert_eq!(pod.dp_rank, Some(0));
    }
}

#[tokio::test]
async fn bind_mode_sha256_int_stream_matches_vllm() {
    replay_in_bind_mode("qwen3-sha256-int").await;
}

#[tokio::test]
async fn bind_mode_sha256_int_stream_array_v0_23_matches_vllm() {
    replay_in_bind_mode("qwen3-sha256-int.array-v0.23").await;
}

#[tokio::test]
async fn bind_mode_sha256_int_stream_array_v0_11_matches_vllm() {
    replay_in_bind_mode("qwen3-sha256-int.array-v0.11").await;
}

#[tokio::test]
async fn bind_mode_sha256cbor_bytes_stream_matches_vllm() {
    replay_in_bind_mode("qwen3-sha256cbor-bytes").await;
}

#[tokio::test]
async fn bind_mode_sha256cbor_bytes_stream_array_v0_23_matches_vllm() {
    replay_in_bind_mode("qwen3-sha256cbor-bytes.array-v0.23").await;
}

#[tokio::test]
async fn bind_mode_sha256cbor_bytes_stream_array_v0_11_matches_vllm() {
    replay_in_bind_mode("qwen3-sha256cbor-bytes.array-v0.11").await;
}

#[tokio::test]
async fn lora_and_cache_salt_blocks_only_match_their_own_adapter_and_salt() {
    replay_in_bind_mode("qwen3-lora-salt").await;
}

/// The indexer dials pods that bind their PUB socket, one socket per pod.
#[tokio::test]
async fn dial_mode_connects_to_each_pod_and_matches_vllm() {
    let stream = "qwen3-sha256-int";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let mut publishers = BTreeMap::new();
    let mut endpoints = Vec::new();
    for pod in &expected.pods {
        let (publisher, endpoint) = Publisher::bind().await;
        publishers.insert(pod.clone(), publisher);
        endpoints.push(endpoint);
    }
    let service = Service::start_dialing(&endpoints, &[]).await;
    for (pod, publisher) in publishers.iter_mut() {
        publisher
            .wait_subscribed(&service, &format!("marker-{pod}"))
            .await;
    }
    // Each pod publishes its own batches, in the recorded order.
    for f in &frames {
        publishers
            .get_mut(f.pod())
            .expect("known pod")
            .send(f.message())
            .await;
    }
    service
        .wait_applied(&expected.model, &batches_per_pod(&frames))
        .await;
    check_probes(&service, &expected).await;
}

/// `--ingest-priority idle`: every thread that receives or applies events,
/// ours and libzmq's (of the bound socket's context and of a dialing one),
/// runs under `SCHED_IDLE`; the main thread and the runtime's workers (gRPC)
/// keep the normal policy; and the events are applied as ever.
#[tokio::test]
async fn idle_ingest_priority_lowers_exactly_the_ingest_threads() {
    const OTHER: u32 = 0;
    const IDLE: u32 = 5;
    let (dialed, endpoint) = Publisher::bind().await;
    let args = [
        "--ingest-priority",
        "idle",
        "--ingest-workers",
        "2",
        "--zmq-connect",
        &endpoint,
    ];
    let (service, expected, _publisher) = serve_recorded("qwen3-sha256-int", &args).await;
    check_probes(&service, &expected).await;
    let mut dialed = dialed;
    dialed.wait_subscribed(&service, "marker-dialed").await;

    // libzmq's threads (an I/O thread and a reaper per context) inherit
    // the name and the policy of the thread that started them: the bound
    // socket's keep the process's name, the dialing context's are named
    // `zmq-dial`. The main thread is the one whose id is the process's.
    let pid = service.pid();
    let threads = service.threads();
    let count = |name: &str| threads.iter().filter(|t| t.1 == name).count();
    assert_eq!(count("ingest-0") + count("ingest-1"), 2, "{threads:?}");
    assert_eq!(count("zmq-bind"), 1, "{threads:?}");
    assert!(
        count("zmq-dial") >= 3,
        "the dialer and its context's: {threads:?}"
    );
    assert!(
        count("kv-indexer") >= 3,
        "main and the bound context's: {threads:?}"
    );
    assert!(count("tokio-rt-worker") >= 1, "{threads:?}");
    for (tid, name, policy) in &threads {
        let want = if *tid == pid || name.starts_with("tokio-") {
            OTHER
        } else {
            IDLE
        };
        assert_eq!(*policy, want, "{name} ({tid}): {threads:?}");
    }

    // The default leaves every thread alone.
    let normal = Service::start(&[]).await;
    assert!(
        normal.threads().iter().all(|(_, _, p)| *p == OTHER),
        "{:?}",
        normal.threads()
    );
}

/// Bind and dial at once: one pod connects to us, the other we dial.
#[tokio::test]
async fn bind_and_dial_modes_run_together() {
    let stream = "qwen3-lora-salt";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let (mut dialed, endpoint) = Publisher::bind().await;
    let service = Service::start(&["--zmq-connect", &endpoint]).await;
    let mut connecting = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
    dialed.wait_subscribed(&service, "marker-dialed").await;
    connecting
        .wait_subscribed(&service, "marker-connecting")
        .await;
    for f in &frames {
        let publisher = if f.pod() == "pod-0" {
            &mut dialed
        } else {
            &mut connecting
        };
        publisher.send(f.message()).await;
    }
    service
        .wait_applied(&expected.model, &batches_per_pod(&frames))
        .await;
    check_probes(&service, &expected).await;
}

/// Garbage between valid batches is counted and skipped; nothing valid is lost.
#[tokio::test]
async fn malformed_messages_are_skipped_and_valid_ones_all_land() {
    let stream = "qwen3-sha256cbor-bytes";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let service = Service::start(&[]).await;
    let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&service, "marker").await;
    let topic = frames[0].topic.clone();
    let seq = Bytes::copy_from_slice(&1u64.to_be_bytes());
    let garbage: Vec<Vec<Bytes>> = vec![
        // two frames
        vec![Bytes::from(topic.clone()), Bytes::from_static(b"x")],
        // four frames
        vec![
            Bytes::from(topic.clone()),
            seq.clone(),
            Bytes::new(),
            Bytes::new(),
        ],
        // short seq
        vec![
            Bytes::from(topic.clone()),
            Bytes::from_static(b"123"),
            Bytes::new(),
        ],
        // bad topic (matches the subscription prefix, but no pod/model)
        vec![
            Bytes::from_static(b"kv@only-pod"),
            seq.clone(),
            Bytes::new(),
        ],
        // undecodable payloads
        vec![
            Bytes::from(topic.clone()),
            seq.clone(),
            Bytes::from_static(b"\xc1\xc1"),
        ],
        vec![
            Bytes::from(topic.clone()),
            seq.clone(),
            Bytes::from_static(&[0xdd, 0xff, 0xff, 0xff, 0xff]),
        ],
    ];
    for (i, f) in frames.iter().enumerate() {
        publisher.send(f.message()).await;
        if i % 10 == 0 {
            for g in &garbage {
                publisher.send(zmq_message(g.clone())).await;
            }
        }
    }
    service
        .wait_applied(&expected.model, &batches_per_pod(&frames))
        .await;
    check_probes(&service, &expected).await;
    // The service is still answering and healthy.
    let pods = service.list_pods("").await;
    assert!(pods.iter().all(|p| p.pod != "only-pod"));
}

/// A `Score` that asks (`kv-indexer-timing`) gets its handler's time back
/// in microseconds, no more than the call took; one that does not gets
/// nothing extra.
#[tokio::test]
async fn score_tells_its_handlers_time_when_asked() {
    let service = Service::start(&[]).await;
    let mut client = service.client().await;
    let score = || pb::ScoreRequest {
        model: "m".into(),
        input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
            ids: (0..4096).collect(),
        })),
        ..Default::default()
    };
    let mut asked = tonic::Request::new(score());
    asked
        .metadata_mut()
        .insert(kv_indexer::grpc::TIMING_REQUEST, "1".parse().unwrap());
    let started = std::time::Instant::now();
    let answer = client.score(asked).await.expect("Score");
    let took = started.elapsed();
    let handler: u128 = answer
        .metadata()
        .get(kv_indexer::grpc::TIMING_RESPONSE)
        .expect("the handler's time")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(handler <= took.as_micros(), "{handler} us of {took:?}");
    let plain = client.score(score()).await.expect("Score");
    assert!(plain
        .metadata()
        .get(kv_indexer::grpc::TIMING_RESPONSE)
        .is_none());
}

#[tokio::test]
async fn bad_requests_get_clear_status_codes() {
    let service = Service::start(&[]).await;
    let mut client = service.client().await;
    let tokens = Some(pb::score_request::Input::TokenIds(pb::TokenIds {
        ids: vec![1, 2, 3],
    }));
    let cases = [
        (
            pb::ScoreRequest {
                input: tokens.clone(),
                ..Default::default()
            },
            Code::InvalidArgument,
            "model",
        ),
        (
            pb::ScoreRequest {
                model: "m".into(),
                ..Default::default()
            },
            Code::InvalidArgument,
            "token_ids",
        ),
    ];
    assert_score_errors(&mut client, cases).await;
    // A text prompt for a model neither configured nor published: nothing
    // to tokenize it with and nothing cached, so Score answers 0 untokenized
    // and Tokenize (whose answer is the tokens) NOT_FOUND.
    let resp = client
        .score(pb::ScoreRequest {
            model: "m".into(),
            input: Some(pb::score_request::Input::Prompt("hello".into())),
            pods: vec!["a".into()],
            ..Default::default()
        })
        .await
        .expect("Score")
        .into_inner();
    assert_eq!((resp.prompt_tokens, resp.pods[0].matched_blocks), (0, 0));
    let status = client
        .tokenize(pb::TokenizeRequest {
            model: "m".into(),
            input: Some(pb::tokenize_request::Input::Prompt("hello".into())),
            ..Default::default()
        })
        .await
        .expect_err("no tokenizer");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(
        status.message().contains("neither configured"),
        "{status:?}"
    );
    // A model nobody published for is a valid question with an empty answer.
    let resp = client
        .score(pb::ScoreRequest {
            model: "unknown".into(),
            input: tokens,
            pods: vec!["a".into()],
            ..Default::default()
        })
        .await
        .expect("Score")
        .into_inner();
    assert_eq!(resp.pods.len(), 1);
    assert_eq!(
        (resp.pods[0].pod.as_str(), resp.pods[0].matched_blocks),
        ("a", 0)
    );

    let status = client
        .lookup_blocks(pb::LookupBlocksRequest::default())
        .await
        .expect_err("must fail");
    assert_eq!(status.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn lookup_blocks_shows_who_holds_a_prompts_blocks() {
    let (service, expected, _publisher) = serve_recorded("qwen3-lora-salt", &[]).await;
    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "plain:same")
        .expect("probe");
    let mut client = service.client().await;
    let resp = client
        .lookup_blocks(pb::LookupBlocksRequest {
            model: expected.model.clone(),
            input: Some(pb::lookup_blocks_request::Input::TokenIds(pb::TokenIds {
                ids: probe.token_ids.clone(),
            })),
            ..Default::default()
        })
        .await
        .expect("LookupBlocks")
        .into_inner();
    assert_eq!(resp.blocks.len(), probe.token_ids.len() / 16);
    let first = &resp.blocks[0];
    assert_eq!(first.holders.len(), 1);
    assert_eq!(first.holders[0].pod, "pod-1");
    assert_eq!(first.holders[0].tiers, vec![pb::Tier::Gpu as i32]);
    // Keys round-trip.
    let again = client
        .lookup_blocks(pb::LookupBlocksRequest {
            input: Some(pb::lookup_blocks_request::Input::BlockKeys(pb::BlockKeys {
                keys: vec![first.key, 12345],
            })),
            ..Default::default()
        })
        .await
        .expect("LookupBlocks")
        .into_inner();
    assert_eq!(again.blocks[0], *first);
    assert!(again.blocks[1].holders.is_empty());
}

#[tokio::test]
async fn sigterm_stops_the_service_cleanly() {
    let service = Service::start(&[]).await;
    // A client holding a connection open must not block shutdown.
    let _client = service.client().await;
    let status = service.terminate().await;
    assert!(status.success(), "{status:?}");
}

#[test]
fn bad_configuration_fails_fast_naming_the_setting() {
    for (flags, setting) in [
        (vec!["--block-size", "0"], "block_size"),
        (vec!["--zmq-connect", "tcp://nohost"], "zmq_connect"),
        (vec!["--tier-weight", "gpu=7"], "tier_weight"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
            .args(&flags)
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(2), "{flags:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(setting), "{flags:?}: {stderr}");
    }
    let dir = std::env::temp_dir().join(format!("kv-indexer-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("wrongkey.yaml");
    std::fs::write(&file, "grpc_adress: 1.2.3.4:5\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .arg("--config")
        .arg(&file)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("grpc_adress"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A port already taken stops the service at start with the flag to change.
#[test]
fn a_taken_port_fails_naming_its_flag() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let free = format!("127.0.0.1:{}", free_port());
    let zmq = format!("tcp://127.0.0.1:{port}");
    let addr = format!("127.0.0.1:{port}");
    let none = "none".to_owned();
    for (grpc, metrics, bind, flag) in [
        (&addr, &none, &none, "--grpc-addr"),
        (&free, &addr, &none, "--metrics-addr"),
        (&free, &none, &zmq, "--zmq-bind"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
            .args([
                "--grpc-addr",
                grpc,
                "--metrics-addr",
                metrics,
                "--zmq-bind",
                bind,
            ])
            .env("KV_INDEXER_LOG_LEVEL", "error")
            .output()
            .expect("run");
        assert!(!out.status.success(), "{flag}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{flag}: {stderr}");
    }
}

/// Two replicas dialing the same pods converge on their own to the same
/// state: every Score answer is identical.
#[tokio::test]
async fn two_replicas_on_the_same_stream_answer_identically() {
    let stream = "qwen3-sha256-int";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let (mut publisher, endpoint) = Publisher::bind().await;
    let one = Service::start_dialing(std::slice::from_ref(&endpoint), &[]).await;
    let two = Service::start_dialing(std::slice::from_ref(&endpoint), &[]).await;
    publisher.wait_subscribed(&one, "marker").await;
    publisher.wait_subscribed(&two, "marker").await;
    publisher.publish_all(&frames).await;
    let batches = batches_per_pod(&frames);
    one.wait_applied(&expected.model, &batches).await;
    two.wait_applied(&expected.model, &batches).await;
    let (mut c1, mut c2) = (one.client().await, two.client().await);
    for probe in &expected.probes {
        let mut a = c1
            .score(token_request(&expected.model, probe))
            .await
            .expect("Score")
            .into_inner();
        let mut b = c2
            .score(token_request(&expected.model, probe))
            .await
            .expect("Score")
            .into_inner();
        // Each replica numbers its own prompt handles.
        assert!(a.prompt_handle != 0 && b.prompt_handle != 0);
        (a.prompt_handle, b.prompt_handle) = (0, 0);
        assert_eq!(a, b, "probe {}", probe.id);
        assert_matches(&a, probe);
    }
}

/// `kv-indexer demo`: the real service plus a built-in publisher; prints the
/// grpcurl command and scores that grow as conversations continue.
#[test]
fn demo_runs_publishes_and_shows_scores_growing() {
    let (grpc, metrics, zmq) = (free_port(), free_port(), free_port());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .args(["--zmq-bind", &format!("tcp://127.0.0.1:{zmq}")])
        .args(["demo", "--turns", "14"])
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("grpcurl -plaintext"), "{stdout}");
    assert_eq!(stdout.matches("routed to").count(), 14, "{stdout}");
    // Continuing conversations find more than the shared 4-block system
    // prompt cached on the pod that served them.
    let best = stdout
        .lines()
        .filter_map(|l| l.split("cached blocks: pod-").nth(1))
        .filter_map(|rest| {
            rest.split_once('=')?
                .1
                .split('/')
                .next()?
                .parse::<u32>()
                .ok()
        })
        .max()
        .unwrap_or(0);
    assert!(best > 4, "{stdout}");
}

#[tokio::test]
async fn an_admin_can_remove_a_pod_and_it_returns_fresh_if_it_publishes_again() {
    let stream = "qwen3-lora-salt";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let service = Service::start(&["--admin"]).await;
    let mut publisher = service.publish_recorded(&expected.model, &frames).await;
    let mut client = service.client().await;
    let resp = client
        .remove_pod(pb::RemovePodRequest {
            model: expected.model.clone(),
            pod: "pod-1".into(),
        })
        .await
        .expect("RemovePod")
        .into_inner();
    assert!(resp.removed);
    assert_eq!(resp.removed_blocks, 62);
    let pods = service.list_pods(&expected.model).await;
    assert_eq!(
        pods.iter().map(|p| p.pod.as_str()).collect::<Vec<_>>(),
        vec!["pod-0"]
    );
    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "plain:same")
        .unwrap();
    let scored = client
        .score(token_request(&expected.model, probe))
        .await
        .unwrap()
        .into_inner();
    assert!(scored.pods.iter().all(|p| p.pod != "pod-1"));
    // Unknown pods: removed = false.
    let none = client
        .remove_pod(pb::RemovePodRequest {
            model: expected.model.clone(),
            pod: "pod-9".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!none.removed);
    // pod-1 publishes again (its first batch): it is back, fresh.
    publisher
        .send(
            frames
                .iter()
                .find(|f| f.pod() == "pod-1")
                .unwrap()
                .message(),
        )
        .await;
    // Listed as soon as it is known; wait for its batch to be applied.
    let back = async || {
        let pods = service.list_pods(&expected.model).await;
        pods.into_iter()
            .find(|p| p.pod == "pod-1" && p.batches == 1)
    };
    service
        .wait_until("pod-1 back with its batch", async || back().await.is_some())
        .await;
    assert_eq!(back().await.map(|p| p.gpu_blocks), Some(30));
}

#[tokio::test]
async fn admin_rpcs_are_refused_without_admin() {
    let (service, expected, _publisher) = serve_recorded("qwen3-lora-salt", &[]).await;
    let status = service
        .client()
        .await
        .remove_pod(pb::RemovePodRequest {
            model: expected.model.clone(),
            pod: "pod-1".into(),
        })
        .await
        .expect_err("RemovePod without --admin");
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("--admin"), "{status:?}");
    assert_eq!(service.list_pods(&expected.model).await.len(), 2);
}

/// libzmq's reconnect, verified: a dialed pod's publisher dies
/// and comes back on the same endpoint; its batches arrive again.
#[tokio::test]
async fn a_dialed_publisher_that_restarts_is_reconnected() {
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let (mut first, _) = Publisher::bind_on(&endpoint).await;
    let service = Service::start_dialing(std::slice::from_ref(&endpoint), &[]).await;
    first.wait_subscribed(&service, "before-restart").await;
    service
        .wait_metric("kv_indexer_zmq_connections", |v| v == 1.0)
        .await;
    drop(first);
    service
        .wait_metric("kv_indexer_zmq_connections", |v| v == 0.0)
        .await;
    // The port comes free once libzmq's I/O thread closed the listener.
    let mut second = None;
    service
        .wait_until("the endpoint free again", async || {
            second = Publisher::try_bind_on(&endpoint);
            second.is_some()
        })
        .await;
    let (mut second, _) = second.expect("bound");
    second.wait_subscribed(&service, "after-restart").await;
}

/// Dial mode: a pod that is gone (connection down) and silent for
/// --pod-expiry is forgotten; a pod that is merely quiet is not.
#[tokio::test]
async fn dialed_pods_expire_only_when_disconnected_and_silent() {
    let stream = "qwen3-lora-salt";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let (mut quiet, quiet_ep) = Publisher::bind().await;
    let (mut gone, gone_ep) = Publisher::bind().await;
    let service = Service::start_dialing(&[quiet_ep, gone_ep], &["--pod-expiry", "500ms"]).await;
    quiet.wait_subscribed(&service, "quiet-marker").await;
    gone.wait_subscribed(&service, "gone-marker").await;
    for f in &frames {
        let publisher = if f.pod() == "pod-0" {
            &mut quiet
        } else {
            &mut gone
        };
        publisher.send(f.message()).await;
    }
    service
        .wait_applied(&expected.model, &batches_per_pod(&frames))
        .await;
    drop(gone); // pod-1's publisher dies
    service
        .wait_until("only pod-0 left", async || {
            let pods = service.list_pods(&expected.model).await;
            pods.len() == 1 && pods[0].pod == "pod-0"
        })
        .await;
    // pod-0 stays quiet but connected, well past the expiry. A sleep on
    // purpose: what is checked is that nothing happens meanwhile.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let pods = service.list_pods(&expected.model).await;
    assert_eq!(pods.len(), 1);
    assert!(service.logs().contains("pod expired"));
    drop(quiet);
}

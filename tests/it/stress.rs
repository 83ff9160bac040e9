//! A fleet's first minute: new pods appear by the thousand while the router
//! already asks about named pods. Nothing may freeze: every call answers
//! within a few seconds for the whole run. And churn while the router
//! scores: every answer about the pods the churn leaves alone stays exact.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use bytes::Bytes;
use kv_indexer::proto::kvindexer::v1 as pb;
use kv_indexer::proto::llmd::v1 as llmd;

const MODEL: &str = "Qwen/Qwen3-8B";
/// How long the storm lasts.
const STORM: Duration = Duration::from_secs(6);
/// The longest any one call may take (5 s on a quiet machine).
fn call_limit() -> Duration {
    crate::common::budget(5)
}

/// Fails the test if `call` takes longer than [`call_limit`].
async fn bounded<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    let limit = call_limit();
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or_else(|_| panic!("{what} took longer than {limit:?}: frozen"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_pods_by_the_thousand_while_named_pods_are_scored_never_freeze() {
    let tok = qwen3_tokenizer_arg();
    // Env, not flags: the same test runs against builds that predate them.
    let zmq = format!("tcp://127.0.0.1:{}", free_port());
    let service = Arc::new(
        Service::start_with_env(
            &["--zmq-bind", &zmq, "--tokenizer", &tok],
            Some(zmq.clone()),
            &[
                ("KV_INDEXER_ADMIN", "true".into()),
                ("KV_INDEXER_MAX_PODS", "1000000".into()),
            ],
        )
        .await,
    );
    let mut publisher = Publisher::connect(&zmq).await;
    publisher.wait_subscribed(&service, "marker").await;
    // Pods the router will name, present from the start.
    let named: Vec<String> = (0..32).map(|i| format!("named-{i}")).collect();
    for (i, pod) in named.iter().enumerate() {
        publisher
            .send(zmq_message(vec![
                Bytes::from(format!("kv@{pod}@{MODEL}")),
                Bytes::copy_from_slice(&0u64.to_be_bytes()),
                Bytes::from(one_block_store(i as u64 + 1)),
            ]))
            .await;
    }

    // The tokenizer loads on first use (seconds in a debug build on a busy
    // 2-core machine): loaded before the storm, which is about freezes, not
    // about a cold start.
    {
        let grpc = format!("http://{}", service.grpc_addr());
        let mut llmd_client = llmd::indexer_service_client::IndexerServiceClient::connect(grpc)
            .await
            .expect("connect llm-d API");
        tokio::time::timeout(
            crate::common::budget(60),
            llmd_client.get_pod_scores(llmd::GetPodScoresRequest {
                prompt: "warm up".into(),
                model_name: MODEL.into(),
                pod_identifiers: named.clone(),
            }),
        )
        .await
        .expect("the tokenizer loads")
        .expect("GetPodScores");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicU64::new(0));
    let storm = {
        let (stop, published) = (stop.clone(), published.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..200 {
                    publisher
                        .send(zmq_message(vec![
                            Bytes::from(format!("kv@new-{i}@{MODEL}")),
                            Bytes::copy_from_slice(&0u64.to_be_bytes()),
                            Bytes::from(one_block_store(i + 1)),
                        ]))
                        .await;
                    i += 1;
                }
                published.store(i, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    let mut callers = Vec::new();
    for kind in 0..4 {
        let (service, stop, named) = (service.clone(), stop.clone(), named.clone());
        callers.push(tokio::spawn(async move {
            let grpc = format!("http://{}", service.grpc_addr());
            let mut client = bounded("connect", service.client()).await;
            let mut llmd_client = bounded(
                "connect",
                llmd::indexer_service_client::IndexerServiceClient::connect(grpc),
            )
            .await
            .expect("connect llm-d API");
            let mut calls = 0u64;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                match kind {
                    0 => {
                        let mut pods = named.clone();
                        pods.push(format!("new-{}", n * 7));
                        bounded(
                            "Score with named pods",
                            client.score(pb::ScoreRequest {
                                model: MODEL.into(),
                                input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                                    ids: (0..64).collect(),
                                })),
                                pods,
                                ..Default::default()
                            }),
                        )
                        .await
                        .expect("Score");
                    }
                    1 => {
                        bounded(
                            "GetPodScores with pod identifiers",
                            llmd_client.get_pod_scores(llmd::GetPodScoresRequest {
                                prompt: "hello world, and then some".into(),
                                model_name: MODEL.into(),
                                pod_identifiers: named.clone(),
                            }),
                        )
                        .await
                        .expect("GetPodScores");
                    }
                    2 => {
                        bounded(
                            "ListPods",
                            client.list_pods(pb::ListPodsRequest {
                                model: MODEL.into(),
                            }),
                        )
                        .await
                        .expect("ListPods");
                    }
                    _ => {
                        bounded(
                            "RemovePod",
                            client.remove_pod(pb::RemovePodRequest {
                                model: MODEL.into(),
                                pod: format!("new-{}", n * 13),
                            }),
                        )
                        .await
                        .expect("RemovePod");
                    }
                }
                calls += 1;
            }
            calls
        }));
    }
    let started = Instant::now();
    while started.elapsed() < STORM {
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Health answers throughout, too.
        let health = service.clone();
        let (status, _) = bounded(
            "/healthz",
            tokio::task::spawn_blocking(move || health.http_get("/healthz")),
        )
        .await
        .expect("healthz");
        assert_eq!(status, 200);
    }
    stop.store(true, Ordering::Relaxed);
    let mut calls = 0;
    for caller in callers {
        calls += bounded("a caller to finish", caller).await.expect("caller");
    }
    bounded("the publisher to finish", storm).await.unwrap();
    let pods = bounded("ListPods", service.list_pods(MODEL)).await.len();
    println!(
        "{} new topics published, {calls} calls answered, {pods} pods listed",
        published.load(Ordering::Relaxed)
    );
    assert!(pods > 1000, "only {pods} pods: the storm did not happen");
    assert!(calls > 100, "only {calls} calls");
}

/// Churn while Score runs, answers checked: one pod of a recorded stream
/// is removed and published again from seq 0, over and over, while other
/// pods come and go beside it. Throughout, every answer for the two pods
/// nobody touches is exact; at the end every answer is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_while_scoring_leaves_the_untouched_pods_exact_throughout() {
    let stream = "qwen3-sha256-int";
    let (service, expected, mut publisher) = serve_recorded(stream, &["--admin"]).await;
    let model = expected.model.clone();
    let churned: Vec<RecordedFrame> = load_frames(stream)
        .into_iter()
        .filter(|f| f.pod() == "pod-1")
        .collect();
    let untouched = ["pod-0", "pod-2"];
    let stop = Arc::new(AtomicBool::new(false));
    let mut scorers = Vec::new();
    for _ in 0..2 {
        let (stop, probes, model) = (stop.clone(), expected.probes.clone(), model.clone());
        let mut client = service.client().await;
        scorers.push(tokio::spawn(async move {
            let mut answers = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for probe in &probes {
                    let resp = bounded("Score", client.score(token_request(&model, probe)))
                        .await
                        .expect("Score")
                        .into_inner();
                    for pod in untouched {
                        assert_answer_as(&resp, probe, pod, pod);
                    }
                    answers += 1;
                }
            }
            answers
        }));
    }
    let mut client = service.client().await;
    let remove = |pod: String| pb::RemovePodRequest {
        model: model.clone(),
        pod,
    };
    let until = Instant::now() + crate::common::budget(3);
    let mut rounds = 0u64;
    while Instant::now() < until {
        bounded("RemovePod", client.remove_pod(remove("pod-1".into())))
            .await
            .expect("RemovePod");
        let passers: Vec<String> = (0..20).map(|i| format!("churn-{rounds}-{i}")).collect();
        for (i, pod) in passers.iter().enumerate() {
            publisher
                .send(zmq_message(vec![
                    Bytes::from(format!("kv@{pod}@{model}")),
                    Bytes::copy_from_slice(&0u64.to_be_bytes()),
                    Bytes::from(one_block_store(1_000_000 + i as u64)),
                ]))
                .await;
        }
        publisher.publish_all(&churned).await;
        service
            .wait_until("pod-1 published again", async || {
                service
                    .list_pods(&model)
                    .await
                    .iter()
                    .any(|p| p.pod == "pod-1" && p.batches == churned.len() as u64)
            })
            .await;
        for pod in passers {
            bounded("RemovePod", client.remove_pod(remove(pod)))
                .await
                .expect("RemovePod");
        }
        rounds += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for scorer in scorers {
        assert!(scorer.await.expect("scorer") > 0);
    }
    assert!(rounds > 1, "{rounds} rounds of churn");
    check_probes(&service, &expected).await;
}

//! `/metrics`, `/healthz` and `/readyz` over real HTTP.

use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;

/// The value of the first sample line starting with `prefix`.
fn sample(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {prefix} in:\n{metrics}"))
}

#[tokio::test]
async fn metrics_count_ingestion_scoring_and_tokenization() {
    let stream = "qwen3-lora-salt";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let tok = qwen3_tokenizer_arg();
    let service = Service::start(&["--tokenizer", &tok]).await;
    assert_eq!(service.http_get("/healthz"), (200, "ok\n".into()));
    assert_eq!(service.http_get("/readyz").0, 200);

    let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&service, "marker").await;
    publisher.publish_all(&frames).await;
    // One malformed message: two frames.
    publisher
        .send(zmq_message(vec![
            bytes::Bytes::from_static(b"kv@p@m"),
            bytes::Bytes::from_static(b"x"),
        ]))
        .await;
    service
        .wait_applied(&expected.model, &batches_per_pod(&frames))
        .await;

    let mut client = service.client().await;
    let probe = &expected.probes[0];
    client
        .score(token_request(&expected.model, probe))
        .await
        .expect("Score");
    for _ in 0..2 {
        client
            .score(pb::ScoreRequest {
                input: Some(pb::score_request::Input::Prompt(
                    probe.text.clone().unwrap(),
                )),
                ..token_request(&expected.model, probe)
            })
            .await
            .expect("Score by text");
    }
    let _ = client.score(pb::ScoreRequest::default()).await;

    // Worker counters are bumped just after a batch is counted as applied:
    // wait until the last one is in.
    let deadline = std::time::Instant::now() + crate::common::budget(20);
    let (status, m) = loop {
        let (status, m) = service.http_get("/metrics");
        if m.contains("kv_indexer_blocks_stored_total 124\n")
            || std::time::Instant::now() > deadline
        {
            break (status, m);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(status, 200);
    let marker_batches = sample(&m, "kv_indexer_batches_applied_total") - frames.len() as f64;
    assert!(marker_batches >= 1.0, "{m}");
    assert_eq!(
        sample(
            &m,
            "kv_indexer_messages_skipped_total{reason=\"frame_count\"}"
        ),
        1.0
    );
    assert_eq!(sample(&m, "kv_indexer_pods{model=\"Qwen/Qwen3-8B\"}"), 2.0);
    assert_eq!(sample(&m, "kv_indexer_indexed_blocks{tier=\"GPU\"}"), 124.0);
    assert_eq!(sample(&m, "kv_indexer_blocks_stored_total"), 124.0);
    assert_eq!(
        sample(
            &m,
            "kv_indexer_score_requests_total{input=\"token_ids\",code=\"Ok\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &m,
            "kv_indexer_score_requests_total{input=\"prompt\",code=\"Ok\"}"
        ),
        2.0
    );
    assert_eq!(
        sample(
            &m,
            "kv_indexer_score_requests_total{input=\"none\",code=\"InvalidArgument\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(&m, "kv_indexer_score_seconds_count{input=\"prompt\"}"),
        2.0
    );
    assert_eq!(
        sample(&m, "kv_indexer_tokenize_seconds_count{input=\"prompt\"}"),
        2.0
    );
    // The second tokenization of the same text came from the cache.
    assert!(
        sample(
            &m,
            "kv_indexer_tokenization_cache_hits_total{model=\"Qwen/Qwen3-8B\"}"
        ) >= 1.0
    );
    assert_eq!(sample(&m, "kv_indexer_build_info{version="), 1.0);
    assert!(m.ends_with("# EOF\n"), "OpenMetrics text ends with # EOF");
}

/// Pods are spread over the ingest workers by count, and the metrics show
/// how: 7 pods (and the subscription marker) on 2 workers, 4 each.
#[tokio::test]
async fn ingest_worker_pods_show_the_balance() {
    let zmq = format!("tcp://127.0.0.1:{}", free_port());
    let service = Service::start_with_env(
        &["--zmq-bind", &zmq, "--ingest-workers", "2"],
        Some(zmq.clone()),
        &[],
    )
    .await;
    let mut publisher = Publisher::connect(&zmq).await;
    publisher.wait_subscribed(&service, "marker").await;
    let mut seqs = std::collections::BTreeMap::new();
    for p in 0..7u64 {
        let pod = format!("pod-{p}");
        let payload = one_block_store(p + 1);
        publisher
            .send(zmq_message(vec![
                bytes::Bytes::from(format!("kv@{pod}@m")),
                bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()),
                bytes::Bytes::from(payload),
            ]))
            .await;
        seqs.insert(pod, 1u64);
    }
    service.wait_applied("m", &seqs).await;
    let (_, m) = service.http_get("/metrics");
    let w0 = sample(&m, "kv_indexer_ingest_worker_pods{worker=\"0\"}");
    let w1 = sample(&m, "kv_indexer_ingest_worker_pods{worker=\"1\"}");
    assert_eq!((w0, w1), (4.0, 4.0), "{m}");
}

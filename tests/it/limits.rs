//! Hostile and heavy requests: limits, overload and deadlines answer with
//! clear codes, and queries never slow or lose event ingestion.

use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;
use tonic::Code;

fn tokens_request(n: usize) -> pb::ScoreRequest {
    pb::ScoreRequest {
        model: "m".into(),
        input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
            ids: vec![7; n],
        })),
        ..Default::default()
    }
}

#[tokio::test]
async fn limits_are_enforced_with_clear_messages() {
    let tok = qwen3_tokenizer_arg();
    let service = Service::start(&[
        "--tokenizer",
        &tok,
        "--max-message",
        "64KiB",
        "--max-prompt",
        "1KiB",
        "--max-prompt-tokens",
        "1000",
        "--max-candidate-pods",
        "3",
    ])
    .await;
    let mut client = service.client().await;
    let cases = [
        (
            tokens_request(1001),
            Code::InvalidArgument,
            "max-prompt-tokens",
        ),
        (
            pb::ScoreRequest {
                pods: (0..4).map(|i| format!("p{i}")).collect(),
                ..tokens_request(16)
            },
            Code::InvalidArgument,
            "max-candidate-pods",
        ),
        (
            pb::ScoreRequest {
                model: "Qwen/Qwen3-8B".into(),
                input: Some(pb::score_request::Input::Prompt("x".repeat(2000))),
                ..Default::default()
            },
            Code::InvalidArgument,
            "max-prompt",
        ),
        (
            pb::ScoreRequest {
                model: "Qwen/Qwen3-8B".into(),
                input: Some(pb::score_request::Input::Prompt("word ".repeat(180))),
                ..Default::default()
            },
            Code::Ok,
            "",
        ),
    ];
    for (req, code, mentions) in cases {
        match client.score(req).await {
            Ok(_) => assert_eq!(code, Code::Ok),
            Err(status) => {
                assert_eq!(status.code(), code, "{status:?}");
                assert!(status.message().contains(mentions), "{status:?}");
            }
        }
    }
    // A message over --max-message is refused by the transport, before any
    // handler, as RESOURCE_EXHAUSTED (100,000 one-byte token ids: ~100 KB
    // against the 64 KiB limit).
    let status = client.score(tokens_request(100_000)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // The server is fine afterwards.
    assert!(client.score(tokens_request(16)).await.is_ok());
}

#[tokio::test]
async fn overload_is_refused_at_once() {
    let tok = qwen3_tokenizer_arg();
    let service = Service::start(&["--tokenizer", &tok, "--max-inflight", "1"]).await;
    let prompt = |text: &str| pb::ScoreRequest {
        model: "Qwen/Qwen3-8B".into(),
        input: Some(pb::score_request::Input::Prompt(text.into())),
        ..Default::default()
    };
    // The first request loads the tokenizer (hundreds of ms) holding the
    // only permit; requests meanwhile are refused immediately. Whichever
    // request wins the permit, the others must be refused, fast.
    let mut slow = service.client().await;
    let first = tokio::spawn(async move { slow.score(prompt("hello")).await });
    let mut client = service.client().await;
    let mut refused = None;
    while !first.is_finished() {
        match client.score(prompt("hello again")).await {
            Err(status) if status.code() == Code::ResourceExhausted => {
                // Refused while the permit was still held: had it waited
                // for the permit (a queue), the holder would have
                // answered first.
                assert!(
                    !first.is_finished(),
                    "the refusal waited for the permit holder"
                );
                refused = Some(status);
                break;
            }
            Err(status) => panic!("{status:?}"),
            Ok(_) => {}
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let first = first.await.unwrap();
    // Our request may have won the permit, the first one then was refused.
    let refused = match (refused, first) {
        (Some(status), _) => status,
        (None, Err(status)) if status.code() == Code::ResourceExhausted => status,
        (None, other) => panic!("no request was refused while another held the permit: {other:?}"),
    };
    assert!(refused.message().contains("max-inflight"), "{refused:?}");
    // (Expired deadlines: unit tests in src/grpc/mod.rs; over the wire the
    // client enforces its own grpc-timeout first.)
    let (_, metrics) = service.http_get("/metrics");
    assert!(
        metrics.contains("kv_indexer_rejected_overload_total 1"),
        "{metrics}"
    );
}

/// A flood of queries while a stream is published: every batch lands and
/// every answer is exact afterwards.
#[tokio::test]
async fn a_query_flood_does_not_slow_or_lose_ingestion() {
    let stream = "qwen3-sha256-int";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let service = Service::start(&["--max-inflight", "4"]).await;
    let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&service, "marker").await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut flood = Vec::new();
    for i in 0..8 {
        let mut client = service.client().await;
        let probe = expected.probes[i % expected.probes.len()].clone();
        let model = expected.model.clone();
        let stop = stop.clone();
        flood.push(tokio::spawn(async move {
            let (mut ok, mut refused) = (0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match client.score(token_request(&model, &probe)).await {
                    Ok(_) => ok += 1,
                    Err(s) if s.code() == Code::ResourceExhausted => refused += 1,
                    Err(s) => panic!("{s:?}"),
                }
            }
            (ok, refused)
        }));
    }
    publisher.publish_all(&frames).await;
    service
        .wait_applied(&expected.model, &batches_per_pod(&frames))
        .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut ok, mut refused) = (0, 0);
    for f in flood {
        let (o, r) = f.await.unwrap();
        ok += o;
        refused += r;
    }
    println!(
        "flood: {ok} answered, {refused} refused while {} batches landed",
        frames.len()
    );
    assert!(ok > 0);
    check_probes(&service, &expected).await;
}

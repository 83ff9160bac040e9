//! Prompts with images: vLLM 0.33's own `KVCacheManager` served requests
//! carrying `mm_features` (`tests/fixtures/vllm-events/gen_multimodal.py`),
//! its publisher's frames go over real ZeroMQ, and `Score`, `LookupBlocks`
//! and `RecordRouting` take the items beside the token ids over real gRPC.

use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;

const STREAM: &str = "qwen3-multimodal";

/// Every probe with its items scores what vLLM's pods hold, never more:
/// an image inside one block, over several, two in one block, the same
/// image twice and moved, identical placeholder ids for different images,
/// an image in a cached prefix with a new one after it, under LoRA and a
/// cache salt; the same ids without the items, or with another image,
/// match up to the first block an image touches, as in vLLM.
#[tokio::test]
async fn multimodal_prompts_score_what_vllm_holds() {
    let (service, expected, _publisher) = serve_recorded(STREAM, &[]).await;
    assert!(expected.probes.iter().any(|p| p.mm_items.len() >= 2));
    check_probes(&service, &expected).await;
}

/// The render server's answer, passed as it is, scores as its token ids
/// and items do (vLLM's own `GenerateRequest` made each body).
#[tokio::test]
async fn the_render_servers_body_scores_as_it_is() {
    let (service, expected, _publisher) = serve_recorded(STREAM, &[]).await;
    let mut client = service.client().await;
    let mut bodies = 0;
    for probe in &expected.probes {
        let Some(body) = &probe.generate_request_json else {
            continue;
        };
        bodies += 1;
        let resp = client
            .score(pb::ScoreRequest {
                model: expected.model.clone(),
                input: Some(pb::score_request::Input::GenerateRequestJson(body.clone())),
                // The adapter is named by the model a router asks for, not
                // in the body: given beside it. The salt is the body's.
                lora_name: probe.lora_name.clone().unwrap_or_default(),
                ..Default::default()
            })
            .await
            .expect("Score")
            .into_inner();
        assert_matches(&resp, probe);
    }
    assert_eq!(bodies, expected.probes.len());
    // Items both in the body and beside it: refused, never merged.
    let probe = &expected.probes[0];
    let both = pb::ScoreRequest {
        model: expected.model.clone(),
        input: Some(pb::score_request::Input::GenerateRequestJson(
            probe.generate_request_json.clone().unwrap(),
        )),
        mm_items: probe.mm_items.clone(),
        ..Default::default()
    };
    let bad_json = pb::ScoreRequest {
        model: expected.model.clone(),
        input: Some(pb::score_request::Input::GenerateRequestJson(
            "{\"token_ids\": 1}".into(),
        )),
        ..Default::default()
    };
    assert_score_errors(
        &mut client,
        [
            (both, tonic::Code::InvalidArgument, "one or the other"),
            (
                bad_json,
                tonic::Code::InvalidArgument,
                "generate_request_json",
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn lookup_and_record_routing_key_the_items_as_score_does() {
    let (service, expected, _publisher) = serve_recorded(STREAM, &[]).await;
    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "spanning:-:-")
        .expect("probe");
    let mut client = service.client().await;
    let looked_up = client
        .lookup_blocks(pb::LookupBlocksRequest {
            model: expected.model.clone(),
            input: Some(pb::lookup_blocks_request::Input::TokenIds(pb::TokenIds {
                ids: probe.token_ids.clone(),
            })),
            mm_items: probe.mm_items.clone(),
            ..Default::default()
        })
        .await
        .expect("LookupBlocks")
        .into_inner();
    let held = looked_up
        .blocks
        .iter()
        .take_while(|b| b.holders.iter().any(|h| h.pod == "pod-0"))
        .count() as u32;
    assert_eq!(held, probe.expected["pod-0"]);
    // A routing of the prompt with a new image after it, to pod-1: its
    // speculative blocks reach past what pod-1 holds, keyed with the items.
    let next = expected
        .probes
        .iter()
        .find(|p| p.id == "prefix-then-new:-:tenant-a")
        .expect("probe");
    let recorded = client
        .record_routing(pb::RecordRoutingRequest {
            model: expected.model.clone(),
            input: Some(pb::record_routing_request::Input::TokenIds(pb::TokenIds {
                ids: next.token_ids.clone(),
            })),
            pod: "pod-0".into(),
            cache_salt: "tenant-a".into(),
            mm_items: next.mm_items.clone(),
            ..Default::default()
        })
        .await
        .expect("RecordRouting")
        .into_inner();
    assert_eq!(recorded.total_blocks, (next.token_ids.len() / 16) as u32);
    let scored = client
        .score(token_request(&expected.model, next))
        .await
        .expect("Score")
        .into_inner();
    let pod0 = scored
        .pods
        .iter()
        .find(|p| p.pod == "pod-0")
        .expect("pod-0");
    assert_eq!(pod0.speculative_blocks, recorded.total_blocks, "{scored:?}");
    // Without the items the same ids are another prompt: nothing speculative.
    let mut bare = token_request(&expected.model, next);
    bare.mm_items.clear();
    let scored = client.score(bare).await.expect("Score").into_inner();
    let pod0 = scored.pods.iter().find(|p| p.pod == "pod-0");
    assert!(
        pod0.is_none_or(|p| p.speculative_blocks < recorded.total_blocks),
        "{scored:?}"
    );
}

#[tokio::test]
async fn items_that_cannot_be_keyed_are_refused_with_the_reason() {
    let (service, expected, _publisher) = serve_recorded(STREAM, &[]).await;
    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "two-in-one:-:-")
        .expect("probe");
    let with_items = |items: Vec<pb::MultimodalItem>| pb::ScoreRequest {
        mm_items: items,
        ..token_request(&expected.model, probe)
    };
    let item = |offset, length| pb::MultimodalItem {
        identifier: "img".into(),
        offset,
        length,
        modality: "image".into(),
    };
    let text = pb::ScoreRequest {
        model: expected.model.clone(),
        input: Some(pb::score_request::Input::Prompt("a picture".into())),
        mm_items: vec![item(0, 1)],
        ..Default::default()
    };
    let end = probe.token_ids.len() as u32;
    let mut client = service.client().await;
    assert_score_errors(
        &mut client,
        [
            (
                text,
                tonic::Code::InvalidArgument,
                "mm_items go with token_ids",
            ),
            (
                with_items(vec![item(2, 6), item(4, 4)]),
                tonic::Code::InvalidArgument,
                "overlap",
            ),
            (
                with_items(vec![item(end - 2, 4)]),
                tonic::Code::InvalidArgument,
                "past the prompt",
            ),
            (
                with_items(vec![item(0, 0)]),
                tonic::Code::InvalidArgument,
                "length 0",
            ),
        ],
    )
    .await;
}

/// `--key-mode engine`: the blocks' keys are vLLM's own hashes, the items'
/// `("mm", identifier, offset)` keys pickled as vLLM pickles them; with the
/// adapter's path configured, its blocks too.
#[tokio::test]
async fn engine_keys_of_multimodal_blocks_are_vllms() {
    let args = [
        "--key-mode",
        "engine",
        "--lora-path",
        "vision-lora=/loras/vision-lora",
    ];
    let (service, expected, _publisher) = serve_recorded(STREAM, &args).await;
    check_probes(&service, &expected).await;
    let pods = service.list_pods(&expected.model).await;
    assert!(pods.iter().all(|p| p.key_mode == "engine"), "{pods:?}");
}

/// A stand-in for `vllm launch render` on loopback: answers each `POST
/// /v1/chat/completions/render` as `answer` says, and keeps the bodies.
struct RenderServer {
    port: u16,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// How the stand-in answers: (HTTP status, body, delay).
type Answer = (u16, String, std::time::Duration);

impl RenderServer {
    fn start(answer: impl Fn(&str) -> Answer + Send + 'static) -> RenderServer {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = bodies.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut length = 0usize;
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                    line.clear();
                }
                let mut body = vec![0u8; length];
                reader.read_exact(&mut body).unwrap();
                let body = String::from_utf8(body).unwrap();
                let (status, text, delay) = answer(&body);
                kept.lock().unwrap().push(body);
                std::thread::sleep(delay);
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                    text.len()
                );
            }
        });
        RenderServer { port, bodies }
    }

    fn url(&self, model: &str) -> String {
        format!("{model}=http://127.0.0.1:{}", self.port)
    }
}

/// `--render-concurrency`: one render in flight at a time per server; a
/// second chat with an image while the first waits on the server is
/// refused at once, and counted, not queued.
#[tokio::test]
async fn renders_beyond_render_concurrency_are_refused_at_once() {
    let expected = load_expected(STREAM);
    let rendered = expected.probes[0].generate_request_json.clone().unwrap();
    let server =
        RenderServer::start(move |_| (200, rendered.clone(), std::time::Duration::from_secs(2)));
    let service = Service::start(&[
        "--render-url",
        &server.url(&expected.model),
        "--render-concurrency",
        "1",
    ])
    .await;
    let chat = pb::ScoreRequest {
        model: expected.model.clone(),
        input: Some(pb::score_request::Input::ChatCompletionJson(image_chat())),
        ..Default::default()
    };
    let mut first = service.client().await;
    let first_chat = chat.clone();
    let slow = tokio::spawn(async move { first.score(first_chat).await });
    // The first is at the server (it keeps the body before it sleeps).
    service
        .wait_until("the first render at the server", async || {
            !server.bodies.lock().unwrap().is_empty()
        })
        .await;
    let mut second = service.client().await;
    assert_score_errors(
        &mut second,
        [(chat, tonic::Code::ResourceExhausted, "--render-concurrency")],
    )
    .await;
    slow.await.unwrap().expect("the first render is answered");
    assert_eq!(
        service.metric("kv_indexer_renders_total{outcome=\"busy\"}"),
        1.0
    );
}

/// A chat with an image part and the probe whose prompt the render server
/// makes of it.
fn image_chat() -> String {
    r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AA=="}},{"type":"text","text":"what is this?"}]}]}"#.into()
}

/// `--render-url`: a chat with an image is rendered by the model's render
/// server (its `GenerateRequest` is one vLLM's own class made) and scored
/// with its items; a text chat stays in-process; the server's refusals,
/// absence and slowness come back as gRPC statuses naming them.
#[tokio::test]
async fn render_url_renders_chats_with_images() {
    let expected = load_expected(STREAM);
    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "two-in-one:-:-")
        .expect("probe")
        .clone();
    let rendered = probe.generate_request_json.clone().unwrap();
    let server = RenderServer::start(move |body| {
        if body.contains("refuse me") {
            let error = r#"{"error":{"message":"image could not be decoded","type":"BadRequestError","code":400}}"#;
            (400, error.into(), std::time::Duration::ZERO)
        } else if body.contains("slow") {
            (200, rendered.clone(), std::time::Duration::from_secs(3))
        } else {
            (200, rendered.clone(), std::time::Duration::ZERO)
        }
    });
    let tokenizer = qwen3_tokenizer_arg();
    let args = [
        "--render-url",
        &server.url(&expected.model),
        "--render-timeout",
        "1s",
        "--tokenizer",
        &tokenizer,
    ];
    let (service, expected, _publisher) = serve_recorded(STREAM, &args).await;
    let chat = |body: String| pb::ScoreRequest {
        model: expected.model.clone(),
        input: Some(pb::score_request::Input::ChatCompletionJson(body)),
        ..Default::default()
    };
    let mut client = service.client().await;
    let resp = client
        .score(chat(image_chat()))
        .await
        .expect("Score")
        .into_inner();
    assert_matches(&resp, &probe);
    assert!(resp.pods.iter().any(|p| p.matched_blocks > 1), "{resp:?}");
    let sent = server.bodies.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    assert!(
        sent[0].contains(r#""model":"Qwen/Qwen3-8B""#),
        "{}",
        sent[0]
    );
    // A text chat is tokenized here: the server hears nothing.
    let text = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}"#;
    client.score(chat(text.into())).await.expect("text chat");
    assert_eq!(server.bodies.lock().unwrap().len(), 1);
    let refused = image_chat().replace("what is this?", "refuse me");
    let slow = image_chat().replace("what is this?", "slow");
    assert_score_errors(
        &mut client,
        [
            (
                chat(refused),
                tonic::Code::InvalidArgument,
                "image could not be decoded",
            ),
            (
                chat(slow),
                tonic::Code::DeadlineExceeded,
                "--render-timeout",
            ),
        ],
    )
    .await;
    for (outcome, n) in [("ok", 1.0), ("refused", 1.0), ("timeout", 1.0)] {
        let series = format!("kv_indexer_renders_total{{outcome=\"{outcome}\"}}");
        assert_eq!(service.metric(&series), n, "{series}");
    }
    drop(client);
    drop(service);
    // A model whose server is down, and one with none configured.
    let down = free_port();
    let service = Service::start(&[
        "--render-url",
        &format!("{}=http://127.0.0.1:{down}", expected.model),
        "--tokenizer",
        &tokenizer,
    ])
    .await;
    let mut client = service.client().await;
    assert_score_errors(
        &mut client,
        [(
            chat(image_chat()),
            tonic::Code::Unavailable,
            "cannot be reached",
        )],
    )
    .await;
    let service = Service::start(&["--tokenizer", &tokenizer]).await;
    let mut client = service.client().await;
    assert_score_errors(
        &mut client,
        [(
            chat(image_chat()),
            tonic::Code::InvalidArgument,
            "--render-url",
        )],
    )
    .await;
}

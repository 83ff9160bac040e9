//! What a client cannot do with a chat template: make the service run one
//! without end. Each test is one attack, over real gRPC.

mod common;

use std::time::Duration;

use common::*;
use kv_indexer::proto::kvindexer::v1 as pb;
use tonic::Code;

const QWEN: &str = "Qwen/Qwen3-8B";

/// A request with a `grpc-timeout`: the server must answer by then. (Every
/// call here has one, so a service that ignores its bounds fails the test
/// instead of hanging it: tonic cancels such a call with CANCELLED.)
fn within<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

fn prompt(model: &str, text: &str) -> pb::ScoreRequest {
    pb::ScoreRequest {
        model: model.into(),
        input: Some(pb::score_request::Input::Prompt(text.into())),
        ..Default::default()
    }
}

fn chat_with_template(template: &str) -> String {
    serde_json::json!({
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": template,
    })
    .to_string()
}

/// Attack 1: a request-level template of two nested `range(100000)` loops.
/// Refused without `--allow-request-chat-template`; with it, every render
/// stops with a clear error (out of fuel; over `--max-prompt` for one that
/// writes without end), and text scoring goes on meanwhile.
#[tokio::test]
async fn request_chat_templates_are_refused_unless_allowed_and_bounded_when_allowed() {
    let tok = qwen3_tokenizer_arg();
    let runaway =
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
    let endless_output = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}";
    let tokenize = |template: &str| pb::TokenizeRequest {
        model: QWEN.into(),
        input: Some(pb::tokenize_request::Input::ChatCompletionJson(
            chat_with_template(template),
        )),
        ..Default::default()
    };
    let score_chat = |template: &str| pb::ScoreRequest {
        model: QWEN.into(),
        input: Some(pb::score_request::Input::ChatCompletionJson(
            chat_with_template(template),
        )),
        ..Default::default()
    };
    let timeout = Duration::from_secs(60);

    let service = Service::start(&["--tokenizer", &tok]).await;
    let mut client = service.client().await;
    for template in [runaway, endless_output] {
        let tokenized = client.tokenize(within(tokenize(template), timeout)).await;
        let scored = client.score(within(score_chat(template), timeout)).await;
        for status in [
            tokenized.expect_err("refused"),
            scored.expect_err("refused"),
        ] {
            assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
            assert!(
                status.message().contains("--allow-request-chat-template"),
                "{status:?}"
            );
        }
    }
    // The model's own template is still used for chats without one.
    let ok = client
        .tokenize(within(
            pb::TokenizeRequest {
                model: QWEN.into(),
                input: Some(pb::tokenize_request::Input::ChatCompletionJson(
                    r#"{"messages": [{"role": "user", "content": "hi"}]}"#.into(),
                )),
                ..Default::default()
            },
            timeout,
        ))
        .await
        .expect("chat without a template")
        .into_inner();
    assert!(ok.rendered_prompt.contains("<|im_start|>user\nhi"));
    drop(service);

    let service = Service::start(&["--tokenizer", &tok, "--allow-request-chat-template"]).await;
    let client = service.client().await;
    let mut renders = Vec::new();
    for i in 0..6 {
        let mut c = client.clone();
        renders.push(tokio::spawn(async move {
            match i % 3 {
                0 => c
                    .tokenize(within(tokenize(runaway), timeout))
                    .await
                    .map(|_| ())
                    .map_err(|s| (s, "fuel")),
                1 => c
                    .score(within(score_chat(runaway), timeout))
                    .await
                    .map(|_| ())
                    .map_err(|s| (s, "fuel")),
                _ => c
                    .score(within(score_chat(endless_output), timeout))
                    .await
                    .map(|_| ())
                    .map_err(|s| (s, "--max-prompt")),
            }
        }));
    }
    // Meanwhile, text scoring for the loaded model answers.
    let mut c = client.clone();
    for _ in 0..3 {
        let resp = c
            .score(within(prompt(QWEN, "hello while templates run"), timeout))
            .await
            .expect("text Score during the renders")
            .into_inner();
        assert!(resp.prompt_tokens > 0);
    }
    for r in renders {
        let (status, mentions) = r.await.unwrap().expect_err("every such render fails");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(mentions), "{status:?}");
    }
}

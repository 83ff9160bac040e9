//! Text and chat prompts, tokenized in-process with the model's real
//! tokenizer, score exactly like their token ids.

use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;
use tonic::Code;

async fn serve_stream(stream: &str) -> (Service, Expected) {
    let tok = qwen3_tokenizer_arg();
    let (service, expected, _) = serve_recorded(stream, &["--tokenizer", &tok]).await;
    (service, expected)
}

fn with_input(probe: &Probe, model: &str, input: pb::score_request::Input) -> pb::ScoreRequest {
    pb::ScoreRequest {
        input: Some(input),
        ..token_request(model, probe)
    }
}

/// Every probe that round-trips (per the fixture, checked with
/// transformers) scores the same by text and by chat messages as by ids.
#[tokio::test]
async fn text_and_chat_prompts_score_like_their_token_ids() {
    for stream in [
        "qwen3-sha256-int",
        "qwen3-sha256cbor-bytes",
        "qwen3-lora-salt",
    ] {
        let (service, expected) = serve_stream(stream).await;
        let mut client = service.client().await;
        let (mut by_text, mut by_chat) = (0, 0);
        for probe in &expected.probes {
            // The same prompt tokens, the same matches as by token ids.
            let mut same_as_ids = async |input| {
                let req = with_input(probe, &expected.model, input);
                let resp = client.score(req).await.expect("Score").into_inner();
                assert_eq!(
                    resp.prompt_tokens as usize,
                    probe.token_ids.len(),
                    "{}",
                    probe.id
                );
                assert_matches(&resp, probe);
            };
            if let (true, Some(text)) = (probe.text_roundtrips, &probe.text) {
                same_as_ids(pb::score_request::Input::Prompt(text.clone())).await;
                by_text += 1;
            }
            if let (true, Some(messages)) = (probe.chat_roundtrips, &probe.messages) {
                let body = serde_json::json!({ "messages": messages }).to_string();
                same_as_ids(pb::score_request::Input::ChatCompletionJson(body)).await;
                by_chat += 1;
            }
        }
        println!("{stream}: {by_text} probes by text, {by_chat} by chat, all as by token ids");
        assert!(by_text > 0);
        if stream != "qwen3-lora-salt" {
            assert!(by_chat > 0);
        }
    }
}

#[tokio::test]
async fn tokenize_returns_ids_keys_and_the_rendered_chat() {
    let (service, expected) = serve_stream("qwen3-sha256-int").await;
    let mut client = service.client().await;
    let probe = expected
        .probes
        .iter()
        .find(|p| p.chat_roundtrips && p.messages.is_some())
        .expect("a chat probe");
    let body = serde_json::json!({ "messages": probe.messages }).to_string();
    let resp = client
        .tokenize(pb::TokenizeRequest {
            model: expected.model.clone(),
            input: Some(pb::tokenize_request::Input::ChatCompletionJson(body)),
            ..Default::default()
        })
        .await
        .expect("Tokenize")
        .into_inner();
    assert_eq!(resp.token_ids, probe.token_ids);
    assert_eq!(Some(&resp.rendered_prompt), probe.text.as_ref());
    assert_eq!(resp.block_size, 16);
    assert_eq!(resp.block_keys.len(), probe.token_ids.len() / 16);
    // The keys are the ones the index holds for that prompt.
    let lookup = client
        .lookup_blocks(pb::LookupBlocksRequest {
            model: expected.model.clone(),
            input: Some(pb::lookup_blocks_request::Input::BlockKeys(pb::BlockKeys {
                keys: resp.block_keys.clone(),
            })),
            ..Default::default()
        })
        .await
        .expect("LookupBlocks")
        .into_inner();
    let best = probe.expected.values().copied().max().unwrap_or(0) as usize;
    assert!(lookup.blocks[..best].iter().all(|b| !b.holders.is_empty()));

    // add_special_tokens override: Qwen has no BOS, so the ids do not change;
    // the override is accepted for both input kinds.
    let text = probe.text.clone().unwrap();
    let plain = client
        .tokenize(pb::TokenizeRequest {
            model: expected.model.clone(),
            input: Some(pb::tokenize_request::Input::Prompt(text)),
            add_special_tokens: Some(false),
            ..Default::default()
        })
        .await
        .expect("Tokenize")
        .into_inner();
    assert_eq!(plain.token_ids, probe.token_ids);
    assert!(plain.rendered_prompt.is_empty());
}

#[tokio::test]
async fn tokenizer_problems_get_clear_status_codes() {
    let tok = qwen3_tokenizer_arg();
    let service = Service::start(&["--tokenizer", &tok, "--allow-request-chat-template"]).await;
    let mut client = service.client().await;
    let model = "Qwen/Qwen3-8B".to_string();
    let chat = |body: &str| pb::ScoreRequest {
        model: model.clone(),
        input: Some(pb::score_request::Input::ChatCompletionJson(body.into())),
        ..Default::default()
    };
    let cases = [
        (chat("{not json"), Code::InvalidArgument, "JSON"),
        (
            chat(r#"{"messages": []}"#),
            Code::InvalidArgument,
            "messages",
        ),
        (
            chat(r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#),
            Code::InvalidArgument,
            "image_url",
        ),
        (
            chat(
                r#"{"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ raise_exception('roles must alternate') }}"}"#,
            ),
            Code::InvalidArgument,
            "roles must alternate",
        ),
    ];
    assert_score_errors(&mut client, cases).await;
    // A model neither configured nor published: Score is not an error
    // (nothing is cached for it), Tokenize has no tokens to give.
    let unknown = client
        .score(pb::ScoreRequest {
            model: "org/unknown-model".into(),
            input: Some(pb::score_request::Input::Prompt("hi".into())),
            pods: vec!["pod-a".into()],
            ..Default::default()
        })
        .await
        .expect("Score")
        .into_inner();
    assert_eq!(unknown.pods.len(), 1);
    assert_eq!(unknown.pods[0].matched_blocks, 0);
    let status = client
        .tokenize(pb::TokenizeRequest {
            model: "org/unknown-model".into(),
            input: Some(pb::tokenize_request::Input::Prompt("hi".into())),
            ..Default::default()
        })
        .await
        .expect_err("no tokenizer");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(status.message().contains("org/unknown-model"), "{status:?}");
    // A chat request for a model with a tokenizer works and is not cached as failing.
    let ok = client
        .score(chat(
            r#"{"messages": [{"role": "user", "content": "hello"}]}"#,
        ))
        .await
        .expect("Score")
        .into_inner();
    assert!(ok.prompt_tokens > 0);
}

/// A model that pods publish and that has no local tokenizer is downloaded
/// from the Hub endpoint (`HF_ENDPOINT`, with `HF_TOKEN`) into the HF cache,
/// tokenizer files only; a later start with `HF_HUB_OFFLINE=1` finds it there.
#[tokio::test]
async fn missing_tokenizers_are_downloaded_once_into_the_hf_cache() {
    let hub = FakeHub::serve(
        "Qwen/Qwen3-8B",
        fixtures_dir().join("tokenizers/qwen3"),
        "hf_secret",
    );
    let hf_home = tempfile::tempdir().unwrap();
    let env = [
        ("HF_HUB_OFFLINE", "0".to_string()),
        ("HF_ENDPOINT", hub.endpoint.clone()),
        ("HF_TOKEN", "hf_secret".to_string()),
        ("HF_HOME", hf_home.path().display().to_string()),
    ];
    let frames = &load_frames("qwen3-sha256-int");
    let start = |env: Vec<(&'static str, String)>| async move {
        let zmq = format!("tcp://127.0.0.1:{}", free_port());
        let service = Service::start_with_env(&["--zmq-bind", &zmq], Some(zmq.clone()), &env).await;
        // Its pods make the model one the service may fetch a tokenizer for.
        let publisher = service.publish_recorded("Qwen/Qwen3-8B", frames).await;
        (service, publisher)
    };
    let (service, _publisher) = start(env.to_vec()).await;
    let mut client = service.client().await;
    let req = pb::TokenizeRequest {
        model: "Qwen/Qwen3-8B".into(),
        input: Some(pb::tokenize_request::Input::Prompt("Hello".into())),
        ..Default::default()
    };
    // Concurrent first requests wait for one load.
    let mut other = client.clone();
    let (a, b) = tokio::join!(other.tokenize(req.clone()), client.tokenize(req.clone()));
    assert_eq!(a.expect("Tokenize").into_inner().token_ids, vec![9707]);
    assert_eq!(b.expect("Tokenize").into_inner().token_ids, vec![9707]);
    let requested = hub.requests.lock().unwrap().clone();
    assert!(
        requested.iter().all(|p| !p.contains("safetensors")),
        "{requested:?}"
    );
    let tokenizer_gets = requested
        .iter()
        .filter(|p| p.ends_with("/tokenizer.json"))
        .count();
    assert_eq!(tokenizer_gets, 1, "downloaded once: {requested:?}");
    assert!(service
        .logs()
        .contains("downloading from the Hugging Face Hub"));
    let snapshot = hf_home
        .path()
        .join("hub/models--Qwen--Qwen3-8B/snapshots/0123456789abcdef");
    assert!(snapshot.join("tokenizer.json").exists());
    assert!(snapshot.join("tokenizer_config.json").exists());
    drop(service);

    let offline = [
        ("HF_HUB_OFFLINE", "1".to_string()),
        ("HF_HOME", hf_home.path().display().to_string()),
    ];
    let (service, _publisher) = start(offline.to_vec()).await;
    let out = service
        .client()
        .await
        .tokenize(req)
        .await
        .expect("Tokenize from the cache")
        .into_inner();
    assert_eq!(out.token_ids, vec![9707]);
    assert_eq!(hub.requests.lock().unwrap().len(), requested.len());
}

/// A planted `HF_TOKEN` and a password in `HF_ENDPOINT` appear in no
/// output: `kv-indexer check`, the service's debug logs (text and JSON),
/// `/metrics`, and the errors of a download that reached the Hub and of one
/// that could not connect (whose transport error quotes the URL).
#[tokio::test]
async fn planted_secrets_appear_in_no_output() {
    // Lower case: the fake Hub compares the header in lower case.
    const TOKEN: &str = "hf_plantedt0ken4242";
    const PASSWORD: &str = "plantedPa55w0rd";
    let hub = FakeHub::serve(
        "Qwen/Qwen3-8B",
        fixtures_dir().join("tokenizers/qwen3"),
        TOKEN,
    );
    let with_password =
        |endpoint: &str| endpoint.replacen("http://", &format!("http://hfuser:{PASSWORD}@"), 1);
    let closed = format!("http://127.0.0.1:{}", free_port());
    let mut seen = String::new();

    let check = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .arg("check")
        .env("HF_TOKEN", TOKEN)
        .env("HF_ENDPOINT", with_password(&hub.endpoint))
        .env("HF_HUB_OFFLINE", "0")
        .output()
        .expect("run check");
    assert!(check.status.success());
    let check_out = String::from_utf8_lossy(&check.stdout).into_owned();
    assert!(check_out.contains("token: \"set\""), "{check_out}");
    assert!(
        check_out.contains("hfuser") || check_out.contains("***@"),
        "{check_out}"
    );
    seen += &check_out;
    seen += &String::from_utf8_lossy(&check.stderr);

    let frames = &load_frames("qwen3-sha256-int");
    let req = pb::TokenizeRequest {
        model: "Qwen/Qwen3-8B".into(),
        input: Some(pb::tokenize_request::Input::Prompt("Hello".into())),
        ..Default::default()
    };
    // The token wins over the endpoint's credentials, and the fake Hub takes
    // it: the download succeeds, logged at debug level (where the HTTP
    // client logs every URL it requests). The closed port fails to connect,
    // and its error quotes the URL.
    for (endpoint, format) in [
        (with_password(&hub.endpoint), "text"),
        (with_password(&closed), "json"),
    ] {
        let hf_home = tempfile::tempdir().unwrap();
        let env = [
            ("HF_HUB_OFFLINE", "0".to_string()),
            ("HF_ENDPOINT", endpoint.clone()),
            ("HF_TOKEN", TOKEN.to_string()),
            ("HF_HOME", hf_home.path().display().to_string()),
            ("KV_INDEXER_LOG_LEVEL", "debug".to_string()),
            ("KV_INDEXER_LOG_FORMAT", format.to_string()),
        ];
        let zmq = format!("tcp://127.0.0.1:{}", free_port());
        let service = Service::start_with_env(&["--zmq-bind", &zmq], Some(zmq.clone()), &env).await;
        let _publisher = service.publish_recorded("Qwen/Qwen3-8B", frames).await;
        let answer = service.client().await.tokenize(req.clone()).await;
        match (endpoint == with_password(&hub.endpoint), answer) {
            (true, Ok(ok)) => assert_eq!(ok.into_inner().token_ids, vec![9707]),
            (false, Err(status)) => {
                assert!(status.message().contains("Hub download"), "{status:?}");
                seen += status.message();
            }
            (_, other) => panic!("{endpoint}: {other:?}"),
        }
        seen += &service.http_get("/metrics").1;
        seen += &service.logs();
    }
    assert!(seen.contains("downloading from the Hugging Face Hub"));
    for secret in [TOKEN, PASSWORD] {
        assert!(!seen.contains(secret), "{secret} printed:\n{seen}");
    }
}

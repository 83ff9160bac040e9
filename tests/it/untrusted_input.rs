//! What a client cannot do with a model name or a chat template: make the
//! service run a template without end, read tokenizers from outside
//! `--tokenizers-dir`, load one directory many times, reach the Hugging
//! Face Hub for a model nobody serves, or hold threads on a download that
//! hangs. Each test is one of those attacks, over real gRPC.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;
use kv_indexer::proto::llmd::v1 as llmd;
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

/// A Hugging Face Hub endpoint that accepts connections and never answers,
/// counting them.
struct SilentHub {
    endpoint: String,
    connections: Arc<AtomicUsize>,
}

impl SilentHub {
    fn start() -> SilentHub {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
        let connections = Arc::new(AtomicUsize::new(0));
        let count = connections.clone();
        std::thread::spawn(move || {
            // Held open, never read or written: the peer waits for nothing.
            let mut open = Vec::new();
            for stream in listener.incoming().flatten() {
                count.fetch_add(1, Ordering::SeqCst);
                open.push(stream);
            }
        });
        SilentHub {
            endpoint,
            connections,
        }
    }

    fn env(&self, hf_home: &std::path::Path) -> Vec<(&'static str, String)> {
        vec![
            ("HF_HUB_OFFLINE", "0".to_string()),
            ("HF_ENDPOINT", self.endpoint.clone()),
            ("HF_HOME", hf_home.display().to_string()),
        ]
    }
}

fn metric_line(metrics: &str, name: &str) -> Option<i64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

/// `kv_indexer_tokenizers{state=...}` as (loaded, loading, failed).
fn tokenizer_states(service: &Service) -> (i64, i64, i64) {
    let (_, metrics) = service.http_get("/metrics");
    let state = |s: &str| {
        metric_line(&metrics, &format!("kv_indexer_tokenizers{{state=\"{s}\"}}"))
            .unwrap_or_else(|| panic!("no tokenizers{{state={s}}} in\n{metrics}"))
    };
    (state("loaded"), state("loading"), state("failed"))
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
    let timeout = crate::common::budget(60);

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

/// Attack 2: model names that are absolute paths or climb out with `..`,
/// and many spellings of one directory, with `--tokenizers-dir`.
#[tokio::test]
async fn model_names_never_leave_the_tokenizers_dir_and_aliases_share_one_tokenizer() {
    let root = tempfile::tempdir().unwrap();
    let fixture = fixtures_dir().join("tokenizers/qwen3");
    let models = root.path().join("models");
    let outside = root.path().join("outside");
    for dir in [models.join("qwen3"), outside.clone()] {
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::os::unix::fs::symlink(fixture.join(f), dir.join(f)).unwrap();
        }
    }
    let service = Service::start(&["--tokenizers-dir", models.to_str().unwrap()]).await;
    let mut client = service.client().await;
    let timeout = crate::common::budget(30);
    let tokenize = |model: &str| pb::TokenizeRequest {
        model: model.into(),
        input: Some(pb::tokenize_request::Input::Prompt("Hello".into())),
        ..Default::default()
    };
    let abs = |p: &std::path::Path| p.display().to_string();
    let escapes = [
        abs(&outside),
        format!("/{}", abs(&outside)),
        format!("/.{}", abs(&outside)),
        format!("{}/", abs(&outside)),
        abs(&models.join("qwen3")),
        "../outside".to_string(),
        "qwen3/../../outside".to_string(),
        "../../../../../../..".to_string() + &abs(&outside),
    ];
    for name in &escapes {
        let status = client
            .tokenize(within(tokenize(name), timeout))
            .await
            .expect_err("a name outside the directory has no tokenizer");
        assert_eq!(status.code(), Code::NotFound, "{name}: {status:?}");
        assert!(
            status.message().contains("neither configured"),
            "{status:?}"
        );
        // Score answers, untokenized.
        let resp = client
            .score(within(prompt(name, "Hello"), timeout))
            .await
            .expect("Score")
            .into_inner();
        assert_eq!(resp.prompt_tokens, 0, "{name}");
    }
    assert_eq!(tokenizer_states(&service), (0, 0, 0));
    for alias in [
        "qwen3",
        "qwen3/",
        "./qwen3",
        "qwen3/.",
        ".//qwen3",
        "qwen3//",
        "./qwen3/./",
        "././qwen3",
    ] {
        let ids = client
            .tokenize(within(tokenize(alias), timeout))
            .await
            .unwrap_or_else(|s| panic!("{alias}: {s:?}"))
            .into_inner()
            .token_ids;
        assert_eq!(ids, vec![9707], "{alias}");
    }
    // Eight spellings, one directory, one tokenizer.
    assert_eq!(tokenizer_states(&service), (1, 0, 0));
}

/// Attack 3: many random model names on `Score(prompt)`, with a Hub endpoint
/// that accepts and never answers. None reaches the Hub, each answers at
/// once with its candidates at 0, and the registry holds only the one
/// configured tokenizer afterwards.
#[tokio::test]
async fn unknown_models_do_no_tokenizer_work_and_never_reach_the_hub() {
    let hub = SilentHub::start();
    let hf_home = tempfile::tempdir().unwrap();
    let tok = qwen3_tokenizer_arg();
    let service = Service::start_with_env(
        &["--zmq-bind", "none", "--tokenizer", &tok],
        None,
        &hub.env(hf_home.path()),
    )
    .await;
    let client = service.client().await;
    // The configured model's first Score waits for its tokenizer to load
    // from file. In a debug build on two cores shared with busy processes
    // that took 10.2 s, past the 10 s the unknown models get below (they
    // must answer at once): with four busy processes, 2 of 2 runs failed
    // here. 30 s, as this file's other first loads.
    let loaded = client
        .clone()
        .score(within(prompt(QWEN, "hello"), crate::common::budget(30)))
        .await
        .expect("the configured model")
        .into_inner();
    assert!(loaded.prompt_tokens > 0);

    let timeout = crate::common::budget(10);
    let mut tasks = Vec::new();
    for worker in 0..8u64 {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (worker + 1).wrapping_mul(0xff51_afd7);
            for i in 0..250 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let model = format!("org-{:x}/model-{worker}-{i}", rng);
                let req = pb::ScoreRequest {
                    pods: vec!["pod-a".into(), "pod-b".into()],
                    ..prompt(&model, "Hello, world")
                };
                let resp = c
                    .score(within(req, timeout))
                    .await
                    .unwrap_or_else(|s| panic!("{model}: {s:?}"))
                    .into_inner();
                assert_eq!(resp.prompt_tokens, 0, "{model}: not tokenized");
                assert_eq!(resp.pods.len(), 2);
                assert!(
                    resp.pods
                        .iter()
                        .all(|p| p.matched_blocks == 0 && p.score == 0.0),
                    "{resp:?}"
                );
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // llm-d's API: the same rule.
    let mut llmd_client = llmd::indexer_service_client::IndexerServiceClient::connect(format!(
        "http://{}",
        service.grpc_addr()
    ))
    .await
    .unwrap();
    let scores = llmd_client
        .get_pod_scores(within(
            llmd::GetPodScoresRequest {
                prompt: "Hello".into(),
                model_name: "org/never-published".into(),
                pod_identifiers: vec!["pod-a".into(), "pod-b".into()],
            },
            timeout,
        ))
        .await
        .expect("GetPodScores")
        .into_inner()
        .scores;
    assert_eq!(scores.len(), 2);
    assert!(scores.iter().all(|s| s.score == 0.0), "{scores:?}");
    // Tokenize has no tokens to give.
    let status = client
        .clone()
        .tokenize(within(
            pb::TokenizeRequest {
                model: "org/never-published".into(),
                input: Some(pb::tokenize_request::Input::Prompt("Hello".into())),
                ..Default::default()
            },
            timeout,
        ))
        .await
        .expect_err("NOT_FOUND");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(
        status.message().contains("nor published by any pod"),
        "{status:?}"
    );

    assert_eq!(
        hub.connections.load(Ordering::SeqCst),
        0,
        "nothing asked the Hub"
    );
    assert_eq!(
        tokenizer_states(&service),
        (1, 0, 0),
        "nothing kept per name"
    );
    let lines = service
        .logs()
        .lines()
        .filter(|l| l.contains("neither configured nor published"))
        .count();
    assert!(lines < 10, "{lines} log lines for 2,000 unknown models");
}

/// Attack 3, second half: a model pods publish, with no local tokenizer,
/// whose Hub download hangs. A request with a 1 s deadline gets
/// DEADLINE_EXCEEDED (one download for all of them; no thread held by
/// any), and text scoring for the loaded model answers meanwhile.
#[tokio::test]
async fn a_hanging_hub_download_costs_its_waiters_only_their_deadline() {
    let hub = SilentHub::start();
    let hf_home = tempfile::tempdir().unwrap();
    let tok = qwen3_tokenizer_arg();
    let zmq = format!("tcp://127.0.0.1:{}", free_port());
    let service = Service::start_with_env(
        &["--zmq-bind", &zmq, "--tokenizer", &tok],
        Some(zmq.clone()),
        &hub.env(hf_home.path()),
    )
    .await;
    // A pod publishes WARMUP_MODEL: a model the service may fetch for.
    let mut publisher = Publisher::connect(&zmq).await;
    publisher.wait_subscribed(&service, "marker").await;
    let client = service.client().await;
    // Load the configured tokenizer first: its load is seconds of CPU in a
    // debug build, and with it running the waiters' deadlines would race
    // tonic's own grpc-timeout (CANCELLED) on a 2-core machine.
    let mut warm = client.clone();
    warm.score(within(prompt(QWEN, "warm up"), crate::common::budget(60)))
        .await
        .expect("the configured tokenizer loads");

    let mut waiters = Vec::new();
    for _ in 0..32 {
        let mut c = client.clone();
        waiters.push(tokio::spawn(async move {
            c.score(within(
                prompt(WARMUP_MODEL, "Hello"),
                Duration::from_secs(1),
            ))
            .await
        }));
    }
    let mut c = client.clone();
    let resp = c
        .score(within(prompt(QWEN, "hello"), crate::common::budget(30)))
        .await
        .expect("the loaded model answers while the download hangs")
        .into_inner();
    assert!(resp.prompt_tokens > 0);
    for w in waiters {
        let status = w.await.unwrap().expect_err("the download never finishes");
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(status.message().contains("tokenizer"), "{status:?}");
    }
    // Still answering, and token ids never needed a tokenizer.
    let resp = c
        .score(within(
            prompt(QWEN, "hello again"),
            crate::common::budget(30),
        ))
        .await
        .expect("after the waiters gave up")
        .into_inner();
    assert!(resp.prompt_tokens > 0);
    c.score(within(
        pb::ScoreRequest {
            model: WARMUP_MODEL.into(),
            input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                ids: vec![1; 32],
            })),
            ..Default::default()
        },
        crate::common::budget(30),
    ))
    .await
    .expect("token ids");
    service
        .wait_log("downloading from the Hugging Face Hub")
        .await;
    assert_eq!(
        hub.connections.load(Ordering::SeqCst),
        1,
        "one download for every waiter"
    );
}

/// `--hub-timeout`: a download that gets no answer fails after it, the
/// failure is answered to the waiting request, and the next attempt waits
/// for the backoff instead of following every request.
#[tokio::test]
async fn hub_downloads_time_out_and_back_off() {
    let hub = SilentHub::start();
    let hf_home = tempfile::tempdir().unwrap();
    let zmq = format!("tcp://127.0.0.1:{}", free_port());
    let service = Service::start_with_env(
        &["--zmq-bind", &zmq, "--hub-timeout", "1s"],
        Some(zmq.clone()),
        &hub.env(hf_home.path()),
    )
    .await;
    let mut publisher = Publisher::connect(&zmq).await;
    publisher.wait_subscribed(&service, "marker").await;
    let mut client = service.client().await;
    for attempt in 0..3 {
        let status = client
            .score(within(
                prompt(WARMUP_MODEL, "Hello"),
                crate::common::budget(30),
            ))
            .await
            .expect_err("no tokenizer to be had");
        assert_eq!(status.code(), Code::NotFound, "{attempt}: {status:?}");
        assert!(status.message().contains("Hub download"), "{status:?}");
    }
    assert_eq!(
        hub.connections.load(Ordering::SeqCst),
        1,
        "retried only after a backoff"
    );
    assert_eq!(tokenizer_states(&service), (0, 0, 1));
    service.wait_log("tokenizer unavailable").await;
}

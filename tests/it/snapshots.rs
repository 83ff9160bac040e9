//! Snapshots: the index survives a restart; a corrupt snapshot is ignored.

use crate::common::*;

/// Bind mode, no replay endpoints: only the snapshot carries the first half
/// of the stream across the restart.
#[tokio::test]
async fn a_restart_from_a_snapshot_continues_exactly() {
    let stream = "qwen3-sha256-int";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let half = frames.len() / 2;
    let dir = tempfile::tempdir().unwrap();
    let snap_dir = dir.path().to_str().unwrap();

    let first = Service::start(&["--snapshot-dir", snap_dir]).await;
    let mut publisher = Publisher::connect(first.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&first, "marker").await;
    publisher.publish_all(&frames[..half]).await;
    first
        .wait_applied(&expected.model, &batches_per_pod(&frames[..half]))
        .await;
    let status = first.terminate().await;
    assert!(status.success(), "{status:?}");
    assert!(dir.path().join("kv-indexer.snapshot").is_file());
    drop(publisher);

    let second = Service::start(&["--snapshot-dir", snap_dir]).await;
    // Restored before it reported ready.
    let restored = second.list_pods(&expected.model).await;
    assert_eq!(restored.len(), expected.pods.len());
    assert!(restored.iter().any(|p| p.gpu_blocks > 0));
    let mut publisher = Publisher::connect(second.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&second, "marker").await;
    publisher.publish_all(&frames[half..]).await;
    // Restored pods count no batches; the second half is what arrives.
    second
        .wait_applied(&expected.model, &batches_per_pod(&frames[half..]))
        .await;
    check_probes(&second, &expected).await;
    for pod in second.list_pods(&expected.model).await {
        assert_eq!(pod.seq_gaps, 0, "seq continued from the snapshot: {pod:?}");
        assert_eq!(pod.publisher_restarts, 0, "{pod:?}");
    }
    let (_, m) = second.http_get("/metrics");
    assert!(m.contains("kv_indexer_snapshot_age_seconds "), "{m}");
    assert!(!m.contains("kv_indexer_snapshot_age_seconds -1"), "{m}");
}

#[tokio::test]
async fn corrupt_snapshots_are_reported_and_ignored() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("kv-indexer.snapshot"),
        b"KVIXSNAP garbage garbage",
    )
    .unwrap();
    let service = Service::start(&["--snapshot-dir", dir.path().to_str().unwrap()]).await;
    assert!(service.list_pods("").await.is_empty());
    assert!(
        service.logs().contains("snapshot ignored"),
        "{}",
        service.logs()
    );
}

#[tokio::test]
async fn snapshots_are_written_periodically() {
    let dir = tempfile::tempdir().unwrap();
    let service = Service::start(&[
        "--snapshot-dir",
        dir.path().to_str().unwrap(),
        "--snapshot-interval",
        "200ms",
    ])
    .await;
    let file = dir.path().join("kv-indexer.snapshot");
    for _ in 0..100 {
        if file.is_file() {
            let bytes = std::fs::read(&file).unwrap();
            assert!(indexer::snapshot::SnapshotReader::open(std::io::Cursor::new(bytes)).is_ok());
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("no snapshot written; logs:\n{}", service.logs());
}

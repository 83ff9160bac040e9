//! Supervised ingest: a panic while applying one pod's batch costs that pod
//! its state, never the worker or the other pods it serves. The panic is
//! injected (debug builds only) through `KV_INDEXER_TEST_PANIC_POD`.

use crate::common::*;
use bytes::Bytes;

#[tokio::test]
async fn a_panic_applying_one_pods_batch_resets_that_pod_only() {
    let zmq = format!("tcp://127.0.0.1:{}", free_port());
    // One worker: the faulty pod and the good one share it.
    let service = Service::start_with_env(
        &["--zmq-bind", &zmq, "--ingest-workers", "1"],
        Some(zmq.clone()),
        &[("KV_INDEXER_TEST_PANIC_POD", "faulty".into())],
    )
    .await;
    let mut publisher = Publisher::connect(&zmq).await;
    publisher.wait_subscribed(&service, "marker").await;
    for seq in 0..3u64 {
        for pod in ["faulty", "good"] {
            publisher
                .send(zmq_message(vec![
                    Bytes::from(format!("kv@{pod}@m")),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(one_block_store(seq + 1)),
                ]))
                .await;
        }
    }
    service
        .wait_metric("kv_indexer_ingest_panics_total", |n| n >= 3.0)
        .await;
    service
        .wait_until("the good pod applied all", async || {
            service
                .list_pods("m")
                .await
                .iter()
                .any(|p| p.pod == "good" && p.batches == 3)
        })
        .await;
    let pods = service.list_pods("m").await;
    let faulty = pods
        .iter()
        .find(|p| p.pod == "faulty")
        .expect("faulty listed");
    assert!(faulty.incomplete, "{faulty:?}");
    assert_eq!(faulty.gpu_blocks, 0, "{faulty:?}");
    let good = pods.iter().find(|p| p.pod == "good").unwrap();
    assert!(!good.incomplete && good.gpu_blocks == 3, "{good:?}");
    // The worker is alive: ready, and still applying.
    assert_eq!(service.http_get("/readyz").0, 200);
    assert!(service.logs().contains("applying a batch panicked"));
}

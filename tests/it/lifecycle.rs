//! A pod's life in bind mode (pods connect to us): a pod whose connection
//! closed and that stays silent for --pod-expiry is forgotten; a pod that is
//! connected but quiet is kept (an idle vLLM still holds its cache). Dial
//! mode's counterpart (a target discovery stops listing) is in
//! `discovery.rs`.

use std::collections::BTreeSet;

use crate::common::*;

async fn listed(service: &Service) -> BTreeSet<String> {
    service
        .list_pods(WARMUP_MODEL)
        .await
        .into_iter()
        .map(|p| p.pod)
        .collect()
}

/// A Kubernetes rollout: the old pods publish, then close their
/// connections for good; new pods connect and publish. The old names used
/// to stay in `ListPods` and `Score` forever, with their blocks, one more
/// set per rollout.
#[tokio::test]
async fn a_bind_mode_rollout_ends_with_only_the_live_pods() {
    let service = Service::start(&["--pod-expiry", "1s"]).await;
    let endpoint = service.zmq_bind.clone().unwrap();
    // Connected, publishes once, then quiet for the rest of the test.
    let mut idle = Publisher::connect(&endpoint).await;
    idle.wait_subscribed(&service, "idle").await;
    let mut old = Vec::new();
    for i in 0..3 {
        let mut p = Publisher::connect(&endpoint).await;
        p.wait_subscribed(&service, &format!("old-{i}")).await;
        old.push(p);
    }
    assert_eq!(listed(&service).await.len(), 4);
    // The rollout: old pods go, new ones come.
    drop(old);
    let mut new = Vec::new();
    for i in 0..3 {
        let mut p = Publisher::connect(&endpoint).await;
        p.wait_subscribed(&service, &format!("new-{i}")).await;
        new.push(p);
    }
    let live: BTreeSet<String> = ["idle", "new-0", "new-1", "new-2"].map(String::from).into();
    service
        .wait_until("only the live pods listed", async || {
            listed(&service).await == live
        })
        .await;
    // Well past the expiry: the idle pod is still connected, so kept.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let pods = service.list_pods(WARMUP_MODEL).await;
    let names: BTreeSet<String> = pods.iter().map(|p| p.pod.clone()).collect();
    assert_eq!(names, live);
    let idle_info = pods.iter().find(|p| p.pod == "idle").unwrap();
    assert_eq!(idle_info.connection, "connected", "{idle_info:?}");
    assert!(
        idle_info.last_event_age_seconds.unwrap() >= 2.0,
        "{idle_info:?}"
    );
    drop(idle);
}

/// A pod that reconnects (its connection dropped, vLLM kept running)
/// within --pod-expiry keeps its blocks.
#[tokio::test]
async fn a_pod_that_reconnects_in_time_is_kept() {
    let service = Service::start(&["--pod-expiry", "3s"]).await;
    let endpoint = service.zmq_bind.clone().unwrap();
    let mut first = Publisher::connect(&endpoint).await;
    first.wait_subscribed(&service, "flaky").await;
    drop(first);
    service
        .wait_until("the disconnect seen", async || {
            service
                .list_pods(WARMUP_MODEL)
                .await
                .iter()
                .any(|p| p.pod == "flaky" && p.connection == "disconnected")
        })
        .await;
    let mut again = Publisher::connect(&endpoint).await;
    // Markers until the new connection's arrive (PUB drops them until the
    // subscription is through).
    let deadline = std::time::Instant::now() + crate::common::budget(20);
    loop {
        again.reaches(&service, "flaky").await;
        let pods = service.list_pods(WARMUP_MODEL).await;
        if pods
            .iter()
            .any(|p| p.pod == "flaky" && p.connection == "connected")
        {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never reconnected");
    }
    // Past the expiry of the first connection: kept, connected.
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    let pods = service.list_pods(WARMUP_MODEL).await;
    let flaky = pods.iter().find(|p| p.pod == "flaky").expect("kept");
    assert_eq!(flaky.connection, "connected", "{flaky:?}");
}

/// A rolling restart of a pod that keeps its name (a StatefulSet's): the
/// new engine connects and publishes its run from seq 0 before the old
/// connection's close is seen. The restart is seen by its seq, the old
/// connection closing afterwards neither disconnects nor expires the pod,
/// and its answers are the new run's. The pods beside it stay exact.
#[tokio::test]
async fn a_pod_restarted_under_its_name_before_its_old_connection_closes_is_its_new_run() {
    let stream = "qwen3-sha256-int";
    let expected = load_expected(stream);
    let frames = load_frames(stream);
    let service = Service::start(&["--pod-expiry", "1s"]).await;
    let endpoint = service.zmq_bind.clone().unwrap();
    // pod-0 and pod-2 on connections that stay; pod-1's engine on its own.
    let mut steady = Publisher::connect(&endpoint).await;
    steady.wait_subscribed(&service, "steady").await;
    steady
        .publish_all(frames.iter().filter(|f| f.pod() != "pod-1"))
        .await;
    let mut old = Publisher::connect(&endpoint).await;
    old.wait_subscribed(&service, "old").await;
    old.publish_all(frames.iter().filter(|f| f.pod() == "pod-1"))
        .await;
    service
        .wait_applied(&expected.model, &batches_per_pod(&frames))
        .await;
    // pod-1's new run: pod-0's recorded batches under pod-1's topic.
    let topic = frames
        .iter()
        .find(|f| f.pod() == "pod-1")
        .unwrap()
        .topic
        .clone();
    let new_run: Vec<RecordedFrame> = frames
        .iter()
        .filter(|f| f.pod() == "pod-0")
        .map(|f| RecordedFrame {
            topic: topic.clone(),
            ..f.clone()
        })
        .collect();
    let mut new = Publisher::connect(&endpoint).await;
    new.wait_subscribed(&service, "new").await;
    new.publish_all(&new_run).await;
    let last = new_run.last().map(|f| f.seq);
    service
        .wait_until("pod-1's new run applied", async || {
            service
                .list_pods(&expected.model)
                .await
                .iter()
                .any(|p| p.pod == "pod-1" && p.last_seq == last && p.publisher_restarts == 1)
        })
        .await;
    // The old engine's connection closes; well past --pod-expiry.
    drop(old);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let pods = service.list_pods(&expected.model).await;
    let restarted = pods.iter().find(|p| p.pod == "pod-1").expect("pod-1 kept");
    assert_eq!(restarted.connection, "connected", "{restarted:?}");
    assert_answers_as(&service, &expected, "pod-1", "pod-0").await;
    for pod in ["pod-0", "pod-2"] {
        assert_answers_as(&service, &expected, pod, pod).await;
    }
    drop((new, steady));
}

//! Gaps and late starts repaired through vLLM's replay protocol, against a
//! libzmq stand-in for vLLM's publisher: PUB for live batches, ROUTER
//! answering replay requests from its buffer (`tests/it/common/vllm_pod.rs`),
//! publishing the recorded streams' real payloads.

use std::collections::{BTreeMap, HashSet};

use crate::common::vllm_pod::{Fleet, PodOptions, VllmPod};
use crate::common::*;

/// `new_name`'s recorded batches under `old`'s topic: a new run for
/// `old`'s engine after a restart.
fn new_run_for(stream: &str, old: &VllmPod, new_name: &str) -> Vec<crate::common::vllm_pod::Batch> {
    let topic = old.frames()[0].0.clone();
    VllmPod::start(stream, new_name, PodOptions::default())
        .frames()
        .iter()
        .map(|(_, seq, payload)| (topic.clone(), *seq, payload.clone()))
        .collect()
}

/// Waits until `pod` applied the new run up to `last_seq`, as its one
/// restart.
async fn wait_restarted(service: &Service, model: &str, pod: &str, last_seq: Option<u64>) {
    service
        .wait_until("the new run applied, as a restart", async || {
            service
                .list_pods(model)
                .await
                .iter()
                .any(|p| p.pod == pod && p.last_seq == last_seq && p.publisher_restarts == 1)
        })
        .await;
}

/// Every batch of the fleet applied, every probe exact, every pod complete,
/// and some of it through replay.
async fn assert_repaired(service: &Service, fleet: &Fleet) {
    service
        .wait_applied(&fleet.expected.model, &fleet.per_pod)
        .await;
    check_probes(service, &fleet.expected).await;
    for pod in service.list_pods(&fleet.expected.model).await {
        assert!(!pod.incomplete, "{pod:?}");
        assert_eq!(pod.unrecovered_batches, 0, "{pod:?}");
    }
    let (_, m) = service.http_get("/metrics");
    assert!(!m.contains("kv_indexer_replays_requested_total 0\n"), "{m}");
}

/// Every 5th batch of each pod never arrives live (PUB dropped it); each
/// gap is noticed on the next batch and filled from the replay socket.
#[tokio::test]
async fn dropped_batches_are_replayed_and_the_state_is_exact() {
    // One pod answers in the older two-frame replay form.
    let fleet = Fleet::start("qwen3-sha256-int", |i| PodOptions {
        old_format: i == 2,
        ..Default::default()
    });
    let service = Service::start_dialing(&fleet.targets(), &[]).await;
    fleet.wait_subscribed(&service, "m").await;
    let Fleet {
        expected,
        per_pod,
        pubs,
    } = &fleet;
    for (pod, p) in pubs {
        let n = per_pod[pod.as_str()];
        // Drop every 5th seq live, but never the last one (a gap shows on
        // the next batch).
        let skip: HashSet<u64> = (1..n - 1).filter(|s| s % 5 == 0).collect();
        p.publish(0, n as usize, &skip);
    }
    service.wait_applied(&expected.model, per_pod).await;
    check_probes(&service, expected).await;
    for pod in service.list_pods(&expected.model).await {
        assert!(!pod.incomplete, "{pod:?}");
        assert_eq!(pod.seq_gaps, 0, "applied in order after repair: {pod:?}");
    }
    let (_, m) = service.http_get("/metrics");
    assert!(!m.contains("kv_indexer_replays_requested_total 0\n"), "{m}");
}

/// The indexer starts after the pods published half their batches: their
/// first live batch (seq > 0) triggers a catch-up from seq 0.
#[tokio::test]
async fn an_indexer_that_starts_late_catches_up_from_the_replay_buffers() {
    let fleet = Fleet::start("qwen3-sha256cbor-bytes", |_| PodOptions::default());
    // Before any indexer exists: published into the void (and the buffer).
    fleet.publish(|n| (0, n / 2));
    let service = Service::start_dialing(&fleet.targets(), &[]).await;
    fleet.wait_subscribed(&service, "m").await;
    fleet.publish(|n| (n / 2, n));
    service
        .wait_applied(&fleet.expected.model, &fleet.per_pod)
        .await;
    check_probes(&service, &fleet.expected).await;
    assert!(service
        .list_pods(&fleet.expected.model)
        .await
        .iter()
        .all(|p| !p.incomplete && p.unrecovered_batches == 0));
}

/// A gap longer than the pod's replay buffer cannot be filled: the pod is
/// flagged incomplete (ListPods, Score) and, with --incomplete-pods drop,
/// gets no credit.
#[tokio::test]
async fn a_gap_beyond_the_replay_buffer_marks_the_pod_incomplete() {
    let stream = "qwen3-lora-salt";
    let expected = load_expected(stream);
    let p = VllmPod::start(
        stream,
        "pod-1",
        PodOptions {
            buffer: 1,
            ..Default::default()
        },
    );
    let service = Service::start_dialing(
        std::slice::from_ref(&p.target),
        &["--incomplete-pods", "drop"],
    )
    .await;
    p.wait_subscribed(&service, "m").await;
    // seqs 1 and 2 lost live; only seq 3 is still buffered by then.
    p.publish(0, 4, &HashSet::from([1, 2]));
    let mut info = None;
    for _ in 0..200 {
        let pods = service.list_pods(&expected.model).await;
        if let Some(pod) = pods
            .into_iter()
            // The flag is set just after the last batch is applied.
            .find(|p| p.pod == "pod-1" && p.batches == 2 && p.incomplete)
        {
            info = Some(pod);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let info = info.expect("pod-1 applied its batches");
    assert!(info.incomplete, "{info:?}");
    assert_eq!(info.unrecovered_batches, 2, "{info:?}");
    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "plain:same")
        .unwrap();
    let resp = service
        .client()
        .await
        .score(token_request(&expected.model, probe))
        .await
        .unwrap()
        .into_inner();
    let pod1 = resp.pods.iter().find(|p| p.pod == "pod-1").unwrap();
    assert!(pod1.incomplete);
    assert_eq!(pod1.matched_blocks, 0, "dropped while incomplete");
}

/// Every other batch lost for good (a replay buffer of one batch): each
/// gap is counted and flagged, but the warning is rate limited, so a lossy
/// link or an overloaded indexer cannot write a log line per lost batch.
#[tokio::test]
async fn gaps_lost_for_good_are_each_counted_but_warned_of_at_a_bounded_rate() {
    let p = VllmPod::start(
        "qwen3-sha256-int",
        "pod-1",
        PodOptions {
            buffer: 1,
            ..Default::default()
        },
    );
    let service = Service::start_dialing(std::slice::from_ref(&p.target), &[]).await;
    p.wait_subscribed(&service, "m").await;
    let n = p.batches();
    // Odd seqs lost live, never the last (a gap shows on the next batch).
    let skip: HashSet<u64> = (0..n as u64 - 1).filter(|s| s % 2 == 1).collect();
    assert!(skip.len() >= 100, "{}", skip.len());
    // Paced, so that most gaps are seen (and given up on) one at a time,
    // as on a link that loses a batch now and then.
    for i in 0..n {
        p.publish(i, i + 1, &skip);
        tokio::time::sleep(std::time::Duration::from_millis(3)).await;
    }
    let mut info = None;
    for _ in 0..400 {
        let pods = service
            .list_pods(&load_expected("qwen3-sha256-int").model)
            .await;
        if let Some(pod) = pods
            .into_iter()
            .find(|p| p.pod == "pod-1" && p.last_seq == Some(n as u64 - 1))
        {
            info = Some(pod);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let info = info.expect("the last batch applied");
    assert!(info.incomplete, "{info:?}");
    // Under load some gaps merge (a later loss seen before the repair of
    // an earlier one ends): most still come one by one.
    assert!(info.seq_gaps >= 10, "the gaps came one by one: {info:?}");
    assert!(
        info.unrecovered_batches >= info.seq_gaps,
        "every gap lost a batch at least: {info:?}"
    );
    let warned = service.logs().matches("batches lost for good").count();
    assert!(
        (1..=3).contains(&warned),
        "{warned} warnings for {} lost batches",
        skip.len()
    );
}

/// The indexer is killed (-9) mid-stream and started again while the pods
/// keep publishing: the new process catches up from the pods' replay
/// buffers and ends with the exact state.
#[tokio::test]
async fn an_indexer_killed_mid_stream_recovers_the_exact_state_on_restart() {
    let fleet = Fleet::start("qwen3-sha256-int", |_| PodOptions::default());
    let first = Service::start_dialing(&fleet.targets(), &[]).await;
    fleet.wait_subscribed(&first, "m1").await;
    fleet.publish(|n| (0, n / 3));
    first.kill9();
    // Published while no indexer runs.
    fleet.publish(|n| (n / 3, 2 * n / 3));
    let second = Service::start_dialing(&fleet.targets(), &[]).await;
    fleet.wait_subscribed(&second, "m2").await;
    fleet.publish(|n| (2 * n / 3, n));
    second
        .wait_applied(&fleet.expected.model, &fleet.per_pod)
        .await;
    check_probes(&second, &fleet.expected).await;
}

/// Pods that published before the indexer started and then stay idle: the
/// indexer asks each for its replay buffer as soon as it connects.
#[tokio::test]
async fn idle_pods_are_caught_up_as_soon_as_the_indexer_connects() {
    let fleet = Fleet::start("qwen3-sha256cbor-bytes", |_| PodOptions::default());
    fleet.publish(|n| (0, n));
    let service = Service::start_dialing(&fleet.targets(), &[]).await;
    // No live event batch is ever published from here on.
    service
        .wait_applied(&fleet.expected.model, &fleet.per_pod)
        .await;
    check_probes(&service, &fleet.expected).await;
    service.wait_log("caught up from the replay buffer").await;
}

/// Snapshot + replay: after a graceful restart, each pod is replayed only
/// from its snapshot seq on; the state is exact.
#[tokio::test]
async fn a_snapshot_restart_replays_only_what_came_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().to_str().unwrap();
    let fleet = Fleet::start("qwen3-sha256-int", |_| PodOptions::default());
    let targets = fleet.targets();
    let first = Service::start_dialing(&targets, &["--snapshot-dir", snap]).await;
    fleet.wait_subscribed(&first, "m1").await;
    fleet.publish(|n| (0, n / 3));
    let (model, per_pod) = (fleet.expected.model.clone(), fleet.per_pod.clone());
    let third: std::collections::BTreeMap<String, u64> =
        per_pod.iter().map(|(p, n)| (p.clone(), n / 3)).collect();
    first.wait_applied(&model, &third).await;
    assert!(first.terminate().await.success());
    let while_down: u64 = per_pod.values().map(|n| 2 * n / 3 - n / 3).sum();
    fleet.publish(|n| (n / 3, 2 * n / 3));
    let second = Service::start_dialing(&targets, &["--snapshot-dir", snap]).await;
    let caught_up: std::collections::BTreeMap<String, u64> = per_pod
        .iter()
        .map(|(p, n)| (p.clone(), 2 * n / 3 - n / 3))
        .collect();
    second.wait_applied(&model, &caught_up).await;
    // The counter is bumped just after the replayed batches are applied.
    let want = format!("kv_indexer_replay_batches_total {while_down}\n");
    let deadline = std::time::Instant::now() + crate::common::budget(20);
    let m = loop {
        let (_, m) = second.http_get("/metrics");
        if m.contains(&want) || std::time::Instant::now() > deadline {
            break m;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(
        m.contains(&want),
        "replayed exactly what came after the snapshot ({while_down}):\n{m}"
    );
    fleet.wait_subscribed(&second, "m2").await;
    fleet.publish(|n| (2 * n / 3, n));
    let rest: std::collections::BTreeMap<String, u64> = per_pod
        .iter()
        .map(|(p, n)| (p.clone(), n - n / 3))
        .collect();
    second.wait_applied(&fleet.expected.model, &rest).await;
    check_probes(&second, &fleet.expected).await;
}

/// The bug the stream state machine was written for, over real sockets:
/// the indexer caught up a pod's whole buffer (seqs 0..N), then the pod's
/// engine restarted on the same endpoints and published a new run from
/// seq 0 with other blocks. The new run's batches used to be dropped as
/// "already applied" (their seqs were at or below N): the old blocks kept
/// scoring and the new ones scored 0. Now the new run replaces the old.
#[tokio::test]
async fn a_pod_restarted_right_after_a_catch_up_ends_with_only_its_new_blocks() {
    let stream = "qwen3-sha256-int";
    let expected = load_expected(stream);
    let (old_name, new_name) = (&expected.pods[1], &expected.pods[0]);
    let old = VllmPod::start(stream, old_name, PodOptions::default());
    // The new run: another pod's recorded batches, under this pod's topic.
    let new_run = new_run_for(stream, &old, new_name);
    assert!(
        new_run.len() < old.batches(),
        "the new run's seqs all lie within what was caught up"
    );
    // Published before the indexer exists: only the buffer has them.
    old.publish(0, old.batches(), &HashSet::new());
    let service = Service::start_dialing(std::slice::from_ref(&old.target), &[]).await;
    let caught_up = BTreeMap::from([(old_name.clone(), old.batches() as u64)]);
    service.wait_applied(&expected.model, &caught_up).await;

    let restarted = old.restart(new_run.clone(), PodOptions::default());
    restarted.wait_subscribed(&service, "after-restart").await;
    restarted.publish(0, new_run.len(), &HashSet::new());
    let last_seq = new_run.last().map(|b| b.1);
    wait_restarted(&service, &expected.model, old_name, last_seq).await;
    // Every probe: the restarted pod now answers what the new run's pod did.
    assert_answers_as(&service, &expected, old_name, new_name).await;
}

/// A pod whose engine restarted while the indexer was down, and whose new
/// run had passed the snapshot's seq by the time the indexer came back:
/// the seq alone says "continue after the snapshot", so the old blocks
/// were kept, and the new run's first batches never applied. The
/// snapshot's last batch, still in the pod's buffer or not, tells: its
/// fingerprint differs from the new run's batch under that seq.
#[tokio::test]
async fn a_pod_restarted_while_the_indexer_was_down_ends_with_only_its_new_blocks() {
    let stream = "qwen3-sha256-int";
    let expected = load_expected(stream);
    let (old_name, new_name) = (&expected.pods[1], &expected.pods[0]);
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().to_str().unwrap();
    let old = VllmPod::start(stream, old_name, PodOptions::default());
    let new_run = new_run_for(stream, &old, new_name);
    // The old run's first batches, snapshotted; the new run goes past them.
    let before = (new_run.len() / 2).min(old.batches());
    assert!(before > 0 && new_run.len() > before);
    old.publish(0, before, &HashSet::new());
    let first =
        Service::start_dialing(std::slice::from_ref(&old.target), &["--snapshot-dir", snap]).await;
    let applied = BTreeMap::from([(old_name.clone(), before as u64)]);
    first.wait_applied(&expected.model, &applied).await;
    assert!(first.terminate().await.success());

    let restarted = old.restart(new_run.clone(), PodOptions::default());
    restarted.publish(0, new_run.len(), &HashSet::new());
    let second = Service::start_dialing(
        std::slice::from_ref(&restarted.target),
        &["--snapshot-dir", snap],
    )
    .await;
    let last_seq = new_run.last().map(|b| b.1);
    wait_restarted(&second, &expected.model, old_name, last_seq).await;
    assert_answers_as(&second, &expected, old_name, new_name).await;
}

/// Overload, then repair: the service's ingest queue holds one message,
/// so a burst of the pods' batches is mostly dropped there (counted). Each
/// drop is a gap, fetched from the pod's replay buffer at once: also the
/// burst's last batches, which no later batch would show missing (the
/// pods go quiet). At the end every pod is exact, complete, nothing lost.
#[tokio::test]
async fn batches_dropped_by_a_full_ingest_queue_are_repaired_from_the_replay_buffers() {
    let fleet = Fleet::start("qwen3-sha256-int", |_| PodOptions::default());
    let service = Service::start_dialing(
        &fleet.targets(),
        &["--ingest-workers", "1", "--ingest-queue", "1"],
    )
    .await;
    fleet.wait_subscribed(&service, "m").await;
    // Each pod's stream exists (a pod none of whose batches got through
    // is caught up by its next one), then the burst.
    let mut first = BTreeMap::new();
    for (pod, p) in &fleet.pubs {
        p.publish(0, 1, &HashSet::new());
        first.insert(pod.clone(), 1);
        service.wait_applied(&fleet.expected.model, &first).await;
    }
    fleet.publish(|n| (1, n));
    service
        .wait_metric("kv_indexer_messages_dropped_total", |v| v > 0.0)
        .await;
    assert_repaired(&service, &fleet).await;
}

/// A crash (-9) some time after a periodic snapshot: the restored state is
/// older than what was applied, and the pods went on publishing. Each pod
/// is caught up from the snapshot's seq; the batch under that seq is still
/// the same in its buffer, so nothing is taken for a restart; the state is
/// exact.
#[tokio::test]
async fn a_crash_after_a_periodic_snapshot_recovers_exactly_without_false_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().to_str().unwrap();
    let fleet = Fleet::start("qwen3-sha256-int", |_| PodOptions::default());
    let args = ["--snapshot-dir", snap, "--snapshot-interval", "300ms"];
    let first = Service::start_dialing(&fleet.targets(), &args).await;
    fleet.wait_subscribed(&first, "m1").await;
    let model = fleet.expected.model.clone();
    let third: BTreeMap<String, u64> = fleet
        .per_pod
        .iter()
        .map(|(p, n)| (p.clone(), n / 3))
        .collect();
    fleet.publish(|n| (0, n / 3));
    first.wait_applied(&model, &third).await;
    first
        .wait_metric("kv_indexer_snapshot_age_seconds", |age| {
            (0.0..0.2).contains(&age)
        })
        .await;
    fleet.publish(|n| (n / 3, 2 * n / 3));
    first.kill9();
    fleet.publish(|n| (2 * n / 3, n));
    let second = Service::start_dialing(&fleet.targets(), &args).await;
    second
        .wait_until("every pod caught up", async || {
            let pods = second.list_pods(&model).await;
            fleet.per_pod.iter().all(|(name, n)| {
                pods.iter()
                    .any(|p| &p.pod == name && p.last_seq == Some(n - 1))
            })
        })
        .await;
    check_probes(&second, &fleet.expected).await;
    for pod in second.list_pods(&model).await {
        assert_eq!(pod.publisher_restarts, 0, "{pod:?}");
        assert!(!pod.incomplete, "{pod:?}");
    }
}

/// Bind mode with replay: the pods connect to us, and each one's replay
/// (ROUTER) endpoint is configured (`--replay-endpoint POD=...`). Every
/// 5th batch is lost on the way; each gap is filled from the pod's
/// buffer, and the state is exact. (Every other replay test dials.)
#[tokio::test]
async fn in_bind_mode_gaps_are_repaired_from_the_configured_replay_endpoints() {
    let stream = "qwen3-sha256-int";
    let fleet = Fleet::start(stream, |_| PodOptions::default());
    let replay_args: Vec<String> = fleet
        .pubs
        .iter()
        .map(|(pod, p)| {
            let replay = p.target.split("replay=").nth(1).expect("a replay endpoint");
            format!("{pod}={replay}")
        })
        .collect();
    let mut args: Vec<&str> = Vec::new();
    for a in &replay_args {
        args.extend(["--replay-endpoint", a.as_str()]);
    }
    let service = Service::start(&args).await;
    let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(&service, "marker").await;
    let frames = load_frames(stream);
    for (pod, p) in &fleet.pubs {
        // Into the pod's buffer (its own PUB has no subscriber here).
        p.publish(0, p.batches(), &HashSet::new());
        let n = fleet.per_pod[pod.as_str()];
        // Live to us, every 5th lost but never the last.
        for f in frames.iter().filter(|f| f.pod() == pod.as_str()) {
            if f.seq % 5 == 0 && f.seq > 0 && f.seq + 1 < n {
                continue;
            }
            publisher.send(f.message()).await;
        }
    }
    assert_repaired(&service, &fleet).await;
}

/// The reverse order of a restart right after a catch-up: the pod's engine
/// restarts, and batches of its new run are lost on the way (among them
/// the new run's first, so the restart itself shows only in the buffer).
/// The gaps are repaired from the new run's buffer, and the pod ends with
/// only the new run's blocks.
#[tokio::test]
async fn a_restart_whose_new_run_loses_batches_is_repaired_from_the_new_buffer() {
    let stream = "qwen3-sha256-int";
    let expected = load_expected(stream);
    let (old_name, new_name) = (&expected.pods[1], &expected.pods[0]);
    let old = VllmPod::start(stream, old_name, PodOptions::default());
    let new_run = new_run_for(stream, &old, new_name);
    let service = Service::start_dialing(std::slice::from_ref(&old.target), &[]).await;
    old.wait_subscribed(&service, "before").await;
    old.publish(0, old.batches(), &HashSet::new());
    let all_old = BTreeMap::from([(old_name.clone(), old.batches() as u64)]);
    service.wait_applied(&expected.model, &all_old).await;

    let restarted = old.restart(new_run.clone(), PodOptions::default());
    restarted.wait_subscribed(&service, "after").await;
    let lost: HashSet<u64> = [0, 1, 7, 20].into_iter().collect();
    restarted.publish(0, new_run.len(), &lost);
    let last_seq = new_run.last().map(|b| b.1);
    wait_restarted(&service, &expected.model, old_name, last_seq).await;
    let pod = service
        .list_pods(&expected.model)
        .await
        .into_iter()
        .find(|p| &p.pod == old_name)
        .unwrap();
    assert!(!pod.incomplete && pod.unrecovered_batches == 0, "{pod:?}");
    assert_answers_as(&service, &expected, old_name, new_name).await;
}

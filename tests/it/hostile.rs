//! Whatever reaches the event port or the HTTP port, the service keeps
//! answering, within bounded memory, and counts what it refused. Each test
//! is an attack that crashed, froze or grew the service before these
//! bounds existed.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::common::*;
use bytes::Bytes;
use kv_indexer::proto::kvindexer::v1 as pb;

const BLOCK: u32 = 16;

fn tokens(blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| 1000 + i).collect()
}

/// vLLM's map-form batch storing `blocks` blocks of [`tokens`].
fn store_batch(blocks: u32) -> Vec<u8> {
    let event = Stored {
        ty: "BlockStored",
        block_hashes: (1..=u64::from(blocks)).collect(),
        parent_block_hash: None,
        token_ids: tokens(blocks),
        block_size: BLOCK,
        medium: "GPU",
    };
    rmp_serde::to_vec_named(&(0.0f64, vec![event], 0u32)).expect("encode")
}

fn message(topic: &[u8], seq: u64, payload: &[u8]) -> ZmqMessage {
    zmq_message(vec![
        Bytes::copy_from_slice(topic),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::copy_from_slice(payload),
    ])
}

fn zmq_port(service: &Service) -> u16 {
    let endpoint = service.zmq_bind.as_deref().expect("bind mode");
    endpoint.rsplit(':').next().unwrap().parse().unwrap()
}

/// A publisher that is subscribed and reaches the service.
async fn subscribed(service: &Service) -> Publisher {
    let mut publisher = Publisher::connect(service.zmq_bind.as_deref().unwrap()).await;
    publisher.wait_subscribed(service, "marker").await;
    publisher
}

/// The service still answers: a good pod's events are applied and scored.
async fn still_serves(service: &Service, pod: &str) {
    let mut publisher = subscribed(service).await;
    publisher
        .send(message(
            format!("kv@{pod}@good").as_bytes(),
            0,
            &store_batch(4),
        ))
        .await;
    let mut want = std::collections::BTreeMap::new();
    want.insert(pod.to_owned(), 1);
    service.wait_applied("good", &want).await;
    let resp = service
        .client()
        .await
        .score(pb::ScoreRequest {
            model: "good".into(),
            input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                ids: tokens(4),
            })),
            ..Default::default()
        })
        .await
        .expect("Score")
        .into_inner();
    assert_eq!(resp.pods[0].matched_blocks, 4, "{resp:?}");
}

/// ZMTP 3.0's 64-byte greeting, NULL mechanism, as a client.
fn zmtp_greeting() -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0];
    let mut mechanism = b"NULL".to_vec();
    mechanism.resize(20, 0);
    g.extend_from_slice(&mechanism);
    g.push(0); // as-server
    g.resize(64, 0);
    g
}

/// The NULL mechanism's READY command from a PUB socket.
fn zmtp_ready() -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut cmd = vec![0x04, body.len() as u8];
    cmd.extend_from_slice(&body);
    cmd
}

/// A long frame header (flags 0x02) declaring `size` bytes, no bytes after.
fn frame_header(size: u64) -> Vec<u8> {
    let mut h = vec![0x02];
    h.extend_from_slice(&size.to_be_bytes());
    h
}

/// Waits until the peer closes `stream` (read returns 0 or an error).
fn closed_by_peer(stream: &mut TcpStream, within: Duration) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

#[tokio::test]
async fn a_frame_declaring_a_terabyte_drops_that_connection_not_the_process() {
    let mut service = Service::start(&[]).await;
    let port = zmq_port(&service);
    // 73 bytes, no handshake: the greeting, then a frame of 2^40 bytes.
    let mut raw = TcpStream::connect(("127.0.0.1", port)).unwrap();
    raw.write_all(&zmtp_greeting()).unwrap();
    raw.write_all(&frame_header(1 << 40)).unwrap();
    // The same after a complete handshake, as a message frame.
    let mut shaken = TcpStream::connect(("127.0.0.1", port)).unwrap();
    shaken.write_all(&zmtp_greeting()).unwrap();
    shaken.write_all(&zmtp_ready()).unwrap();
    shaken.write_all(&frame_header(1 << 40)).unwrap();
    assert!(closed_by_peer(&mut raw, crate::common::budget(10)));
    assert!(closed_by_peer(&mut shaken, crate::common::budget(10)));
    assert!(service.is_running(), "the process died");
    still_serves(&service, "after-terabyte").await;
    let peak = service.peak_rss_kib();
    assert!(peak < 200 * 1024, "peak RSS {peak} KiB");
    assert!(service.metric("kv_indexer_zmq_disconnects_total") >= 1.0);
}

#[tokio::test]
async fn messages_over_the_event_limit_are_refused_without_holding_memory() {
    let mut service = Service::start(&[]).await;
    // Subscribed first: PUB drops everything until then.
    let publisher = subscribed(&service).await;
    let big = Bytes::from(vec![7u8; 200 << 20]);
    for seq in 0..8u64 {
        publisher
            .socket
            .send(&[
                Bytes::from_static(b"kv@big@m"),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                big.clone(),
            ])
            .expect("send");
    }
    // Until libzmq refused the first one (or the process took it in).
    let deadline = Instant::now() + crate::common::budget(30);
    while service.metric("kv_indexer_zmq_disconnects_total") < 1.0
        && service.peak_rss_kib() < 200 * 1024
    {
        assert!(
            Instant::now() < deadline,
            "nothing happened to the big messages"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Time for what the publisher still had queued.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let peak = service.peak_rss_kib();
    assert!(
        peak < 200 * 1024,
        "peak RSS {peak} KiB: a refused message was held"
    );
    drop(publisher);
    assert!(service.is_running(), "the process died");
    still_serves(&service, "after-big").await;
    assert!(service.list_pods("m").await.is_empty());
}

/// Publishes one 4-block batch for each of `pods` pod names of `model`.
async fn flood_pods(publisher: &mut Publisher, model: &str, pods: usize) {
    let payload = store_batch(4);
    for i in 0..pods {
        publisher
            .send(message(
                format!("kv@flood-{i}@{model}").as_bytes(),
                0,
                &payload,
            ))
            .await;
        if i % 500 == 499 {
            // Stay under the ingest queue: this test is about names, not
            // about drops.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn a_flood_of_pod_names_stops_at_max_pods() {
    let service = Service::start(&["--max-pods", "50"]).await;
    let mut publisher = subscribed(&service).await; // the marker is pod 1
    flood_pods(&mut publisher, "m", 1000).await;
    let refused = service
        .wait_metric(r#"kv_indexer_refused_total{what="pod"}"#, |n| n >= 951.0)
        .await;
    assert_eq!(refused, 951.0);
    assert_eq!(service.list_pods("m").await.len(), 49);
    let logs = service.logs();
    let refusals = logs.matches("new pod refused").count();
    assert!(refusals <= 3, "{refusals} refusal lines: not rate-limited");
    let new_pods = logs.matches("new pod").count() - refusals;
    assert!(new_pods <= 50, "{new_pods} new-pod lines");
    // Pods admitted before the bound keep working.
    still_serves_admitted(&service).await;
}

/// A pod admitted before a flood still scores its blocks. Which pods were
/// admitted is not the order they were sent in: each ingest worker creates
/// its own pods, and the first worker to reach the bound refuses the rest
/// (beside two busy cores, `flood-0`'s worker was the late one in 4 runs of
/// 12, and the test, which scored `flood-0`, failed).
async fn still_serves_admitted(service: &Service) {
    // A pod is listed once created, its batch applied just after.
    let applied = async || {
        let pods = service.list_pods("m").await;
        pods.into_iter().find(|p| p.batches >= 1)
    };
    service
        .wait_until("an admitted pod applied its batch", async || {
            applied().await.is_some()
        })
        .await;
    let admitted = applied()
        .await
        .expect("applied, and pods are never dropped here");
    let resp = service
        .client()
        .await
        .score(pb::ScoreRequest {
            model: "m".into(),
            input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                ids: tokens(4),
            })),
            pods: vec![admitted.pod.clone()],
            ..Default::default()
        })
        .await
        .expect("Score")
        .into_inner();
    assert_eq!(resp.pods[0].matched_blocks, 4, "{resp:?}");
}

#[tokio::test]
async fn pods_fixed_cost_counts_against_max_memory() {
    let service = Service::start(&["--max-memory", "4MiB", "--max-pods", "100000"]).await;
    let mut publisher = subscribed(&service).await;
    let before = service.rss_kib();
    flood_pods(&mut publisher, "m", 5000).await;
    service
        .wait_metric(r#"kv_indexer_refused_total{what="pod_memory"}"#, |n| {
            n > 0.0
        })
        .await;
    let admitted = service.list_pods("m").await.len();
    let refused = service
        .wait_metric(r#"kv_indexer_refused_total{what="pod_memory"}"#, |n| {
            n as usize + admitted >= 5000
        })
        .await;
    let grown = service.rss_kib().saturating_sub(before);
    println!("admitted {admitted} pods, refused {refused}, RSS +{grown} KiB");
    // 4 MiB of budget, at most half of it for pods' fixed cost.
    assert!(admitted < 600, "{admitted} pods admitted under 4MiB");
    assert!(grown < 8 * 1024, "RSS grew {grown} KiB under a 4MiB budget");
    still_serves_admitted(&service).await;
}

#[tokio::test]
async fn a_pod_costs_less_than_the_memory_budget_assumes() {
    let service = Service::start(&["--max-pods", "100000"]).await;
    let mut publisher = subscribed(&service).await;
    // Warm the allocator and the tables up before the baseline.
    flood_pods(&mut publisher, "warm", 500).await;
    let pods_before = 501;
    service
        .wait_metric("kv_indexer_batches_applied_total", |n| {
            n as usize >= pods_before
        })
        .await;
    let before = service.rss_kib();
    let n = 5000;
    flood_pods(&mut publisher, "m", n).await;
    service
        .wait_metric("kv_indexer_batches_applied_total", |v| {
            v as usize >= pods_before + n
        })
        .await;
    let per_pod = (service.rss_kib().saturating_sub(before) * 1024) as usize / n;
    println!(
        "{per_pod} bytes per pod holding 4 blocks (--max-memory assumes {})",
        kv_indexer::config::BYTES_PER_POD
    );
    assert!(
        per_pod <= kv_indexer::config::BYTES_PER_POD,
        "a pod costs {per_pod} bytes, more than BYTES_PER_POD"
    );
}

#[tokio::test]
async fn models_beyond_max_models_are_refused_and_metrics_stay_small() {
    let service = Service::start(&["--max-models", "8"]).await;
    let mut publisher = subscribed(&service).await; // the marker's model is 1
    let payload = store_batch(1);
    for i in 0..200 {
        publisher
            .send(message(format!("kv@p@model-{i}").as_bytes(), 0, &payload))
            .await;
    }
    service
        .wait_metric(r#"kv_indexer_refused_total{what="model"}"#, |n| n >= 193.0)
        .await;
    let (_, metrics) = service.http_get("/metrics");
    let series = metrics
        .lines()
        .filter(|l| l.starts_with("kv_indexer_pods{"))
        .count();
    assert_eq!(series, 8, "{metrics}");
    assert!(
        metrics.len() < 16 * 1024,
        "/metrics is {} bytes",
        metrics.len()
    );
    assert_eq!(
        service.metric(r#"kv_indexer_refused_total{what="model"}"#),
        193.0
    );
}

#[tokio::test]
async fn long_and_unprintable_topics_are_skipped_and_counted() {
    let service = Service::start(&[]).await;
    let mut publisher = subscribed(&service).await;
    let before = service.rss_kib();
    let payload = store_batch(1);
    let mut bad: Vec<Vec<u8>> = Vec::new();
    bad.push(format!("kv@{}@m", "p".repeat(1 << 20)).into_bytes());
    for i in 0..100 {
        bad.push(format!("kv@{i}{}@m", "q".repeat(1 << 20)).into_bytes());
    }
    for forged in [
        "kv@pod\n2026-12-01 INFO forged@m",
        "kv@p\u{1b}[2J@m",
        "kv@p@m\r",
    ] {
        bad.push(forged.as_bytes().to_vec());
    }
    for topic in &bad {
        publisher.send(message(topic, 0, &payload)).await;
    }
    let skipped = service
        .wait_metric(
            r#"kv_indexer_messages_skipped_total{reason="topic"}"#,
            |n| n >= bad.len() as f64,
        )
        .await;
    assert_eq!(skipped, bad.len() as f64);
    let (_, metrics) = service.http_get("/metrics");
    assert!(
        metrics.len() < 16 * 1024,
        "/metrics is {} bytes",
        metrics.len()
    );
    let logs = service.logs();
    assert!(logs.len() < 64 * 1024, "{} bytes of logs", logs.len());
    assert!(!logs.contains("INFO forged"), "a topic forged a log line");
    assert!(service.list_pods("m").await.is_empty());
    let grown = service.rss_kib().saturating_sub(before);
    assert!(grown < 16 * 1024, "RSS grew {grown} KiB");
}

#[tokio::test]
async fn zmq_allow_refuses_publishers_from_other_networks() {
    let refusing = Service::start(&["--zmq-allow", "10.0.0.0/8"]).await;
    let mut publisher = Publisher::connect(refusing.zmq_bind.as_deref().unwrap()).await;
    assert!(
        !publisher.reaches(&refusing, "forged").await,
        "a publisher outside --zmq-allow reached the index"
    );
    assert!(refusing.metric(r#"kv_indexer_refused_total{what="connection"}"#) >= 1.0);
    let allowing = Service::start(&["--zmq-allow", "127.0.0.0/8,10.0.0.0/8"]).await;
    still_serves(&allowing, "allowed").await;
}

#[tokio::test]
async fn a_full_ingest_queue_drops_and_counts_and_loses_nothing_else() {
    full_queue_drops(&["--ingest-workers", "1", "--ingest-queue", "1"]).await;
}

/// The same bound in bytes: a queue of small messages may be deep, of
/// large ones it may not.
#[tokio::test]
async fn an_ingest_queue_full_in_bytes_drops_and_counts_too() {
    full_queue_drops(&["--ingest-workers", "1", "--ingest-queue-bytes", "4KiB"]).await;
}

async fn full_queue_drops(args: &[&str]) {
    let service = Service::start(args).await;
    let mut publisher = subscribed(&service).await;
    let payload = store_batch(64);
    let received_before = service.metric("kv_indexer_messages_received_total");
    let applied_before = service.metric("kv_indexer_batches_applied_total");
    let n = 5000u64;
    for seq in 0..n {
        publisher.send(message(b"kv@fast@m", seq, &payload)).await;
    }
    service
        .wait_metric("kv_indexer_messages_received_total", |v| {
            v >= received_before + n as f64
        })
        .await;
    let dropped = service
        .wait_metric("kv_indexer_messages_dropped_total", |v| v > 0.0)
        .await;
    // Every valid message received was either applied or counted dropped.
    let deadline = Instant::now() + crate::common::budget(30);
    loop {
        let applied = service.metric("kv_indexer_batches_applied_total") - applied_before;
        let dropped = service.metric("kv_indexer_messages_dropped_total");
        if applied + dropped == n as f64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "applied {applied} + dropped {dropped} != {n}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(dropped > 0.0);
}

#[tokio::test]
async fn idle_connections_cannot_lock_out_grpc_or_health_checks() {
    // This test process needs its own 1,100 descriptors and more.
    rlimit::increase_nofile_limit(8192).expect("raise the test's open-files limit");
    let service = Service::start_with_soft_nofile(1024, &[]).await;
    // More idle connections than the process's soft limit had descriptors.
    let mut idle: Vec<TcpStream> = (0..1100)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", service.metrics_port)).ok())
        .collect();
    assert!(idle.len() >= 1100, "only {} connections", idle.len());
    // gRPC has descriptors and connection slots of its own.
    tokio::time::timeout(
        crate::common::budget(20),
        still_serves(&service, "beside-idle"),
    )
    .await
    .expect("gRPC did not answer beside the idle connections");
    // The idle ones are closed once they sent nothing for the header
    // timeout, and health checks answer again.
    assert!(closed_by_peer(&mut idle[0], crate::common::budget(20)));
    let deadline = Instant::now() + crate::common::budget(20);
    loop {
        let port = service.metrics_port;
        let answered = tokio::task::spawn_blocking(move || {
            let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
            write!(
                s,
                "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            .ok()?;
            let mut raw = String::new();
            s.read_to_string(&mut raw).ok()?;
            Some(raw.starts_with("HTTP/1.1 200"))
        })
        .await
        .unwrap();
        if answered == Some(true) {
            break;
        }
        assert!(Instant::now() < deadline, "/healthz never answered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(service.logs().contains("open-files limit raised"));
}

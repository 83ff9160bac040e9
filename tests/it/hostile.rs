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

/// A pod publishing with an empty topic (SGLang's default) to the bound
/// socket cannot be told from any other: its messages are refused, counted
/// under their own reason, and the log says how to take such a pod (it
/// used to be filtered out unseen). Topics outside `--topic-filter` are
/// counted as filtered, silently; the pod with a topic is taken.
#[tokio::test]
async fn empty_topics_are_refused_by_name_and_foreign_ones_filtered() {
    let service = Service::start(&[]).await;
    let mut publisher = subscribed(&service).await;
    let payload = store_batch(1);
    for seq in 0..3 {
        publisher.send(message(b"", seq, &payload)).await;
    }
    publisher.send(message(b"other@p@m", 0, &payload)).await;
    publisher.send(message(b"kv@p@m", 0, &payload)).await;
    service
        .wait_metric(
            r#"kv_indexer_messages_skipped_total{reason="no_topic"}"#,
            |n| n >= 3.0,
        )
        .await;
    service
        .wait_metric(
            r#"kv_indexer_messages_skipped_total{reason="filtered"}"#,
            |n| n >= 1.0,
        )
        .await;
    service
        .wait_until("the pod with a topic taken", async || {
            service.list_pods("m").await.len() == 1
        })
        .await;
    assert!(
        service.logs().contains("pod=NAME,model=MODEL"),
        "{}",
        service.logs()
    );
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

/// Connections an attacker holds on one port: `idle` that send nothing,
/// `slow` that send one byte of `opening` every 2 s (slowloris). A
/// connection the service closes is opened again on the next round, as a
/// flood that does not give up would.
struct Flood {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Flood {
    fn hold(port: u16, idle: usize, slow: usize, opening: &'static [u8]) -> Flood {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let open = move || {
            let s = TcpStream::connect(("127.0.0.1", port)).ok()?;
            s.set_nonblocking(true).ok()?;
            Some(s)
        };
        // (connection, slow, bytes of `opening` sent)
        let mut held: Vec<(Option<TcpStream>, bool, usize)> =
            (0..idle + slow).map(|i| (open(), i >= idle, 0)).collect();
        let opened = held.iter().filter(|h| h.0.is_some()).count();
        assert!(opened >= idle + slow, "only {opened} connections on {port}");
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut reopened = 0;
            let mut buf = [0u8; 4096];
            while !flag.load(Ordering::Relaxed) {
                for (conn, slow, sent) in held.iter_mut() {
                    let alive = match conn {
                        None => false,
                        Some(s) => {
                            let open = match s.read(&mut buf) {
                                Ok(0) => false,
                                Ok(_) => true,
                                Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                            };
                            open && (!*slow || {
                                let byte = [opening[*sent % opening.len()]];
                                *sent += 1;
                                s.write(&byte).is_ok()
                            })
                        }
                    };
                    if !alive {
                        *conn = open();
                        *sent = 0;
                        reopened += 1;
                    }
                }
                std::thread::sleep(Duration::from_secs(2));
            }
            reopened
        });
        Flood {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the flood: how many connections it had to open again.
    fn stop(mut self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// `GET path` on a fresh connection, as the kubelet probes: its status, or
/// why there was none within `within`.
fn http_probe(port: u16, path: &str, within: Duration) -> Result<u16, String> {
    let started = Instant::now();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, within).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(within.saturating_sub(started.elapsed())))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).map_err(|e| e.to_string())?;
    if started.elapsed() > within {
        return Err(format!("answered after {:?}", started.elapsed()));
    }
    raw.get(9..12)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {raw:?}"))
}

/// gRPC health `Check` on a fresh connection, as the kubelet's gRPC probe.
async fn grpc_probe(addr: &str, within: Duration) -> Result<i32, String> {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let check = async {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map_err(|e| format!("check: {e}"))?;
        Ok(answer.into_inner().status)
    };
    tokio::time::timeout(within, check)
        .await
        .map_err(|_| format!("no answer within {within:?}"))?
}

#[tokio::test]
async fn probes_answer_within_a_second_under_a_connection_flood() {
    // 2,000 flood connections on each of two ports, and the probes'.
    rlimit::increase_nofile_limit(16_384).expect("raise the test's open-files limit");
    let service = Service::start_with_soft_nofile(1024, &[]).await;
    assert!(service.logs().contains("open-files limit raised"));
    // Twice --max-connections (1,024) on each listener, a quarter slowloris.
    let floods = [
        Flood::hold(
            service.metrics_port,
            1500,
            500,
            b"GET /metrics HTTP/1.1\r\n",
        ),
        Flood::hold(
            service.grpc_port,
            1500,
            500,
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ),
    ];
    // A kubelet probes every few seconds with a 1 s timeout; three misses
    // in a row and the pod is restarted. Here: every probe, for 12 s (past
    // the 5 s within which a connection must send its opening).
    let within = Duration::from_secs(1);
    let (http, grpc) = (service.metrics_port, service.grpc_addr());
    let mut misses = Vec::new();
    let until = Instant::now() + Duration::from_secs(12);
    let mut probes = 0;
    let mut slowest = Duration::ZERO;
    while Instant::now() < until {
        let round = Instant::now();
        for path in ["/healthz", "/readyz"] {
            let got = tokio::task::spawn_blocking(move || http_probe(http, path, within))
                .await
                .unwrap();
            if got != Ok(200) {
                misses.push(format!("{path}: {got:?}"));
            }
        }
        let got = grpc_probe(&grpc, within).await;
        if got != Ok(1) {
            misses.push(format!("gRPC health: {got:?}"));
        }
        probes += 3;
        slowest = slowest.max(round.elapsed());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        misses.is_empty(),
        "{} of {probes} probes missed: {misses:#?}",
        misses.len()
    );
    eprintln!("{probes} probes, slowest round of three {slowest:?}");
    // gRPC still serves a client beside the flood.
    tokio::time::timeout(
        crate::common::budget(20),
        still_serves(&service, "beside-flood"),
    )
    .await
    .expect("gRPC did not answer beside the flood");
    let reopened: Vec<usize> = floods.into_iter().map(Flood::stop).collect();
    // The caps held: the flood was shed, not admitted past them.
    for listener in ["grpc", "http"] {
        let open = service.metric(&format!(
            "kv_indexer_connections{{listener=\"{listener}\"}}"
        ));
        assert!(open <= 1024.0, "{listener}: {open} connections open");
        let full = service.metric(&format!(
            "kv_indexer_connections_shed_total{{listener=\"{listener}\",reason=\"full\"}}"
        ));
        assert!(full > 0.0, "{listener}: none shed");
    }
    assert!(reopened.iter().all(|&n| n > 0), "reopened {reopened:?}");
}

/// A connection that sends a byte now and then, never a whole HTTP/2
/// preface, is closed once it had 5 s for it, and counted; one that sent
/// its preface stays.
#[tokio::test]
async fn a_grpc_connection_that_never_sends_its_preface_is_closed() {
    let service = Service::start(&[]).await;
    let mut slow = TcpStream::connect(("127.0.0.1", service.grpc_port)).unwrap();
    let mut prompt = TcpStream::connect(("127.0.0.1", service.grpc_port)).unwrap();
    prompt
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .unwrap();
    for byte in b"PRI" {
        slow.write_all(&[*byte]).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
    }
    assert!(closed_by_peer(&mut slow, crate::common::budget(10)));
    let series = "kv_indexer_connections_shed_total{listener=\"grpc\",reason=\"first_bytes\"}";
    assert_eq!(service.metric(series), 1.0);
    // The other one is open: the server's SETTINGS came, no EOF since.
    assert!(!closed_by_peer(&mut prompt, Duration::from_millis(500)));
}

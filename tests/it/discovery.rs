//! Pod discovery: a pods file re-read on change, and DNS names re-resolved
//! against a real (tiny) DNS server on loopback.

use std::collections::HashMap;
use std::net::{Ipv4Addr, UdpSocket};
use std::sync::{Arc, Mutex};

use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;

const CONNECTIONS: &str = "kv_indexer_zmq_connections";

/// Waits until no pod named `gone*` is left in `ListPods` or among
/// `Score`'s candidates, and checks that pods named `kept*` are still in
/// both: a pod discovery stopped listing is forgotten after --pod-expiry,
/// not only disconnected.
async fn wait_forgotten(service: &Service, gone: &str, kept: &str) {
    let names = async || -> (Vec<String>, Vec<String>) {
        let listed = service.list_pods(WARMUP_MODEL).await;
        let scored = service
            .client()
            .await
            .score(pb::ScoreRequest {
                model: WARMUP_MODEL.into(),
                input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                    ids: vec![1; 16],
                })),
                ..Default::default()
            })
            .await
            .expect("Score")
            .into_inner();
        (
            listed.into_iter().map(|p| p.pod).collect(),
            scored.pods.into_iter().map(|p| p.pod).collect(),
        )
    };
    let has = |pods: &[String], prefix: &str| pods.iter().any(|p| p.starts_with(prefix));
    service
        .wait_until(&format!("{gone}* forgotten"), async || {
            let (listed, scored) = names().await;
            !has(&listed, gone) && !has(&scored, gone)
        })
        .await;
    let (listed, scored) = names().await;
    assert!(has(&listed, kept), "{kept}* left ListPods too: {listed:?}");
    assert!(has(&scored, kept), "{kept}* left Score too: {scored:?}");
}

#[tokio::test]
async fn pods_file_changes_add_and_remove_pods_without_restart() {
    let (mut a, ea) = Publisher::bind().await;
    let (mut b, eb) = Publisher::bind().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pods.yaml");
    std::fs::write(&file, format!("- {ea}\n")).unwrap();
    let service = Service::start_raw(
        &[
            "--zmq-bind",
            "none",
            "--pods-file",
            file.to_str().unwrap(),
            "--discovery-interval",
            "100ms",
            "--pod-expiry",
            "1s",
        ],
        None,
    )
    .await;
    a.wait_subscribed(&service, "file-a-1").await;
    service.wait_metric(CONNECTIONS, |v| v == 1.0).await;
    assert!(
        !b.reaches(&service, "file-b-0").await,
        "b is not listed yet"
    );

    // Add b (object form, as JSON), the way a ConfigMap update lands.
    std::fs::write(
        &file,
        format!(r#"{{"pods": ["{ea}", {{"endpoint": "{eb}", "replay": "tcp://127.0.0.1:1"}}]}}"#),
    )
    .unwrap();
    b.wait_subscribed(&service, "file-b-1").await;
    service.wait_metric(CONNECTIONS, |v| v == 2.0).await;

    // A broken write keeps the current pods.
    std::fs::write(&file, "pods: [not an endpoint").unwrap();
    assert!(a.reaches(&service, "file-a-2").await);

    // Remove a: disconnected at once.
    std::fs::write(&file, format!("pods:\n  - {eb}\n")).unwrap();
    service.wait_metric(CONNECTIONS, |v| v == 1.0).await;
    assert!(!a.reaches(&service, "file-a-3").await, "a was removed");
    assert!(b.reaches(&service, "file-b-2").await);

    // After --pod-expiry, a's pods are forgotten: gone from ListPods and
    // from Score's candidates; b's stay.
    wait_forgotten(&service, "file-a-", "file-b-").await;
}

/// Answers A queries for one name from a table the test changes.
struct TinyDns {
    addr: String,
    records: Arc<Mutex<HashMap<String, Vec<Ipv4Addr>>>>,
}

impl TinyDns {
    fn start() -> TinyDns {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap().to_string();
        let records: Arc<Mutex<HashMap<String, Vec<Ipv4Addr>>>> = Default::default();
        let table = records.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok((n, peer)) = socket.recv_from(&mut buf) {
                let q = &buf[..n];
                if n < 12 {
                    continue;
                }
                // Question: labels, then qtype and qclass.
                let mut i = 12;
                let mut labels = Vec::new();
                while i < n && q[i] != 0 {
                    let len = q[i] as usize;
                    labels.push(String::from_utf8_lossy(&q[i + 1..i + 1 + len]).to_lowercase());
                    i += 1 + len;
                }
                let qtype = u16::from_be_bytes([q[i + 1], q[i + 2]]);
                let question_end = i + 5;
                let name = labels.join(".");
                let ips = table.lock().unwrap().get(&name).cloned();
                let answers = match (&ips, qtype) {
                    (Some(ips), 1) => ips.clone(),
                    _ => Vec::new(),
                };
                let mut r = Vec::with_capacity(512);
                r.extend_from_slice(&q[..2]); // id
                let rcode = if ips.is_none() { 3 } else { 0 }; // NXDOMAIN for unknown names
                r.extend_from_slice(&[0x81, 0x80 | rcode]);
                r.extend_from_slice(&[0, 1]);
                r.extend_from_slice(&(answers.len() as u16).to_be_bytes());
                r.extend_from_slice(&[0, 0, 0, 0]);
                r.extend_from_slice(&q[12..question_end]);
                for ip in answers {
                    r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4]);
                    r.extend_from_slice(&ip.octets());
                }
                let _ = socket.send_to(&r, peer);
            }
        });
        TinyDns { addr, records }
    }

    fn set(&self, name: &str, ips: &[Ipv4Addr]) {
        self.records
            .lock()
            .unwrap()
            .insert(name.to_owned(), ips.to_vec());
    }
}

#[tokio::test]
async fn dns_discovery_follows_the_records_of_a_headless_service() {
    let port = free_port();
    let ip_a: Ipv4Addr = "127.0.0.2".parse().unwrap();
    let ip_b: Ipv4Addr = "127.0.0.3".parse().unwrap();
    let (mut a, _) = Publisher::bind_on(&format!("tcp://{ip_a}:{port}")).await;
    let (mut b, _) = Publisher::bind_on(&format!("tcp://{ip_b}:{port}")).await;
    let dns = TinyDns::start();
    let name = "vllm-headless.test.svc.cluster.local";
    dns.set(name, &[ip_a]);
    let target = format!("{name}:{port},replay-port=5558");
    let service = Service::start_raw(
        &[
            "--zmq-bind",
            "none",
            "--discover-dns",
            &target,
            "--dns-server",
            &dns.addr,
            "--discovery-interval",
            "100ms",
            "--pod-expiry",
            "1s",
        ],
        None,
    )
    .await;
    a.wait_subscribed(&service, "dns-a-1").await;
    service.wait_metric(CONNECTIONS, |v| v == 1.0).await;
    assert!(!b.reaches(&service, "dns-b-0").await);

    dns.set(name, &[ip_a, ip_b]);
    b.wait_subscribed(&service, "dns-b-1").await;
    service.wait_metric(CONNECTIONS, |v| v == 2.0).await;

    // a leaves the Service: disconnected at once, forgotten after
    // --pod-expiry.
    dns.set(name, &[ip_b]);
    service.wait_metric(CONNECTIONS, |v| v == 1.0).await;
    assert!(!a.reaches(&service, "dns-a-2").await, "a left the Service");
    assert!(b.reaches(&service, "dns-b-2").await);
    wait_forgotten(&service, "dns-a-", "dns-b-").await;
}

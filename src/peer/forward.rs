//! Routing feedback to every other replica: a `RecordRouting` this replica
//! accepted is sent to each peer (`KvIndexerPeer/Routed`) with the instant
//! its speculative entries end, so a router balancing per request sees its
//! pick on whichever replica answers its next `Score`.
//!
//! Never in the caller's way: each peer has a bounded queue, filled without
//! waiting (a full queue drops and counts), drained by a task of its own in
//! batches; a slow or absent peer delays and loses only its own. The peers
//! are `--peer`'s targets, resolved again every few seconds (a `dns:///`
//! name follows the Ready replicas), this replica's own skipped.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::bootstrap::{candidates, endpoint, Candidate};
use super::present;
use super::serve::MAX_ROUTINGS;
use crate::config::{Config, Secret};
use crate::metrics::Metrics;
use crate::proto::kvindexer::v1 as pb;
use crate::ratelimit::RateLimited;
use pb::kv_indexer_peer_client::KvIndexerPeerClient;

/// Routings queued per peer.
const QUEUE: usize = 4096;
/// How often the peers are resolved again.
const REFRESH: Duration = Duration::from_secs(2);
/// Bytes of routings in one batch, about.
const BATCH_BYTES: usize = 1 << 20;
/// Longest wait for a peer's answer to a batch.
const SEND: Duration = Duration::from_secs(1);

struct Queued {
    routing: pb::PeerRouting,
    accepted: Instant,
}

pub struct Forwarder {
    peers: Mutex<HashMap<SocketAddr, mpsc::Sender<Queued>>>,
    metrics: Arc<Metrics>,
}

impl Forwarder {
    /// Forwards to `--peer`'s replicas; `None` without peers.
    pub fn start(config: &Config, metrics: Arc<Metrics>) -> Option<Arc<Forwarder>> {
        if config.peers.targets.is_empty() {
            return None;
        }
        let forwarder = Arc::new(Forwarder {
            peers: Mutex::new(HashMap::new()),
            metrics,
        });
        let (config, weak) = (config.clone(), Arc::downgrade(&forwarder));
        tokio::spawn(async move {
            while let Some(forwarder) = weak.upgrade() {
                let found = candidates(&config.peers.targets, config.grpc_addr.port()).await;
                forwarder.follow(&config, found);
                drop(forwarder);
                tokio::time::sleep(REFRESH).await;
            }
        });
        Some(forwarder)
    }

    /// A routing accepted here, to every peer.
    pub fn forward(&self, routing: pb::PeerRouting) {
        let accepted = Instant::now();
        for tx in self.peers.lock().values() {
            let queued = Queued {
                routing: routing.clone(),
                accepted,
            };
            if tx.try_send(queued).is_err() {
                Metrics::count(&self.metrics.peer_routings_forwarded, "outcome", "dropped");
            }
        }
    }

    /// Starts a sender for each new peer, stops those no longer found.
    fn follow(&self, config: &Config, found: Vec<Candidate>) {
        let mut peers = self.peers.lock();
        peers.retain(|addr, _| found.iter().any(|c| c.addr == *addr));
        for peer in found {
            if peers.contains_key(&peer.addr) {
                continue;
            }
            let Ok(endpoint) = endpoint(config, &peer) else {
                continue;
            };
            let (tx, rx) = mpsc::channel(QUEUE);
            peers.insert(peer.addr, tx);
            let client = KvIndexerPeerClient::new(endpoint.timeout(SEND).connect_lazy());
            tokio::spawn(send(
                peer.addr,
                client,
                rx,
                config.peers.token.clone(),
                self.metrics.clone(),
            ));
        }
    }
}

/// Drains one peer's queue, in batches, until the peer is dropped.
async fn send(
    addr: SocketAddr,
    mut client: KvIndexerPeerClient<tonic::transport::Channel>,
    mut rx: mpsc::Receiver<Queued>,
    token: Option<Secret>,
    metrics: Arc<Metrics>,
) {
    let warn = RateLimited::new(Duration::from_secs(30));
    while let Some(first) = rx.recv().await {
        // At most `MAX_ROUTINGS`, and about `BATCH_BYTES` (a routing of a
        // long prompt is 256 KiB at 32K tokens; the receiver takes 4 MiB).
        let mut bytes = prost::Message::encoded_len(&first.routing);
        let mut batch = vec![first];
        while batch.len() < MAX_ROUTINGS && bytes < BATCH_BYTES {
            match rx.try_recv() {
                Ok(q) => {
                    bytes += prost::Message::encoded_len(&q.routing);
                    batch.push(q);
                }
                Err(_) => break,
            }
        }
        let n = batch.len() as u64;
        let accepted: Vec<Instant> = batch.iter().map(|q| q.accepted).collect();
        let mut request = tonic::Request::new(pb::PeerRoutedRequest {
            routings: batch.into_iter().map(|q| q.routing).collect(),
        });
        // A secret that cannot be a header value is not sent: the peer
        // refuses, and the batch counts as failed.
        let _ = present(&mut request, token.as_ref());
        let outcome = match client.routed(request).await {
            Ok(_) => {
                for at in accepted {
                    metrics
                        .peer_forward_seconds
                        .observe(at.elapsed().as_secs_f64());
                }
                "sent"
            }
            Err(status) => {
                warn.warn(|suppressed| {
                    tracing::warn!(peer = %addr, error = %status.message(), suppressed, "routings not forwarded to a peer replica")
                });
                "failed"
            }
        };
        metrics
            .peer_routings_forwarded
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc_by(n);
    }
}

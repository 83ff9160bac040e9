//! `--peer`: before this replica opens its sockets, copy a Ready peer's
//! index into it.
//!
//! Peers are tried in the order given (a `dns:///` name: each address it
//! resolves to, this replica's own skipped), again and again until one
//! gives a whole snapshot or `--peer-wait` has passed. A replica serves
//! only once it is Ready, so two replicas starting together never wait on
//! each other past `--peer-wait`.
//!
//! The snapshot is spooled to an unnamed temporary file, then loaded run
//! by run (never the whole index twice in memory) with every check a
//! snapshot file gets (format, checksum, key fingerprint): nothing of a
//! refused or broken copy is kept.

use std::collections::HashSet;
use std::io::{Seek, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indexer::Indexer;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Status};

use super::{present, CHUNK};
use crate::config::{Config, PeerTarget};
use crate::metrics::Metrics;
use crate::proto::kvindexer::v1 as pb;
use pb::kv_indexer_peer_client::KvIndexerPeerClient;

/// How long connecting to one peer may take.
const CONNECT: Duration = Duration::from_secs(2);
/// Longest wait for a peer's first answer (TLS handshake included).
const ANSWER: Duration = Duration::from_secs(5);
/// Longest wait for the next chunk of a snapshot being received.
const IDLE: Duration = Duration::from_secs(30);
/// Pause between rounds over the peers.
const ROUND: Duration = Duration::from_millis(250);

/// A peer's address, and the name its certificate is checked against.
pub(super) struct Candidate {
    pub addr: SocketAddr,
    pub name: String,
}

/// A peer's index, copied.
pub struct Copied {
    /// Its speculative entries live when the copy was made: for this
    /// replica's pods' writers, once they run.
    pub live: Vec<pb::PeerRouting>,
}

/// Keys of live speculative entries taken from a peer, at most.
const LIVE_MAX: usize = 1 << 24;

/// Copies a peer's index into `indexer` (empty, no writers yet). Returns
/// the peer it came from, or `None` when no peer gave one within
/// `--peer-wait`.
pub async fn run(
    config: &Config,
    indexer: &Arc<Indexer>,
    metrics: &Metrics,
    replica: u64,
) -> Option<Copied> {
    let deadline = Instant::now() + config.peers.wait;
    // Each (peer, reason) logged once, not once a round.
    let mut told: HashSet<(SocketAddr, String)> = HashSet::new();
    loop {
        for peer in candidates(&config.peers.targets, config.grpc_addr.port()).await {
            match copy(config, indexer, &peer, replica).await {
                Ok((pods, live)) => {
                    let speculative: usize = live.iter().map(|r| r.keys.len()).sum();
                    tracing::info!(peer = %peer.addr, pods, entries = indexer.entries(), speculative, "index copied from a peer replica");
                    return Some(Copied { live });
                }
                Err(Failure { reason, detail }) => {
                    Metrics::count(&metrics.peer_bootstrap_failures, "reason", reason);
                    if told.insert((peer.addr, reason.to_owned())) {
                        tracing::warn!(peer = %peer.addr, reason, "{detail}");
                    }
                }
            }
        }
        if Instant::now() + ROUND > deadline {
            tracing::warn!(
                wait = ?config.peers.wait,
                "no peer replica gave its index within --peer-wait"
            );
            return None;
        }
        tokio::time::sleep(ROUND).await;
    }
}

/// Every address of every target, in order, without this replica's own
/// (`port` on one of this host's addresses).
pub(super) async fn candidates(targets: &[PeerTarget], port: u16) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = Vec::new();
    for target in targets {
        let (host, p, every) = match target {
            PeerTarget::Addr { host, port } => (host, *port, false),
            PeerTarget::Dns { name, port } => (name, *port, true),
        };
        let Ok(found) = tokio::net::lookup_host((host.as_str(), p)).await else {
            continue;
        };
        let found: Vec<SocketAddr> = found.collect();
        for addr in found.into_iter().take(if every { usize::MAX } else { 1 }) {
            let own = addr.port() == port && is_this_host(addr);
            if !own && out.iter().all(|c| c.addr != addr) {
                out.push(Candidate {
                    addr,
                    name: host.clone(),
                });
            }
        }
    }
    out
}

/// Whether `addr`'s IP is one of this host's: only a local address can be
/// bound.
fn is_this_host(addr: SocketAddr) -> bool {
    std::net::UdpSocket::bind(SocketAddr::new(addr.ip(), 0)).is_ok()
}

struct Failure {
    /// The metric's label.
    reason: &'static str,
    detail: String,
}

fn failure(reason: &'static str, detail: impl Into<String>) -> Failure {
    Failure {
        reason,
        detail: detail.into(),
    }
}

fn refused(status: &Status) -> Failure {
    let reason = match status.code() {
        Code::PermissionDenied | Code::Unauthenticated => "auth",
        Code::FailedPrecondition if status.message().contains("format") => "format",
        Code::FailedPrecondition => "keys",
        Code::ResourceExhausted => "busy",
        _ => "unavailable",
    };
    failure(reason, format!("peer refused: {}", status.message()))
}

/// A copy's request: this replica's keys, format and id, and the secret.
fn request(
    config: &Config,
    indexer: &Indexer,
    replica: u64,
) -> Result<tonic::Request<pb::PeerSnapshotRequest>, Failure> {
    let mut request = tonic::Request::new(pb::PeerSnapshotRequest {
        keys: indexer.keys_configuration(),
        format: indexer::snapshot::VERSION,
        replica,
    });
    present(&mut request, config.peers.token.as_ref())
        .map_err(|_| failure("auth", "the peer token is not a valid header value"))?;
    Ok(request)
}

/// One peer's snapshot, spooled, then loaded; the pods restored, and the
/// peer's live speculative entries.
async fn copy(
    config: &Config,
    indexer: &Arc<Indexer>,
    peer: &Candidate,
    replica: u64,
) -> Result<(usize, Vec<pb::PeerRouting>), Failure> {
    let channel = connect(config, peer).await?;
    // A `Live` message carries up to 65,536 keys of 9 bytes each.
    let mut client = KvIndexerPeerClient::new(channel).max_decoding_message_size(2 * CHUNK);
    // A peer that accepted the connection but does not answer (one still
    // starting, whose listener is bound) must not hold the search.
    let mut stream =
        tokio::time::timeout(ANSWER, client.snapshot(request(config, indexer, replica)?))
            .await
            .map_err(|_| failure("unavailable", "the peer did not answer"))?
            .map_err(|s| refused(&s))?
            .into_inner();
    let mut file = tempfile::tempfile()
        .map_err(|e| failure("invalid", format!("no temporary file to receive into: {e}")))?;
    let mut bytes = 0u64;
    loop {
        let next = tokio::time::timeout(IDLE, stream.message())
            .await
            .map_err(|_| failure("unavailable", "the peer stopped sending"))?
            .map_err(|s| refused(&s))?;
        let Some(chunk) = next else {
            break;
        };
        bytes += chunk.data.len() as u64;
        file.write_all(&chunk.data)
            .map_err(|e| failure("invalid", format!("cannot spool the snapshot: {e}")))?;
    }
    file.rewind()
        .map_err(|e| failure("invalid", format!("cannot read the spooled snapshot: {e}")))?;
    let importer = indexer.clone();
    let loaded = tokio::task::spawn_blocking(move || importer.import(&file))
        .await
        .map_err(|e| failure("invalid", format!("loading the snapshot failed: {e}")))?;
    match loaded {
        Ok(pods) => {
            tracing::debug!(bytes, "peer snapshot received");
            Ok((
                pods,
                live(&mut client, request(config, indexer, replica)?).await,
            ))
        }
        Err(indexer::snapshot::SnapshotError::KeysChanged) => Err(failure(
            "keys",
            "the peer's snapshot was computed under another key configuration",
        )),
        Err(e) => Err(failure(
            "invalid",
            format!("the peer's snapshot is refused: {e}"),
        )),
    }
}

/// The peer's live speculative entries (none if it cannot give them: they
/// only help, and end within seconds anyway).
async fn live(
    client: &mut KvIndexerPeerClient<tonic::transport::Channel>,
    request: tonic::Request<pb::PeerSnapshotRequest>,
) -> Vec<pb::PeerRouting> {
    let mut out = Vec::new();
    let Ok(Ok(response)) = tokio::time::timeout(ANSWER, client.live(request)).await else {
        return out;
    };
    let mut stream = response.into_inner();
    let mut keys = 0;
    while let Ok(Ok(Some(message))) = tokio::time::timeout(IDLE, stream.message()).await {
        keys += message.routings.iter().map(|r| r.keys.len()).sum::<usize>();
        if keys > LIVE_MAX {
            break;
        }
        out.extend(message.routings);
    }
    out
}

/// A channel to `peer`, over TLS when this replica serves TLS (a fleet's
/// replicas share it).
async fn connect(config: &Config, peer: &Candidate) -> Result<tonic::transport::Channel, Failure> {
    let endpoint = endpoint(config, peer).map_err(|e| failure("unavailable", e))?;
    tokio::time::timeout(ANSWER, endpoint.connect())
        .await
        .map_err(|_| failure("unavailable", "connecting timed out"))?
        .map_err(|e| failure("unavailable", format!("cannot connect: {e}")))
}

/// How `peer` is reached: over TLS when this replica serves TLS, trusting
/// `--tls-client-ca` and presenting this replica's own certificate.
pub(super) fn endpoint(config: &Config, peer: &Candidate) -> Result<Endpoint, String> {
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", peer.addr))
        .map_err(|e| e.to_string())?
        .connect_timeout(CONNECT);
    if let Some(tls) = &config.tls {
        let mut client = ClientTlsConfig::new()
            .domain_name(peer.name.clone())
            .identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem));
        if let Some(ca) = &tls.client_ca_pem {
            client = client.ca_certificate(Certificate::from_pem(ca));
        }
        endpoint = endpoint.tls_config(client).map_err(|e| e.to_string())?;
    }
    Ok(endpoint)
}

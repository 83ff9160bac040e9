//! `KvIndexerPeer`: this replica's index to a starting one.
//!
//! The snapshot is cut as `--snapshot-dir`'s is (`Indexer::export`: the
//! pods' locks held while their blocks are written, run by run, never
//! copied), into an unnamed file in the temporary directory, on a blocking
//! thread; then the file is read into a channel of a few chunks that the
//! gRPC stream drains. Ingest waits only for the file's writing, never for
//! the reader, `Score` never (its reads take no lock), and memory grows by
//! the channel's chunks, not by a copy of the index. One copy at a time: a
//! second caller is told to try another peer.

use std::io::{Seek, Write};
use std::sync::Arc;

use indexer::keys::BlockKey;
use indexer::Indexer;
use subtle::ConstantTimeEq;
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::{AUTHORIZATION, CHUNK};
use crate::config::Secret;
use crate::metrics::Metrics;
use crate::proto::kvindexer::v1 as pb;
use pb::kv_indexer_peer_server::KvIndexerPeer;

/// Chunks written ahead of the reader.
const AHEAD: usize = 4;

pub struct PeerService {
    indexer: Arc<Indexer>,
    metrics: Arc<Metrics>,
    /// `--peer-token-file`'s secret.
    token: Option<Secret>,
    /// `--tls-client-ca`: every connection presented a certificate it
    /// trusts.
    client_certificates: bool,
    /// This process's id (`PeerSnapshotRequest.replica`).
    replica: u64,
    copying: Arc<Semaphore>,
    /// Forwarded routings to their pods' writers.
    control: crate::ingest::Control,
    /// This replica is Ready (not after a worker died, not while stopping).
    ready: Arc<std::sync::atomic::AtomicBool>,
}

impl PeerService {
    pub fn new(
        indexer: Arc<Indexer>,
        metrics: Arc<Metrics>,
        token: Option<Secret>,
        client_certificates: bool,
        replica: u64,
        control: crate::ingest::Control,
        ready: Arc<std::sync::atomic::AtomicBool>,
    ) -> PeerService {
        PeerService {
            indexer,
            metrics,
            token,
            client_certificates,
            replica,
            copying: Arc::new(Semaphore::new(1)),
            control,
            ready,
        }
    }

    /// Ready, and the shared secret (compared in constant time); without
    /// one, a client certificate the TLS layer verified.
    fn authorize<T>(&self, request: &Request<T>) -> Result<(), Status> {
        if !self.ready.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Status::unavailable("this replica is not ready"));
        }
        // With a secret, the secret: with mTLS every client (the router
        // too) has a trusted certificate.
        if self.token.is_none()
            && self.client_certificates
            && request.peer_certs().is_some_and(|c| !c.is_empty())
        {
            return Ok(());
        }
        let Some(Secret(token)) = &self.token else {
            return Err(Status::permission_denied(
                "peer RPCs are off: this replica has no --peer-token-file (or --tls-client-ca)",
            ));
        };
        let presented = request
            .metadata()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        if bool::from(presented.as_bytes().ct_eq(token.as_bytes())) {
            Ok(())
        } else {
            Err(Status::permission_denied(
                "not a replica of this fleet: wrong or missing peer token",
            ))
        }
    }

    /// A copy's checks: the caller is of the fleet, is not this replica, and
    /// keys and reads as this one does. A refusal is counted.
    fn check_copy(&self, request: Request<pb::PeerSnapshotRequest>) -> Result<(), Status> {
        let checked = self.copy_refusal(request);
        if checked.is_err() {
            self.outcome("refused");
        }
        checked
    }

    fn copy_refusal(&self, request: Request<pb::PeerSnapshotRequest>) -> Result<(), Status> {
        self.authorize(&request)?;
        let req = request.into_inner();
        if req.replica == self.replica {
            return Err(Status::failed_precondition("a replica cannot copy itself"));
        }
        let ours = self.indexer.keys_configuration();
        if req.keys != ours {
            return Err(Status::failed_precondition(format!(
                "key configuration differs: this replica's is {ours:?}, the caller's {:?}",
                req.keys
            )));
        }
        if req.format != indexer::snapshot::VERSION {
            return Err(Status::failed_precondition(format!(
                "snapshot format differs: this replica writes version {}, the caller reads {}",
                indexer::snapshot::VERSION,
                req.format
            )));
        }
        Ok(())
    }

    fn outcome(&self, outcome: &str) {
        Metrics::count(&self.metrics.peer_snapshots_served, "outcome", outcome);
    }
}

#[tonic::async_trait]
impl KvIndexerPeer for PeerService {
    type SnapshotStream = ReceiverStream<Result<pb::PeerSnapshotChunk, Status>>;
    type LiveStream = ReceiverStream<Result<pb::PeerRoutedRequest, Status>>;

    async fn snapshot(
        &self,
        request: Request<pb::PeerSnapshotRequest>,
    ) -> Result<Response<Self::SnapshotStream>, Status> {
        self.check_copy(request)?;
        let Ok(permit) = self.copying.clone().try_acquire_owned() else {
            self.outcome("busy");
            return Err(Status::resource_exhausted(
                "another replica is copying this one's index: try another peer",
            ));
        };
        let (tx, rx) = mpsc::channel(AHEAD);
        let (indexer, metrics) = (self.indexer.clone(), self.metrics.clone());
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut out = Chunks {
                tx: tx.clone(),
                buf: Vec::with_capacity(CHUNK),
                metrics: metrics.clone(),
            };
            let sent = spool(&indexer)
                .and_then(|mut file| std::io::copy(&mut file, &mut out))
                .and_then(|_| out.flush());
            let outcome = match sent {
                Ok(()) => "sent",
                Err(e) => {
                    // The reader gone (its replica gave up) or the export
                    // failed: either way the stream ends in an error.
                    let _ = tx.blocking_send(Err(Status::aborted(format!("snapshot: {e}"))));
                    "aborted"
                }
            };
            Metrics::count(&metrics.peer_snapshots_served, "outcome", outcome);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn live(
        &self,
        request: Request<pb::PeerSnapshotRequest>,
    ) -> Result<Response<Self::LiveStream>, Status> {
        self.check_copy(request)?;
        let messages = self.live();
        let (tx, rx) = mpsc::channel(AHEAD);
        tokio::spawn(async move {
            for m in messages {
                if tx.send(Ok(m)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn routed(
        &self,
        request: Request<pb::PeerRoutedRequest>,
    ) -> Result<Response<pb::PeerRoutedResponse>, Status> {
        self.authorize(&request)?;
        let req = request.into_inner();
        if req.routings.len() > MAX_ROUTINGS {
            return Err(Status::invalid_argument(format!(
                "{} routings in one request (at most {MAX_ROUTINGS})",
                req.routings.len()
            )));
        }
        let written = write_live(&self.control, &self.indexer, &self.metrics, req.routings);
        Ok(Response::new(pb::PeerRoutedResponse { written }))
    }
}

impl PeerService {
    /// Each pod's live speculative entries, grouped by their end (one
    /// `PeerRouting` per run of entries ending together), in messages of at
    /// most `LIVE_KEYS` keys.
    fn live(&self) -> Vec<pb::PeerRoutedRequest> {
        let (now, unix_ms) = (std::time::Instant::now(), super::unix_ms());
        let mut out = vec![pb::PeerRoutedRequest::default()];
        let mut keys_in_last = 0;
        for live in self.indexer.speculative().live(now) {
            let (model, pod) = (live.model, live.pod);
            for run in live.entries.chunk_by(|a, b| a.1 == b.1) {
                for part in run.chunks(LIVE_KEYS) {
                    if keys_in_last + part.len() > LIVE_KEYS {
                        out.push(pb::PeerRoutedRequest::default());
                        keys_in_last = 0;
                    }
                    keys_in_last += part.len();
                    let left = part[0].1.saturating_duration_since(now).as_millis() as u64;
                    out.last_mut()
                        .expect("one at least")
                        .routings
                        .push(pb::PeerRouting {
                            model: model.clone(),
                            pod: pod.clone(),
                            keys: part.iter().map(|(k, _)| k.0).collect(),
                            expires_unix_ms: unix_ms + left,
                        });
                }
            }
        }
        out.retain(|m| !m.routings.is_empty());
        out
    }
}

/// Routings another replica accepted (or had live when it was copied),
/// to their pods' writers here; returns how many were queued.
pub fn write_live(
    control: &crate::ingest::Control,
    indexer: &Indexer,
    metrics: &Metrics,
    routings: Vec<pb::PeerRouting>,
) -> u32 {
    let (now, unix_ms) = (std::time::Instant::now(), super::unix_ms());
    let mut written = 0;
    for r in routings {
        let outcome = match r.expires_unix_ms.checked_sub(unix_ms) {
            _ if r.keys.len() > MAX_KEYS => "refused",
            None | Some(0) => "ended",
            // Only pods this replica has (a name never makes a new one).
            _ if indexer.find_pod(&r.model, &r.pod).is_none() => "unknown",
            Some(left) => {
                // Speculative entries last seconds: a far end is a wrong
                // clock (or a wrong peer), held to the longest TTL.
                let until = now + std::time::Duration::from_millis(left.min(MAX_TTL_MS));
                let keys = r.keys.into_iter().map(BlockKey).collect();
                match control.speculate(r.model, r.pod, keys, until) {
                    true => {
                        written += 1;
                        "written"
                    }
                    false => "dropped",
                }
            }
        };
        Metrics::count(&metrics.peer_routings_received, "outcome", outcome);
    }
    written
}

/// The furthest end a forwarded entry may have, from now: ten minutes.
const MAX_TTL_MS: u64 = 600_000;

/// Keys in one `Live` message, at most (and in one of its routings).
const LIVE_KEYS: usize = 1 << 16;

/// Routings in one `Routed` request, at most.
pub(super) const MAX_ROUTINGS: usize = 1024;
/// Keys of one forwarded routing, at most (a 1M-token prompt of 16-token
/// blocks).
const MAX_KEYS: usize = 1 << 16;

/// The index as a snapshot, in an unnamed temporary file (gone when
/// dropped), from its start.
fn spool(indexer: &Indexer) -> std::io::Result<std::fs::File> {
    let mut file = indexer.export(tempfile::tempfile()?)?;
    file.rewind()?;
    Ok(file)
}

/// The snapshot's bytes as chunks into the stream's channel, waiting for
/// room (so memory stays at `AHEAD` chunks whatever the reader's pace).
struct Chunks {
    tx: mpsc::Sender<Result<pb::PeerSnapshotChunk, Status>>,
    buf: Vec<u8>,
    metrics: Arc<Metrics>,
}

impl Chunks {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        let n = data.len() as u64;
        self.tx
            .blocking_send(Ok(pb::PeerSnapshotChunk { data }))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the peer left"))?;
        self.metrics.peer_snapshot_bytes_sent.inc_by(n);
        Ok(())
    }
}

impl Write for Chunks {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let n = bytes.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&bytes[..n]);
        if self.buf.len() == CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

//! Replicas of one fleet: a starting replica copies a Ready peer's index
//! before it reports Ready (`bootstrap`), and a Ready replica serves its
//! index to the ones starting (`serve`).
//!
//! What is copied is exactly what `--snapshot-dir` writes (the same format,
//! the same checks): every pod's blocks and its place in its stream, cut at
//! one instant. The copy then follows each pod from there as after a
//! snapshot load: live batches, and the gap between the copy's seq and the
//! live stream repaired from the pod's replay buffer. So a replica started
//! now holds the prefixes every request shares, which vLLM never publishes
//! again while it keeps them.
//!
//! Routing feedback reaches every replica: a `RecordRouting` one replica
//! accepted is forwarded to the others (`forward`), whose pods' writers
//! make the same speculative entries, ending at the same instant.
//!
//! Only replicas may copy or forward: the caller presents the fleet's shared secret
//! (`--peer-token-file`) or a client certificate the server's TLS trusts;
//! with neither configured the RPC is refused. A peer whose key
//! configuration or snapshot format differs is refused by name, never
//! misread.

pub mod bootstrap;
pub mod forward;
pub mod serve;

/// Metadata key of the shared secret (`Bearer <secret>`).
const AUTHORIZATION: &str = "authorization";

/// `request` presents the fleet's secret, if there is one; an error if the
/// secret cannot be a header value.
fn present<T>(
    request: &mut tonic::Request<T>,
    token: Option<&crate::config::Secret>,
) -> Result<(), tonic::metadata::errors::InvalidMetadataValue> {
    if let Some(crate::config::Secret(token)) = token {
        let value = format!("Bearer {token}").parse()?;
        request.metadata_mut().insert(AUTHORIZATION, value);
    }
    Ok(())
}

/// Now, as Unix time in milliseconds: how replicas name one instant.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Bytes per streamed chunk: a few HTTP/2 frames (the server's are 256 KiB)
/// and far below any message limit.
const CHUNK: usize = 1 << 20;

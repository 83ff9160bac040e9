//! vLLM's replay protocol, client side: a DEALER asks a pod's ROUTER for
//! every buffered batch from `start_seq` on.
//!
//! Request: `["", start_seq (8-byte big-endian)]`. Replies, after the empty
//! delimiter: `[topic, seq, payload]` (vLLM >= 0.26) or `[seq, payload]`
//! (older), then an end marker whose seq is `0xffff_ffff_ffff_ffff` with an
//! empty payload.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

pub const END_SEQ: u64 = u64::MAX;

/// One replayed batch.
#[derive(Clone, Debug)]
pub struct Replayed {
    /// Absent in the older two-frame form.
    pub topic: Option<Bytes>,
    pub seq: u64,
    pub payload: Bytes,
}

/// Fetches every buffered batch with seq >= `start_seq`, or fails within
/// `timeout` (a pod that is gone must not stall repair forever).
pub async fn fetch(
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> Result<Vec<Replayed>, String> {
    tokio::time::timeout(timeout, fetch_inner(endpoint, start_seq))
        .await
        .map_err(|_| format!("no complete replay from {endpoint} within {timeout:?}"))?
}

async fn fetch_inner(endpoint: &str, start_seq: u64) -> Result<Vec<Replayed>, String> {
    let mut socket = DealerSocket::new();
    socket
        .connect(endpoint)
        .await
        .map_err(|e| format!("connect {endpoint}: {e}"))?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ])
    .map_err(|_| "empty request".to_owned())?;
    socket
        .send(request)
        .await
        .map_err(|e| format!("send to {endpoint}: {e}"))?;
    let mut out = Vec::new();
    loop {
        let msg = socket
            .recv()
            .await
            .map_err(|e| format!("receive from {endpoint}: {e}"))?;
        let mut frames = msg.into_vec();
        if frames.first().is_some_and(|f| f.is_empty()) {
            frames.remove(0);
        }
        let (topic, seq, payload) = match frames.len() {
            2 => (None, &frames[0], frames[1].clone()),
            3 => (Some(frames[0].clone()), &frames[1], frames[2].clone()),
            n => return Err(format!("replay reply with {n} frames from {endpoint}")),
        };
        let seq: [u8; 8] = seq
            .as_ref()
            .try_into()
            .map_err(|_| format!("replay reply with a {}-byte seq", seq.len()))?;
        let seq = u64::from_be_bytes(seq);
        if seq == END_SEQ {
            return Ok(out);
        }
        out.push(Replayed {
            topic: topic.filter(|t| !t.is_empty()),
            seq,
            payload,
        });
    }
}

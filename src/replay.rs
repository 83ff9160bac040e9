//! vLLM's replay protocol, client side: a DEALER asks a pod's ROUTER for
//! every buffered batch from `start_seq` on.
//!
//! Request: `["", start_seq (8-byte big-endian)]`. Replies, after the empty
//! delimiter: `[topic, seq, payload]` (vLLM >= 0.26) or `[seq, payload]`
//! (older), then an end marker whose seq is `0xffff_ffff_ffff_ffff` with an
//! empty payload.
//!
//! libzmq blocks: callers run [`fetch`] on a thread of their own (the
//! workers use the runtime's blocking pool), never on an async worker.

use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::zmq_io::{self, ReceiveLimits};

pub const END_SEQ: u64 = u64::MAX;

/// One replayed batch.
#[derive(Clone, Debug)]
pub struct Replayed {
    /// Absent in the older two-frame form.
    pub topic: Option<Bytes>,
    pub seq: u64,
    pub payload: Bytes,
}

/// Most bytes one replay reply may bring in. vLLM's buffer holds 10,000
/// batches by default, mostly small decode batches (a few MB in all); a
/// pod that answers with more is refused rather than trusted with memory.
pub const MAX_REPLY_BYTES: usize = 256 << 20;

/// Fetches every buffered batch with seq >= `start_seq`, or fails within
/// `timeout` (a pod that is gone must not stall repair forever). Each
/// frame is bounded by `limits.max_message_bytes`, the reply by
/// [`MAX_REPLY_BYTES`].
pub fn fetch(
    context: &zmq::Context,
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
    limits: ReceiveLimits,
) -> Result<Vec<Replayed>, String> {
    let deadline = Instant::now() + timeout;
    let socket = context
        .socket(zmq::DEALER)
        .map_err(|e| format!("replay socket: {e}"))?;
    zmq_io::limit(&socket, limits).map_err(|e| format!("replay socket options: {e}"))?;
    socket
        .connect(endpoint)
        .map_err(|e| format!("connect {endpoint}: {e}"))?;
    socket
        .send_multipart([&b""[..], &start_seq.to_be_bytes()], 0)
        .map_err(|e| format!("send to {endpoint}: {e}"))?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "no complete replay from {endpoint} within {timeout:?}"
            ));
        }
        socket
            .set_rcvtimeo(i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX))
            .map_err(|e| format!("replay socket options: {e}"))?;
        let mut frames = match socket.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => {
                return Err(format!(
                    "no complete replay from {endpoint} within {timeout:?}"
                ))
            }
            Err(e) => return Err(format!("receive from {endpoint}: {e}")),
        };
        bytes += frames.iter().map(Vec::len).sum::<usize>();
        if bytes > MAX_REPLY_BYTES {
            return Err(format!(
                "replay from {endpoint} exceeds {MAX_REPLY_BYTES} bytes; refused"
            ));
        }
        if frames.first().is_some_and(|f| f.is_empty()) {
            frames.remove(0);
        }
        let (topic, seq, payload) = match frames.len() {
            2 => {
                let payload = frames.pop().unwrap_or_default();
                (None, frames.pop().unwrap_or_default(), payload)
            }
            3 => {
                let payload = frames.pop().unwrap_or_default();
                let seq = frames.pop().unwrap_or_default();
                (frames.pop(), seq, payload)
            }
            n => return Err(format!("replay reply with {n} frames from {endpoint}")),
        };
        let seq: [u8; 8] = seq[..]
            .try_into()
            .map_err(|_| format!("replay reply with a {}-byte seq", seq.len()))?;
        let seq = u64::from_be_bytes(seq);
        if seq == END_SEQ {
            return Ok(out);
        }
        out.push(Replayed {
            topic: topic.filter(|t| !t.is_empty()).map(Bytes::from),
            seq,
            payload: Bytes::from(payload),
        });
    }
}

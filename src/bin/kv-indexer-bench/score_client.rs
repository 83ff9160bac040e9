//! The load generator's Score client: unary gRPC calls with a pre-encoded
//! request, written on `h2` directly.
//!
//! Why not tonic's `Channel`: the load generator shares the two cores with
//! the service it measures, so every microsecond it spends is one the
//! service may wait for. A `Channel` sends each call through a buffer task
//! (one more task hop, often a cross-thread wake-up, per request) and
//! copies the ~130 KB message into its encode buffer. Dynamo's side of the
//! peer part is driven by a hand-written HTTP/1.1 client; this is ours at
//! the same weight: the same HTTP/2 and gRPC on the wire (headers, the
//! 5-byte message prefix, `grpc-status` in the trailers, checked), the
//! prefixed message built once and handed to h2 by reference count.

use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use tokio::net::TcpStream;
use tonic::codegen::http;

use super::pb;

/// Connections to one service, used round robin by call index.
#[derive(Clone)]
pub struct ScoreClient {
    connections: Arc<Vec<h2::client::SendRequest<Bytes>>>,
    uri: http::Uri,
}

impl ScoreClient {
    /// Opens `n` HTTP/2 connections to `addr` (`host:port`).
    pub async fn connect(addr: &str, n: usize) -> std::io::Result<ScoreClient> {
        let mut connections = Vec::with_capacity(n);
        for _ in 0..n {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            // tonic's client windows (hyper's defaults): a response never
            // waits for a WINDOW_UPDATE.
            let (send, connection) = h2::client::Builder::new()
                .initial_window_size(2 << 20)
                .initial_connection_window_size(5 << 20)
                .handshake::<_, Bytes>(tcp)
                .await
                .map_err(std::io::Error::other)?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            connections.push(send);
        }
        let uri = format!("http://{addr}/kvindexer.v1.KvIndexer/Score")
            .parse()
            .map_err(std::io::Error::other)?;
        Ok(ScoreClient {
            connections: Arc::new(connections),
            uri,
        })
    }

    /// One Score call on connection `i % n` with `message`, a request as
    /// `grpc_message` frames it; returns the answer's pods and the time
    /// the service says its handler took, or what went wrong.
    pub async fn score(
        &self,
        i: usize,
        message: Bytes,
    ) -> Result<(usize, Option<std::time::Duration>), String> {
        let connection = &self.connections[i % self.connections.len()];
        let mut send = connection
            .clone()
            .ready()
            .await
            .map_err(|e| format!("connection: {e}"))?;
        let request = http::Request::post(self.uri.clone())
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header(kv_indexer::grpc::TIMING_REQUEST, "1")
            .body(())
            .map_err(|e| e.to_string())?;
        let (response, mut stream) = send
            .send_request(request, false)
            .map_err(|e| format!("send: {e}"))?;
        stream
            .send_data(message, true)
            .map_err(|e| format!("send: {e}"))?;
        let response = response.await.map_err(|e| format!("response: {e}"))?;
        if response.status() != http::StatusCode::OK {
            return Err(format!("HTTP status {}", response.status()));
        }
        // A failed call may be "trailers only": its status in the headers.
        if let Some(status) = response.headers().get("grpc-status") {
            return Err(format!("grpc-status {status:?} without a message"));
        }
        let handler = response
            .headers()
            .get(kv_indexer::grpc::TIMING_RESPONSE)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map(std::time::Duration::from_micros);
        let mut body = response.into_body();
        let mut received = BytesMut::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.map_err(|e| format!("body: {e}"))?;
            let _ = body.flow_control().release_capacity(chunk.len());
            received.extend_from_slice(&chunk);
        }
        let trailers = body
            .trailers()
            .await
            .map_err(|e| format!("trailers: {e}"))?
            .ok_or("no trailers")?;
        match trailers.get("grpc-status").map(|s| s.as_bytes()) {
            Some(b"0") => {}
            other => return Err(format!("grpc-status {other:?}: {trailers:?}")),
        }
        let answer = grpc_unframe(received.freeze())?;
        let answer: pb::ScoreResponse =
            prost::Message::decode(answer).map_err(|e| format!("ScoreResponse: {e}"))?;
        Ok((answer.pods.len(), handler))
    }
}

/// A gRPC message on the wire: not compressed, its length, then it.
pub fn grpc_message(encoded: &[u8]) -> Bytes {
    let mut framed = BytesMut::with_capacity(5 + encoded.len());
    framed.extend_from_slice(&[0]);
    framed.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    framed.extend_from_slice(encoded);
    framed.freeze()
}

/// The one message of a unary answer.
fn grpc_unframe(mut body: Bytes) -> Result<Bytes, String> {
    if body.len() < 5 {
        return Err(format!("a {}-byte answer", body.len()));
    }
    let compressed = body.get_u8();
    let len = body.get_u32() as usize;
    if compressed != 0 || body.len() != len {
        return Err(format!(
            "answer prefix: compressed {compressed}, length {len} of {}",
            body.len()
        ));
    }
    Ok(body)
}

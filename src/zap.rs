//! Who may publish: `--zmq-allow`, enforced by libzmq's ZAP hook.
//!
//! Anyone who reaches the event port can forge blocks and steer routing.
//! libzmq asks a ZAP handler (a REP socket on `inproc://zeromq.zap.01` in the
//! same context, RFC 27) about every new connection of a socket that has a
//! ZAP domain, before any message of that connection is delivered; the
//! request carries the peer's IP address even under the NULL mechanism
//! vLLM uses. We answer 200 for addresses inside an allowed network and 400
//! otherwise; libzmq then closes the refused connection itself.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use crate::metrics::Metrics;
use crate::ratelimit::RateLimited;

/// The ZAP domain our event sockets declare (any non-empty name turns ZAP
/// on for the NULL mechanism).
pub const DOMAIN: &str = "kv-indexer";
const ENDPOINT: &str = "inproc://zeromq.zap.01";

/// Whether a peer at `address` (ZAP's textual IP) may connect.
pub fn allowed(allow: &[IpNet], address: &str) -> bool {
    // IPv6 peers may come as `::ffff:10.0.0.1` (v4-mapped): test both forms.
    let Ok(ip) = address.parse::<IpAddr>() else {
        return false;
    };
    let mapped = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4),
        IpAddr::V4(_) => None,
    };
    allow
        .iter()
        .any(|net| net.contains(&ip) || mapped.is_some_and(|m| net.contains(&m)))
}

/// One ZAP request's reply: `[version, request id, status, text, user, metadata]`.
fn reply(request: &[Vec<u8>], allow: &[IpNet]) -> Option<(bool, String, Vec<Vec<u8>>)> {
    // [version, request id, domain, address, routing id, mechanism, credentials...]
    let (version, id, address) = (request.first()?, request.get(1)?, request.get(3)?);
    let address = String::from_utf8_lossy(address).into_owned();
    let ok = allowed(allow, &address);
    let (code, text): (&[u8], &[u8]) = if ok {
        (b"200", b"OK")
    } else {
        (b"400", b"address not allowed by --zmq-allow")
    };
    let frames = vec![
        version.clone(),
        id.clone(),
        code.to_vec(),
        text.to_vec(),
        Vec::new(),
        Vec::new(),
    ];
    Some((ok, address, frames))
}

/// The running handler; stops when dropped.
pub struct ZapHandler {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ZapHandler {
    /// Binds the handler in `context`; sockets of that context that set
    /// [`DOMAIN`] are then checked against `allow`.
    pub fn start(
        context: &zmq::Context,
        allow: Vec<IpNet>,
        metrics: Arc<Metrics>,
    ) -> Result<ZapHandler, String> {
        let socket = context
            .socket(zmq::REP)
            .map_err(|e| format!("ZAP socket: {e}"))?;
        socket
            .set_linger(0)
            .and_then(|()| socket.set_rcvtimeo(100))
            .and_then(|()| socket.bind(ENDPOINT))
            .map_err(|e| format!("ZAP handler bind: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("zmq-zap".into())
            .spawn(move || serve(socket, &allow, &metrics, &stopping))
            .map_err(|e| format!("ZAP handler thread: {e}"))?;
        tracing::info!("ZeroMQ connections checked against --zmq-allow");
        Ok(ZapHandler {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for ZapHandler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn serve(socket: zmq::Socket, allow: &[IpNet], metrics: &Metrics, stop: &AtomicBool) {
    let warn = RateLimited::new(Duration::from_secs(10));
    while !stop.load(Ordering::Relaxed) {
        let Ok(request) = socket.recv_multipart(0) else {
            continue; // timeout: check `stop`
        };
        let Some((ok, address, frames)) = reply(&request, allow) else {
            // Malformed (cannot come from libzmq itself): REP still owes
            // an answer before it can receive again.
            let _ = socket.send_multipart([&b"1.0"[..], b"", b"500", b"bad request", b"", b""], 0);
            continue;
        };
        if !ok {
            metrics.refuse("connection");
            warn.warn(|suppressed| {
                tracing::warn!(%address, suppressed, "ZeroMQ connection refused: address not in --zmq-allow")
            });
        }
        let _ = socket.send_multipart(frames, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn addresses_are_matched_against_networks() {
        let allow = nets(&["10.0.0.0/8", "192.168.1.7/32", "fd00::/8"]);
        assert!(allowed(&allow, "10.1.2.3"));
        assert!(allowed(&allow, "192.168.1.7"));
        assert!(!allowed(&allow, "192.168.1.8"));
        assert!(allowed(&allow, "fd12::1"));
        assert!(allowed(&allow, "::ffff:10.9.9.9"), "v4-mapped v6 peer");
        assert!(!allowed(&allow, "127.0.0.1"));
        assert!(!allowed(&allow, "not an address"));
        assert!(!allowed(&[], "10.1.2.3"));
    }

    #[test]
    fn replies_carry_the_request_id_and_a_status() {
        let request: Vec<Vec<u8>> = [
            &b"1.0"[..],
            b"42",
            DOMAIN.as_bytes(),
            b"127.0.0.1",
            b"",
            b"NULL",
        ]
        .iter()
        .map(|f| f.to_vec())
        .collect();
        let (ok, _, frames) = reply(&request, &nets(&["127.0.0.0/8"])).unwrap();
        assert!(ok);
        assert_eq!(frames[1], b"42");
        assert_eq!(frames[2], b"200");
        let (ok, _, frames) = reply(&request, &nets(&["10.0.0.0/8"])).unwrap();
        assert!(!ok);
        assert_eq!(frames[2], b"400");
        assert!(reply(&request[..2], &[]).is_none());
    }

    #[test]
    fn libzmq_refuses_a_peer_outside_the_allow_list() {
        let context = zmq::Context::new();
        let metrics = Arc::new(Metrics::new());
        let _zap = ZapHandler::start(&context, nets(&["10.0.0.0/8"]), metrics.clone()).unwrap();
        let sub = context.socket(zmq::SUB).unwrap();
        sub.set_zap_domain(DOMAIN).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(20).unwrap();
        sub.bind("tcp://127.0.0.1:0").unwrap();
        let endpoint = crate::zmq_io::last_endpoint(&sub).unwrap();
        let publisher = crate::zmq_io::Publisher::connect(&context, &endpoint).unwrap();
        for _ in 0..50 {
            publisher
                .send(&[bytes::Bytes::from_static(b"forged")])
                .unwrap();
            assert!(
                sub.recv_multipart(0).is_err(),
                "a refused peer's message arrived"
            );
        }
        assert!(
            metrics.refused("connection") > 0,
            "the refusal was not counted"
        );
    }
}

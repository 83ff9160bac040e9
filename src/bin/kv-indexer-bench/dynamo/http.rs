//! A minimal HTTP/1.1 client for Dynamo's API, and what its Prometheus
//! metrics say it applied and spent.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A minimal HTTP/1.1 client for Dynamo's API: keep-alive connections
/// (`TCP_NODELAY`), one request in flight on each, idle ones reused.
pub(super) struct Http {
    addr: SocketAddr,
    idle: parking_lot::Mutex<Vec<TcpStream>>,
}

pub(super) fn http_request(method: &str, path: &str, body: &[u8]) -> bytes::Bytes {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nHost: peer\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r.into()
}

impl Http {
    pub(super) fn new(addr: SocketAddr) -> Http {
        Http {
            addr,
            idle: parking_lot::Mutex::new(Vec::new()),
        }
    }

    pub(super) async fn get(&self, path: &str) -> std::io::Result<(u16, Vec<u8>)> {
        self.send(&http_request("GET", path, b"")).await
    }

    pub(super) async fn post(&self, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        self.send(&http_request("POST", path, body)).await
    }

    /// Opens `n` connections ahead of the load, so that requests do not pay
    /// a connect.
    pub(super) async fn warm(&self, n: usize) -> std::io::Result<()> {
        let open = self.idle.lock().len();
        for _ in open..n {
            let s = self.open().await?;
            self.idle.lock().push(s);
        }
        Ok(())
    }

    async fn open(&self) -> std::io::Result<TcpStream> {
        let s = TcpStream::connect(self.addr).await?;
        s.set_nodelay(true)?;
        Ok(s)
    }

    /// Sends a request written whole by [`http_request`]; returns the
    /// status and the body (which must come with a `Content-Length`).
    pub(super) async fn send(&self, request: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        let idle = self.idle.lock().pop();
        let mut s = match idle {
            Some(s) => s,
            None => self.open().await?,
        };
        s.write_all(request).await?;
        let bad =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
        let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
        let head_end = loop {
            if s.read_buf(&mut buf).await? == 0 {
                return Err(bad("connection closed before the response"));
            }
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
        };
        let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| bad("head not UTF-8"))?;
        let mut lines = head.split("\r\n");
        let status: u16 = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| bad("no status"))?;
        let mut length = None;
        let mut close = false;
        for l in lines {
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim(), v.trim());
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.parse::<usize>().ok();
                } else if k.eq_ignore_ascii_case("connection") {
                    close = v.eq_ignore_ascii_case("close");
                }
            }
        }
        let length = length.ok_or_else(|| bad("no Content-Length"))?;
        let start = head_end + 4;
        while buf.len() < start + length {
            if s.read_buf(&mut buf).await? == 0 {
                return Err(bad("connection closed inside the body"));
            }
        }
        if !close && buf.len() == start + length {
            self.idle.lock().push(s);
        }
        Ok((status, buf[start..start + length].to_vec()))
    }

    /// Dynamo's Prometheus text.
    async fn metrics(&self) -> String {
        let (status, body) = self.get("/metrics").await.expect("GET /metrics");
        assert_eq!(status, 200, "GET /metrics");
        String::from_utf8_lossy(&body).into_owned()
    }
}

/// Sum of a metric's samples whose labels contain every `label`.
fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Dynamo's applied events: `(ok, any other status)`.
pub(super) async fn dynamo_events(http: &Http) -> (u64, u64) {
    const NAME: &str = "dynamo_kvrouter_kv_cache_events_applied";
    let text = http.metrics().await;
    let all = metric_sum(&text, NAME, &[]);
    let ok = metric_sum(&text, NAME, &["status=\"ok\""]);
    (ok as u64, (all - ok) as u64)
}

/// Dynamo's own time in `/query` so far (seconds, requests): its request
/// middleware, which includes reading and parsing the JSON body.
pub(super) async fn dynamo_query_time(http: &Http) -> (f64, f64) {
    const NAME: &str = "dynamo_kvindexer_request_duration_seconds";
    let text = http.metrics().await;
    let on = ["endpoint=\"/query\""];
    (
        metric_sum(&text, &format!("{NAME}_sum"), &on),
        metric_sum(&text, &format!("{NAME}_count"), &on),
    )
}

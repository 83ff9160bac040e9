//! Who holds one of a listener's `--max-connections` slots, and whom a new
//! connection takes its slot from.
//!
//! Every connection costs a file descriptor and a protocol state machine,
//! so a listener holds at most `max` of them. Refusing the newest when the
//! table is full lets anyone who opens `max` idle connections (a broken
//! scraper, a slowloris, anyone on the cluster network) lock out the
//! kubelet's probes, which open a fresh connection every period and must
//! answer within 1 s, or the pod is restarted. So a new connection is always
//! admitted, and when the table is full the one that has waited longest
//! since it last sent a byte is closed instead: idle and slow connections go
//! first, a client in the middle of a request goes last, and a probe (which
//! sends its request as soon as it connects) is answered long before it
//! could be the oldest. Shedding wakes the victim's task and fails its next
//! read, so its protocol state closes at once.
//!
//! A connection must also send its first bytes (an HTTP/2 preface, a TLS
//! ClientHello, a request line) within [`FIRST_BYTES_TIMEOUT`]: one that
//! sends nothing, or a byte every few seconds, never holds a slot longer.
//!
//! Shed connections leave the table when their task drops them, a moment
//! later; the table refuses outright only if twice `max` are still open
//! (victims that did not close yet), which bounds descriptors whatever
//! clients do.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::metrics::Metrics;

/// How long a new connection has to send its first [`FIRST_BYTES`] bytes.
pub const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(5);

/// The shortest opening any client of ours sends at once: HTTP/2's preface
/// is 24 bytes, a TLS ClientHello and an HTTP/1 request line more.
const FIRST_BYTES: u64 = 24;

/// The connections of one listener.
#[derive(Clone)]
pub struct Admission {
    table: Arc<Table>,
}

struct Table {
    max: usize,
    first_bytes_timeout: Duration,
    epoch: Instant,
    conns: Mutex<Conns>,
    /// This listener's series, found once: connections open, shed for a
    /// newer one, shed for sending nothing in time.
    open: Gauge,
    shed_full: Counter,
    shed_first_bytes: Counter,
    /// `kv_indexer_refused_total`'s `what` for this listener.
    refused: &'static str,
    metrics: Arc<Metrics>,
}

#[derive(Default)]
struct Conns {
    next_id: u64,
    open: HashMap<u64, Arc<Conn>>,
    /// Of `open`, those already told to close.
    shed: usize,
}

/// What the table knows of one connection; its reads update it.
struct Conn {
    /// Milliseconds since the table's epoch at which it last sent a byte
    /// (or opened).
    last_read_ms: AtomicU64,
    shed: AtomicBool,
    /// The task reading the connection, woken when it is shed.
    reader: AtomicWaker,
}

impl Admission {
    pub fn new(listener: &'static str, max: usize, metrics: Arc<Metrics>) -> Admission {
        Admission::with_timeout(listener, max, FIRST_BYTES_TIMEOUT, metrics)
    }

    fn with_timeout(
        listener: &'static str,
        max: usize,
        first_bytes_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Admission {
        let shed = |reason: &str| {
            metrics
                .connections_shed
                .get_or_create(&vec![
                    ("listener", listener.to_owned()),
                    ("reason", reason.to_owned()),
                ])
                .clone()
        };
        let open = metrics
            .connections
            .get_or_create(&vec![("listener", listener.to_owned())])
            .clone();
        let (shed_full, shed_first_bytes) = (shed("full"), shed("first_bytes"));
        Admission {
            table: Arc::new(Table {
                max,
                first_bytes_timeout,
                epoch: Instant::now(),
                conns: Mutex::new(Conns::default()),
                open,
                shed_full,
                shed_first_bytes,
                refused: match listener {
                    "grpc" => "grpc_connection",
                    _ => "http_connection",
                },
                metrics,
            }),
        }
    }

    /// `stream` with a slot, taken from the connection that has been
    /// silent longest if every slot is held; `None` (the stream is closed)
    /// only while twice `max` shed connections have not closed yet.
    pub fn admit(&self, stream: TcpStream) -> Option<Admitted> {
        let table = &self.table;
        let now = table.now_ms();
        let conn = Arc::new(Conn {
            last_read_ms: AtomicU64::new(now),
            shed: AtomicBool::new(false),
            reader: AtomicWaker::new(),
        });
        let id = {
            let mut conns = table.conns.lock().unwrap_or_else(|e| e.into_inner());
            if conns.open.len() >= table.max.saturating_mul(2) {
                drop(conns);
                table.metrics.refuse(table.refused);
                return None;
            }
            if conns.open.len() - conns.shed >= table.max {
                let victim = conns
                    .open
                    .values()
                    .filter(|c| !c.shed.load(Ordering::Relaxed))
                    .min_by_key(|c| c.last_read_ms.load(Ordering::Relaxed))
                    .cloned();
                if let Some(victim) = victim {
                    victim.shed();
                    conns.shed += 1;
                    table.shed_full.inc();
                }
            }
            let id = conns.next_id;
            conns.next_id += 1;
            conns.open.insert(id, conn.clone());
            id
        };
        table.open.inc();
        Some(Admitted {
            stream,
            conn,
            id,
            table: table.clone(),
            first_bytes: Some(Box::pin(tokio::time::sleep(table.first_bytes_timeout))),
            bytes_read: 0,
        })
    }
}

impl Table {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

impl Conn {
    fn shed(&self) {
        self.shed.store(true, Ordering::Relaxed);
        self.reader.wake();
    }
}

/// An admitted connection: the stream, and its entry in the table, which
/// it leaves when dropped.
pub struct Admitted {
    stream: TcpStream,
    conn: Arc<Conn>,
    id: u64,
    table: Arc<Table>,
    /// Until the first bytes arrive: the deadline for them.
    first_bytes: Option<Pin<Box<tokio::time::Sleep>>>,
    bytes_read: u64,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut conns = self.table.conns.lock().unwrap_or_else(|e| e.into_inner());
        if conns.open.remove(&self.id).is_some() && self.conn.shed.load(Ordering::Relaxed) {
            conns.shed -= 1;
        }
        drop(conns);
        self.table.open.dec();
    }
}

fn closed() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "connection shed for a newer one (--max-connections)",
    )
}

impl Admitted {
    /// Shed by the table, or out of time for its first bytes.
    fn check(&mut self, cx: &mut Context<'_>) -> std::io::Result<()> {
        self.conn.reader.register(cx.waker());
        if self.conn.shed.load(Ordering::Relaxed) {
            return Err(closed());
        }
        if let Some(deadline) = &mut self.first_bytes {
            if deadline.as_mut().poll(cx).is_ready() {
                // Counted as shed, so the drop does not count it again; and
                // once, if the table shed it meanwhile.
                let mut conns = self.table.conns.lock().unwrap_or_else(|e| e.into_inner());
                if !self.conn.shed.swap(true, Ordering::Relaxed) {
                    conns.shed += 1;
                    self.table.shed_first_bytes.inc();
                }
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no request within the first-bytes timeout",
                ));
            }
        }
        Ok(())
    }
}

impl Connected for Admitted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Err(e) = self.check(cx) {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        let read = (buf.filled().len() - before) as u64;
        if read > 0 {
            let now = self.table.now_ms();
            self.conn.last_read_ms.store(now, Ordering::Relaxed);
            self.bytes_read += read;
            if self.bytes_read >= FIRST_BYTES {
                self.first_bytes = None;
            }
        }
        polled
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.conn.shed.load(Ordering::Relaxed) {
            return Poll::Ready(Err(closed()));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.conn.shed.load(Ordering::Relaxed) {
            return Poll::Ready(Err(closed()));
        }
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn pair(listener: &tokio::net::TcpListener) -> (TcpStream, TcpStream) {
        let client = TcpStream::connect(listener.local_addr().unwrap());
        let (client, accepted) = tokio::join!(client, listener.accept());
        (client.unwrap(), accepted.unwrap().0)
    }

    fn shed(metrics: &Metrics, reason: &str) -> u64 {
        metrics
            .connections_shed
            .get_or_create(&vec![
                ("listener", "grpc".to_owned()),
                ("reason", reason.to_owned()),
            ])
            .get()
    }

    #[tokio::test]
    async fn a_full_table_sheds_the_connection_silent_longest() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics = Arc::new(Metrics::new());
        let admission = Admission::new("grpc", 2, metrics.clone());
        let (mut quiet_client, quiet) = pair(&listener).await;
        let mut quiet = admission.admit(quiet).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let (mut busy_client, busy) = pair(&listener).await;
        let mut busy = admission.admit(busy).unwrap();
        // The older connection speaks after the newer one opened: the
        // newer one is now the one silent longest.
        tokio::time::sleep(Duration::from_millis(5)).await;
        busy_client.write_all(b"x").await.unwrap();
        busy.read_exact(&mut [0u8; 1]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        quiet_client.write_all(b"y").await.unwrap();
        quiet.read_exact(&mut [0u8; 1]).await.unwrap();
        let (_client, third) = pair(&listener).await;
        let _third = admission.admit(third).expect("a full table admits");
        assert_eq!(shed(&metrics, "full"), 1);
        let err = busy.read(&mut [0u8; 1]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionAborted);
        assert!(quiet.write_all(b"still open").await.is_ok());
        // Its slot returns when it is dropped; until then, up to twice the
        // bound are open and no more.
        let mut more = Vec::new();
        for _ in 0..4 {
            let (client, conn) = pair(&listener).await;
            more.push((client, admission.admit(conn)));
        }
        let admitted = more.iter().filter(|(_, a)| a.is_some()).count();
        assert_eq!(admitted, 1, "4 open of a bound of 2, yet more admitted");
        assert_eq!(metrics.refused("grpc_connection"), 3);
        drop(busy);
        drop(more);
        let (_client, conn) = pair(&listener).await;
        assert!(admission.admit(conn).is_some());
    }

    #[tokio::test]
    async fn a_connection_that_sends_nothing_in_time_is_closed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics = Arc::new(Metrics::new());
        let admission =
            Admission::with_timeout("grpc", 8, Duration::from_millis(300), metrics.clone());
        let (mut prompt_client, prompt) = pair(&listener).await;
        let (mut slow_client, slow) = pair(&listener).await;
        let (mut prompt, mut slow) = (
            admission.admit(prompt).unwrap(),
            admission.admit(slow).unwrap(),
        );
        prompt_client.write_all(&[b'p'; 24]).await.unwrap();
        prompt.read_exact(&mut [0u8; 24]).await.unwrap();
        // A byte now and then is not an opening.
        slow_client.write_all(b"P").await.unwrap();
        slow.read_exact(&mut [0u8; 1]).await.unwrap();
        let err = slow.read(&mut [0u8; 1]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(shed(&metrics, "first_bytes"), 1);
        // The one that sent its opening has no deadline.
        prompt_client.write_all(b"late").await.unwrap();
        let mut late = [0u8; 4];
        prompt.read_exact(&mut late).await.unwrap();
        assert_eq!(&late, b"late");
    }
}

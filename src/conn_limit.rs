//! At most `--max-connections` gRPC connections at once.
//!
//! Every connection costs a file descriptor and an HTTP/2 state machine;
//! without a bound, a client that opens connections and never closes them
//! takes the process's descriptors from everyone else (new clients, the
//! health port). Each accepted connection carries a semaphore permit that
//! returns when tonic drops the connection; beyond the bound a new
//! connection is closed at once and counted.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// An accepted connection holding one of the slots.
pub struct Limited {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

/// Hands out slots for accepted connections.
#[derive(Clone)]
pub struct ConnectionLimit {
    slots: Arc<Semaphore>,
}

impl ConnectionLimit {
    pub fn new(max: usize) -> ConnectionLimit {
        ConnectionLimit {
            slots: Arc::new(Semaphore::new(max)),
        }
    }

    /// The connection with a slot, or `None` when every slot is taken
    /// (dropping the stream closes it).
    pub fn admit(&self, stream: TcpStream) -> Option<Limited> {
        let slot = self.slots.clone().try_acquire_owned().ok()?;
        Some(Limited {
            stream,
            _slot: slot,
        })
    }
}

impl Connected for Limited {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Limited {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
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

    #[tokio::test]
    async fn slots_return_when_connections_close() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limit = ConnectionLimit::new(2);
        let mut clients = Vec::new();
        let mut admitted = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.unwrap());
            let (stream, _) = listener.accept().await.unwrap();
            admitted.push(limit.admit(stream));
        }
        assert!(admitted[0].is_some() && admitted[1].is_some());
        assert!(admitted[2].is_none(), "a third connection was admitted");
        admitted.remove(0);
        clients.push(TcpStream::connect(addr).await.unwrap());
        let (stream, _) = listener.accept().await.unwrap();
        assert!(
            limit.admit(stream).is_some(),
            "a closed connection's slot did not return"
        );
    }
}

//! ZeroMQ through libzmq, the reference implementation (what vLLM itself
//! publishes with, through pyzmq): the socket options every event socket
//! gets, the socket monitor's events, and a PUB socket for our own
//! publishers (demo, load tool, tests).
//!
//! libzmq's calls block, so every socket here lives on a thread of its own
//! (never on the async runtime's workers) and is only ever touched by that
//! thread: a `zmq::Socket` is `Send`, not `Sync`.
//!
//! Why these options: a frame header declares its size before the bytes
//! come, and a decoder that believes it allocates whatever a peer claims
//! (the `zeromq` crate we used before aborted the process on a 73-byte
//! message declaring 2^40 bytes). `ZMQ_MAXMSGSIZE` makes libzmq refuse such
//! a frame and drop that connection instead; `ZMQ_RCVHWM` bounds what it
//! queues per connection while our receive loop is busy.

use bytes::Bytes;

/// Limits of one receiving socket.
#[derive(Clone, Copy, Debug)]
pub struct ReceiveLimits {
    /// Largest frame accepted; a peer that sends a larger one is
    /// disconnected by libzmq before the frame is read.
    pub max_message_bytes: usize,
    /// Messages libzmq queues per connection before it stops reading from
    /// that peer (TCP backpressure; a PUB peer then drops at its own HWM).
    pub hwm: i32,
}

/// libzmq's default, kept explicit: with frames bounded by
/// `max_message_bytes` it bounds what one connection can park in memory.
pub const RECEIVE_HWM: i32 = 1000;

/// Applies the options every socket that receives from pods gets.
pub fn limit(socket: &zmq::Socket, limits: ReceiveLimits) -> zmq::Result<()> {
    socket.set_maxmsgsize(i64::try_from(limits.max_message_bytes).unwrap_or(i64::MAX))?;
    socket.set_rcvhwm(limits.hwm)?;
    // Closing a socket must never wait on undelivered messages.
    socket.set_linger(0)?;
    // A dialed pod that is down is retried every 100 ms at first, backing
    // off to 10 s (libzmq reconnects by itself; these are its knobs).
    socket.set_reconnect_ivl(100)?;
    socket.set_reconnect_ivl_max(10_000)?;
    // A peer that vanished without a FIN (a node lost, a partition) must
    // show as disconnected: ZMTP heartbeats (libzmq answers them itself,
    // vLLM's pyzmq too) close a connection silent for 30 s after a PING,
    // TCP keepalive catches what heartbeats cannot (a stuck handshake).
    socket.set_heartbeat_ivl(10_000)?;
    socket.set_heartbeat_timeout(30_000)?;
    socket.set_tcp_keepalive(1)?;
    socket.set_tcp_keepalive_idle(60)?;
    socket.set_tcp_keepalive_intvl(10)?;
    socket.set_tcp_keepalive_cnt(3)?;
    Ok(())
}

/// One event of a socket monitor (`zmq_socket_monitor`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MonitorEvent {
    pub event: zmq::SocketEvent,
    /// The event's value: for accepted and disconnected connections, the
    /// connection's file descriptor.
    pub value: u32,
    /// The endpoint the event is about (the peer for accepted connections).
    pub endpoint: String,
}

/// Starts monitoring `socket`'s connection events on an inproc PAIR socket.
/// `name` must be unique within the context.
pub fn monitor(
    context: &zmq::Context,
    socket: &zmq::Socket,
    name: &str,
) -> zmq::Result<zmq::Socket> {
    let endpoint = format!("inproc://monitor-{name}");
    let events = zmq::SocketEvent::CONNECTED as i32
        | zmq::SocketEvent::ACCEPTED as i32
        | zmq::SocketEvent::DISCONNECTED as i32
        | zmq::SocketEvent::HANDSHAKE_FAILED_AUTH as i32
        | zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32;
    socket.monitor(&endpoint, events)?;
    let pair = context.socket(zmq::PAIR)?;
    pair.set_linger(0)?;
    pair.connect(&endpoint)?;
    Ok(pair)
}

/// A multipart message as libzmq handed it over: its first three frames,
/// not copied, and how many it had (the event shape has three; the rest of
/// a longer one is read and dropped).
pub struct Received {
    pub parts: [zmq::Message; 3],
    pub count: usize,
    /// The connection's file descriptor, if asked for (bind mode).
    pub fd: Option<i32>,
}

impl Received {
    /// The three frames of a message that has exactly three.
    pub fn three(&self) -> Option<[&[u8]; 3]> {
        let [a, b, c] = &self.parts;
        (self.count == 3).then(|| [&a[..], &b[..], &c[..]])
    }
}

/// Receives one multipart message, with the file descriptor of the
/// connection it came on when `want_fd` and libzmq says (its `__fd`
/// metadata property, which `ZMQ_SRCFD` reads; absent for inproc). A dialed
/// socket is one connection: it skips the lookup (a metadata search and
/// an integer parse per message). The frames are not copied here: a copy
/// of each, and a list of them, was four allocations a message, ~17% of
/// the dial thread's samples with 1-block batches.
pub fn recv_message(socket: &zmq::Socket, flags: i32, want_fd: bool) -> zmq::Result<Received> {
    let mut first = socket.recv_msg(flags)?;
    let fd = if want_fd {
        first.gets("__fd").and_then(|v| v.parse().ok())
    } else {
        None
    };
    let mut more = first.get_more();
    let mut received = Received {
        parts: [first, zmq::Message::new(), zmq::Message::new()],
        count: 1,
        fd,
    };
    while more {
        let part = socket.recv_msg(0)?;
        more = part.get_more();
        if let Some(slot) = received.parts.get_mut(received.count) {
            *slot = part;
        }
        received.count += 1;
    }
    Ok(received)
}

/// Reads every monitor event waiting on `pair`, without blocking.
pub fn drain_monitor(pair: &zmq::Socket) -> Vec<MonitorEvent> {
    let mut out = Vec::new();
    while let Ok(frames) = pair.recv_multipart(zmq::DONTWAIT) {
        // Frame 1: event id (u16) then value (u32), native byte order;
        // frame 2: the endpoint.
        let (Some(head), Some(endpoint)) = (frames.first(), frames.get(1)) else {
            continue;
        };
        if head.len() < 6 {
            continue;
        }
        out.push(MonitorEvent {
            event: zmq::SocketEvent::from_raw(u16::from_ne_bytes([head[0], head[1]])),
            value: u32::from_ne_bytes([head[2], head[3], head[4], head[5]]),
            endpoint: String::from_utf8_lossy(endpoint).into_owned(),
        });
    }
    out
}

/// A PUB socket standing in for vLLM's publisher (`ZmqEventPublisher`):
/// the demo, the load tool and the tests publish through it.
pub struct Publisher {
    socket: zmq::Socket,
}

/// vLLM's `ZmqEventPublisher` default high-water mark.
const VLLM_SEND_HWM: i32 = 100_000;

impl Publisher {
    fn new(context: &zmq::Context) -> zmq::Result<Publisher> {
        let socket = context.socket(zmq::PUB)?;
        socket.set_sndhwm(VLLM_SEND_HWM)?;
        socket.set_linger(0)?;
        Ok(Publisher { socket })
    }

    /// Connects to an indexer's bound SUB socket (vLLM pointed at it).
    pub fn connect(context: &zmq::Context, endpoint: &str) -> zmq::Result<Publisher> {
        let publisher = Publisher::new(context)?;
        publisher.socket.connect(endpoint)?;
        Ok(publisher)
    }

    /// Binds for an indexer to dial (vLLM's own default); returns the
    /// endpoint really bound (port 0 resolved).
    pub fn bind(context: &zmq::Context, endpoint: &str) -> zmq::Result<(Publisher, String)> {
        let publisher = Publisher::new(context)?;
        publisher.socket.bind(endpoint)?;
        let bound = last_endpoint(&publisher.socket)?;
        Ok((publisher, bound))
    }

    /// Publishes one multipart message. PUB never blocks: past the HWM,
    /// libzmq drops (as vLLM's publisher does).
    pub fn send(&self, frames: &[Bytes]) -> zmq::Result<()> {
        self.socket.send_multipart(frames.iter().map(|f| &f[..]), 0)
    }
}

/// The endpoint a socket really bound (`tcp://127.0.0.1:PORT` for port 0).
pub fn last_endpoint(socket: &zmq::Socket) -> zmq::Result<String> {
    Ok(match socket.get_last_endpoint()? {
        Ok(s) => s,
        Err(raw) => String::from_utf8_lossy(&raw).into_owned(),
    })
}

/// Why a bind failed, in words an operator can act on: a taken port names
/// the flag that chose it.
pub fn bind_error(endpoint: &str, e: zmq::Error) -> String {
    match e {
        zmq::Error::EADDRINUSE => {
            format!("{endpoint} is already in use (change --zmq-bind, or `none` to disable)")
        }
        e => format!("cannot bind {endpoint}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SUB socket limited to 1 KiB frames, bound on a free loopback port,
    /// its monitor, and a publisher connected to it.
    fn limited_sub(
        context: &zmq::Context,
        filter: &[u8],
        name: &str,
    ) -> (zmq::Socket, zmq::Socket, Publisher) {
        let sub = context.socket(zmq::SUB).unwrap();
        limit(
            &sub,
            ReceiveLimits {
                max_message_bytes: 1024,
                hwm: RECEIVE_HWM,
            },
        )
        .unwrap();
        sub.set_subscribe(filter).unwrap();
        let events = monitor(context, &sub, name).unwrap();
        sub.bind("tcp://127.0.0.1:0").unwrap();
        let endpoint = last_endpoint(&sub).unwrap();
        let publisher = Publisher::connect(context, &endpoint).unwrap();
        (sub, events, publisher)
    }

    #[test]
    fn publisher_reaches_a_limited_sub_socket_and_monitor_sees_it() {
        let context = zmq::Context::new();
        let (sub, events, publisher) = limited_sub(&context, b"kv@", "test");
        let frames = [
            Bytes::from_static(b"kv@p@m"),
            Bytes::copy_from_slice(&1u64.to_be_bytes()),
            Bytes::from_static(b"x"),
        ];
        sub.set_rcvtimeo(50).unwrap();
        // PUB drops until the subscription has arrived: publish until seen.
        let got = (0..200)
            .find_map(|_| {
                publisher.send(&frames).unwrap();
                sub.recv_multipart(0).ok()
            })
            .expect("no message arrived");
        assert_eq!(
            got,
            vec![
                b"kv@p@m".to_vec(),
                1u64.to_be_bytes().to_vec(),
                b"x".to_vec()
            ]
        );
        let seen = drain_monitor(&events);
        assert!(
            seen.iter().any(|e| e.event == zmq::SocketEvent::ACCEPTED),
            "{seen:?}"
        );
    }

    #[test]
    fn a_frame_over_the_limit_drops_the_connection_not_the_process() {
        let context = zmq::Context::new();
        let (sub, events, publisher) = limited_sub(&context, b"", "oversize");
        sub.set_rcvtimeo(20).unwrap();
        let big = [Bytes::from(vec![0u8; 4096])];
        let mut disconnected = false;
        for _ in 0..200 {
            publisher.send(&big).unwrap();
            assert!(
                sub.recv_multipart(0).is_err(),
                "an oversized frame was delivered"
            );
            if drain_monitor(&events)
                .iter()
                .any(|e| e.event == zmq::SocketEvent::DISCONNECTED)
            {
                disconnected = true;
                break;
            }
        }
        assert!(disconnected, "the oversized sender was never disconnected");
    }
}

//! Where the events come from: ZeroMQ endpoints to bind or dial, DNS names
//! to discover pods by, replay endpoints. Each parses from the one string a
//! flag, an environment variable or a YAML entry holds; errors are the
//! reason alone, the caller (clap, the file reader, the pods file) says
//! which setting it was.

use std::str::FromStr;

use super::{invalid, ConfigError, DialTarget};

/// `tcp://HOST:PORT`, checked; `*` is every interface. The ZeroMQ crate
/// speaks TCP only, so anything else would fail later and less clearly.
fn tcp_endpoint(raw: &str) -> Result<(&str, u16), String> {
    let rest = raw
        .strip_prefix("tcp://")
        .ok_or("only tcp:// endpoints are supported")?;
    let (host, port) = rest.rsplit_once(':').ok_or("want tcp://HOST:PORT")?;
    let port: u16 = port.parse().map_err(|_| "port must be a number 0-65535")?;
    if host.is_empty() {
        return Err("host is empty".into());
    }
    Ok((host, port))
}

/// `--zmq-bind`: the endpoint our SUB socket binds, `*` spelled `0.0.0.0`
/// (what the socket library wants).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindEndpoint(pub String);

impl FromStr for BindEndpoint {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let (host, port) = tcp_endpoint(raw.trim())?;
        let host = if host == "*" { "0.0.0.0" } else { host };
        Ok(BindEndpoint(format!("tcp://{host}:{port}")))
    }
}

/// `--zmq-connect tcp://HOST:PORT[,replay=tcp://HOST:PORT]`.
impl FromStr for DialTarget {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let mut parts = raw.trim().split(',').map(str::trim);
        let endpoint = parts.next().unwrap_or_default();
        let (host, port) = tcp_endpoint(endpoint)?;
        if host == "*" || port == 0 {
            return Err("a pod endpoint needs a host and a port".into());
        }
        let mut replay = None;
        for option in parts {
            match option.split_once('=') {
                Some(("replay", value)) => {
                    tcp_endpoint(value).map_err(|e| format!("replay endpoint: {e}"))?;
                    replay = Some(value.to_owned());
                }
                _ => return Err(format!("unknown option {option:?} (want replay=ENDPOINT)")),
            }
        }
        Ok(DialTarget {
            endpoint: endpoint.to_owned(),
            replay,
        })
    }
}

/// A dial target as the pods file (`discovery.rs`) reads them, with the
/// setting named as `--zmq-connect` would.
pub(crate) fn dial_target(raw: &str) -> Result<DialTarget, ConfigError> {
    raw.parse()
        .map_err(|reason: String| invalid("zmq_connect", raw, reason))
}

/// `--discover-dns NAME:PORT[,replay-port=PORT]`.
/// `--discover-dns NAME:PORT[,replay-port=P]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsTarget {
    pub name: String,
    pub port: u16,
    pub replay_port: Option<u16>,
}

impl FromStr for DnsTarget {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let mut parts = raw.trim().split(',').map(str::trim);
        let main = parts.next().unwrap_or_default();
        let (name, port) = main.rsplit_once(':').ok_or("want NAME:PORT")?;
        let port: u16 = port.parse().map_err(|_| "port must be a number 1-65535")?;
        if name.is_empty() || port == 0 {
            return Err("want NAME:PORT".into());
        }
        let mut replay_port = None;
        for option in parts {
            match option.split_once('=') {
                Some(("replay-port", p)) => {
                    replay_port = Some(p.parse().map_err(|_| "replay-port must be a number")?)
                }
                _ => return Err(format!("unknown option {option:?}")),
            }
        }
        Ok(DnsTarget {
            name: name.to_owned(),
            port,
            replay_port,
        })
    }
}

/// `--replay-endpoint POD=tcp://HOST:PORT`: the replay (ROUTER) endpoint of
/// a pod that connects to us, by the pod name in its topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayEndpoint {
    pub pod: String,
    pub endpoint: String,
}

impl FromStr for ReplayEndpoint {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let (pod, endpoint) = super::values::split_pair(raw, "POD=tcp://HOST:PORT")?;
        tcp_endpoint(endpoint)?;
        Ok(ReplayEndpoint {
            pod: pod.to_owned(),
            endpoint: endpoint.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_endpoints_spell_every_interface_as_the_socket_wants() {
        let e: BindEndpoint = "tcp://*:5557".parse().unwrap();
        assert_eq!(e.0, "tcp://0.0.0.0:5557");
        assert!("ipc:///tmp/x".parse::<BindEndpoint>().is_err());
    }

    #[test]
    fn dial_targets_and_dns_targets_parse() {
        let t: DialTarget = " tcp://pod:1 , replay=tcp://pod:2 ".parse().unwrap();
        assert_eq!(t.endpoint, "tcp://pod:1");
        assert_eq!(t.replay.as_deref(), Some("tcp://pod:2"));
        assert!("tcp://*:1".parse::<DialTarget>().is_err());
        assert!("tcp://a:1,replay=udp://a:2"
            .parse::<DialTarget>()
            .unwrap_err()
            .contains("replay"));
        let d: DnsTarget = "svc:5557,replay-port=5558".parse().unwrap();
        assert_eq!((d.port, d.replay_port), (5557, Some(5558)));
        assert!("svc:0".parse::<DnsTarget>().is_err());
        let err = dial_target("tcp://a").unwrap_err().to_string();
        assert!(err.contains("zmq_connect"), "{err}");
    }
}

/// `--peer`: a peer replica's gRPC address, `HOST:PORT`, or every address a
/// DNS name resolves to, `dns:///NAME:PORT` (a Kubernetes headless Service,
/// which lists Ready pods only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerTarget {
    Addr { host: String, port: u16 },
    Dns { name: String, port: u16 },
}

impl FromStr for PeerTarget {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let raw = raw.trim();
        let (dns, rest) = match raw.strip_prefix("dns:///") {
            Some(rest) => (true, rest),
            None if raw.contains("://") => return Err("want HOST:PORT or dns:///NAME:PORT".into()),
            None => (false, raw),
        };
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or("want HOST:PORT or dns:///NAME:PORT")?;
        let port: u16 = port.parse().map_err(|_| "port must be a number 1-65535")?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || port == 0 {
            return Err("want HOST:PORT or dns:///NAME:PORT".into());
        }
        let host = host.to_owned();
        Ok(match dns {
            true => PeerTarget::Dns { name: host, port },
            false => PeerTarget::Addr { host, port },
        })
    }
}

impl std::fmt::Display for PeerTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerTarget::Addr { host, port } if host.contains(':') => write!(f, "[{host}]:{port}"),
            PeerTarget::Addr { host, port } => write!(f, "{host}:{port}"),
            PeerTarget::Dns { name, port } => write!(f, "dns:///{name}:{port}"),
        }
    }
}

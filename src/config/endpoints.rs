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

/// `--zmq-connect tcp://HOST:PORT[,replay=tcp://HOST:PORT][,pod=NAME,model=MODEL]`.
impl FromStr for DialTarget {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let mut parts = raw.trim().split(',').map(str::trim);
        let endpoint = parts.next().unwrap_or_default();
        let (host, port) = tcp_endpoint(endpoint)?;
        if host == "*" || port == 0 {
            return Err("a pod endpoint needs a host and a port".into());
        }
        let (mut replay, mut pod, mut model) = (None, None, None);
        for option in parts {
            match option.split_once('=') {
                Some(("replay", value)) => {
                    tcp_endpoint(value).map_err(|e| format!("replay endpoint: {e}"))?;
                    replay = Some(value.to_owned());
                }
                Some(("pod", value)) => pod = Some(value),
                Some(("model", value)) => model = Some(value),
                _ => {
                    return Err(format!(
                        "unknown option {option:?} (want replay=ENDPOINT, pod=NAME, model=MODEL)"
                    ))
                }
            }
        }
        Ok(DialTarget {
            endpoint: endpoint.to_owned(),
            replay,
            named: named_topic(pod, model)?,
        })
    }
}

/// The topic a dialed pod named by `pod=` and `model=` goes by; both or
/// neither. Bounded as a topic off the wire is (`parse_topic`): the names
/// go into metric labels and logs.
pub(crate) fn named_topic(
    pod: Option<&str>,
    model: Option<&str>,
) -> Result<Option<String>, String> {
    let (pod, model) = match (pod, model) {
        (None, None) => return Ok(None),
        (Some(pod), Some(model)) => (pod, model),
        _ => return Err("pod= and model= name a pod together: give both".into()),
    };
    if pod.contains('@') {
        return Err(format!("pod name {pod:?} has an '@'"));
    }
    let topic = format!("kv@{pod}@{model}");
    indexer::topic::parse_topic(topic.as_bytes()).map_err(|e| format!("pod or model name: {e}"))?;
    Ok(Some(topic))
}

/// One `--zmq-connect` value: a target, or with `dp-ranks=N` one per
/// rank, on consecutive ports from the one given (replay endpoints too):
/// SGLang's data-parallel ranks publish on the base port plus their rank,
/// each its own cache, told apart by the rank in its batches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DialTargets(pub Vec<DialTarget>);

/// Most ranks one `dp-ranks=` expands to.
const MAX_DP_RANKS: u16 = 256;

impl FromStr for DialTargets {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let mut ranks = 1u16;
        let mut rest = Vec::new();
        for part in raw.trim().split(',').map(str::trim) {
            match part.split_once('=') {
                Some(("dp-ranks", n)) => ranks = dp_ranks(n)?,
                _ => rest.push(part),
            }
        }
        let target: DialTarget = rest.join(",").parse()?;
        Ok(DialTargets(target.ranks(ranks)?))
    }
}

fn dp_ranks(n: &str) -> Result<u16, String> {
    match n.parse::<u16>() {
        Ok(n) if (1..=MAX_DP_RANKS).contains(&n) => Ok(n),
        _ => Err(format!("dp-ranks must be 1-{MAX_DP_RANKS}")),
    }
}

impl DialTarget {
    /// This target and the next `ranks - 1` ports' (see `DialTargets`).
    pub fn ranks(self, ranks: u16) -> Result<Vec<DialTarget>, String> {
        let shifted = |endpoint: &str, r: u16| -> Result<String, String> {
            let (host, port) = tcp_endpoint(endpoint)?;
            let port = port
                .checked_add(r)
                .ok_or_else(|| format!("{endpoint} plus {r} ranks passes port 65535"))?;
            Ok(format!("tcp://{host}:{port}"))
        };
        (0..ranks)
            .map(|r| {
                Ok(DialTarget {
                    endpoint: shifted(&self.endpoint, r)?,
                    replay: self.replay.as_deref().map(|e| shifted(e, r)).transpose()?,
                    named: self.named.clone(),
                })
            })
            .collect()
    }
}

/// A model whose pods are named by their addresses (discovery's
/// `model=`, `--topicless-model`), checked as the topics they go by.
pub(crate) fn address_named_model(model: &str) -> Result<String, String> {
    named_topic(Some("0.0.0.0"), Some(model))?;
    Ok(model.to_owned())
}

/// Dial targets as the pods file (`discovery.rs`) reads them, with the
/// setting named as `--zmq-connect` would.
pub(crate) fn dial_targets(raw: &str) -> Result<Vec<DialTarget>, ConfigError> {
    raw.parse::<DialTargets>()
        .map(|t| t.0)
        .map_err(|reason: String| invalid("zmq_connect", raw, reason))
}

/// `--discover-dns NAME:PORT[,replay-port=P][,model=MODEL][,dp-ranks=N]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsTarget {
    pub name: String,
    pub port: u16,
    pub replay_port: Option<u16>,
    /// Each address's DP ranks, on consecutive ports (see `DialTargets`).
    pub dp_ranks: u16,
    /// The pods publish no usable topic (SGLang's default): each is named
    /// by its address and serves this model.
    pub model: Option<String>,
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
        let (mut replay_port, mut model, mut ranks) = (None, None, 1);
        for option in parts {
            match option.split_once('=') {
                Some(("replay-port", p)) => {
                    replay_port = Some(p.parse().map_err(|_| "replay-port must be a number")?)
                }
                Some(("dp-ranks", n)) => ranks = dp_ranks(n)?,
                Some(("model", m)) => model = Some(address_named_model(m)?),
                _ => return Err(format!("unknown option {option:?}")),
            }
        }
        Ok(DnsTarget {
            name: name.to_owned(),
            port,
            replay_port,
            dp_ranks: ranks,
            model,
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
        let err = dial_targets("tcp://a").unwrap_err().to_string();
        assert!(err.contains("zmq_connect"), "{err}");
    }

    /// SGLang's pods: named by the target (no topic), and its DP ranks on
    /// consecutive ports, replay endpoints too.
    #[test]
    fn named_targets_and_dp_ranks() {
        let t: DialTargets =
            "tcp://h:5557,replay=tcp://h:6000,pod=p-0,model=Qwen/Qwen3-8B,dp-ranks=3"
                .parse()
                .unwrap();
        let got: Vec<(&str, Option<&str>, Option<&str>)> =
            t.0.iter()
                .map(|t| (t.endpoint.as_str(), t.replay.as_deref(), t.named.as_deref()))
                .collect();
        let named = Some("kv@p-0@Qwen/Qwen3-8B");
        assert_eq!(
            got,
            vec![
                ("tcp://h:5557", Some("tcp://h:6000"), named),
                ("tcp://h:5558", Some("tcp://h:6001"), named),
                ("tcp://h:5559", Some("tcp://h:6002"), named),
            ]
        );
        for bad in [
            "tcp://h:1,pod=p",
            "tcp://h:1,model=m",
            "tcp://h:1,pod=a@b,model=m",
            "tcp://h:1,pod=p\u{1b}[2J,model=m",
            "tcp://h:1,dp-ranks=0",
            "tcp://h:1,dp-ranks=257",
            "tcp://h:65535,dp-ranks=2",
        ] {
            assert!(bad.parse::<DialTargets>().is_err(), "{bad}");
        }
        let d: DnsTarget = "svc:5557,model=m,dp-ranks=2".parse().unwrap();
        assert_eq!((d.model.as_deref(), d.dp_ranks), (Some("m"), 2));
        assert!("svc:5557,model=".parse::<DnsTarget>().is_err());
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

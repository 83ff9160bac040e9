//! Which pods to dial, over time: the static `--zmq-connect` list, a pods
//! file (a mounted ConfigMap, re-read when it changes) and DNS names (a
//! Kubernetes headless Service, re-resolved periodically). Each round the
//! union is handed to the dialer, which connects new endpoints and drops the
//! ones that disappeared.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

use crate::config::{DialTarget, DiscoveryConfig, DnsTarget};

/// A pods file: a list (or `{pods: [...]}`) of endpoints, each a string
/// `tcp://host:port[,replay=tcp://host:port]` or `{endpoint, replay}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum PodsFile {
    List(Vec<PodEntry>),
    Wrapped { pods: Vec<PodEntry> },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PodEntry {
    Line(String),
    /// As `--zmq-connect`'s options (`dp_ranks`: `dp-ranks`).
    Full {
        endpoint: String,
        #[serde(default)]
        replay: Option<String>,
        #[serde(default)]
        pod: Option<String>,
        #[serde(default)]
        model: Option<String>,
        #[serde(default)]
        dp_ranks: Option<u16>,
    },
}

/// Parses a pods file (YAML; JSON is YAML too). An empty file is an error,
/// not "no pods": a file being rewritten in place is empty for a moment, and
/// that must not disconnect every pod (write `[]` to remove them all).
pub fn parse_pods_file(text: &str) -> Result<Vec<DialTarget>, String> {
    if text.trim().is_empty() {
        return Err("the file is empty (write [] for no pods)".into());
    }
    let file: PodsFile = serde_norway::from_str(text).map_err(|e| e.to_string())?;
    let entries = match file {
        PodsFile::List(v) | PodsFile::Wrapped { pods: v } => v,
    };
    entries
        .into_iter()
        .map(|e| {
            let line = match e {
                PodEntry::Line(l) => l,
                PodEntry::Full {
                    endpoint,
                    replay,
                    pod,
                    model,
                    dp_ranks,
                } => {
                    let mut line = endpoint;
                    let options = [
                        ("replay", replay),
                        ("pod", pod),
                        ("model", model),
                        ("dp-ranks", dp_ranks.map(|n| n.to_string())),
                    ];
                    for (name, value) in options {
                        if let Some(v) = value {
                            line.push_str(&format!(",{name}={v}"));
                        }
                    }
                    line
                }
            };
            crate::config::dial_targets(&line).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<Vec<DialTarget>>, String>>()
        .map(|t| t.into_iter().flatten().collect())
}

/// `tcp://IP:PORT` (IPv6 in brackets).
fn endpoint(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("tcp://{v4}:{port}"),
        IpAddr::V6(v6) => format!("tcp://[{v6}]:{port}"),
    }
}

/// Resolves `target` to dial targets. `Ok(empty)` when the name has no
/// records (every pod gone); `Err` on a lookup failure (keep what we had).
async fn resolve(
    target: &DnsTarget,
    server: Option<SocketAddr>,
) -> Result<Vec<DialTarget>, String> {
    let ips: Vec<IpAddr> = match server {
        Some(server) => {
            use hickory_resolver::config::{NameServerConfig, ResolverConfig};
            use hickory_resolver::net::runtime::TokioRuntimeProvider;
            let mut ns = NameServerConfig::udp_and_tcp(server.ip());
            for c in &mut ns.connections {
                c.port = server.port();
            }
            let config = ResolverConfig::from_parts(None, vec![], vec![ns]);
            // A fresh resolver per round: no answer outlives one interval.
            let resolver = hickory_resolver::Resolver::builder_with_config(
                config,
                TokioRuntimeProvider::default(),
            )
            .build()
            .map_err(|e| e.to_string())?;
            match resolver.lookup_ip(target.name.as_str()).await {
                Ok(lookup) => lookup.iter().collect(),
                Err(e) if e.is_no_records_found() || e.is_nx_domain() => Vec::new(),
                Err(e) => return Err(e.to_string()),
            }
        }
        None => match tokio::net::lookup_host((target.name.as_str(), target.port)).await {
            Ok(addrs) => addrs.map(|a| a.ip()).collect(),
            Err(e) => return Err(e.to_string()),
        },
    };
    let unique: BTreeSet<IpAddr> = ips.into_iter().collect();
    let mut targets = Vec::new();
    for ip in unique {
        let base = DialTarget {
            endpoint: endpoint(ip, target.port),
            replay: target.replay_port.map(|p| endpoint(ip, p)),
            // Topic-less pods are named by their address.
            named: target.model.as_ref().map(|m| format!("kv@{ip}@{m}")),
        };
        targets.extend(base.ranks(target.dp_ranks)?);
    }
    Ok(targets)
}

/// Runs discovery forever, calling `apply` with the full desired set each
/// time it changes.
pub async fn run(
    config: DiscoveryConfig,
    static_targets: Vec<DialTarget>,
    mut apply: impl FnMut(Vec<DialTarget>) + Send,
) {
    let mut from_file: Vec<DialTarget> = Vec::new();
    let mut file_seen: Option<String> = None;
    let mut from_dns: Vec<Vec<DialTarget>> = vec![Vec::new(); config.dns.len()];
    let mut last: Option<BTreeSet<DialTarget>> = None;
    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if let Some(path) = &config.pods_file {
            match tokio::fs::read_to_string(path).await {
                Ok(text) if file_seen.as_deref() != Some(text.as_str()) => {
                    match parse_pods_file(&text) {
                        Ok(targets) => {
                            tracing::info!(file = %path.display(), pods = targets.len(), "pods file read");
                            from_file = targets;
                        }
                        // A half-written or broken file must not drop every pod.
                        Err(e) => {
                            tracing::warn!(file = %path.display(), error = %e, "pods file is invalid; keeping the previous list")
                        }
                    }
                    file_seen = Some(text);
                }
                Ok(_) => {}
                Err(e) => {
                    if file_seen.is_some() {
                        tracing::warn!(file = %path.display(), error = %e, "cannot read pods file; keeping the previous list");
                    }
                }
            }
        }
        for (i, target) in config.dns.iter().enumerate() {
            match resolve(target, config.dns_server).await {
                Ok(targets) => from_dns[i] = targets,
                Err(e) => {
                    tracing::warn!(name = %target.name, error = %e, "DNS lookup failed; keeping the previous addresses")
                }
            }
        }
        let mut desired: Vec<DialTarget> = static_targets.clone();
        desired.extend(from_file.iter().cloned());
        desired.extend(from_dns.iter().flatten().cloned());
        let key: BTreeSet<DialTarget> = desired.iter().cloned().collect();
        if last.as_ref() != Some(&key) {
            last = Some(key);
            apply(desired);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_files_in_every_shape() {
        let yaml = "pods:\n  - tcp://10.0.0.1:5557\n  - endpoint: tcp://10.0.0.2:5557\n    replay: tcp://10.0.0.2:5558\n";
        let json = r#"["tcp://10.0.0.1:5557", {"endpoint": "tcp://10.0.0.2:5557", "replay": "tcp://10.0.0.2:5558"}]"#;
        for text in [yaml, json] {
            let t = parse_pods_file(text).unwrap();
            assert_eq!(t.len(), 2);
            assert_eq!(t[1].replay.as_deref(), Some("tcp://10.0.0.2:5558"));
        }
        assert!(parse_pods_file("").is_err());
        assert!(parse_pods_file("[]").unwrap().is_empty());
        assert!(parse_pods_file("pods: []").unwrap().is_empty());
        assert!(parse_pods_file("pods: [udp://x:1]").is_err());
        assert!(parse_pods_file("{nope").is_err());
    }

    #[test]
    fn endpoints_bracket_ipv6() {
        assert_eq!(
            endpoint("10.1.2.3".parse().unwrap(), 5557),
            "tcp://10.1.2.3:5557"
        );
        assert_eq!(
            endpoint("fd00::1".parse().unwrap(), 5557),
            "tcp://[fd00::1]:5557"
        );
    }
}

//! Settings: flags, `KV_INDEXER_*` environment variables and an optional YAML
//! file, parsed and validated once at start into a typed [`Config`]. A bad
//! value fails fast with the setting's name.
//!
//! Precedence: flag > environment variable > config file > built-in default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Parser;
use indexer::score::TierWeights;
use indexer::IndexerConfig;
use serde::Deserialize;

/// Flags. Every one can also be set by `KV_INDEXER_<FLAG>` (upper case, `_`
/// for `-`) or in the `--config` file (snake_case key).
#[derive(Parser, Debug, Default)]
#[command(name = "kv-indexer", version, about, long_about = None)]
pub struct Args {
    /// YAML file with any of the settings below (snake_case keys).
    #[arg(long, env = "KV_INDEXER_CONFIG")]
    pub config: Option<PathBuf>,

    /// gRPC listen address [default: 0.0.0.0:50051].
    #[arg(long, env = "KV_INDEXER_GRPC_ADDR")]
    pub grpc_addr: Option<String>,

    /// ZeroMQ endpoint to bind a SUB socket on, for pods that connect to the
    /// indexer; `none` disables [default: tcp://*:5557].
    #[arg(long, env = "KV_INDEXER_ZMQ_BIND")]
    pub zmq_bind: Option<String>,

    /// A pod's PUB endpoint to connect to, optionally with its replay (ROUTER)
    /// endpoint: `tcp://pod:5557[,replay=tcp://pod:5558]`. Repeatable; in the
    /// environment variable, separate targets with spaces.
    #[arg(long, env = "KV_INDEXER_ZMQ_CONNECT", value_delimiter = ' ')]
    pub zmq_connect: Vec<String>,

    /// Topic prefix to subscribe to [default: kv@].
    #[arg(long, env = "KV_INDEXER_TOPIC_FILTER")]
    pub topic_filter: Option<String>,

    /// Block size assumed for a model until its events show one [default: 16].
    #[arg(long, env = "KV_INDEXER_BLOCK_SIZE")]
    pub block_size: Option<u32>,

    /// Score weight of a tier, `TIER=WEIGHT` with TIER in gpu|cpu|storage and
    /// WEIGHT in [0, 1]. Repeatable or comma-separated [default: gpu=1,cpu=0.8,storage=0.5].
    #[arg(long, env = "KV_INDEXER_TIER_WEIGHT", value_delimiter = ',')]
    pub tier_weight: Vec<String>,

    /// Log format: text or json [default: text].
    #[arg(long, env = "KV_INDEXER_LOG_FORMAT")]
    pub log_format: Option<String>,

    /// Log filter (`RUST_LOG` syntax) [default: info].
    #[arg(long, env = "KV_INDEXER_LOG_LEVEL")]
    pub log_level: Option<String>,

    /// Threads applying events to the index; a pod's events always go to the
    /// same one, in order [default: number of CPUs].
    #[arg(long, env = "KV_INDEXER_INGEST_WORKERS")]
    pub ingest_workers: Option<usize>,
}

/// The `--config` file: the same settings, snake_case keys.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub grpc_addr: Option<String>,
    pub zmq_bind: Option<String>,
    #[serde(default)]
    pub zmq_connect: Vec<String>,
    pub topic_filter: Option<String>,
    pub block_size: Option<u32>,
    /// `{gpu: 1.0, cpu: 0.8, storage: 0.5}`; tiers left out keep their default.
    #[serde(default)]
    pub tier_weights: std::collections::BTreeMap<String, f64>,
    pub log_format: Option<String>,
    pub log_level: Option<String>,
    pub ingest_workers: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// A pod to dial: its PUB endpoint and, if known, its replay endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DialTarget {
    pub endpoint: String,
    pub replay: Option<String>,
}

/// Validated settings.
#[derive(Clone, Debug)]
pub struct Config {
    pub grpc_addr: SocketAddr,
    pub zmq_bind: Option<String>,
    pub zmq_connect: Vec<DialTarget>,
    pub topic_filter: String,
    pub indexer: IndexerConfig,
    pub log_format: LogFormat,
    pub log_level: String,
    pub ingest_workers: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid {setting} {value:?}: {reason}")]
    Invalid {
        setting: &'static str,
        value: String,
        reason: String,
    },
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_norway::Error,
    },
}

fn invalid(
    setting: &'static str,
    value: impl Into<String>,
    reason: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        setting,
        value: value.into(),
        reason: reason.into(),
    }
}

impl Config {
    /// Merges flags/environment over the config file (if any) and validates.
    pub fn load(args: Args) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        Config::merge(args, file)
    }

    pub fn merge(args: Args, file: FileConfig) -> Result<Config, ConfigError> {
        let grpc_addr_raw = args
            .grpc_addr
            .or(file.grpc_addr)
            .unwrap_or_else(|| "0.0.0.0:50051".into());
        let grpc_addr = grpc_addr_raw
            .parse()
            .map_err(|e| invalid("grpc_addr", &grpc_addr_raw, format!("{e} (want IP:PORT)")))?;

        let zmq_bind = match args
            .zmq_bind
            .or(file.zmq_bind)
            .unwrap_or_else(|| "tcp://*:5557".into())
        {
            s if s.eq_ignore_ascii_case("none") || s.is_empty() => None,
            s => Some(bind_endpoint(&s)?),
        };

        let connect = if args.zmq_connect.is_empty() {
            file.zmq_connect
        } else {
            args.zmq_connect
        };
        let zmq_connect = connect
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| dial_target(s))
            .collect::<Result<Vec<_>, _>>()?;

        let topic_filter = args
            .topic_filter
            .or(file.topic_filter)
            .unwrap_or_else(|| "kv@".into());

        let block_size = args.block_size.or(file.block_size).unwrap_or(16);
        if block_size == 0 || block_size > 1 << 20 {
            return Err(invalid(
                "block_size",
                block_size.to_string(),
                "must be between 1 and 1048576",
            ));
        }

        let mut weights = TierWeights::default();
        let pairs: Vec<(String, String)> = if args.tier_weight.is_empty() {
            file.tier_weights
                .into_iter()
                .map(|(k, v)| (k, v.to_string()))
                .collect()
        } else {
            args.tier_weight
                .iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| {
                    s.split_once('=')
                        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                        .ok_or_else(|| invalid("tier_weight", s, "want TIER=WEIGHT"))
                })
                .collect::<Result<_, _>>()?
        };
        for (tier, value) in pairs {
            let idx = match tier.to_ascii_lowercase().as_str() {
                "gpu" => 0,
                "cpu" => 1,
                "storage" => 2,
                _ => {
                    return Err(invalid(
                        "tier_weight",
                        tier,
                        "tier must be gpu, cpu or storage",
                    ))
                }
            };
            let w: f64 = value
                .parse()
                .ok()
                .filter(|w: &f64| (0.0..=1.0).contains(w))
                .ok_or_else(|| {
                    invalid("tier_weight", &value, "weight must be a number in [0, 1]")
                })?;
            weights.0[idx] = w;
        }

        let log_format = match args
            .log_format
            .or(file.log_format)
            .unwrap_or_else(|| "text".into())
            .as_str()
        {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => return Err(invalid("log_format", other, "want text or json")),
        };
        let log_level = args
            .log_level
            .or(file.log_level)
            .unwrap_or_else(|| "info".into());
        tracing_subscriber::EnvFilter::try_new(&log_level)
            .map_err(|e| invalid("log_level", &log_level, e.to_string()))?;

        let ingest_workers = args
            .ingest_workers
            .or(file.ingest_workers)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
        if ingest_workers == 0 || ingest_workers > 256 {
            return Err(invalid(
                "ingest_workers",
                ingest_workers.to_string(),
                "must be between 1 and 256",
            ));
        }

        Ok(Config {
            grpc_addr,
            zmq_bind,
            zmq_connect,
            topic_filter,
            indexer: IndexerConfig {
                default_block_size: block_size,
                tier_weights: weights,
            },
            log_format,
            log_level,
            ingest_workers,
        })
    }
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    if text.trim().is_empty() {
        return Ok(FileConfig::default());
    }
    serde_norway::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source,
    })
}

/// `tcp://HOST:PORT`, checked; `*` is every interface.
fn tcp_endpoint(setting: &'static str, raw: &str) -> Result<(String, u16), ConfigError> {
    let rest = raw
        .strip_prefix("tcp://")
        .ok_or_else(|| invalid(setting, raw, "only tcp:// endpoints are supported"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| invalid(setting, raw, "want tcp://HOST:PORT"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| invalid(setting, raw, "port must be a number 0-65535"))?;
    if host.is_empty() {
        return Err(invalid(setting, raw, "host is empty"));
    }
    Ok((host.to_owned(), port))
}

fn bind_endpoint(raw: &str) -> Result<String, ConfigError> {
    let (host, port) = tcp_endpoint("zmq_bind", raw)?;
    let host = if host == "*" {
        "0.0.0.0".to_owned()
    } else {
        host
    };
    Ok(format!("tcp://{host}:{port}"))
}

fn dial_target(raw: &str) -> Result<DialTarget, ConfigError> {
    let mut parts = raw.split(',').map(str::trim);
    let endpoint = parts.next().unwrap_or_default();
    let (host, port) = tcp_endpoint("zmq_connect", endpoint)?;
    if host == "*" || port == 0 {
        return Err(invalid(
            "zmq_connect",
            raw,
            "a pod endpoint needs a host and a port",
        ));
    }
    let mut replay = None;
    for option in parts {
        match option.split_once('=') {
            Some(("replay", value)) => {
                tcp_endpoint("zmq_connect replay", value)?;
                replay = Some(value.to_owned());
            }
            _ => {
                return Err(invalid(
                    "zmq_connect",
                    raw,
                    format!("unknown option {option:?} (want replay=ENDPOINT)"),
                ))
            }
        }
    }
    Ok(DialTarget {
        endpoint: endpoint.to_owned(),
        replay,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("kv-indexer").chain(list.iter().copied())).unwrap()
    }

    #[test]
    fn defaults_are_sensible() {
        let c = Config::merge(Args::default(), FileConfig::default()).unwrap();
        assert_eq!(c.grpc_addr, "0.0.0.0:50051".parse().unwrap());
        assert_eq!(c.zmq_bind.as_deref(), Some("tcp://0.0.0.0:5557"));
        assert!(c.zmq_connect.is_empty());
        assert_eq!(c.topic_filter, "kv@");
        assert_eq!(c.indexer.default_block_size, 16);
        assert_eq!(c.indexer.tier_weights, TierWeights::default());
        assert_eq!(c.log_format, LogFormat::Text);
    }

    #[test]
    fn flags_parse_and_win_over_the_file() {
        let a = args(&[
            "--grpc-addr",
            "127.0.0.1:1",
            "--zmq-bind",
            "none",
            "--zmq-connect",
            "tcp://a:1,replay=tcp://a:2",
            "--zmq-connect",
            "tcp://b:1",
            "--tier-weight",
            "cpu=0.5,storage=0",
        ]);
        let file: FileConfig = serde_norway::from_str(
            "grpc_addr: 127.0.0.1:9\nblock_size: 32\ntier_weights: {gpu: 0.9}\n",
        )
        .unwrap();
        let c = Config::merge(a, file).unwrap();
        assert_eq!(c.grpc_addr, "127.0.0.1:1".parse().unwrap());
        assert_eq!(c.zmq_bind, None);
        assert_eq!(
            c.zmq_connect,
            vec![
                DialTarget {
                    endpoint: "tcp://a:1".into(),
                    replay: Some("tcp://a:2".into())
                },
                DialTarget {
                    endpoint: "tcp://b:1".into(),
                    replay: None
                },
            ]
        );
        assert_eq!(c.indexer.default_block_size, 32);
        // Flags replace the file's weights; unspecified tiers keep defaults.
        assert_eq!(c.indexer.tier_weights.0, [1.0, 0.5, 0.0]);
    }

    #[test]
    fn errors_name_the_setting() {
        let cases: &[(&[&str], &str)] = &[
            (&["--grpc-addr", "nope"], "grpc_addr"),
            (&["--zmq-bind", "udp://x:1"], "zmq_bind"),
            (&["--zmq-connect", "tcp://a"], "zmq_connect"),
            (&["--zmq-connect", "tcp://a:1,foo=bar"], "zmq_connect"),
            (&["--block-size", "0"], "block_size"),
            (&["--tier-weight", "gpu=2"], "tier_weight"),
            (&["--tier-weight", "tpu=1"], "tier_weight"),
            (&["--log-format", "xml"], "log_format"),
            (&["--log-level", "info,=[bad"], "log_level"),
            (&["--ingest-workers", "0"], "ingest_workers"),
        ];
        for (flags, setting) in cases {
            let err = Config::merge(args(flags), FileConfig::default()).unwrap_err();
            assert!(err.to_string().contains(setting), "{flags:?}: {err}");
        }
    }

    #[test]
    fn unknown_file_keys_are_rejected() {
        let err = serde_norway::from_str::<FileConfig>("grpc_adr: 1.2.3.4:5\n").unwrap_err();
        assert!(err.to_string().contains("grpc_adr"), "{err}");
    }
}

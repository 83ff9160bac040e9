//! Settings: flags, `KV_INDEXER_*` environment variables and an optional YAML
//! file, parsed and validated once at start into a typed [`Config`]. A bad
//! value fails fast with the setting's name.
//!
//! Precedence: flag > environment variable > config file > built-in default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use std::collections::{BTreeMap, HashMap};

use clap::Parser;
use indexer::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo, DEFAULT_SEED};
use indexer::scheme::{EngineKeys, KeyMode, KeySchemes};
use indexer::score::TierWeights;
use indexer::IndexerConfig;
use serde::Deserialize;

/// Flags. Every one can also be set by `KV_INDEXER_<FLAG>` (upper case, `_`
/// for `-`) or in the `--config` file (snake_case key).
#[derive(Parser, Debug, Default)]
#[command(name = "kv-indexer", version, about, long_about = None)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// YAML file with any of the settings below (snake_case keys).
    #[arg(long, env = "KV_INDEXER_CONFIG")]
    pub config: Option<PathBuf>,

    /// gRPC listen address [default: 0.0.0.0:50051].
    #[arg(long, env = "KV_INDEXER_GRPC_ADDR")]
    pub grpc_addr: Option<String>,

    /// PEM certificate (chain) for gRPC over TLS; with --tls-key.
    #[arg(long, env = "KV_INDEXER_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key for --tls-cert.
    #[arg(long, env = "KV_INDEXER_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA certificate(s): require and verify client certificates (mTLS).
    #[arg(long, env = "KV_INDEXER_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,

    /// HTTP address for `/metrics`, `/healthz` and `/readyz`; `none`
    /// disables [default: 0.0.0.0:9090].
    #[arg(long, env = "KV_INDEXER_METRICS_ADDR")]
    pub metrics_addr: Option<String>,

    /// ZeroMQ endpoint to bind a SUB socket on, for pods that connect to the
    /// indexer; `none` disables [default: tcp://*:5557].
    #[arg(long, env = "KV_INDEXER_ZMQ_BIND")]
    pub zmq_bind: Option<String>,

    /// A pod's PUB endpoint to connect to, optionally with its replay (ROUTER)
    /// endpoint: `tcp://pod:5557[,replay=tcp://pod:5558]`. Repeatable; in the
    /// environment variable, separate targets with spaces.
    #[arg(long, env = "KV_INDEXER_ZMQ_CONNECT", value_delimiter = ' ')]
    pub zmq_connect: Vec<String>,

    /// A pods file (YAML or JSON list of endpoints as for --zmq-connect, or
    /// `{endpoint, replay}` objects), re-read when it changes (a mounted
    /// ConfigMap).
    #[arg(long, env = "KV_INDEXER_PODS_FILE")]
    pub pods_file: Option<PathBuf>,

    /// Dial every address of a DNS name, re-resolved periodically (a
    /// Kubernetes headless Service): `NAME:PORT[,replay-port=PORT]`.
    /// Repeatable.
    #[arg(long, env = "KV_INDEXER_DISCOVER_DNS", value_delimiter = ' ')]
    pub discover_dns: Vec<String>,

    /// DNS server (`IP:PORT`) for --discover-dns instead of the system
    /// resolver.
    #[arg(long, env = "KV_INDEXER_DNS_SERVER")]
    pub dns_server: Option<String>,

    /// How often the pods file is checked and DNS names re-resolved, e.g.
    /// `5s`, `500ms` [default: 5s].
    #[arg(long, env = "KV_INDEXER_DISCOVERY_INTERVAL")]
    pub discovery_interval: Option<String>,

    /// Replay endpoint of a pod that connects to us (bind mode), by the pod
    /// name in its topic: `POD=tcp://host:port`. Repeatable. (Dial targets
    /// carry theirs in --zmq-connect.)
    #[arg(long, env = "KV_INDEXER_REPLAY_ENDPOINT", value_delimiter = ' ')]
    pub replay_endpoint: Vec<String>,

    /// Dial mode: forget a pod whose connection has been down and that has
    /// published nothing for this long (silence alone proves nothing);
    /// `off` disables [default: 10m].
    #[arg(long, env = "KV_INDEXER_POD_EXPIRY")]
    pub pod_expiry: Option<String>,

    /// How long one replay request may take, e.g. `2s` [default: 2s].
    #[arg(long, env = "KV_INDEXER_REPLAY_TIMEOUT")]
    pub replay_timeout: Option<String>,

    /// Pods with gaps replay could not fill: `score` them anyway (their
    /// matches may be low) or `drop` them (score 0, flagged) [default: score].
    #[arg(long, env = "KV_INDEXER_INCOMPLETE_PODS")]
    pub incomplete_pods: Option<String>,

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

    /// Most (pod, block) entries the index holds; beyond, the largest pods
    /// lose their least recently stored blocks [default: unbounded].
    #[arg(long, env = "KV_INDEXER_MAX_BLOCKS")]
    pub max_blocks: Option<usize>,

    /// Memory budget for the index, e.g. `4GiB`: converted to entries at
    /// 400 bytes each (with --max-blocks, the smaller wins).
    #[arg(long, env = "KV_INDEXER_MAX_MEMORY")]
    pub max_memory: Option<String>,

    /// Directory for index snapshots: written every --snapshot-interval and
    /// on shutdown, loaded at start [default: none].
    #[arg(long, env = "KV_INDEXER_SNAPSHOT_DIR")]
    pub snapshot_dir: Option<PathBuf>,

    /// How often to write a snapshot, e.g. `60s` [default: 60s].
    #[arg(long, env = "KV_INDEXER_SNAPSHOT_INTERVAL")]
    pub snapshot_interval: Option<String>,

    /// Largest gRPC request accepted, e.g. `16MiB` [default: 16MiB].
    #[arg(long, env = "KV_INDEXER_MAX_MESSAGE")]
    pub max_message: Option<String>,

    /// Largest text prompt or chat request accepted, in bytes [default: 8MiB].
    #[arg(long, env = "KV_INDEXER_MAX_PROMPT")]
    pub max_prompt: Option<String>,

    /// Most tokens a prompt may have [default: 1048576].
    #[arg(long, env = "KV_INDEXER_MAX_PROMPT_TOKENS")]
    pub max_prompt_tokens: Option<usize>,

    /// Most candidate pods in one request [default: 4096].
    #[arg(long, env = "KV_INDEXER_MAX_CANDIDATE_PODS")]
    pub max_candidate_pods: Option<usize>,

    /// Scoring requests (Score, Tokenize, GetPodScores) in flight at once;
    /// more are refused at once with RESOURCE_EXHAUSTED [default: 256].
    #[arg(long, env = "KV_INDEXER_MAX_INFLIGHT")]
    pub max_inflight: Option<usize>,

    /// Threads applying events to the index; a pod's events always go to the
    /// same one, in order [default: number of CPUs].
    #[arg(long, env = "KV_INDEXER_INGEST_WORKERS")]
    pub ingest_workers: Option<usize>,

    /// Block keys: `token` (ours, from token ids) or `engine` (vLLM's own
    /// block hashes; needs the pods' hash algorithm and seed) [default: token].
    #[arg(long, env = "KV_INDEXER_KEY_MODE")]
    pub key_mode: Option<String>,

    /// Engine mode: the pods' `--prefix-caching-hash-algo`: sha256,
    /// sha256_cbor, xxhash or xxhash_cbor [default: sha256].
    #[arg(long, env = "KV_INDEXER_ENGINE_HASH_ALGO")]
    pub engine_hash_algo: Option<String>,

    /// Engine mode: the pods' `PYTHONHASHSEED`, if they set one
    /// [default: vllm-none-hash, vLLM's own default for sha256 algorithms].
    #[arg(long, env = "KV_INDEXER_ENGINE_HASH_SEED")]
    pub engine_hash_seed: Option<String>,

    /// Engine mode: how the pods' vLLM hashes LoRA names and cache salts:
    /// `tagged` (vLLM >= 0.31) or `bare` (older) [default: tagged].
    #[arg(long, env = "KV_INDEXER_ENGINE_EXTRA_KEYS")]
    pub engine_extra_keys: Option<String>,

    /// Engine mode: a LoRA adapter's path as given to vLLM, `NAME=PATH`
    /// (hashed since vLLM 0.31, absent from events). Adapters without one use
    /// token keys. Repeatable or comma-separated.
    #[arg(long, env = "KV_INDEXER_LORA_PATH", value_delimiter = ',')]
    pub lora_path: Vec<String>,

    /// Engine mode: a pod holding block k of a prompt holds blocks 0..k
    /// (vLLM evicts descendants first), even if their events were missed
    /// [default: true].
    #[arg(long, env = "KV_INDEXER_ASSUME_PREFIX_CLOSED")]
    pub assume_prefix_closed: Option<bool>,

    /// Engine mode: after each pod's first 8, recompute one in N prompt-start
    /// stores' hashes to catch a wrong algorithm or seed; 0 = off [default: 64].
    #[arg(long, env = "KV_INDEXER_ENGINE_SELF_CHECK_EVERY")]
    pub engine_self_check_every: Option<u32>,

    /// A model's tokenizer: `MODEL=PATH`, PATH a directory with
    /// `tokenizer.json` (+ `tokenizer_config.json`) or a `tokenizer.json`.
    /// Repeatable. Otherwise the models dir, the Hugging Face cache and the
    /// Hub are tried (`HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_TOKEN`,
    /// `HF_HUB_OFFLINE` are honoured).
    #[arg(long, env = "KV_INDEXER_TOKENIZER", value_delimiter = ' ')]
    pub tokenizer: Vec<String>,

    /// Directory of tokenizers by model name: `DIR/<model>/tokenizer.json`.
    #[arg(long, env = "KV_INDEXER_TOKENIZERS_DIR")]
    pub tokenizers_dir: Option<PathBuf>,

    /// Bytes of tokenization cache per model, e.g. `256MiB` [default: 256MiB].
    #[arg(long, env = "KV_INDEXER_TOKENIZATION_CACHE")]
    pub tokenization_cache: Option<String>,

    /// Run a chat request's own `chat_template` (a program from the client;
    /// bounded, but trust the clients first); without it such requests get
    /// INVALID_ARGUMENT [default: false].
    #[arg(
        long,
        env = "KV_INDEXER_ALLOW_REQUEST_CHAT_TEMPLATE",
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub allow_request_chat_template: Option<bool>,

    /// Connect and read timeout of Hugging Face Hub downloads, e.g. `30s`
    /// [default: 30s].
    #[arg(long, env = "KV_INDEXER_HUB_TIMEOUT")]
    pub hub_timeout: Option<String>,

    /// Key mode for one model, overriding the above:
    /// `MODEL=token` or `MODEL=engine[:ALGO[:SEED]]`. Repeatable.
    #[arg(long, env = "KV_INDEXER_MODEL_KEY_MODE", value_delimiter = ' ')]
    pub model_key_mode: Vec<String>,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Validate the configuration (flags, environment, --config file),
    /// print the effective settings and exit: 0 if valid, 2 if not.
    Check,
    /// Run the service with a built-in publisher that behaves like a few
    /// vLLM pods serving conversations; prints how the scores move.
    Demo {
        /// Fake pods.
        #[arg(long, default_value_t = 3)]
        pods: usize,
        /// Stop after this many turns (0 = until Ctrl-C).
        #[arg(long, default_value_t = 0)]
        turns: u32,
    },
}

/// The `--config` file: the same settings, snake_case keys.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub grpc_addr: Option<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub metrics_addr: Option<String>,
    pub zmq_bind: Option<String>,
    #[serde(default)]
    pub zmq_connect: Vec<String>,
    pub pods_file: Option<PathBuf>,
    /// `{pod-name: tcp://host:port}`
    #[serde(default)]
    pub replay_endpoints: BTreeMap<String, String>,
    pub replay_timeout: Option<String>,
    pub pod_expiry: Option<String>,
    pub incomplete_pods: Option<String>,
    #[serde(default)]
    pub discover_dns: Vec<String>,
    pub dns_server: Option<String>,
    pub discovery_interval: Option<String>,
    pub topic_filter: Option<String>,
    pub block_size: Option<u32>,
    /// `{gpu: 1.0, cpu: 0.8, storage: 0.5}`; tiers left out keep their default.
    #[serde(default)]
    pub tier_weights: std::collections::BTreeMap<String, f64>,
    pub log_format: Option<String>,
    pub log_level: Option<String>,
    pub ingest_workers: Option<usize>,
    pub max_blocks: Option<usize>,
    pub max_memory: Option<String>,
    pub snapshot_dir: Option<PathBuf>,
    pub snapshot_interval: Option<String>,
    pub max_message: Option<String>,
    pub max_prompt: Option<String>,
    pub max_prompt_tokens: Option<usize>,
    pub max_candidate_pods: Option<usize>,
    pub max_inflight: Option<usize>,
    pub key_mode: Option<String>,
    pub engine_hash_algo: Option<String>,
    pub engine_hash_seed: Option<String>,
    pub engine_extra_keys: Option<String>,
    /// `{adapter-name: /path/given/to/vllm}`
    #[serde(default)]
    pub lora_paths: BTreeMap<String, String>,
    pub assume_prefix_closed: Option<bool>,
    pub engine_self_check_every: Option<u32>,
    /// `{model: "token" | "engine[:ALGO[:SEED]]"}`
    #[serde(default)]
    pub model_key_modes: BTreeMap<String, String>,
    /// `{model: /path/to/tokenizer/dir}`
    #[serde(default)]
    pub tokenizers: BTreeMap<String, PathBuf>,
    pub tokenizers_dir: Option<PathBuf>,
    pub tokenization_cache: Option<String>,
    pub allow_request_chat_template: Option<bool>,
    pub hub_timeout: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// PEM material for gRPC TLS, read at start.
#[derive(Clone)]
pub struct TlsConfig {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("TlsConfig")
            .field("mtls", &self.client_ca_pem.is_some())
            .finish_non_exhaustive()
    }
}

/// What one request may ask for. Each bound exists so that one client
/// cannot take the service's memory or CPU from everyone else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_message_bytes: usize,
    pub max_prompt_bytes: usize,
    pub max_prompt_tokens: usize,
    pub max_candidate_pods: usize,
    pub max_inflight: usize,
}

/// A pod to dial: its PUB endpoint and, if known, its replay endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DialTarget {
    pub endpoint: String,
    pub replay: Option<String>,
}

/// Validated settings.
#[derive(Clone, Debug)]
pub struct Config {
    pub grpc_addr: SocketAddr,
    /// gRPC over TLS (and mTLS when a client CA is given).
    pub tls: Option<TlsConfig>,
    pub metrics_addr: Option<SocketAddr>,
    pub zmq_bind: Option<String>,
    pub zmq_connect: Vec<DialTarget>,
    pub discovery: crate::discovery::DiscoveryConfig,
    pub replay_endpoints: HashMap<String, String>,
    pub replay_timeout: std::time::Duration,
    /// Dial mode: expiry of silent, disconnected pods (`None`: never).
    pub pod_expiry: Option<std::time::Duration>,
    pub topic_filter: String,
    pub indexer: IndexerConfig,
    pub log_format: LogFormat,
    pub log_level: String,
    pub ingest_workers: usize,
    pub limits: Limits,
    pub snapshot_dir: Option<PathBuf>,
    pub snapshot_interval: std::time::Duration,
    pub tokenizers: tokenizer::load::Sources,
    /// Tokenization cache bytes, per model.
    pub tokenization_cache_bytes: usize,
    /// Run requests' own chat templates.
    pub allow_request_chat_template: bool,
    /// Connect and read timeout of Hub downloads.
    pub hub_timeout: std::time::Duration,
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
    pub fn load(mut args: Args) -> Result<Config, ConfigError> {
        args.command = None;
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

        let read_pem = |setting: &'static str, path: &Path| -> Result<Vec<u8>, ConfigError> {
            let pem = std::fs::read(path)
                .map_err(|e| invalid(setting, path.display().to_string(), e.to_string()))?;
            if !pem.windows(10).any(|w| w == b"-----BEGIN") {
                return Err(invalid(
                    setting,
                    path.display().to_string(),
                    "not a PEM file",
                ));
            }
            Ok(pem)
        };
        let tls = match (
            args.tls_cert.or(file.tls_cert),
            args.tls_key.or(file.tls_key),
            args.tls_client_ca.or(file.tls_client_ca),
        ) {
            (None, None, None) => None,
            (Some(cert), Some(key), ca) => Some(TlsConfig {
                cert_pem: read_pem("tls_cert", &cert)?,
                key_pem: read_pem("tls_key", &key)?,
                client_ca_pem: ca.map(|ca| read_pem("tls_client_ca", &ca)).transpose()?,
            }),
            (cert, _, _) => {
                return Err(invalid(
                    if cert.is_some() {
                        "tls_key"
                    } else {
                        "tls_cert"
                    },
                    "",
                    "TLS needs both --tls-cert and --tls-key (--tls-client-ca adds mTLS)",
                ))
            }
        };

        let metrics_raw = args
            .metrics_addr
            .or(file.metrics_addr)
            .unwrap_or_else(|| "0.0.0.0:9090".into());
        let metrics_addr = if metrics_raw.eq_ignore_ascii_case("none") {
            None
        } else {
            Some(metrics_raw.parse().map_err(|e| {
                invalid(
                    "metrics_addr",
                    &metrics_raw,
                    format!("{e} (want IP:PORT or none)"),
                )
            })?)
        };

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

        let dns_raw = if args.discover_dns.is_empty() {
            file.discover_dns
        } else {
            args.discover_dns
        };
        let dns = dns_raw
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| dns_target(s))
            .collect::<Result<Vec<_>, _>>()?;
        let dns_server = match args.dns_server.or(file.dns_server) {
            None => None,
            Some(raw) => Some(
                raw.parse()
                    .map_err(|e| invalid("dns_server", &raw, format!("{e} (want IP:PORT)")))?,
            ),
        };
        let interval_raw = args
            .discovery_interval
            .or(file.discovery_interval)
            .unwrap_or_else(|| "5s".into());
        let interval = parse_duration(&interval_raw)
            .filter(|d| !d.is_zero())
            .ok_or_else(|| invalid("discovery_interval", &interval_raw, "want e.g. 5s or 500ms"))?;
        let discovery = crate::discovery::DiscoveryConfig {
            pods_file: args.pods_file.or(file.pods_file),
            dns,
            dns_server,
            interval,
        };

        let replay_endpoints: HashMap<String, String> = if args.replay_endpoint.is_empty() {
            file.replay_endpoints.into_iter().collect()
        } else {
            args.replay_endpoint
                .iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| {
                    s.split_once('=')
                        .map(|(p, e)| (p.to_owned(), e.to_owned()))
                        .ok_or_else(|| invalid("replay_endpoint", s, "want POD=tcp://host:port"))
                })
                .collect::<Result<_, _>>()?
        };
        for endpoint in replay_endpoints.values() {
            tcp_endpoint("replay_endpoint", endpoint)?;
        }
        let replay_raw = args
            .replay_timeout
            .or(file.replay_timeout)
            .unwrap_or_else(|| "2s".into());
        let replay_timeout = parse_duration(&replay_raw)
            .filter(|d| !d.is_zero())
            .ok_or_else(|| invalid("replay_timeout", &replay_raw, "want e.g. 2s or 500ms"))?;
        let by_memory = match args.max_memory.or(file.max_memory) {
            None => None,
            Some(raw) => Some(
                parse_bytes(&raw)
                    .filter(|b| *b >= BYTES_PER_ENTRY)
                    .ok_or_else(|| invalid("max_memory", &raw, "want a size, e.g. 4GiB"))?
                    / BYTES_PER_ENTRY,
            ),
        };
        let max_entries = match (args.max_blocks.or(file.max_blocks), by_memory) {
            (Some(0), _) => return Err(invalid("max_blocks", "0", "must be at least 1")),
            (a, b) => a.into_iter().chain(b).min(),
        };
        let snapshot_raw = args
            .snapshot_interval
            .or(file.snapshot_interval)
            .unwrap_or_else(|| "60s".into());
        let snapshot_interval = parse_duration(&snapshot_raw)
            .filter(|d| !d.is_zero())
            .ok_or_else(|| invalid("snapshot_interval", &snapshot_raw, "want e.g. 60s or 5m"))?;
        let snapshot_dir = args.snapshot_dir.or(file.snapshot_dir);
        let expiry_raw = args
            .pod_expiry
            .or(file.pod_expiry)
            .unwrap_or_else(|| "10m".into());
        let pod_expiry = if expiry_raw.eq_ignore_ascii_case("off") {
            None
        } else {
            Some(
                parse_duration(&expiry_raw)
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| invalid("pod_expiry", &expiry_raw, "want e.g. 10m, or off"))?,
            )
        };
        let drop_incomplete = match args
            .incomplete_pods
            .or(file.incomplete_pods)
            .as_deref()
            .unwrap_or("score")
        {
            "score" => false,
            "drop" => true,
            other => return Err(invalid("incomplete_pods", other, "want score or drop")),
        };

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

        let keys = key_schemes(&KeyArgs {
            key_mode: args.key_mode.or(file.key_mode),
            algo: args.engine_hash_algo.or(file.engine_hash_algo),
            seed: args.engine_hash_seed.or(file.engine_hash_seed),
            extra_keys: args.engine_extra_keys.or(file.engine_extra_keys),
            lora_paths: if args.lora_path.is_empty() {
                file.lora_paths.into_iter().collect()
            } else {
                args.lora_path
                    .iter()
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| {
                        s.split_once('=')
                            .map(|(n, p)| (n.trim().to_owned(), p.trim().to_owned()))
                            .ok_or_else(|| invalid("lora_path", s, "want NAME=PATH"))
                    })
                    .collect::<Result<_, _>>()?
            },
            assume_prefix_closed: args.assume_prefix_closed.or(file.assume_prefix_closed),
            self_check_every: args
                .engine_self_check_every
                .or(file.engine_self_check_every),
            per_model: if args.model_key_mode.is_empty() {
                file.model_key_modes.into_iter().collect()
            } else {
                args.model_key_mode
                    .iter()
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| {
                        s.split_once('=')
                            .map(|(m, spec)| (m.to_owned(), spec.to_owned()))
                            .ok_or_else(|| invalid("model_key_mode", s, "want MODEL=MODE"))
                    })
                    .collect::<Result<_, _>>()?
            },
        })?;

        let size = |setting: &'static str, raw: Option<String>, default: &str| {
            let raw = raw.unwrap_or_else(|| default.to_owned());
            parse_bytes(&raw)
                .filter(|n| *n > 0)
                .ok_or_else(|| invalid(setting, &raw, "want a positive size, e.g. 16MiB"))
        };
        let positive =
            |setting: &'static str, v: Option<usize>, default: usize| match v.unwrap_or(default) {
                0 => Err(invalid(setting, "0", "must be at least 1")),
                n => Ok(n),
            };
        let limits = Limits {
            max_message_bytes: size(
                "max_message",
                args.max_message.or(file.max_message),
                "16MiB",
            )?,
            max_prompt_bytes: size("max_prompt", args.max_prompt.or(file.max_prompt), "8MiB")?,
            max_prompt_tokens: positive(
                "max_prompt_tokens",
                args.max_prompt_tokens.or(file.max_prompt_tokens),
                1 << 20,
            )?,
            max_candidate_pods: positive(
                "max_candidate_pods",
                args.max_candidate_pods.or(file.max_candidate_pods),
                4096,
            )?,
            max_inflight: positive("max_inflight", args.max_inflight.or(file.max_inflight), 256)?,
        };

        let mut tokenizers = tokenizer::load::Sources::from_env();
        tokenizers.explicit = if args.tokenizer.is_empty() {
            file.tokenizers.into_iter().collect()
        } else {
            args.tokenizer
                .iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| {
                    s.split_once('=')
                        .map(|(m, p)| (m.to_owned(), PathBuf::from(p)))
                        .ok_or_else(|| invalid("tokenizer", s, "want MODEL=PATH"))
                })
                .collect::<Result<_, _>>()?
        };
        for (model, path) in &tokenizers.explicit {
            if !path.exists() {
                return Err(invalid(
                    "tokenizer",
                    format!("{model}={}", path.display()),
                    "path does not exist",
                ));
            }
        }
        tokenizers.models_dir = args.tokenizers_dir.or(file.tokenizers_dir);
        let cache_raw = args
            .tokenization_cache
            .or(file.tokenization_cache)
            .unwrap_or_else(|| "256MiB".into());
        let tokenization_cache_bytes = parse_bytes(&cache_raw).ok_or_else(|| {
            invalid(
                "tokenization_cache",
                &cache_raw,
                "want bytes, e.g. 268435456 or 256MiB",
            )
        })?;
        let allow_request_chat_template = args
            .allow_request_chat_template
            .or(file.allow_request_chat_template)
            .unwrap_or(false);
        let hub_raw = args
            .hub_timeout
            .or(file.hub_timeout)
            .unwrap_or_else(|| "30s".into());
        let hub_timeout = parse_duration(&hub_raw)
            .filter(|d| !d.is_zero())
            .ok_or_else(|| invalid("hub_timeout", &hub_raw, "want e.g. 30s or 500ms"))?;

        Ok(Config {
            grpc_addr,
            tls,
            metrics_addr,
            zmq_bind,
            zmq_connect,
            discovery,
            replay_endpoints,
            replay_timeout,
            pod_expiry,
            topic_filter,
            indexer: IndexerConfig {
                default_block_size: block_size,
                tier_weights: weights,
                keys,
                drop_incomplete,
                max_entries,
            },
            log_format,
            log_level,
            ingest_workers,
            limits,
            snapshot_dir,
            snapshot_interval,
            tokenizers,
            tokenization_cache_bytes,
            allow_request_chat_template,
            hub_timeout,
        })
    }
}

/// Key-mode settings after precedence, before validation.
struct KeyArgs {
    key_mode: Option<String>,
    algo: Option<String>,
    seed: Option<String>,
    extra_keys: Option<String>,
    lora_paths: Vec<(String, String)>,
    assume_prefix_closed: Option<bool>,
    self_check_every: Option<u32>,
    per_model: Vec<(String, String)>,
}

/// Builds an engine key configuration, checking that it can be reproduced.
fn engine_keys(
    setting: &'static str,
    algo: Option<&str>,
    seed: Option<&str>,
    k: &KeyArgs,
) -> Result<EngineKeys, ConfigError> {
    let algo_name = algo.unwrap_or("sha256");
    let algo = HashAlgo::parse(algo_name).ok_or_else(|| {
        invalid(
            setting,
            algo_name,
            "want sha256, sha256_cbor, xxhash or xxhash_cbor",
        )
    })?;
    if algo.needs_explicit_seed() && seed.is_none() {
        return Err(invalid(
            setting,
            algo_name,
            "xxhash hashes are only reproducible when the pods set PYTHONHASHSEED: give it as the engine hash seed",
        ));
    }
    let style = match k.extra_keys.as_deref().unwrap_or("tagged") {
        "tagged" => ExtraKeyStyle::Tagged,
        "bare" => ExtraKeyStyle::Bare,
        other => return Err(invalid("engine_extra_keys", other, "want tagged or bare")),
    };
    Ok(EngineKeys {
        hasher: EngineHasher::new(algo, seed.unwrap_or(DEFAULT_SEED), style),
        lora_paths: k.lora_paths.iter().cloned().collect::<HashMap<_, _>>(),
        assume_prefix_closed: k.assume_prefix_closed.unwrap_or(true),
        self_check_every: k.self_check_every.unwrap_or(64),
    })
}

fn key_schemes(k: &KeyArgs) -> Result<KeySchemes, ConfigError> {
    let default = match k.key_mode.as_deref().unwrap_or("token") {
        "token" => KeyMode::Token,
        "engine" => KeyMode::Engine(Box::new(engine_keys(
            "engine_hash_algo",
            k.algo.as_deref(),
            k.seed.as_deref(),
            k,
        )?)),
        other => return Err(invalid("key_mode", other, "want token or engine")),
    };
    let mut per_model = HashMap::new();
    for (model, spec) in &k.per_model {
        let mut parts = spec.splitn(3, ':');
        let mode = match parts.next().unwrap_or_default() {
            "token" => KeyMode::Token,
            "engine" => {
                let algo = parts.next().or(k.algo.as_deref());
                let seed = parts.next().or(k.seed.as_deref());
                KeyMode::Engine(Box::new(engine_keys("model_key_mode", algo, seed, k)?))
            }
            _ => {
                return Err(invalid(
                    "model_key_mode",
                    format!("{model}={spec}"),
                    "want MODEL=token or MODEL=engine[:ALGO[:SEED]]",
                ))
            }
        };
        per_model.insert(model.clone(), mode);
    }
    Ok(KeySchemes { default, per_model })
}

/// Memory one (pod, block) entry costs at capacity, all structures and
/// allocator overhead included: tests/memory.rs measures about 77 MB of
/// resident memory for 200,000 entries including the process itself, so
/// 400 bytes keeps --max-memory on the safe side.
pub const BYTES_PER_ENTRY: usize = 400;

/// `1234`, `64KiB`, `256MiB`, `2GiB` (also `K`/`M`/`G`, `KB`/`MB`/`GB` as
/// powers of 1024).
pub fn parse_bytes(raw: &str) -> Option<usize> {
    let s = raw.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num.parse().ok()?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
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

/// `NAME:PORT[,replay-port=PORT]`.
fn dns_target(raw: &str) -> Result<crate::discovery::DnsTarget, ConfigError> {
    let mut parts = raw.split(',').map(str::trim);
    let main = parts.next().unwrap_or_default();
    let (name, port) = main
        .rsplit_once(':')
        .ok_or_else(|| invalid("discover_dns", raw, "want NAME:PORT"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| invalid("discover_dns", raw, "port must be a number 1-65535"))?;
    if name.is_empty() || port == 0 {
        return Err(invalid("discover_dns", raw, "want NAME:PORT"));
    }
    let mut replay_port = None;
    for option in parts {
        match option.split_once('=') {
            Some(("replay-port", p)) => {
                replay_port =
                    Some(p.parse().map_err(|_| {
                        invalid("discover_dns", raw, "replay-port must be a number")
                    })?)
            }
            _ => {
                return Err(invalid(
                    "discover_dns",
                    raw,
                    format!("unknown option {option:?}"),
                ))
            }
        }
    }
    Ok(crate::discovery::DnsTarget {
        name: name.to_owned(),
        port,
        replay_port,
    })
}

/// `5s`, `500ms`, `2m`, `1h`.
pub fn parse_duration(raw: &str) -> Option<std::time::Duration> {
    let s = raw.trim();
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "ms" => std::time::Duration::from_millis(n),
        "s" => std::time::Duration::from_secs(n),
        "m" => std::time::Duration::from_secs(n.checked_mul(60)?),
        "h" => std::time::Duration::from_secs(n.checked_mul(3600)?),
        _ => return None,
    })
}

pub(crate) fn dial_target(raw: &str) -> Result<DialTarget, ConfigError> {
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
        assert!(!c.allow_request_chat_template);
        assert_eq!(c.hub_timeout, std::time::Duration::from_secs(30));
        let c = Config::merge(
            args(&["--allow-request-chat-template"]),
            FileConfig::default(),
        );
        assert!(c.unwrap().allow_request_chat_template);
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
            (&["--metrics-addr", "nope"], "metrics_addr"),
            (&["--tls-cert", "/etc/hostname"], "tls_key"),
            (
                &["--tls-cert", "/etc/hostname", "--tls-key", "/etc/hostname"],
                "tls_cert",
            ),
            (&["--discover-dns", "svc"], "discover_dns"),
            (&["--discover-dns", "svc:1,replay=2"], "discover_dns"),
            (&["--dns-server", "x"], "dns_server"),
            (&["--discovery-interval", "5"], "discovery_interval"),
            (&["--replay-endpoint", "p"], "replay_endpoint"),
            (&["--replay-endpoint", "p=udp://x:1"], "replay_endpoint"),
            (&["--replay-timeout", "0s"], "replay_timeout"),
            (&["--pod-expiry", "soon"], "pod_expiry"),
            (&["--incomplete-pods", "ignore"], "incomplete_pods"),
            (&["--zmq-bind", "udp://x:1"], "zmq_bind"),
            (&["--zmq-connect", "tcp://a"], "zmq_connect"),
            (&["--zmq-connect", "tcp://a:1,foo=bar"], "zmq_connect"),
            (&["--block-size", "0"], "block_size"),
            (&["--tier-weight", "gpu=2"], "tier_weight"),
            (&["--tier-weight", "tpu=1"], "tier_weight"),
            (&["--log-format", "xml"], "log_format"),
            (&["--log-level", "info,=[bad"], "log_level"),
            (&["--ingest-workers", "0"], "ingest_workers"),
            (&["--key-mode", "hash"], "key_mode"),
            (
                &["--key-mode", "engine", "--engine-hash-algo", "md5"],
                "engine_hash_algo",
            ),
            (
                &["--key-mode", "engine", "--engine-hash-algo", "xxhash"],
                "PYTHONHASHSEED",
            ),
            (
                &["--key-mode", "engine", "--engine-extra-keys", "x"],
                "engine_extra_keys",
            ),
            (&["--lora-path", "nopath"], "lora_path"),
            (&["--model-key-mode", "m=fast"], "model_key_mode"),
            (&["--model-key-mode", "m=engine:sha1"], "model_key_mode"),
            (&["--tokenizer", "m"], "tokenizer"),
            (&["--tokenizer", "m=/no/such/dir"], "tokenizer"),
            (&["--tokenization-cache", "lots"], "tokenization_cache"),
            (&["--hub-timeout", "soon"], "hub_timeout"),
            (&["--max-message", "0"], "max_message"),
            (&["--max-blocks", "0"], "max_blocks"),
            (&["--snapshot-interval", "often"], "snapshot_interval"),
            (&["--max-memory", "12"], "max_memory"),
            (&["--max-inflight", "0"], "max_inflight"),
            (&["--max-prompt-tokens", "0"], "max_prompt_tokens"),
        ];
        for (flags, setting) in cases {
            let err = Config::merge(args(flags), FileConfig::default()).unwrap_err();
            assert!(err.to_string().contains(setting), "{flags:?}: {err}");
        }
    }

    #[test]
    fn key_modes_per_model() {
        let c = Config::merge(
            args(&[
                "--key-mode",
                "engine",
                "--engine-hash-algo",
                "sha256_cbor",
                "--lora-path",
                "sql=/loras/sql",
                "--model-key-mode",
                "org/a=token",
                "--model-key-mode",
                "org/b=engine:xxhash:42",
            ]),
            FileConfig::default(),
        )
        .unwrap();
        let keys = &c.indexer.keys;
        let e = keys.default.engine().unwrap();
        assert_eq!(e.hasher.algo(), HashAlgo::Sha256Cbor);
        assert!(e.assume_prefix_closed);
        assert_eq!(e.lora_paths["sql"], "/loras/sql");
        assert!(keys.for_model("org/a").engine().is_none());
        assert_eq!(
            keys.for_model("org/b").engine().unwrap().hasher.algo(),
            HashAlgo::Xxhash
        );
        assert!(keys.for_model("org/c").engine().is_some());
        let file: FileConfig = serde_norway::from_str(
            "key_mode: engine\nengine_hash_seed: '7'\nassume_prefix_closed: false\nmodel_key_modes: {x: token}\n",
        )
        .unwrap();
        let c = Config::merge(Args::default(), file).unwrap();
        let e = c.indexer.keys.default.engine().unwrap();
        assert!(!e.assume_prefix_closed);
        assert!(c.indexer.keys.for_model("x").engine().is_none());
    }

    #[test]
    fn byte_sizes_parse() {
        assert_eq!(parse_bytes("1234"), Some(1234));
        assert_eq!(parse_bytes("64KiB"), Some(64 << 10));
        assert_eq!(parse_bytes("256MiB"), Some(256 << 20));
        assert_eq!(parse_bytes("2G"), Some(2 << 30));
        assert_eq!(parse_bytes("2 TB"), None);
        assert_eq!(parse_bytes("MiB"), None);
    }

    #[test]
    fn unknown_file_keys_are_rejected() {
        let err = serde_norway::from_str::<FileConfig>("grpc_adr: 1.2.3.4:5\n").unwrap_err();
        assert!(err.to_string().contains("grpc_adr"), "{err}");
    }
}

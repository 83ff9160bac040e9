//! Settings: flags, `KV_INDEXER_*` environment variables and an optional YAML
//! file, parsed and validated once at start into a typed [`Config`]. A bad
//! value fails fast with the setting's name.
//!
//! Precedence: flag > environment variable > config file > built-in default.
//!
//! - `settings.rs`: the table, every setting once (name, type, default,
//!   help); the flag, the environment variable and the YAML key all come
//!   from its entry.
//! - `file.rs`: the `--config` file, read into the same `Settings` type
//!   with the same parsers.
//! - `values.rs`: what each kind of value looks like (sizes, durations,
//!   `KEY=VALUE` pairs, ...), one `FromStr` per kind, shared by all sources.
//! - `endpoints.rs`: ZeroMQ endpoints and DNS targets.
//! - `validate.rs`: ranges and settings that depend on each other, into
//!   [`Config`].
//!
//! Plain data that the rest of the service reads; the command line around
//! it (subcommands, parsing, `--help`) is the binary's `cli` (`src/bin/kv-indexer/cli/`).

mod endpoints;
mod file;
mod settings;
mod validate;
mod values;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use indexer::IndexerConfig;

pub(crate) use endpoints::dial_targets;
pub use endpoints::{DnsTarget, PeerTarget};
pub use settings::Settings;
pub use values::{parse_bytes, IngestPriority, LogFormat};

/// The `--config` file holds the same settings as the flags, in the same
/// type: one parser per setting whatever the source.
pub type FileConfig = Settings;

/// Where pods are discovered (`--pods-file`, `--discover-dns`):
/// `discovery.rs` reads it.
#[derive(Clone, Debug, Default)]
pub struct DiscoveryConfig {
    pub pods_file: Option<PathBuf>,
    pub dns: Vec<DnsTarget>,
    /// Resolve with this DNS server instead of the system resolver.
    pub dns_server: Option<SocketAddr>,
    pub interval: std::time::Duration,
}

impl DiscoveryConfig {
    pub fn is_enabled(&self) -> bool {
        self.pods_file.is_some() || !self.dns.is_empty()
    }
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

/// A shared secret read from a file: never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Replicas of one fleet (`--peer`, `--peer-wait`, `--peer-token-file`).
#[derive(Clone, Debug)]
pub struct PeerConfig {
    pub targets: Vec<PeerTarget>,
    pub wait: std::time::Duration,
    pub token: Option<Secret>,
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
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DialTarget {
    pub endpoint: String,
    pub replay: Option<String>,
    /// `pod=NAME,model=MODEL`: every message on this connection is that
    /// pod's, whatever its topic (SGLang publishes none by default). The
    /// topic the pod goes by: `kv@NAME@MODEL`.
    pub named: Option<String>,
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
    pub discovery: DiscoveryConfig,
    pub replay_endpoints: HashMap<String, String>,
    pub replay_timeout: std::time::Duration,
    /// Dial mode: expiry of silent, disconnected pods (`None`: never).
    pub pod_expiry: Option<std::time::Duration>,
    pub topic_filter: String,
    /// Bound pods with an empty topic serve this model, named by address.
    pub topicless_model: Option<String>,
    pub indexer: IndexerConfig,
    pub log_format: LogFormat,
    pub log_level: String,
    pub ingest_workers: usize,
    pub ingest_priority: IngestPriority,
    pub limits: Limits,
    pub snapshot_dir: Option<PathBuf>,
    pub snapshot_interval: std::time::Duration,
    pub peers: PeerConfig,
    /// After a restored start: the longest wait for pods' first catch-ups
    /// before Ready.
    pub catch_up_wait: std::time::Duration,
    pub tokenizers: tokenizer::load::Sources,
    /// Tokenization cache bytes, per model.
    pub tokenization_cache_bytes: usize,
    /// Largest ZeroMQ message accepted from a pod; larger ones are refused
    /// by the socket.
    pub max_event_message_bytes: usize,
    /// Messages queued per ingest worker; beyond, new messages are dropped
    /// and counted.
    pub ingest_queue: usize,
    /// Bytes of messages queued per ingest worker.
    pub ingest_queue_bytes: usize,
    /// Bind mode: the source networks that may connect to the event port
    /// (empty: any).
    pub zmq_allow: Vec<ipnet::IpNet>,
    /// Most cache domains (pod, DP rank) held.
    pub max_pods: usize,
    /// Most models held.
    pub max_models: usize,
    /// Accept a request-level `chat_template`.
    pub allow_request_chat_template: bool,
    /// Connect/read timeout of one Hugging Face Hub request.
    pub hub_timeout: std::time::Duration,
    /// Models' vLLM render servers, for chats with media parts.
    pub render: RenderConfig,
    /// Admin RPCs (`RemovePod`) allowed; otherwise refused.
    pub admin: bool,
    /// Most concurrent gRPC connections (and, separately, metrics HTTP
    /// connections).
    pub max_connections: usize,
    /// Routing feedback (`RecordRouting`).
    pub routing: RoutingConfig,
}

/// Routing feedback: speculative entries, outcomes, the approximate index.
/// `--render-url`, `--render-timeout`, `--render-concurrency`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RenderConfig {
    /// Model -> render server base URL.
    pub urls: HashMap<String, String>,
    pub timeout: std::time::Duration,
    pub concurrency: usize,
}

#[derive(Clone, Debug)]
pub struct RoutingConfig {
    pub ttl: indexer::routing::ttl::TtlPolicy,
    pub approximate_models: Vec<String>,
    pub approximate_capacity: usize,
    /// Memory for all of it: speculative entries, routings awaiting their
    /// outcome, prompt handles, approximate history.
    pub budget_bytes: usize,
}

/// Of --max-memory, the share routing feedback may use (1/8).
pub const ROUTING_SHARE: usize = 8;
/// Without --max-memory.
pub const DEFAULT_ROUTING_BYTES: usize = 256 << 20;
/// What a speculative entry costs (key, end, map slot and overhead).
pub const BYTES_PER_SPECULATIVE: usize = 48;
/// What a block of approximate history costs (two maps' entries).
pub const BYTES_PER_APPROXIMATE: usize = 96;

impl RoutingConfig {
    /// Budget split: speculative entries 3/8, routings awaiting their
    /// outcome 1/4, prompt handles 1/8, approximate history 1/4.
    pub fn speculative_entries(&self) -> usize {
        (self.budget_bytes / 8 * 3 / BYTES_PER_SPECULATIVE).max(1)
    }

    pub fn tracked_bytes(&self) -> usize {
        self.budget_bytes / 4
    }

    pub fn handle_bytes(&self) -> usize {
        self.budget_bytes / 8
    }

    pub fn approximate_entries(&self) -> usize {
        (self.budget_bytes / 4 / BYTES_PER_APPROXIMATE).max(1)
    }
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
    /// The error names the key (`max_memory: invalid value ...`).
    #[error("config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_path_to_error::Error<serde_norway::Error>,
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

/// Memory one (pod, block) entry costs at capacity, all structures and
/// allocator overhead included: tests/it/memory.rs measures what 200,000
/// entries add to the process's resident memory at capacity, 93 bytes each
/// in a release build (107-111 before the shared table's slot went from 32
/// bytes to 24; one holder per key, the index's worst case), and checks it
/// against this. 256 leaves room for what that test
/// does not do: token keys (8 bytes more per entry), blocks linked to
/// parents the pod no longer holds (up to 16), re-stores (stale
/// eviction-order entries) and tables that have just doubled. It was 400
/// while the index's tables were sized at twice their share (~200 bytes
/// measured then).
pub const BYTES_PER_ENTRY: usize = 256;

/// Memory a cache domain costs before it holds any block (its pod record,
/// names, stream state, map headers, allocator overhead): tests/it/hostile.rs
/// measures ~1.9 KB per pod holding a few blocks; twice that keeps
/// --max-memory on the safe side.
pub const BYTES_PER_POD: usize = 4096;

impl Config {
    /// Merges `settings` (flags and environment, joined by clap) over the
    /// `--config` file (if any) and validates.
    pub fn load(settings: Settings, file: Option<&Path>) -> Result<Config, ConfigError> {
        let file = match file {
            Some(path) => file::read_file(path)?,
            None => FileConfig::default(),
        };
        Config::merge(settings, file)
    }

    /// Flags and environment over the file, then the defaults, then
    /// validation.
    pub fn merge(settings: Settings, file: FileConfig) -> Result<Config, ConfigError> {
        validate::validate(settings.or(file).resolve())
    }
}

#[cfg(test)]
mod tests {
    use indexer::keys::engine_hash::HashAlgo;
    use indexer::score::TierWeights;

    use super::*;

    /// The settings as the command line takes them.
    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        settings: Settings,
    }

    fn args(list: &[&str]) -> Settings {
        use clap::Parser;
        Flags::try_parse_from(std::iter::once("kv-indexer").chain(list.iter().copied()))
            .unwrap()
            .settings
    }

    #[test]
    fn defaults_are_sensible() {
        let c = Config::merge(Settings::default(), FileConfig::default()).unwrap();
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
                    replay: Some("tcp://a:2".into()),
                    named: None,
                },
                DialTarget {
                    endpoint: "tcp://b:1".into(),
                    replay: None,
                    named: None,
                },
            ]
        );
        assert_eq!(c.indexer.default_block_size, 32);
        // Flags replace the file's weights; unspecified tiers keep defaults.
        assert_eq!(c.indexer.tier_weights.0, [1.0, 0.5, 0.0]);
    }

    #[test]
    fn newer_settings_defaults_forms_and_bounds() {
        let c = Config::merge(Settings::default(), FileConfig::default()).unwrap();
        assert_eq!(c.max_event_message_bytes, 4 << 20);
        assert_eq!((c.ingest_queue, c.ingest_queue_bytes), (65536, 64 << 20));
        assert!(c.zmq_allow.is_empty());
        assert_eq!((c.max_pods, c.max_models), (10_000, 64));
        assert_eq!(c.max_connections, 1024);
        assert!(!c.allow_request_chat_template);
        assert!(!c.admin);
        assert_eq!(c.hub_timeout, std::time::Duration::from_secs(30));

        let c = Config::merge(
            args(&[
                "--admin",
                "--allow-request-chat-template=true",
                "--zmq-allow",
                "10.0.0.0/8,192.168.1.7",
                "--zmq-allow",
                "fd00::/8",
                "--hub-timeout",
                "1m 30s",
                "--max-event-message",
                "1MiB",
                "--ingest-queue",
                "8",
            ]),
            FileConfig::default(),
        )
        .unwrap();
        assert!(c.admin && c.allow_request_chat_template);
        let allow: Vec<String> = c.zmq_allow.iter().map(|n| n.to_string()).collect();
        assert_eq!(allow, ["10.0.0.0/8", "192.168.1.7/32", "fd00::/8"]);
        assert_eq!(c.hub_timeout, std::time::Duration::from_secs(90));
        assert_eq!((c.max_event_message_bytes, c.ingest_queue), (1 << 20, 8));

        // Every spelling of a bool, and the flag still wins over the file.
        let file = || -> FileConfig { serde_norway::from_str("admin: true\n").unwrap() };
        assert!(Config::merge(Settings::default(), file()).unwrap().admin);
        for no in [&["--admin=false"][..], &["--admin", "false"]] {
            assert!(!Config::merge(args(no), file()).unwrap().admin, "{no:?}");
        }

        let cases: &[(&[&str], &str)] = &[
            (&["--max-event-message", "0"], "max_event_message"),
            (&["--ingest-queue", "0"], "ingest_queue"),
            (&["--max-pods", "0"], "max_pods"),
            (&["--max-models", "0"], "max_models"),
            (&["--max-connections", "0"], "max_connections"),
            (&["--hub-timeout", "0s"], "hub_timeout"),
            (
                &["--zmq-allow", "10.0.0.1", "--zmq-bind", "none"],
                "zmq_allow",
            ),
        ];
        for (flags, setting) in cases {
            let err = Config::merge(args(flags), FileConfig::default()).unwrap_err();
            assert!(err.to_string().contains(setting), "{flags:?}: {err}");
        }
        for bad in [&["--zmq-allow", "10.0.0.0/40"][..], &["--admin", "maybe"]] {
            assert!(<Flags as clap::Parser>::try_parse_from(
                std::iter::once("kv-indexer").chain(bad.iter().copied())
            )
            .is_err());
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
        let c = Config::merge(Settings::default(), file).unwrap();
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

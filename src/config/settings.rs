//! The settings table: every setting once, with its name, type (which is
//! its parser, see `values.rs`), default and help. From that one entry:
//!
//! - the flag `--NAME` (kebab-case) and its help, with the default appended;
//! - the environment variable `KV_INDEXER_NAME` (upper case), set on every
//!   flag by [`finish_arg`], because clap's derive has no prefix for them;
//! - the YAML key `NAME` (snake_case, the field's own name), with older
//!   spellings as serde aliases;
//! - the precedence, `Settings::or` (flag or environment, else file), and the
//!   default, `Settings::resolve`.
//!
//! Every field is an `Option` so that "not given" survives until the file
//! has had its say: a clap `default_value` would win over the file.

use std::net::SocketAddr;
use std::path::PathBuf;

use humantime::Duration;
use serde::Deserialize;

use super::endpoints::DialTargets;
use super::endpoints::{BindEndpoint, ReplayEndpoint};
use super::file::from_file;
use super::values::*;
use super::DnsTarget;
use super::PeerTarget;

/// Writes the struct, its precedence and defaults from the table below.
/// An entry is `doc, attributes, name: Type [= "default"],`. The type is
/// what clap and the file parse (`FromStr`); the default is text, parsed
/// the same way. Without a default, the resolved value stays an `Option`
/// (for lists: `None` is empty).
macro_rules! settings {
    ($(
        $(#[$attr:meta])*
        $name:ident: $ty:ty $(= $default:literal)?,
    )*) => {
        /// Every setting, each `None` unless given. Parsed from flags and
        /// environment variables (clap), and from the `--config` file
        /// (serde) into this same type, then joined with [`Settings::or`].
        #[derive(clap::Args, Deserialize, Debug, Default)]
        #[serde(deny_unknown_fields)]
        #[command(mut_args = finish_arg)]
        pub struct Settings {
            $(
                $(#[$attr])*
                #[arg(long)]
                #[serde(default, deserialize_with = "from_file")]
                pub $name: Option<$ty>,
            )*
        }

        /// The settings after precedence and defaults: what `validate.rs`
        /// turns into a `Config`.
        pub(super) struct Resolved {
            $( pub $name: resolved_type!($ty $(, $default)?), )*
        }

        impl Settings {
            /// Every setting's name (flag, file key and environment suffix).
            pub const NAMES: &[&str] = &[$(stringify!($name)),*];

            /// `self` (flags and environment) where given, else `lower` (the file).
            pub fn or(self, lower: Settings) -> Settings {
                Settings { $( $name: self.$name.or(lower.$name), )* }
            }

            /// Fills in the defaults.
            pub(super) fn resolve(self) -> Resolved {
                Resolved { $( $name: resolve_value!(self.$name, $name $(, $default)?), )* }
            }

            /// The default as written in the table, for `--help`.
            fn default_text(name: &str) -> Option<&'static str> {
                match name {
                    $($( stringify!($name) => Some($default), )?)*
                    _ => None,
                }
            }
        }
    };
}

macro_rules! resolved_type {
    ($ty:ty) => { Option<$ty> };
    ($ty:ty, $default:literal) => { $ty };
}

macro_rules! resolve_value {
    ($value:expr, $name:ident) => {
        $value
    };
    ($value:expr, $name:ident, $default:literal) => {
        $value.unwrap_or_else(|| parse_default(stringify!($name), $default))
    };
}

// The order is `--help`'s. Bool settings take `num_args = 0..=1` with a
// missing value meaning true: `--admin` alone, `--admin=false` and (as
// `--assume-prefix-closed false` always has) `--admin false` all work.
settings! {
    /// gRPC listen address.
    grpc_addr: SocketAddr = "0.0.0.0:50051",

    /// PEM certificate (chain) for gRPC over TLS; with --tls-key.
    tls_cert: PathBuf,

    /// PEM private key for --tls-cert.
    tls_key: PathBuf,

    /// PEM CA certificate(s): require and verify client certificates (mTLS).
    tls_client_ca: PathBuf,

    /// Most concurrent gRPC connections (and, separately, most metrics HTTP
    /// connections); beyond it a new one takes the slot of the one silent
    /// longest.
    max_connections: usize = "1024",

    /// Enable admin RPCs (RemovePod); without it they are refused.
    #[arg(num_args = 0..=1, default_missing_value = "true")]
    admin: bool = "false",

    /// HTTP address for `/metrics`, `/healthz` and `/readyz`; `none`
    /// disables.
    metrics_addr: OrNone<SocketAddr> = "0.0.0.0:9090",

    /// ZeroMQ endpoint to bind a SUB socket on, for pods that connect to the
    /// indexer; `none` disables.
    zmq_bind: OrNone<BindEndpoint> = "tcp://*:5557",

    /// Bind mode: only these source networks (`10.0.0.0/8`, or one address)
    /// may connect to the event port. Repeatable or comma-separated
    /// [default: any].
    #[arg(value_delimiter = ',')]
    zmq_allow: Vec<Item<Network>>,

    /// A pod's PUB endpoint to connect to, optionally with its replay (ROUTER)
    /// endpoint: `tcp://pod:5557[,replay=tcp://pod:5558]`. `pod=NAME,model=MODEL`
    /// names the pod for publishers with no usable topic (SGLang's default);
    /// `dp-ranks=N` dials N data-parallel ranks on consecutive ports.
    /// Repeatable; in the environment variable, separate targets with spaces.
    #[arg(value_delimiter = ' ')]
    zmq_connect: Vec<Item<DialTargets>>,

    /// A pods file (YAML or JSON list of endpoints as for --zmq-connect, or
    /// `{endpoint, replay}` objects), re-read when it changes (a mounted
    /// ConfigMap).
    pods_file: PathBuf,

    /// Dial every address of a DNS name, re-resolved periodically (a
    /// Kubernetes headless Service): `NAME:PORT[,replay-port=PORT]`.
    /// Repeatable; in the environment variable, separate names with spaces.
    #[arg(value_delimiter = ' ')]
    discover_dns: Vec<Item<DnsTarget>>,

    /// DNS server (`IP:PORT`) for --discover-dns instead of the system
    /// resolver.
    dns_server: SocketAddr,

    /// How often the pods file is checked and DNS names re-resolved, e.g.
    /// `5s`, `500ms`.
    discovery_interval: Duration = "5s",

    /// Replay endpoint of a pod that connects to us (bind mode), by the pod
    /// name in its topic: `POD=tcp://host:port`. Repeatable; in the
    /// environment variable, separate them with spaces. (Dial targets carry
    /// theirs in --zmq-connect.)
    #[arg(value_delimiter = ' ')]
    #[serde(alias = "replay_endpoints")]
    replay_endpoint: Vec<Item<ReplayEndpoint>>,

    /// Forget a pod (either mode) whose connection has been down and that has
    /// published nothing for this long (silence alone proves nothing);
    /// `off` disables.
    pod_expiry: OrNone<Duration> = "10m",

    /// How long one replay request may take, e.g. `2s`.
    replay_timeout: Duration = "2s",

    /// Pods with gaps replay could not fill: `score` them anyway (their
    /// matches may be low) or `drop` them (score 0, flagged).
    incomplete_pods: IncompletePods = "score",

    /// Weight of a speculatively held block (routed to the pod with
    /// RecordRouting, its stores not arrived yet) in Score's `score`, in
    /// [0, 1]; 0 scores exact blocks only.
    speculative_weight: f64 = "1.0",

    /// How long a routing's speculative entries last: `auto` (per pod, from
    /// how long its stores take to follow a routing: 1.5x their 95th
    /// percentile, within 100ms..10s, 2s until 8 are seen) or a duration,
    /// e.g. `2s`.
    speculative_ttl: SpeculativeTtl = "auto",

    /// A model whose pods publish no KV events: its RecordRouting history
    /// is its index (answers flagged `approximate`). It switches to the
    /// exact index on its own once a pod publishes. Repeatable; in the
    /// environment variable, separate them with spaces.
    #[arg(value_delimiter = ' ')]
    #[serde(alias = "approximate_models")]
    approximate_model: Vec<Item<String>>,

    /// Blocks of routing history kept per pod of an --approximate-model,
    /// the least recently routed dropped first.
    approximate_capacity: usize = "31250",

    /// Topic prefix a message's topic must start with (others are skipped
    /// and counted; a dial target's `pod=` ignores the topic).
    topic_filter: String = "kv@",

    /// Pods that connect to the bound socket with an empty topic (SGLang's
    /// default) serve this model, each named by its address
    /// [default: none: such messages are skipped and counted].
    topicless_model: String,

    /// Largest ZeroMQ message accepted from a pod, e.g. `4MiB`; larger ones
    /// are refused by the socket.
    max_event_message: Size = "4MiB",

    /// Threads applying events to the index; a pod's events always go to the
    /// same one, in order [default: number of CPUs].
    ingest_workers: usize,

    /// CPU priority of the threads that receive and apply events (libzmq's,
    /// the receivers, the workers): `normal`, or `idle`, where they run only
    /// when no other thread wants the CPU, so Score never waits for them;
    /// ingest then lags, and past its queues drops, while the cores are
    /// saturated.
    ingest_priority: IngestPriority = "normal",

    /// Messages queued per ingest worker; beyond (or beyond
    /// --ingest-queue-bytes), new messages are dropped and counted.
    ingest_queue: usize = "65536",

    /// Bytes of messages queued per ingest worker, e.g. `64MiB`: a deep
    /// queue for small batches, a bounded one for large.
    ingest_queue_bytes: Size = "64MiB",

    /// Block size assumed for a model until its events show one.
    block_size: u32 = "16",

    /// Score weight of a tier, `TIER=WEIGHT` with TIER in gpu|cpu|storage and
    /// WEIGHT in [0, 1]; tiers left out keep theirs. Repeatable or
    /// comma-separated [default: gpu=1,cpu=0.8,storage=0.5].
    #[arg(value_delimiter = ',')]
    #[serde(alias = "tier_weights")]
    tier_weight: Vec<Item<TierWeight>>,

    /// The pods' offloaded block size in tokens (the `block_size` in their
    /// offloading connector's kv_connector_extra_config). Above a model's
    /// block size, offloaded blocks count in whole chunks, as vLLM loads
    /// them. 0: as the pods' offload events say (older vLLM), else blocks.
    offload_block_size: u32 = "0",

    /// Log format.
    log_format: LogFormat = "text",

    /// Log filter (`RUST_LOG` syntax; `RUST_LOG` wins if set).
    log_level: String = "info",

    /// Most (pod, block) entries the index holds; beyond, the largest pods
    /// lose their least recently stored blocks [default: unbounded].
    max_blocks: usize,

    /// Memory budget for the index, e.g. `4GiB`: converted to entries at
    /// 256 bytes each (with --max-blocks, the smaller wins).
    max_memory: Size,

    /// Most cache domains (pod, data-parallel rank) held.
    max_pods: usize = "10000",

    /// Most models held.
    max_models: usize = "64",

    /// A peer replica to copy the index from before reporting Ready:
    /// `HOST:PORT` of its gRPC port, or `dns:///NAME:PORT` for every address
    /// the name resolves to (this replica's own skipped). Tried in order;
    /// repeatable; in the environment variable, separate peers with spaces.
    #[arg(value_delimiter = ' ')]
    peer: Vec<Item<PeerTarget>>,

    /// How long to look for a Ready peer (--peer) before starting from the
    /// snapshot file, or empty, e.g. `5s`.
    peer_wait: Duration = "5s",

    /// File holding the fleet's shared secret: presented to peers, and
    /// required of replicas that copy this one's index (or a client
    /// certificate --tls-client-ca trusts). Neither: peer RPCs are refused.
    peer_token_file: PathBuf,

    /// After a start from a peer's index or a snapshot: how long readiness
    /// waits for every pod's replay buffer to be applied (each dialed pod's,
    /// each bound pod's with a --replay-endpoint), e.g. `10s`.
    catch_up_wait: Duration = "10s",

    /// Directory for index snapshots: written every --snapshot-interval and
    /// on shutdown, loaded at start [default: none].
    snapshot_dir: PathBuf,

    /// How often to write a snapshot, e.g. `60s`.
    snapshot_interval: Duration = "60s",

    /// Largest gRPC request accepted, e.g. `16MiB`.
    max_message: Size = "16MiB",

    /// Largest text prompt or chat request accepted, in bytes.
    max_prompt: Size = "8MiB",

    /// Most tokens a prompt may have.
    max_prompt_tokens: usize = "1048576",

    /// Most candidate pods in one request.
    max_candidate_pods: usize = "4096",

    /// Scoring requests (Score, Tokenize, GetPodScores) in flight at once;
    /// more are refused at once with RESOURCE_EXHAUSTED.
    max_inflight: usize = "256",

    /// Block keys: `token` (ours, from token ids) or `engine` (vLLM's own
    /// block hashes; needs the pods' hash algorithm and seed).
    key_mode: KeyModeName = "token",

    /// Engine mode: the pods' `--prefix-caching-hash-algo`: sha256,
    /// sha256_cbor, xxhash or xxhash_cbor; for SGLang pods `sglang`, or
    /// `sglang_dynamo` when their `--kv-events-config` has `"format":
    /// "dynamo"` (their seed and extra-key settings do not apply).
    engine_hash_algo: HashAlgoName = "sha256",

    /// Engine mode: the pods' `PYTHONHASHSEED`, if they set one
    /// [default: vllm-none-hash, vLLM's own default for sha256 algorithms].
    engine_hash_seed: String,

    /// Engine mode: how the pods' vLLM hashes LoRA names and cache salts:
    /// `tagged` (vLLM >= 0.31) or `bare` (older).
    engine_extra_keys: ExtraKeys = "tagged",

    /// Engine mode: a LoRA adapter's path as given to vLLM, `NAME=PATH`
    /// (hashed since vLLM 0.31, absent from events), or to SGLang's
    /// `--lora-paths NAME=PATH` (its adapter id is made of both). Adapters
    /// without one use token keys. Repeatable or comma-separated.
    #[arg(value_delimiter = ',')]
    #[serde(alias = "lora_paths")]
    lora_path: Vec<Item<LoraPath>>,

    /// Engine mode: a pod holding block k of a prompt on GPU holds blocks
    /// 0..k there (vLLM's GPU pool evicts descendants first), even if their
    /// events were missed. Offloaded tiers are never inferred.
    #[arg(num_args = 0..=1, default_missing_value = "true")]
    assume_prefix_closed: bool = "true",

    /// Engine mode: after each pod's first 8, recompute one in N prompt-start
    /// stores' hashes to catch a wrong algorithm or seed; 0 = off.
    engine_self_check_every: u32 = "64",

    /// Key mode for one model, overriding the above: `MODEL=token` or
    /// `MODEL=engine[:ALGO[:SEED]]`. Repeatable; in the environment
    /// variable, separate them with spaces.
    #[arg(value_delimiter = ' ')]
    #[serde(alias = "model_key_modes")]
    model_key_mode: Vec<Item<ModelKeyMode>>,

    /// A model's tokenizer: `MODEL=PATH`, PATH a directory with
    /// `tokenizer.json` (+ `tokenizer_config.json`) or a `tokenizer.json`.
    /// Repeatable; in the environment variable, separate them with spaces.
    /// Otherwise the models dir; for a model some pod publishes events for,
    /// also the Hugging Face cache and the Hub (`HF_HOME`, `HF_HUB_CACHE`,
    /// `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` are honoured).
    #[arg(value_delimiter = ' ')]
    #[serde(alias = "tokenizers")]
    tokenizer: Vec<Item<TokenizerPath>>,

    /// Directory of tokenizers by model name: `DIR/<model>/tokenizer.json`.
    tokenizers_dir: PathBuf,

    /// Bytes of tokenization cache per model, e.g. `256MiB`.
    tokenization_cache: Size = "256MiB",

    /// Connect and read timeout of one Hugging Face Hub request.
    hub_timeout: Duration = "30s",

    /// A model's vLLM render server (`vllm launch render`), `MODEL=URL`: a
    /// chat `Score` or `RecordRouting` with image, audio or video parts is
    /// rendered there (`POST URL/v1/chat/completions/render`); text-only
    /// chats stay in-process. Without one such chats are refused.
    /// Repeatable or comma-separated.
    #[arg(value_delimiter = ',')]
    render_url: Vec<Item<RenderUrl>>,

    /// How long one render may take (and never past the request's deadline).
    render_timeout: Duration = "5s",

    /// Most renders in flight per render server; more are refused with
    /// RESOURCE_EXHAUSTED.
    render_concurrency: usize = "32",

    /// Accept a request-level `chat_template` (like vLLM's
    /// `--trust-request-chat-template`); otherwise such requests are refused.
    #[arg(num_args = 0..=1, default_missing_value = "true")]
    allow_request_chat_template: bool = "false",
}

/// What the table cannot say through clap's derive: each setting's
/// environment variable, its default in `--help`, and that it may follow
/// a subcommand (`kv-indexer check --config FILE`).
fn finish_arg(arg: clap::Arg) -> clap::Arg {
    let name = arg.get_id().as_str().to_owned();
    if !Settings::NAMES.contains(&name.as_str()) {
        return arg;
    }
    let with_default = |help: &clap::builder::StyledStr| match Settings::default_text(&name) {
        Some(default) => format!("{help} [default: {default}]"),
        None => help.to_string(),
    };
    let help = arg.get_help().map(with_default);
    let long_help = arg.get_long_help().map(with_default);
    let mut arg = arg
        .env(format!("KV_INDEXER_{}", name.to_ascii_uppercase()))
        .global(true);
    if let Some(help) = help {
        arg = arg.help(help);
    }
    if let Some(long_help) = long_help {
        arg = arg.long_help(long_help);
    }
    arg
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// The settings as the command line takes them.
    #[derive(clap::Parser)]
    struct Args {
        #[command(flatten)]
        settings: Settings,
    }

    #[test]
    fn every_setting_has_its_flag_and_environment_variable() {
        let cmd = Args::command();
        for name in Settings::NAMES {
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_id() == *name)
                .unwrap_or_else(|| panic!("{name}: no flag"));
            assert_eq!(arg.get_long(), Some(name.replace('_', "-").as_str()));
            let env = arg.get_env().unwrap().to_str().unwrap();
            assert_eq!(env, format!("KV_INDEXER_{}", name.to_uppercase()));
            assert!(arg.is_global_set(), "{name}");
        }
    }

    #[test]
    fn every_default_parses() {
        // `resolve` parses each default; a bad one panics naming it.
        let _ = Settings::default().resolve();
    }

    #[test]
    fn help_shows_the_defaults() {
        let help = Args::command().render_help().to_string();
        assert!(help.contains("[default: 0.0.0.0:50051]"), "{help}");
        assert!(help.contains("KV_INDEXER_MAX_EVENT_MESSAGE"), "{help}");
    }
}

//! From resolved settings to the typed [`Config`] the service runs on.
//! Each value is already well-formed (its type parsed it); what is checked
//! here is whether it is acceptable: ranges, files that must exist and be
//! PEM, and settings that only make sense together (TLS's certificate and
//! key, engine key modes, `--max-blocks` with `--max-memory`). Every error
//! names the setting.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use indexer::keys::engine_hash::{EngineHasher, ExtraKeyStyle, HashAlgo, DEFAULT_SEED};
use indexer::keys::scheme::{EngineKeys, KeyMode, KeySchemes};
use indexer::score::TierWeights;
use indexer::IndexerConfig;

use super::settings::Resolved;
use super::values::*;
use super::{
    invalid, Config, ConfigError, Limits, PeerConfig, RenderConfig, RoutingConfig, Secret,
    TlsConfig, BYTES_PER_ENTRY, BYTES_PER_POD, DEFAULT_ROUTING_BYTES, ROUTING_SHARE,
};

pub(super) fn validate(s: Resolved) -> Result<Config, ConfigError> {
    let tls = tls(s.tls_cert, s.tls_key, s.tls_client_ca)?;

    let zmq_bind = s.zmq_bind.0.map(|e| e.0);
    let zmq_allow: Vec<ipnet::IpNet> = items(s.zmq_allow).into_iter().map(|n| n.0).collect();
    if !zmq_allow.is_empty() && zmq_bind.is_none() {
        // It filters who may connect to our bound socket; without one it
        // would silently do nothing, which is not what whoever set it meant.
        return Err(invalid(
            "zmq_allow",
            list(&zmq_allow),
            "applies to the --zmq-bind socket, which is off",
        ));
    }

    let discovery = super::DiscoveryConfig {
        pods_file: s.pods_file,
        dns: items(s.discover_dns),
        dns_server: s.dns_server,
        interval: longer_than_zero("discovery_interval", s.discovery_interval)?,
    };
    let replay_endpoints: HashMap<String, String> = items(s.replay_endpoint)
        .into_iter()
        .map(|r| (r.pod, r.endpoint))
        .collect();
    let replay_timeout = longer_than_zero("replay_timeout", s.replay_timeout)?;
    let pod_expiry = s
        .pod_expiry
        .0
        .map(|d| longer_than_zero("pod_expiry", d))
        .transpose()?;

    let by_memory = match s.max_memory {
        None => None,
        Some(Size(bytes)) if bytes < BYTES_PER_ENTRY => {
            return Err(invalid(
                "max_memory",
                bytes.to_string(),
                format!("want at least {BYTES_PER_ENTRY} bytes (one entry), e.g. 4GiB"),
            ))
        }
        // Routing feedback's state takes its share first.
        Some(Size(bytes)) => Some((bytes - bytes / ROUTING_SHARE) / BYTES_PER_ENTRY),
    };
    let routing_bytes = s
        .max_memory
        .map_or(DEFAULT_ROUTING_BYTES, |Size(b)| b / ROUTING_SHARE);
    if !(0.0..=1.0).contains(&s.speculative_weight) {
        return Err(invalid(
            "speculative_weight",
            s.speculative_weight.to_string(),
            "must be a number in [0, 1]",
        ));
    }
    let approximate_models = items(s.approximate_model);
    let routing = RoutingConfig {
        ttl: s.speculative_ttl.0,
        approximate_capacity: at_least_one("approximate_capacity", s.approximate_capacity)?,
        approximate_models,
        budget_bytes: routing_bytes,
    };
    let max_entries = match (s.max_blocks, by_memory) {
        (Some(0), _) => return Err(invalid("max_blocks", "0", "must be at least 1")),
        (a, b) => a.into_iter().chain(b).min(),
    };

    if s.block_size == 0 || s.block_size > 1 << 20 {
        return Err(invalid(
            "block_size",
            s.block_size.to_string(),
            "must be between 1 and 1048576",
        ));
    }

    let mut tier_weights = TierWeights::default();
    for w in items(s.tier_weight) {
        if !(0.0..=1.0).contains(&w.weight) {
            return Err(invalid(
                "tier_weight",
                w.weight.to_string(),
                "weight must be a number in [0, 1]",
            ));
        }
        tier_weights.0[w.tier] = w.weight;
    }

    tracing_subscriber::EnvFilter::try_new(&s.log_level)
        .map_err(|e| invalid("log_level", &s.log_level, e.to_string()))?;

    let ingest_workers = s
        .ingest_workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    if ingest_workers == 0 || ingest_workers > 256 {
        return Err(invalid(
            "ingest_workers",
            ingest_workers.to_string(),
            "must be between 1 and 256",
        ));
    }

    let keys = key_schemes(KeyArgs {
        key_mode: s.key_mode,
        algo: s.engine_hash_algo.0,
        seed: s.engine_hash_seed,
        extra_keys: s.engine_extra_keys.into(),
        lora_paths: items(s.lora_path)
            .into_iter()
            .map(|l| (l.name, l.path))
            .collect(),
        assume_prefix_closed: s.assume_prefix_closed,
        self_check_every: s.engine_self_check_every,
        per_model: items(s.model_key_mode),
    })?;

    let limits = Limits {
        max_message_bytes: positive_size("max_message", s.max_message)?,
        max_prompt_bytes: positive_size("max_prompt", s.max_prompt)?,
        max_prompt_tokens: at_least_one("max_prompt_tokens", s.max_prompt_tokens)?,
        max_candidate_pods: at_least_one("max_candidate_pods", s.max_candidate_pods)?,
        max_inflight: at_least_one("max_inflight", s.max_inflight)?,
    };

    let mut tokenizers = tokenizer::load::Sources::from_env();
    tokenizers.explicit = items(s.tokenizer)
        .into_iter()
        .map(|t| (t.model, t.path))
        .collect();
    for (model, path) in &tokenizers.explicit {
        if !path.exists() {
            return Err(invalid(
                "tokenizer",
                format!("{model}={}", path.display()),
                "path does not exist",
            ));
        }
    }
    tokenizers.models_dir = s.tokenizers_dir;

    let max_pods = at_least_one("max_pods", s.max_pods)?;
    let max_models = at_least_one("max_models", s.max_models)?;
    Ok(Config {
        grpc_addr: s.grpc_addr,
        tls,
        metrics_addr: s.metrics_addr.0,
        zmq_bind,
        zmq_connect: items(s.zmq_connect).into_iter().flat_map(|t| t.0).collect(),
        discovery,
        replay_endpoints,
        replay_timeout,
        pod_expiry,
        topic_filter: s.topic_filter,
        topicless_model: s
            .topicless_model
            .map(|m| {
                super::endpoints::address_named_model(&m)
                    .map_err(|reason| invalid("topicless_model", &m, reason))
            })
            .transpose()?,
        indexer: IndexerConfig {
            default_block_size: s.block_size,
            tier_weights,
            keys,
            drop_incomplete: s.incomplete_pods == IncompletePods::Drop,
            max_entries,
            max_pods: Some(max_pods),
            max_models: Some(max_models),
            // A memory budget pays for pods too; an entry count does not.
            pod_cost_entries: if by_memory.is_some() {
                BYTES_PER_POD.div_ceil(BYTES_PER_ENTRY)
            } else {
                0
            },
            max_speculative_entries: routing.speculative_entries(),
            speculative_weight: s.speculative_weight,
            offload_block_size: s.offload_block_size,
        },
        routing,
        log_format: s.log_format,
        log_level: s.log_level,
        ingest_workers,
        ingest_priority: s.ingest_priority,
        limits,
        snapshot_dir: s.snapshot_dir,
        snapshot_interval: longer_than_zero("snapshot_interval", s.snapshot_interval)?,
        catch_up_wait: s.catch_up_wait.into(),
        peers: PeerConfig {
            targets: items(s.peer),
            wait: s.peer_wait.into(),
            token: s.peer_token_file.map(|p| peer_token(&p)).transpose()?,
        },
        tokenizers,
        tokenization_cache_bytes: s.tokenization_cache.0,
        max_event_message_bytes: positive_size("max_event_message", s.max_event_message)?,
        ingest_queue: at_least_one("ingest_queue", s.ingest_queue)?,
        ingest_queue_bytes: positive_size("ingest_queue_bytes", s.ingest_queue_bytes)?,
        zmq_allow,
        max_pods,
        max_models,
        allow_request_chat_template: s.allow_request_chat_template,
        hub_timeout: longer_than_zero("hub_timeout", s.hub_timeout)?,
        render: RenderConfig {
            urls: items(s.render_url)
                .into_iter()
                .map(|r| (r.model, r.url))
                .collect(),
            timeout: longer_than_zero("render_timeout", s.render_timeout)?,
            concurrency: at_least_one("render_concurrency", s.render_concurrency)?,
        },
        admin: s.admin,
        max_connections: at_least_one("max_connections", s.max_connections)?,
    })
}

/// Intervals and timeouts: zero would spin or fail every request at once.
fn longer_than_zero(
    setting: &'static str,
    d: humantime::Duration,
) -> Result<Duration, ConfigError> {
    if d.is_zero() {
        return Err(invalid(setting, d.to_string(), "must be longer than 0"));
    }
    Ok(d.into())
}

/// Limits and queue lengths: zero would refuse everything.
fn at_least_one(setting: &'static str, n: usize) -> Result<usize, ConfigError> {
    match n {
        0 => Err(invalid(setting, "0", "must be at least 1")),
        n => Ok(n),
    }
}

fn positive_size(setting: &'static str, size: Size) -> Result<usize, ConfigError> {
    match size.0 {
        0 => Err(invalid(setting, "0", "want a positive size, e.g. 16MiB")),
        n => Ok(n),
    }
}

fn list(nets: &[ipnet::IpNet]) -> String {
    nets.iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The fleet's shared secret, read now: surrounding whitespace (a file's
/// trailing newline) is not part of it, and an empty one is refused.
fn peer_token(path: &Path) -> Result<Secret, ConfigError> {
    let at = || path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| invalid("peer_token_file", at(), e.to_string()))?;
    match text.trim() {
        "" => Err(invalid("peer_token_file", at(), "the file is empty")),
        token => Ok(Secret(token.to_owned())),
    }
}

/// Certificate and key come together; the CA adds client verification.
/// Read now, so that a wrong path stops the start rather than the first
/// handshake.
fn tls(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
) -> Result<Option<TlsConfig>, ConfigError> {
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
    match (cert, key, client_ca) {
        (None, None, None) => Ok(None),
        (Some(cert), Some(key), ca) => Ok(Some(TlsConfig {
            cert_pem: read_pem("tls_cert", &cert)?,
            key_pem: read_pem("tls_key", &key)?,
            client_ca_pem: ca.map(|ca| read_pem("tls_client_ca", &ca)).transpose()?,
        })),
        (cert, _, _) => Err(invalid(
            if cert.is_some() {
                "tls_key"
            } else {
                "tls_cert"
            },
            "",
            "TLS needs both --tls-cert and --tls-key (--tls-client-ca adds mTLS)",
        )),
    }
}

/// The key-mode settings, for building the default and per-model modes.
struct KeyArgs {
    key_mode: KeyModeName,
    algo: HashAlgo,
    seed: Option<String>,
    extra_keys: ExtraKeyStyle,
    lora_paths: HashMap<String, String>,
    assume_prefix_closed: bool,
    self_check_every: u32,
    per_model: Vec<ModelKeyMode>,
}

/// Builds an engine key configuration, checking that it can be reproduced.
fn engine_keys(
    setting: &'static str,
    algo: HashAlgo,
    seed: Option<&str>,
    k: &KeyArgs,
) -> Result<EngineKeys, ConfigError> {
    if algo.needs_explicit_seed() && seed.is_none() {
        return Err(invalid(
            setting,
            algo.name(),
            "xxhash hashes are only reproducible when the pods set PYTHONHASHSEED: give it as the engine hash seed",
        ));
    }
    Ok(EngineKeys {
        hasher: EngineHasher::new(algo, seed.unwrap_or(DEFAULT_SEED), k.extra_keys),
        lora_paths: k.lora_paths.clone(),
        assume_prefix_closed: k.assume_prefix_closed,
        self_check_every: k.self_check_every,
    })
}

fn key_schemes(k: KeyArgs) -> Result<KeySchemes, ConfigError> {
    let default = match k.key_mode {
        KeyModeName::Token => KeyMode::Token,
        KeyModeName::Engine => KeyMode::Engine(Box::new(engine_keys(
            "engine_hash_algo",
            k.algo,
            k.seed.as_deref(),
            &k,
        )?)),
    };
    let mut per_model = HashMap::new();
    for m in &k.per_model {
        let mode = match &m.mode {
            KeyModeSpec::Token => KeyMode::Token,
            KeyModeSpec::Engine { algo, seed } => KeyMode::Engine(Box::new(engine_keys(
                "model_key_mode",
                algo.unwrap_or(k.algo),
                seed.as_deref().or(k.seed.as_deref()),
                &k,
            )?)),
        };
        per_model.insert(m.model.clone(), mode);
    }
    Ok(KeySchemes { default, per_model })
}

//! The command line: `kv-indexer [SUBCOMMAND] [SETTINGS]`. The settings
//! are `config`'s (one table, `config/settings.rs`); this module adds the
//! subcommands and the `--config` file's path, parses, and renders `--help`.
//! It sits above the tools it names (`simulate`'s options): `config` stays
//! plain data that the rest of the service reads.

#[cfg(test)]
mod reference;

use std::path::PathBuf;

use clap::Parser;

use kv_indexer::config::Settings;

/// The command line: a subcommand, the `--config` file, and every setting
/// (`settings.rs`), each also settable by `KV_INDEXER_<FLAG>` (upper case,
/// `_` for `-`) or in the file (snake_case key, the flag's name).
#[derive(Parser, Debug, Default)]
#[command(name = "kv-indexer", version, about, long_about = None)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// YAML file with any of the settings below (snake_case keys).
    #[arg(long, env = "KV_INDEXER_CONFIG", global = true)]
    pub config: Option<PathBuf>,

    #[command(flatten)]
    pub settings: Settings,
}

impl Args {
    /// `Args::parse()`, exiting with status 2 on a bad flag or variable, as
    /// clap does; see [`Args::try_parse_named`] for the message.
    pub fn parse_or_exit() -> Args {
        Args::try_parse_named(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// `Args::try_parse_from`, with a malformed value's error also naming
    /// the setting and its environment variable: clap names the flag only,
    /// even when the value came from `KV_INDEXER_<FLAG>`, and the file's
    /// errors (and `validate.rs`'s) name the setting in snake_case.
    pub fn try_parse_named<I, T>(argv: I) -> Result<Args, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::FromArgMatches;
        let mut matches = Args::cli()
            .try_get_matches_from(argv)
            .map_err(name_the_setting)?;
        Args::from_arg_matches_mut(&mut matches).map_err(name_the_setting)
    }

    /// The command line as parsed and as `--help` shows it. The service's
    /// settings are global (`kv-indexer check --config FILE` works), so
    /// clap would list all of them again in every subcommand's help,
    /// interleaved with its own flags: there they are hidden, still
    /// accepted, and the help names where they are described.
    pub fn cli() -> clap::Command {
        use clap::CommandFactory;
        let mut cmd = Args::command();
        // Each subcommand gets its own hidden copy of every setting, which
        // clap's propagation of the global ones then leaves alone; a value
        // given after the subcommand still reaches `Args::settings`.
        let settings: Vec<clap::Arg> = cmd
            .get_arguments()
            .filter(|a| a.is_global_set())
            .cloned()
            .collect();
        let subcommands: Vec<String> = cmd
            .get_subcommands()
            .map(|s| s.get_name().to_owned())
            .collect();
        for name in subcommands {
            cmd = cmd.mut_subcommand(&name, |mut sub| {
                for arg in &settings {
                    // simulate reads one setting: the pods' block size.
                    let shown = name == "simulate" && arg.get_id() == "block_size";
                    sub = sub.arg(arg.clone().hide(!shown));
                }
                sub.after_help(
                    "The service's settings (--config, --grpc-addr, ... and their \
                     KV_INDEXER_* variables) apply here too: see `kv-indexer --help`.",
                )
            });
        }
        cmd
    }
}

fn name_the_setting(mut e: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        e.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return e;
    }
    // The context is the flag as usage shows it: `--max-memory <MAX_MEMORY>`.
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e;
    };
    let flag = arg.split(' ').next().unwrap_or_default();
    let name = flag.trim_start_matches("--").replace('-', "_");
    if !Settings::NAMES.contains(&name.as_str()) {
        return e;
    }
    let tip = format!(
        "this is the setting {name}, given by {flag} or KV_INDEXER_{}",
        name.to_ascii_uppercase()
    );
    e.insert(
        ContextKind::Suggested,
        ContextValue::StyledStrs(vec![tip.into()]),
    );
    e
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
        /// Pause between turns, e.g. `1s`, `0ms`.
        #[arg(long, default_value = "1s")]
        interval: humantime::Duration,
    },
    /// Publish a stream real vLLM recorded to a running kv-indexer, as a
    /// pod would, score its first probe next to vLLM's answer, then remove
    /// the pods it created (needs the service's --admin).
    Publish {
        /// Recorded stream (`*.frames.jsonl`, its `*.expected.json` beside it).
        #[arg(default_value = "tests/fixtures/vllm-events/qwen3-lora-salt.frames.jsonl")]
        frames: String,
        /// The indexer's ZeroMQ SUB endpoint.
        #[arg(long, default_value = "tcp://127.0.0.1:5557")]
        zmq: String,
        /// The indexer's gRPC address.
        #[arg(long, default_value = "http://127.0.0.1:50051")]
        grpc: String,
    },
    /// Race routing policies over simulated vLLM pods whose events feed
    /// our index; prints a table (the pods' block size is --block-size).
    Simulate(Box<simulator::Options>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_indexer::config::{Config, FileConfig};

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
            (&["--max-message", "0"], "max_message"),
            (&["--max-blocks", "0"], "max_blocks"),
            (&["--snapshot-interval", "often"], "snapshot_interval"),
            (&["--max-memory", "12"], "max_memory"),
            (&["--max-inflight", "0"], "max_inflight"),
            (&["--max-prompt-tokens", "0"], "max_prompt_tokens"),
        ];
        for (flags, setting) in cases {
            // A malformed value stops at clap, the rest at validation.
            let argv = std::iter::once("kv-indexer").chain(flags.iter().copied());
            let err = match Args::try_parse_named(argv) {
                Err(e) => e.to_string(),
                Ok(a) => Config::merge(a.settings, FileConfig::default())
                    .unwrap_err()
                    .to_string(),
            };
            assert!(err.contains(setting), "{flags:?}: {err}");
        }
    }

    #[test]
    fn a_subcommands_help_shows_its_own_flags_and_points_at_the_services() {
        let help = |args: &[&str]| match Args::cli().try_get_matches_from(args) {
            Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => e.to_string(),
            other => panic!("{args:?}: {other:?}"),
        };
        let simulate = help(&["kv-indexer", "simulate", "--help"]);
        assert!(simulate.contains("--pod-blocks") && simulate.contains("--block-size"));
        let check = help(&["kv-indexer", "check", "--help"]);
        for sub in [&simulate, &check] {
            assert!(
                !sub.contains("--grpc-addr <") && !sub.contains("--config <"),
                "{sub}"
            );
            assert!(sub.contains("see `kv-indexer --help`"), "{sub}");
        }
        let top = help(&["kv-indexer", "--help"]);
        assert!(top.contains("--grpc-addr <") && !top.contains("--pod-blocks"));
        // Hidden, still taken, wherever they are given.
        let args =
            Args::try_parse_named(["kv-indexer", "check", "--grpc-addr", "1.2.3.4:5"]).unwrap();
        assert_eq!(args.settings.grpc_addr, Some("1.2.3.4:5".parse().unwrap()));
    }
}

//! `docs/configuration.md`, written from the command line's own definition
//! ([`Args::cli`]): every setting with its flag, environment variable,
//! config-file key, default and help, every subcommand's own flags, and the
//! other environment variables the service reads. A unit test compares the
//! file with what this renders, so the page cannot drift from the code;
//! `KV_INDEXER_BLESS=1 cargo test --bin kv-indexer cli::reference` rewrites it.
//! Only that test uses this module.

use super::Args;

/// Environment variables read outside the settings table: who reads them
/// and what for.
const OTHER_ENVIRONMENT: &[(&str, &str)] = &[
    (
        "RUST_LOG",
        "log filter; wins over `--log-level` when set (`tracing_subscriber`'s `EnvFilter` syntax)",
    ),
    (
        "HF_TOKEN",
        "token for gated models on the Hugging Face Hub; shown only as set / not set",
    ),
    (
        "HF_ENDPOINT",
        "the Hub's address (default `https://huggingface.co`); credentials in it are shown as `***@`",
    ),
    (
        "HF_HOME",
        "the Hugging Face home; its `hub/` is the tokenizer cache unless `HF_HUB_CACHE` is set",
    ),
    ("HF_HUB_CACHE", "the Hugging Face cache directory"),
    (
        "HF_HUB_OFFLINE",
        "`1` or `true`: never download a tokenizer from the Hub",
    ),
];

/// The page, as committed in `docs/configuration.md`.
pub fn markdown() -> String {
    let cli = Args::cli();
    let mut out = String::from(
        "# Configuration reference\n\n\
         Generated from the command line's definition (`src/config/settings.rs`, `src/bin/kv-indexer/cli/`) by\n\
         `KV_INDEXER_BLESS=1 cargo test --bin kv-indexer cli::reference`; a test fails when\n\
         this page and the code differ. Precedence: flag > environment variable >\n\
         `--config` file > default. Every setting may be given before or after a\n\
         subcommand. See `docs/operations.md` for how they fit together.\n\n\
         ## Service settings\n\n\
         | flag | environment | file key | default | what it does |\n\
         |---|---|---|---|---|\n",
    );
    for arg in cli.get_arguments().filter(|a| a.is_global_set()) {
        let id = arg.get_id().as_str();
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let (help, default) = split_default(&help_of(arg));
        // `--config` names the file; it is no key in it.
        let key = match id {
            "config" => "-".to_owned(),
            _ => format!("`{id}`"),
        };
        out.push_str(&format!(
            "| `--{}` | {env} | {key} | {} | {} |\n",
            arg.get_long().unwrap_or(id),
            default.map_or("-".to_owned(), |d| format!("`{d}`")),
            cell(&help),
        ));
    }
    out.push_str("\n## Other environment variables\n\n| variable | what it does |\n|---|---|\n");
    for (name, what) in OTHER_ENVIRONMENT {
        out.push_str(&format!("| `{name}` | {what} |\n"));
    }
    for sub in cli.get_subcommands() {
        out.push_str(&format!(
            "\n## `kv-indexer {}`\n\n{}\n",
            sub.get_name(),
            cell(&sub.get_about().map(|a| a.to_string()).unwrap_or_default())
        ));
        let own: Vec<&clap::Arg> = sub
            .get_arguments()
            .filter(|a| !a.is_hide_set() && a.get_id() != "help")
            .collect();
        if own.is_empty() {
            continue;
        }
        out.push_str("\n| flag | default | what it does |\n|---|---|---|\n");
        for arg in own {
            let name = match arg.get_long() {
                Some(long) => format!("`--{long}`"),
                None => format!("`{}` (argument)", arg.get_id().as_str().to_uppercase()),
            };
            let (help, default) = split_default(&help_of(arg));
            let default = default.or_else(|| {
                let values = arg.get_default_values();
                (!values.is_empty()).then(|| {
                    values
                        .iter()
                        .map(|v| v.to_string_lossy())
                        .collect::<Vec<_>>()
                        .join(",")
                })
            });
            out.push_str(&format!(
                "| {name} | {} | {} |\n",
                default.map_or("-".to_owned(), |d| format!("`{d}`")),
                cell(&help)
            ));
        }
    }
    out
}

fn help_of(arg: &clap::Arg) -> String {
    arg.get_long_help()
        .or_else(|| arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default()
}

/// The settings' help ends with ` [default: X]` (see `finish_arg`).
fn split_default(help: &str) -> (String, Option<String>) {
    match help.rsplit_once(" [default: ") {
        Some((text, rest)) if rest.ends_with(']') => {
            (text.to_owned(), Some(rest[..rest.len() - 1].to_owned()))
        }
        _ => (help.to_owned(), None),
    }
}

/// One table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use kv_indexer::config::Settings;

    #[test]
    fn docs_configuration_md_is_what_the_settings_say() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
        let want = super::markdown();
        if std::env::var_os("KV_INDEXER_BLESS").is_some() {
            std::fs::write(path, &want).expect("write docs/configuration.md");
        }
        let have = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            have == want,
            "docs/configuration.md differs from the settings: run \
             `KV_INDEXER_BLESS=1 cargo test --bin kv-indexer cli::reference` and commit it"
        );
        for name in Settings::NAMES {
            assert!(want.contains(&format!("| `{name}` |")), "{name}");
        }
    }
}

//! The configuration as the real binary reads it: `kv-indexer check` exits
//! 0 on a valid configuration and 2 on an invalid one, with a message naming
//! the setting; flags, `KV_INDEXER_*` variables and the `--config` file in
//! that order of precedence. Nothing here opens a socket.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output};

use kv_indexer::config::Settings;

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/config")
        .join(name)
        .display()
        .to_string()
}

/// `kv-indexer ARGV`, from the package root (the fixtures' paths are
/// relative to it), with no `KV_INDEXER_*` variable of ours but `env`.
fn run(argv: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kv-indexer"));
    cmd.args(argv)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("HF_HUB_OFFLINE", "1");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("KV_INDEXER_") {
            cmd.env_remove(key);
        }
    }
    cmd.envs(env.iter().copied())
        .output()
        .expect("run kv-indexer")
}

/// `kv-indexer check ARGS`.
fn check(args: &[&str], env: &[(&str, &str)]) -> Output {
    let argv: Vec<&str> = std::iter::once("check")
        .chain(args.iter().copied())
        .collect();
    run(&argv, env)
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_good_file_is_valid_and_sets_every_setting() {
    let good = fixture("good.yaml");
    let out = check(&["--config", &good], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("configuration is valid"));

    let text = std::fs::read_to_string(&good).unwrap();
    let doc: serde_norway::Mapping = serde_norway::from_str(&text).unwrap();
    let keys: BTreeSet<&str> = doc.keys().map(|k| k.as_str().unwrap()).collect();
    let names: BTreeSet<&str> = Settings::NAMES.iter().copied().collect();
    assert_eq!(
        keys, names,
        "good.yaml should set every setting, by its flag's name"
    );
}

#[test]
fn older_keys_and_map_forms_give_the_same_settings() {
    let good = check(&["--config", &fixture("good.yaml")], &[]);
    let old = check(&["--config", &fixture("old-keys.yaml")], &[]);
    assert!(old.status.success(), "{}", stderr(&old));
    // Each map in the fixtures has one entry, so the printed HashMaps
    // cannot differ by order.
    assert_eq!(stdout(&good), stdout(&old));
}

#[test]
fn a_wrong_key_exits_2_naming_it() {
    let out = check(&["--config", &fixture("wrongkey.yaml")], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("unknown field `tier_wieghts`"), "{err}");
}

#[test]
fn a_wrong_value_exits_2_naming_the_setting_from_every_source() {
    let out = check(&["--config", &fixture("badvalue.yaml")], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("max_memory: invalid value \"lots\""),
        "{}",
        stderr(&out)
    );

    // clap names the flag; our tip names the setting and the variable.
    let out = check(&[], &[("KV_INDEXER_MAX_MEMORY", "lots")]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("--max-memory"), "{err}");
    assert!(err.contains("setting max_memory"), "{err}");
    assert!(err.contains("KV_INDEXER_MAX_MEMORY"), "{err}");

    let out = check(&["--block-size", "0"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("invalid block_size"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn precedence_is_flag_then_environment_then_file_then_default() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(
        file,
        "topic_filter: file@\nblock_size: 32\nadmin: true\nlog_format: json"
    )
    .unwrap();
    let path = file.path().display().to_string();
    let out = check(
        &["--config", &path, "--topic-filter", "flag@"],
        &[
            ("KV_INDEXER_TOPIC_FILTER", "env@"),
            ("KV_INDEXER_BLOCK_SIZE", "64"),
            ("KV_INDEXER_ADMIN", "false"),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let c = stdout(&out);
    assert!(c.contains("topic_filter: \"flag@\""), "flag over env: {c}");
    assert!(c.contains("default_block_size: 64,"), "env over file: {c}");
    assert!(c.contains("admin: false,"), "env over file: {c}");
    assert!(c.contains("log_format: Json,"), "file over default: {c}");
    assert!(c.contains("replay_timeout: 2s,"), "default: {c}");
}

#[test]
fn repeatable_settings_split_their_environment_variables() {
    let out = check(
        &[],
        &[
            // Spaces for endpoints (their options use commas), commas for
            // pairs and networks; a trailing delimiter is no entry.
            (
                "KV_INDEXER_ZMQ_CONNECT",
                "tcp://a:1 tcp://b:1,replay=tcp://b:2 ",
            ),
            ("KV_INDEXER_TIER_WEIGHT", "gpu=0.5,cpu=0.25,"),
            ("KV_INDEXER_ZMQ_ALLOW", "10.0.0.0/8,10.1.2.3"),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let c = stdout(&out);
    assert!(c.contains("endpoint: \"tcp://a:1\""), "{c}");
    assert!(c.contains("\"tcp://b:2\""), "{c}");
    assert!(c.contains("0.25,"), "{c}");
    assert!(c.contains("10.1.2.3/32"), "{c}");
}

#[test]
fn settings_may_follow_the_subcommand_or_precede_it() {
    let good = fixture("good.yaml");
    let before = run(&["--config", &good, "check"], &[]);
    assert!(before.status.success(), "{}", stderr(&before));
    let after = check(&["--config", &good], &[]);
    assert_eq!(stdout(&before), stdout(&after));
}

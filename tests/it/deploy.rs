//! What can be checked of `deploy/` without a cluster: every manifest
//! parses, the chart's templates only use values that exist, the shipped
//! configuration is valid for this binary, the image runs as non-root.
//! (`helm template deploy/helm/kv-indexer | kubectl apply --dry-run=client -f -`
//! is the manual step where helm is available.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_norway::Value;

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .collect()
}

fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    out.sort();
    out
}

#[test]
fn plain_manifests_parse_and_are_kubernetes_objects() {
    let mut checked = 0;
    for dir in ["kustomize/base", "examples"] {
        for path in files(&deploy().join(dir), "yaml") {
            for doc in yaml_docs(&path) {
                if path.ends_with("config.yaml") {
                    continue; // the service's own config, checked below
                }
                assert!(
                    doc.get("apiVersion").is_some(),
                    "{}: no apiVersion",
                    path.display()
                );
                assert!(doc.get("kind").is_some(), "{}: no kind", path.display());
                checked += 1;
            }
        }
    }
    assert!(checked >= 8, "{checked}");
    // kustomize references exist.
    let k = &yaml_docs(&deploy().join("kustomize/base/kustomization.yaml"))[0];
    for r in k["resources"].as_sequence().unwrap() {
        assert!(deploy()
            .join("kustomize/base")
            .join(r.as_str().unwrap())
            .is_file());
    }
}

/// `.Values.a.b` paths used by the templates exist in values.yaml.
#[test]
fn chart_templates_only_use_defined_values() {
    let chart = deploy().join("helm/kv-indexer");
    let chart_yaml = &yaml_docs(&chart.join("Chart.yaml"))[0];
    assert_eq!(chart_yaml["apiVersion"].as_str(), Some("v2"));
    let values = &yaml_docs(&chart.join("values.yaml"))[0];
    assert_eq!(
        values["replicaCount"].as_u64(),
        Some(2),
        "HA default: 2 replicas"
    );
    assert_eq!(values["mode"].as_str(), Some("dial"), "HA needs dial mode");
    assert_eq!(values["autoscaling"]["enabled"].as_bool(), Some(false));
    let mut used = BTreeSet::new();
    let mut templates = files(&chart.join("templates"), "yaml");
    templates.extend(files(&chart.join("templates"), "tpl"));
    for t in &templates {
        let text = std::fs::read_to_string(t).unwrap();
        for (i, _) in text.match_indices(".Values.") {
            let path: String = text[i + ".Values.".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '_')
                .collect();
            used.insert(path.trim_end_matches('.').to_owned());
        }
    }
    for path in &used {
        let mut v = values;
        for part in path.split('.') {
            v = v
                .get(part)
                .unwrap_or_else(|| panic!(".Values.{path} is not in values.yaml"));
        }
    }
    assert!(used.len() > 20, "{used:?}");
    for name in [
        "deployment",
        "service",
        "configmap",
        "pdb",
        "hpa",
        "servicemonitor",
    ] {
        assert!(
            chart.join(format!("templates/{name}.yaml")).is_file(),
            "{name}"
        );
    }
}

#[test]
fn shipped_configuration_is_valid_for_this_binary() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .arg("--config")
        .arg(deploy().join("kustomize/base/config.yaml"))
        .arg("check")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cm = &yaml_docs(&deploy().join("examples/pods-file-configmap.yaml"))[0];
    let pods =
        kv_indexer::discovery::parse_pods_file(cm["data"]["pods.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(pods.len(), 2);
}

#[test]
fn image_is_multi_stage_and_non_root() {
    let docker = std::fs::read_to_string(deploy().join("Dockerfile")).unwrap();
    assert_eq!(docker.lines().filter(|l| l.starts_with("FROM ")).count(), 2);
    assert!(docker
        .lines()
        .any(|l| l.starts_with("USER ") && !l.contains(" 0") && !l.contains("root:")));
    assert!(docker.contains("EXPOSE 50051 5557 9090"));
}

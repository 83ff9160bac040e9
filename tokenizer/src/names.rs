//! Model names as paths and as Hub repository ids: pure rules, no files.
//!
//! A model name comes from a request (or a pod's topic), so it is untrusted:
//! joined onto `--tokenizers-dir` as it is, `/etc` or `../../x` would name a
//! directory outside it (`Path::join` with an absolute path replaces the
//! base), and `x`, `x/`, `./x`, `x/.` would name one directory four times
//! over. These rules look at path components, never substrings.

use std::path::{Component, Path};

/// `model` as a path relative to `--tokenizers-dir`, normalized
/// (`./org//name/.` -> `org/name`), if every component stays inside the
/// directory: only plain names and `.`; no root (`/x`), no `..` anywhere, no
/// Windows prefix. `None` also for a name with no plain component at all
/// (`.`, `./`), which would be the directory itself.
pub fn dir_relative(model: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for component in Path::new(model).components() {
        match component {
            Component::Normal(part) => parts.push(part.to_str()?),
            Component::CurDir => {}
            Component::RootDir | Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// Whether `model` can be a Hugging Face model repository id (`name` or
/// `org/name`: letters, digits, `-`, `_`, `.`; no `--` or `..`; neither
/// starting nor ending with `-` or `.`; at most 96 characters), the only
/// names worth asking the Hub for.
pub fn is_hub_repo_id(model: &str) -> bool {
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !p.starts_with(['-', '.'])
            && !p.ends_with(['-', '.'])
            && !p.contains("--")
            && !p.contains("..")
    };
    let mut parts = model.split('/');
    let ok = match (parts.next(), parts.next(), parts.next()) {
        (Some(name), None, None) => part_ok(name),
        (Some(org), Some(name), None) => part_ok(org) && part_ok(name),
        _ => false,
    };
    ok && model.len() <= 96
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_inside_the_directory_are_normalized() {
        for alias in [
            "qwen3",
            "qwen3/",
            "./qwen3",
            "qwen3/.",
            ".//qwen3",
            "qwen3//",
            "./qwen3/./",
            "././qwen3",
        ] {
            assert_eq!(dir_relative(alias).as_deref(), Some("qwen3"), "{alias}");
        }
        assert_eq!(
            dir_relative("Qwen//Qwen3-8B/").as_deref(),
            Some("Qwen/Qwen3-8B")
        );
        assert_eq!(dir_relative("a..b/c...").as_deref(), Some("a..b/c..."));
    }

    #[test]
    fn names_that_would_leave_the_directory_are_refused() {
        for escape in [
            "/etc",
            "/x/",
            "//x",
            "/./x",
            "..",
            "../x",
            "../../../../x",
            "x/../../y",
            "x/..",
            "x/../x",
            ".",
            "./",
            "",
        ] {
            assert_eq!(dir_relative(escape), None, "{escape:?}");
        }
    }

    #[test]
    fn hub_repo_ids() {
        for ok in [
            "gpt2",
            "Qwen/Qwen3-8B",
            "meta-llama/Llama-3.1-8B-Instruct",
            "a_b/c.d",
        ] {
            assert!(is_hub_repo_id(ok), "{ok}");
        }
        let long = "x".repeat(97);
        for bad in [
            "",
            "/x",
            "x/",
            "a/b/c",
            "../x",
            "a/..",
            "a--b/c",
            "-a/b",
            "a/b.",
            "a b/c",
            "a/b?c",
            long.as_str(),
        ] {
            assert!(!is_hub_repo_id(bad), "{bad:?}");
        }
    }
}

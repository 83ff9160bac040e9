//! Finding and reading a model's tokenizer files: an explicit mapping, a
//! local models directory, the Hugging Face cache, or a download from the
//! Hub ([`crate::hub`]; tokenizer files only, never weights).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{ModelTokenizer, TextError, TokenizerText};

/// Where to look, in this order.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    /// `--tokenizer MODEL=PATH`: a directory, or a `tokenizer.json` file.
    pub explicit: HashMap<String, PathBuf>,
    /// `--tokenizers-dir DIR`: `DIR/<model>/tokenizer.json` (the model name
    /// may contain `/`, i.e. `DIR/org/name/`; never a name that would leave
    /// `DIR`, see [`crate::names::dir_relative`]).
    pub models_dir: Option<PathBuf>,
    /// The Hugging Face hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`).
    pub hf_cache: Option<PathBuf>,
    /// Download missing tokenizers from the Hub (off when `HF_HUB_OFFLINE=1`).
    pub hub: Option<Hub>,
}

#[derive(Clone)]
pub struct Hub {
    /// `HF_ENDPOINT`, default `https://huggingface.co`. It may carry
    /// credentials (`https://user:password@host`), which are shown as
    /// `***@` and sent as a header, never in a URL (`hub.rs`).
    pub endpoint: Option<String>,
    /// `HF_TOKEN`, for gated models. A secret: never printed.
    pub token: Option<String>,
    /// Connect and read timeout of every Hub request (`--hub-timeout`).
    pub timeout: Duration,
}

impl std::fmt::Debug for Hub {
    /// The token as set or not set, the endpoint without its credentials:
    /// `kv-indexer check` prints this, and its output goes into tickets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("endpoint", &self.endpoint.as_deref().map(without_userinfo))
            .field(
                "token",
                &if self.token.is_some() {
                    "set"
                } else {
                    "not set"
                },
            )
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Hub {
    /// `text` with every secret of this Hub (the token, the endpoint's
    /// user and password) replaced by `***`: for errors and log lines that
    /// quote a URL or a header.
    pub fn redact(&self, text: &str) -> String {
        let mut out = text.to_owned();
        let userinfo = self.endpoint.as_deref().and_then(userinfo);
        for secret in self.token.iter().map(String::as_str).chain(userinfo) {
            if !secret.is_empty() {
                out = out.replace(secret, "***");
            }
        }
        out
    }
}

/// The `user:password` of `scheme://user:password@host/...`, if any.
fn userinfo(url: &str) -> Option<&str> {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let authority = url[after_scheme..]
        .split(['/', '?', '#'])
        .next()
        .unwrap_or_default();
    authority.rsplit_once('@').map(|(info, _)| info)
}

/// `url` without its `user:password@`, and that `user:password`.
pub(crate) fn split_credentials(url: &str) -> (String, Option<String>) {
    let (bare, info) = swap_userinfo(url, "");
    (bare, info.map(str::to_owned))
}

/// `url` with its `user:password@` replaced by `***@`.
fn without_userinfo(url: &str) -> String {
    swap_userinfo(url, "***@").0
}

/// `url` with its `user:password@` (if any) replaced by `with`, and the
/// `user:password` it had.
fn swap_userinfo<'a>(url: &'a str, with: &str) -> (String, Option<&'a str>) {
    match userinfo(url) {
        Some(info) => (url.replacen(&format!("{info}@"), with, 1), Some(info)),
        None => (url.to_owned(), None),
    }
}

/// `--hub-timeout`'s default. Python's `huggingface_hub` waits 10 s per
/// request (`HF_HUB_DOWNLOAD_TIMEOUT`, `HF_HUB_ETAG_TIMEOUT`); 30 s leaves
/// room for a slow link or proxy, while a Hub that never answers costs one
/// attempt half a minute (and requests only their own deadline).
pub const DEFAULT_HUB_TIMEOUT: Duration = Duration::from_secs(30);

impl Sources {
    /// The Hugging Face settings from the environment (`HF_HOME`,
    /// `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE`).
    pub fn from_env() -> Sources {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let hf_cache = var("HF_HUB_CACHE").map(PathBuf::from).or_else(|| {
            var("HF_HOME")
                .map(|h| PathBuf::from(h).join("hub"))
                .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/hub")))
        });
        let offline =
            var("HF_HUB_OFFLINE").is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        Sources {
            hf_cache,
            hub: (!offline).then(|| Hub {
                endpoint: var("HF_ENDPOINT"),
                token: var("HF_TOKEN"),
                timeout: DEFAULT_HUB_TIMEOUT,
            }),
            ..Default::default()
        }
    }
}

/// The files a tokenizer is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizerFiles {
    pub tokenizer_json: PathBuf,
    pub config_json: Option<PathBuf>,
    /// Newer Hub repos keep the chat template in its own file.
    pub chat_template_jinja: Option<PathBuf>,
    /// Where they were found, for logs.
    pub origin: String,
}

#[derive(Debug, thiserror::Error, Clone)]
pub enum LoadError {
    #[error("no tokenizer for model {model:?}; tried: {}", tried.join("; "))]
    NotFound { model: String, tried: Vec<String> },
    #[error("tokenizer for model {model:?} at {path} is unusable: {reason}")]
    Invalid {
        model: String,
        path: String,
        reason: String,
    },
}

impl TokenizerFiles {
    pub(crate) fn in_dir(dir: &Path, origin: String) -> Option<TokenizerFiles> {
        let tokenizer_json = dir.join("tokenizer.json");
        if !tokenizer_json.is_file() {
            return None;
        }
        let opt = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        Some(TokenizerFiles {
            tokenizer_json,
            config_json: opt("tokenizer_config.json"),
            chat_template_jinja: opt("chat_template.jinja"),
            origin,
        })
    }
}

/// The tokenizer files at `path`: a directory with `tokenizer.json` (and
/// perhaps `tokenizer_config.json`, `chat_template.jinja`), or a
/// `tokenizer.json` itself (its directory's other files still count).
pub fn files_at(path: &Path, origin: String) -> Option<TokenizerFiles> {
    if path.is_file() {
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut files = TokenizerFiles::in_dir(dir, origin.clone()).unwrap_or(TokenizerFiles {
            tokenizer_json: path.to_owned(),
            config_json: None,
            chat_template_jinja: None,
            origin: String::new(),
        });
        files.tokenizer_json = path.to_owned();
        files.origin = origin;
        return Some(files);
    }
    TokenizerFiles::in_dir(path, origin)
}

/// `DIR/<model>` under `--tokenizers-dir`, if the name stays inside it.
pub fn in_models_dir(dir: &Path, model: &str) -> Option<PathBuf> {
    crate::names::dir_relative(model).map(|rel| dir.join(rel))
}

/// The local places `model`'s tokenizer may be, in order: `--tokenizer`,
/// `--tokenizers-dir`, the Hugging Face cache. No network.
pub fn locate_local(model: &str, sources: &Sources) -> Result<TokenizerFiles, Vec<String>> {
    let mut tried = Vec::new();
    if let Some(path) = sources.explicit.get(model) {
        if let Some(f) = files_at(path, format!("--tokenizer {}", path.display())) {
            return Ok(f);
        }
        tried.push(format!(
            "--tokenizer {} (no tokenizer.json)",
            path.display()
        ));
    }
    if let Some(dir) = &sources.models_dir {
        match in_models_dir(dir, model) {
            Some(d) => {
                if let Some(f) = TokenizerFiles::in_dir(&d, format!("models dir {}", d.display())) {
                    return Ok(f);
                }
                tried.push(format!("models dir {}", d.display()));
            }
            None => tried.push(format!(
                "models dir {} (the name would leave it)",
                dir.display()
            )),
        }
    }
    if let Some(cache) = &sources.hf_cache {
        let repo = cache.join(hf_cache_repo(model));
        if let Some(f) = from_hf_cache(&repo) {
            return Ok(f);
        }
        tried.push(format!("Hugging Face cache {}", repo.display()));
    }
    Err(tried)
}

/// Finds (downloading if allowed) the tokenizer files of `model`. Blocks
/// for as long as a download takes (bounded by the Hub timeout): the
/// [`crate::Registry`] runs it on a thread of its own.
pub fn locate(model: &str, sources: &Sources) -> Result<TokenizerFiles, LoadError> {
    let mut tried = match locate_local(model, sources) {
        Ok(files) => return Ok(files),
        Err(tried) => tried,
    };
    match (&sources.hub, &sources.hf_cache) {
        (Some(hub), Some(cache)) => {
            match crate::hub::download(model, hub, cache).map_err(|e| hub.redact(&e)) {
                Ok(f) => return Ok(f),
                Err(e) => tried.push(format!("Hub download: {e}")),
            }
        }
        (Some(_), None) => {
            tried.push("Hub download (no cache directory to download into: set HF_HOME)".into())
        }
        (None, _) => tried.push("Hub download (disabled: HF_HUB_OFFLINE)".into()),
    }
    Err(LoadError::NotFound {
        model: model.to_owned(),
        tried,
    })
}

/// `models--org--name`: one path component whatever the name (no `/` left).
pub(crate) fn hf_cache_repo(model: &str) -> String {
    format!("models--{}", model.replace('/', "--"))
}

/// Reads `files`.
pub fn read(model: &str, files: &TokenizerFiles) -> Result<TokenizerText, LoadError> {
    let invalid = |path: &Path, reason: String| LoadError::Invalid {
        model: model.to_owned(),
        path: path.display().to_string(),
        reason,
    };
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| invalid(p, e.to_string()));
    Ok(TokenizerText {
        tokenizer_json: read(&files.tokenizer_json)?,
        config_json: files.config_json.as_deref().map(read).transpose()?,
        chat_template: files.chat_template_jinja.as_deref().map(read).transpose()?,
    })
}

impl ModelTokenizer {
    /// Reads and loads `files`; `cache_bytes` bounds the tokenization cache.
    pub fn load(
        model: &str,
        files: &TokenizerFiles,
        cache_bytes: usize,
    ) -> Result<ModelTokenizer, LoadError> {
        let text = read(model, files)?;
        ModelTokenizer::from_text(model, files.origin.clone(), &text, cache_bytes).map_err(|e| {
            let (path, reason) = match e {
                TextError::TokenizerJson(r) => (&files.tokenizer_json, r),
                TextError::ConfigJson(r) => (
                    files.config_json.as_ref().unwrap_or(&files.tokenizer_json),
                    r,
                ),
            };
            LoadError::Invalid {
                model: model.to_owned(),
                path: path.display().to_string(),
                reason,
            }
        })
    }
}

/// `models--org--name/snapshots/<rev>/`: the revision `refs/main` names,
/// else any snapshot that has a `tokenizer.json`.
fn from_hf_cache(repo: &Path) -> Option<TokenizerFiles> {
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let dir = snapshots.join(rev.trim());
        if let Some(f) =
            TokenizerFiles::in_dir(&dir, format!("Hugging Face cache {}", dir.display()))
        {
            return Some(f);
        }
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    dirs.sort();
    dirs.into_iter()
        .find_map(|d| TokenizerFiles::in_dir(&d, format!("Hugging Face cache {}", d.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub(endpoint: Option<&str>, token: Option<&str>) -> Hub {
        Hub {
            endpoint: endpoint.map(str::to_owned),
            token: token.map(str::to_owned),
            timeout: DEFAULT_HUB_TIMEOUT,
        }
    }

    #[test]
    fn a_hub_shows_its_token_as_set_and_its_endpoint_without_credentials() {
        let h = hub(Some("https://me:pw@hub.example/x"), Some("hf_abc"));
        let shown = format!("{h:?}");
        assert!(shown.contains("token: \"set\""), "{shown}");
        assert!(shown.contains("https://***@hub.example/x"), "{shown}");
        assert!(
            !shown.contains("hf_abc") && !shown.contains("pw"),
            "{shown}"
        );
        assert!(format!("{:?}", hub(None, None)).contains("token: \"not set\""));
        assert_eq!(
            split_credentials("http://me:pw@a.b/c@d"),
            ("http://a.b/c@d".to_owned(), Some("me:pw".to_owned()))
        );
        assert_eq!(
            split_credentials("http://a.b/c@d"),
            ("http://a.b/c@d".to_owned(), None)
        );
    }

    #[test]
    fn redact_removes_the_token_and_the_endpoints_credentials() {
        let h = hub(Some("http://me:pw@127.0.0.1:1"), Some("hf_abc"));
        assert_eq!(
            h.redact("http://me:pw@127.0.0.1:1/m: refused; Bearer hf_abc"),
            "http://***@127.0.0.1:1/m: refused; Bearer ***"
        );
        assert_eq!(hub(None, None).redact("as it is"), "as it is");
    }
}

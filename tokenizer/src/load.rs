//! Finding a model's tokenizer files: an explicit mapping, a local models
//! directory, the Hugging Face cache, or a download from the Hub (tokenizer
//! files only, never weights).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where to look, in this order.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    /// `--tokenizer MODEL=PATH`: a directory, or a `tokenizer.json` file.
    pub explicit: HashMap<String, PathBuf>,
    /// `--tokenizers-dir DIR`: `DIR/<model>/tokenizer.json` (the model name
    /// may contain `/`, i.e. `DIR/org/name/`).
    pub models_dir: Option<PathBuf>,
    /// The Hugging Face hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`).
    pub hf_cache: Option<PathBuf>,
    /// Download missing tokenizers from the Hub (off when `HF_HUB_OFFLINE=1`).
    pub hub: Option<Hub>,
}

#[derive(Clone, Debug)]
pub struct Hub {
    /// `HF_ENDPOINT`, default `https://huggingface.co`.
    pub endpoint: Option<String>,
    /// `HF_TOKEN`, for gated models.
    pub token: Option<String>,
}

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
    fn in_dir(dir: &Path, origin: String) -> Option<TokenizerFiles> {
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

/// Finds (downloading if allowed) the tokenizer files of `model`.
pub fn locate(model: &str, sources: &Sources) -> Result<TokenizerFiles, LoadError> {
    let mut tried = Vec::new();
    if let Some(path) = sources.explicit.get(model) {
        if path.is_file() {
            let dir = path.parent().unwrap_or(Path::new("."));
            let mut files = TokenizerFiles::in_dir(dir, format!("--tokenizer {}", path.display()))
                .unwrap_or(TokenizerFiles {
                    tokenizer_json: path.clone(),
                    config_json: None,
                    chat_template_jinja: None,
                    origin: String::new(),
                });
            files.tokenizer_json = path.clone();
            files.origin = format!("--tokenizer {}", path.display());
            return Ok(files);
        }
        if let Some(f) = TokenizerFiles::in_dir(path, format!("--tokenizer {}", path.display())) {
            return Ok(f);
        }
        tried.push(format!(
            "--tokenizer {} (no tokenizer.json)",
            path.display()
        ));
    }
    if let Some(dir) = &sources.models_dir {
        let d = dir.join(model);
        if let Some(f) = TokenizerFiles::in_dir(&d, format!("models dir {}", d.display())) {
            return Ok(f);
        }
        tried.push(format!("models dir {}", d.display()));
    }
    if let Some(cache) = &sources.hf_cache {
        let repo = cache.join(format!("models--{}", model.replace('/', "--")));
        if let Some(f) = from_hf_cache(&repo) {
            return Ok(f);
        }
        tried.push(format!("Hugging Face cache {}", repo.display()));
    }
    match &sources.hub {
        Some(hub) => match download(model, hub, sources.hf_cache.as_deref()) {
            Ok(f) => return Ok(f),
            Err(e) => tried.push(format!("Hub download: {e}")),
        },
        None => tried.push("Hub download (disabled: HF_HUB_OFFLINE)".into()),
    }
    Err(LoadError::NotFound {
        model: model.to_owned(),
        tried,
    })
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

/// Logs download progress every quarter.
struct LogProgress {
    file: String,
    total: usize,
    done: usize,
    next_report: usize,
}

impl hf_hub::api::Progress for LogProgress {
    fn init(&mut self, size: usize, filename: &str) {
        self.file = filename.to_owned();
        self.total = size;
        self.next_report = size / 4;
        tracing::info!(file = %filename, bytes = size, "downloading from the Hugging Face Hub");
    }

    fn update(&mut self, size: usize) {
        self.done += size;
        if self.total > 0 && self.done >= self.next_report && self.done < self.total {
            tracing::info!(file = %self.file, percent = self.done * 100 / self.total, "downloading");
            self.next_report += self.total / 4;
        }
    }

    fn finish(&mut self) {
        tracing::info!(file = %self.file, bytes = self.done, "downloaded");
    }
}

/// Downloads `tokenizer.json` (required), `tokenizer_config.json` and
/// `chat_template.jinja` (if the repo has them) into the HF cache.
fn download(model: &str, hub: &Hub, cache: Option<&Path>) -> Result<TokenizerFiles, String> {
    let mut builder = hf_hub::api::sync::ApiBuilder::new()
        .with_progress(false)
        .with_token(hub.token.clone());
    if let Some(endpoint) = &hub.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    if let Some(cache) = cache {
        builder = builder.with_cache_dir(cache.to_owned());
    }
    let api = builder.build().map_err(|e| e.to_string())?;
    let repo = api.model(model.to_owned());
    // hf-hub asserts internally on some filesystem states; never let that
    // take the service down.
    let get = |file: &str| {
        let progress = LogProgress {
            file: String::new(),
            total: 0,
            done: 0,
            next_report: 0,
        };
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            repo.download_with_progress(file, progress)
        }))
        .map_err(|_| format!("{file}: download failed"))?
        .map_err(|e| format!("{file}: {e}"))
    };
    let tokenizer_json = get("tokenizer.json")?;
    let config_json = get("tokenizer_config.json").ok();
    let chat_template_jinja = get("chat_template.jinja").ok();
    Ok(TokenizerFiles {
        tokenizer_json,
        config_json,
        chat_template_jinja,
        origin: format!("Hub {}", repo.url("tokenizer.json")),
    })
}

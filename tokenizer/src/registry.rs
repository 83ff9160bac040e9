//! Which models get a tokenizer, and loading each one once.
//!
//! A model name comes from a request, so it decides nothing by itself: a
//! tokenizer is loaded (or downloaded) only for a model that is configured
//! (`--tokenizer MODEL=PATH`, or present under `--tokenizers-dir`) or that a
//! pod publishes events for (the caller says, from the index). Any other
//! name gets [`Lookup::Unknown`] at once: no file read beyond one `stat` in
//! the models dir, no download, nothing kept for it.
//!
//! Tokenizers are kept per resolved source, not per name: the canonical
//! path of a local directory or file (so `x`, `x/`, `./x` and a symlink to
//! `x` share one), or the name of a published model (fetched from the
//! Hugging Face cache or the Hub). Each load runs on a thread of its own,
//! never on a request's: requests wait on a `watch` channel, asynchronously,
//! for as long as their own deadline allows, and hold no thread meanwhile.
//! A failed load is kept as failed and retried, by the next request after a
//! backoff ([`retry_delay`]), not by every request.
//!
//! Locks: `slots` guards the table of slots and is never held across a
//! load or a wait; `ready` is a read-mostly cache in front of it and is only
//! written with `slots` not held.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;

use crate::load::{self, LoadError, Sources};
use crate::ModelTokenizer;

/// Where a tokenizer comes from; one slot (and at most one tokenizer) each.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Source {
    /// A directory or `tokenizer.json` on disk, canonical.
    Local(PathBuf),
    /// A model pods publish: the Hugging Face cache, then the Hub.
    Published(String),
}

#[derive(Clone)]
enum State {
    Loading {
        failures: u32,
    },
    Ready(Arc<ModelTokenizer>),
    Failed {
        error: LoadError,
        failures: u32,
        retry_at: Instant,
    },
}

struct Slot {
    /// Display name: the first name it was asked for.
    model: String,
    origin: String,
    state: watch::Sender<State>,
}

/// The answer for one model name.
pub enum Lookup {
    /// Neither configured nor published: nothing was done or kept.
    Unknown,
    Ready(Arc<ModelTokenizer>),
    /// The last load failed; the next is not due yet.
    Failed(LoadError),
    /// Loading (on its own thread): [`Pending::wait`] for it.
    Pending(Pending),
}

/// A load in progress.
pub struct Pending(watch::Receiver<State>);

impl Pending {
    /// Waits for the load to finish, asynchronously (no thread is held;
    /// drop the future to stop waiting).
    pub async fn wait(mut self) -> Result<Arc<ModelTokenizer>, LoadError> {
        let done = self
            .0
            .wait_for(|s| !matches!(s, State::Loading { .. }))
            .await;
        match done.as_deref() {
            Ok(State::Ready(t)) => Ok(t.clone()),
            Ok(State::Failed { error, .. }) => Err(error.clone()),
            // The registry (and so the loader) is gone: shutting down.
            _ => Err(LoadError::NotFound {
                model: String::new(),
                tried: vec!["the tokenizer registry stopped".into()],
            }),
        }
    }
}

/// Slots by state, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistryCounts {
    pub loaded: usize,
    pub loading: usize,
    pub failed: usize,
}

/// Per-model tokenizers, loaded lazily, once per source.
pub struct Registry {
    sources: Arc<Sources>,
    /// `--tokenizer` paths, canonical (aliases of one directory share).
    explicit: HashMap<String, PathBuf>,
    cache_bytes: usize,
    slots: Mutex<HashMap<Source, Arc<Slot>>>,
    /// Loaded tokenizers by the exact names that may be cached: configured
    /// names, normalized models-dir names, published names; never an alias
    /// spelling (`./x`), so a client cannot grow it by inventing spellings.
    ready: RwLock<HashMap<String, Arc<ModelTokenizer>>>,
}

/// A failed load is retried after 30 s (a file may appear, the Hub may come
/// back), doubling with each further failure up to 10 minutes: a model
/// whose Hub repository is gone costs one attempt per 10 minutes, not one
/// per request.
pub fn retry_delay(failures: u32) -> Duration {
    const FIRST: Duration = Duration::from_secs(30);
    const MAX: Duration = Duration::from_secs(600);
    FIRST
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(MAX)
}

impl Registry {
    pub fn new(sources: Sources, cache_bytes: usize) -> Registry {
        let explicit = sources
            .explicit
            .iter()
            .map(|(m, p)| (m.clone(), std::fs::canonicalize(p).unwrap_or(p.clone())))
            .collect();
        Registry {
            sources: Arc::new(sources),
            explicit,
            cache_bytes,
            slots: Mutex::new(HashMap::new()),
            ready: RwLock::new(HashMap::new()),
        }
    }

    /// The tokenizer of `model`, if it may have one: configured, or
    /// `published` (some pod publishes events for it; asked only when the
    /// model is neither loaded nor configured, off the hot path). Never
    /// blocks on a load: a first use starts one on its own thread and
    /// answers [`Lookup::Pending`].
    pub fn get(&self, model: &str, published: impl FnOnce() -> bool) -> Lookup {
        if let Some(t) = self.ready.read().get(model) {
            return Lookup::Ready(t.clone());
        }
        let Some((source, origin, cacheable)) = self.resolve(model, published) else {
            return Lookup::Unknown;
        };
        let mut slots = self.slots.lock();
        let slot = slots
            .entry(source.clone())
            .or_insert_with(|| {
                let (state, _) = watch::channel(State::Failed {
                    error: LoadError::NotFound {
                        model: model.to_owned(),
                        tried: Vec::new(),
                    },
                    failures: 0,
                    retry_at: Instant::now(),
                });
                Arc::new(Slot {
                    model: model.to_owned(),
                    origin,
                    state,
                })
            })
            .clone();
        drop(slots);
        let current = slot.state.borrow().clone();
        match current {
            State::Ready(t) => {
                if cacheable {
                    self.ready.write().insert(model.to_owned(), t.clone());
                }
                Lookup::Ready(t)
            }
            State::Loading { .. } => Lookup::Pending(Pending(slot.state.subscribe())),
            State::Failed {
                error,
                failures,
                retry_at,
            } => {
                if Instant::now() < retry_at {
                    return Lookup::Failed(error);
                }
                // Only one caller starts the load: the others see Loading.
                let started = slot.state.send_if_modified(|s| match s {
                    State::Failed { retry_at, .. } if Instant::now() >= *retry_at => {
                        *s = State::Loading { failures };
                        true
                    }
                    _ => false,
                });
                let pending = Pending(slot.state.subscribe());
                if started {
                    self.spawn_load(source, slot);
                }
                Lookup::Pending(pending)
            }
        }
    }

    /// Where `model`'s tokenizer would come from, whether its name may be
    /// cached in `ready`, or `None` for a model that may have none.
    fn resolve(
        &self,
        model: &str,
        published: impl FnOnce() -> bool,
    ) -> Option<(Source, String, bool)> {
        if let Some(path) = self.explicit.get(model) {
            let origin = format!("--tokenizer {}", path.display());
            return Some((Source::Local(path.clone()), origin, true));
        }
        if let Some(dir) = &self.sources.models_dir {
            if let Some(rel) = crate::names::dir_relative(model) {
                let d = dir.join(&rel);
                if d.join("tokenizer.json").is_file() {
                    let canonical = std::fs::canonicalize(&d).unwrap_or(d);
                    let origin = format!("models dir {}", canonical.display());
                    return Some((Source::Local(canonical), origin, rel == model));
                }
            }
        }
        published().then(|| {
            let origin = format!("published model {model}");
            (Source::Published(model.to_owned()), origin, true)
        })
    }

    fn spawn_load(&self, source: Source, slot: Arc<Slot>) {
        let sources = self.sources.clone();
        let cache_bytes = self.cache_bytes;
        let for_thread = slot.clone();
        let spawned = std::thread::Builder::new()
            .name("tokenizer-load".into())
            .spawn(move || {
                let slot = for_thread;
                // `tokenizers` and the HTTP stack may assert on odd input
                // (a file or a Hub's answer): a loader panic is a failed
                // load, never a dead service.
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    load_source(&slot, &source, &sources, cache_bytes)
                }))
                .unwrap_or_else(|_| {
                    Err(LoadError::Invalid {
                        model: slot.model.clone(),
                        path: slot.origin.clone(),
                        reason: "the loader panicked".into(),
                    })
                });
                finish(&slot, result);
            });
        if let Err(e) = spawned {
            finish(
                &slot,
                Err(LoadError::Invalid {
                    model: slot.model.clone(),
                    path: slot.origin.clone(),
                    reason: format!("cannot start a loader thread: {e}"),
                }),
            );
        }
    }

    /// Tokenizers loaded so far, one per source.
    pub fn loaded(&self) -> Vec<Arc<ModelTokenizer>> {
        self.slots
            .lock()
            .values()
            .filter_map(|s| match &*s.state.borrow() {
                State::Ready(t) => Some(t.clone()),
                _ => None,
            })
            .collect()
    }

    /// Slots by state: what the registry holds, however many names asked.
    pub fn counts(&self) -> RegistryCounts {
        let mut c = RegistryCounts::default();
        for slot in self.slots.lock().values() {
            match &*slot.state.borrow() {
                State::Ready(_) => c.loaded += 1,
                State::Loading { .. } => c.loading += 1,
                State::Failed { .. } => c.failed += 1,
            }
        }
        c
    }
}

/// One load of one source (blocking: on the loader thread).
fn load_source(
    slot: &Slot,
    source: &Source,
    sources: &Sources,
    cache_bytes: usize,
) -> Result<Arc<ModelTokenizer>, LoadError> {
    let started = Instant::now();
    let model = slot.model.as_str();
    let files = match source {
        Source::Local(path) => {
            load::files_at(path, slot.origin.clone()).ok_or_else(|| LoadError::NotFound {
                model: model.to_owned(),
                tried: vec![format!("{} (no tokenizer.json)", slot.origin)],
            })
        }
        Source::Published(name) => load::locate(name, sources),
    }?;
    let t = ModelTokenizer::load(model, &files, cache_bytes)?;
    tracing::info!(
        model,
        origin = %t.origin,
        piecewise = t.is_piecewise(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "tokenizer loaded"
    );
    Ok(Arc::new(t))
}

fn finish(slot: &Slot, result: Result<Arc<ModelTokenizer>, LoadError>) {
    let failures = match &*slot.state.borrow() {
        State::Loading { failures } => *failures,
        _ => 0,
    };
    let next = match result {
        Ok(t) => State::Ready(t),
        Err(error) => {
            let failures = failures + 1;
            let delay = retry_delay(failures);
            // One line per attempt, and attempts back off: this is the
            // per-model warning's rate limit.
            tracing::warn!(
                model = %slot.model,
                error = %error,
                retry_in_s = delay.as_secs(),
                "tokenizer unavailable"
            );
            State::Failed {
                error,
                failures,
                retry_at: Instant::now() + delay,
            }
        }
    };
    slot.state.send_replace(next);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers/qwen3")
    }

    async fn ready(r: &Registry, model: &str, published: bool) -> Arc<ModelTokenizer> {
        match r.get(model, || published) {
            Lookup::Ready(t) => t,
            Lookup::Pending(p) => p.wait().await.unwrap(),
            Lookup::Failed(e) => panic!("{model}: {e}"),
            Lookup::Unknown => panic!("{model}: unknown"),
        }
    }

    #[test]
    fn retries_back_off() {
        assert_eq!(retry_delay(1), Duration::from_secs(30));
        assert_eq!(retry_delay(2), Duration::from_secs(60));
        assert_eq!(retry_delay(5), Duration::from_secs(480));
        assert_eq!(retry_delay(6), Duration::from_secs(600));
        assert_eq!(retry_delay(u32::MAX), Duration::from_secs(600));
    }

    #[tokio::test]
    async fn unknown_names_cost_nothing_and_aliases_share_one_tokenizer() {
        let models = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(qwen_dir(), models.path().join("qwen3")).unwrap();
        std::os::unix::fs::symlink(qwen_dir(), models.path().join("also-qwen3")).unwrap();
        let sources = Sources {
            models_dir: Some(models.path().to_owned()),
            ..Default::default()
        };
        let r = Registry::new(sources, 1 << 20);
        for name in ["org/unknown", "../qwen3", "/etc", "qwen3/../qwen3"] {
            assert!(matches!(r.get(name, || false), Lookup::Unknown), "{name}");
        }
        assert_eq!(r.counts(), RegistryCounts::default());
        let first = ready(&r, "qwen3", false).await;
        for alias in ["qwen3/", "./qwen3", "qwen3/.", "also-qwen3"] {
            assert!(
                Arc::ptr_eq(&first, &ready(&r, alias, false).await),
                "{alias}"
            );
        }
        assert_eq!(r.counts().loaded, 1);
        assert_eq!(r.loaded().len(), 1);
        // Spellings are not remembered; the normalized names are.
        let cached: Vec<String> = r.ready.read().keys().cloned().collect();
        assert!(
            cached.iter().all(|n| n == "qwen3" || n == "also-qwen3"),
            "{cached:?}"
        );
    }

    #[tokio::test]
    async fn published_models_without_files_fail_once_then_wait_for_the_backoff() {
        let r = Registry::new(Sources::default(), 1 << 20);
        assert!(matches!(r.get("org/m", || false), Lookup::Unknown));
        let err = match r.get("org/m", || true) {
            Lookup::Pending(p) => p.wait().await.err().unwrap(),
            _ => panic!("a first use loads"),
        };
        assert!(err.to_string().contains("HF_HUB_OFFLINE"), "{err}");
        // Not retried on the next request.
        assert!(matches!(r.get("org/m", || true), Lookup::Failed(_)));
        assert_eq!(r.counts().failed, 1);
    }
}

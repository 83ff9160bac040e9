//! Downloading a model's tokenizer files from the Hugging Face Hub into the
//! Hugging Face cache, the way `huggingface_hub` lays it out
//! (`models--org--name/{blobs/<etag>, snapshots/<commit>/<file>, refs/main}`),
//! so a later start (or Python) finds them there offline.
//!
//! Talks HTTP with `ureq` directly rather than through `hf-hub` 0.4: its
//! `ApiBuilder` builds its `ureq::Agent` itself with ureq's defaults (30 s to
//! connect, no read timeout at all) and offers no way to change them, so a
//! Hub (or proxy, or `HF_ENDPOINT`) that accepts a connection and never
//! answers held a download forever. Here every connect, read and write waits
//! at most the Hub timeout, a whole file at most [`FILE_TIME_FACTOR`] times
//! that, a file is at most [`MAX_FILE_BYTES`], and progress is logged.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::load::{hf_cache_repo, Hub, TokenizerFiles};

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Largest tokenizer file accepted. The largest real ones are ~35 MB
/// (Gemma's `tokenizer.json`); an endpoint that streams without end stops
/// here instead of filling the disk and then memory.
pub const MAX_FILE_BYTES: u64 = 128 << 20;

/// A whole file may take this many Hub timeouts (10 minutes at the default
/// 30 s): reads that each arrive just in time cannot keep a download going
/// forever.
pub const FILE_TIME_FACTOR: u32 = 20;

/// Redirects followed per file (the Hub redirects to its CDN once; renamed
/// repositories add one).
const MAX_REDIRECTS: usize = 5;

/// Downloads `tokenizer.json` (required), `tokenizer_config.json` and
/// `chat_template.jinja` (where the repository has them) of `model` into
/// `cache`. Blocks up to the bounds above: run it off any executor.
pub fn download(model: &str, hub: &Hub, cache: &Path) -> Result<TokenizerFiles, String> {
    if !crate::names::is_hub_repo_id(model) {
        return Err(format!("{model:?} is not a Hub repository id"));
    }
    let given = hub
        .endpoint
        .as_deref()
        .unwrap_or(DEFAULT_ENDPOINT)
        .trim_end_matches('/');
    // Credentials in the endpoint go into a header of ours, never into a
    // URL: ureq logs the URLs it requests (at debug level) and quotes them
    // in its errors.
    let (endpoint, credentials) = crate::load::split_credentials(given);
    let endpoint = endpoint.as_str();
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(hub.timeout)
        .timeout_read(hub.timeout)
        .timeout_write(hub.timeout)
        // Redirects are followed by hand: the commit and etag are on the
        // Hub's own answer, and the token must not follow to the CDN.
        .redirects(0)
        .user_agent(concat!("kv-indexer/", env!("CARGO_PKG_VERSION")))
        .build();
    let started = Instant::now();
    tracing::info!(
        model,
        endpoint,
        timeout_s = hub.timeout.as_secs_f64(),
        "downloading from the Hugging Face Hub (tokenizer files only)"
    );
    let repo = cache.join(hf_cache_repo(model));
    let get = |file: &str| -> Result<Option<PathBuf>, String> {
        let url = format!("{endpoint}/{model}/resolve/main/{file}");
        let Some(got) = fetch(&agent, hub, credentials.as_deref(), endpoint, &url, file)? else {
            return Ok(None);
        };
        store(&repo, file, &got).map(Some).map_err(|e| {
            format!(
                "{file}: cannot write into the Hugging Face cache {}: {e}",
                repo.display()
            )
        })
    };
    let tokenizer_json =
        get("tokenizer.json")?.ok_or_else(|| "tokenizer.json: not found (404)".to_owned())?;
    let config_json = get("tokenizer_config.json")?;
    let chat_template_jinja = get("chat_template.jinja")?;
    tracing::info!(
        model,
        seconds = started.elapsed().as_secs_f64(),
        "tokenizer files downloaded"
    );
    Ok(TokenizerFiles {
        tokenizer_json,
        config_json,
        chat_template_jinja,
        origin: format!("Hub {endpoint}/{model}"),
    })
}

/// One downloaded file and what the Hub said about it.
struct Fetched {
    body: Vec<u8>,
    commit: String,
    etag: Option<String>,
}

/// GETs `url`, following up to [`MAX_REDIRECTS`]. `Ok(None)`: the
/// repository has no such file.
fn fetch(
    agent: &ureq::Agent,
    hub: &Hub,
    credentials: Option<&str>,
    endpoint: &str,
    url: &str,
    file: &str,
) -> Result<Option<Fetched>, String> {
    let budget = hub.timeout.saturating_mul(FILE_TIME_FACTOR);
    let mut url = url.to_owned();
    let (mut commit, mut etag) = (None, None);
    for _ in 0..=MAX_REDIRECTS {
        let mut req = agent.get(&url).timeout(budget);
        // Only to the Hub itself, never to where it redirects (its CDN).
        if origin(&url) == origin(endpoint) {
            if let Some(token) = &hub.token {
                req = req.set("Authorization", &format!("Bearer {token}"));
            } else if let Some(user_password) = credentials {
                use base64::Engine;
                let basic = base64::engine::general_purpose::STANDARD.encode(user_password);
                req = req.set("Authorization", &format!("Basic {basic}"));
            }
        }
        let resp = match req.call() {
            Ok(resp) => resp,
            Err(ureq::Error::Status(404, _)) => return Ok(None),
            Err(ureq::Error::Status(code, _)) => return Err(format!("{file}: HTTP {code}")),
            Err(ureq::Error::Transport(t)) => return Err(format!("{file}: {t}")),
        };
        commit = commit.or_else(|| resp.header("x-repo-commit").map(str::to_owned));
        etag = etag.or_else(|| {
            resp.header("x-linked-etag")
                .or_else(|| resp.header("etag"))
                .map(str::to_owned)
        });
        if (300..400).contains(&resp.status()) {
            let location = resp
                .header("location")
                .ok_or_else(|| format!("{file}: redirect without a location"))?;
            url = redirect_target(&url, location)
                .ok_or_else(|| format!("{file}: unusable redirect to {location:?}"))?;
            continue;
        }
        let commit = commit
            .filter(|c| safe_name(c))
            .ok_or_else(|| format!("{file}: the Hub's answer has no usable x-repo-commit"))?;
        let size = resp
            .header("content-length")
            .and_then(|v| v.parse::<u64>().ok());
        let body = read_body(resp.into_reader(), file, size, hub.timeout, budget)?;
        return Ok(Some(Fetched { body, commit, etag }));
    }
    Err(format!("{file}: more than {MAX_REDIRECTS} redirects"))
}

/// Reads a body up to [`MAX_FILE_BYTES`], logging progress (bytes,
/// seconds) every quarter of a known size, or every 16 MiB.
fn read_body(
    mut reader: impl Read,
    file: &str,
    size: Option<u64>,
    timeout: Duration,
    budget: Duration,
) -> Result<Vec<u8>, String> {
    if size.is_some_and(|s| s > MAX_FILE_BYTES) {
        return Err(format!(
            "{file}: {} bytes, over the limit of {MAX_FILE_BYTES}",
            size.unwrap_or_default()
        ));
    }
    let started = Instant::now();
    let step = size.map_or(16 << 20, |s| (s / 4).max(1));
    let mut next_report = step;
    let mut body = Vec::with_capacity(size.unwrap_or(0) as usize);
    let mut chunk = vec![0u8; 64 << 10];
    tracing::info!(file, bytes = size, "downloading");
    loop {
        let n = reader.read(&mut chunk).map_err(|e| {
            let waited = if e.kind() == std::io::ErrorKind::TimedOut {
                format!(" (no data for {timeout:?}, or over {budget:?} in all)")
            } else {
                String::new()
            };
            format!("{file}: {e}{waited} after {} bytes", body.len())
        })?;
        if n == 0 {
            break;
        }
        if body.len() as u64 + n as u64 > MAX_FILE_BYTES {
            return Err(format!("{file}: over the limit of {MAX_FILE_BYTES} bytes"));
        }
        body.extend_from_slice(&chunk[..n]);
        if body.len() as u64 >= next_report && size.is_none_or(|s| (body.len() as u64) < s) {
            tracing::info!(
                file,
                bytes = body.len(),
                of = size,
                seconds = started.elapsed().as_secs_f64(),
                "downloading"
            );
            next_report += step;
        }
    }
    tracing::info!(
        file,
        bytes = body.len(),
        seconds = started.elapsed().as_secs_f64(),
        "downloaded"
    );
    Ok(body)
}

/// Writes a fetched file into the cache: the blob, the snapshot's link to
/// it, and `refs/main`. Returns the snapshot path.
fn store(repo: &Path, file: &str, got: &Fetched) -> std::io::Result<PathBuf> {
    // Only names the cache can hold safely: a Hub's headers are input too.
    let blob_name = got
        .etag
        .as_deref()
        .map(|e| e.trim_start_matches("W/").trim_matches('"').to_owned())
        .filter(|e| safe_name(e))
        .unwrap_or_else(|| format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&got.body)));
    let blobs = repo.join("blobs");
    let snapshot = repo.join("snapshots").join(&got.commit);
    std::fs::create_dir_all(&blobs)?;
    std::fs::create_dir_all(&snapshot)?;
    std::fs::create_dir_all(repo.join("refs"))?;
    let blob = blobs.join(&blob_name);
    let partial = blobs.join(format!("{blob_name}.partial"));
    std::fs::write(&partial, &got.body)?;
    std::fs::rename(&partial, &blob)?;
    let link = snapshot.join(file);
    let _ = std::fs::remove_file(&link);
    #[cfg(unix)]
    let linked = std::os::unix::fs::symlink(Path::new("../../blobs").join(&blob_name), &link);
    #[cfg(not(unix))]
    let linked: std::io::Result<()> = Err(std::io::ErrorKind::Unsupported.into());
    if linked.is_err() {
        std::fs::copy(&blob, &link)?;
    }
    std::fs::write(repo.join("refs/main"), &got.commit)?;
    Ok(link)
}

/// A commit or etag usable as a file name: letters, digits, `-`, `_`.
fn safe_name(s: &str) -> bool {
    (1..=128).contains(&s.len())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let end = url[after_scheme..]
        .find('/')
        .map_or(url.len(), |i| after_scheme + i);
    &url[..end]
}

/// Where a redirect from `from` to `location` goes: absolute http(s) URLs
/// as they are, absolute paths on the same origin.
fn redirect_target(from: &str, location: &str) -> Option<String> {
    if location.starts_with("https://") || location.starts_with("http://") {
        Some(location.to_owned())
    } else if location.starts_with('/') {
        Some(format!("{}{location}", origin(from)))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_redirects() {
        assert_eq!(origin("https://h:1/a/b"), "https://h:1");
        assert_eq!(origin("http://h"), "http://h");
        assert_eq!(
            redirect_target("https://h/a/resolve/main/x", "/b/resolve/main/x").as_deref(),
            Some("https://h/b/resolve/main/x")
        );
        assert_eq!(
            redirect_target("https://h/a", "https://cdn/x").as_deref(),
            Some("https://cdn/x")
        );
        assert_eq!(redirect_target("https://h/a", "x"), None);
    }

    #[test]
    fn header_values_never_become_paths() {
        assert!(safe_name("0123456789abcdef"));
        for bad in ["", "../x", "a/b", "a.b", &"x".repeat(129)] {
            assert!(!safe_name(bad), "{bad}");
        }
    }

    #[test]
    fn bodies_are_capped() {
        let endless = std::io::repeat(b'x').take(MAX_FILE_BYTES + 1);
        let t = Duration::from_secs(1);
        let err = read_body(endless, "f", None, t, t).unwrap_err();
        assert!(err.contains("over the limit"), "{err}");
        let err = read_body(std::io::empty(), "f", Some(MAX_FILE_BYTES + 1), t, t).unwrap_err();
        assert!(err.contains("over the limit"), "{err}");
        assert_eq!(
            read_body(&b"abc"[..], "f", Some(3), t, t).unwrap(),
            b"abc".to_vec()
        );
    }
}

//! Snapshot files: streamed one pod at a time through a buffer into a temp
//! file, made durable and atomic (fsync, rename, fsync of the directory);
//! loaded at start, checked whole before a pod is restored. A missing file
//! starts empty; a corrupt or incompatible one is reported and ignored,
//! never fatal.

use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use indexer::Indexer;

const FILE: &str = "kv-indexer.snapshot";

pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// Unix time of the last snapshot written or loaded (0: none), for metrics.
pub type LastSnapshot = Arc<AtomicU64>;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Loads the snapshot in `dir` into the (empty) indexer, if there is one;
/// whether one was loaded.
pub fn load(dir: &Path, indexer: &Indexer, last: &LastSnapshot) -> bool {
    let file = path(dir);
    let opened = match std::fs::File::open(&file) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!(file = %file.display(), "no snapshot yet: starting empty");
            return false;
        }
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "cannot read snapshot: starting empty");
            return false;
        }
    };
    match indexer.import(&opened) {
        Ok(pods) => {
            let modified = opened
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs());
            last.store(modified, Ordering::Relaxed);
            tracing::info!(file = %file.display(), pods, entries = indexer.entries(), "snapshot loaded");
            true
        }
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "snapshot ignored: starting empty");
            false
        }
    }
}

/// Writes the indexer's state to `dir`, atomically.
pub fn write(dir: &Path, indexer: &Indexer, last: &LastSnapshot) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("{FILE}.tmp"));
    let file = std::fs::File::create(&tmp)?;
    let file = indexer
        .export(BufWriter::with_capacity(1 << 16, file))?
        .into_inner()
        .map_err(|e| e.into_error())?;
    file.sync_all()?;
    let bytes = file.metadata()?.len();
    drop(file);
    std::fs::rename(&tmp, path(dir))?;
    // The rename itself must survive a crash.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    last.store(now(), Ordering::Relaxed);
    tracing::debug!(bytes, "snapshot written");
    Ok(())
}

/// Writes a snapshot every `interval`, forever.
pub async fn every(dir: PathBuf, interval: Duration, indexer: Arc<Indexer>, last: LastSnapshot) {
    let mut ticker = tokio::time::interval(interval);
    ticker.tick().await; // the first tick is immediate
    loop {
        ticker.tick().await;
        let (dir, indexer, last) = (dir.clone(), indexer.clone(), last.clone());
        match tokio::task::spawn_blocking(move || write(&dir, &indexer, &last)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot write snapshot"),
            Err(e) => tracing::warn!(error = %e, "snapshot task failed"),
        }
    }
}

/// Seconds since the last snapshot, or -1 if none.
pub fn age_seconds(last: &LastSnapshot) -> i64 {
    match last.load(Ordering::Relaxed) {
        0 => -1,
        t => now().saturating_sub(t) as i64,
    }
}

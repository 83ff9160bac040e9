//! Snapshot files: streamed one pod at a time through a buffer into a temp
//! file, made durable and atomic (fsync, rename, fsync of the directory);
//! loaded at start, checked whole before a pod is restored. A missing file
//! starts empty; a corrupt or incompatible one is reported and ignored,
//! never fatal.

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
///
/// The temp file has a name of its own, so that replicas sharing one
/// directory (the Helm chart's `snapshots` volume) never write into each
/// other's: each rename replaces the snapshot whole, and a reader opens
/// the last one renamed.
pub fn write(dir: &Path, indexer: &Indexer, last: &LastSnapshot) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = tempfile::Builder::new()
        .prefix(&format!("{FILE}."))
        .suffix(".tmp")
        .tempfile_in(dir)?;
    let (file, tmp) = tmp.into_parts();
    let file = indexer.export(file)?;
    file.sync_all()?;
    let bytes = file.metadata()?.len();
    drop(file);
    tmp.persist(path(dir)).map_err(|e| e.error)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use indexer::event::{BlockStored, EngineHash, EventBatch, KvEvent};
    use indexer::IndexerConfig;

    /// An index of `pods` pods holding `blocks` blocks each.
    fn filled(pods: usize, blocks: u32) -> Indexer {
        let ix = Indexer::new(IndexerConfig::default());
        for p in 0..pods {
            let pod = ix.pod("m", &format!("pod-{p}"), None);
            let hashes: Vec<EngineHash> = (0..u64::from(blocks))
                .map(|b| EngineHash((p as u64) << 32 | b))
                .collect();
            let tokens: Vec<u32> = (0..blocks * 16).map(|t| t + p as u32).collect();
            let stored = KvEvent::Stored(BlockStored {
                block_hashes: hashes,
                token_ids: tokens,
                block_size: Some(16),
                ..Default::default()
            });
            let batch = EventBatch {
                events: vec![stored],
                ..Default::default()
            };
            ix.apply(&pod, 0, &batch);
        }
        ix
    }

    /// Replicas sharing one snapshot directory: while two write over and
    /// over, every load finds a whole snapshot, one of the two.
    #[test]
    fn writers_sharing_a_directory_never_leave_a_torn_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (filled(3, 2000), filled(5, 1000));
        write(dir.path(), &a, &LastSnapshot::default()).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for ix in [&a, &b] {
                let (dir, stop) = (dir.path(), &stop);
                s.spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        write(dir, ix, &LastSnapshot::default()).unwrap();
                    }
                });
            }
            for _ in 0..40 {
                let fresh = Indexer::new(IndexerConfig::default());
                assert!(
                    load(dir.path(), &fresh, &LastSnapshot::default()),
                    "a torn or missing snapshot"
                );
                let entries = fresh.entries();
                assert!(
                    entries == a.entries() || entries == b.entries(),
                    "{entries} entries, neither writer's"
                );
            }
            stop.store(true, Ordering::Relaxed);
        });
    }
}

use super::*;

impl Indexer {
    /// Fingerprint of the key configuration: keys in a snapshot are only
    /// valid under the configuration that computed them.
    ///
    /// An explicit, sorted encoding of the settings that change keys (not a
    /// `Debug` dump: a `HashMap`'s order differs per process, and a
    /// fingerprint that differs across restarts throws every snapshot away).
    pub(super) fn keys_fingerprint(&self) -> u64 {
        let keys = &self.config.keys;
        let mut per_model: Vec<String> = keys
            .per_model
            .iter()
            .map(|(m, k)| format!("{}={m}:{}", m.len(), k.key_fingerprint()))
            .collect();
        per_model.sort();
        let text = format!(
            "{}|{}|{}",
            crate::keys::SCHEME,
            keys.default.key_fingerprint(),
            per_model.join(",")
        );
        xxhash_rust::xxh3::xxh3_64(text.as_bytes())
    }

    /// Writes everything needed to restart where we are to `out`, one pod
    /// at a time: each pod is locked only while its blocks are copied out,
    /// and written unlocked, so no more than one pod's blocks are copied at
    /// once and ingest is never paused for the whole write.
    pub fn export<W: std::io::Write>(&self, out: W) -> std::io::Result<W> {
        let mut snapshot = SnapshotWriter::new(out, self.keys_fingerprint())?;
        let pods: Vec<Arc<Pod>> = self.table.read().pods().cloned().collect();
        for p in pods.iter().filter(|p| !p.is_removed()) {
            let pod = {
                let inner = self.lock(p);
                let export = inner.state.export();
                PodSnapshot {
                    model: p.model.clone(),
                    pod: p.topic_pod.clone(),
                    dp_rank: p.dp_rank,
                    block_size: inner.state.block_size(),
                    last_seq: inner.progress.last_seq,
                    last_fingerprint: inner.progress.last_fingerprint,
                    incomplete: p.incomplete.load(Ordering::Relaxed),
                    non_full_groups: export.non_full_groups,
                    blocks: export.blocks,
                    parents: export.parents,
                    offload_block_size: inner.state.offload_block_size(),
                }
            };
            snapshot.pod(&pod)?;
        }
        snapshot.finish()
    }

    /// Restores a snapshot into this (empty) indexer, one pod at a time,
    /// once all of it was checked. Returns the pods restored. Runs before
    /// any writer starts (the service loads snapshots before ingest), so
    /// this thread is every pod's writer meanwhile.
    pub fn import<R: std::io::Read + std::io::Seek>(
        &self,
        snapshot: R,
    ) -> Result<usize, SnapshotError> {
        let mut snapshot = SnapshotReader::open(snapshot)?;
        if snapshot.keys_fingerprint() != self.keys_fingerprint() {
            return Err(SnapshotError::KeysChanged);
        }
        let mut imported = 0;
        while let Some(ps) = snapshot.next_pod()? {
            // Bounds may have been lowered since the snapshot was written.
            let Ok(pod) = self.try_pod(&ps.model, &ps.pod, ps.dp_rank) else {
                continue;
            };
            imported += 1;
            let mut inner = pod.inner.lock();
            inner.state.import(
                &self.blocks,
                &ps.blocks,
                &ps.parents,
                &ps.non_full_groups,
                ps.block_size,
                ps.offload_block_size,
            );
            inner.progress.last_seq = ps.last_seq;
            inner.progress.last_fingerprint = ps.last_fingerprint;
            let entries = inner.state.entries();
            drop(inner);
            pod.incomplete.store(ps.incomplete, Ordering::Relaxed);
            if let Some(bs) = ps.block_size {
                pod.block_size.store(bs, Ordering::Relaxed);
                self.learn_block_size(&ps.model, bs);
            }
            if let Some(size) = ps.offload_block_size {
                pod.offload_block_size.store(size, Ordering::Relaxed);
                self.learn_offload_block_size(&ps.model, size);
            }
            self.account(&pod, entries);
        }
        // Restored before any writer runs: this thread owns every pod.
        self.enforce_capacity(|_| true);
        Ok(imported)
    }
}

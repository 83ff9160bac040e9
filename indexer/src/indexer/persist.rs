use std::collections::HashMap;

use super::*;
use crate::index::{Dump, DumpError};
use crate::snapshot::Record;

impl Indexer {
    /// Fingerprint of the key configuration: keys in a snapshot are only
    /// valid under the configuration that computed them. The hash of
    /// `keys_configuration`.
    pub fn keys_fingerprint(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.keys_configuration().as_bytes())
    }

    /// The settings that change keys, as text: the token-key scheme, the
    /// default key mode (engine: hash algorithm, seed, LoRA paths) and each
    /// model's own. What two replicas compare before one copies the
    /// other's index, and name when they differ.
    ///
    /// An explicit, sorted encoding (not a `Debug` dump: a `HashMap`'s order
    /// differs per process, and a fingerprint that differs across restarts
    /// throws every snapshot away).
    pub fn keys_configuration(&self) -> String {
        let keys = &self.config.keys;
        let mut per_model: Vec<String> = keys
            .per_model
            .iter()
            .map(|(m, k)| format!("{}={m}:{}", m.len(), k.key_fingerprint()))
            .collect();
        per_model.sort();
        format!(
            "{}|{}|{}",
            crate::keys::SCHEME,
            keys.default.key_fingerprint(),
            per_model.join(",")
        )
    }

    /// Writes everything needed to restart where we are to `out`: each
    /// pod's record (its stream's place, what its events taught), then the
    /// runs of each key kind.
    ///
    /// Every pod's place and the blocks are taken at one instant: a
    /// restored pod's stream resumes after the last batch its blocks
    /// include, and a batch applied twice would count its stores twice. So
    /// the pods' locks are all held while the runs are copied (taken in id
    /// order; nothing else holds two pods' locks, and a writer holding one
    /// takes the runs' lock only after it), and released before a byte is
    /// written. Ingest waits for the copy, which is about the size of the
    /// index; a pod created meanwhile has no record, and its blocks in the
    /// copy are dropped on restore.
    pub fn export<W: std::io::Write>(&self, out: W) -> std::io::Result<W> {
        let mut snapshot = SnapshotWriter::new(out, self.keys_fingerprint())?;
        // The pods and their models' runs from one reading of the table.
        let (mut pods, models) = {
            let table = self.table.read();
            let pods: Vec<Arc<Pod>> = table.pods().filter(|p| !p.is_removed()).cloned().collect();
            let models: Vec<(String, Arc<KeyedRuns>)> = table
                .models()
                .map(|(name, m)| (name.clone(), m.runs.clone()))
                .collect();
            (pods, models)
        };
        pods.sort_unstable_by_key(|p| p.id);
        let (records, dumps) = {
            let guards: Vec<_> = pods.iter().map(|p| self.lock(p)).collect();
            let dumps: Vec<(&str, Dump)> = models
                .iter()
                .flat_map(|(name, runs)| {
                    [runs.engine.dump(), runs.token.dump()].map(|d| (name.as_str(), d))
                })
                .filter(|(_, d)| !d.runs.is_empty())
                .collect();
            let records: Vec<PodSnapshot> = pods
                .iter()
                .zip(&guards)
                .map(|(p, inner)| {
                    let (non_full_groups, block_size, offload_block_size) =
                        inner.state.rules_state();
                    PodSnapshot {
                        model: p.model.clone(),
                        pod: p.topic_pod.clone(),
                        dp_rank: p.dp_rank,
                        block_size,
                        last_seq: inner.progress.last_seq,
                        last_fingerprint: inner.progress.last_fingerprint,
                        incomplete: p.incomplete.load(Ordering::Relaxed),
                        non_full_groups,
                        blocks: Vec::new(),
                        parents: Vec::new(),
                        offload_block_size,
                        runs_id: Some(p.id.0),
                    }
                })
                .collect();
            (records, dumps)
        };
        for record in &records {
            snapshot.pod(record)?;
        }
        for (model, dump) in &dumps {
            snapshot.runs(model, dump)?;
        }
        snapshot.finish()
    }

    /// Restores a snapshot into this (empty) indexer, once all of it was
    /// checked, pod by pod, then the runs. Returns the pods restored. Runs
    /// before any writer starts (the service loads snapshots before
    /// ingest), so this thread is every pod's writer meanwhile. A version 2
    /// snapshot's blocks (each pod's own list) are stored into the runs.
    ///
    /// Runs that break the index's rules (which the file's checksum cannot
    /// tell) refuse the snapshot: everything restored is dropped again.
    pub fn import<R: std::io::Read + std::io::Seek>(
        &self,
        snapshot: R,
    ) -> Result<usize, SnapshotError> {
        let mut snapshot = SnapshotReader::open(snapshot)?;
        if snapshot.keys_fingerprint() != self.keys_fingerprint() {
            return Err(SnapshotError::KeysChanged);
        }
        let mut restored: Vec<Arc<Pod>> = Vec::new();
        // A pod's id in the snapshot's runs, and now.
        let mut renamed: HashMap<u32, u32> = HashMap::new();
        loop {
            let record = match snapshot.next_record() {
                Ok(Some(record)) => record,
                Ok(None) => break,
                Err(e) => {
                    // Nothing of a snapshot that fails is kept.
                    for pod in &restored {
                        self.remove_pod(pod);
                    }
                    return Err(e);
                }
            };
            match record {
                Record::Pod(ps) => {
                    if let Some(pod) = self.import_pod(&ps) {
                        if let Some(id) = ps.runs_id {
                            renamed.insert(id, pod.id.0);
                        }
                        restored.push(pod);
                    }
                }
                Record::Runs { model, dump } => {
                    if let Err(e) = self.import_runs(&model, *dump, &renamed) {
                        for pod in &restored {
                            self.remove_pod(pod);
                        }
                        return Err(SnapshotError::Decode(format!("runs: {e}")));
                    }
                }
            }
        }
        for pod in &restored {
            let entries = {
                let mut inner = pod.inner.lock();
                inner.state.restored(&pod.runs);
                inner.state.cost(&pod.runs)
            };
            self.account(pod, entries);
        }
        // Restored before any writer runs: this thread owns every pod.
        self.enforce_capacity(|_| true);
        Ok(restored.len())
    }

    /// One pod's record (and its blocks, from a version 2 snapshot); `None`
    /// if it is refused now (bounds may have been lowered since).
    fn import_pod(&self, ps: &PodSnapshot) -> Option<Arc<Pod>> {
        let pod = self.try_pod(&ps.model, &ps.pod, ps.dp_rank).ok()?;
        let mut inner = pod.inner.lock();
        inner
            .state
            .restore_rules(&ps.non_full_groups, ps.block_size, ps.offload_block_size);
        if !ps.blocks.is_empty() {
            inner
                .state
                .import_blocks(&pod.runs, &ps.blocks, &ps.parents, &pod.mode);
        }
        inner.progress.last_seq = ps.last_seq;
        inner.progress.last_fingerprint = ps.last_fingerprint;
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
        Some(pod)
    }

    /// One model's runs of one key kind, its pods given their new ids
    /// (`renamed`). Blocks of pods without one (refused now, or created
    /// after the snapshot listed its pods) are held under ids no pod has,
    /// then dropped; a model none of whose pods was restored has no runs
    /// now, and its blocks are skipped. On an error the index may hold part
    /// of the runs: the caller drops every restored pod.
    fn import_runs(
        &self,
        model: &str,
        mut dump: Dump,
        renamed: &HashMap<u32, u32>,
    ) -> Result<(), DumpError> {
        let Some(runs) = self.table.read().model(model).map(|m| m.runs.clone()) else {
            return Ok(());
        };
        let strays: Vec<u32> = dump
            .pods()
            .into_iter()
            .filter(|p| !renamed.contains_key(p))
            .collect();
        let stray_id = |k: usize| crate::index::MAX_POD - 1 - k as u32;
        dump.rename_pods(|p| match renamed.get(&p) {
            Some(id) => *id,
            None => stray_id(strays.binary_search(&p).expect("a stray")),
        });
        let runs = runs.for_request(!dump.token_keys);
        let result = runs.restore(dump);
        for k in 0..strays.len() {
            runs.clear(stray_id(k));
        }
        result
    }
}

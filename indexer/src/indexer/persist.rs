use std::collections::HashMap;

use super::*;
use crate::index::{DumpError, RepeatRecord, RunRecord};
use crate::snapshot::{Record, RunsSink};

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
    /// the pods' locks are all held while everything is written (taken in
    /// id order; nothing else holds two pods' locks, and a writer holding
    /// one takes the runs' lock only after it). Ingest waits meanwhile;
    /// memory does not grow by a copy of the index (which would be about
    /// its size). A pod created meanwhile has no record, and its blocks
    /// are dropped on restore.
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
        // Written as they are read, under the pods' locks: the runs are
        // never copied (`DumpView`), so `out` should be a file, not a slow
        // reader (ingest waits until the last run is written).
        let guards: Vec<_> = pods.iter().map(|p| self.lock(p)).collect();
        for (p, inner) in pods.iter().zip(&guards) {
            let (non_full_groups, block_size, offload_block_size, bigram) =
                inner.state.rules_state();
            snapshot.pod(&PodSnapshot {
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
                bigram,
                engine: p.engine() as u8,
            })?;
        }
        for (name, runs) in &models {
            for index in [&runs.engine, &runs.token] {
                let view = index.dump_view();
                if !view.is_empty() {
                    snapshot.runs(name, &view)?;
                }
            }
        }
        drop(guards);
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
        let mut runs = ImportRuns {
            indexer: self,
            renamed: HashMap::new(),
            at: None,
            refused: false,
        };
        loop {
            let record = match snapshot.next_record(&mut runs) {
                Ok(Some(record)) => record,
                Ok(None) => break,
                Err(e) => {
                    // Nothing of a snapshot that fails is kept.
                    runs.abandon();
                    for pod in &restored {
                        self.remove_pod(pod);
                    }
                    return Err(match e {
                        SnapshotError::Decode(why) if runs.refused => {
                            SnapshotError::Decode(format!("runs: {why}"))
                        }
                        e => e,
                    });
                }
            };
            if let Record::Pod(ps) = record {
                if let Some(pod) = self.import_pod(&ps) {
                    if let Some(id) = ps.runs_id {
                        runs.renamed.insert(id, pod.id.0);
                    }
                    restored.push(pod);
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
        inner.state.restore_rules(
            &ps.non_full_groups,
            ps.block_size,
            ps.offload_block_size,
            ps.bigram,
        );
        if !ps.blocks.is_empty() {
            inner
                .state
                .import_blocks(&pod.runs, &ps.blocks, &ps.parents, &pod.mode);
        }
        inner.progress.last_seq = ps.last_seq;
        inner.progress.last_fingerprint = ps.last_fingerprint;
        drop(inner);
        pod.incomplete.store(ps.incomplete, Ordering::Relaxed);
        pod.bigram.store(ps.bigram, Ordering::Relaxed);
        pod.engine.store(ps.engine, Ordering::Relaxed);
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
}

/// A snapshot's runs restored as they are read: one model's runs of one
/// key kind at a time, its pods given their new ids (`renamed`). Blocks of
/// pods without one (refused now, or created after the snapshot listed
/// its pods) are held under ids no pod has, then dropped; a model none of
/// whose pods was restored has no runs now, and its blocks are skipped.
struct ImportRuns<'a> {
    indexer: &'a Indexer,
    /// A pod's id in the snapshot's runs, and now.
    renamed: HashMap<u32, u32>,
    at: Option<Importing>,
    /// A rule of the index refused a run (not the file's encoding).
    refused: bool,
}

struct Importing {
    runs: Arc<KeyedRuns>,
    token_keys: bool,
    restore: crate::index::Restore,
    /// Pods of the dump without an id now, and the stray id each is held
    /// under meanwhile.
    strays: HashMap<u32, u32>,
}

impl Importing {
    fn rename(&mut self, pod: u32, renamed: &HashMap<u32, u32>) -> u32 {
        if let Some(id) = renamed.get(&pod) {
            return *id;
        }
        let k = self.strays.len() as u32;
        *self
            .strays
            .entry(pod)
            .or_insert(crate::index::MAX_POD - 1 - k)
    }

    /// Ends the model's runs: the repeats, then the strays' blocks go.
    fn finish(self, repeats: Vec<RepeatRecord>) -> Result<(), DumpError> {
        let index = self.runs.for_request(!self.token_keys);
        let result = index.restore_end(self.restore, repeats);
        clear_strays(index, &self.strays);
        result
    }
}

/// Drops what the dump's pods without an id now hold (see `Importing`).
fn clear_strays(index: &crate::index::RunIndex, strays: &HashMap<u32, u32>) {
    for &id in strays.values() {
        index.clear(id);
    }
}

impl ImportRuns<'_> {
    fn refuse(&mut self, e: DumpError) -> String {
        self.refused = true;
        e.to_string()
    }

    /// After an error: the strays' blocks go (the restored pods' are the
    /// caller's to drop).
    fn abandon(&mut self) {
        if let Some(at) = self.at.take() {
            clear_strays(at.runs.for_request(!at.token_keys), &at.strays);
        }
    }
}

impl RunsSink for ImportRuns<'_> {
    fn begin(&mut self, model: &str, token_keys: bool, clock: u32) -> Result<(), String> {
        let runs = self
            .indexer
            .table
            .read()
            .model(model)
            .map(|m| m.runs.clone());
        let Some(runs) = runs else {
            self.at = None;
            return Ok(());
        };
        let restore = runs
            .for_request(!token_keys)
            .restore_begin(token_keys, clock)
            .map_err(|e| self.refuse(e))?;
        self.at = Some(Importing {
            runs,
            token_keys,
            restore,
            strays: HashMap::new(),
        });
        Ok(())
    }

    fn run(&mut self, mut run: RunRecord) -> Result<(), String> {
        let Some(at) = self.at.as_mut() else {
            return Ok(());
        };
        for h in &mut run.holdings {
            h.pod = at.rename(h.pod, &self.renamed);
        }
        run.holdings.sort_by_key(|h| (h.pod, h.tier));
        let index = at.runs.for_request(!at.token_keys);
        let result = index.restore_run(&mut at.restore, run);
        result.map_err(|e| self.refuse(e))
    }

    fn end(&mut self, mut repeats: Vec<RepeatRecord>) -> Result<(), String> {
        let Some(mut at) = self.at.take() else {
            return Ok(());
        };
        for r in &mut repeats {
            r.pod = at.rename(r.pod, &self.renamed);
        }
        at.finish(repeats).map_err(|e| self.refuse(e))
    }
}

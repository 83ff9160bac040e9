use super::*;

impl Indexer {
    /// Keys of a prompt's full blocks, as the model's key mode computes them.
    pub fn request_keys(
        &self,
        model: &str,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        tokens: &[u32],
        block_size: u32,
    ) -> Vec<BlockKey> {
        self.config
            .keys
            .for_model(model)
            .request_keys(model, lora_name, cache_salt, tokens, block_size as usize)
            .0
    }

    pub fn score(&self, q: &ScoreQuery<'_>) -> ScoreOutcome {
        // (candidate name, pod if known)
        let mut offload_block_size = self.config.offload_block_size;
        let mut candidates: Vec<(String, Option<Arc<Pod>>)> = {
            let table = self.table.read();
            if offload_block_size == 0 {
                offload_block_size = table.model(q.model).map_or(0, |m| m.offload_block_size);
            }
            if q.pods.is_empty() {
                let ids = table
                    .model(q.model)
                    .map(|m| m.pods.clone())
                    .unwrap_or_default();
                ids.iter()
                    .filter_map(|id| table.get(*id))
                    .map(|p| (p.name.clone(), Some(p.clone())))
                    .collect()
            } else {
                let mut seen = std::collections::HashSet::new();
                q.pods
                    .iter()
                    .filter(|name| seen.insert(name.as_str()))
                    .map(|name| (name.clone(), table.by_name(q.model, name).cloned()))
                    .collect()
            }
        };
        let speculating = !self.speculative.is_empty();
        if speculating && q.pods.is_empty() {
            // A pod just picked may not have published yet: it is a
            // candidate all the same.
            let known: std::collections::HashSet<String> =
                candidates.iter().map(|(n, _)| n.clone()).collect();
            for name in self.speculative.pods_of(q.model) {
                if !known.contains(&name) {
                    candidates.push((name, None));
                }
            }
        }

        // Pods of one model may run different block sizes: chunk per size.
        let mut by_size: BTreeMap<u32, SizeGroup> = BTreeMap::new();
        let mut scores: Vec<PodScore> = Vec::with_capacity(candidates.len());
        for (pos, (name, pod)) in candidates.into_iter().enumerate() {
            let bs = self.pod_block_size(pod.as_deref(), q.model);
            let total = (q.tokens.len() / bs as usize) as u32;
            let incomplete = pod
                .as_ref()
                .is_some_and(|p| p.incomplete.load(Ordering::Relaxed));
            let dropped = incomplete && self.config.drop_incomplete;
            let group = by_size.entry(bs).or_default();
            if speculating && !dropped {
                if let Some(spec) = self.speculative.pod(q.model, &name) {
                    group
                        .speculative
                        .push((pos, pod.as_ref().map(|p| p.id), spec));
                }
            }
            match pod {
                Some(pod) if !dropped => group.exact.push((pod.id, pos)),
                _ => {}
            }
            scores.push(PodScore {
                pod: name,
                matched: PrefixMatch::default(),
                score: 0.0,
                block_size: bs,
                total_blocks: total,
                incomplete,
                speculative_blocks: 0,
            });
        }
        let block_size = self.model_block_size(q.model);
        by_size.entry(block_size).or_default();
        let mode = self.config.keys.for_model(q.model);
        let now = Instant::now();
        let mut keys_out = Vec::with_capacity(by_size.len());
        for (bs, group) in by_size {
            let SizeGroup {
                exact: mut group,
                speculative,
            } = group;
            let (keys, engine_keys) =
                mode.request_keys(q.model, q.lora_name, q.cache_salt, q.tokens, bs as usize);
            group.sort_unstable();
            let ids: Vec<PodId> = group.iter().map(|(id, _)| *id).collect();
            // Closure is only sound on engine keys: token keys of a block
            // whose parent was never seen do not exist at all.
            let closure = engine_keys && mode.engine().is_some_and(|e| e.assume_prefix_closed);
            let rules = Rules {
                closure,
                offload_block_size,
                block_size: bs,
            };
            self.match_pods(&keys, &ids, rules, |at, m| {
                scores[group[at].1].matched = m;
            });
            for (pos, id, spec) in speculative {
                let spec = spec.read();
                let from = scores[pos].matched.matched_blocks as usize;
                let run = spec.run_from(&keys[from.min(keys.len())..], now, |key| {
                    id.is_some_and(|id| self.holds_exactly(id, key))
                });
                scores[pos].speculative_blocks = (from + run) as u32;
            }
            keys_out.push((bs, keys));
        }
        let weight = self.config.speculative_weight;
        for s in &mut scores {
            s.speculative_blocks = s.speculative_blocks.max(s.matched.matched_blocks);
            if s.total_blocks > 0 {
                let extra = f64::from(s.speculative_blocks - s.matched.matched_blocks);
                s.score = (s.matched.weighted_blocks + weight * extra) / f64::from(s.total_blocks);
            }
        }
        scores.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then(b.matched.matched_blocks.cmp(&a.matched.matched_blocks))
                .then_with(|| a.pod.cmp(&b.pod))
        });
        ScoreOutcome {
            block_size,
            total_blocks: (q.tokens.len() / block_size as usize) as u32,
            pods: scores,
            keys: keys_out,
        }
    }

    /// The first-miss prefix match of the pods of `model` holding at least
    /// one block of a prompt already turned into keys (`request_keys`, or
    /// engine hashes in engine mode), in pod id order. No names, no zeros,
    /// no closure inference: the index alone, answering what the peers'
    /// indexes answer, as the comparison bench measures it.
    pub fn prefix_matches(&self, model: &str, keys: &[BlockKey]) -> Vec<(PodId, PrefixMatch)> {
        // One read guard for the whole lookup, the model's pod list borrowed
        // from it: taking the list (an `Arc` clone and drop) and then the
        // guard again were four locked instructions per lookup, each a full
        // fence (see `match_pods`).
        let table = self.table.read();
        let Some(model) = table.model(model) else {
            return Vec::new();
        };
        let ids: &[PodId] = &model.pods;
        // Room for every pod up front (untouched memory costs nothing): a
        // growing vector's copies added 14% to a 128-pod lookup.
        let mut out = Vec::with_capacity(ids.len());
        let in_order = self.match_pods_in(&table, keys, ids, Rules::INDEX_ONLY, |pos, m| {
            out.push((ids[pos], m))
        });
        if !in_order {
            out.sort_unstable_by_key(|(id, _)| *id);
        }
        out
    }

    /// Prefix matches of `ids` (sorted) with at least one block, each
    /// given to `emit` as (position in `ids`, match), in position order
    /// unless this returns false. Pods whose held set is prefix-closed and
    /// on one tier are binary-searched (`score::jump`); the others, and any
    /// whose closure a writer changed meanwhile, walk block by block (and
    /// come last). Both give the first-miss answer on the index's own
    /// state, or under concurrent events one between the states before and
    /// after them (see `closure`).
    ///
    /// Only pods holding the first block can match (closure inference
    /// aside, which credits blocks the index never saw): one probe picks
    /// them, so with a large fleet a prompt pays per pod that holds its
    /// start, not per pod of the model. With offloaded chunks (`rules`),
    /// pods holding the first chunk's last block count too (vLLM's default
    /// offload events name a chunk by it alone); those and every pod with
    /// offloaded blocks are walked, then counted by chunks (`offload`).
    ///
    /// The pod table's read guard is held throughout: a pod removed since
    /// `ids` was read has no slot and is skipped, and no id is freed (so
    /// reused) while the search runs. The block index's shards are taken
    /// under it; nothing takes them the other way round.
    fn match_pods(
        &self,
        keys: &[BlockKey],
        ids: &[PodId],
        rules: Rules,
        emit: impl FnMut(usize, PrefixMatch),
    ) -> bool {
        self.match_pods_in(&self.table.read(), keys, ids, rules, emit)
    }

    /// `match_pods` under a guard the caller holds.
    fn match_pods_in(
        &self,
        table: &PodTable,
        keys: &[BlockKey],
        ids: &[PodId],
        rules: Rules,
        mut emit: impl FnMut(usize, PrefixMatch),
    ) -> bool {
        debug_assert!(ids.windows(2).all(|w| w[0] < w[1]));
        if keys.is_empty() {
            return true;
        }
        LOOKUP_SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => {
                self.match_pods_with(table, keys, ids, rules, &mut scratch, &mut emit)
            }
            Err(_) => self.match_pods_with(
                table,
                keys,
                ids,
                rules,
                &mut LookupScratch::default(),
                &mut emit,
            ),
        })
    }

    /// `match_pods` with its buffers. Matches go straight to `emit`, not
    /// through a list of every candidate that was then filtered and
    /// re-keyed: 7% fewer instructions per lookup with 128 pods holding a
    /// 128-block prompt's start (callgrind).
    fn match_pods_with(
        &self,
        pods: &PodTable,
        keys: &[BlockKey],
        ids: &[PodId],
        Rules {
            closure,
            offload_block_size,
            block_size,
        }: Rules,
        scratch: &mut LookupScratch,
        emit: &mut impl FnMut(usize, PrefixMatch),
    ) -> bool {
        let LookupScratch {
            search,
            candidates,
            closed,
            views,
            open,
        } = scratch;
        if closure {
            candidates.clear();
            candidates.extend(0..ids.len() as u32);
        } else {
            holding(&self.blocks, keys[0], ids, search, candidates);
        }
        let weights = &self.config.tier_weights;
        closed.clear();
        views.clear();
        open.clear();
        for &pos in candidates.iter() {
            let id = ids[pos as usize];
            let Some(pod) = pods.get(id) else { continue };
            match pod.closure.view() {
                // Offloaded chunks are counted after the walk (below).
                Some(view)
                    if view.tier == Tier::Gpu
                        || self.pod_chunk_factor(pod, offload_block_size, block_size) == 1 =>
                {
                    closed.push(id);
                    views.push((pos, view));
                }
                _ => open.push(pos),
            }
        }
        let model_factor = chunk_factor(offload_block_size, block_size);
        if model_factor > 1 && !closure && keys.len() >= model_factor as usize {
            // A pod may hold the first chunk offloaded and not block 0:
            // with the connector's default events only the chunk's last
            // block is known. (The model's chunk size: a pod of another
            // size holding its first chunk alone is missed.)
            let mut more = Vec::new();
            holding(
                &self.blocks,
                keys[model_factor as usize - 1],
                ids,
                search,
                &mut more,
            );
            let mut known = candidates.clone();
            known.sort_unstable();
            more.retain(|pos| {
                known.binary_search(pos).is_err() && pods.get(ids[*pos as usize]).is_some()
            });
            open.extend(more);
        }
        // Without closure inference the candidates are the holders of
        // block 0, probed above.
        let depths = jump(&self.blocks, keys, closed, !closure, search);
        let mut searched_any = false;
        for ((&id, &(pos, view)), &depth) in closed.iter().zip(views.iter()).zip(depths) {
            if !pods.get(id).is_some_and(|p| p.closure.unchanged(view)) {
                open.push(pos);
            } else if depth > 0 {
                searched_any = true;
                emit(
                    pos as usize,
                    PrefixMatch::on_one_tier(depth, view.tier, weights),
                );
            }
        }
        if open.is_empty() {
            return true;
        }
        // Rare (pods not closed, offloading in chunks, or whose closure a
        // writer changed): walk.
        open.sort_unstable();
        let open_ids: Vec<PodId> = open.iter().map(|pos| ids[*pos as usize]).collect();
        let (mut walked, mut gpu_runs) = walk_with_gpu_runs(&self.blocks, keys, &open_ids, weights);
        // Per walked pod, blocks per offloaded chunk (1: none).
        let factors: Vec<u32> = open_ids
            .iter()
            .map(|id| {
                pods.get(*id).map_or(1, |p| {
                    self.pod_chunk_factor(p, offload_block_size, block_size)
                })
            })
            .collect();
        if closure {
            let chunked: Vec<bool> = factors.iter().map(|f| *f > 1).collect();
            extend_prefix_closed(
                &self.blocks,
                keys,
                &open_ids,
                &mut walked,
                &mut gpu_runs,
                &chunked,
                weights,
            );
        }
        for (c, f) in factors.iter().enumerate() {
            if *f > 1 {
                walked[c] =
                    chunked_match(&self.blocks, keys, open_ids[c], *f, gpu_runs[c], weights);
            }
        }
        for (pos, m) in open.iter().zip(walked) {
            if m.matched_blocks > 0 {
                emit(*pos as usize, m);
            }
        }
        // The walked ones came after any searched ones.
        !searched_any
    }

    /// The matches `score` gives every pod of `model` for `keys` (cut in
    /// blocks of `block_size`) under its rules, by pod id: the walk,
    /// `closure` as given and offloaded chunks, without names or
    /// speculative entries (what `run_score` answers from the runs).
    #[cfg(test)]
    pub(crate) fn matches_by_rules(
        &self,
        model: &str,
        keys: &[BlockKey],
        closure: bool,
        block_size: u32,
    ) -> Vec<(PodId, PrefixMatch)> {
        let table = self.table.read();
        let Some(m) = table.model(model) else {
            return Vec::new();
        };
        let offload_block_size = match self.config.offload_block_size {
            0 => m.offload_block_size,
            configured => configured,
        };
        let ids = m.pods.clone();
        let rules = Rules {
            closure,
            offload_block_size,
            block_size,
        };
        let mut out = Vec::new();
        self.match_pods_in(&table, keys, &ids, rules, |pos, m| out.push((ids[pos], m)));
        out.sort_unstable_by_key(|(id, _)| *id);
        out
    }

    /// Who holds each key (debugging).
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<KeyHolders> {
        let pods = self.table.read();
        keys.iter()
            .map(|key| KeyHolders {
                key: *key,
                pods: self.blocks.with_holders(*key, |h| {
                    h.iter()
                        .filter_map(|h| Some((pods.get(h.pod())?.name.clone(), h.tiers())))
                        .collect()
                }),
            })
            .collect()
    }

    /// Every pod (of `model`, if given), sorted by model then pod.
    pub fn list_pods(&self, model: Option<&str>) -> Vec<PodSummary> {
        let (pods, model_offload): (Vec<Arc<Pod>>, BTreeMap<String, u32>) = {
            let table = self.table.read();
            let sizes = table
                .models()
                .map(|(name, m)| (name.clone(), m.offload_block_size))
                .collect();
            (table.pods().cloned().collect(), sizes)
        };
        let now = Instant::now();
        let mut out: Vec<PodSummary> = pods
            .iter()
            .filter(|p| !p.is_removed() && model.is_none_or(|m| p.model == m))
            .map(|p| {
                let inner = self.lock(p);
                PodSummary {
                    pod: p.name.clone(),
                    model: p.model.clone(),
                    dp_rank: p.dp_rank,
                    block_size: self.pod_block_size(Some(p), &p.model),
                    offload_block_size: self.pod_offload_block_size(
                        p,
                        model_offload.get(&p.model).copied().unwrap_or(0),
                    ),
                    blocks_per_tier: inner.state.held_per_tier(),
                    last_seq: inner.progress.last_seq,
                    batches: inner.progress.batches,
                    events: inner.progress.events,
                    seq_gaps: inner.progress.seq_gaps,
                    publisher_restarts: inner.progress.publisher_restarts,
                    duplicate_batches: inner.progress.duplicate_batches,
                    unrecovered_batches: inner.progress.unrecovered_batches,
                    incomplete: p.incomplete.load(Ordering::Relaxed),
                    last_event_age: inner.progress.last_event.map(|t| now - t),
                    connection: p.connection(),
                    applied: inner.progress.applied,
                    skipped: inner.progress.skipped,
                    key_mode: p.mode.name(),
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.model, &a.pod).cmp(&(&b.model, &b.pod)));
        out
    }

    /// Distinct keys held by any pod.
    pub fn indexed_keys(&self) -> usize {
        self.blocks.len()
    }
}

/// The candidates of one block size: those the exact index knows, and
/// those with speculative entries (known or not yet).
#[derive(Default)]
struct SizeGroup {
    exact: Vec<(PodId, usize)>,
    speculative: Vec<(
        usize,
        Option<PodId>,
        Arc<RwLock<crate::routing::speculative::PodSpeculation>>,
    )>,
}

/// What a lookup answers beyond the first-miss walk on the index's blocks.
#[derive(Clone, Copy, Debug)]
struct Rules {
    /// Engine mode's prefix closure: a pod holding block k on GPU holds
    /// blocks 0..k there (`extend_prefix_closed`).
    closure: bool,
    /// The model's offloaded block size in tokens (0: none known, blocks
    /// count one by one); a pod whose own events gave another counts by
    /// its own (`pod_offload_block_size`).
    offload_block_size: u32,
    /// The block size `keys` were cut with (the pods' own).
    block_size: u32,
}

impl Rules {
    /// The index alone, as the peers' indexes answer.
    const INDEX_ONLY: Rules = Rules {
        closure: false,
        offload_block_size: 0,
        block_size: 0,
    };
}

impl Indexer {
    /// The offloaded block size in tokens `pod` is counted by: the
    /// configured one, else what its own events gave, else its model's
    /// (`model`); 0: none.
    fn pod_offload_block_size(&self, pod: &Pod, model: u32) -> u32 {
        let own = pod.offload_block_size.load(Ordering::Relaxed);
        match (self.config.offload_block_size, own) {
            (0, 0) => model,
            (0, own) => own,
            (configured, _) => configured,
        }
    }

    /// Blocks per offloaded chunk of `pod`, in blocks of `bs` (1: counted
    /// one by one, as every pod is when the lookup knows no size: `model`
    /// 0, which a model whose pods gave one never has).
    fn pod_chunk_factor(&self, pod: &Pod, model: u32, bs: u32) -> u32 {
        match model {
            0 => 1,
            _ => chunk_factor(self.pod_offload_block_size(pod, model), bs),
        }
    }
}

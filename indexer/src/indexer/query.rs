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
        mm_items: &[crate::keys::multimodal::MmItem],
    ) -> Vec<BlockKey> {
        self.config
            .keys
            .for_model(model)
            .request_keys(
                model,
                lora_name,
                cache_salt,
                tokens,
                block_size as usize,
                mm_items,
            )
            .0
    }

    /// Keys of a prompt's pages for a pod that pages its bigrams (SGLang
    /// with EAGLE): a page is `block_size` bigrams, `2 block_size` ids (no
    /// multimodal items: SGLang's events name none), keyed in a scope of
    /// their own. Whether they are engine hashes rides along.
    pub fn bigram_request_keys(
        &self,
        model: &str,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        tokens: &[u32],
        block_size: u32,
    ) -> (Vec<BlockKey>, bool) {
        self.config.keys.for_model(model).request_keys(
            &crate::keys::bigram_scope(model),
            lora_name,
            cache_salt,
            &crate::keys::bigram_words(tokens),
            2 * block_size as usize,
            &[],
        )
    }

    pub fn score(&self, q: &ScoreQuery<'_>) -> ScoreOutcome {
        let mut offload_block_size = self.config.offload_block_size;
        // The model's blocks (none: no pod of it is known), and
        // (candidate name, pod if known).
        let (runs, mut candidates): (Option<Arc<KeyedRuns>>, Vec<Named>) = {
            let table = self.table.read();
            if offload_block_size == 0 {
                offload_block_size = table.model(q.model).map_or(0, |m| m.offload_block_size);
            }
            let runs = table.model(q.model).map(|m| m.runs.clone());
            let candidates = if q.pods.is_empty() {
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
            };
            (runs, candidates)
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

        // Pods of one model may run different block sizes: chunk per size
        // (and per unit: EAGLE's pods page a prompt's bigrams).
        let mut by_size: BTreeMap<(u32, bool), SizeGroup> = BTreeMap::new();
        let mut scores: Vec<PodScore> = Vec::with_capacity(candidates.len());
        for (pos, (name, pod)) in candidates.into_iter().enumerate() {
            let engine = pod.as_ref().map_or("", |p| p.engine().name());
            let bs = self.pod_block_size(pod.as_deref(), q.model);
            let bigram = pod
                .as_ref()
                .is_some_and(|p| p.bigram.load(Ordering::Relaxed));
            // A bigram per token but the last.
            let units = q.tokens.len().saturating_sub(usize::from(bigram));
            let total = (units / bs as usize) as u32;
            let incomplete = pod
                .as_ref()
                .is_some_and(|p| p.incomplete.load(Ordering::Relaxed));
            let dropped = incomplete && self.config.drop_incomplete;
            let group = by_size.entry((bs, bigram)).or_default();
            if speculating && !dropped {
                if let Some(spec) = self.speculative.pod(q.model, &name) {
                    group
                        .speculative
                        .push((pos, pod.as_ref().map(|p| p.id), spec));
                }
            }
            match pod {
                Some(pod) if !dropped => {
                    let chunk = self.pod_chunk_factor(&pod, offload_block_size, bs);
                    group.exact.push((pod.id, pos, chunk));
                }
                _ => {}
            }
            scores.push(PodScore {
                engine,
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
        by_size.entry((block_size, false)).or_default();
        let mode = self.config.keys.for_model(q.model);
        let now = Instant::now();
        let mut keys_out = Vec::with_capacity(by_size.len());
        let mut bigram_keys_out = Vec::new();
        for ((bs, bigram), group) in by_size {
            let SizeGroup {
                exact: mut group,
                speculative,
            } = group;
            let (keys, engine_keys) = if bigram {
                self.bigram_request_keys(q.model, q.lora_name, q.cache_salt, q.tokens, bs)
            } else {
                mode.request_keys(
                    q.model,
                    q.lora_name,
                    q.cache_salt,
                    q.tokens,
                    bs as usize,
                    q.mm_items,
                )
            };
            group.sort_unstable();
            // Closure is only sound on engine keys: token keys of a block
            // whose parent was never seen do not exist at all.
            let closure = engine_keys && mode.engine().is_some_and(|e| e.assume_prefix_closed);
            let raw = BlockKey::as_raw(&keys);
            if let Some(runs) = &runs {
                let candidates: Vec<Candidate> = group
                    .iter()
                    .map(|&(id, _, chunk)| Candidate { pod: id.0, chunk })
                    .collect();
                let rules = MatchRules {
                    closure,
                    model_chunk: chunk_factor(offload_block_size, bs),
                };
                let weights = &self.config.tier_weights;
                let index = runs.for_request(engine_keys);
                for (at, m) in score::match_pods(index, raw, &candidates, rules, weights) {
                    scores[group[at].1].matched = m;
                }
            }
            // What every pod holds of the prompt, read once for all the
            // pods with speculative entries (their runs stop at a block
            // held exactly).
            let along: Vec<crate::index::HeldAlong> = match &runs {
                Some(runs) if !speculative.is_empty() => {
                    runs.for_request(engine_keys).held_along(raw)
                }
                _ => Vec::new(),
            };
            for (pos, id, spec) in speculative {
                let spec = spec.read();
                let from = scores[pos].matched.matched_blocks as usize;
                let held = id
                    .and_then(|id| along.iter().find(|a| a.pod == id.0))
                    .map(Held::of);
                let run = spec.run_from(&keys[from.min(keys.len())..], now, |at, _| {
                    held.as_ref()
                        .is_some_and(|h| !h.at((from + at) as u32).is_empty())
                });
                scores[pos].speculative_blocks = (from + run) as u32;
            }
            // A prompt handle's keys, by block size and unit.
            if bigram {
                bigram_keys_out.push((bs, keys));
            } else {
                keys_out.push((bs, keys));
            }
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
            bigram_keys: bigram_keys_out,
        }
    }

    /// The first-miss prefix match of the pods of `model` holding at least
    /// one block of a prompt already turned into keys (`request_keys`, or
    /// engine hashes in engine mode), in pod id order. No names, no zeros,
    /// no closure inference: the index alone, answering what the peers'
    /// indexes answer, as the comparison bench measures it. Looked up in
    /// the runs of the model's key kind.
    pub fn prefix_matches(&self, model: &str, keys: &[BlockKey]) -> Vec<(PodId, PrefixMatch)> {
        // A model's runs hold its pods' blocks only (a removed pod's are
        // gone with it): every pod they answer is a candidate.
        let Some(runs) = self.table.read().model(model).map(|m| m.runs.clone()) else {
            return Vec::new();
        };
        let engine = matches!(self.config.keys.for_model(model), KeyMode::Engine(_));
        let weights = &self.config.tier_weights;
        // In pod order as the runs answer.
        runs.for_request(engine)
            .prefix_matches_as(BlockKey::as_raw(keys), |m| {
                (PodId(m.pod), score::prefix_match(&m, weights))
            })
    }

    /// Who holds each key (debugging). The keys are read as a prompt's,
    /// in order from its first block (as `request_keys` gives them): a key
    /// is found where the list reaches it from the start of a run of
    /// blocks the index keeps, which a prompt's keys always do; each key
    /// is compared, so a list that is no chain gets no wrong holder.
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<KeyHolders> {
        let raw = BlockKey::as_raw(keys);
        let mut held: Vec<Vec<(PodId, TierMask)>> = vec![Vec::new(); keys.len()];
        let models: Vec<Arc<KeyedRuns>> = self
            .table
            .read()
            .models()
            .map(|(_, m)| m.runs.clone())
            .collect();
        for runs in &models {
            for index in [&runs.engine, &runs.token] {
                for along in index.held_at_each(raw) {
                    let pod = PodId(along.pod);
                    for (tier, start, end) in along.spans {
                        for at in &mut held[start as usize..end as usize] {
                            match at.iter_mut().find(|(p, _)| *p == pod) {
                                Some((_, tiers)) => tiers.0 |= 1 << tier.index(),
                                None => at.push((pod, TierMask(1 << tier.index()))),
                            }
                        }
                    }
                }
            }
        }
        let pods = self.table.read();
        keys.iter()
            .zip(held)
            .map(|(key, holders)| KeyHolders {
                key: *key,
                pods: holders
                    .into_iter()
                    .filter_map(|(pod, tiers)| Some((pods.get(pod)?.name.clone(), tiers)))
                    .collect(),
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
                    blocks_per_tier: inner.state.held_per_tier(&p.runs),
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
                    engine: p.engine().name(),
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.model, &a.pod).cmp(&(&b.model, &b.pod)));
        out
    }

    /// Distinct blocks kept, of either key kind (a block no pod holds any
    /// more stays in its run until the run's later blocks go).
    pub fn indexed_keys(&self) -> usize {
        self.table
            .read()
            .models()
            .map(|(_, m)| m.runs.engine.blocks() + m.runs.token.blocks())
            .sum()
    }
}

/// A candidate's name, and its pod if known.
type Named = (String, Option<Arc<Pod>>);

/// The candidates of one block size: those the exact index knows, and
/// those with speculative entries (known or not yet).
#[derive(Default)]
struct SizeGroup {
    /// (pod, position in the answer, blocks per offloaded chunk).
    exact: Vec<(PodId, usize, u32)>,
    speculative: Vec<(
        usize,
        Option<PodId>,
        Arc<RwLock<crate::routing::speculative::PodSpeculation>>,
    )>,
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

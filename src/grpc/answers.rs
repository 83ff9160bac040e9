//! The answers: `Score` (exact, speculative, approximate) and
//! `RecordRouting` over the index and routing feedback.

use super::*;

/// Longest pod name `RecordRouting` accepts.
pub(super) const MAX_POD_NAME: usize = 256;

/// What `Score` tokenized, for its response and prompt handle.
#[derive(Debug)]
pub(crate) struct Scored {
    pub tokens: Vec<u32>,
    pub approximate: bool,
}

impl KvIndexerService {
    /// Scores a request; also used by the llm-d API.
    ///
    /// A text or chat prompt for a model that is neither configured nor
    /// published is not tokenized: nothing is cached for it anywhere, so
    /// every candidate scores 0 (with 0 prompt tokens and blocks).
    pub(crate) async fn score_outcome(
        &self,
        req: pb::ScoreRequest,
        permit: OwnedSemaphorePermit,
        deadline: Deadline,
    ) -> Result<(indexer::ScoreOutcome, Scored), ApiError> {
        require_model(&req.model)?;
        self.check_candidates(req.pods.len())?;
        let input = PromptInput::from_score(req.input, self.limits.max_prompt_bytes)?;
        let input = self.render_media(&req.model, input, deadline).await?;
        let (input, mm_items, salt) = with_rendered(input, req.mm_items, &req.cache_salt)?;
        items_need_token_ids(&input, &mm_items)?;
        // Held to the end of scoring (the tokenization hands it back).
        let (tokens, _permit) = self
            .prompt_tokens(&req.model, input, req.add_special_tokens, deadline, permit)
            .await?;
        let mm = match &tokens {
            PromptTokens::Ids(ids) => self.mm_items(mm_items, ids)?,
            _ => Vec::new(),
        };
        deadline.check("scoring")?;
        let approximate = self.approximate(&req.model);
        let lora_name = non_empty(&req.lora_name);
        let cache_salt = salt.as_deref();
        let (out, tokens) = match tokens {
            PromptTokens::Ids(tokens) if approximate => {
                let bs = self.indexer.model_block_size(&req.model);
                let keys = self
                    .indexer
                    .request_keys(&req.model, lora_name, cache_salt, &tokens, bs, &mm);
                (
                    self.approximate_outcome(&req.model, &req.pods, bs, keys),
                    tokens,
                )
            }
            PromptTokens::Unknown(Some(text)) if approximate => {
                let keys = indexer::routing::approximate::text_block_keys(
                    &req.model,
                    cache_salt,
                    text.as_bytes(),
                );
                let bs = indexer::routing::approximate::TEXT_BLOCK_TOKENS;
                (
                    self.approximate_outcome(&req.model, &req.pods, bs, keys),
                    Vec::new(),
                )
            }
            PromptTokens::Ids(tokens) => (
                self.indexer.score(&ScoreQuery {
                    model: &req.model,
                    tokens: &tokens,
                    lora_name,
                    cache_salt,
                    mm_items: &mm,
                    pods: &req.pods,
                }),
                tokens,
            ),
            PromptTokens::Unknown(_) => (
                self.indexer.score(&ScoreQuery {
                    model: &req.model,
                    tokens: &[],
                    lora_name,
                    cache_salt,
                    mm_items: &[],
                    pods: &req.pods,
                }),
                Vec::new(),
            ),
        };
        let span = tracing::Span::current();
        span.record("tokens", tokens.len());
        span.record("blocks", out.total_blocks);
        span.record(
            "best",
            out.pods.first().map_or(0, |p| p.matched.matched_blocks),
        );
        Ok((
            out,
            Scored {
                tokens,
                approximate,
            },
        ))
    }

    /// An approximate model's answer: leading blocks in each candidate's
    /// routing history.
    pub(super) fn approximate_outcome(
        &self,
        model: &str,
        pods: &[String],
        block_size: u32,
        keys: Vec<BlockKey>,
    ) -> indexer::ScoreOutcome {
        let Some((feedback, _)) = &self.feedback else {
            unreachable!("approximate models need routing feedback")
        };
        let total = keys.len() as u32;
        let mut scores: Vec<indexer::PodScore> = feedback
            .approximate
            .matches(model, &keys, pods)
            .into_iter()
            .map(|(pod, n)| indexer::PodScore {
                pod,
                matched: indexer::score::PrefixMatch {
                    matched_blocks: n,
                    blocks_per_tier: [n, 0, 0],
                    best_tier_blocks: [n, 0, 0],
                    weighted_blocks: f64::from(n),
                },
                score: if total > 0 {
                    f64::from(n) / f64::from(total)
                } else {
                    0.0
                },
                block_size,
                total_blocks: total,
                incomplete: false,
                speculative_blocks: n,
                // A guess from routing history, not from the pod's events.
                engine: "",
            })
            .collect();
        scores.sort_by(|a, b| b.score.total_cmp(&a.score).then_with(|| a.pod.cmp(&b.pod)));
        indexer::ScoreOutcome {
            block_size,
            total_blocks: total,
            pods: scores,
            keys: vec![(block_size, keys)],
            bigram_keys: Vec::new(),
        }
    }

    pub(super) async fn score_inner(
        &self,
        req: pb::ScoreRequest,
        permit: OwnedSemaphorePermit,
        deadline: Deadline,
    ) -> Result<pb::ScoreResponse, ApiError> {
        let model = req.model.clone();
        let (mut out, scored) = self.score_outcome(req, permit, deadline).await?;
        let prompt_tokens = scored.tokens.len() as u32;
        let prompt_handle = match &self.feedback {
            Some((feedback, _)) if !out.keys.is_empty() => {
                let mut tokens = scored.tokens;
                tokens.truncate(indexer::routing::tracker::KEPT_TOKENS);
                // Kept for seconds and counted by length: not a long prompt's capacity.
                tokens.shrink_to_fit();
                let shared = |keys: Vec<(u32, Vec<BlockKey>)>| {
                    keys.into_iter().map(|(bs, k)| (bs, Arc::from(k))).collect()
                };
                feedback.handles.insert(PromptHandle {
                    model,
                    keys: shared(std::mem::take(&mut out.keys)),
                    bigram_keys: shared(std::mem::take(&mut out.bigram_keys)),
                    tokens,
                    approximate: scored.approximate,
                })
            }
            _ => 0,
        };
        Ok(pb::ScoreResponse {
            block_size: out.block_size,
            total_blocks: out.total_blocks,
            prompt_tokens,
            pods: out
                .pods
                .into_iter()
                .map(|p| pb::PodScore {
                    pod: p.pod,
                    matched_blocks: p.matched.matched_blocks,
                    score: p.score,
                    gpu_blocks: p.matched.blocks_per_tier[Tier::Gpu.index()],
                    cpu_blocks: p.matched.blocks_per_tier[Tier::Cpu.index()],
                    storage_blocks: p.matched.blocks_per_tier[Tier::Storage.index()],
                    block_size: p.block_size,
                    total_blocks: p.total_blocks,
                    incomplete: p.incomplete,
                    speculative_blocks: p.speculative_blocks,
                    matched_tokens: p.matched.matched_blocks.saturating_mul(p.block_size),
                    engine: p.engine.into(),
                })
                .collect(),
            prompt_handle,
            approximate: scored.approximate,
        })
    }

    /// `RecordRouting`: the prompt's keys for the pod's block size (from a
    /// handle, or computed as `Score` does), recorded by the pod's writer.
    pub(super) async fn record_inner(
        &self,
        req: pb::RecordRoutingRequest,
        permit: OwnedSemaphorePermit,
        deadline: Deadline,
    ) -> Result<pb::RecordRoutingResponse, ApiError> {
        let Some((feedback, control)) = &self.feedback else {
            return Err(ApiError::Internal("routing feedback is not running".into()));
        };
        require_model(&req.model)?;
        if req.pod.is_empty() {
            return Err(ApiError::MissingInput("`pod`"));
        }
        if req.pod.len() > MAX_POD_NAME {
            return Err(ApiError::TooLarge {
                what: "the pod name's length",
                got: req.pod.len(),
                limit: MAX_POD_NAME,
                flag: "(fixed: 256 bytes)",
            });
        }
        let approximate = feedback.approximate.serves(&req.model);
        // Outcomes are counted per model: only models we hold (or serve
        // approximately) get one, not any string a client sends.
        if !approximate && !self.indexer.has_model(&req.model) {
            return Err(ApiError::UnknownModel(shorten(&req.model).to_owned()));
        }
        let (block_size, bigram) = self.indexer.pod_paging(&req.model, &req.pod);
        // A pod paging the prompt's bigrams (EAGLE) is routed their keys.
        // The diagnosis of a routing that ends unconfirmed reads plain
        // tokens only: it gets none for such a pod.
        let bigram = bigram && !approximate;
        let (keys, tokens, block_size) = match req.input {
            Some(pb::record_routing_request::Input::PromptHandle(id)) => {
                let handle = feedback
                    .handles
                    .get(id)
                    .filter(|h| h.model == req.model)
                    .ok_or(ApiError::HandleExpired)?;
                let (bs, keys) = if handle.approximate {
                    handle.keys.first().cloned()
                } else {
                    let by_size = if bigram {
                        &handle.bigram_keys
                    } else {
                        &handle.keys
                    };
                    by_size.iter().find(|(bs, _)| *bs == block_size).cloned()
                }
                .ok_or(ApiError::HandleBlockSize(block_size))?;
                let tokens = if bigram {
                    Vec::new()
                } else {
                    handle.tokens.clone()
                };
                (keys, tokens, bs)
            }
            input => {
                let input = PromptInput::from_record(input, self.limits.max_prompt_bytes)?;
                let input = self.render_media(&req.model, input, deadline).await?;
                let (input, mm_items, salt) = with_rendered(input, req.mm_items, &req.cache_salt)?;
                items_need_token_ids(&input, &mm_items)?;
                let (tokens, _permit) = self
                    .prompt_tokens(&req.model, input, req.add_special_tokens, deadline, permit)
                    .await?;
                let (lora, salt) = (non_empty(&req.lora_name), salt.as_deref());
                match tokens {
                    PromptTokens::Ids(mut tokens) => {
                        let mm = self.mm_items(mm_items, &tokens)?;
                        let bs = if approximate {
                            self.indexer.model_block_size(&req.model)
                        } else {
                            block_size
                        };
                        let keys = if bigram {
                            let keys = self
                                .indexer
                                .bigram_request_keys(&req.model, lora, salt, &tokens, bs)
                                .0;
                            tokens.clear();
                            keys
                        } else {
                            self.indexer
                                .request_keys(&req.model, lora, salt, &tokens, bs, &mm)
                        };
                        tokens.truncate(indexer::routing::tracker::KEPT_TOKENS);
                        // Kept for seconds and counted by length: not a long prompt's capacity.
                        tokens.shrink_to_fit();
                        (Arc::from(keys), tokens, bs)
                    }
                    PromptTokens::Unknown(Some(text)) if approximate => {
                        let keys = indexer::routing::approximate::text_block_keys(
                            &req.model,
                            salt,
                            text.as_bytes(),
                        );
                        (
                            Arc::from(keys),
                            Vec::new(),
                            indexer::routing::approximate::TEXT_BLOCK_TOKENS,
                        )
                    }
                    PromptTokens::Unknown(_) => {
                        return Err(ApiError::UnknownModel(shorten(&req.model).to_owned()))
                    }
                }
            }
        };
        deadline.check("recording")?;
        let total_blocks = keys.len() as u32;
        let forward = self.forwarder.as_ref().filter(|_| !approximate);
        let forwarded = forward.map(|_| (req.model.clone(), req.pod.clone(), keys.clone()));
        let routing = indexer::routing::tracker::Routing {
            model: req.model,
            pod: req.pod,
            keys,
            tokens,
            block_size,
        };
        let reply = control
            .record(routing, approximate)
            .await
            .ok_or_else(|| ApiError::Internal("the ingest workers are gone".into()))?;
        if let (Some(forwarder), Some((model, pod, keys))) = (forward, forwarded) {
            if !reply.confirmed && reply.ttl > std::time::Duration::ZERO {
                // One instant on every replica: this one's end, in Unix time.
                let ends = std::time::SystemTime::now() + reply.ttl;
                forwarder.forward(pb::PeerRouting {
                    model,
                    pod,
                    keys: keys.iter().map(|k| k.0).collect(),
                    expires_unix_ms: ends
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64),
                });
            }
        }
        Ok(pb::RecordRoutingResponse {
            total_blocks,
            held_blocks: reply.held,
            speculative_blocks: reply.speculative,
            ttl_seconds: reply.ttl.as_secs_f64(),
            outcome: if reply.confirmed {
                "confirmed".into()
            } else {
                String::new()
            },
            approximate: reply.approximate,
        })
    }
}

pub(super) fn tier_to_pb(t: Tier) -> pb::Tier {
    match t {
        Tier::Gpu => pb::Tier::Gpu,
        Tier::Cpu => pb::Tier::Cpu,
        Tier::Storage => pb::Tier::Storage,
    }
}

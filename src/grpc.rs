//! The `kvindexer.v1.KvIndexer` gRPC service over the core `Indexer`.

use std::sync::Arc;
use std::time::Instant;

use indexer::event::Tier;
use indexer::keys::BlockKey;
use indexer::{Indexer, ScoreQuery};
use tokenizer::chat::ChatRequest;
use tokenizer::Registry;
use tonic::{Request, Response, Status};

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::proto::kvindexer::v1 as pb;
use pb::kv_indexer_server::KvIndexer;

pub struct KvIndexerService {
    indexer: Arc<Indexer>,
    tokenizers: Arc<Registry>,
    metrics: Arc<Metrics>,
}

impl KvIndexerService {
    pub fn new(indexer: Arc<Indexer>, tokenizers: Arc<Registry>, metrics: Arc<Metrics>) -> Self {
        KvIndexerService {
            indexer,
            tokenizers,
            metrics,
        }
    }

    /// Tokenizes text or chat input with the model's tokenizer (LoRA
    /// requests use the base model's), off the async executor: a first use
    /// loads the tokenizer, a long prompt takes milliseconds.
    async fn tokenize_input(
        &self,
        model: &str,
        input: TextInput,
        add_special_tokens: Option<bool>,
    ) -> Result<Tokenized, ApiError> {
        let registry = self.tokenizers.clone();
        let model = model.to_owned();
        let kind = input.kind();
        let started = Instant::now();
        let out = tokio::task::spawn_blocking(move || -> Result<Tokenized, ApiError> {
            let tok = registry.get(&model)?;
            match input {
                TextInput::Prompt(text) => Ok(Tokenized {
                    ids: tok.encode(&text, add_special_tokens.unwrap_or(true))?,
                    rendered: None,
                }),
                TextInput::Chat(body) => {
                    let req = ChatRequest::parse(&body)?;
                    let rendered = tok.render_chat(&req)?;
                    // vLLM tokenizes rendered chats without adding specials.
                    let ids = tok.encode(&rendered, add_special_tokens.unwrap_or(false))?;
                    Ok(Tokenized {
                        ids,
                        rendered: Some(rendered),
                    })
                }
            }
        })
        .await
        .map_err(|e| ApiError::Internal(format!("tokenization task failed: {e}")))?;
        self.metrics.observe_tokenize(kind, started.elapsed());
        out
    }

    /// Scores a request; also used by the llm-d API.
    pub(crate) async fn score_outcome(
        &self,
        req: pb::ScoreRequest,
    ) -> Result<(indexer::ScoreOutcome, usize), ApiError> {
        require_model(&req.model)?;
        let tokens = match req.input {
            Some(pb::score_request::Input::TokenIds(t)) => t.ids,
            Some(pb::score_request::Input::Prompt(text)) => {
                self.tokenize_input(&req.model, TextInput::Prompt(text), req.add_special_tokens)
                    .await?
                    .ids
            }
            Some(pb::score_request::Input::ChatCompletionJson(body)) => {
                self.tokenize_input(&req.model, TextInput::Chat(body), req.add_special_tokens)
                    .await?
                    .ids
            }
            None => {
                return Err(ApiError::MissingInput(
                    "`prompt`, `token_ids` or `chat_completion_json`",
                ))
            }
        };
        let out = self.indexer.score(&ScoreQuery {
            model: &req.model,
            tokens: &tokens,
            lora_name: non_empty(&req.lora_name),
            cache_salt: non_empty(&req.cache_salt),
            pods: &req.pods,
        });
        let span = tracing::Span::current();
        span.record("tokens", tokens.len());
        span.record("blocks", out.total_blocks);
        span.record(
            "best",
            out.pods.first().map_or(0, |p| p.matched.matched_blocks),
        );
        Ok((out, tokens.len()))
    }

    async fn score_inner(&self, req: pb::ScoreRequest) -> Result<pb::ScoreResponse, ApiError> {
        let (out, tokens) = self.score_outcome(req).await?;
        Ok(pb::ScoreResponse {
            block_size: out.block_size,
            total_blocks: out.total_blocks,
            prompt_tokens: tokens as u32,
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
                })
                .collect(),
        })
    }
}

enum TextInput {
    Prompt(String),
    Chat(String),
}

impl TextInput {
    fn kind(&self) -> &'static str {
        match self {
            TextInput::Prompt(_) => "prompt",
            TextInput::Chat(_) => "chat",
        }
    }
}

impl KvIndexerService {
    /// Runs a scoring future inside its span, recording latency and outcome.
    pub(crate) async fn observed<T>(
        &self,
        kind: &'static str,
        span: tracing::Span,
        work: impl std::future::Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        let started = Instant::now();
        let result = tracing::Instrument::instrument(work, span.clone()).await;
        let code = result
            .as_ref()
            .map_or_else(ApiError::code, |_| tonic::Code::Ok);
        self.metrics.observe_score(kind, code, started.elapsed());
        span.in_scope(|| {
            tracing::debug!(
                ?code,
                elapsed_us = started.elapsed().as_micros() as u64,
                "score"
            )
        });
        result
    }
}

fn input_kind(input: &Option<pb::score_request::Input>) -> &'static str {
    match input {
        Some(pb::score_request::Input::TokenIds(_)) => "token_ids",
        Some(pb::score_request::Input::Prompt(_)) => "prompt",
        Some(pb::score_request::Input::ChatCompletionJson(_)) => "chat",
        None => "none",
    }
}

struct Tokenized {
    ids: Vec<u32>,
    rendered: Option<String>,
}

/// Proto3 strings are never absent: empty means "not set".
fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

fn require_model(model: &str) -> Result<(), ApiError> {
    if model.is_empty() {
        return Err(ApiError::MissingModel);
    }
    Ok(())
}

fn tier_to_pb(t: Tier) -> pb::Tier {
    match t {
        Tier::Gpu => pb::Tier::Gpu,
        Tier::Cpu => pb::Tier::Cpu,
        Tier::Storage => pb::Tier::Storage,
    }
}

#[tonic::async_trait]
impl KvIndexer for KvIndexerService {
    async fn score(
        &self,
        request: Request<pb::ScoreRequest>,
    ) -> Result<Response<pb::ScoreResponse>, Status> {
        let req = request.into_inner();
        let kind = input_kind(&req.input);
        let span = tracing::debug_span!(
            "score",
            model = %req.model,
            input = kind,
            tokens = tracing::field::Empty,
            blocks = tracing::field::Empty,
            best = tracing::field::Empty,
        );
        let result = self.observed(kind, span, self.score_inner(req)).await;
        result.map(Response::new).map_err(Status::from)
    }

    async fn list_pods(
        &self,
        request: Request<pb::ListPodsRequest>,
    ) -> Result<Response<pb::ListPodsResponse>, Status> {
        let req = request.into_inner();
        let pods = self
            .indexer
            .list_pods(non_empty(&req.model))
            .into_iter()
            .map(|p| pb::PodInfo {
                pod: p.pod,
                model: p.model,
                dp_rank: p.dp_rank,
                block_size: p.block_size,
                gpu_blocks: p.blocks_per_tier[Tier::Gpu.index()],
                cpu_blocks: p.blocks_per_tier[Tier::Cpu.index()],
                storage_blocks: p.blocks_per_tier[Tier::Storage.index()],
                last_seq: p.last_seq,
                batches: p.batches,
                events: p.events,
                seq_gaps: p.seq_gaps,
                last_event_age_seconds: p.last_event_age.map(|d| d.as_secs_f64()),
                stored_blocks: p.applied.stored_blocks,
                removed_blocks: p.applied.removed_blocks,
                clears: p.applied.clears,
                parent_unknown_blocks: p.applied.parent_unknown_blocks,
                unknown_removals: p.applied.unknown_removals,
                unkeyable_blocks: p.applied.unkeyable_blocks,
                non_full_attention_events: p.applied.non_full_attention_events,
                malformed_events: u64::from(p.skipped.malformed_events)
                    + p.applied.malformed_stores,
                unknown_event_types: u64::from(p.skipped.unknown_event_types),
                unknown_fields: u64::from(p.skipped.unknown_fields),
                engine_hash_checks: p.applied.engine_hash_checks,
                engine_hash_mismatches: p.applied.engine_hash_mismatches,
                key_mode: p.key_mode.into(),
                publisher_restarts: p.publisher_restarts,
                duplicate_batches: p.duplicate_batches,
            })
            .collect();
        Ok(Response::new(pb::ListPodsResponse { pods }))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let req = request.into_inner();
        require_model(&req.model)?;
        let input = match req.input {
            Some(pb::tokenize_request::Input::Prompt(text)) => TextInput::Prompt(text),
            Some(pb::tokenize_request::Input::ChatCompletionJson(body)) => TextInput::Chat(body),
            None => return Err(ApiError::MissingInput("`prompt` or `chat_completion_json`").into()),
        };
        let out = self
            .tokenize_input(&req.model, input, req.add_special_tokens)
            .await?;
        let block_size = self.indexer.model_block_size(&req.model);
        let keys = self.indexer.request_keys(
            &req.model,
            non_empty(&req.lora_name),
            non_empty(&req.cache_salt),
            &out.ids,
            block_size,
        );
        Ok(Response::new(pb::TokenizeResponse {
            token_ids: out.ids,
            block_size,
            block_keys: keys.into_iter().map(|k| k.0).collect(),
            rendered_prompt: out.rendered.unwrap_or_default(),
        }))
    }

    async fn lookup_blocks(
        &self,
        request: Request<pb::LookupBlocksRequest>,
    ) -> Result<Response<pb::LookupBlocksResponse>, Status> {
        let req = request.into_inner();
        let keys: Vec<BlockKey> = match req.input {
            Some(pb::lookup_blocks_request::Input::BlockKeys(k)) => {
                k.keys.into_iter().map(BlockKey).collect()
            }
            Some(pb::lookup_blocks_request::Input::TokenIds(t)) => {
                require_model(&req.model)?;
                let block_size = match req.block_size {
                    0 => self.indexer.model_block_size(&req.model),
                    bs => bs,
                };
                self.indexer.request_keys(
                    &req.model,
                    non_empty(&req.lora_name),
                    non_empty(&req.cache_salt),
                    &t.ids,
                    block_size,
                )
            }
            None => return Err(ApiError::MissingInput("`block_keys` or `token_ids`").into()),
        };
        let blocks = self
            .indexer
            .lookup(&keys)
            .into_iter()
            .map(|b| pb::BlockLocation {
                key: b.key.0,
                holders: b
                    .pods
                    .into_iter()
                    .map(|(pod, tiers)| pb::BlockHolder {
                        pod,
                        tiers: tiers.tiers().map(|t| tier_to_pb(t) as i32).collect(),
                    })
                    .collect(),
            })
            .collect();
        Ok(Response::new(pb::LookupBlocksResponse { blocks }))
    }
}

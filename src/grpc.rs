//! The `kvindexer.v1.KvIndexer` gRPC service over the core `Indexer`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use indexer::event::Tier;
use indexer::keys::BlockKey;
use indexer::{Indexer, ScoreQuery};
use tokenizer::chat::{ChatRequest, RenderBounds, TemplateCache};
use tokenizer::{Lookup, ModelTokenizer, Registry};
use tonic::{Request, Response, Status};

use crate::config::Limits;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::proto::kvindexer::v1 as pb;
use crate::ratelimit::RateLimited;
use pb::kv_indexer_server::KvIndexer;

pub struct KvIndexerService {
    indexer: Arc<Indexer>,
    tokenizers: Arc<Registry>,
    metrics: Arc<Metrics>,
    limits: Limits,
    /// Admission control: one permit per scoring request in flight, held
    /// until its tokenization and rendering have stopped (not merely until
    /// the client gave up), so the limit bounds CPU work.
    inflight: Arc<Semaphore>,
    /// `--admin`: write RPCs other than the router's are served, through
    /// the pods' ingest workers (their single writers).
    admin: Option<crate::ingest::Control>,
    /// `--allow-request-chat-template`: a request's `chat_template` is a
    /// program from the client, run only if the operator says so.
    allow_request_chat_template: bool,
    /// Compiled request templates (bounded, see `TemplateCache`).
    templates: Arc<TemplateCache>,
    /// Requests for models with no tokenizer to be had: one line per 10 s.
    unknown_models: RateLimited,
}

/// When a request stops being worth answering (`grpc-timeout`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline(Option<Instant>);

/// How much earlier than the client's `grpc-timeout` we stop: tonic's
/// transport also enforces that header, and when its timer wins the client
/// hears CANCELLED ("Timeout expired") instead of DEADLINE_EXCEEDED.
/// Stopping a little earlier ourselves gives the right code and message.
const DEADLINE_MARGIN: Duration = Duration::from_millis(20);

impl Deadline {
    /// Fails if the deadline has passed: work that cannot be used is not started.
    fn check(self, before: &'static str) -> Result<(), ApiError> {
        match self.0 {
            Some(d) if Instant::now() >= d => Err(ApiError::DeadlineExceeded(before)),
            _ => Ok(()),
        }
    }
}

/// `grpc-timeout`: digits then H, M, S, m (ms), u (us) or n (ns).
fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

impl KvIndexerService {
    pub fn new(
        indexer: Arc<Indexer>,
        tokenizers: Arc<Registry>,
        metrics: Arc<Metrics>,
        limits: Limits,
        allow_request_chat_template: bool,
    ) -> Self {
        KvIndexerService {
            indexer,
            tokenizers,
            metrics,
            inflight: Arc::new(Semaphore::new(limits.max_inflight)),
            limits,
            admin: None,
            allow_request_chat_template,
            templates: Arc::new(TemplateCache::default()),
            unknown_models: RateLimited::new(Duration::from_secs(10)),
        }
    }

    /// Serves admin RPCs (`RemovePod`). Off by default: the gRPC port is
    /// unauthenticated, and a client that can remove pods can blind the
    /// router.
    pub fn with_admin(mut self, admin: Option<crate::ingest::Control>) -> Self {
        self.admin = admin;
        self
    }

    fn require_admin(&self, rpc: &str) -> Result<&crate::ingest::Control, Status> {
        if let Some(control) = &self.admin {
            return Ok(control);
        }
        Err(Status::permission_denied(format!(
            "{rpc} is an admin RPC, off unless the service runs with --admin"
        )))
    }

    /// Admits a scoring request or refuses it at once: under overload the
    /// answer is RESOURCE_EXHAUSTED now, not a queue that grows. Event
    /// ingestion runs on its own threads and is never slowed by queries.
    pub(crate) fn admit(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<(OwnedSemaphorePermit, Deadline), ApiError> {
        let permit = self.inflight.clone().try_acquire_owned().map_err(|_| {
            self.metrics.rejected_overload.inc();
            ApiError::Overloaded(self.limits.max_inflight)
        })?;
        let deadline = metadata
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
            .map(|d| Instant::now() + d.saturating_sub(DEADLINE_MARGIN.min(d / 10)));
        Ok((permit, Deadline(deadline)))
    }

    fn check_tokens(&self, n: usize) -> Result<(), ApiError> {
        if n > self.limits.max_prompt_tokens {
            return Err(ApiError::TooLarge {
                what: "the prompt's token count",
                got: n,
                limit: self.limits.max_prompt_tokens,
                flag: "max-prompt-tokens",
            });
        }
        Ok(())
    }

    /// The tokenizer of `model`, if it may have one (configured, or
    /// published by some pod: see `tokenizer::Registry`). A first use
    /// waits for the load, asynchronously and no longer than the deadline.
    async fn tokenizer_for(
        &self,
        model: &str,
        deadline: Deadline,
    ) -> Result<Arc<ModelTokenizer>, ApiError> {
        let pending = match self.tokenizers.get(model, || self.indexer.has_model(model)) {
            Lookup::Ready(t) => return Ok(t),
            Lookup::Failed(e) => return Err(e.into()),
            Lookup::Unknown => {
                self.unknown_models.warn(|suppressed| {
                    tracing::info!(
                        model = ?shorten(model),
                        suppressed,
                        "request for a model neither configured nor published by any pod: \
                         not tokenized (Score answers 0, Tokenize NOT_FOUND)"
                    )
                });
                return Err(ApiError::UnknownModel(shorten(model).to_owned()));
            }
            Lookup::Pending(p) => p,
        };
        match deadline.0 {
            None => Ok(pending.wait().await?),
            Some(d) => tokio::time::timeout_at(d.into(), pending.wait())
                .await
                .map_err(|_| ApiError::DeadlineExceeded("the model's tokenizer finished loading"))?
                .map_err(ApiError::from),
        }
    }

    /// Tokenizes text or chat input with the model's tokenizer (LoRA
    /// requests use the base model's), off the async executor: a long
    /// prompt takes milliseconds, a chat template runs up to its bounds.
    /// `permit` goes into the blocking work and comes back with its result:
    /// a client that gives up does not free its `--max-inflight` place
    /// while its render still runs.
    async fn tokenize_input(
        &self,
        model: &str,
        input: TextInput,
        add_special_tokens: Option<bool>,
        deadline: Deadline,
        permit: OwnedSemaphorePermit,
    ) -> Result<(Tokenized, OwnedSemaphorePermit), ApiError> {
        let bytes = match &input {
            TextInput::Prompt(t) | TextInput::Chat(t) => t.len(),
        };
        if bytes > self.limits.max_prompt_bytes {
            return Err(ApiError::TooLarge {
                what: "the prompt's size in bytes",
                got: bytes,
                limit: self.limits.max_prompt_bytes,
                flag: "max-prompt",
            });
        }
        deadline.check("tokenization")?;
        let tok = self.tokenizer_for(model, deadline).await?;
        let kind = input.kind();
        let started = Instant::now();
        let bounds = RenderBounds {
            max_output_bytes: self.limits.max_prompt_bytes,
            deadline: deadline.0,
        };
        let allow_template = self.allow_request_chat_template;
        let templates = self.templates.clone();
        let (out, permit) = tokio::task::spawn_blocking(move || {
            let out = (|| -> Result<Tokenized, ApiError> {
                match input {
                    TextInput::Prompt(text) => Ok(Tokenized {
                        ids: tok.encode(&text, add_special_tokens.unwrap_or(true))?,
                        rendered: None,
                    }),
                    TextInput::Chat(body) => {
                        let req = ChatRequest::parse(&body)?;
                        let request_template = match &req.chat_template {
                            None => None,
                            Some(_) if !allow_template => {
                                return Err(ApiError::RequestTemplateRefused)
                            }
                            Some(source) => Some(templates.get(source)?),
                        };
                        let rendered =
                            tok.render_chat(&req, request_template.as_deref(), &bounds)?;
                        // vLLM tokenizes rendered chats without adding specials.
                        let ids = tok.encode(&rendered, add_special_tokens.unwrap_or(false))?;
                        Ok(Tokenized {
                            ids,
                            rendered: Some(rendered),
                        })
                    }
                }
            })();
            (out, permit)
        })
        .await
        .map_err(|e| {
            if e.is_panic() {
                self.metrics.handler_panics.inc();
            }
            ApiError::Internal(format!("tokenization task failed: {e}"))
        })?;
        self.metrics.observe_tokenize(kind, started.elapsed());
        let out = out?;
        self.check_tokens(out.ids.len())?;
        Ok((out, permit))
    }

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
    ) -> Result<(indexer::ScoreOutcome, usize), ApiError> {
        require_model(&req.model)?;
        if req.pods.len() > self.limits.max_candidate_pods {
            return Err(ApiError::TooLarge {
                what: "the number of candidate pods",
                got: req.pods.len(),
                limit: self.limits.max_candidate_pods,
                flag: "max-candidate-pods",
            });
        }
        let text = match req.input {
            Some(pb::score_request::Input::TokenIds(t)) => {
                self.check_tokens(t.ids.len())?;
                Err(t.ids)
            }
            Some(pb::score_request::Input::Prompt(text)) => Ok(TextInput::Prompt(text)),
            Some(pb::score_request::Input::ChatCompletionJson(body)) => Ok(TextInput::Chat(body)),
            None => {
                return Err(ApiError::MissingInput(
                    "`prompt`, `token_ids` or `chat_completion_json`",
                ))
            }
        };
        // Held to the end of scoring (the tokenization hands it back).
        let (tokens, _permit) = match text {
            Err(ids) => (ids, Some(permit)),
            Ok(input) => match self
                .tokenize_input(&req.model, input, req.add_special_tokens, deadline, permit)
                .await
            {
                Ok((t, permit)) => (t.ids, Some(permit)),
                Err(ApiError::UnknownModel(_)) => (Vec::new(), None),
                Err(e) => return Err(e),
            },
        };
        deadline.check("scoring")?;
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

    async fn score_inner(
        &self,
        req: pb::ScoreRequest,
        permit: OwnedSemaphorePermit,
        deadline: Deadline,
    ) -> Result<pb::ScoreResponse, ApiError> {
        let (out, tokens) = self.score_outcome(req, permit, deadline).await?;
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
                    incomplete: p.incomplete,
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
    /// Runs a scoring future inside its span, recording latency and
    /// outcome. A panic in the work becomes INTERNAL (and is counted): one
    /// bad request never takes the server down.
    pub(crate) async fn observed<T>(
        &self,
        kind: &'static str,
        span: tracing::Span,
        work: impl std::future::Future<Output = Result<T, ApiError>>,
    ) -> Result<T, ApiError> {
        let started = Instant::now();
        let result = tracing::Instrument::instrument(
            std::panic::AssertUnwindSafe(work).catch_unwind(),
            span.clone(),
        )
        .await
        .unwrap_or_else(|panic| {
            self.metrics.handler_panics.inc();
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(panic = %what, "request handler panicked");
            Err(ApiError::Internal("the request handler panicked".into()))
        });
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

/// A client's string, cut for logs and messages (a model name can be as
/// long as the message limit).
fn shorten(s: &str) -> &str {
    const MAX: usize = 256;
    if s.len() <= MAX {
        return s;
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
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
        let admitted = self.admit(request.metadata());
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
        let work = async move {
            let (permit, deadline) = admitted?;
            self.score_inner(req, permit, deadline).await
        };
        let result = self.observed(kind, span, work).await;
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
                unrecovered_batches: p.unrecovered_batches,
                incomplete: p.incomplete,
                connection: match p.connection {
                    indexer::Connection::Connected => "connected",
                    indexer::Connection::Disconnected => "disconnected",
                    indexer::Connection::Unknown => "unknown",
                }
                .into(),
            })
            .collect();
        Ok(Response::new(pb::ListPodsResponse { pods }))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let (permit, deadline) = self.admit(request.metadata())?;
        let req = request.into_inner();
        require_model(&req.model)?;
        let input = match req.input {
            Some(pb::tokenize_request::Input::Prompt(text)) => TextInput::Prompt(text),
            Some(pb::tokenize_request::Input::ChatCompletionJson(body)) => TextInput::Chat(body),
            None => return Err(ApiError::MissingInput("`prompt` or `chat_completion_json`").into()),
        };
        // A model with no tokenizer: NOT_FOUND (the answer is the tokens).
        let (out, _permit) = self
            .tokenize_input(&req.model, input, req.add_special_tokens, deadline, permit)
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

    async fn remove_pod(
        &self,
        request: Request<pb::RemovePodRequest>,
    ) -> Result<Response<pb::RemovePodResponse>, Status> {
        let control = self.require_admin("RemovePod")?.clone();
        let req = request.into_inner();
        require_model(&req.model)?;
        let (domains, removed_blocks) = control.remove_pod(&req.model, &req.pod).await;
        tracing::info!(model = %req.model, pod = %req.pod, domains, removed_blocks, "pod removed by admin");
        Ok(Response::new(pb::RemovePodResponse {
            removed: domains > 0,
            removed_blocks,
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
                self.check_tokens(t.ids.len())?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn service(max_inflight: usize) -> KvIndexerService {
        KvIndexerService::new(
            Arc::new(Indexer::new(Default::default())),
            Arc::new(Registry::new(Default::default(), 1 << 20)),
            Arc::new(Metrics::new()),
            Limits {
                max_message_bytes: 1 << 20,
                max_prompt_bytes: 1 << 20,
                max_prompt_tokens: 1 << 20,
                max_candidate_pods: 16,
                max_inflight,
            },
            false,
        )
    }

    #[test]
    fn grpc_timeouts_parse() {
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("5u"), Some(Duration::from_micros(5)));
        assert_eq!(parse_grpc_timeout("x"), None);
        assert_eq!(parse_grpc_timeout(""), None);
        assert_eq!(parse_grpc_timeout("10Q"), None);
    }

    #[tokio::test]
    async fn a_panicking_handler_answers_internal_and_is_counted() {
        let svc = service(4);
        let work = async { panic!("boom") };
        let result: Result<(), ApiError> =
            svc.observed("token_ids", tracing::Span::none(), work).await;
        assert_eq!(result.unwrap_err().code(), tonic::Code::Internal);
        assert_eq!(svc.metrics.handler_panics.get(), 1);
    }

    #[tokio::test]
    async fn expired_deadlines_stop_work_before_it_starts() {
        let svc = service(4);
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert("grpc-timeout", "50m".parse().unwrap());
        let (_permit, deadline) = svc.admit(&md).unwrap();
        assert!(deadline.0.is_some());
        assert!(deadline.check("anything").is_ok());
        let past = Deadline(Some(Instant::now() - Duration::from_millis(1)));
        let req = pb::ScoreRequest {
            model: "m".into(),
            input: Some(pb::score_request::Input::Prompt("hi".into())),
            ..Default::default()
        };
        let permit = || svc.admit(&md).unwrap().0;
        let err = svc
            .score_outcome(req.clone(), permit(), past)
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
        assert!(err.to_string().contains("tokenization"), "{err}");
        let ids = pb::ScoreRequest {
            input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                ids: vec![1; 32],
            })),
            ..req
        };
        let err = svc
            .score_outcome(ids.clone(), permit(), past)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("scoring"), "{err}");
        assert!(svc
            .score_outcome(ids, permit(), Deadline(None))
            .await
            .is_ok());
    }

    #[test]
    fn admission_refuses_beyond_the_limit_and_frees_permits() {
        let svc = service(1);
        let md = tonic::metadata::MetadataMap::new();
        let first = svc.admit(&md).unwrap();
        let refused = svc.admit(&md).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        drop(first);
        assert!(svc.admit(&md).is_ok());
        assert_eq!(svc.metrics.rejected_overload.get(), 1);
    }
}

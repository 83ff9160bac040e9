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
use crate::feedback::{Feedback, PromptHandle};
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
    /// Routing feedback (`RecordRouting`, prompt handles, approximate
    /// models) and the way to the pods' writers; `None` in unit tests.
    feedback: Option<(Arc<Feedback>, crate::ingest::Control)>,
}

/// When a request stops being worth answering (`grpc-timeout`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline(Option<Instant>);

/// How much earlier than the client's `grpc-timeout` we stop, at most (a
/// tenth of the timeout below 1 s): tonic's transport also enforces that
/// header, and when its timer wins the client hears CANCELLED ("Timeout
/// expired") instead of DEADLINE_EXCEEDED and what we were waiting for.
/// Our answer must beat that timer by the time the runtime takes to wake
/// the waiting task and write the reply: 20 ms lost that race when the
/// machine was busy (32 waiters at once on 2 loaded cores, in a test).
const DEADLINE_MARGIN: Duration = Duration::from_millis(100);

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
            feedback: None,
        }
    }

    /// Serves `RecordRouting` and `Diagnose`, keeps prompt handles, answers
    /// approximate models from routing history.
    pub fn with_feedback(
        mut self,
        feedback: Arc<Feedback>,
        control: crate::ingest::Control,
    ) -> Self {
        self.feedback = Some((feedback, control));
        self
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

    /// A prompt's tokens: token ids as given, text and chat tokenized.
    /// `Unknown`: a text prompt for a model with no tokenizer to be had
    /// (the text is handed back for approximate models' byte chunking).
    async fn prompt_tokens(
        &self,
        model: &str,
        input: PromptInput,
        add_special_tokens: Option<bool>,
        deadline: Deadline,
        permit: OwnedSemaphorePermit,
    ) -> Result<(PromptTokens, Option<OwnedSemaphorePermit>), ApiError> {
        let text = match input {
            PromptInput::TokenIds(ids) => {
                self.check_tokens(ids.len())?;
                return Ok((PromptTokens::Ids(ids), Some(permit)));
            }
            PromptInput::Text(text) => text,
        };
        let approximate = self.approximate(model);
        let fallback = approximate.then(|| text.text().to_owned());
        match self
            .tokenize_input(model, text, add_special_tokens, deadline, permit)
            .await
        {
            Ok((t, permit)) => Ok((PromptTokens::Ids(t.ids), Some(permit))),
            Err(ApiError::UnknownModel(_)) => Ok((PromptTokens::Unknown(fallback), None)),
            Err(ApiError::TokenizerNotFound(_)) if approximate => {
                Ok((PromptTokens::Unknown(fallback), None))
            }
            Err(e) => Err(e),
        }
    }

    /// Whether `model` is answered from routing history.
    fn approximate(&self, model: &str) -> bool {
        self.feedback
            .as_ref()
            .is_some_and(|(f, _)| f.approximate.serves(model))
    }

    fn check_candidates(&self, n: usize) -> Result<(), ApiError> {
        if n > self.limits.max_candidate_pods {
            return Err(ApiError::TooLarge {
                what: "the number of candidate pods",
                got: n,
                limit: self.limits.max_candidate_pods,
                flag: "max-candidate-pods",
            });
        }
        Ok(())
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
    ) -> Result<(indexer::ScoreOutcome, Scored), ApiError> {
        require_model(&req.model)?;
        self.check_candidates(req.pods.len())?;
        let input = PromptInput::from_score(req.input)?;
        // Held to the end of scoring (the tokenization hands it back).
        let (tokens, _permit) = self
            .prompt_tokens(&req.model, input, req.add_special_tokens, deadline, permit)
            .await?;
        deadline.check("scoring")?;
        let approximate = self.approximate(&req.model);
        let lora_name = non_empty(&req.lora_name);
        let cache_salt = non_empty(&req.cache_salt);
        let (out, tokens) = match tokens {
            PromptTokens::Ids(tokens) if approximate => {
                let bs = self.indexer.model_block_size(&req.model);
                let keys = self
                    .indexer
                    .request_keys(&req.model, lora_name, cache_salt, &tokens, bs);
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
    fn approximate_outcome(
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
            })
            .collect();
        scores.sort_by(|a, b| b.score.total_cmp(&a.score).then_with(|| a.pod.cmp(&b.pod)));
        indexer::ScoreOutcome {
            block_size,
            total_blocks: total,
            pods: scores,
            keys: vec![(block_size, keys)],
        }
    }

    async fn score_inner(
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
                feedback.handles.insert(PromptHandle {
                    model,
                    keys: std::mem::take(&mut out.keys)
                        .into_iter()
                        .map(|(bs, k)| (bs, Arc::from(k)))
                        .collect(),
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
                })
                .collect(),
            prompt_handle,
            approximate: scored.approximate,
        })
    }

    /// `RecordRouting`: the prompt's keys for the pod's block size (from a
    /// handle, or computed as `Score` does), recorded by the pod's writer.
    async fn record_inner(
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
        let block_size = self.indexer.block_size_of(&req.model, &req.pod);
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
                    handle
                        .keys
                        .iter()
                        .find(|(bs, _)| *bs == block_size)
                        .cloned()
                }
                .ok_or(ApiError::HandleBlockSize(block_size))?;
                (keys, handle.tokens.clone(), bs)
            }
            input => {
                let input = PromptInput::from_record(input)?;
                let (tokens, _permit) = self
                    .prompt_tokens(&req.model, input, req.add_special_tokens, deadline, permit)
                    .await?;
                let (lora, salt) = (non_empty(&req.lora_name), non_empty(&req.cache_salt));
                match tokens {
                    PromptTokens::Ids(mut tokens) => {
                        let bs = if approximate {
                            self.indexer.model_block_size(&req.model)
                        } else {
                            block_size
                        };
                        let keys = self
                            .indexer
                            .request_keys(&req.model, lora, salt, &tokens, bs);
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

/// Longest pod name `RecordRouting` accepts.
const MAX_POD_NAME: usize = 256;

/// What `Score` tokenized, for its response and prompt handle.
#[derive(Debug)]
pub(crate) struct Scored {
    pub tokens: Vec<u32>,
    pub approximate: bool,
}

/// A prompt as either RPC carries it.
enum PromptInput {
    TokenIds(Vec<u32>),
    Text(TextInput),
}

impl PromptInput {
    fn from_score(input: Option<pb::score_request::Input>) -> Result<PromptInput, ApiError> {
        use pb::score_request::Input;
        Ok(match input {
            Some(Input::TokenIds(t)) => PromptInput::TokenIds(t.ids),
            Some(Input::Prompt(text)) => PromptInput::Text(TextInput::Prompt(text)),
            Some(Input::ChatCompletionJson(body)) => PromptInput::Text(TextInput::Chat(body)),
            None => {
                return Err(ApiError::MissingInput(
                    "`prompt`, `token_ids` or `chat_completion_json`",
                ))
            }
        })
    }

    fn from_record(
        input: Option<pb::record_routing_request::Input>,
    ) -> Result<PromptInput, ApiError> {
        use pb::record_routing_request::Input;
        Ok(match input {
            Some(Input::TokenIds(t)) => PromptInput::TokenIds(t.ids),
            Some(Input::Prompt(text)) => PromptInput::Text(TextInput::Prompt(text)),
            Some(Input::ChatCompletionJson(body)) => PromptInput::Text(TextInput::Chat(body)),
            Some(Input::PromptHandle(_)) | None => {
                return Err(ApiError::MissingInput(
                    "`prompt_handle`, `prompt`, `token_ids` or `chat_completion_json`",
                ))
            }
        })
    }
}

enum PromptTokens {
    Ids(Vec<u32>),
    /// No tokenizer for the model; the text, for approximate models.
    Unknown(Option<String>),
}

enum TextInput {
    Prompt(String),
    Chat(String),
}

impl TextInput {
    fn text(&self) -> &str {
        match self {
            TextInput::Prompt(t) | TextInput::Chat(t) => t,
        }
    }

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

    async fn record_routing(
        &self,
        request: Request<pb::RecordRoutingRequest>,
    ) -> Result<Response<pb::RecordRoutingResponse>, Status> {
        let admitted = self.admit(request.metadata());
        let req = request.into_inner();
        let (permit, deadline) = admitted.map_err(Status::from)?;
        let work = std::panic::AssertUnwindSafe(self.record_inner(req, permit, deadline));
        match work.catch_unwind().await {
            Ok(result) => result.map(Response::new).map_err(Status::from),
            Err(_) => {
                self.metrics.handler_panics.inc();
                tracing::error!("RecordRouting handler panicked");
                Err(Status::internal("the request handler panicked"))
            }
        }
    }

    async fn diagnose(
        &self,
        request: Request<pb::DiagnoseRequest>,
    ) -> Result<Response<pb::DiagnoseResponse>, Status> {
        let req = request.into_inner();
        let Some((feedback, _)) = &self.feedback else {
            return Ok(Response::new(pb::DiagnoseResponse::default()));
        };
        let mismatches = feedback
            .mismatches(non_empty(&req.model))
            .into_iter()
            .map(|d| {
                let m = d.mismatch;
                pb::RoutingMismatch {
                    model: d.model,
                    pod: d.pod,
                    cause: m.cause.label().into(),
                    fix: m.cause.fix().into(),
                    block: m.block as u32,
                    offset: m.offset as u32,
                    window_start: m.window_start as u32,
                    our_tokens: m.ours,
                    pod_tokens: m.theirs,
                    our_block_size: m.our_block_size,
                    pod_block_size: m.their_block_size,
                    age_seconds: d.at.elapsed().as_secs_f64(),
                }
            })
            .collect();
        Ok(Response::new(pb::DiagnoseResponse { mismatches }))
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
                offload_block_size: p.offload_block_size,
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

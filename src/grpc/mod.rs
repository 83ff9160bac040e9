//! The `kvindexer.v1.KvIndexer` gRPC service over the core `Indexer`.
//!
//! Here: the service, its construction and the RPCs, each a thin layer over
//! its rooms: `admission` (in-flight limit, deadline, size limits,
//! observation), `prompt` (a request's prompt to token ids) and `answers`
//! (Score and RecordRouting).

mod admission;
mod answers;
mod prompt;
mod rendered;

pub(crate) use admission::Deadline;
use answers::*;
use prompt::*;
use rendered::*;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use indexer::event::Tier;
use indexer::keys::multimodal::MmItem;
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

/// A `Score` request carrying this metadata key (any value) gets its
/// handler's time back in `TIMING_RESPONSE`: a client can tell, request by
/// request, how much of what it waited was the service's work (from the
/// decoded request to the answer) and how much the transport, the decoding
/// and waiting for a CPU.
pub const TIMING_REQUEST: &str = "kv-indexer-timing";
/// Microseconds from the handler's start to its answer.
pub const TIMING_RESPONSE: &str = "kv-indexer-handler-us";

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
    /// Accepted routings to the other replicas (`--peer`).
    forwarder: Option<Arc<crate::peer::forward::Forwarder>>,
    /// Models' vLLM render servers (`--render-url`), for chats with media.
    render: crate::render::RenderServers,
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
            forwarder: None,
            render: crate::render::RenderServers::default(),
        }
    }

    /// Renders chats with image, audio or video parts on the models' render
    /// servers (`--render-url`).
    pub fn with_render(mut self, render: crate::render::RenderServers) -> Self {
        self.render = render;
        self
    }

    /// Forwards accepted routings to the other replicas.
    pub fn with_forwarder(
        mut self,
        forwarder: Option<Arc<crate::peer::forward::Forwarder>>,
    ) -> Self {
        self.forwarder = forwarder;
        self
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
}

#[tonic::async_trait]
impl KvIndexer for KvIndexerService {
    async fn score(
        &self,
        request: Request<pb::ScoreRequest>,
    ) -> Result<Response<pb::ScoreResponse>, Status> {
        let started = std::time::Instant::now();
        let timed = request.metadata().contains_key(TIMING_REQUEST);
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
        let mut response = result.map(Response::new).map_err(Status::from)?;
        if timed {
            let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            response.metadata_mut().insert(TIMING_RESPONSE, us.into());
        }
        Ok(response)
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
                engine: p.engine.into(),
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
            &[],
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
            Some(pb::lookup_blocks_request::Input::BlockKeys(_)) if !req.mm_items.is_empty() => {
                return Err(ApiError::BadMultimodal(
                    "mm_items go with token_ids: block_keys are keyed already".into(),
                )
                .into())
            }
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
                let mm = self.mm_items(req.mm_items, &t.ids)?;
                self.indexer.request_keys(
                    &req.model,
                    non_empty(&req.lora_name),
                    non_empty(&req.cache_salt),
                    &t.ids,
                    block_size,
                    &mm,
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
    use super::admission::parse_grpc_timeout;
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

//! llm-d's indexer API (`indexer.v1.IndexerService`), so an llm-d
//! deployment can point at this service unchanged.
//!
//! `GetPodScores` tokenizes `prompt` like a completions prompt (special
//! tokens added) and scores it exactly like `kvindexer.v1.KvIndexer/Score`.
//! Each score is what llm-d's longest-prefix scorer computes: the sum, over
//! the pod's consecutive leading blocks held, of the best tier's weight
//! (`--tier-weight`, GPU 1.0, CPU 0.8, storage 0.5 by default), i.e.
//! `score = Σ_{i < matched_blocks} max_{tier holding block i} weight(tier)`,
//! not normalised. Every candidate is returned (all pods of the model when
//! `pod_identifiers` is empty), best first.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::grpc::KvIndexerService;
use crate::proto::kvindexer::v1 as pb;
use crate::proto::llmd::v1 as llmd;

pub struct LlmdIndexerService {
    inner: Arc<KvIndexerService>,
}

impl LlmdIndexerService {
    pub fn new(inner: Arc<KvIndexerService>) -> Self {
        LlmdIndexerService { inner }
    }
}

#[tonic::async_trait]
impl llmd::indexer_service_server::IndexerService for LlmdIndexerService {
    async fn get_pod_scores(
        &self,
        request: Request<llmd::GetPodScoresRequest>,
    ) -> Result<Response<llmd::GetPodScoresResponse>, Status> {
        let admitted = self.inner.admit(request.metadata());
        let req = request.into_inner();
        let span = tracing::debug_span!(
            "score",
            api = "llm-d",
            model = %req.model_name,
            input = "prompt",
            tokens = tracing::field::Empty,
            blocks = tracing::field::Empty,
            best = tracing::field::Empty,
        );
        let score = pb::ScoreRequest {
            model: req.model_name,
            input: Some(pb::score_request::Input::Prompt(req.prompt)),
            pods: req.pod_identifiers,
            ..Default::default()
        };
        let work = async move {
            let (permit, deadline) = admitted?;
            self.inner.score_outcome(score, permit, deadline).await
        };
        let (out, _) = self.inner.observed("prompt", span, work).await?;
        let mut scores: Vec<llmd::PodScore> = out
            .pods
            .into_iter()
            .map(|p| llmd::PodScore {
                pod: p.pod,
                score: p.matched.weighted_blocks,
            })
            .collect();
        scores.sort_by(|a, b| b.score.total_cmp(&a.score).then_with(|| a.pod.cmp(&b.pod)));
        Ok(Response::new(llmd::GetPodScoresResponse { scores }))
    }
}

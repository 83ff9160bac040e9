//! llm-d's `indexer.v1.IndexerService/GetPodScores`, with a client generated
//! from that proto: same answers as our Score, in llm-d's score units.

use crate::common::*;
use kv_indexer::proto::llmd::v1 as llmd;
use llmd::indexer_service_client::IndexerServiceClient;

#[tokio::test]
async fn llmd_get_pod_scores_answers_like_llmds_longest_prefix_scorer() {
    let tok = qwen3_tokenizer_arg();
    let args = ["--tokenizer", &tok, "--tier-weight", "gpu=0.9"];
    let (service, expected, _publisher) = serve_recorded("qwen3-lora-salt", &args).await;

    let mut client = IndexerServiceClient::connect(format!("http://{}", service.grpc_addr()))
        .await
        .expect("connect");
    for probe in expected
        .probes
        .iter()
        .filter(|p| p.lora_name.is_none() && p.cache_salt.is_none())
    {
        let resp = client
            .get_pod_scores(llmd::GetPodScoresRequest {
                prompt: probe.text.clone().unwrap(),
                model_name: expected.model.clone(),
                pod_identifiers: vec![],
            })
            .await
            .expect("GetPodScores")
            .into_inner();
        // Score = sum of the best tier's weight over consecutive blocks held
        // (all GPU here, weight 0.9).
        for (pod, blocks) in &probe.expected {
            let got = resp
                .scores
                .iter()
                .find(|s| &s.pod == pod)
                .map_or(0.0, |s| s.score);
            assert!(
                (got - 0.9 * f64::from(*blocks)).abs() < 1e-9,
                "{} {pod}: {got}",
                probe.id
            );
        }
        assert!(resp.scores.windows(2).all(|w| w[0].score >= w[1].score));
    }
    // Candidate filter.
    let resp = client
        .get_pod_scores(llmd::GetPodScoresRequest {
            prompt: expected.probes[0].text.clone().unwrap(),
            model_name: expected.model.clone(),
            pod_identifiers: vec!["pod-0".into()],
        })
        .await
        .expect("GetPodScores")
        .into_inner();
    assert_eq!(resp.scores.len(), 1);
    assert_eq!(resp.scores[0].pod, "pod-0");
    // Errors keep their codes.
    let err = client
        .get_pod_scores(llmd::GetPodScoresRequest::default())
        .await
        .expect_err("no model");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
}

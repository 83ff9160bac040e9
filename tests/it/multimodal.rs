//! Prompts with images: vLLM 0.33's own `KVCacheManager` served requests
//! carrying `mm_features` (`tests/fixtures/vllm-events/gen_multimodal.py`),
//! its publisher's frames go over real ZeroMQ, and `Score`, `LookupBlocks`
//! and `RecordRouting` take the items beside the token ids over real gRPC.

use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;

const STREAM: &str = "qwen3-multimodal";

/// Every probe with its items scores what vLLM's pods hold, never more:
/// an image inside one block, over several, two in one block, the same
/// image twice and moved, identical placeholder ids for different images,
/// an image in a cached prefix with a new one after it, under LoRA and a
/// cache salt; the same ids without the items, or with another image,
/// match up to the first block an image touches, as in vLLM.
#[tokio::test]
async fn multimodal_prompts_score_what_vllm_holds() {
    let (service, expected, _publisher) = serve_recorded(STREAM, &[]).await;
    assert!(expected.probes.iter().any(|p| p.mm_items.len() >= 2));
    check_probes(&service, &expected).await;
}

/// The render server's answer, passed as it is, scores as its token ids
/// and items do (vLLM's own `GenerateRequest` made each body).
#[tokio::test]
async fn the_render_servers_body_scores_as_it_is() {
    let (service, expected, _publisher) = serve_recorded(STREAM, &[]).await;
    let mut client = service.client().await;
    let mut bodies = 0;
    for probe in &expected.probes {
        let Some(body) = &probe.generate_request_json else {
            continue;
        };
        bodies += 1;
        let resp = client
            .score(pb::ScoreRequest {
                model: expected.model.clone(),
                input: Some(pb::score_request::Input::GenerateRequestJson(body.clone())),
                // The adapter is named by the model a router asks for, not
                // in the body: given beside it. The salt is the body's.
                lora_name: probe.lora_name.clone().unwrap_or_default(),
                ..Default::default()
            })
            .await
            .expect("Score")
            .into_inner();
        assert_matches(&resp, probe);
    }
    assert_eq!(bodies, expected.probes.len());
    // Items both in the body and beside it: refused, never merged.
    let probe = &expected.probes[0];
    let both = pb::ScoreRequest {
        model: expected.model.clone(),
        input: Some(pb::score_request::Input::GenerateRequestJson(
            probe.generate_request_json.clone().unwrap(),
        )),
        mm_items: probe.mm_items.clone(),
        ..Default::default()
    };
    let bad_json = pb::ScoreRequest {
        model: expected.model.clone(),
        input: Some(pb::score_request::Input::GenerateRequestJson(
            "{\"token_ids\": 1}".into(),
        )),
        ..Default::default()
    };
    assert_score_errors(
        &mut client,
        [
            (both, tonic::Code::InvalidArgument, "one or the other"),
            (
                bad_json,
                tonic::Code::InvalidArgument,
                "generate_request_json",
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn lookup_and_record_routing_key_the_items_as_score_does() {
    let (service, expected, _publisher) = serve_recorded(STREAM, &[]).await;
    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "spanning:-:-")
        .expect("probe");
    let mut client = service.client().await;
    let looked_up = client
        .lookup_blocks(pb::LookupBlocksRequest {
            model: expected.model.clone(),
            input: Some(pb::lookup_blocks_request::Input::TokenIds(pb::TokenIds {
                ids: probe.token_ids.clone(),
            })),
            mm_items: probe.mm_items.clone(),
            ..Default::default()
        })
        .await
        .expect("LookupBlocks")
        .into_inner();
    let held = looked_up
        .blocks
        .iter()
        .take_while(|b| b.holders.iter().any(|h| h.pod == "pod-0"))
        .count() as u32;
    assert_eq!(held, probe.expected["pod-0"]);
    // A routing of the prompt with a new image after it, to pod-1: its
    // speculative blocks reach past what pod-1 holds, keyed with the items.
    let next = expected
        .probes
        .iter()
        .find(|p| p.id == "prefix-then-new:-:tenant-a")
        .expect("probe");
    let recorded = client
        .record_routing(pb::RecordRoutingRequest {
            model: expected.model.clone(),
            input: Some(pb::record_routing_request::Input::TokenIds(pb::TokenIds {
                ids: next.token_ids.clone(),
            })),
            pod: "pod-0".into(),
            cache_salt: "tenant-a".into(),
            mm_items: next.mm_items.clone(),
            ..Default::default()
        })
        .await
        .expect("RecordRouting")
        .into_inner();
    assert_eq!(recorded.total_blocks, (next.token_ids.len() / 16) as u32);
    let scored = client
        .score(token_request(&expected.model, next))
        .await
        .expect("Score")
        .into_inner();
    let pod0 = scored
        .pods
        .iter()
        .find(|p| p.pod == "pod-0")
        .expect("pod-0");
    assert_eq!(pod0.speculative_blocks, recorded.total_blocks, "{scored:?}");
    // Without the items the same ids are another prompt: nothing speculative.
    let mut bare = token_request(&expected.model, next);
    bare.mm_items.clear();
    let scored = client.score(bare).await.expect("Score").into_inner();
    let pod0 = scored.pods.iter().find(|p| p.pod == "pod-0");
    assert!(
        pod0.is_none_or(|p| p.speculative_blocks < recorded.total_blocks),
        "{scored:?}"
    );
}

#[tokio::test]
async fn items_that_cannot_be_keyed_are_refused_with_the_reason() {
    let (service, expected, _publisher) = serve_recorded(STREAM, &[]).await;
    let probe = expected
        .probes
        .iter()
        .find(|p| p.id == "two-in-one:-:-")
        .expect("probe");
    let with_items = |items: Vec<pb::MultimodalItem>| pb::ScoreRequest {
        mm_items: items,
        ..token_request(&expected.model, probe)
    };
    let item = |offset, length| pb::MultimodalItem {
        identifier: "img".into(),
        offset,
        length,
        modality: "image".into(),
    };
    let text = pb::ScoreRequest {
        model: expected.model.clone(),
        input: Some(pb::score_request::Input::Prompt("a picture".into())),
        mm_items: vec![item(0, 1)],
        ..Default::default()
    };
    let end = probe.token_ids.len() as u32;
    let mut client = service.client().await;
    assert_score_errors(
        &mut client,
        [
            (
                text,
                tonic::Code::InvalidArgument,
                "mm_items go with token_ids",
            ),
            (
                with_items(vec![item(2, 6), item(4, 4)]),
                tonic::Code::InvalidArgument,
                "overlap",
            ),
            (
                with_items(vec![item(end - 2, 4)]),
                tonic::Code::InvalidArgument,
                "past the prompt",
            ),
            (
                with_items(vec![item(0, 0)]),
                tonic::Code::InvalidArgument,
                "length 0",
            ),
        ],
    )
    .await;
    // In engine key mode the items are refused, never keyed as text.
    let engine = Service::start(&["--key-mode", "engine"]).await;
    let mut client = engine.client().await;
    assert_score_errors(
        &mut client,
        [(
            with_items(probe.mm_items.clone()),
            tonic::Code::InvalidArgument,
            "engine hashes",
        )],
    )
    .await;
}

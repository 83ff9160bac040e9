//! vLLM's render server's answer, taken as a router already has it.
//!
//! `vllm launch render` (`POST /v1/chat/completions/render`, `POST
//! /v1/completions/render`) turns a request into a `GenerateRequest`: the
//! prompt's token ids after placeholder expansion and, for images, audio
//! and video, `features`: per modality, each item's hash (`mm_hashes`) and
//! placeholder range (`mm_placeholders`). That is what vLLM keys a
//! prompt's blocks by, so a router passes the body on as it is, and we read
//! only those fields (and `cache_salt`); anything else in it is ignored.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::*;

/// The fields of a `GenerateRequest` that key a prompt.
pub(super) struct Rendered {
    pub ids: Vec<u32>,
    pub mm_items: Vec<pb::MultimodalItem>,
    pub cache_salt: Option<String>,
}

#[derive(Deserialize)]
struct Body {
    token_ids: Vec<u32>,
    #[serde(default)]
    features: Option<Features>,
    #[serde(default)]
    cache_salt: Option<String>,
}

#[derive(Deserialize)]
struct Features {
    mm_hashes: BTreeMap<String, Vec<String>>,
    mm_placeholders: BTreeMap<String, Vec<Placeholder>>,
}

#[derive(Deserialize)]
struct Placeholder {
    offset: u32,
    length: u32,
}

impl Rendered {
    /// A request's `generate_request_json`, at most `max_bytes` of it
    /// (`--max-prompt`).
    pub(super) fn from_request(body: &str, max_bytes: usize) -> Result<Rendered, ApiError> {
        super::admission::within_max_prompt(
            "generate_request_json's size in bytes",
            body.len(),
            max_bytes,
        )?;
        Rendered::parse(body)
    }

    /// `body`, a `GenerateRequest` in JSON (bounded by the caller).
    pub(super) fn parse(body: &str) -> Result<Rendered, ApiError> {
        let bad = |why: String| ApiError::BadMultimodal(format!("generate_request_json: {why}"));
        let body: Body = serde_json::from_str(body).map_err(|e| bad(e.to_string()))?;
        let mut mm_items = Vec::new();
        if let Some(f) = body.features {
            if let Some(m) = f
                .mm_placeholders
                .keys()
                .find(|m| !f.mm_hashes.contains_key(*m))
            {
                return Err(bad(format!("{m} placeholders without hashes")));
            }
            let items: usize = f.mm_hashes.values().map(Vec::len).sum();
            if items > indexer::keys::multimodal::MAX_ITEMS {
                return Err(bad(format!(
                    "{items} multimodal items; at most {}",
                    indexer::keys::multimodal::MAX_ITEMS
                )));
            }
            for (modality, hashes) in f.mm_hashes {
                let places = f.mm_placeholders.get(&modality).map_or(&[][..], |p| p);
                if places.len() != hashes.len() {
                    return Err(bad(format!(
                        "{} {modality} hashes but {} placeholders",
                        hashes.len(),
                        places.len()
                    )));
                }
                for (identifier, p) in hashes.into_iter().zip(places) {
                    mm_items.push(pb::MultimodalItem {
                        identifier,
                        offset: p.offset,
                        length: p.length,
                        modality: modality.clone(),
                    });
                }
            }
        }
        Ok(Rendered {
            ids: body.token_ids,
            mm_items,
            cache_salt: body.cache_salt.filter(|s| !s.is_empty()),
        })
    }
}

/// A request's input, items and salt: from the render server's body when
/// it brings one (then the request's own `mm_items` must be empty, and its
/// `cache_salt`, if set, the body's), else as the request gives them.
pub(super) fn with_rendered(
    input: Result<PromptInput, Rendered>,
    mm_items: Vec<pb::MultimodalItem>,
    cache_salt: &str,
) -> Result<(PromptInput, Vec<pb::MultimodalItem>, Option<String>), ApiError> {
    let salt = non_empty(cache_salt).map(str::to_owned);
    match input {
        Ok(input) => Ok((input, mm_items, salt)),
        Err(r) => {
            if !mm_items.is_empty() {
                return Err(ApiError::BadMultimodal(
                    "mm_items come from generate_request_json's features: send one or the other"
                        .into(),
                ));
            }
            if salt.is_some() && r.cache_salt.is_some() && salt != r.cache_salt {
                return Err(ApiError::BadMultimodal(
                    "cache_salt differs from generate_request_json's".into(),
                ));
            }
            Ok((
                PromptInput::TokenIds(r.ids),
                r.mm_items,
                salt.or(r.cache_salt),
            ))
        }
    }
}

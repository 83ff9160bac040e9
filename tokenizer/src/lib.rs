//! Hugging Face tokenizers, in-process and exact.
//!
//! [`ModelTokenizer`]s tokenize completions prompts and render chat requests
//! ([`chat`]) the way vLLM does, with an exact incremental cache
//! ([`pieces`]).
//!
//! The pure part (no files, no network): this module's tokenizer built
//! from the files' text, [`chat`], [`pieces`], [`names`] (which model names
//! may name which files). The part that touches the outside: [`load`]
//! (finding and reading files), [`hub`] (downloading from the Hugging Face
//! Hub) and [`Registry`] (which models get a tokenizer, each loaded once on
//! its own thread; callers wait without holding one).

pub mod chat;
pub mod hub;
pub mod load;
pub mod names;
pub mod pieces;
mod registry;

use std::sync::Arc;

use serde_json::{Map, Value as Json};

use crate::chat::{ChatError, ChatRequest, ChatTemplate, RenderBounds};
use crate::pieces::{pieces, PieceCache, MIN_PIECE};

pub use crate::registry::{Lookup, Pending, Registry, RegistryCounts};

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error(transparent)]
    Chat(#[from] ChatError),
    #[error("tokenization failed: {0}")]
    Encode(String),
}

/// One model's tokenizer, chat template and tokenization cache.
pub struct ModelTokenizer {
    pub model: String,
    /// Where the files came from, for logs.
    pub origin: String,
    tokenizer: tokenizers::Tokenizer,
    chat: Result<ChatTemplate, String>,
    /// `bos_token`, `eos_token`... as chat templates see them.
    special_tokens: Map<String, Json>,
    /// The ids `add_special_tokens` puts before a text, when that is all it
    /// does (BOS); `None` if it does something else (then no piecewise path).
    special_prefix: Option<Vec<u32>>,
    /// Safe to tokenize piece by piece (see `pieces`).
    piecewise: bool,
    cache: PieceCache,
}

/// The text of a tokenizer's files, as read.
#[derive(Clone, Debug, Default)]
pub struct TokenizerText {
    /// `tokenizer.json`.
    pub tokenizer_json: String,
    /// `tokenizer_config.json`, if there is one.
    pub config_json: Option<String>,
    /// `chat_template.jinja`, if there is one (it wins over the config's).
    pub chat_template: Option<String>,
}

/// Which of a tokenizer's files is unusable, and why.
#[derive(Debug)]
pub enum TextError {
    TokenizerJson(String),
    ConfigJson(String),
}

impl ModelTokenizer {
    /// A tokenizer from its files' text; `cache_bytes` bounds the
    /// tokenization cache. `origin` says where the files came from, for logs.
    pub fn from_text(
        model: &str,
        origin: String,
        text: &TokenizerText,
        cache_bytes: usize,
    ) -> Result<Self, TextError> {
        let json = &text.tokenizer_json;
        let tokenizer: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e: tokenizers::Error| TextError::TokenizerJson(e.to_string()))?;
        let config: Json = match &text.config_json {
            Some(t) => serde_json::from_str(t).map_err(|e| TextError::ConfigJson(e.to_string()))?,
            None => Json::Object(Map::new()),
        };
        let template_source = match &text.chat_template {
            Some(t) => Some(t.clone()),
            None => chat_template_from_config(&config),
        };
        let chat = match template_source {
            Some(src) => ChatTemplate::compile(&src).map_err(|e| e.to_string()),
            None => Err(ChatError::NoTemplate.to_string()),
        };
        if let Err(e) = &chat {
            tracing::warn!(model, error = %e, "chat requests for this model will fail");
        }
        let mut t = ModelTokenizer {
            model: model.to_owned(),
            origin,
            tokenizer,
            chat,
            special_tokens: special_tokens_map(&config),
            special_prefix: None,
            piecewise: false,
            cache: PieceCache::new(cache_bytes),
        };
        t.special_prefix = t.detect_special_prefix();
        t.piecewise = piecewise_safe(json) && t.passes_self_test();
        if !t.piecewise {
            tracing::info!(
                model,
                "tokenizer shape not proven piece-safe: incremental cache off"
            );
        }
        Ok(t)
    }

    fn raw(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// Tokenizes from scratch, bypassing the cache (benchmarks, checks).
    pub fn encode_uncached(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.raw(text, add_special_tokens)
    }

    fn detect_special_prefix(&self) -> Option<Vec<u32>> {
        let probe = "Hello world.\nProbe";
        let with = self.raw(probe, true).ok()?;
        let without = self.raw(probe, false).ok()?;
        with.ends_with(&without)
            .then(|| with[..with.len() - without.len()].to_vec())
    }

    /// Piecewise tokenization must reproduce whole-text tokenization on a
    /// text full of cut points of every kind.
    fn passes_self_test(&self) -> bool {
        let probe = "System: be brief.\nUser asked why the sky is blue; it's Rayleigh scattering \
                     of sunlight.\n\nAnswer in 12 words.\r\nDone now\n\tTabbed line\nCafé au lait \
                     é\u{301}t\u{e9} naïve\n<|im_start|>user\nhello there";
        let pieced = |add| -> Option<Vec<u32>> {
            let mut ids = if add {
                self.special_prefix.clone()?
            } else {
                Vec::new()
            };
            for p in pieces(probe, 1) {
                ids.extend(self.raw(p, false).ok()?);
            }
            Some(ids)
        };
        [false, true]
            .iter()
            .all(|&add| pieced(add).is_some_and(|ids| Some(ids) == self.raw(probe, add).ok()))
    }

    /// Token ids of `text`, as `tokenizer(text, add_special_tokens=...)`
    /// gives them, served from the incremental cache where possible.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let prefix = match (&self.special_prefix, add_special_tokens) {
            (_, false) => &[][..],
            (Some(p), true) => p.as_slice(),
            (None, true) => return self.raw(text, true),
        };
        if !self.piecewise {
            return self.raw(text, add_special_tokens);
        }
        let mut ids = Vec::with_capacity(prefix.len() + text.len() / 3);
        ids.extend_from_slice(prefix);
        for piece in pieces(text, MIN_PIECE) {
            match self.cache.get(piece) {
                Some(cached) => ids.extend_from_slice(&cached),
                None => {
                    let fresh: Arc<[u32]> = self.raw(piece, false)?.into();
                    ids.extend_from_slice(&fresh);
                    self.cache.insert(piece, fresh);
                }
            }
        }
        Ok(ids)
    }

    /// Renders a chat request within `bounds`: with `request_template` (the
    /// request's own `chat_template`, compiled; whether a request may bring
    /// one is the caller's decision, see [`chat::TemplateCache`]), else with
    /// the model's template.
    pub fn render_chat(
        &self,
        req: &ChatRequest,
        request_template: Option<&ChatTemplate>,
        bounds: &RenderBounds,
    ) -> Result<String, ChatError> {
        match (request_template, &self.chat) {
            (Some(t), _) | (None, Ok(t)) => t.render(req, &self.special_tokens, bounds),
            (None, Err(e)) => Err(ChatError::Template(e.clone())),
        }
    }

    /// Cache counters.
    pub fn cache(&self) -> &PieceCache {
        &self.cache
    }

    /// Whether prompts are tokenized incrementally.
    pub fn is_piecewise(&self) -> bool {
        self.piecewise
    }
}

/// `chat_template` from `tokenizer_config.json`: a string, or a list of
/// named templates (the one named `default`).
fn chat_template_from_config(config: &Json) -> Option<String> {
    match config.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .or_else(|| named.first())
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// transformers' `special_tokens_map`: token strings (an `AddedToken` dict
/// counts by its `content`), as templates see them.
fn special_tokens_map(config: &Json) -> Map<String, Json> {
    let content = |v: &Json| match v {
        Json::String(s) => Some(Json::String(s.clone())),
        Json::Object(o) => o.get("content").cloned(),
        _ => None,
    };
    let mut out = Map::new();
    for key in [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ] {
        if let Some(v) = config.get(key).and_then(content) {
            out.insert(key.into(), v);
        }
    }
    if let Some(Json::Array(extra)) = config.get("additional_special_tokens") {
        out.insert(
            "additional_special_tokens".into(),
            Json::Array(extra.iter().filter_map(content).collect()),
        );
    }
    out
}

/// The structural half of the piece-safety argument (`pieces` module docs),
/// read from `tokenizer.json`.
fn piecewise_safe(tokenizer_json: &str) -> bool {
    let Ok(t) = serde_json::from_str::<Json>(tokenizer_json) else {
        return false;
    };
    let normalizer_ok = match t.get("normalizer") {
        None | Some(Json::Null) => true,
        Some(n) => n.get("type").and_then(Json::as_str) == Some("NFC"),
    };
    let byte_level = |p: &Json, use_regex: bool| {
        p.get("type").and_then(Json::as_str) == Some("ByteLevel")
            && p.get("add_prefix_space").and_then(Json::as_bool) == Some(false)
            && p.get("use_regex").and_then(Json::as_bool) == Some(use_regex)
    };
    let regex_ok = |p: &Json| {
        let pattern = p.pointer("/pattern/Regex").and_then(Json::as_str);
        p.get("type").and_then(Json::as_str) == Some("Split")
            && p.get("behavior").and_then(Json::as_str) == Some("Isolated")
            && p.get("invert").and_then(Json::as_bool) == Some(false)
            && pattern.is_some_and(|r| r.contains("\\p{L}+") && !has_context_assertions(r))
    };
    let pre_ok = match t.get("pre_tokenizer") {
        Some(p) if p.get("type").and_then(Json::as_str) == Some("Sequence") => {
            match p
                .get("pretokenizers")
                .and_then(Json::as_array)
                .map(Vec::as_slice)
            {
                Some([split, bl]) => regex_ok(split) && byte_level(bl, false),
                _ => false,
            }
        }
        _ => false,
    };
    let model_ok = t.pointer("/model/type").and_then(Json::as_str) == Some("BPE");
    let added_ok = t
        .get("added_tokens")
        .and_then(Json::as_array)
        .is_some_and(|tokens| {
            tokens.iter().all(|a| {
                let flag = |k: &str| a.get(k).and_then(Json::as_bool).unwrap_or(false);
                let content = a.get("content").and_then(Json::as_str).unwrap_or("");
                !flag("lstrip")
                    && !flag("rstrip")
                    && !flag("single_word")
                    && !content.chars().any(char::is_whitespace)
            })
        });
    normalizer_ok && pre_ok && model_ok && added_ok
}

/// Whether a regex looks behind or anchors (`(?<`, `\b`, `\A`, `^`, `$`...):
/// then matching from a cut could differ from matching the whole text.
/// `^` inside a character class (`[^...]`) is negation, not an anchor.
fn has_context_assertions(regex: &str) -> bool {
    let mut in_class = false;
    let mut chars = regex.chars().peekable();
    let mut prev = '\0';
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                let escaped = chars.next().unwrap_or('\0');
                if !in_class && matches!(escaped, 'b' | 'B' | 'A' | 'G' | 'z' | 'Z') {
                    return true;
                }
                prev = escaped;
                continue;
            }
            '[' if !in_class => in_class = true,
            ']' if in_class => in_class = false,
            '^' | '$' if !in_class => return true,
            '<' if !in_class && prev == '?' => return true,
            _ => {}
        }
        prev = c;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::has_context_assertions;

    #[test]
    fn context_assertions_are_found_outside_classes_only() {
        let qwen = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        assert!(!has_context_assertions(qwen));
        for bad in [
            r"(?<=a)b", r"\bword", r"^start", r"end$", r"\Ax", r"a(?<!b)",
        ] {
            assert!(has_context_assertions(bad), "{bad}");
        }
        assert!(!has_context_assertions(r"[$^\]]x"));
    }
}

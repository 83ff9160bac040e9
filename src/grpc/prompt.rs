//! A request's prompt to token ids: ids as given, text and chats
//! tokenized with the model's tokenizer off the executor, within the
//! request's bounds and deadline.

use super::*;

impl KvIndexerService {
    /// The tokenizer of `model`, if it may have one (configured, or
    /// published by some pod: see `tokenizer::Registry`). A first use
    /// waits for the load, asynchronously and no longer than the deadline.
    pub(super) async fn tokenizer_for(
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
    pub(super) async fn tokenize_input(
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
        self.check_prompt_bytes("the prompt's size in bytes", bytes)?;
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
    pub(super) async fn prompt_tokens(
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

    /// A chat with image, audio or video parts, for a model with a render
    /// server (`--render-url`): rendered there, its answer read as a
    /// `generate_request_json` is. Anything else is left as it is.
    pub(super) async fn render_media(
        &self,
        model: &str,
        input: Result<PromptInput, Rendered>,
        deadline: Deadline,
    ) -> Result<Result<PromptInput, Rendered>, ApiError> {
        let Ok(PromptInput::Text(TextInput::Chat(chat))) = &input else {
            return Ok(input);
        };
        let Some(server) = self.render.for_model(model) else {
            return Ok(input);
        };
        // The bound a chat tokenized here would meet, before any parsing.
        self.check_prompt_bytes("the prompt's size in bytes", chat.len())?;
        let Some(chat) = crate::render::media_chat(chat) else {
            return Ok(input);
        };
        deadline.check("rendering")?;
        use crate::render::RenderError;
        let rendered = match server.render_chat(model, chat, deadline.0).await {
            // Up to 16 MiB of JSON: parsed off the runtime's threads.
            Ok(answer) => tokio::task::spawn_blocking(move || {
                // Bounded already: the render client reads at most 16 MiB.
                Rendered::parse(&answer).map_err(|e| {
                    RenderError::Failed(200, format!("its answer is no GenerateRequest: {e}"))
                })
            })
            .await
            .map_err(|e| ApiError::Internal(format!("render answer task: {e}")))?,
            Err(e) => Err(e),
        };
        let outcome = match &rendered {
            Ok(_) => "ok",
            Err(RenderError::Busy(_)) => "busy",
            Err(RenderError::Timeout(_)) => "timeout",
            Err(RenderError::Unreachable(_)) => "unreachable",
            Err(RenderError::Refused(..)) => "refused",
            Err(RenderError::Failed(..)) => "failed",
        };
        Metrics::count(&self.metrics.renders, "outcome", outcome);
        Ok(Err(rendered?))
    }

    /// A request's multimodal items, checked against its token ids and
    /// put in prompt order.
    pub(super) fn mm_items(
        &self,
        items: Vec<pb::MultimodalItem>,
        tokens: &[u32],
    ) -> Result<Vec<MmItem>, ApiError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let items = items
            .into_iter()
            .map(|i| MmItem {
                identifier: i.identifier,
                offset: i.offset,
                length: i.length,
            })
            .collect();
        indexer::keys::multimodal::sorted_items(items, tokens.len())
            .map_err(|e| ApiError::BadMultimodal(e.to_string()))
    }

    /// Whether `model` is answered from routing history.
    pub(super) fn approximate(&self, model: &str) -> bool {
        self.feedback
            .as_ref()
            .is_some_and(|(f, _)| f.approximate.serves(model))
    }
}

/// A prompt as either RPC carries it.
pub(super) enum PromptInput {
    TokenIds(Vec<u32>),
    Text(TextInput),
}

impl PromptInput {
    /// The prompt, or (`Err`) the render server's body that brings it
    /// (see `rendered`), of at most `max_bytes`.
    pub(super) fn from_score(
        input: Option<pb::score_request::Input>,
        max_bytes: usize,
    ) -> Result<Result<PromptInput, Rendered>, ApiError> {
        use pb::score_request::Input;
        Ok(Ok(match input {
            Some(Input::TokenIds(t)) => PromptInput::TokenIds(t.ids),
            Some(Input::Prompt(text)) => PromptInput::Text(TextInput::Prompt(text)),
            Some(Input::ChatCompletionJson(body)) => PromptInput::Text(TextInput::Chat(body)),
            Some(Input::GenerateRequestJson(body)) => {
                return Ok(Err(Rendered::from_request(&body, max_bytes)?))
            }
            None => {
                return Err(ApiError::MissingInput(
                    "`prompt`, `token_ids`, `chat_completion_json` or `generate_request_json`",
                ))
            }
        }))
    }

    /// As `from_score`, for `RecordRouting`'s inputs but a prompt handle.
    pub(super) fn from_record(
        input: Option<pb::record_routing_request::Input>,
        max_bytes: usize,
    ) -> Result<Result<PromptInput, Rendered>, ApiError> {
        use pb::record_routing_request::Input;
        Ok(Ok(match input {
            Some(Input::TokenIds(t)) => PromptInput::TokenIds(t.ids),
            Some(Input::Prompt(text)) => PromptInput::Text(TextInput::Prompt(text)),
            Some(Input::ChatCompletionJson(body)) => PromptInput::Text(TextInput::Chat(body)),
            Some(Input::GenerateRequestJson(body)) => {
                return Ok(Err(Rendered::from_request(&body, max_bytes)?))
            }
            Some(Input::PromptHandle(_)) | None => {
                return Err(ApiError::MissingInput(
                    "`prompt_handle`, `prompt`, `token_ids`, `chat_completion_json` or \
                     `generate_request_json`",
                ))
            }
        }))
    }
}

pub(super) enum PromptTokens {
    Ids(Vec<u32>),
    /// No tokenizer for the model; the text, for approximate models.
    Unknown(Option<String>),
}

pub(super) enum TextInput {
    Prompt(String),
    Chat(String),
}

impl TextInput {
    pub(super) fn text(&self) -> &str {
        match self {
            TextInput::Prompt(t) | TextInput::Chat(t) => t,
        }
    }

    pub(super) fn kind(&self) -> &'static str {
        match self {
            TextInput::Prompt(_) => "prompt",
            TextInput::Chat(_) => "chat",
        }
    }
}

pub(super) fn input_kind(input: &Option<pb::score_request::Input>) -> &'static str {
    match input {
        Some(pb::score_request::Input::TokenIds(_)) => "token_ids",
        Some(pb::score_request::Input::Prompt(_)) => "prompt",
        Some(pb::score_request::Input::ChatCompletionJson(_)) => "chat",
        Some(pb::score_request::Input::GenerateRequestJson(_)) => "generate_request",
        None => "none",
    }
}

pub(super) struct Tokenized {
    pub(super) ids: Vec<u32>,
    pub(super) rendered: Option<String>,
}

/// A client's string, cut for logs and messages (a model name can be as
/// long as the message limit).
pub(super) fn shorten(s: &str) -> &str {
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

/// Multimodal items go with token ids only: a text or chat prompt has no
/// placeholders to put them at.
pub(super) fn items_need_token_ids(
    input: &PromptInput,
    items: &[pb::MultimodalItem],
) -> Result<(), ApiError> {
    if items.is_empty() || matches!(input, PromptInput::TokenIds(_)) {
        return Ok(());
    }
    Err(ApiError::BadMultimodal(
        "mm_items go with token_ids: send the prompt as rendered (vLLM's render server returns \
         token_ids and each item's placeholders)"
            .into(),
    ))
}

/// Proto3 strings are never absent: empty means "not set".
pub(super) fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

pub(super) fn require_model(model: &str) -> Result<(), ApiError> {
    if model.is_empty() {
        return Err(ApiError::MissingModel);
    }
    Ok(())
}

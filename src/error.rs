//! API errors and the one place they become gRPC status codes.

use crate::render::RenderError;
use tokenizer::chat::ChatError;
use tokenizer::load::LoadError;
use tokenizer::TokenizeError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("`model` is required")]
    MissingModel,
    #[error("one of {0} is required")]
    MissingInput(&'static str),
    /// The request's multimodal items cannot be keyed (the message says why).
    #[error("{0}")]
    BadMultimodal(String),
    /// The model's render server gave no prompt (`--render-url`).
    #[error("{0}")]
    Render(#[from] crate::render::RenderError),
    /// No tokenizer could be found for the model (the message says where
    /// we looked).
    #[error("{0}")]
    TokenizerNotFound(String),
    /// The model is neither configured (`--tokenizer`, `--tokenizers-dir`)
    /// nor published by any pod: no tokenizer is loaded or fetched for it.
    /// (`Score` answers every candidate 0 instead: nothing is cached for
    /// such a model.)
    #[error(
        "model {0:?} is neither configured (--tokenizer, --tokenizers-dir) nor published by \
         any pod: no tokenizer is loaded or downloaded for it"
    )]
    UnknownModel(String),
    /// The request brings its own `chat_template` and the service does not
    /// run clients' templates.
    #[error(
        "the request's chat_template is refused: templates from requests run only with \
         --allow-request-chat-template"
    )]
    RequestTemplateRefused,
    /// The tokenizer (or its chat template) exists but cannot serve this.
    #[error("{0}")]
    TokenizerUnusable(String),
    /// The chat request is malformed, or its template refused it.
    #[error("{0}")]
    BadChat(String),
    /// A request over one of the configured limits.
    #[error("{what} is {got}, over the limit of {limit} (--{flag})")]
    TooLarge {
        what: &'static str,
        got: usize,
        limit: usize,
        flag: &'static str,
    },
    #[error("too many scoring requests in flight (limit {0}, --max-inflight): retry later")]
    Overloaded(usize),
    #[error("the request's deadline passed before {0}")]
    DeadlineExceeded(&'static str),
    #[error("internal error: {0}")]
    Internal(String),
    /// `RecordRouting`'s prompt handle is unknown, expired, or another model's.
    #[error(
        "prompt_handle is unknown to this replica or expired (a handle lasts 10 s, on the \
         replica whose Score returned it, for the model it was scored for): send the prompt \
         instead"
    )]
    HandleExpired,
    /// The handle's Score did not key the prompt at the pod's block size.
    #[error(
        "the prompt_handle's Score did not key the prompt at this pod's block size {0} (the pod \
         was not among its candidates): send the prompt instead"
    )]
    HandleBlockSize(u32),
}

impl From<LoadError> for ApiError {
    fn from(e: LoadError) -> ApiError {
        match e {
            LoadError::NotFound { .. } => ApiError::TokenizerNotFound(e.to_string()),
            LoadError::Invalid { .. } => ApiError::TokenizerUnusable(e.to_string()),
        }
    }
}

impl From<ChatError> for ApiError {
    fn from(e: ChatError) -> ApiError {
        match e {
            ChatError::NoTemplate => ApiError::TokenizerUnusable(e.to_string()),
            ChatError::DeadlineExceeded => {
                ApiError::DeadlineExceeded("the chat template finished rendering")
            }
            // Out of fuel or over --max-prompt: this chat (or template)
            // asks more than a render may take; retrying will not help.
            ChatError::OutOfFuel | ChatError::OutputTooLarge(_) => ApiError::BadChat(e.to_string()),
            // Bad JSON or messages, or the template refusing them
            // (`raise_exception`): the request's fault.
            ChatError::Json(_) | ChatError::Invalid(_) | ChatError::Template(_) => {
                ApiError::BadChat(e.to_string())
            }
        }
    }
}

impl From<TokenizeError> for ApiError {
    fn from(e: TokenizeError) -> ApiError {
        match e {
            TokenizeError::Chat(c) => c.into(),
            TokenizeError::Encode(m) => ApiError::Internal(m),
        }
    }
}

impl ApiError {
    pub fn code(&self) -> Code {
        match self {
            ApiError::MissingModel
            | ApiError::MissingInput(_)
            | ApiError::BadChat(_)
            | ApiError::BadMultimodal(_)
            | ApiError::RequestTemplateRefused => Code::InvalidArgument,
            ApiError::TokenizerNotFound(_) | ApiError::UnknownModel(_) => Code::NotFound,
            ApiError::TokenizerUnusable(_) | ApiError::HandleBlockSize(_) => {
                Code::FailedPrecondition
            }
            ApiError::HandleExpired => Code::NotFound,
            ApiError::TooLarge { .. } => Code::InvalidArgument,
            ApiError::Overloaded(_) => Code::ResourceExhausted,
            ApiError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            ApiError::Internal(_) => Code::Internal,
            ApiError::Render(e) => match e {
                RenderError::Busy(_) => Code::ResourceExhausted,
                RenderError::Timeout(_) => Code::DeadlineExceeded,
                RenderError::Refused(..) => Code::InvalidArgument,
                RenderError::Unreachable(_) | RenderError::Failed(..) => Code::Unavailable,
            },
        }
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

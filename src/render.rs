//! Chats with images, audio or video, rendered by the model's vLLM render
//! server (`--render-url MODEL=URL`).
//!
//! Which placeholder tokens an image becomes, and the identifier vLLM keys
//! its blocks by, come from the model's multimodal processor, which only
//! vLLM runs. `vllm launch render` runs exactly that step: `POST
//! URL/v1/chat/completions/render` answers a `GenerateRequest` (token ids
//! and each item's hash and placeholders), which `grpc::rendered` reads as
//! it reads one a router forwards. Text-only chats never leave the process.
//!
//! The server is outside the process: each render has a timeout (and never
//! outlives the request's deadline), at most `--render-concurrency` run at
//! once per server (beyond, `RESOURCE_EXHAUSTED`), and its failures come
//! back as a gRPC status that says whose failure it was.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::config::RenderConfig;

/// Longest answer read from a render server (a 32K-token prompt's
/// `GenerateRequest` is ~200 KB of JSON).
const MAX_ANSWER: u64 = 16 << 20;

/// Every model's render server.
#[derive(Default)]
pub struct RenderServers {
    servers: HashMap<String, Arc<RenderServer>>,
}

/// One model's render server.
pub struct RenderServer {
    url: String,
    agent: ureq::Agent,
    timeout: Duration,
    slots: Arc<Semaphore>,
    concurrency: usize,
}

/// Why a render gave no prompt.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("the render server has {0} renders in flight (--render-concurrency): retry later")]
    Busy(usize),
    #[error("the render server did not answer within {0:?} (--render-timeout, or the request's deadline)")]
    Timeout(Duration),
    #[error("the render server cannot be reached: {0}")]
    Unreachable(String),
    /// 400, 413, 422: the server refused this chat (its message).
    #[error("the render server refused the chat (HTTP {0}): {1}")]
    Refused(u16, String),
    /// Any other status, or an answer that is no prompt.
    #[error("the render server failed (HTTP {0}): {1}")]
    Failed(u16, String),
}

impl RenderServers {
    pub fn new(config: &RenderConfig) -> RenderServers {
        let servers = config
            .urls
            .iter()
            .map(|(model, url)| {
                let agent = ureq::AgentBuilder::new()
                    .timeout_connect(config.timeout)
                    // No redirects: the answer comes from the server named.
                    .redirects(0)
                    .build();
                let server = RenderServer {
                    url: format!("{url}/v1/chat/completions/render"),
                    agent,
                    timeout: config.timeout,
                    slots: Arc::new(Semaphore::new(config.concurrency)),
                    concurrency: config.concurrency,
                };
                (model.clone(), Arc::new(server))
            })
            .collect();
        RenderServers { servers }
    }

    pub fn for_model(&self, model: &str) -> Option<Arc<RenderServer>> {
        self.servers.get(model).cloned()
    }
}

impl RenderServer {
    /// The server's `GenerateRequest` (JSON) for a chat completions body
    /// (as `media_chat` parsed it), before `deadline` (if any).
    pub async fn render_chat(
        self: Arc<Self>,
        model: &str,
        mut chat: serde_json::Map<String, serde_json::Value>,
        deadline: Option<Instant>,
    ) -> Result<String, RenderError> {
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            return Err(RenderError::Busy(self.concurrency));
        };
        let timeout = deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
            .map_or(self.timeout, |left| left.min(self.timeout));
        // vLLM requires the model; a router's body may leave it out.
        chat.entry("model").or_insert_with(|| model.into());
        let body = serde_json::Value::Object(chat).to_string();
        let server = self.clone();
        let call = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            server.post(&body, timeout)
        });
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => Err(RenderError::Failed(0, format!("render task: {e}"))),
            Err(_) => Err(RenderError::Timeout(timeout)),
        }
    }

    fn post(&self, body: &str, timeout: Duration) -> Result<String, RenderError> {
        let answer = self
            .agent
            .post(&self.url)
            .timeout(timeout)
            .set("content-type", "application/json")
            .send_string(body);
        match answer {
            Ok(resp) => read(resp).map_err(|e| RenderError::Failed(200, e)),
            Err(ureq::Error::Status(code, resp)) => {
                let message = read(resp).map_or_else(|e| e, |body| error_message(&body));
                // The chat's fault only when the server says the request is
                // bad; 401, 404, 408, 429 and the like are the server's or
                // our configuration's, and a retry may do.
                if matches!(code, 400 | 413 | 422) {
                    Err(RenderError::Refused(code, message))
                } else {
                    Err(RenderError::Failed(code, message))
                }
            }
            Err(ureq::Error::Transport(t)) => {
                let timed_out = std::error::Error::source(&t)
                    .and_then(|s| s.downcast_ref::<std::io::Error>())
                    .is_some_and(|e| {
                        matches!(
                            e.kind(),
                            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                        )
                    });
                if timed_out {
                    Err(RenderError::Timeout(timeout))
                } else {
                    Err(RenderError::Unreachable(t.to_string()))
                }
            }
        }
    }
}

fn read(resp: ureq::Response) -> Result<String, String> {
    use std::io::Read;
    let mut body = String::new();
    resp.into_reader()
        .take(MAX_ANSWER + 1)
        .read_to_string(&mut body)
        .map_err(|e| format!("reading the answer: {e}"))?;
    if body.len() as u64 > MAX_ANSWER {
        return Err(format!("answer over {MAX_ANSWER} bytes"));
    }
    Ok(body)
}

/// vLLM's `ErrorResponse` (`{"error": {"message": ...}}`, or a top-level
/// `message`), else the body itself, shortened.
fn error_message(body: &str) -> String {
    let parsed: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let message = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("message"))
            .and_then(|m| m.as_str())
    });
    let text = message.unwrap_or(body);
    match text.char_indices().nth(500) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_owned(),
    }
}

/// A chat completions body, parsed, if it has a part that is not text (an
/// image, audio, video): those need the model's processor. `None` for
/// anything else, malformed bodies included (the tokenizer says why).
pub fn media_chat(chat: &str) -> Option<serde_json::Map<String, serde_json::Value>> {
    let serde_json::Value::Object(body) = serde_json::from_str(chat).ok()? else {
        return None;
    };
    let media = body
        .get("messages")
        .and_then(|m| m.as_array())
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("content")?.as_array())
        .flatten()
        .any(|part| {
            part.get("type")
                .and_then(|t| t.as_str())
                .is_some_and(|t| t != "text")
        });
    media.then_some(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_parts_are_told_from_text() {
        let text = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
        let image = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:"}}]}]}"#;
        assert!(media_chat(text).is_none());
        assert!(media_chat(r#"{"messages":[{"role":"user","content":"hi"}]}"#).is_none());
        assert!(media_chat(image).is_some());
    }

    #[test]
    fn vllm_error_messages_are_quoted() {
        assert_eq!(
            error_message(r#"{"error":{"message":"no image","type":"BadRequestError"}}"#),
            "no image"
        );
        assert_eq!(error_message("plain"), "plain");
    }
}

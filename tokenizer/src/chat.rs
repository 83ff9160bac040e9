//! Chat prompts: an OpenAI `/v1/chat/completions` body rendered with the
//! model's chat template exactly as vLLM renders it (vLLM's message
//! preprocessing, then transformers' `apply_chat_template` semantics).
//!
//! Templates run in minijinja configured like transformers' Jinja
//! environment (`trim_blocks`, `lstrip_blocks`, loop controls,
//! `raise_exception`, `strftime_now`, Python string/dict methods) with a
//! `tojson` that formats exactly like Python's `json.dumps`.
//!
//! Every render is bounded ([`RenderBounds`]): a template is a program, and
//! the model's own template meets chats of any size while a request's
//! template (when the service accepts them at all) is a program written by
//! a client. Fuel bounds the steps, the output writer bounds the bytes and
//! checks the request's deadline.
//!
//! Why one file of ~770 lines (and its tests): the preprocessing, the
//! environment and the bounds each reproduce one part of what vLLM and
//! transformers do to a chat; a difference anywhere changes the tokens, and
//! they are checked against each other here.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use parking_lot::Mutex;
use serde_json::{Map, Value as Json};

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat_completion_json is not valid JSON: {0}")]
    Json(String),
    #[error("invalid chat request: {0}")]
    Invalid(String),
    #[error("the model has no chat template (and the request gives none)")]
    NoTemplate,
    #[error("chat template error: {0}")]
    Template(String),
    #[error(
        "the chat template ran out of fuel: a render may take at most {} steps \
         (the template loops too long for this chat)",
        RENDER_FUEL
    )]
    OutOfFuel,
    #[error("the rendered chat prompt is over the limit of {0} bytes (--max-prompt)")]
    OutputTooLarge(usize),
    #[error("the request's deadline passed while its chat template rendered")]
    DeadlineExceeded,
}

/// Steps (minijinja instructions) one render may take.
///
/// Real templates need little, and per message, not per byte (a string
/// operation is one step however long the string): a 1,000-message chat
/// with tool calls costs the Qwen3 template 63K steps and the Llama 3.1
/// template 25K (measured with [`ChatTemplate::render_counted`];
/// `tokenizer/tests/render_bounds.rs` checks Qwen3's). 5M lets ~80,000
/// messages of that shape render, far more than real conversations hold,
/// while a runaway loop (`range(100000)` inside `range(100000)`, 10^10
/// steps) stops after ~0.15 s of one core (release build) instead of hours.
pub const RENDER_FUEL: u64 = 5_000_000;

/// What one render may produce, and until when.
#[derive(Clone, Copy, Debug)]
pub struct RenderBounds {
    /// Bytes of rendered prompt (`--max-prompt`: a rendered chat is a prompt).
    pub max_output_bytes: usize,
    /// The request's deadline: a render nobody waits for stops.
    pub deadline: Option<Instant>,
}

impl RenderBounds {
    pub fn output(max_output_bytes: usize) -> RenderBounds {
        RenderBounds {
            max_output_bytes,
            deadline: None,
        }
    }
}

/// The parts of a chat completions request that shape the prompt.
#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Json>,
    pub tools: Option<Vec<Json>>,
    pub documents: Option<Vec<Json>>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub chat_template_kwargs: Map<String, Json>,
    pub chat_template: Option<String>,
}

impl ChatRequest {
    /// Parses a request body, preprocessing messages as vLLM does: text
    /// parts joined with newlines, `null` content as empty, assistant tool
    /// call arguments given as JSON strings parsed into objects.
    pub fn parse(body: &str) -> Result<ChatRequest, ChatError> {
        let v: Json = serde_json::from_str(body).map_err(|e| ChatError::Json(e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| ChatError::Invalid("the body must be a JSON object".into()))?;
        let messages = obj
            .get("messages")
            .and_then(Json::as_array)
            .ok_or_else(|| ChatError::Invalid("`messages` must be an array".into()))?;
        if messages.is_empty() {
            return Err(ChatError::Invalid("`messages` is empty".into()));
        }
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| normalize_message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let list = |key: &str| -> Result<Option<Vec<Json>>, ChatError> {
            match obj.get(key) {
                None | Some(Json::Null) => Ok(None),
                Some(Json::Array(a)) => Ok(Some(a.clone())),
                Some(_) => Err(ChatError::Invalid(format!("`{key}` must be an array"))),
            }
        };
        let flag = |key: &str, default: bool| -> Result<bool, ChatError> {
            match obj.get(key) {
                None | Some(Json::Null) => Ok(default),
                Some(Json::Bool(b)) => Ok(*b),
                Some(_) => Err(ChatError::Invalid(format!("`{key}` must be a boolean"))),
            }
        };
        let add_generation_prompt = flag("add_generation_prompt", true)?;
        let continue_final_message = flag("continue_final_message", false)?;
        if add_generation_prompt && continue_final_message {
            return Err(ChatError::Invalid(
                "`continue_final_message` needs `add_generation_prompt: false`".into(),
            ));
        }
        let chat_template_kwargs = match obj.get("chat_template_kwargs") {
            None | Some(Json::Null) => Map::new(),
            Some(Json::Object(m)) => m.clone(),
            Some(_) => {
                return Err(ChatError::Invalid(
                    "`chat_template_kwargs` must be an object".into(),
                ))
            }
        };
        let chat_template = match obj.get("chat_template") {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(s.clone()),
            Some(_) => {
                return Err(ChatError::Invalid(
                    "`chat_template` must be a string".into(),
                ))
            }
        };
        Ok(ChatRequest {
            messages,
            tools: list("tools")?,
            documents: list("documents")?,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            chat_template,
        })
    }
}

/// One message, in the shape vLLM hands to the template.
fn normalize_message(i: usize, m: &Json) -> Result<Json, ChatError> {
    let bad = |what: &str| ChatError::Invalid(format!("messages[{i}]: {what}"));
    let obj = m.as_object().ok_or_else(|| bad("must be an object"))?;
    let role = obj
        .get("role")
        .and_then(Json::as_str)
        .ok_or_else(|| bad("`role` must be a string"))?;
    let content = match obj.get("content") {
        None | Some(Json::Null) => String::new(),
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match (
                    part.get("type").and_then(Json::as_str),
                    part.get("text").and_then(Json::as_str),
                ) {
                    (Some("text") | None, Some(text)) => texts.push(text),
                    // An image's placeholders and its identifier come from
                    // the model's processor, which only vLLM runs: scoring
                    // the chat as its text alone would claim cache hits the
                    // pods never had.
                    (Some(other), _) => {
                        return Err(bad(&format!(
                            "content part of type {other:?} needs the model's processor: set \
                             --render-url MODEL=URL (a vLLM render server) for this model, or \
                             send the rendered prompt (generate_request_json, or token_ids with \
                             mm_items)"
                        )))
                    }
                    _ => return Err(bad("content part without text")),
                }
            }
            texts.join("\n")
        }
        Some(_) => return Err(bad("`content` must be a string or an array of parts")),
    };
    let mut out = Map::new();
    out.insert("role".into(), Json::String(role.to_owned()));
    out.insert("content".into(), Json::String(content));
    for (k, v) in obj {
        match k.as_str() {
            "role" | "content" => {}
            "tool_calls" => {
                let calls = v
                    .as_array()
                    .ok_or_else(|| bad("`tool_calls` must be an array"))?;
                let calls = calls
                    .iter()
                    .map(|c| parse_tool_call_arguments(c).map_err(|e| bad(&e)))
                    .collect::<Result<Vec<_>, _>>()?;
                out.insert(k.clone(), Json::Array(calls));
            }
            _ => {
                out.insert(k.clone(), v.clone());
            }
        }
    }
    // transformers aliases the reasoning fields for templates that read any of them.
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| out.get(*k).filter(|v| !v.is_null()).cloned());
    if let Some(r) = reasoning {
        let mut aliased = Map::new();
        aliased.insert("thinking".into(), r.clone());
        for (k, v) in out {
            aliased.insert(k, v);
        }
        aliased.insert("reasoning_content".into(), r);
        out = aliased;
    }
    Ok(Json::Object(out))
}

/// vLLM parses `function.arguments` given as a JSON string into an object
/// (empty or absent arguments become `{}`), so templates can `tojson` them.
fn parse_tool_call_arguments(call: &Json) -> Result<Json, String> {
    let mut call = call.clone();
    if let Some(function) = call.get_mut("function").and_then(Json::as_object_mut) {
        let args = match function.get("arguments") {
            None | Some(Json::Null) => Json::Object(Map::new()),
            Some(Json::String(s)) if s.is_empty() => Json::Object(Map::new()),
            Some(Json::String(s)) => serde_json::from_str(s)
                .map_err(|e| format!("tool call arguments are not valid JSON: {e}"))?,
            Some(other) => other.clone(),
        };
        function.insert("arguments".into(), args);
    }
    Ok(call)
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

/// Why the bounded writer refused a write.
#[derive(Clone, Copy, Debug)]
enum Stop {
    TooLarge,
    Deadline,
}

/// Collects a render's output; fails the render past the byte cap or the
/// deadline (checked every few writes: a clock read per write would cost
/// more than most writes).
struct BoundedOutput {
    buf: Vec<u8>,
    bounds: RenderBounds,
    writes: u32,
    stopped: Option<Stop>,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.bounds.max_output_bytes {
            return Err(self.stop(Stop::TooLarge));
        }
        self.writes = self.writes.wrapping_add(1);
        if self.writes.is_multiple_of(64)
            && self.bounds.deadline.is_some_and(|d| Instant::now() >= d)
        {
            return Err(self.stop(Stop::Deadline));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl BoundedOutput {
    fn stop(&mut self, why: Stop) -> std::io::Error {
        self.stopped = Some(why);
        std::io::Error::other("render stopped")
    }
}

const TEMPLATE: &str = "chat";
/// transformers' marker for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

impl ChatTemplate {
    pub fn compile(source: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template_owned(TEMPLATE, source.to_owned())
            .map_err(|e| ChatError::Template(describe(&e)))?;
        Ok(ChatTemplate { env })
    }

    /// Whether this template was compiled from `source`.
    pub fn has_source(&self, source: &str) -> bool {
        self.env
            .get_template(TEMPLATE)
            .is_ok_and(|t| t.source() == source)
    }

    /// Renders `req` with the tokenizer's special tokens in scope, within
    /// `bounds` and [`RENDER_FUEL`].
    pub fn render(
        &self,
        req: &ChatRequest,
        special_tokens: &Map<String, Json>,
        bounds: &RenderBounds,
    ) -> Result<String, ChatError> {
        self.render_counted(req, special_tokens, bounds)
            .map(|(rendered, _)| rendered)
    }

    /// [`ChatTemplate::render`], and the fuel the render consumed (what
    /// [`RENDER_FUEL`] is sized by).
    pub fn render_counted(
        &self,
        req: &ChatRequest,
        special_tokens: &Map<String, Json>,
        bounds: &RenderBounds,
    ) -> Result<(String, u64), ChatError> {
        let mut messages = req.messages.clone();
        let mut final_content = None;
        if req.continue_final_message {
            let last = messages
                .last_mut()
                .and_then(Json::as_object_mut)
                .ok_or_else(|| ChatError::Invalid("no final message to continue".into()))?;
            let content = last
                .get("content")
                .and_then(Json::as_str)
                .unwrap_or_default()
                .to_owned();
            last.insert(
                "content".into(),
                Json::String(format!("{content}{CONTINUE_TAG}")),
            );
            final_content = Some(content);
        }
        let mut ctx = special_tokens.clone();
        for (k, v) in &req.chat_template_kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages));
        if let Some(tools) = &req.tools {
            ctx.insert("tools".into(), Json::Array(tools.clone()));
        }
        if let Some(docs) = &req.documents {
            ctx.insert("documents".into(), Json::Array(docs.clone()));
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(req.add_generation_prompt),
        );
        let template = self
            .env
            .get_template(TEMPLATE)
            .map_err(|e| ChatError::Template(describe(&e)))?;
        let mut out = BoundedOutput {
            buf: Vec::new(),
            bounds: *bounds,
            writes: 0,
            stopped: None,
        };
        let fuel = match template.render_captured_to(Value::from_serialize(&ctx), &mut out) {
            Ok(captured) => captured
                .state()
                .fuel_levels()
                .map_or(0, |(consumed, _)| consumed),
            Err(e) => {
                return Err(match (out.stopped, e.kind()) {
                    (Some(Stop::TooLarge), _) => ChatError::OutputTooLarge(bounds.max_output_bytes),
                    (Some(Stop::Deadline), _) => ChatError::DeadlineExceeded,
                    (None, ErrorKind::OutOfFuel) => ChatError::OutOfFuel,
                    (None, _) => ChatError::Template(describe(&e)),
                })
            }
        };
        // Templates only ever write `str`s.
        let rendered = String::from_utf8(out.buf)
            .map_err(|_| ChatError::Template("the template wrote invalid UTF-8".into()))?;
        let rendered = match final_content {
            None => rendered,
            Some(content) => cut_at_continue_tag(rendered, &content)?,
        };
        Ok((rendered, fuel))
    }
}

/// Compiled request templates (`chat_template` in a request), so a client
/// that sends the same template with every request does not pay its
/// compilation every time.
///
/// Bounded two ways: at most [`TemplateCache::ENTRIES`] templates, the least
/// recently used one making room (a client or two in steady use keep theirs
/// however many one-off templates pass by; with this few entries a linear
/// scan for the victim costs nothing next to one compilation), and only
/// sources up to [`TemplateCache::MAX_SOURCE_BYTES`] (real templates are a
/// few KiB; a bigger one is compiled per request, which `--max-prompt` and
/// `--max-inflight` already bound). Keyed by a hash of the source, checked
/// against the source itself on a hit: a colliding template never renders
/// in another's place.
pub struct TemplateCache {
    entries: Mutex<HashMap<u128, (Arc<ChatTemplate>, u64)>>,
    clock: std::sync::atomic::AtomicU64,
}

impl Default for TemplateCache {
    fn default() -> Self {
        TemplateCache {
            entries: Mutex::new(HashMap::new()),
            clock: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl TemplateCache {
    pub const ENTRIES: usize = 64;
    pub const MAX_SOURCE_BYTES: usize = 256 << 10;

    /// The compiled `source`, from the cache or compiled now (outside the
    /// lock: a slow compilation holds up nobody else).
    pub fn get(&self, source: &str) -> Result<Arc<ChatTemplate>, ChatError> {
        let key = xxhash_rust::xxh3::xxh3_128(source.as_bytes());
        let tick = self
            .clock
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some((template, used)) = self.entries.lock().get_mut(&key) {
            if template.has_source(source) {
                *used = tick;
                return Ok(template.clone());
            }
        }
        let template = Arc::new(ChatTemplate::compile(source)?);
        if source.len() <= Self::MAX_SOURCE_BYTES {
            let mut entries = self.entries.lock();
            if entries.len() >= Self::ENTRIES && !entries.contains_key(&key) {
                let oldest = entries.iter().min_by_key(|(_, (_, used))| *used);
                if let Some(&k) = oldest.map(|(k, _)| k) {
                    entries.remove(&k);
                }
            }
            entries.insert(key, (template.clone(), tick));
        }
        Ok(template)
    }

    /// Templates held.
    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// transformers: the prompt ends where the final message's content ends.
fn cut_at_continue_tag(rendered: String, content: &str) -> Result<String, ChatError> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(content.trim()) || !rendered.contains(tag) {
        return Err(ChatError::Invalid(
            "continue_final_message is set but the chat template drops the final message".into(),
        ));
    }
    let loc = rendered.rfind(tag).unwrap_or(rendered.len());
    if rendered[loc..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..loc].to_owned())
    } else {
        Ok(rendered[..loc].trim_end().to_owned())
    }
}

fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Date formatting is never part of a cacheable prompt prefix; templates
/// that call it get today's date like transformers gives them.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let days = secs.div_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, as transformers installs it (Jinja's own `tojson`
/// escapes HTML characters; templates are written against Python's).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v).unwrap_or(0))),
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => {
            let a = s.get_item(&Value::from(0))?;
            let b = s.get_item(&Value::from(1))?;
            (a.to_string(), b.to_string())
        }
        _ => (
            if indent.is_some() { "," } else { ", " }.to_owned(),
            ": ".to_owned(),
        ),
    };
    let fmt = JsonFmt {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    fmt.write(&mut out, &value, 0)?;
    Ok(Value::from(out))
}

struct JsonFmt {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl JsonFmt {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, out: &mut String, v: &Value, level: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    out.push_str(&v.to_string());
                } else {
                    out.push_str(&python_float(f64::try_from(v.clone())?));
                }
            }
            ValueKind::String => self.string(out, v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container(out, '[', ']', &items, level, |this, out, item, level| {
                    this.write(out, item, level)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|a| a.to_string());
                }
                self.container(out, '{', '}', &keys, level, |this, out, key, level| {
                    let name = match key.as_str() {
                        Some(s) => s.to_owned(),
                        None => key.to_string(),
                    };
                    this.string(out, &name);
                    out.push_str(&this.key_sep);
                    this.write(out, &v.get_item(key)?, level)
                })?;
            }
            ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("Object of type {} is not JSON serializable", v.kind()),
                ))
            }
            // Future minijinja kinds: refuse rather than guess.
            #[allow(unreachable_patterns)]
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "value is not JSON serializable",
                ))
            }
        }
        Ok(())
    }

    fn container(
        &self,
        out: &mut String,
        open: char,
        close: char,
        items: &[Value],
        level: usize,
        mut each: impl FnMut(&Self, &mut String, &Value, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(out, level + 1);
            each(self, out, item, level + 1)?;
        }
        self.newline(out, level);
        out.push(close);
        Ok(())
    }

    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)` as `json.dumps` writes it.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Shortest round-trip digits, then Python's layout rules.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            out.push_str("0.");
            out.push_str(&"0".repeat((-point) as usize));
            out.push_str(&digits);
        } else if point as usize >= digits.len() {
            out.push_str(&digits);
            out.push_str(&"0".repeat(point as usize - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point as usize]);
            out.push('.');
            out.push_str(&digits[point as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push_str(&format!(
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: RenderBounds = RenderBounds {
        max_output_bytes: 1 << 20,
        deadline: None,
    };

    fn render(src: &str, ctx: Json) -> String {
        let t = ChatTemplate::compile(src).unwrap();
        t.env
            .get_template(TEMPLATE)
            .unwrap()
            .render(Value::from_serialize(&ctx))
            .unwrap()
    }

    #[test]
    fn tojson_formats_like_python_json_dumps() {
        let ctx = serde_json::json!({"x": {"b": [1, 2.5, "é\"\n<>&", null, true], "a": {}, "c": [],
            "f": [1e16, 1e15, 0.0001, 0.00001, -2.0, 1.5e-7, 123456789.125]}});
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"b": [1, 2.5, "é\"\n<>&", null, true], "a": {}, "c": [], "f": [1e+16, 1000000000000000.0, 0.0001, 1e-05, -2.0, 1.5e-07, 123456789.125]}"#
        );
        assert_eq!(
            render("{{ x.b | tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2.5,\n  \"é\\\"\\n<>&\",\n  null,\n  true\n]"
        );
        assert_eq!(
            render("{{ x.b[2] | tojson(ensure_ascii=true) }}", ctx),
            r#""\u00e9\"\n<>&""#
        );
    }

    #[test]
    fn python_string_methods_and_loop_controls_work() {
        let out = render(
            "{% for m in xs %}{% if m == 'skip' %}{% continue %}{% endif %}{{ m.strip().upper() }}|{% endfor %}{{ s.split('</think>')[-1].lstrip('\\n') }}",
            serde_json::json!({"xs": [" a ", "skip", "b"], "s": "x</think>\n\ny"}),
        );
        assert_eq!(out, "A|B|y");
    }

    #[test]
    fn raise_exception_surfaces_the_message() {
        let t = ChatTemplate::compile("{{ raise_exception('no system role') }}").unwrap();
        let req = ChatRequest::parse(r#"{"messages":[{"role":"user","content":"x"}]}"#).unwrap();
        let err = t
            .render(&req, &Map::new(), &BOUNDS)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no system role"), "{err}");
    }

    #[test]
    fn requests_are_preprocessed_like_vllm() {
        let req = ChatRequest::parse(
            r#"{"messages":[
                {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"x\": 1}"}}]},
                {"role":"assistant","content":"ok","reasoning_content":"hmm"}
            ]}"#,
        )
        .unwrap();
        assert_eq!(req.messages[0]["content"], "a\nb");
        assert_eq!(req.messages[1]["content"], "");
        assert_eq!(
            req.messages[1]["tool_calls"][0]["function"]["arguments"]["x"],
            1
        );
        assert_eq!(req.messages[2]["thinking"], "hmm");
        assert!(req.add_generation_prompt);
        for bad in [
            "[]",
            r#"{"messages":[]}"#,
            r#"{"messages":[{"content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"continue_final_message":true}"#,
            r#"{"messages":[{"role":"assistant","content":"x","tool_calls":[{"function":{"arguments":"{"}}]}]}"#,
        ] {
            assert!(ChatRequest::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn continue_final_message_cuts_after_the_final_content() {
        let t = ChatTemplate::compile(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}",
        )
        .unwrap();
        let req = ChatRequest::parse(
            r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Sure, "}],
                "add_generation_prompt":false,"continue_final_message":true}"#,
        )
        .unwrap();
        assert_eq!(
            t.render(&req, &Map::new(), &BOUNDS).unwrap(),
            "<user>hi</s>\n<assistant>Sure, "
        );
    }

    fn user(text: &str) -> ChatRequest {
        ChatRequest::parse(
            &serde_json::json!({"messages": [{"role": "user", "content": text}]}).to_string(),
        )
        .unwrap()
    }

    #[test]
    fn runaway_templates_run_out_of_fuel() {
        let t = ChatTemplate::compile(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        )
        .unwrap();
        let err = t.render(&user("x"), &Map::new(), &BOUNDS).unwrap_err();
        assert!(matches!(err, ChatError::OutOfFuel), "{err}");
    }

    #[test]
    fn output_past_the_cap_stops_the_render() {
        let t = ChatTemplate::compile("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}")
            .unwrap();
        let err = t.render(&user("x"), &Map::new(), &BOUNDS).unwrap_err();
        assert!(
            matches!(err, ChatError::OutputTooLarge(n) if n == 1 << 20),
            "{err}"
        );
        assert!(err.to_string().contains("--max-prompt"), "{err}");
        // Exactly at the cap is fine.
        let t = ChatTemplate::compile("{{ 'x' * 1000 }}").unwrap();
        assert_eq!(
            t.render(&user("x"), &Map::new(), &RenderBounds::output(1000))
                .unwrap()
                .len(),
            1000
        );
    }

    #[test]
    fn a_passed_deadline_stops_the_render() {
        let t = ChatTemplate::compile("{% for i in range(100000) %}{{ i }}{% endfor %}").unwrap();
        let bounds = RenderBounds {
            deadline: Some(Instant::now()),
            ..BOUNDS
        };
        let err = t.render(&user("x"), &Map::new(), &bounds).unwrap_err();
        assert!(matches!(err, ChatError::DeadlineExceeded), "{err}");
    }

    #[test]
    fn the_template_cache_is_bounded_and_keeps_what_is_in_use() {
        let cache = TemplateCache::default();
        let hot = "{{ messages[0].content }}";
        let first = cache.get(hot).unwrap();
        for i in 0..200 {
            cache.get(&format!("{{{{ {i} }}}}")).unwrap();
            // The hot template is used all along: never the victim.
            assert!(Arc::ptr_eq(&first, &cache.get(hot).unwrap()), "{i}");
            assert!(cache.len() <= TemplateCache::ENTRIES);
        }
        assert_eq!(cache.len(), TemplateCache::ENTRIES);
        // Too big to keep: compiled, not cached.
        let big = format!("{}{{{{ 1 }}}}", " ".repeat(TemplateCache::MAX_SOURCE_BYTES));
        let a = cache.get(&big).unwrap();
        assert!(!Arc::ptr_eq(&a, &cache.get(&big).unwrap()));
        assert!(cache.get("{% if %}").is_err());
    }

    #[test]
    fn strftime_now_formats_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_000), (2024, 10, 4));
        assert!(strftime_now("%d %B %Y".into()).len() >= 10);
    }
}

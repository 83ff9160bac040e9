//! Render bounds against a real template: the fuel budget lets a real
//! template render a long chat with room to spare, and stops runaway
//! loops.

use std::path::PathBuf;

use serde_json::json;
use tokenizer::chat::{ChatError, ChatRequest, ChatTemplate, RenderBounds, RENDER_FUEL};
use tokenizer::load::{locate, Sources};
use tokenizer::ModelTokenizer;

fn qwen3() -> ModelTokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers/qwen3");
    let mut sources = Sources::default();
    sources.explicit.insert("qwen3".into(), dir);
    let files = locate("qwen3", &sources).expect("files");
    ModelTokenizer::load("qwen3", &files, 1 << 20).expect("load")
}

/// A chat of `n` messages after a system prompt, with tools, a tool call and
/// its result every tenth turn, and reasoning: the template's every branch.
fn long_chat(n: usize) -> ChatRequest {
    let mut messages = vec![json!({"role": "system", "content": "You are helpful."})];
    for i in 0..n {
        let m = match i % 10 {
            8 => json!({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": {"q": i}}}]}),
            9 => json!({"role": "tool", "content": format!("result {i}")}),
            _ if i % 2 == 0 => {
                json!({"role": "user", "content": format!("Question {i}: why is the sky blue?")})
            }
            _ => {
                json!({"role": "assistant", "content": format!("Answer {i}: Rayleigh scattering."),
                        "reasoning_content": "Think."})
            }
        };
        messages.push(m);
    }
    let tools = json!([{"type": "function", "function": {"name": "lookup",
        "description": "Look something up", "parameters": {"type": "object",
        "properties": {"q": {"type": "string"}}}}}]);
    ChatRequest::parse(&json!({"messages": messages, "tools": tools}).to_string()).unwrap()
}

#[test]
fn a_thousand_message_chat_renders_well_within_the_fuel_budget() {
    let tok = qwen3();
    let req = long_chat(1000);
    let bounds = RenderBounds::output(8 << 20);
    let rendered = tok.render_chat(&req, None, &bounds).expect("renders");
    assert!(rendered.contains("Answer 997") && rendered.contains("result 999"));
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures/tokenizers/qwen3/tokenizer_config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let template = ChatTemplate::compile(config["chat_template"].as_str().unwrap()).unwrap();
    let (_, fuel) = template
        .render_counted(&req, &serde_json::Map::new(), &bounds)
        .unwrap();
    println!("qwen3, 1,000 messages: {fuel} steps of {RENDER_FUEL}");
    assert!(fuel > 0);
    // The comment on RENDER_FUEL quotes this; 20x headroom at least.
    assert!(fuel * 20 < RENDER_FUEL, "{fuel}");
}

#[test]
fn a_runaway_request_template_stops_with_a_clear_error() {
    let tok = qwen3();
    let template = ChatTemplate::compile(
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    )
    .unwrap();
    let err = tok
        .render_chat(
            &long_chat(1),
            Some(&template),
            &RenderBounds::output(8 << 20),
        )
        .unwrap_err();
    assert!(matches!(err, ChatError::OutOfFuel), "{err}");
    assert!(err.to_string().contains("fuel"), "{err}");
}

//! The requests every policy is raced on: generated from a seed (a mix of
//! session kinds) or replayed from a JSONL trace. Arrival times are fixed
//! here, before any policy runs (an open loop): a later turn of a
//! conversation arrives when it would whatever the router did, so all
//! policies see the same requests in the same order.

use std::path::Path;

use super::rng::Rng;

/// One request: its prompt and the tokens it will generate.
#[derive(Clone, Debug)]
pub struct Request {
    /// Position in arrival order.
    pub id: u32,
    pub name: String,
    /// Virtual seconds since the start.
    pub arrival: f64,
    pub prompt: Vec<u32>,
    /// What the model answers; a multi-turn follow-up re-sends it.
    pub output: Vec<u32>,
    /// The prompt as text, when the trace gave text (the approximate
    /// producer chunks text, not tokens).
    pub text: Option<String>,
}

/// The session kinds a generated workload mixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Multi-turn chat: each turn re-sends the history plus a new message.
    Chat,
    /// Agent fan-out: parallel calls sharing a system prompt and a context.
    Agent,
    /// Long-document Q&A: one of a few long documents, many questions.
    Doc,
    /// One-shot prompts over a few shared system prompts.
    OneShot,
    /// Prompts that share nothing.
    Unshared,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Chat,
        Kind::Agent,
        Kind::Doc,
        Kind::OneShot,
        Kind::Unshared,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::Agent => "agent",
            Kind::Doc => "doc",
            Kind::OneShot => "oneshot",
            Kind::Unshared => "unshared",
        }
    }
}

/// Sizes of a generated workload. Token counts are means: each draw is
/// uniform from half to one and a half times the mean.
#[derive(Clone, Debug)]
pub struct Spec {
    pub seed: u64,
    /// Kinds and their weights (shares of sessions).
    pub mix: Vec<(Kind, u32)>,
    pub requests: usize,
    /// Mean requests per second, all kinds together.
    pub rate: f64,
    pub output_tokens: usize,
    pub system_prompts: usize,
    pub system_tokens: usize,
    pub chat_turns: usize,
    pub message_tokens: usize,
    /// Mean pause between a conversation's turns (or a document's questions).
    pub think_time: f64,
    pub agent_fanout: usize,
    pub agent_context_tokens: usize,
    pub docs: usize,
    pub doc_tokens: usize,
    pub doc_questions: usize,
    pub unshared_tokens: usize,
}

impl Spec {
    /// Requests one session of `kind` sends.
    fn per_session(&self, kind: Kind) -> usize {
        match kind {
            Kind::Chat => self.chat_turns,
            Kind::Agent => self.agent_fanout,
            Kind::Doc => self.doc_questions,
            Kind::OneShot | Kind::Unshared => 1,
        }
        .max(1)
    }
}

/// The prompts sessions share, drawn once per run.
struct Shared {
    systems: Vec<Vec<u32>>,
    docs: Vec<Vec<u32>>,
}

/// Generates `spec.requests` requests, sorted by arrival.
pub fn generate(spec: &Spec) -> Vec<Request> {
    let mut shared_rng = Rng::fork(spec.seed, 1);
    let shared = Shared {
        systems: (0..spec.system_prompts.max(1))
            .map(|_| shared_rng.tokens(spec.system_tokens))
            .collect(),
        docs: (0..spec.docs.max(1))
            .map(|_| shared_rng.tokens(spec.doc_tokens))
            .collect(),
    };
    let weight: u32 = spec.mix.iter().map(|(_, w)| w).sum();
    let mean_per_session = spec
        .mix
        .iter()
        .map(|&(k, w)| f64::from(w) * spec.per_session(k) as f64)
        .sum::<f64>()
        / f64::from(weight.max(1));
    let session_gap = mean_per_session / spec.rate.max(1e-9);
    let mut arrivals = Rng::fork(spec.seed, 2);
    let mut out = Vec::new();
    let mut start = 0.0;
    let mut session = 0u64;
    // Sessions keep starting until enough requests arrived before the
    // latest start: later sessions could only add requests after it.
    while out.len() < spec.requests && weight > 0 {
        start += arrivals.exp(session_gap);
        let mut pick = arrivals.below(weight as usize) as u32;
        let kind = spec
            .mix
            .iter()
            .find(|(_, w)| {
                let hit = pick < *w;
                pick = pick.saturating_sub(*w);
                hit
            })
            .map_or(Kind::Unshared, |(k, _)| *k);
        let mut rng = Rng::fork(spec.seed, 1000 + session);
        session_requests(spec, &shared, kind, session, start, &mut rng, &mut out);
        session += 1;
    }
    out.sort_by(|a, b| a.arrival.total_cmp(&b.arrival).then(a.name.cmp(&b.name)));
    out.truncate(spec.requests);
    renumber(&mut out);
    out
}

fn renumber(requests: &mut [Request]) {
    for (i, r) in requests.iter_mut().enumerate() {
        r.id = i as u32;
    }
}

#[allow(clippy::too_many_arguments)]
fn session_requests(
    spec: &Spec,
    shared: &Shared,
    kind: Kind,
    session: u64,
    start: f64,
    rng: &mut Rng,
    out: &mut Vec<Request>,
) {
    let mut push = |name: String, arrival: f64, prompt: Vec<u32>, rng: &mut Rng| {
        let output = rng.tokens_around(spec.output_tokens);
        out.push(Request {
            id: 0,
            name,
            arrival,
            prompt,
            output: output.clone(),
            text: None,
        });
        output
    };
    let system = &shared.systems[rng.below(shared.systems.len())];
    match kind {
        Kind::Chat => {
            let mut history = system.clone();
            let mut at = start;
            for turn in 0..spec.chat_turns.max(1) {
                history.extend(rng.tokens_around(spec.message_tokens));
                let answer = push(format!("chat{session}-t{turn}"), at, history.clone(), rng);
                history.extend(answer);
                at += rng.exp(spec.think_time);
            }
        }
        Kind::Agent => {
            let mut context = system.clone();
            context.extend(rng.tokens_around(spec.agent_context_tokens));
            for call in 0..spec.agent_fanout.max(1) {
                let mut prompt = context.clone();
                prompt.extend(rng.tokens_around(spec.message_tokens));
                // The calls leave together, within a few milliseconds.
                let at = start + rng.unit() * 0.01;
                push(format!("agent{session}-c{call}"), at, prompt, rng);
            }
        }
        Kind::Doc => {
            let doc = &shared.docs[rng.below(shared.docs.len())];
            let mut at = start;
            for q in 0..spec.doc_questions.max(1) {
                let mut prompt = doc.clone();
                prompt.extend(rng.tokens_around(spec.message_tokens));
                push(format!("doc{session}-q{q}"), at, prompt, rng);
                at += rng.exp(spec.think_time);
            }
        }
        Kind::OneShot => {
            let mut prompt = system.clone();
            prompt.extend(rng.tokens_around(spec.message_tokens));
            push(format!("oneshot{session}"), start, prompt, rng);
        }
        Kind::Unshared => {
            let prompt = rng.tokens_around(spec.unshared_tokens);
            push(format!("unshared{session}"), start, prompt, rng);
        }
    }
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("trace line {line}: {reason}")]
    Line { line: usize, reason: String },
}

/// One line of a `--trace` file.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceLine {
    /// Seconds since the trace's start.
    arrival: f64,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    text: Option<String>,
    /// A tokenizer directory (`tokenizer.json`), for `text`.
    #[serde(default)]
    tokenizer: Option<String>,
    output_tokens: usize,
}

/// A replayed trace: its requests and the model they name.
pub struct Trace {
    pub model: Option<String>,
    pub requests: Vec<Request>,
}

/// Reads a JSONL trace: one request a line, `arrival` (s), `model`,
/// `token_ids` or `text` + `tokenizer`, `output_tokens`. Generated tokens
/// are drawn from `seed`, per request.
pub fn read_trace(path: &Path, seed: u64) -> Result<Trace, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Read {
        path: path.display().to_string(),
        source,
    })?;
    let mut tokenizers: Vec<(String, tokenizer::ModelTokenizer)> = Vec::new();
    let mut model: Option<String> = None;
    let mut requests = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = |reason: String| TraceError::Line {
            line: i + 1,
            reason,
        };
        if line.trim().is_empty() {
            continue;
        }
        let l: TraceLine = serde_json::from_str(line).map_err(|e| at(e.to_string()))?;
        if !l.arrival.is_finite() || l.arrival < 0.0 {
            return Err(at(format!("arrival {} is not a time >= 0", l.arrival)));
        }
        match (&model, &l.model) {
            (Some(m), Some(n)) if m != n => {
                return Err(at(format!(
                    "model {n:?}: the simulator serves one model, and earlier lines name {m:?}"
                )))
            }
            (None, Some(n)) => model = Some(n.clone()),
            _ => {}
        }
        let prompt = match (l.token_ids, &l.text, &l.tokenizer) {
            (Some(ids), None, None) => ids,
            (None, Some(text), Some(dir)) => {
                let t = match tokenizers.iter().position(|(d, _)| d == dir) {
                    Some(k) => &tokenizers[k].1,
                    None => {
                        let loaded = load_tokenizer(dir).map_err(at)?;
                        tokenizers.push((dir.clone(), loaded));
                        &tokenizers[tokenizers.len() - 1].1
                    }
                };
                t.encode(text, true).map_err(|e| at(e.to_string()))?
            }
            _ => {
                return Err(at(
                    "give either token_ids, or text with a tokenizer directory".into(),
                ))
            }
        };
        let mut rng = Rng::fork(seed, 7_000_000 + i as u64);
        requests.push(Request {
            id: 0,
            name: l.id.unwrap_or_else(|| format!("trace{}", i + 1)),
            arrival: l.arrival,
            prompt,
            output: rng.tokens(l.output_tokens),
            text: l.text,
        });
    }
    requests.sort_by(|a, b| a.arrival.total_cmp(&b.arrival));
    renumber(&mut requests);
    Ok(Trace { model, requests })
}

fn load_tokenizer(dir: &str) -> Result<tokenizer::ModelTokenizer, String> {
    let path = Path::new(dir);
    let files = tokenizer::load::files_at(path, dir.to_owned())
        .ok_or_else(|| format!("no tokenizer.json in {dir}"))?;
    tokenizer::ModelTokenizer::load(dir, &files, 16 << 20).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn small(seed: u64, mix: Vec<(Kind, u32)>) -> Spec {
        Spec {
            seed,
            mix,
            requests: 60,
            rate: 10.0,
            output_tokens: 20,
            system_prompts: 2,
            system_tokens: 64,
            chat_turns: 4,
            message_tokens: 20,
            think_time: 1.0,
            agent_fanout: 4,
            agent_context_tokens: 100,
            docs: 1,
            doc_tokens: 300,
            doc_questions: 3,
            unshared_tokens: 50,
        }
    }

    #[test]
    fn a_follow_up_turn_re_sends_the_history_and_the_answer() {
        let reqs = generate(&small(3, vec![(Kind::Chat, 1)]));
        let t0 = reqs.iter().find(|r| r.name == "chat0-t0").unwrap();
        let t1 = reqs.iter().find(|r| r.name == "chat0-t1").unwrap();
        let mut expected = t0.prompt.clone();
        expected.extend(&t0.output);
        assert!(t1.prompt.starts_with(&expected));
        assert!(t1.prompt.len() > expected.len());
        assert!(t1.arrival > t0.arrival);
    }

    #[test]
    fn the_same_seed_gives_the_same_requests() {
        let mix = Kind::ALL.iter().map(|&k| (k, 1)).collect::<Vec<_>>();
        let a = generate(&small(5, mix.clone()));
        let b = generate(&small(5, mix.clone()));
        let c = generate(&small(6, mix));
        assert_eq!(a.len(), 60);
        let names = |r: &[Request]| r.iter().map(|r| r.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&a), names(&b));
        assert!(a.iter().zip(&b).all(|(x, y)| x.prompt == y.prompt));
        assert!(a.iter().zip(&c).any(|(x, y)| x.prompt != y.prompt));
        assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival));
        assert!(a.iter().enumerate().all(|(i, r)| r.id == i as u32));
    }

    #[test]
    fn a_trace_line_with_text_is_tokenized_by_its_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        let qwen = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tokenizers/qwen3"
        );
        std::fs::write(
            &path,
            format!(
                "{{\"arrival\": 0.5, \"model\": \"m\", \"text\": \"hello world\", \"tokenizer\": \"{qwen}\", \"output_tokens\": 3}}\n\
                 {{\"arrival\": 0.1, \"model\": \"m\", \"token_ids\": [1, 2, 3], \"output_tokens\": 2}}\n"
            ),
        )
        .unwrap();
        let t = read_trace(&path, 1).unwrap();
        assert_eq!(t.model.as_deref(), Some("m"));
        assert_eq!(t.requests[0].prompt, vec![1, 2, 3]);
        assert_eq!(t.requests[0].output.len(), 2);
        assert_eq!(t.requests[1].prompt, vec![14990, 1879]);
        assert_eq!(t.requests[1].text.as_deref(), Some("hello world"));
        std::fs::write(&path, "{\"arrival\": 1, \"output_tokens\": 2}\n").unwrap();
        let err = read_trace(&path, 1).err().unwrap().to_string();
        assert!(err.contains("line 1"), "{err}");
    }
}

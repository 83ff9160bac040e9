//! `kv-indexer simulate`: the routing race. The same requests are served by
//! simulated vLLM pods under each routing policy, and the results compared.
//!
//! - `workload`: the requests (generated from a seed, or a `--trace`);
//! - `pod_cache`: one pod's prefix cache, vLLM 0.33's `KVCacheManager`
//!   call for call; `op_log`: its calls as `--ops-out` writes them, and
//!   their replay;
//! - `serving`: each pod's vLLM scheduler loop (chunked prefill, decode
//!   steps, preemption) in virtual time;
//! - `policy` (and `approximate`): how a router picks a pod;
//! - `feed`: the pods' events, in vLLM's wire form (`vllm_wire`), into
//!   our index (in process, or a running service: `Service`);
//! - `report` and `html`: the numbers, the table, a line on each policy's
//!   causes, the page.
//!
//! Data flows one way: requests -> policy pick -> pod queue -> pod cache
//! ops -> events -> wire -> decoder -> index -> the next pick's Score.

mod approximate;
mod feed;
mod html;
mod op_log;
mod pod_cache;
mod policy;
mod report;
mod rng;
mod serving;
pub mod vllm_wire;
mod workload;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;

pub use op_log::{replay as replay_op_log, Answer, Seen};
pub use policy::Spec as PolicySpec;
pub use report::{explain, PolicyResult, Report};

pub use feed::{Connection, Service};

use feed::Feed;
use serving::{Prepared, Serving, Simulation};
use workload::Kind;

/// `kv-indexer simulate` flags. The block size is the global `--block-size`.
#[derive(clap::Args, Debug, Clone)]
pub struct Options {
    /// Policies to race, comma-separated: round-robin, least-connections,
    /// random, approximate, approximate-load, precise, precise-load; `+spec`
    /// adds speculative writes after the pick to precise and precise-load.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round-robin,least-connections,random,approximate,approximate-load,precise,precise-load,precise-load+spec"
    )]
    pub policies: Vec<PolicySpec>,
    /// Pods serving the model.
    #[arg(long, default_value_t = 8)]
    pub pods: usize,
    /// KV-cache blocks per pod (vLLM's usable GPU blocks). The default is
    /// an eighth of a real pod: one 80 GB GPU serving an 8B model (128 KiB
    /// of KV per token) holds about 25,000 blocks of 16 tokens; the
    /// workload's concurrency is scaled down with it.
    #[arg(long, default_value_t = 3125)]
    pub pod_blocks: usize,
    /// Most requests running (holding KV blocks) per pod at once; the rest
    /// wait (vLLM's `--max-num-seqs`: 1024 on an 80 GB GPU, an eighth here,
    /// as the pod's blocks).
    #[arg(long, default_value_t = 128)]
    pub max_running: usize,
    /// Most tokens one step of a pod computes (vLLM's
    /// `--max-num-batched-tokens`, 8192 on an H100-class GPU; a compute
    /// budget, not scaled with the pod): a longer prefill is computed in
    /// chunks, alongside the running decodes.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Prefill time per uncached prompt token, seconds (3.7 s for 32K
    /// tokens on H200-class hardware).
    #[arg(long, default_value_t = 0.000113)]
    pub prefill_per_token: f64,
    /// Decode time per output token, seconds.
    #[arg(long, default_value_t = 0.02)]
    pub decode_per_token: f64,
    /// Requests in all.
    #[arg(long, default_value_t = 3000)]
    pub requests: usize,
    /// Mean arrivals per second.
    #[arg(long, default_value_t = 16.0)]
    pub rate: f64,
    /// Session kinds and weights: chat, agent, doc, oneshot, unshared.
    #[arg(long, default_value = "chat=3,agent=3,doc=2,oneshot=2")]
    pub mix: String,
    /// Seed of everything random in a run (same seed, same results).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Mean output tokens per request.
    #[arg(long, default_value_t = 200)]
    pub output_tokens: usize,
    /// Shared system prompts (chat, agent and one-shot sessions use one).
    #[arg(long, default_value_t = 8)]
    pub system_prompts: usize,
    /// Mean tokens of a shared system prompt.
    #[arg(long, default_value_t = 2000)]
    pub system_tokens: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 6)]
    pub chat_turns: usize,
    /// Mean tokens of a user message (or question, or agent call).
    #[arg(long, default_value_t = 200)]
    pub message_tokens: usize,
    /// Mean pause between a session's turns, seconds.
    #[arg(long, default_value_t = 20.0)]
    pub think_time: f64,
    /// Parallel calls per agent session.
    #[arg(long, default_value_t = 8)]
    pub agent_fanout: usize,
    /// Mean tokens of an agent session's shared context.
    #[arg(long, default_value_t = 6000)]
    pub agent_context_tokens: usize,
    /// Long documents (each doc session asks about one).
    #[arg(long, default_value_t = 8)]
    pub docs: usize,
    /// Mean tokens of a long document.
    #[arg(long, default_value_t = 16384)]
    pub doc_tokens: usize,
    /// Questions per doc session.
    #[arg(long, default_value_t = 6)]
    pub doc_questions: usize,
    /// Mean tokens of an unshared prompt.
    #[arg(long, default_value_t = 1000)]
    pub unshared_tokens: usize,
    /// Replay a JSONL request log instead of generating one: per line
    /// `arrival` (s), `model`, `token_ids` or `text` + `tokenizer` (a
    /// directory), `output_tokens`.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The model name (a trace's own model wins).
    #[arg(long, default_value = "sim/model")]
    pub model: String,
    /// Seconds from a pod's publish to the index applying the batch (vLLM
    /// publishes at schedule time; ZeroMQ and ingest add the rest).
    #[arg(long, default_value_t = 0.05)]
    pub event_delay: f64,
    /// How long a speculative write is believed, seconds: the service's
    /// `--speculative-ttl` (`auto` simulates its 2 s start, llm-d's default).
    #[arg(skip = 2.0)]
    pub speculative_ttl: f64,
    /// Blocks the approximate producer remembers per pod (llm-d's
    /// lruCapacityPerServer).
    #[arg(long, default_value_t = 31250)]
    pub approx_capacity: usize,
    /// Score against a running kv-indexer at this gRPC address instead of
    /// an in-process index (needs --zmq).
    #[arg(long, requires = "zmq")]
    pub against: Option<String>,
    /// The running kv-indexer's ZeroMQ SUB endpoint, for --against.
    #[arg(long, requires = "against")]
    pub zmq: Option<String>,
    /// Write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write one self-contained HTML page of the race.
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// Write every pod's KV-cache manager calls (JSONL), for
    /// `tests/fixtures/simulator/vllm_answers.py` to run through vLLM's own.
    #[arg(long)]
    pub ops_out: Option<PathBuf>,
}

/// Validated options: what a run needs, checked once.
struct Plan {
    serving: Serving,
    policies: Vec<PolicySpec>,
    model: String,
    requests: Vec<workload::Request>,
}

fn plan(o: &Options, block_size: usize) -> anyhow::Result<Plan> {
    let positive = |name: &str, v: usize| {
        anyhow::ensure!(v > 0, "--{name} must be at least 1");
        Ok(())
    };
    positive("pods", o.pods)?;
    positive("pod-blocks", o.pod_blocks)?;
    positive("max-running", o.max_running)?;
    positive("max-num-batched-tokens", o.max_num_batched_tokens)?;
    positive("block-size", block_size)?;
    positive("requests", o.requests)?;
    for (name, v) in [
        ("prefill-per-token", o.prefill_per_token),
        ("decode-per-token", o.decode_per_token),
        ("think-time", o.think_time),
        ("speculative-ttl", o.speculative_ttl),
        ("event-delay", o.event_delay),
    ] {
        anyhow::ensure!(
            v.is_finite() && v >= 0.0,
            "--{name} must be a number >= 0, not {v}"
        );
    }
    anyhow::ensure!(
        o.rate.is_finite() && o.rate > 0.0,
        "--rate must be > 0, not {}",
        o.rate
    );
    anyhow::ensure!(!o.policies.is_empty(), "--policies names none");
    let (model, requests) = match &o.trace {
        Some(path) => {
            let t = workload::read_trace(path, o.seed)?;
            (t.model.unwrap_or_else(|| o.model.clone()), t.requests)
        }
        None => (
            o.model.clone(),
            workload::generate(&workload::Spec {
                seed: o.seed,
                mix: parse_mix(&o.mix)?,
                requests: o.requests,
                rate: o.rate,
                output_tokens: o.output_tokens,
                system_prompts: o.system_prompts,
                system_tokens: o.system_tokens,
                chat_turns: o.chat_turns,
                message_tokens: o.message_tokens,
                think_time: o.think_time,
                agent_fanout: o.agent_fanout,
                agent_context_tokens: o.agent_context_tokens,
                docs: o.docs,
                doc_tokens: o.doc_tokens,
                doc_questions: o.doc_questions,
                unshared_tokens: o.unshared_tokens,
            }),
        ),
    };
    anyhow::ensure!(!requests.is_empty(), "the workload has no requests");
    Ok(Plan {
        serving: Serving {
            pods: o.pods,
            pod_blocks: o.pod_blocks,
            block_size,
            max_running: o.max_running,
            max_batched_tokens: o.max_num_batched_tokens,
            prefill_per_token: o.prefill_per_token,
            decode_per_token: o.decode_per_token,
        },
        policies: o.policies.clone(),
        model,
        requests,
    })
}

/// `chat=4,agent=2`: kinds and weights.
fn parse_mix(s: &str) -> anyhow::Result<Vec<(Kind, u32)>> {
    let mut mix = Vec::new();
    for part in s.split(',').filter(|p| !p.trim().is_empty()) {
        let (name, weight) = part.split_once('=').unwrap_or((part, "1"));
        let kind = Kind::ALL
            .into_iter()
            .find(|k| k.name() == name.trim())
            .with_context(|| {
                format!("--mix: unknown kind {name:?} (chat, agent, doc, oneshot, unshared)")
            })?;
        let weight: u32 = weight
            .trim()
            .parse()
            .with_context(|| format!("--mix: weight of {name} is not a whole number"))?;
        mix.push((kind, weight));
    }
    anyhow::ensure!(
        mix.iter().any(|(_, w)| *w > 0),
        "--mix {s:?} gives no kind a weight"
    );
    Ok(mix)
}

/// Runs the race and prints the table; writes `--json`, `--html` and
/// `--ops-out` when asked. `service`: the running kv-indexer `--against`
/// names, connected by the caller.
pub fn main(o: &Options, block_size: usize, service: Option<&dyn Service>) -> anyhow::Result<()> {
    let started = Instant::now();
    let report = race(o, block_size, true, service)?;
    print!("{}", report::table(&report.results));
    println!();
    for r in &report.results {
        println!("{}", report::explain(r));
    }
    for r in &report.results {
        anyhow::ensure!(
            r.feed.decode_errors == 0 && r.feed.events_decoded == r.feed.events_encoded
                || service.is_some(),
            "{}: our decoder refused simulated batches: {:?}",
            r.policy,
            r.feed
        );
    }
    let rejected = report.results.first().map_or(0, |r| r.rejected);
    if rejected > 0 {
        println!("({rejected} requests were larger than a whole pod and were not served)");
    }
    let working_set = report.parameters["working_set_blocks"]
        .as_u64()
        .unwrap_or(0);
    println!(
        "\n{} requests, {} pods x {} blocks of {} tokens; their prompts name {} distinct \
         blocks ({:.1} pods' worth); simulated in {:.1} s",
        report.results.first().map_or(0, |r| r.requests),
        o.pods,
        o.pod_blocks,
        block_size,
        working_set,
        working_set as f64 / o.pod_blocks as f64,
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &o.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("--json {}", path.display()))?;
    }
    if let Some(path) = &o.html {
        std::fs::write(
            path,
            html::page(&report, "kv-indexer simulate: the routing race"),
        )
        .with_context(|| format!("--html {}", path.display()))?;
    }
    Ok(())
}

/// The race itself: every policy over the same requests, each against an
/// in-process index, or `service`. `progress_bar`: draw one on stderr when
/// it is a terminal.
pub fn race(
    o: &Options,
    block_size: usize,
    progress_bar: bool,
    service: Option<&dyn Service>,
) -> anyhow::Result<Report> {
    let plan = plan(o, block_size)?;
    let root_seed = indexer::keys::request_root_seed(&plan.model, None, None);
    // Every pod hashes a prompt the same way: once per request, not per pick.
    let prepared: Vec<Prepared<'_>> = plan
        .requests
        .iter()
        .map(|r| Prepared {
            request: r,
            hashes: indexer::keys::prompt_keys(root_seed, &r.prompt, block_size)
                .into_iter()
                .map(|k| k.0)
                .collect(),
        })
        .collect();
    // The working set: every distinct full block the prompts name.
    let working_set = prepared
        .iter()
        .flat_map(|p| p.hashes.iter().copied())
        .collect::<std::collections::HashSet<u64>>()
        .len();
    let arrivals: Vec<f64> = plan.requests.iter().map(|r| r.arrival).collect();
    let total = prepared.len() * plan.policies.len();
    let done = AtomicUsize::new(0);
    let bar = Progress::start(progress_bar && std::io::stderr().is_terminal(), total);
    let ops_out = match &o.ops_out {
        Some(p) => Some(Mutex::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("--ops-out {}", p.display()))?,
        ))),
        None => None,
    };
    let run_one = |spec: PolicySpec| -> anyhow::Result<PolicyResult> {
        let name = spec.name();
        let mut feed = match service {
            None => Feed::local(&plan.model, plan.serving.pods, block_size, o.event_delay),
            // Each policy's pods are their own model in the service.
            Some(service) => Feed::remote(
                &format!("{}/{name}", plan.model),
                plan.serving.pods,
                block_size,
                service,
            )?,
        };
        let mut policy = policy::Policy::new(
            spec,
            plan.serving.pods,
            o.seed,
            &plan.model,
            o.approx_capacity,
            o.speculative_ttl,
        );
        let tick = |_: usize| {
            done.fetch_add(1, Ordering::Relaxed);
        };
        let sim = Simulation::new(plan.serving, &prepared, root_seed, ops_out.is_some(), &tick);
        let run = sim
            .run(&mut policy, &mut feed)
            .with_context(|| format!("policy {name}"))?;
        if let Some(out) = &ops_out {
            let mut out = out.lock().map_err(|_| anyhow::anyhow!("op log poisoned"))?;
            report::write_ops(
                &mut *out,
                &format!("{name}/"),
                &run.ops,
                plan.serving.pod_blocks,
                block_size,
            )?;
        }
        Ok(report::summarize(
            name,
            &run.outcomes,
            &arrivals,
            plan.serving.pods,
            feed.stats,
            &feed.cost,
        ))
    };
    // In process, policies race on all cores (each has its own pods and
    // index); against one service, one at a time, so each policy's
    // Score latency is its own.
    let threads = match service {
        Some(_) => 1,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<anyhow::Result<PolicyResult>>>> =
        plan.policies.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.min(plan.policies.len()))
            .map(|_| {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&spec) = plan.policies.get(i) else {
                        break;
                    };
                    let result = run_one(spec);
                    if let Ok(mut slot) = slots[i].lock() {
                        *slot = Some(result);
                    }
                })
            })
            .collect();
        while workers.iter().any(|w| !w.is_finished()) {
            bar.draw(done.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    bar.finish();
    if let Some(out) = ops_out {
        let mut out = out
            .into_inner()
            .map_err(|_| anyhow::anyhow!("op log poisoned"))?;
        std::io::Write::flush(&mut out)?;
    }
    let mut results = Vec::new();
    for slot in slots {
        let r = slot
            .into_inner()
            .map_err(|_| anyhow::anyhow!("a policy's run panicked"))?
            .context("a policy's run did not finish")?;
        results.push(r?);
    }
    let mut parameters = parameters(o, &plan, block_size, service.is_some());
    parameters["working_set_blocks"] = working_set.into();
    Ok(Report {
        parameters,
        results,
    })
}

fn parameters(o: &Options, plan: &Plan, block_size: usize, remote: bool) -> serde_json::Value {
    serde_json::json!({
        "model": plan.model,
        "requests": plan.requests.len(),
        "trace": o.trace.as_ref().map(|p| p.display().to_string()),
        "mix": if o.trace.is_some() { None } else { Some(&o.mix) },
        "rate": o.rate,
        "seed": o.seed,
        "pods": o.pods,
        "pod_blocks": o.pod_blocks,
        "block_size": block_size,
        "max_running": o.max_running,
        "max_num_batched_tokens": o.max_num_batched_tokens,
        "prefill_per_token": o.prefill_per_token,
        "decode_per_token": o.decode_per_token,
        "speculative_ttl": o.speculative_ttl,
        "event_delay": o.event_delay,
        "approx_capacity": o.approx_capacity,
        "index": if remote { "remote" } else { "in-process" },
    })
}

/// A one-line progress bar on stderr, drawn only on a terminal.
struct Progress {
    on: bool,
    total: usize,
}

impl Progress {
    fn start(on: bool, total: usize) -> Progress {
        Progress { on, total }
    }

    fn draw(&self, done: usize) {
        if !self.on {
            return;
        }
        let width = 40;
        let filled = (done * width / self.total.max(1)).min(width);
        eprint!(
            "\r[{}{}] {done}/{} requests served",
            "#".repeat(filled),
            " ".repeat(width - filled),
            self.total
        );
    }

    fn finish(&self) {
        if self.on {
            self.draw(self.total);
            eprintln!();
        }
    }
}

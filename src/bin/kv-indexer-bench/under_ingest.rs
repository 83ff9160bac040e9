//! Score under ingest: token-id Score at fixed request rates while pods
//! publish at a fixed block rate, both over the service's real sockets.
//!
//! Issue #17's question: does a router's Score stay fast while the fleet's
//! events pour in? Each rate runs in alternating steps, without ingest
//! (`idle`) and with it (`ingest`), A B A B, because this machine's speed
//! drifts within a run. A step reports the Score latencies, what the
//! publishers sent and the service applied (zero loss is part of the goal),
//! and where the CPU went: each thread group's time on a CPU and waiting
//! for one (`/proc/<pid>/task/*/schedstat`), for the service and for this
//! process (the load generator shares the cores).
//!
//! The ingest load is vLLM-shaped, pre-encoded before the step: each pod
//! cycles through one 2,048-block prefill, then 64 turns of a 16-block
//! store followed by 8 one-block decode stores (each extending the turn's
//! chain), 16 token ids per block; a pod past its capacity removes its
//! oldest chains in the same batch, as vLLM's evictions ride along a step.
//! The rate paces stored blocks; removals come on top.

use std::collections::{HashMap, VecDeque};

use kv_indexer::zmq_io::Publisher;

use super::*;
use crate::score::{index_score_fleet, score_at_rate, score_step, Step};
use crate::score_client::{grpc_message, ScoreClient};

/// What this part runs (`--ingest-rate`, `--rates`).
pub struct Options {
    /// Stored blocks per second offered by all load pods together.
    pub ingest_rate: f64,
    /// Score requests per second, one step each.
    pub rates: Vec<f64>,
    /// The service's process (for its threads' CPU) when it runs apart.
    pub service_pid: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            ingest_rate: 100_000.0,
            rates: vec![500.0, 1000.0, 2000.0],
            service_pid: None,
        }
    }
}

impl Options {
    /// Takes `arg` (and its value from `rest`) if it is one of ours.
    pub fn parse_arg(&mut self, arg: &str, rest: &mut impl Iterator<Item = String>) -> bool {
        let number = |v: Option<String>, what: &str| -> f64 {
            v.and_then(|v| v.parse().ok())
                .filter(|v: &f64| *v > 0.0)
                .unwrap_or_else(|| {
                    eprintln!("{what}: expected a positive number");
                    std::process::exit(2)
                })
        };
        match arg {
            "--ingest-rate" => self.ingest_rate = number(rest.next(), arg),
            "--rates" => {
                self.rates = rest
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .map(|r| number(Some(r.to_string()), arg))
                    .collect()
            }
            "--service-pid" => self.service_pid = Some(number(rest.next(), arg) as u32),
            _ => return false,
        }
        true
    }

    pub const HELP: &'static str =
        "[--ingest-rate BLOCKS_PER_S] [--rates 500,1000,2000] [--service-pid PID]";
}

const LOAD_PODS: usize = 8;
const PREFILL_BLOCKS: usize = 2048;
const TURN_BLOCKS: usize = 16;
const DECODES_PER_TURN: usize = 8;
const TURNS_PER_PREFILL: usize = 64;
/// Batches in one pod's cycle: a prefill, then turns and their decodes.
const CYCLE: usize = 1 + TURNS_PER_PREFILL * (1 + DECODES_PER_TURN);
/// Blocks a load pod holds before it evicts (bounds the index).
const POD_CAPACITY: usize = 16 * 1024;

/// One vLLM-like pod: where it is in its cycle and what it holds.
pub(crate) struct LoadPod {
    name: String,
    socket: Option<Publisher>,
    seq: u64,
    phase: usize,
    rng: u64,
    next_hash: u64,
    /// Chains held, oldest first; the last one is the turn decodes extend.
    chains: VecDeque<Vec<u64>>,
    held: usize,
}

/// One batch, encoded, with the block operations it carries.
struct Batch {
    frames: ZmqMessage,
    stored: u64,
    removed: u64,
}

impl LoadPod {
    fn new(context: &zmq::Context, zmq: &str, i: usize) -> LoadPod {
        LoadPod {
            socket: Some(Publisher::connect(context, zmq).expect("connect PUB")),
            ..LoadPod::named(format!("load-{i}"), i)
        }
    }

    /// Pod `i` of a load, named `name`, publishing through sockets kept
    /// elsewhere (handed to `publish` with its timeline).
    pub(crate) fn named(name: String, i: usize) -> LoadPod {
        LoadPod {
            name,
            socket: None,
            seq: 0,
            // Pods start at different points of the cycle: prefills spread.
            phase: i * CYCLE / LOAD_PODS,
            rng: 0x10ad + i as u64,
            next_hash: (0x10ad_u64 << 48) | ((i as u64) << 40) | 1,
            chains: VecDeque::new(),
            held: 0,
        }
    }

    fn next_batch(&mut self) -> Batch {
        let (blocks, extends) = match self.phase % CYCLE {
            0 => (PREFILL_BLOCKS, false),
            k if (k - 1) % (1 + DECODES_PER_TURN) == 0 => (TURN_BLOCKS, false),
            _ => (1, !self.chains.is_empty()),
        };
        self.phase += 1;
        let mut removed = Vec::new();
        while self.held + blocks > POD_CAPACITY && self.chains.len() > 1 {
            let oldest = self.chains.pop_front().expect("more than one chain");
            self.held -= oldest.len();
            removed.extend(oldest);
        }
        let hashes: Vec<u64> = (0..blocks)
            .map(|_| {
                self.next_hash += 1;
                self.next_hash
            })
            .collect();
        let tokens = random_tokens(&mut self.rng, blocks);
        let parent = if extends {
            self.chains.back().and_then(|c| c.last().copied())
        } else {
            None
        };
        let frames = store_batch(&self.name, self.seq, &hashes, parent, &tokens, &removed);
        self.seq += 1;
        self.held += blocks;
        if extends {
            self.chains.back_mut().expect("extends").extend(hashes);
        } else {
            self.chains.push_back(hashes);
        }
        Batch {
            frames,
            stored: blocks as u64,
            removed: removed.len() as u64,
        }
    }
}

/// A step's batches in the order they leave, each with when (after the
/// start) and from which pod.
pub(crate) struct Timeline {
    pub(crate) sends: Vec<(Duration, usize, ZmqMessage)>,
    pub(crate) stored: u64,
    removed: u64,
}

/// Pre-encodes `seconds` of load at `rate` stored blocks/s over the pods:
/// each pod's batch leaves when its stored blocks so far reach its share
/// of the rate (open loop).
pub(crate) fn timeline(pods: &mut [LoadPod], rate: f64, seconds: f64) -> Timeline {
    let per_pod = rate / pods.len() as f64;
    let budget = (per_pod * seconds) as u64;
    let mut t = Timeline {
        sends: Vec::new(),
        stored: 0,
        removed: 0,
    };
    for (i, pod) in pods.iter_mut().enumerate() {
        let mut done = 0u64;
        while done < budget {
            let due = Duration::from_secs_f64(done as f64 / per_pod);
            let b = pod.next_batch();
            done += b.stored;
            t.stored += b.stored;
            t.removed += b.removed;
            t.sends.push((due, i, b.frames));
        }
    }
    t.sends.sort_by_key(|(due, ..)| *due);
    t
}

/// Publishes a timeline from a thread of its own (libzmq sends block the
/// caller; pacing must not wait on the Score client's runtime). Returns
/// the sockets and how late the latest send left.
pub(crate) fn publish(
    sockets: Vec<Publisher>,
    sends: Vec<(Duration, usize, ZmqMessage)>,
) -> std::thread::JoinHandle<(Vec<Publisher>, Duration)> {
    std::thread::Builder::new()
        .name("publisher".into())
        .spawn(move || {
            let start = Instant::now();
            let mut worst = Duration::ZERO;
            for (due, pod, frames) in sends {
                let now = start.elapsed();
                if due > now + Duration::from_micros(100) {
                    std::thread::sleep(due - now);
                }
                worst = worst.max(start.elapsed().saturating_sub(due));
                sockets[pod].send(&frames).expect("publish");
            }
            (sockets, worst)
        })
        .expect("publisher thread")
}

/// CPU time and run-queue wait (ns) per thread group of a process, from
/// the kernel's schedstat; groups are thread names without trailing digits
/// (`ingest-0` and `ingest-1` are `ingest-`).
fn thread_times(pid: u32) -> HashMap<String, (u64, u64)> {
    let mut out: HashMap<String, (u64, u64)> = HashMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        let dir = task.path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("schedstat")),
        ) else {
            continue;
        };
        let mut f = stat
            .split_whitespace()
            .map(|v| v.parse::<u64>().unwrap_or(0));
        let (run, wait) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
        let group = comm.trim().trim_end_matches(|c: char| c.is_ascii_digit());
        let e = out.entry(group.to_string()).or_default();
        e.0 += run;
        e.1 += wait;
    }
    out
}

/// CPU time (ms) the whole machine spent busy so far, every core summed
/// (`/proc/stat`: everything but idle and iowait).
fn machine_busy_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(cpu) = stat.lines().next() else {
        return 0.0;
    };
    let f: Vec<f64> = cpu
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    let total: f64 = f.iter().take(8).sum();
    let idle = f.get(3).copied().unwrap_or(0.0) + f.get(4).copied().unwrap_or(0.0);
    // USER_HZ is 100 on Linux.
    (total - idle) * 10.0
}

/// Per thread group over `seconds`: share of one core on a CPU, and ms per
/// second spent runnable but waiting for a CPU.
fn thread_load(
    before: &HashMap<String, (u64, u64)>,
    after: &HashMap<String, (u64, u64)>,
    seconds: f64,
) -> Value {
    let mut groups: Vec<(&String, f64, f64)> = after
        .iter()
        .map(|(g, (run, wait))| {
            let (r0, w0) = before.get(g).copied().unwrap_or_default();
            let per_s = |ns: u64| ns as f64 / 1e6 / seconds;
            (
                g,
                per_s(run.saturating_sub(r0)),
                per_s(wait.saturating_sub(w0)),
            )
        })
        .filter(|(_, run, _)| *run >= 1.0)
        .collect();
    groups.sort_by(|a, b| b.1.total_cmp(&a.1));
    Value::Object(
        groups
            .into_iter()
            .map(|(g, run, wait)| {
                (
                    g.clone(),
                    json!({"cpu_ms_per_s": run.round(), "runqueue_wait_ms_per_s": wait.round()}),
                )
            })
            .collect(),
    )
}

/// `service: tokio-rt-worker 908+366 ...`: per thread group, CPU ms per
/// second + ms per second waiting for a CPU.
fn cpu_line(cpu: &Value) -> String {
    let mut line = format!(
        "cpu ms/s + run-queue wait ms/s: machine busy {}",
        cpu["machine_busy_ms_per_s"]
    );
    for side in ["service", "client"] {
        if let Some(groups) = cpu[side].as_object() {
            line.push_str(&format!(" {side}:"));
            for (g, v) in groups {
                line.push_str(&format!(
                    " {g} {}+{}",
                    v["cpu_ms_per_s"], v["runqueue_wait_ms_per_s"]
                ));
            }
        }
    }
    line
}

/// A counter's value on the service's `/metrics` (first matching line).
fn metric(metrics: Option<&str>, name: &str) -> Option<f64> {
    metrics_text(metrics)?
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// `score_tokens`' fleet and prompt (`index_score_fleet`); returns the
/// request as a gRPC message (prefix and encoded request).
async fn index_score_prompt(zmq: &str, client: &mut KvIndexerClient<Channel>) -> bytes::Bytes {
    let request = index_score_fleet(zmq, client).await;
    let message = grpc_message(&prost::Message::encode_to_vec(&request));
    // The same body for an independent client:
    // `h2load -d target/bench/score_request.grpc`.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&dir).expect("target/bench");
    std::fs::write(dir.join("score_request.grpc"), &message).expect("write the request body");
    message
}

/// Waits until the service applied `target` block operations of the load
/// pods in all (or made no progress for 3 s); returns (applied, seq gaps).
async fn drain(client: &mut KvIndexerClient<Channel>, target: u64) -> (u64, u64) {
    let mut last = (0, Instant::now());
    loop {
        let (now, gaps) = applied(client, "load-").await;
        if now >= target || last.1.elapsed() > Duration::from_secs(3) {
            return (now, gaps);
        }
        if now != last.0 {
            last = (now, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One step's results.
struct Run {
    step: Step,
    ingest: Option<Value>,
    lost: u64,
    cpu: Value,
}

#[allow(clippy::too_many_arguments)]
async fn run_step(
    scores: &ScoreClient,
    message: &bytes::Bytes,
    metrics: Option<&str>,
    client: &mut KvIndexerClient<Channel>,
    pods: &mut [LoadPod],
    service_pid: Option<u32>,
    rate: f64,
    ingest_rate: Option<f64>,
    seconds: f64,
) -> Run {
    let plan = ingest_rate.map(|r| timeline(pods, r, seconds));
    let (applied_before, gaps_before) = applied(client, "load-").await;
    let dropped_before = metric(metrics, "kv_indexer_messages_dropped_total");
    let service_before = service_pid.map(thread_times).unwrap_or_default();
    let client_before = thread_times(std::process::id());
    let machine_before = machine_busy_ms();
    let started = Instant::now();
    let mut publisher = None;
    let mut counts = (0, 0, 0);
    if let Some(plan) = plan {
        let sockets = pods
            .iter_mut()
            .map(|p| p.socket.take().expect("socket returned by the last step"))
            .collect();
        counts = (plan.stored, plan.removed, plan.sends.len());
        publisher = Some(publish(sockets, plan.sends));
    }
    let step = score_step(scores, message, metrics, rate, seconds).await;
    let mut ingest = None;
    let mut lost = 0;
    if let Some(handle) = publisher {
        let (sockets, late) = tokio::task::spawn_blocking(move || handle.join())
            .await
            .expect("join")
            .expect("publisher");
        for (pod, socket) in pods.iter_mut().zip(sockets) {
            pod.socket = Some(socket);
        }
        let (stored, removed, batches) = counts;
        let sent = stored + removed;
        let (applied_after, gaps_after) = drain(client, applied_before + sent).await;
        let applied = applied_after - applied_before;
        lost = sent.saturating_sub(applied);
        let dropped = match (
            dropped_before,
            metric(metrics, "kv_indexer_messages_dropped_total"),
        ) {
            (Some(a), Some(b)) => Some(b - a),
            _ => None,
        };
        ingest = Some(json!({
            "offered_stored_blocks_per_s": ingest_rate,
            "batches_sent": batches,
            "stored_blocks_sent": stored,
            "removed_blocks_sent": removed,
            "block_ops_sent": sent,
            "block_ops_applied": applied,
            "lost_block_ops": lost,
            "seq_gaps": gaps_after - gaps_before,
            "messages_dropped": dropped,
            "publisher_latest_send_ms": late.as_secs_f64() * 1e3,
        }));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = json!({
        "machine_busy_ms_per_s": ((machine_busy_ms() - machine_before) / elapsed).round(),
        "service": service_pid.map(|pid| thread_load(&service_before, &thread_times(pid), elapsed)),
        "client": thread_load(&client_before, &thread_times(std::process::id()), elapsed),
    });
    Run {
        step,
        ingest,
        lost,
        cpu,
    }
}

/// Score at each rate, without and with ingest, alternating; writes
/// `score_under_ingest` (see the module docs).
pub async fn run(
    grpc: &str,
    zmq: &str,
    metrics: Option<&str>,
    client: &mut KvIndexerClient<Channel>,
    service_pid: Option<u32>,
    o: &Options,
    quick: bool,
) -> Value {
    let message = index_score_prompt(zmq, client).await;
    let scores = ScoreClient::connect(grpc, 8).await.expect("connect");
    let context = zmq::Context::new();
    let mut pods: Vec<LoadPod> = (0..LOAD_PODS)
        .map(|i| LoadPod::new(&context, zmq, i))
        .collect();
    // Subscriptions reach a PUB socket asynchronously: each pod's first
    // batch (seq 0) again and again (re-sends are duplicates, skipped)
    // until every pod has been seen, so nothing measured is lost for lack
    // of a subscriber.
    let (base, base_gaps) = applied(client, "load-").await;
    let first: Vec<Batch> = pods.iter_mut().map(LoadPod::next_batch).collect();
    let mut sent_total: u64 = first.iter().map(|b| b.stored + b.removed).sum();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for (pod, b) in pods.iter().zip(&first) {
            let socket = pod.socket.as_ref().expect("socket");
            socket.send(&b.frames).expect("publish");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        if pods_named(client, "load-").await.len() == LOAD_PODS {
            break;
        }
        assert!(Instant::now() < deadline, "load pods never indexed");
    }
    let service_pid = service_pid.or(o.service_pid);
    let (seconds, repeats) = if quick { (1.0, 1) } else { (5.0, 3) };
    let _ = score_at_rate(&scores, message.clone(), 200.0, 0.5).await;
    println!(
        "\nScore under ingest: the 2048-block Score at fixed rates, alone (idle) and while \
         {LOAD_PODS} pods publish {:.0} stored blocks/s (prefills of {PREFILL_BLOCKS}, turns of \
         {TURN_BLOCKS}, 1-block decodes); {repeats} x {seconds} s per cell, alternating, the run \
         with the median p99 shown",
        o.ingest_rate
    );
    println!(
        "{:>9} {:>7} {:>10} {:>8} {:>8} {:>8} {:>11} {:>14} {:>11} {:>11} {:>5}",
        "offered/s",
        "ingest",
        "achieved/s",
        "p50 us",
        "p99 us",
        "p999 us",
        "svc avg/p99",
        "p99 of runs",
        "ops sent",
        "applied",
        "lost"
    );
    let mut rows = Vec::new();
    let mut goal_met = None;
    for &rate in &o.rates {
        let mut cells: [Vec<Run>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..repeats {
            for (c, with) in [(0, None), (1, Some(o.ingest_rate))] {
                let r = run_step(
                    &scores,
                    &message,
                    metrics,
                    client,
                    &mut pods,
                    service_pid,
                    rate,
                    with,
                    seconds,
                )
                .await;
                if let Some(i) = &r.ingest {
                    sent_total += i["block_ops_sent"].as_u64().unwrap_or(0);
                }
                cells[c].push(r);
            }
        }
        for (c, mut runs) in cells.into_iter().enumerate() {
            let lost: u64 = runs.iter().map(|r| r.lost).sum();
            let sent: u64 = runs
                .iter()
                .filter_map(|r| r.ingest.as_ref()?["block_ops_sent"].as_u64())
                .sum();
            let ingest_runs: Vec<Option<Value>> = runs.iter().map(|r| r.ingest.clone()).collect();
            runs.sort_by(|a, b| a.step.p99.total_cmp(&b.step.p99));
            let p99_runs: Vec<f64> = runs.iter().map(|r| r.step.p99).collect();
            let p999_runs: Vec<f64> = runs.iter().map(|r| r.step.p999).collect();
            let shown = runs.swap_remove(runs.len() / 2);
            let s = &shown.step;
            let condition = if c == 0 { "idle" } else { "ingest" };
            println!(
                "{rate:>9.0} {condition:>7} {:>10.0} {:>8.0} {:>8.0} {:>8.0} {:>11} {:>14} {:>11} {:>11} {:>5}",
                s.achieved,
                s.p50,
                s.p99,
                s.p999,
                s.service_column(),
                format!("{:.0}-{:.0}", p99_runs[0], p99_runs[p99_runs.len() - 1]),
                if c == 0 { "-".to_string() } else { sent.to_string() },
                if c == 0 { "-".to_string() } else { (sent - lost).to_string() },
                if c == 0 { "-".to_string() } else { lost.to_string() },
            );
            println!("{:>18} {}", "", cpu_line(&shown.cpu));
            if c == 1 && rate == 2000.0 {
                goal_met = Some(s.p99 <= 1000.0 && s.p999 <= 2000.0 && lost == 0);
            }
            rows.push(json!({
                "offered_per_s": rate, "ingest": c == 1, "achieved_per_s": s.achieved,
                "p50_us": s.p50, "p99_us": s.p99, "p999_us": s.p999,
                "service_mean_us": s.service_us, "service_tail_us": s.service_tail_us, "slowest_us": s.slowest_us, "p99_us_runs": p99_runs,
                "p999_us_runs": p999_runs, "lost_block_ops_all_runs": lost,
                "block_ops_sent_all_runs": sent, "ingest_of_shown_run": shown.ingest,
                "ingest_of_each_run": ingest_runs,
                "cpu_of_shown_run": shown.cpu,
            }));
        }
    }
    // Every block operation published in this part, applied or not: a
    // batch lost at the end of one step shows as a gap only in a later one.
    let (applied_total, gaps_total) = drain(client, base + sent_total).await;
    let (applied_total, gaps_total) = (applied_total - base, gaps_total - base_gaps);
    println!(
        "load pods over the whole part: {sent_total} block operations sent, {applied_total} \
         applied, {} lost, {gaps_total} seq gaps",
        sent_total.saturating_sub(applied_total)
    );
    if let Some(met) = goal_met {
        println!(
            "goal (2000/s under ingest: p99 <= 1 ms, p999 <= 2 ms, nothing lost): {}",
            if met { "met" } else { "missed" }
        );
    }
    json!({
        "ingest_stored_blocks_per_s": o.ingest_rate,
        "load_pods": LOAD_PODS,
        "seconds_per_run": seconds,
        "runs_per_cell": repeats,
        "rows": rows,
        "goal_2000_per_s_met": goal_met,
        "block_ops_sent_total": sent_total,
        "block_ops_applied_total": applied_total,
        "seq_gaps_total": gaps_total,
    })
}

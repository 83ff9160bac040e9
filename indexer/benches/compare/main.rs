//! Ours against Dynamo's and SMG's indexers on one trace, in one run.
//!
//! `cargo bench --bench compare` (add `-- --quick` for a smaller trace, under
//! three minutes). For 16 and 128 pods, with pre-hashed blocks and with
//! token ids, every indexer is fed the same batches and asked the same
//! queries (128, 2048 and 8192 blocks); it measures apply throughput, find
//! latency, mixed read/write throughput on 2 threads and allocator-measured
//! bytes per (block, pod) entry, checks every answer against the simulated
//! pods' real caches, prints tables and writes `target/bench/compare.json`.
//! The indexers are measured side by side (see `measure_all`), so that the
//! machine's drifting speed weighs on all of them alike.
//!
//! Run without `--bench` (as `cargo test --all-targets` does) it is a smoke
//! test: a tiny trace, the agreement check only, a non-zero exit on any
//! difference.

mod alloc;
mod contenders;
mod floor;
mod trace;

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use contenders::{Contender, DynamoPositional, DynamoRadix, Feed, Input, Ours, Runs, Smg};
use serde_json::{json, Value};
use trace::{Params, Trace};

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

const SIZES: [usize; 3] = [128, 2048, 8192];

/// `--cold-prompts`: token-id finds read their prompt from wherever it lies
/// (at 8,192 blocks, 100 prompts of 512 KiB: main memory). By default each
/// prompt is read once, untimed, just before its find, as `Score` finds it:
/// its ids were decoded from the request into a fresh buffer (512 KiB at
/// 8,192 blocks, inside the L2) right before they are keyed.
static COLD_PROMPTS: AtomicBool = AtomicBool::new(false);

/// Reads a word of every cache line of `tokens`.
fn touch(tokens: &[u32]) {
    let mut acc = 0u32;
    for line in tokens.chunks(16) {
        acc ^= line[0];
    }
    black_box(acc);
}

#[derive(Clone, Copy)]
struct Plan {
    /// Rounds in which every indexer takes its turn at the queries.
    find_rounds: usize,
    /// Timed passes over the query set per indexer per round: samples for
    /// a tail (rounds x passes x queries per size and indexer).
    find_passes: usize,
    /// Apply and mixed passes per indexer (alternating; medians reported).
    passes: usize,
    timed: bool,
}

#[derive(Default, Clone)]
struct Measured {
    apply_blocks_per_s: f64,
    /// size -> its finds' times
    find: BTreeMap<usize, FindTimes>,
    mixed_ops_per_s: f64,
    mixed_queries_per_s: f64,
    bytes_per_entry: f64,
    disagreements: usize,
    first_disagreement: Option<String>,
}

/// One indexer's find times at one size, in ns: over all samples, and the
/// lowest and highest tail of a single round (their spread is how far a
/// tail from fewer samples could be trusted).
#[derive(Default, Clone, Copy)]
struct FindTimes {
    p50: f64,
    p99: f64,
    p999: f64,
    samples: usize,
    round_p99: (f64, f64),
    round_p999: (f64, f64),
}

impl FindTimes {
    fn of(rounds: Vec<Vec<Duration>>) -> FindTimes {
        let spread = |p: f64| {
            rounds.iter().fold((f64::MAX, 0f64), |(lo, hi), r| {
                let mut r = r.clone();
                r.sort_unstable();
                let v = percentile(&r, p);
                (lo.min(v), hi.max(v))
            })
        };
        let (round_p99, round_p999) = (spread(0.99), spread(0.999));
        let mut all: Vec<Duration> = rounds.into_iter().flatten().collect();
        all.sort_unstable();
        FindTimes {
            p50: percentile(&all, 0.5),
            p99: percentile(&all, 0.99),
            p999: percentile(&all, 0.999),
            samples: all.len(),
            round_p99,
            round_p999,
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_nanos() as f64
}

/// One indexer filled with the whole trace, its queries prepared: what the
/// interleaved find rounds time. Object-safe, so the contenders' different
/// types sit side by side.
trait Filled {
    /// Runs query `q` of size index `size` once and returns its time.
    fn time_find(&self, size: usize, q: usize) -> Duration;
    /// Reads query `q`'s prompt, if it is one (token ids) and prompts are
    /// not left cold (see `COLD_PROMPTS`).
    fn warm(&self, size: usize, q: usize);
    fn queries(&self, size: usize) -> usize;
    /// Prepares the trace's next query of size index `size`.
    fn prepare(&mut self, trace: &Trace, size: usize);
    /// Checks every prepared query's answer against the pods' caches.
    fn check(&self, trace: &Trace, m: &mut Measured);
}

struct FilledWith<C: Contender> {
    c: C,
    queries: Vec<Vec<C::Query>>,
}

impl<C: Contender> Filled for FilledWith<C> {
    fn time_find(&self, size: usize, q: usize) -> Duration {
        let query = &self.queries[size][q];
        let t = Instant::now();
        black_box(self.c.find(black_box(query)));
        t.elapsed()
    }

    fn warm(&self, size: usize, q: usize) {
        if COLD_PROMPTS.load(Ordering::Relaxed) {
            return;
        }
        if let Some(tokens) = C::prompt(&self.queries[size][q]) {
            touch(tokens);
        }
    }

    fn queries(&self, size: usize) -> usize {
        self.queries[size].len()
    }

    fn prepare(&mut self, trace: &Trace, size: usize) {
        let prepared = &mut self.queries[size];
        let q = &trace.queries[size].1[prepared.len()];
        prepared.push(self.c.prepare_query(&trace.nodes, &q.nodes));
    }

    fn check(&self, trace: &Trace, m: &mut Measured) {
        for (prepared, (size, qs)) in self.queries.iter().zip(&trace.queries) {
            for (i, (pq, q)) in prepared.iter().zip(qs).enumerate() {
                let got = self.c.normalize(&self.c.find(pq));
                if got != q.expected {
                    m.disagreements += 1;
                    m.first_disagreement.get_or_insert_with(|| {
                        format!(
                            "{} {}-block query {i}: got {:?}, pods hold {:?}",
                            C::name(),
                            size,
                            &got[..got.len().min(6)],
                            &q.expected[..q.expected.len().min(6)]
                        )
                    });
                }
            }
        }
    }
}

/// Every indexer's queries, prepared query by query in turn: their prompts
/// are allocated side by side. (Prepared indexer by indexer, the first
/// filled read its 8,192-block prompts ~3 us slower than the others,
/// whichever indexer it was.) Then every answer is checked.
fn prepare_all(filled: &mut [Box<dyn Filled>], trace: &Trace, measured: &mut [Measured]) {
    for (size, (_, qs)) in trace.queries.iter().enumerate() {
        for _ in qs {
            for f in filled.iter_mut() {
                f.prepare(trace, size);
            }
        }
    }
    for (f, m) in filled.iter().zip(measured) {
        f.check(trace, m);
    }
}

/// Fills a fresh `C` with the trace (allocator counting on) and keeps it
/// for the find rounds (`prepare_all` prepares its queries).
fn fill<C: Contender + 'static>(trace: &Trace, input: Input, m: &mut Measured) -> Box<dyn Filled> {
    let (c, bytes) = alloc::retained(|| {
        let c = C::new(trace, input);
        for b in &trace.batches {
            let pb = c.prepare_batch(&trace.nodes, b);
            c.apply(pb);
        }
        c.flush();
        c
    });
    m.bytes_per_entry = bytes as f64 / trace.live_entries as f64;
    let queries = trace.queries.iter().map(|_| Vec::new()).collect();
    Box::new(FilledWith { c, queries })
}

/// Apply throughput from a fresh index, inputs built beforehand: stored +
/// removed blocks / wall time from the first event to all visible.
fn apply_pass<C: Contender>(trace: &Trace, input: Input) -> f64 {
    let c = C::new(trace, input);
    let prepared: Vec<C::Batch> = trace
        .batches
        .iter()
        .map(|b| c.prepare_batch(&trace.nodes, b))
        .collect();
    let t = Instant::now();
    for b in prepared {
        c.apply(b);
    }
    c.flush();
    trace.block_ops() as f64 / t.elapsed().as_secs_f64()
}

/// Mixed: the first 60% of the trace is applied, then one thread applies
/// the rest while another answers 2048-block queries. Throughput in block
/// operations (stored + removed + looked-up blocks) per second, the
/// open-loop indexer benchmarks' unit, and lookups per second.
fn mixed_pass<C: Contender>(trace: &Trace, input: Input) -> (f64, f64) {
    let c = C::new(trace, input);
    let split = trace.batches.len() * 6 / 10;
    for b in &trace.batches[..split] {
        let pb = c.prepare_batch(&trace.nodes, b);
        c.apply(pb);
    }
    c.flush();
    let rest: Vec<C::Batch> = trace.batches[split..]
        .iter()
        .map(|b| c.prepare_batch(&trace.nodes, b))
        .collect();
    let rest_ops: u64 = trace.batches[split..]
        .iter()
        .flat_map(|b| &b.events)
        .map(|e| match e {
            trace::Event::Stored { nodes, .. } | trace::Event::Removed { nodes } => {
                nodes.len() as u64
            }
        })
        .sum();
    let q2048: Vec<C::Query> = trace
        .queries
        .iter()
        .find(|(s, _)| *s == 2048)
        .expect("2048")
        .1
        .iter()
        .map(|q| c.prepare_query(&trace.nodes, &q.nodes))
        .collect();
    let done = AtomicBool::new(false);
    let looked_up = AtomicU64::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            for b in rest {
                c.apply(b);
            }
            c.flush();
            done.store(true, Ordering::Release);
        });
        let mut n = 0u64;
        while !done.load(Ordering::Acquire) {
            black_box(c.find(&q2048[n as usize % q2048.len()]));
            n += 1;
        }
        looked_up.store(n, Ordering::Relaxed);
    });
    let secs = t.elapsed().as_secs_f64();
    let queries_done = looked_up.load(Ordering::Relaxed);
    (
        (rest_ops + queries_done * 2048) as f64 / secs,
        queries_done as f64 / secs,
    )
}

/// One contender's entry points, monomorphised.
struct Entry {
    name: &'static str,
    fill: fn(&Trace, Input, &mut Measured) -> Box<dyn Filled>,
    apply: fn(&Trace, Input) -> f64,
    mixed: fn(&Trace, Input) -> (f64, f64),
}

fn entry<C: Contender + 'static>() -> Entry {
    Entry {
        name: C::name(),
        fill: fill::<C>,
        apply: apply_pass::<C>,
        mixed: mixed_pass::<C>,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Every contender on one trace. The machine is shared and its speed drifts
/// by up to 2x within a minute, so nothing is measured for one indexer and
/// then for the next: find rounds take turns between the indexers, and the
/// apply and mixed passes alternate between them `plan.passes` times
/// (medians reported). Ratios from one run then compare indexers measured
/// under the same conditions.
fn measure_all(
    trace: &Trace,
    input: Input,
    plan: Plan,
    entries: &[Entry],
) -> (Vec<Measured>, Option<f64>) {
    let mut measured = vec![Measured::default(); entries.len()];
    let mut filled: Vec<Box<dyn Filled>> = entries
        .iter()
        .zip(measured.iter_mut())
        .map(|(e, m)| (e.fill)(trace, input, m))
        .collect();
    prepare_all(&mut filled, trace, &mut measured);
    if !plan.timed {
        return (measured, None);
    }
    for (si, size) in SIZES.iter().enumerate() {
        // Per indexer, per round: its samples.
        let mut samples = vec![Vec::new(); entries.len()];
        for round in 0..plan.find_rounds {
            // Each round, every indexer answers the whole query set in turn,
            // starting with a different one: once untimed, so that its cache
            // holds what its own lookups leave rather than what the previous
            // indexer's did, then `find_passes` times timed. Interleaved
            // query by query, or without the warm-up, the comparison
            // measured whose structure the others' evicted most.
            for k in 0..filled.len() {
                let i = (k + round) % filled.len();
                find_pass(filled[i].as_ref(), si);
                let mut timed = Vec::new();
                for _ in 0..plan.find_passes {
                    for q in 0..filled[i].queries(si) {
                        filled[i].warm(si, q);
                        timed.push(filled[i].time_find(si, q));
                    }
                }
                samples[i].push(timed);
            }
        }
        for (m, s) in measured.iter_mut().zip(samples) {
            m.find.insert(*size, FindTimes::of(s));
        }
    }
    drop(filled);
    let mut apply = vec![Vec::new(); entries.len()];
    let mut mixed = vec![Vec::new(); entries.len()];
    let mut floor = Vec::new();
    for pass in 0..plan.passes {
        if input == Input::PreHashed {
            floor.push(floor::apply_pass(trace));
        }
        for k in 0..entries.len() {
            let i = (k + pass) % entries.len();
            apply[i].push((entries[i].apply)(trace, input));
            mixed[i].push((entries[i].mixed)(trace, input));
        }
    }
    for ((m, a), x) in measured.iter_mut().zip(apply).zip(mixed) {
        m.apply_blocks_per_s = median(a);
        let ops = median(x.iter().map(|x| x.0).collect());
        let queries = median(x.iter().map(|x| x.1).collect());
        m.mixed_ops_per_s = ops;
        m.mixed_queries_per_s = queries;
    }
    (measured, (!floor.is_empty()).then(|| median(floor)))
}

struct Run {
    pods: usize,
    input: Input,
    results: Vec<(&'static str, Measured)>,
    /// `floor::apply_pass`'s median, pre-hashed runs only.
    apply_floor: Option<f64>,
    trace_stats: Value,
}

/// Each contender's measures by name, and the apply floor (see `floor`).
fn run_all(
    trace: &Trace,
    input: Input,
    plan: Plan,
) -> (Vec<(&'static str, Measured)>, Option<f64>) {
    let entries = contenders(input == Input::PreHashed);
    let (measured, apply_floor) = measure_all(trace, input, plan, &entries);
    let results = entries
        .iter()
        .zip(measured)
        .map(|(e, m)| {
            if let Some(d) = &m.first_disagreement {
                eprintln!("DISAGREEMENT ({} queries): {d}", m.disagreements);
            }
            (e.name, m)
        })
        .collect();
    (results, apply_floor)
}

fn by_name(results: &[(&'static str, Measured)], f: impl Fn(&Measured) -> f64) -> Value {
    Value::Object(
        results
            .iter()
            .map(|(n, m)| (n.to_string(), json!(f(m))))
            .collect(),
    )
}

fn run_json(run: &Run) -> Value {
    let r = &run.results;
    let per_size = |pick: fn(&FindTimes) -> Value| {
        Value::Object(
            SIZES
                .iter()
                .map(|s| {
                    let by: serde_json::Map<String, Value> = r
                        .iter()
                        .map(|(n, m)| (n.to_string(), pick(&m.find[s])))
                        .collect();
                    (s.to_string(), Value::Object(by))
                })
                .collect(),
        )
    };
    json!({
        "pods": run.pods,
        "input": run.input.name(),
        "trace": run.trace_stats,
        "apply_blocks_per_s": by_name(r, |m| m.apply_blocks_per_s),
        "apply_floor_blocks_per_s": run.apply_floor,
        "find_p50_ns": per_size(|f| json!(f.p50)),
        "find_p99_ns": per_size(|f| json!(f.p99)),
        "find_p999_ns": per_size(|f| json!(f.p999)),
        "find_samples": per_size(|f| json!(f.samples)),
        "find_round_p99_ns": per_size(|f| json!([f.round_p99.0, f.round_p99.1])),
        "find_round_p999_ns": per_size(|f| json!([f.round_p999.0, f.round_p999.1])),
        "mixed_ops_per_s": by_name(r, |m| m.mixed_ops_per_s),
        "mixed_queries_per_s": by_name(r, |m| m.mixed_queries_per_s),
        "bytes_per_entry": by_name(r, |m| m.bytes_per_entry),
        "agree": r.iter().all(|(_, m)| m.disagreements == 0),
    })
}

/// Ours relative to the better of the two named peers (Dynamo's radix tree
/// and SMG's chain index): `higher_is_better` picks the max, else the min.
fn ratio(r: &[(&'static str, Measured)], f: impl Fn(&Measured) -> f64, higher: bool) -> f64 {
    let Some((_, ours)) = r.iter().find(|(n, _)| *n == "ours") else {
        return f64::NAN;
    };
    let peers = r
        .iter()
        .filter(|(n, _)| *n == "dynamo" || *n == "smg")
        .map(|(_, m)| f(m));
    let best = if higher {
        peers.fold(f64::NAN, f64::max)
    } else {
        peers.fold(f64::NAN, f64::min)
    };
    f(ours) / best
}

fn print_run(run: &Run) {
    let r = &run.results;
    let prompts = match run.input {
        Input::Tokens if COLD_PROMPTS.load(Ordering::Relaxed) => ", prompts cold",
        Input::Tokens => ", prompts just read",
        Input::PreHashed => "",
    };
    println!(
        "\n== {} pods, {}{prompts} == {}",
        run.pods,
        run.input.name(),
        run.trace_stats
    );
    print!("{:<28}", "");
    for (n, _) in r {
        print!("{n:>18}");
    }
    println!("{:>14}", "ours/best");
    let row = |label: &str, f: &dyn Fn(&Measured) -> f64, higher: bool, scale: f64| {
        print!("{label:<28}");
        for (_, m) in r {
            print!("{:>18.2}", f(m) / scale);
        }
        println!("{:>13.2}x", ratio(r, f, higher));
    };
    row("apply (M blocks/s)", &|m| m.apply_blocks_per_s, true, 1e6);
    if let Some(floor) = run.apply_floor {
        // Where the apply row stands against one hash-map operation per block.
        print!("{:<28}", "  apply / floor");
        for (_, m) in r {
            print!("{:>17.2}x", m.apply_blocks_per_s / floor);
        }
        println!("   floor {:.2} M blocks/s", floor / 1e6);
    }
    for s in SIZES {
        row(
            &format!("find {s} p50 (us)"),
            &move |m| m.find[&s].p50,
            false,
            1e3,
        );
        row(
            &format!("find {s} p99 (us)"),
            &move |m| m.find[&s].p99,
            false,
            1e3,
        );
        row(
            &format!("find {s} p99.9 (us)"),
            &move |m| m.find[&s].p999,
            false,
            1e3,
        );
        // The spread of one round's tail, lowest-highest.
        let spread = |label: &str, pick: fn(&FindTimes) -> (f64, f64)| {
            print!("{label:<28}");
            for (_, m) in r {
                let (lo, hi) = pick(&m.find[&s]);
                print!("{:>18}", format!("{:.2}-{:.2}", lo / 1e3, hi / 1e3));
            }
            println!();
        };
        spread("  p99 of a round (us)", |f| f.round_p99);
        spread("  p99.9 of a round (us)", |f| f.round_p999);
    }
    if let Some((_, m)) = r.first() {
        let samples: Vec<String> = m
            .find
            .iter()
            .map(|(s, f)| format!("{s}: {}", f.samples))
            .collect();
        println!("{:<28}{} per indexer", "find samples", samples.join(", "));
    }
    row("mixed (M block ops/s)", &|m| m.mixed_ops_per_s, true, 1e6);
    row("mixed lookups/s (K)", &|m| m.mixed_queries_per_s, true, 1e3);
    row("bytes per entry", &|m| m.bytes_per_entry, false, 1.0);
    println!(
        "{:<28}{}",
        "agree with the pods' caches",
        r.iter()
            .map(|(n, m)| format!("{n}: {}", m.disagreements == 0))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// The two simulated fleets every run measures.
struct Fleet {
    pods: usize,
    /// Blocks each pod's cache holds.
    capacity: usize,
    /// Blocks stored over the trace, quick and full.
    stored: (u64, u64),
}

const FLEETS: [Fleet; 2] = [
    Fleet {
        pods: 16,
        capacity: 30_000,
        stored: (700_000, 2_000_000),
    },
    Fleet {
        pods: 128,
        capacity: 9_000,
        stored: (1_400_000, 4_000_000),
    },
];

impl Fleet {
    fn trace(&self, quick: bool, queries_per_size: usize) -> Trace {
        Trace::generate(Params {
            pods: self.pods,
            target_stored: if quick { self.stored.0 } else { self.stored.1 },
            capacity: self.capacity,
            queries_per_size,
            seed: 0x6b76_2d69_6e64 + self.pods as u64,
        })
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let benching = args.iter().any(|a| a == "--bench");
    let quick = args.iter().any(|a| a == "--quick");
    let cold = args.iter().any(|a| a == "--cold-prompts");
    COLD_PROMPTS.store(cold, Ordering::Relaxed);
    if !benching {
        smoke();
        return;
    }
    if args.iter().any(|a| a == "--profile-apply") {
        profile_apply();
        return;
    }
    if args.iter().any(|a| a == "--profile-find") {
        profile_find();
        return;
    }
    if args.iter().any(|a| a == "--profile-tails") {
        profile_tails();
        return;
    }
    if args.iter().any(|a| a == "--profile-clear") {
        profile_clear();
        return;
    }
    if args.iter().any(|a| a == "--profile-along") {
        profile_along();
        return;
    }
    let plan = Plan {
        find_rounds: if quick { 3 } else { 5 },
        find_passes: if quick { 10 } else { 20 },
        passes: 3,
        timed: true,
    };
    let started = Instant::now();
    let mut runs = Vec::new();
    for fleet in FLEETS {
        let t = Instant::now();
        let trace = fleet.trace(quick, if quick { 40 } else { 100 });
        let pods = fleet.pods;
        let trace_stats = json!({
            "batches": trace.batches.len(),
            "stored_blocks": trace.stored_blocks,
            "removed_blocks": trace.removed_blocks,
            "live_entries": trace.live_entries,
            "distinct_blocks": trace.nodes.len(),
        });
        eprintln!(
            "trace: {pods} pods, {} stored, {} removed blocks ({:.1}s)",
            trace.stored_blocks,
            trace.removed_blocks,
            t.elapsed().as_secs_f64()
        );
        for input in [Input::PreHashed, Input::Tokens] {
            let (results, apply_floor) = run_all(&trace, input, plan);
            let run = Run {
                pods,
                input,
                results,
                apply_floor,
                trace_stats: trace_stats.clone(),
            };
            print_run(&run);
            runs.push(run);
        }
    }
    let all: Vec<Value> = runs.iter().map(run_json).collect();
    let agree = all.iter().all(|r| r["agree"] == json!(true));
    // Headline: 128 pods, pre-hashed (the index alone); every run in "runs".
    let mut out = all[2].clone();
    out["agree"] = json!(agree);
    out["runs"] = Value::Array(all);
    out["mode"] = json!(if quick { "quick" } else { "full" });
    out["prompts"] = json!(if cold { "cold" } else { "just read" });
    out["cores"] = json!(std::thread::available_parallelism().map_or(0, |n| n.get()));
    out["seconds"] = json!(started.elapsed().as_secs_f64());
    // The workspace's target/bench, beside e2e.json.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir).expect("target/bench");
    let path = dir.canonicalize().unwrap_or(dir).join("compare.json");
    std::fs::write(&path, serde_json::to_string_pretty(&out).expect("json")).expect("write");
    println!(
        "\nwrote {} in {:.0}s; all answers agree: {agree}",
        path.display(),
        started.elapsed().as_secs_f64()
    );
    if !agree {
        std::process::exit(1);
    }
}

/// `--profile-apply`: one apply pass per indexer on the quick traces and
/// nothing else (no fills, finds or mixed passes), for a profiler run that
/// should see applying alone, e.g. `valgrind --tool=callgrind
/// --cache-sim=yes --toggle-collect='compare::apply_pass*'` (`COMPARE_ONLY`,
/// `COMPARE_PODS=16` or `128` and `COMPARE_INPUT=pre-hashed` or `token ids`
/// narrow it down). `COMPARE_ONLY=floor` runs the apply floor instead
/// (`--toggle-collect='compare::floor::apply_ops'`).
fn profile_apply() {
    if env_filter("COMPARE_ONLY").as_deref() == Some("floor") {
        for fleet in profiled_fleets() {
            let trace = fleet.trace(true, 1);
            let rate = floor::apply_pass(&trace);
            println!(
                "{} pods, pre-hashed, floor: {} block ops at {:.2} M/s",
                fleet.pods,
                trace.block_ops(),
                rate / 1e6
            );
        }
        return;
    }
    for_each_profiled(1, |fleet, trace, input, e| {
        let rate = (e.apply)(trace, input);
        println!(
            "{} pods, {}, {}: {} block ops at {:.2} M/s",
            fleet.pods,
            input.name(),
            e.name,
            trace.block_ops(),
            rate / 1e6
        );
    });
}

/// `--profile-find`: each indexer filled with the quick trace, its query
/// set of each size answered once to warm the caches (as in the timed
/// rounds), then 19 more times and nothing else, for `valgrind
/// --tool=callgrind --toggle-collect='compare::find_pass*'` (the same
/// filters as `--profile-apply`, and `COMPARE_SIZE=128`, `2048` or `8192`).
/// It prints the passes' mean time per find (the timer's reads included;
/// token-id prompts where they lie, not read ahead as in the timed rounds),
/// a quick figure for comparing two builds of one indexer.
fn profile_find() {
    // `COMPARE_FIND_PASSES`: more, for a sampling profiler.
    let passes: usize = env_filter("COMPARE_FIND_PASSES")
        .and_then(|p| p.parse().ok())
        .unwrap_or(19);
    for_each_profiled_size(|fleet, input, e, filled, si, size| {
        // The warm-up, not through `find_pass`: it stays out of the profile.
        for q in 0..filled.queries(si) {
            filled.time_find(si, q);
        }
        let t0 = Instant::now();
        let finds: usize = (0..passes).map(|_| find_pass(filled, si)).sum();
        let ns = t0.elapsed().as_nanos() as f64 / finds as f64;
        println!(
            "{} pods, {}, {}, {size} blocks: {finds} finds profiled, {ns:.0} ns each",
            fleet.pods,
            input.name(),
            e.name,
        );
    });
}

/// `--profile-tails`: where the slowest finds come from. Each indexer's
/// finds (50 passes over the quick trace's prompts, after a warm-up) are
/// timed one by one, and for each the thread's time waiting for a CPU is
/// read from `/proc/thread-self/schedstat` before and after (outside the
/// timed window): a find during which the thread waited was preempted. It
/// prints p50, p99 and p99.9 of all finds and of the finds no wait touched,
/// and how many of the slowest 0.1% waited: a tail that vanishes without
/// the waits is the host's scheduling, not the index. It also groups the
/// finds by prompt (the costliest prompt's median against the tail) and
/// counts each find's probes of the run heads' table (ours). Filters as
/// `--profile-find`.
fn profile_tails() {
    for_each_profiled_size(|fleet, input, e, filled, si, size| {
        find_pass(filled, si);
        // (time, run-queue wait, query, probes of run heads' tables).
        let mut samples: Vec<(Duration, u64, usize, u64)> = Vec::new();
        for _ in 0..50 {
            for q in 0..filled.queries(si) {
                filled.warm(si, q);
                let before = run_queue_wait_ns();
                let probes = indexer::index::head_probes();
                let t = filled.time_find(si, q);
                samples.push((
                    t,
                    run_queue_wait_ns().saturating_sub(before),
                    q,
                    indexer::index::head_probes() - probes,
                ));
            }
        }
        let pct = |mut v: Vec<Duration>, p: f64| {
            if v.is_empty() {
                return f64::NAN;
            }
            v.sort_unstable();
            percentile(&v, p) / 1e3
        };
        let all: Vec<Duration> = samples.iter().map(|s| s.0).collect();
        let calm: Vec<Duration> = samples.iter().filter(|s| s.1 == 0).map(|s| s.0).collect();
        let mut by_time = samples.clone();
        by_time.sort_unstable_by_key(|s| std::cmp::Reverse(s.0));
        let top = (samples.len() / 1000).max(1);
        let waited = by_time[..top].iter().filter(|s| s.1 > 0).count();
        println!(
            "{} pods, {}, {}, {size} blocks: {} finds, {} waited for a CPU; \
                 p50/p99/p99.9 all {:.2}/{:.2}/{:.2} us, unwaited {:.2}/{:.2}/{:.2} us; \
                 slowest {top}: {waited} waited",
            fleet.pods,
            input.name(),
            e.name,
            samples.len(),
            samples.len() - calm.len(),
            pct(all.clone(), 0.5),
            pct(all.clone(), 0.99),
            pct(all.clone(), 0.999),
            pct(calm.clone(), 0.5),
            pct(calm.clone(), 0.99),
            pct(calm, 0.999),
        );
        // Whose finds the slowest are: each prompt's median over its 50
        // finds, the costliest prompt's against the tail (a tail that is one
        // prompt's every find is that prompt's work, not an accident), and
        // the table probes the slowest made against all finds' (ours only:
        // the counter is the run index's).
        let mut per_query: Vec<Vec<Duration>> = vec![Vec::new(); filled.queries(si)];
        for s in &samples {
            per_query[s.2].push(s.0);
        }
        let medians: Vec<Duration> = per_query
            .into_iter()
            .map(|mut v| {
                v.sort_unstable();
                v[v.len() / 2]
            })
            .collect();
        let costliest = medians.iter().max().copied().unwrap_or_default();
        let slow_prompts: std::collections::BTreeSet<usize> =
            by_time[..top].iter().map(|s| s.2).collect();
        let mean_probes = |v: &[(Duration, u64, usize, u64)]| {
            v.iter().map(|s| s.3 as f64).sum::<f64>() / v.len().max(1) as f64
        };
        println!(
            "    slowest {top} from {} prompt(s); the costliest prompt's median {:.2} us; \
             table probes per find: all {:.1}, slowest {:.1}",
            slow_prompts.len(),
            costliest.as_secs_f64() * 1e6,
            mean_probes(&samples),
            mean_probes(&by_time[..top]),
        );
        if e.name == "ours" {
            // The control: fixed work of the same median length, no index.
            let target = Duration::from_nanos(pct(all.clone(), 0.5) as u64 * 1000);
            let control = control_times(target, samples.len());
            println!(
                    "    control (fixed work, same median, {} runs): p50/p99/p99.9 {:.2}/{:.2}/{:.2} us",
                    control.len(),
                    pct(control.clone(), 0.5),
                    pct(control.clone(), 0.99),
                    pct(control, 0.999),
                );
        }
    });
}

/// `n` timings of one fixed piece of work (xxh3 over a 4 KiB buffer, as
/// often as makes its median about `target`): what the host alone does to
/// a computation of that length, without an index or a prompt in memory.
fn control_times(target: Duration, n: usize) -> Vec<Duration> {
    let buf: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    let work = |reps: u32| {
        let mut h = 0u64;
        for r in 0..reps {
            h ^= xxhash_rust::xxh3::xxh3_64_with_seed(black_box(&buf), u64::from(r));
        }
        black_box(h);
    };
    let mut reps = 1u32;
    loop {
        let t = Instant::now();
        work(reps);
        if t.elapsed() >= target || reps > 1 << 20 {
            break;
        }
        reps *= 2;
    }
    // The first power of two past the target: within 2x of it.
    (0..n)
        .map(|_| {
            let t = Instant::now();
            work(reps);
            t.elapsed()
        })
        .collect()
}

/// This thread's total time waiting on a run queue, in ns (the second
/// field of `/proc/thread-self/schedstat`; 0 where there is none).
fn run_queue_wait_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn env_filter(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Ours, the peers (`pre_hashed`: also Dynamo's positional indexer, which
/// needs the engine's own hashes), `runs`, the bare index (`RunIndex`),
/// and `feed`, that index behind the service's event rules, less those `COMPARE_ONLY=ours` (or `dynamo`, `smg`, ..., or several,
/// `ours,feed`) leaves out, for profiling one indexer.
fn contenders(pre_hashed: bool) -> Vec<Entry> {
    let mut entries = vec![entry::<Ours>(), entry::<DynamoRadix>(), entry::<Smg>()];
    if pre_hashed {
        entries.push(entry::<DynamoPositional>());
    }
    entries.push(entry::<Runs>());
    entries.push(entry::<Feed>());
    let only = env_filter("COMPARE_ONLY");
    entries.retain(|e| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|o| o == e.name))
    });
    entries
}

/// The fleets `COMPARE_PODS` lets through.
/// `--profile-along`: `runs` filled with each fleet's trace (pre-hashed;
/// quick unless `COMPARE_TRACE=full`), then each query size's queries
/// answered by `prefix_matches` and by `held_along` (every stretch each pod
/// holds, what Score's closure and chunk rules read), alternating, and the
/// same prompts with their first block replaced (no pod holds their start:
/// `held_along` probes the run heads at every position until it meets a
/// run). Prints the medians.
fn profile_along() {
    let quick = env_filter("COMPARE_TRACE").as_deref() != Some("full");
    for fleet in profiled_fleets() {
        let trace = fleet.trace(quick, 1);
        let runs = Runs::new(&trace, Input::PreHashed);
        for batch in &trace.batches {
            runs.apply(runs.prepare_batch(&trace.nodes, batch));
        }
        for (size, queries) in &trace.queries {
            let prompts: Vec<Vec<u64>> = queries
                .iter()
                .map(|q| {
                    q.nodes
                        .iter()
                        .map(|n| trace.nodes.engine[*n as usize])
                        .collect()
                })
                .collect();
            let headless: Vec<Vec<u64>> = prompts
                .iter()
                .map(|p| {
                    let mut p = p.clone();
                    p[0] ^= 0x5555_5555_5555_5555;
                    p
                })
                .collect();
            let median = |prompts: &[Vec<u64>], f: &dyn Fn(&[u64]) -> usize| {
                let mut ns: Vec<u128> = (0..5)
                    .flat_map(|_| {
                        prompts.iter().map(|p| {
                            let t = Instant::now();
                            black_box(f(black_box(p)));
                            t.elapsed().as_nanos()
                        })
                    })
                    .collect();
                ns.sort_unstable();
                ns[ns.len() / 2] as f64 / 1000.0
            };
            let prefix = median(&prompts, &|p| runs.prefix_matches(p));
            let along = median(&prompts, &|p| runs.held_along(p));
            let headless_prefix = median(&headless, &|p| runs.prefix_matches(p));
            let headless_along = median(&headless, &|p| runs.held_along(p));
            println!(
                "{} pods, {size} blocks: prefix_matches {prefix:.2} us, held_along {along:.2} us; \
                 start held by none: {headless_prefix:.2} us, {headless_along:.2} us (medians)",
                fleet.pods,
            );
        }
    }
}

/// `--profile-clear`: `runs` filled with each fleet's trace (pre-hashed;
/// `COMPARE_TRACE=full` for the full one), and with a large fleet whose
/// pods share nothing; then every pod's entries evicted, 1,024 at a time
/// (pods in turn, as a capacity bound evicts), or every pod cleared in
/// turn (as restarts clear them): the time per entry evicted, per clear.
fn profile_clear() {
    let quick = env_filter("COMPARE_TRACE").as_deref() != Some("full");
    for fleet in profiled_fleets() {
        let trace = fleet.trace(quick, 1);
        let filled = || {
            let runs = Runs::new(&trace, Input::PreHashed);
            for batch in &trace.batches {
                runs.apply(runs.prepare_batch(&trace.nodes, batch));
            }
            runs
        };
        let runs = filled();
        let label = format!("{} pods, {} distinct blocks", fleet.pods, runs.blocks());
        evict_all(&label, fleet.pods as u32, |pod, n| runs.evict(pod, n));
        let runs = filled();
        clear_all(&label, fleet.pods as u32, |pod| runs.clear(pod));
        assert_eq!(runs.blocks(), 0, "every pod cleared");
    }
    // A large fleet whose pods share nothing: 4,096 pods, each holding 32
    // chains of 16 blocks (2M blocks in 131K runs).
    let (pods, chains, len) = (4_096u32, 32u64, 16u64);
    let filled = || {
        let ix = indexer::index::RunIndex::new();
        for pod in 0..pods {
            for chain in 0..chains {
                let first = (u64::from(pod) * chains + chain) * len;
                ix.store(pod, indexer::event::Tier::Gpu, None, &chain_of(first, len));
            }
        }
        ix
    };
    let label = format!(
        "{pods} pods sharing nothing, {} blocks",
        pods as u64 * chains * len
    );
    let ix = filled();
    evict_all(&label, pods, |pod, n| ix.evict(pod, n).len());
    let ix = filled();
    clear_all(&label, pods, |pod| ix.clear(pod));
    assert_eq!(ix.blocks(), 0, "every pod cleared");
    // One pod holding many short chains (65,536 of 4 blocks): what an
    // eviction that sorted the pod's holdings paid for on every call.
    let ix = indexer::index::RunIndex::new();
    for chain in 0..65_536u64 {
        ix.store(0, indexer::event::Tier::Gpu, None, &chain_of(4 * chain, 4));
    }
    evict_all("1 pod, 65,536 chains of 4 blocks", 1, |pod, n| {
        ix.evict(pod, n).len()
    });
}

/// `len` distinct hashes, the `first`-th on (no two calls' ranges meet).
fn chain_of(first: u64, len: u64) -> Vec<u64> {
    (first..first + len)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        .collect()
}

/// Evicts every pod's entries, 1,024 at a time, pods in turn.
fn evict_all(label: &str, pods: u32, evict: impl Fn(u32, usize) -> usize) {
    let t = Instant::now();
    let mut evicted = 0;
    loop {
        let round: usize = (0..pods).map(|pod| evict(pod, 1_024)).sum();
        if round == 0 {
            break;
        }
        evicted += round;
    }
    let ns = t.elapsed().as_secs_f64() * 1e9 / evicted as f64;
    println!("{label}: {ns:.0} ns per entry evicted ({evicted} entries)");
}

fn clear_all(label: &str, pods: u32, clear: impl Fn(u32)) {
    let t = Instant::now();
    for pod in 0..pods {
        clear(pod);
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / f64::from(pods);
    println!("{label}: {us:.1} us per pod cleared");
}

fn profiled_fleets() -> impl Iterator<Item = &'static Fleet> {
    let pods_only: Option<usize> = env_filter("COMPARE_PODS").and_then(|p| p.parse().ok());
    FLEETS
        .iter()
        .filter(move |f| pods_only.is_none_or(|p| p == f.pods))
}

/// The quick traces' (fleet, input, indexer) combinations that
/// `COMPARE_PODS`, `COMPARE_INPUT` and `COMPARE_ONLY` let through
/// (`COMPARE_TRACE=full`: the full traces').
fn for_each_profiled(queries_per_size: usize, mut each: impl FnMut(&Fleet, &Trace, Input, &Entry)) {
    let input_only = env_filter("COMPARE_INPUT");
    // `COMPARE_TRACE=full`: the full trace (its fleets share more).
    let quick = env_filter("COMPARE_TRACE").as_deref() != Some("full");
    for fleet in profiled_fleets() {
        let trace = fleet.trace(quick, queries_per_size);
        for input in [Input::PreHashed, Input::Tokens] {
            if input_only.as_deref().is_some_and(|i| i != input.name()) {
                continue;
            }
            for e in &contenders(input == Input::PreHashed) {
                each(fleet, &trace, input, e);
            }
        }
    }
}

/// Each indexer of `for_each_profiled` (40 queries per size) filled with its
/// trace, then `each` for every query size `COMPARE_SIZE` lets through:
/// (fleet, input, indexer, the filled indexer, size index, size).
fn for_each_profiled_size(mut each: impl FnMut(&Fleet, Input, &Entry, &dyn Filled, usize, usize)) {
    let size_only: Option<usize> = env_filter("COMPARE_SIZE").and_then(|s| s.parse().ok());
    for_each_profiled(40, |fleet, trace, input, e| {
        let mut measured = [Measured::default()];
        let mut filled = [(e.fill)(trace, input, &mut measured[0])];
        prepare_all(&mut filled, trace, &mut measured);
        for (si, size) in SIZES.iter().enumerate() {
            if size_only.is_none_or(|s| s == *size) {
                each(fleet, input, e, filled[0].as_ref(), si, *size);
            }
        }
    });
}

/// One untimed pass over a query set: the timed rounds' warm-up, and what
/// `--profile-find` profiles. Returns the finds made.
#[inline(never)]
fn find_pass(filled: &dyn Filled, size: usize) -> usize {
    for q in 0..filled.queries(size) {
        filled.time_find(size, q);
    }
    filled.queries(size)
}

/// `cargo test --all-targets`: every indexer on a tiny trace, answers only.
fn smoke() {
    let trace = Trace::generate(Params {
        pods: 4,
        target_stored: 60_000,
        capacity: 9_000,
        queries_per_size: 10,
        seed: 7,
    });
    assert!(trace.removed_blocks > 0, "the trace must evict");
    let plan = Plan {
        find_rounds: 0,
        find_passes: 0,
        passes: 0,
        timed: false,
    };
    for input in [Input::PreHashed, Input::Tokens] {
        for (name, m) in run_all(&trace, input, plan).0 {
            assert_eq!(
                m.disagreements,
                0,
                "{name} ({}): {:?}",
                input.name(),
                m.first_disagreement
            );
        }
    }
    assert!(floor::apply_pass(&trace) > 0.0);
    println!("compare smoke: every indexer agrees with the pods' caches");
}

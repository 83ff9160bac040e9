//! `kv-indexer simulate`: the race is deterministic, its batches are real
//! vLLM batches our decoder reads, precise routing finds the histories
//! round robin scatters, the page is XML with SVG charts, and the op log
//! replays through an independent model of vLLM's block pool with the same
//! hit counts.

use crate::common::Service;
use simulator::{self as simulate, Options, PolicyResult};

/// Small sizes: a debug build runs each race in well under a second.
const SMALL: &[&str] = &[
    "--pod-blocks",
    "400",
    "--rate",
    "20",
    "--system-tokens",
    "300",
    "--message-tokens",
    "60",
    "--output-tokens",
    "30",
    "--agent-context-tokens",
    "400",
    "--doc-tokens",
    "2000",
    "--unshared-tokens",
    "200",
    "--think-time",
    "2",
];

fn options(extra: &[&str]) -> Options {
    let mut argv = vec!["simulate"];
    argv.extend_from_slice(SMALL);
    argv.extend_from_slice(&["--requests", "160"]);
    if !extra.contains(&"--pods") {
        argv.extend_from_slice(&["--pods", "4"]);
    }
    argv.extend_from_slice(extra);
    parse(argv)
}

/// `kv-indexer simulate ...`'s options (`argv` from "simulate" on), as
/// clap parses them for the binary.
fn parse(argv: Vec<&str>) -> Options {
    #[derive(clap::Parser)]
    struct Simulate {
        #[command(flatten)]
        options: Options,
    }
    <Simulate as clap::Parser>::try_parse_from(argv)
        .expect("valid flags")
        .options
}

fn race(extra: &[&str]) -> Vec<PolicyResult> {
    simulate::race(&options(extra), 16, false, None)
        .expect("the race runs")
        .results
}

fn by_name<'a>(results: &'a [PolicyResult], name: &str) -> &'a PolicyResult {
    results.iter().find(|r| r.policy == name).expect(name)
}

#[test]
fn the_same_seed_gives_the_same_race() {
    // Score latency is wall-clock; everything else is virtual.
    let strip = |mut v: Vec<PolicyResult>| {
        for r in &mut v {
            r.score_us_mean = 0.0;
            r.score_us_p99 = 0.0;
        }
        v
    };
    let a = strip(race(&["--seed", "3"]));
    let b = strip(race(&["--seed", "3"]));
    let c = strip(race(&["--seed", "4"]));
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(a.len(), 8);
}

#[test]
fn every_simulated_batch_decodes_through_our_decoder() {
    for r in race(&["--policies", "precise,round-robin"]) {
        let f = r.feed;
        assert!(f.batches > 0 && f.events_encoded > f.batches, "{f:?}");
        assert_eq!(f.decode_errors, 0, "{}: {f:?}", r.policy);
        assert_eq!(f.events_skipped, 0, "{}: {f:?}", r.policy);
        assert_eq!(f.events_decoded, f.events_encoded, "{}: {f:?}", r.policy);
    }
}

#[test]
fn precise_routing_beats_round_robin_on_multi_turn_chat() {
    let results = race(&[
        "--mix",
        "chat=1",
        "--policies",
        "round-robin,precise,precise-load",
    ]);
    let rr = by_name(&results, "round-robin");
    let precise = by_name(&results, "precise");
    assert!(
        precise.hit_rate > rr.hit_rate + 0.2,
        "precise {} vs round robin {}",
        precise.hit_rate,
        rr.hit_rate
    );
    assert!(precise.reprefilled_tokens < rr.reprefilled_tokens / 4);
    assert!(precise.score_calls == precise.requests as u64);
    assert_eq!(rr.score_calls, 0);
    assert!(by_name(&results, "precise-load").hit_rate > rr.hit_rate);
}

#[test]
fn the_html_page_is_xml_with_one_svg_chart_per_measure() {
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("race.html");
    let json = dir.path().join("race.json");
    let o = options(&[
        "--policies",
        "random,precise",
        "--html",
        html.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    simulate::main(&o, 16, None).unwrap();
    let page = std::fs::read_to_string(&html).unwrap();
    let mut reader = quick_xml::Reader::from_str(&page);
    let (mut svgs, mut polylines, mut rows) = (0, 0, 0);
    loop {
        match reader.read_event().expect("well-formed XML") {
            quick_xml::events::Event::Start(e) | quick_xml::events::Event::Empty(e) => {
                match e.name().as_ref() {
                    b"svg" => {
                        svgs += 1;
                        let ns = e
                            .try_get_attribute("xmlns")
                            .unwrap()
                            .map(|a| a.value.into_owned());
                        assert_eq!(ns.as_deref(), Some(&b"http://www.w3.org/2000/svg"[..]));
                    }
                    b"polyline" => polylines += 1,
                    b"tr" => rows += 1,
                    b"script" | b"link" | b"img" => panic!("the page loads something"),
                    _ => {}
                }
            }
            quick_xml::events::Event::Eof => break,
            _ => {}
        }
    }
    assert_eq!(svgs, 3);
    assert_eq!(polylines, 3 * 2);
    assert_eq!(rows, 1 + 2);
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["results"][1]["policy"], "precise");
    assert_eq!(report["parameters"]["pods"], 4);
}

/// Each recorded op log (`tests/fixtures/simulator/`, written by the
/// simulator) through the simulator's pod, against what vLLM 0.33.0's own
/// `KVCacheManager` answered to the same calls (`vllm_answers.py`): the
/// hits, whether each allocation fit, and the events each call queued.
#[test]
fn the_simulated_pod_answers_every_cache_call_as_vllms_kv_cache_manager() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/simulator");
    for name in ["pressure", "preemption", "chunked"] {
        let log = std::fs::read_to_string(format!("{dir}/{name}.ops.jsonl")).unwrap();
        let vllm: serde_json::Value =
            serde_json::from_slice(&std::fs::read(format!("{dir}/{name}.vllm.json")).unwrap())
                .unwrap();
        assert_eq!(vllm["vllm"], "0.33.0");
        let theirs: Vec<simulate::Answer> =
            serde_json::from_value(vllm["answers"].clone()).unwrap();
        let ours = simulate::replay_op_log(&log).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let differ: Vec<_> = ours.iter().zip(&theirs).filter(|(a, b)| a != b).collect();
        assert!(
            differ.is_empty(),
            "{name}: {} of {} answers differ from vLLM's, first: ours {:?}, vLLM {:?}",
            differ.len(),
            ours.len(),
            differ[0].0,
            differ[0].1
        );
        // What each log is for is in it.
        let count = |needle: &str| log.matches(needle).count();
        let hits = theirs.iter().filter(|a| a.hit_blocks > 0).count();
        assert!(hits > 10, "{name}: {hits} admissions hit the cache");
        let events = |removed: bool| {
            theirs
                .iter()
                .flat_map(|a| &a.events)
                .filter(|e| matches!(e, simulate::Seen::Removed(_)) == removed)
                .count()
        };
        assert!(events(false) > 100, "{name}: few stores");
        if name != "chunked" {
            assert!(events(true) > 100, "{name}: few evictions");
        }
        match name {
            "pressure" => assert!(count("\"ok\":false") > 10, "{name}: no admission waited"),
            "preemption" => assert!(count("\"preempted\":true") > 10, "{name}: few preemptions"),
            _ => assert!(count("\"op\":\"allocate\"") > 1000, "{name}: few chunks"),
        }
    }
}

#[test]
fn a_fully_cached_block_aligned_prompt_is_capped_as_vllm_caps_it() {
    // The same 64-token prompt three times, then a longer one: vLLM caps a
    // hit at len - 1 tokens and recomputes the last block into a duplicate.
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let ids: Vec<String> = (1..=64).map(|i: u32| i.to_string()).collect();
    let more: Vec<String> = (1..=80).map(|i: u32| i.to_string()).collect();
    let line = |at: f64, ids: &[String]| {
        format!(
            "{{\"arrival\": {at}, \"token_ids\": [{}], \"output_tokens\": 3}}\n",
            ids.join(",")
        )
    };
    let text = [
        line(0.0, &ids),
        line(10.0, &ids),
        line(20.0, &ids),
        line(30.0, &more),
    ]
    .concat();
    std::fs::write(&trace, text).unwrap();
    let args = [
        "--trace",
        trace.to_str().unwrap(),
        "--policies",
        "precise",
        "--pods",
        "1",
    ];
    let results = race(&args);
    // Nothing, then 3 of 4 blocks twice (capped), then all 4 of 5.
    assert_eq!(results[0].cached_tokens, 48 + 48 + 64);
    assert_eq!(results[0].prompt_tokens, 64 * 3 + 80);
}

/// `--ops-out` writes what the pods answered as they ran; replayed, the
/// log gives the same answers (so a log recorded for `vllm_answers.py`
/// says all that the run did).
#[test]
fn the_op_log_replays_to_the_answers_it_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let ops = dir.path().join("ops.jsonl");
    // SMALL, with pods a tenth the size and answers seven times as long.
    let mut argv = vec!["simulate"];
    for pair in SMALL.chunks(2) {
        match pair[0] {
            "--pod-blocks" => argv.extend(["--pod-blocks", "64"]),
            "--output-tokens" => argv.extend(["--output-tokens", "200"]),
            _ => argv.extend(pair),
        }
    }
    argv.extend(["--requests", "160", "--pods", "4", "--policies"]);
    argv.extend(["precise,round-robin", "--max-num-batched-tokens", "128"]);
    argv.extend(["--ops-out", ops.to_str().unwrap()]);
    let o = parse(argv);
    simulate::main(&o, 16, None).unwrap();
    let log = std::fs::read_to_string(&ops).unwrap();
    let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    assert_eq!(first["capacity_blocks"], 64);
    assert_eq!(first["block_size"], 16);
    let answers = simulate::replay_op_log(&log).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    let mut admits = 0;
    for a in &answers {
        let op: serde_json::Value = serde_json::from_str(lines[a.line - 1]).unwrap();
        assert_eq!(op["ok"], a.ok, "line {}: {op}", a.line);
        if op["op"] == "admit" {
            assert_eq!(op["hit_blocks"], a.hit_blocks, "line {}: {op}", a.line);
            admits += usize::from(a.ok);
        }
    }
    assert!(admits >= 100, "{admits} admissions");
    assert!(log.contains("\"preempted\":true"));
}

/// The binary's `simulate --json` results, with `extra` flags.
fn simulate_binary(extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .arg("simulate")
        .args(SMALL)
        .args([
            "--requests",
            "60",
            "--pods",
            "3",
            "--policies",
            "precise,round-robin",
        ])
        .args(["--event-delay", "0", "--json", json.to_str().unwrap()])
        .args(extra)
        .output()
        .expect("run simulate");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("precise"));
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

#[tokio::test]
async fn against_a_running_service_the_race_comes_out_as_in_process() {
    let service = Service::start(&[]).await;
    let zmq = service.zmq_bind.clone().unwrap();
    let grpc = service.grpc_addr();
    let remote =
        tokio::task::spawn_blocking(move || simulate_binary(&["--against", &grpc, "--zmq", &zmq]))
            .await
            .unwrap();
    let local = tokio::task::spawn_blocking(|| simulate_binary(&[]))
        .await
        .unwrap();
    assert_eq!(remote["parameters"]["index"], "remote");
    for i in 0..2 {
        let (r, l) = (&remote["results"][i], &local["results"][i]);
        for field in [
            "policy",
            "cached_tokens",
            "reprefilled_tokens",
            "ttft_p90",
            "score_calls",
        ] {
            assert_eq!(r[field], l[field], "{field} of {}", l["policy"]);
        }
    }
    // Each policy's pods are their own model in the service.
    let pods = service.list_pods("sim/model/precise").await;
    assert_eq!(pods.len(), 3);
    assert!(pods.iter().all(|p| p.batches > 1));
}

/// A trace of `(arrival, token ids, output tokens)` and the race over it:
/// 10 ms a step plus 1 ms per prefilled token, events applied at once.
fn hand_checked(requests: &[(f64, Vec<u32>, usize)], extra: &[&str]) -> Vec<PolicyResult> {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let lines: Vec<String> = requests
        .iter()
        .map(|(at, ids, out)| {
            let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
            format!(
                "{{\"arrival\": {at}, \"token_ids\": [{}], \"output_tokens\": {out}}}\n",
                ids.join(",")
            )
        })
        .collect();
    std::fs::write(&trace, lines.concat()).unwrap();
    let mut argv = vec!["simulate", "--trace", trace.to_str().unwrap()];
    argv.extend(["--prefill-per-token", "0.001", "--decode-per-token", "0.01"]);
    argv.extend(["--event-delay", "0"]);
    if !extra.contains(&"--pod-blocks") {
        argv.extend(["--pod-blocks", "400"]);
    }
    argv.extend_from_slice(extra);
    let o = parse(argv);
    simulate::race(&o, 16, false, None).unwrap().results
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn hit_rate_and_ttft_on_a_hand_checked_pair() {
    // r1: 64 tokens at 0, 3 out. Step 1 prefills 64 tokens: 10 + 64 ms,
    // its first token at 74 ms; two decode steps end it at 94 ms.
    // r2: the same 64 tokens and 16 more at 10 s: 4 blocks hit (64 of its
    // 80 tokens), a 16-token prefill, first token at 10 + 26 ms.
    let r1: Vec<u32> = (1..=64).collect();
    let r2: Vec<u32> = (1..=80).collect();
    let results = hand_checked(
        &[(0.0, r1, 3), (10.0, r2, 2)],
        &["--pods", "1", "--policies", "round-robin"],
    );
    let r = &results[0];
    assert_eq!((r.cached_tokens, r.prompt_tokens), (64, 144));
    assert!(close(r.hit_rate, 64.0 / 144.0), "{}", r.hit_rate);
    assert!(close(r.ttft_mean, (0.074 + 0.026) / 2.0), "{}", r.ttft_mean);
    // Nearest rank of two: p50 is the first, p90 and p99 the second.
    assert!(close(r.ttft_p50, 0.026) && close(r.ttft_p90, 0.074) && close(r.ttft_p99, 0.074));
    // Finished by the last arrival: r1 only (r2 ends at 10.036 s).
    assert_eq!((r.completed, r.finished), (1, 2));
    assert!(close(r.all_done_at, 10.036), "{}", r.all_done_at);
    // Uncached: r1's 64 tokens, of which its last block (16 tokens) any pod
    // would compute, and r2's last 16 tokens, all of them its last block.
    assert_eq!(
        (r.reprefilled_tokens, r.cold_tokens, r.preemptions),
        (0, 48, 0)
    );
    assert!(close(r.wait_mean, 0.0));
}

#[test]
fn re_prefilled_counts_what_another_pod_held_at_admission() {
    // Round robin sends r2 to the other pod, which prefills the 64 tokens
    // pod 0 holds (capped at 79 tokens: 4 blocks); precise sends it to pod 0.
    let r1: Vec<u32> = (1..=64).collect();
    let r2: Vec<u32> = (1..=80).collect();
    let results = hand_checked(
        &[(0.0, r1, 3), (10.0, r2, 2)],
        &["--pods", "2", "--policies", "round-robin,precise"],
    );
    let (rr, precise) = (
        by_name(&results, "round-robin"),
        by_name(&results, "precise"),
    );
    assert_eq!(
        (rr.cached_tokens, rr.reprefilled_tokens, rr.cold_tokens),
        (0, 64, 48)
    );
    assert_eq!((precise.cached_tokens, precise.reprefilled_tokens), (64, 0));
    // One request on each pod, or both on pod 0.
    assert_eq!(
        (rr.requests_per_pod_max, rr.requests_per_pod_mean),
        (1, 1.0)
    );
    assert_eq!(
        (precise.requests_per_pod_max, precise.requests_per_pod_mean),
        (2, 1.0)
    );
    let line = simulate::explain(rr);
    assert!(
        line.contains("44% another pod held, 33% none, 22% last blocks"),
        "{line}"
    );
}

#[test]
fn approximate_re_prefills_a_prefix_another_pod_holds_once_its_history_forgot_it() {
    // Approximate remembers 2 of its 64-token blocks per pod. P (128 tokens)
    // goes to pod 0; X (128 other tokens, a 20 s answer) to pod 0 too (a
    // tie, both idle), which pushes P out of approximate's memory, not out of
    // pod 0's cache. P + 16 tokens then matches nowhere in its history, and
    // the tie goes to the idle pod 1, which prefills all 144 tokens while
    // pod 0 holds 128 of them. Precise asks the index: pod 0.
    let p: Vec<u32> = (1..=128).collect();
    let x: Vec<u32> = (1001..=1128).collect();
    let p_more: Vec<u32> = (1..=144).collect();
    let results = hand_checked(
        &[(0.0, p, 2), (1.0, x, 2000), (5.0, p_more, 2)],
        &[
            "--pods",
            "2",
            "--policies",
            "approximate,precise",
            "--approx-capacity",
            "2",
        ],
    );
    let (approx, precise) = (
        by_name(&results, "approximate"),
        by_name(&results, "precise"),
    );
    assert_eq!((approx.cached_tokens, approx.reprefilled_tokens), (0, 128));
    assert_eq!(
        (precise.cached_tokens, precise.reprefilled_tokens),
        (128, 0)
    );
    let line = simulate::explain(approx);
    assert!(line.contains("32% another pod held"), "{line}");
    assert!(line.contains("routing is the cost"), "{line}");
    assert!(simulate::explain(precise).contains("the misses are cold"));
}

#[test]
fn a_decode_that_outgrows_the_pool_preempts_the_last_running_request() {
    // A pod of 4 blocks of 16 tokens. r1 and r2: 16-token prompts, 40
    // tokens out (39 fed back: 55 tokens, 4 blocks each at most). Both are
    // admitted (their prompts fit: one block each) and decode side by side;
    // at their 33rd token each wants a third block, with none left: r2, the
    // last running, is preempted (its blocks freed) and r1 runs to its end
    // in r2's freed blocks; r2 waits until r1 has finished, as its whole
    // sequence (prompt and 16 tokens out) no longer fits beside r1.
    let r1: Vec<u32> = (1..=16).collect();
    let r2: Vec<u32> = (101..=116).collect();
    let results = hand_checked(
        &[(0.0, r1, 40), (0.0, r2, 40)],
        &[
            "--pods",
            "1",
            "--policies",
            "round-robin",
            "--pod-blocks",
            "4",
        ],
    );
    let r = &results[0];
    assert_eq!((r.preemptions, r.finished), (1, 2));
}

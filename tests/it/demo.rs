//! `kv-indexer demo` keeps telling its story: conversations end and new ones
//! begin, evictions show, and late turns still find their history cached
//! (not only the shared system prompt).

use crate::common::free_port;

#[test]
fn late_turns_still_match_more_than_the_system_prompt() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args(["--grpc-addr", &format!("127.0.0.1:{}", free_port())])
        .args(["--metrics-addr", "none"])
        .args(["--zmq-bind", &format!("tcp://127.0.0.1:{}", free_port())])
        .args(["demo", "--turns", "150", "--interval", "0ms"])
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // "turn  97: conversation 12 turn 5 (389 tokens) cached blocks: pod-0=21/24  pod-1=4/24 ..."
    let mut late_followups = 0;
    let mut late_hits = 0;
    for line in stdout.lines().filter(|l| l.starts_with("turn ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let turn: u32 = words[1].trim_end_matches(':').parse().unwrap();
        let conversation_turn: u32 = words[5].parse().unwrap();
        let best = line
            .split("cached blocks:")
            .nth(1)
            .unwrap()
            .split("->")
            .next()
            .unwrap()
            .split_whitespace()
            .map(|p| {
                let (_, m) = p.split_once('=').unwrap();
                m.split('/').next().unwrap().parse::<u32>().unwrap()
            })
            .max()
            .unwrap();
        if turn > 60 && conversation_turn > 1 {
            late_followups += 1;
            // The system prompt is 4 blocks.
            if best > 4 {
                late_hits += 1;
            }
        }
    }
    assert!(
        late_followups >= 60,
        "{late_followups} late follow-up turns:\n{stdout}"
    );
    assert!(
        late_hits * 10 >= late_followups * 9,
        "only {late_hits} of {late_followups} late follow-up turns found their history:\n{stdout}"
    );
    assert!(stdout.contains("evicted"), "no eviction shown:\n{stdout}");
    assert!(
        stdout.contains("ended; conversation"),
        "no conversation ended:\n{stdout}"
    );
}

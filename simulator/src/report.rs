//! What a race produced: per policy, the numbers the table, `--json` and
//! `--html` show, and the op log `--ops-out` writes.

use std::io::Write;

use serde::Serialize;

use super::feed::{FeedStats, ScoreCost};
use super::op_log::{Header, OpLine};
use super::serving::Outcome;

/// How many points the race-over-time series have.
const SERIES_POINTS: usize = 40;

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PolicyResult {
    pub policy: String,
    pub requests: usize,
    /// Finished by the time the last request arrived (the race's end).
    pub completed: usize,
    /// Finished at all (every request not rejected).
    pub finished: usize,
    /// Requests larger than a whole pod.
    pub rejected: usize,
    /// When the last request finished (virtual seconds).
    pub all_done_at: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub hit_rate: f64,
    pub reprefilled_tokens: u64,
    /// Prompt tokens no pod held at admission (first sight, or evicted
    /// everywhere): the misses no router could have avoided. The rest of
    /// the uncached tokens is each prompt's last block, which vLLM always
    /// computes (a hit is capped at `len - 1` tokens).
    pub cold_tokens: u64,
    /// Preemptions (a running request's blocks freed for another's, its
    /// tokens recomputed later).
    pub preemptions: u64,
    /// Mean seconds from arrival to admission (queueing, not prefill).
    pub wait_mean: f64,
    pub ttft_mean: f64,
    pub ttft_p50: f64,
    pub ttft_p90: f64,
    pub ttft_p99: f64,
    pub requests_per_pod_max: usize,
    pub requests_per_pod_mean: f64,
    pub score_calls: u64,
    /// Wall-clock microseconds per Score call (0 without calls).
    pub score_us_mean: f64,
    pub score_us_p99: f64,
    pub feed: FeedStats,
    /// The race over time, by arrival: each point's requests' hit rate
    /// and mean TTFT.
    pub series: Vec<SeriesPoint>,
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct SeriesPoint {
    /// End of the interval (virtual seconds).
    pub t: f64,
    pub hit_rate: f64,
    pub ttft_mean: f64,
    /// Requests finished by `t`.
    pub completed: usize,
}

/// The whole report: parameters and results.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub parameters: serde_json::Value,
    pub results: Vec<PolicyResult>,
}

pub fn summarize(
    policy: String,
    outcomes: &[Outcome],
    arrivals: &[f64],
    pods: usize,
    feed: FeedStats,
    cost: &ScoreCost,
) -> PolicyResult {
    let end = arrivals.iter().copied().fold(0.0, f64::max);
    let served: Vec<&Outcome> = outcomes.iter().filter(|o| !o.rejected).collect();
    let mut ttft: Vec<f64> = served.iter().map(|o| o.ttft).collect();
    ttft.sort_by(f64::total_cmp);
    let prompt: u64 = served.iter().map(|o| o.prompt_tokens as u64).sum();
    let cached: u64 = served.iter().map(|o| o.cached_tokens as u64).sum();
    let mut per_pod = vec![0usize; pods];
    for o in &served {
        per_pod[o.pod] += 1;
    }
    let mut lat = cost.latencies_us.clone();
    lat.sort_by(f64::total_cmp);
    PolicyResult {
        policy,
        requests: outcomes.len(),
        completed: served.iter().filter(|o| o.finished_at <= end).count(),
        finished: served.len(),
        rejected: outcomes.len() - served.len(),
        all_done_at: served.iter().map(|o| o.finished_at).fold(0.0, f64::max),
        prompt_tokens: prompt,
        cached_tokens: cached,
        hit_rate: ratio(cached as f64, prompt as f64),
        reprefilled_tokens: served.iter().map(|o| o.reprefilled_tokens as u64).sum(),
        cold_tokens: served.iter().map(|o| o.cold_tokens as u64).sum(),
        preemptions: served.iter().map(|o| u64::from(o.preemptions)).sum(),
        wait_mean: mean(
            &outcomes
                .iter()
                .zip(arrivals)
                .filter(|(o, _)| !o.rejected)
                .map(|(o, &at)| o.admitted_at - at)
                .collect::<Vec<f64>>(),
        ),
        ttft_mean: mean(&ttft),
        ttft_p50: quantile(&ttft, 0.50),
        ttft_p90: quantile(&ttft, 0.90),
        ttft_p99: quantile(&ttft, 0.99),
        requests_per_pod_max: per_pod.iter().copied().max().unwrap_or(0),
        requests_per_pod_mean: ratio(served.len() as f64, pods as f64),
        score_calls: cost.calls,
        score_us_mean: mean(&lat),
        score_us_p99: quantile(&lat, 0.99),
        feed,
        series: series(outcomes, arrivals, end),
    }
}

fn series(outcomes: &[Outcome], arrivals: &[f64], end: f64) -> Vec<SeriesPoint> {
    let width = end.max(1e-9) / SERIES_POINTS as f64;
    let mut buckets = vec![(0u64, 0u64, 0.0f64, 0usize); SERIES_POINTS];
    for (o, &at) in outcomes.iter().zip(arrivals) {
        if o.rejected {
            continue;
        }
        let b = ((at / width) as usize).min(SERIES_POINTS - 1);
        let (prompt, cached, ttft, n) = &mut buckets[b];
        *prompt += o.prompt_tokens as u64;
        *cached += o.cached_tokens as u64;
        *ttft += o.ttft;
        *n += 1;
    }
    let mut finished: Vec<f64> = outcomes
        .iter()
        .filter(|o| !o.rejected)
        .map(|o| o.finished_at)
        .collect();
    finished.sort_by(f64::total_cmp);
    buckets
        .iter()
        .enumerate()
        .map(|(i, &(prompt, cached, ttft, n))| {
            let t = width * (i + 1) as f64;
            SeriesPoint {
                t,
                hit_rate: ratio(cached as f64, prompt as f64),
                ttft_mean: ratio(ttft, n as f64),
                completed: finished.partition_point(|&f| f <= t),
            }
        })
        .collect()
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn mean(v: &[f64]) -> f64 {
    ratio(v.iter().sum(), v.len() as f64)
}

/// Nearest-rank quantile of sorted values.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n => sorted[((q * n as f64).ceil() as usize).clamp(1, n) - 1],
    }
}

/// The table, one line a policy.
pub fn table(results: &[PolicyResult]) -> String {
    let mut s = format!(
        "{:<20} {:>9} {:>6} {:>13} {:>8} {:>8} {:>8} {:>8} {:>11} {:>7} {:>9}\n",
        "policy",
        "completed",
        "hit%",
        "re-prefilled",
        "ttft_avg",
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "req/pod max",
        "mean",
        "score_us"
    );
    for r in results {
        let score = match r.score_calls {
            0 => "-".to_owned(),
            _ => format!("{:.1}", r.score_us_mean),
        };
        s.push_str(&format!(
            "{:<20} {:>9} {:>6.1} {:>13} {:>8} {:>8} {:>8} {:>8} {:>11} {:>7.1} {:>9}\n",
            r.policy,
            format!("{}/{}", r.completed, r.requests),
            r.hit_rate * 100.0,
            r.reprefilled_tokens,
            secs(r.ttft_mean),
            secs(r.ttft_p50),
            secs(r.ttft_p90),
            secs(r.ttft_p99),
            r.requests_per_pod_max,
            r.requests_per_pod_mean,
            score,
        ));
    }
    s
}

/// One line on a policy's result and its main cause, read from its own
/// figures: where the uncached prompt tokens were (another pod, or none),
/// how the requests spread, how long they queued.
pub fn explain(r: &PolicyResult) -> String {
    let pct = |a: u64, b: u64| 100.0 * ratio(a as f64, b as f64);
    let missed = r.prompt_tokens - r.cached_tokens;
    let spread = ratio(r.requests_per_pod_max as f64, r.requests_per_pod_mean);
    // TTFT is waiting for admission plus prefill: which one is it?
    let queueing = match (r.wait_mean >= r.ttft_mean / 2.0, spread >= 1.5) {
        (true, true) => "a hot spot queues: the busiest pod gets far more than its share",
        (true, false) => "the fleet falls behind: requests queue for a slot",
        (false, _) => "requests barely queue",
    };
    let misses = if missed == 0 {
        "nothing missed"
    } else if r.reprefilled_tokens * 5 >= missed {
        "routing is the cost: it sent requests away from pods that held their prefix"
    } else {
        "the misses are cold: prompts no pod held, which no router could have found"
    };
    format!(
        "{}: {:.1}% of prompt tokens from cache; of the rest {:.0}% another pod held, \
         {:.0}% none, {:.0}% last blocks (always computed); busiest pod {} requests \
         ({:.1}x the mean), {} mean wait for admission, {} preemptions: {queueing}; {misses}",
        r.policy,
        r.hit_rate * 100.0,
        pct(r.reprefilled_tokens, missed),
        pct(r.cold_tokens, missed),
        pct(missed - r.reprefilled_tokens - r.cold_tokens, missed),
        r.requests_per_pod_max,
        spread,
        secs(r.wait_mean),
        r.preemptions,
    )
}

/// Seconds, to three significant places.
pub fn secs(t: f64) -> String {
    match t {
        t if t < 1.0 => format!("{:.0}ms", t * 1e3),
        t if t < 10.0 => format!("{t:.2}s"),
        t if t < 100.0 => format!("{t:.1}s"),
        t => format!("{t:.0}s"),
    }
}

/// Writes one policy's op log: per pod, its capacity line, then its ops in
/// the order the pod ran them.
pub fn write_ops(
    out: &mut impl Write,
    prefix: &str,
    pods: &[Vec<OpLine>],
    capacity: usize,
    block_size: usize,
) -> std::io::Result<()> {
    #[derive(Serialize)]
    struct Line<'a> {
        pod: &'a str,
        #[serde(flatten)]
        op: &'a OpLine,
    }
    for (i, ops) in pods.iter().enumerate() {
        let pod = format!("{prefix}pod-{i}");
        let header = Header {
            pod: pod.clone(),
            capacity_blocks: capacity,
            block_size,
        };
        serde_json::to_writer(&mut *out, &header)?;
        out.write_all(b"\n")?;
        for op in ops {
            serde_json::to_writer(&mut *out, &Line { pod: &pod, op })?;
            out.write_all(b"\n")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.9), 90.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn op_lines_carry_the_pod_and_the_issues_field_names() {
        let mut buf = Vec::new();
        let ops = vec![vec![
            OpLine::Add {
                req: "r1".into(),
                token_ids: vec![1, 2],
            },
            OpLine::Admit {
                req: "r1".into(),
                hit_blocks: 0,
                new_tokens: 2,
                ok: true,
            },
            OpLine::Free {
                req: "r1".into(),
                preempted: false,
            },
        ]];
        write_ops(&mut buf, "x/", &ops, 10, 16).unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert_eq!(
            text,
            "{\"pod\":\"x/pod-0\",\"capacity_blocks\":10,\"block_size\":16}\n\
             {\"pod\":\"x/pod-0\",\"op\":\"add\",\"req\":\"r1\",\"token_ids\":[1,2]}\n\
             {\"pod\":\"x/pod-0\",\"op\":\"admit\",\"req\":\"r1\",\"hit_blocks\":0,\"new_tokens\":2,\"ok\":true}\n\
             {\"pod\":\"x/pod-0\",\"op\":\"free\",\"req\":\"r1\",\"preempted\":false}\n"
        );
    }
}

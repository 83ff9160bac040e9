//! How a router picks a pod for a request. Each policy sees what a real
//! router would: the pods' load (in flight, waiting, KV utilization, as
//! vLLM's metrics show them), and, for the prefix-aware ones, either our
//! index (`precise`, `precise-load`) or its own routing history
//! (`approximate`). None sees the pods' caches directly.

use std::collections::HashMap;

use super::approximate::Approximate;
use super::feed::Feed;
use super::rng::Rng;
use super::workload::Request;

/// The EPP's weights in llm-d's EndpointPickerConfig example.
const PREFIX_WEIGHT: f64 = 3.0;
const QUEUE_WEIGHT: f64 = 2.0;
const KV_WEIGHT: f64 = 2.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    RoundRobin,
    LeastConnections,
    Random,
    Approximate,
    /// The approximate prefix score in the EPP's weighted sum.
    ApproximateLoad,
    Precise,
    PreciseLoad,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::RoundRobin,
        Kind::LeastConnections,
        Kind::Random,
        Kind::Approximate,
        Kind::ApproximateLoad,
        Kind::Precise,
        Kind::PreciseLoad,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::RoundRobin => "round-robin",
            Kind::LeastConnections => "least-connections",
            Kind::Random => "random",
            Kind::Approximate => "approximate",
            Kind::ApproximateLoad => "approximate-load",
            Kind::Precise => "precise",
            Kind::PreciseLoad => "precise-load",
        }
    }

    /// Whether it asks our index (and so can add speculative writes).
    pub fn reads_index(self) -> bool {
        matches!(self, Kind::Precise | Kind::PreciseLoad)
    }
}

/// A policy as named on the command line: `precise`, `precise+spec`, ...
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spec {
    pub kind: Kind,
    /// Speculative writes after the pick.
    pub speculative: bool,
}

impl Spec {
    pub fn name(&self) -> String {
        match self.speculative {
            true => format!("{}+spec", self.kind.name()),
            false => self.kind.name().to_owned(),
        }
    }
}

impl std::str::FromStr for Spec {
    type Err = String;

    fn from_str(s: &str) -> Result<Spec, String> {
        let (base, speculative) = match s.strip_suffix("+spec") {
            Some(b) => (b, true),
            None => (s, false),
        };
        let kind = Kind::ALL
            .into_iter()
            .find(|k| k.name() == base)
            .ok_or_else(|| {
                let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown policy {s:?}: one of {}, optionally +spec",
                    names.join(", ")
                )
            })?;
        if speculative && !kind.reads_index() {
            return Err(format!(
                "{s:?}: speculative writes feed the index, and {base} reads none \
                 (approximate is write-after-pick already)"
            ));
        }
        Ok(Spec { kind, speculative })
    }
}

/// The pods as a router's metrics show them, at the moment of the pick.
pub struct Load<'a> {
    /// Requests sent and not finished (waiting or running).
    pub in_flight: &'a [usize],
    /// Requests waiting to be admitted (vLLM's `num_requests_waiting`).
    pub waiting: &'a [usize],
    /// KV-cache utilization in [0, 1] (vLLM's `kv_cache_usage_perc`).
    pub kv_usage: &'a [f64],
}

/// Blocks written after a pick, believed until `ttl` passes: the window
/// between the pick and the pod's first `BlockStored`, which a burst of
/// same-prefix requests would otherwise scatter into.
struct Speculative {
    ttl: f64,
    /// Per pod: block hash -> when the belief ends.
    pods: Vec<HashMap<u64, f64>>,
    picks: u64,
}

impl Speculative {
    /// Leading blocks believed held: exactly (the first `exact`) or
    /// speculatively.
    fn matched(&self, pod: usize, exact: usize, hashes: &[u64], now: f64) -> usize {
        let spec = &self.pods[pod];
        exact
            + hashes[exact.min(hashes.len())..]
                .iter()
                .take_while(|h| spec.get(h).is_some_and(|&until| until > now))
                .count()
    }

    fn write(&mut self, pod: usize, hashes: &[u64], now: f64) {
        let until = now + self.ttl;
        self.pods[pod].extend(hashes.iter().map(|&h| (h, until)));
        self.picks += 1;
        // Expired beliefs are dropped now and then, not per lookup.
        if self.picks.is_multiple_of(256) {
            for p in &mut self.pods {
                p.retain(|_, until| *until > now);
            }
        }
    }
}

enum State {
    RoundRobin {
        next: usize,
    },
    LeastConnections,
    Random(Rng),
    Approximate {
        history: Box<Approximate>,
        load: bool,
    },
    Precise,
    PreciseLoad,
}

pub struct Policy {
    state: State,
    speculative: Option<Speculative>,
}

impl Policy {
    pub fn new(
        spec: Spec,
        pods: usize,
        seed: u64,
        model: &str,
        approx_capacity: usize,
        speculative_ttl: f64,
    ) -> Policy {
        let state = match spec.kind {
            Kind::RoundRobin => State::RoundRobin { next: 0 },
            Kind::LeastConnections => State::LeastConnections,
            Kind::Random => State::Random(Rng::fork(seed, 99)),
            Kind::Approximate | Kind::ApproximateLoad => State::Approximate {
                history: Box::new(Approximate::new(model, pods, approx_capacity)),
                load: spec.kind == Kind::ApproximateLoad,
            },
            Kind::Precise => State::Precise,
            Kind::PreciseLoad => State::PreciseLoad,
        };
        Policy {
            state,
            speculative: spec.speculative.then(|| Speculative {
                ttl: speculative_ttl,
                pods: vec![HashMap::new(); pods],
                picks: 0,
            }),
        }
    }

    /// The pod for `req`, whose prompt's blocks hash to `hashes` (the
    /// pods' own hashes, for the speculative beliefs), at virtual `now`.
    pub fn pick(
        &mut self,
        req: &Request,
        hashes: &[u64],
        load: &Load<'_>,
        feed: &mut Feed,
        now: f64,
    ) -> anyhow::Result<usize> {
        let pods = load.in_flight.len();
        let pod = match &mut self.state {
            State::RoundRobin { next } => {
                let p = *next % pods;
                *next = (p + 1) % pods;
                p
            }
            State::LeastConnections => best(pods, load, |p| -(load.in_flight[p] as f64)),
            State::Random(rng) => rng.below(pods),
            State::Approximate {
                history,
                load: weighted,
            } => {
                let blocks = history.block_hashes(req.text.as_deref(), &req.prompt);
                let counts = history.scores(&blocks);
                let p = match weighted {
                    true => weighted_pick(load, &counts, blocks.len()),
                    false => best(pods, load, |p| counts[p] as f64),
                };
                history.record(p, &blocks);
                p
            }
            State::Precise | State::PreciseLoad => {
                let mut matched = feed.matched_blocks(&req.prompt, now)?;
                if let Some(s) = &self.speculative {
                    for (p, m) in matched.iter_mut().enumerate() {
                        *m = s.matched(p, *m, hashes, now);
                    }
                }
                match self.state {
                    State::Precise => best(pods, load, |p| matched[p] as f64),
                    _ => weighted_pick(load, &matched, hashes.len()),
                }
            }
        };
        if let Some(s) = &mut self.speculative {
            s.write(pod, hashes, now);
        }
        Ok(pod)
    }
}

/// The EPP's weighted sum: prefix score (`matched` of `total` blocks),
/// queue score and KV-utilization score, each in [0, 1].
fn weighted_pick(load: &Load<'_>, matched: &[usize], total: usize) -> usize {
    let total = total.max(1) as f64;
    let (lo, hi) = min_max(load.waiting);
    best(load.in_flight.len(), load, |p| {
        // llm-d's queue scorer: the shortest queue 1, the longest 0; all
        // equal, all 1.
        let queue = match hi > lo {
            true => 1.0 - (load.waiting[p] - lo) as f64 / (hi - lo) as f64,
            false => 1.0,
        };
        PREFIX_WEIGHT * (matched[p] as f64 / total)
            + QUEUE_WEIGHT * queue
            + KV_WEIGHT * (1.0 - load.kv_usage[p])
    })
}

/// The pod with the highest `score`; ties go to the fewest in flight, then
/// to the lowest index (so a run is deterministic).
fn best(pods: usize, load: &Load<'_>, score: impl Fn(usize) -> f64) -> usize {
    (0..pods)
        .map(|p| (score(p), p))
        .max_by(|(a, pa), (b, pb)| {
            a.total_cmp(b)
                .then(load.in_flight[*pb].cmp(&load.in_flight[*pa]))
                .then(pb.cmp(pa))
        })
        .map_or(0, |(_, p)| p)
}

fn min_max(v: &[usize]) -> (usize, usize) {
    let lo = v.iter().copied().min().unwrap_or(0);
    let hi = v.iter().copied().max().unwrap_or(0);
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_speculation_needs_an_index() {
        let p: Spec = "precise-load+spec".parse().unwrap();
        assert_eq!(p.kind, Kind::PreciseLoad);
        assert!(p.speculative);
        assert_eq!(p.name(), "precise-load+spec");
        assert!("round-robin+spec".parse::<Spec>().is_err());
        assert!("nope".parse::<Spec>().unwrap_err().contains("round-robin"));
    }

    #[test]
    fn ties_go_to_the_pod_with_fewest_in_flight() {
        let load = Load {
            in_flight: &[3, 1, 1],
            waiting: &[0, 0, 0],
            kv_usage: &[0.0; 3],
        };
        assert_eq!(best(3, &load, |_| 1.0), 1);
        assert_eq!(best(3, &load, |p| [5.0, 5.0, 6.0][p]), 2);
    }

    #[test]
    fn a_speculative_belief_extends_the_exact_match_until_its_ttl() {
        let mut s = Speculative {
            ttl: 2.0,
            pods: vec![HashMap::new(); 2],
            picks: 0,
        };
        s.write(1, &[10, 11, 12], 5.0);
        assert_eq!(s.matched(1, 0, &[10, 11, 12, 13], 6.0), 3);
        assert_eq!(s.matched(1, 1, &[10, 11, 99], 6.0), 2);
        assert_eq!(s.matched(1, 0, &[10, 11, 12], 7.5), 0);
        assert_eq!(s.matched(0, 2, &[10, 11, 12], 6.0), 2);
    }
}

//! Routing feedback in the service: the state `RecordRouting`, `Score` and
//! the ingest workers share beside the index.
//!
//! - prompt handles: the keys a `Score` computed, kept a few seconds so the
//!   `RecordRouting` after the pick costs no second tokenization;
//! - the approximate index of `--approximate-model`s;
//! - what routings ended as: the outcome and mismatch counters, the last
//!   mismatches for `Diagnose`, and a warning when mismatches dominate.
//!
//! The routings themselves (speculative entries, the tracker) are the pods'
//! writers' (see `worker`); this module only holds what they report.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indexer::keys::BlockKey;
use indexer::routing::approximate::Approximate;
use indexer::routing::diagnose::{Cause, Mismatch};
use indexer::routing::tracker::{Ended, Outcome};
use indexer::routing::ttl::TtlPolicy;
use parking_lot::Mutex;

use crate::config::RoutingConfig;
use crate::metrics::Metrics;

/// How long a prompt handle lasts.
pub const HANDLE_TTL: Duration = Duration::from_secs(10);
/// Mismatches kept for `Diagnose`.
const RECENT_MISMATCHES: usize = 32;
/// A model's outcomes are weighed over this long for the warning.
const WARN_WINDOW: Duration = Duration::from_secs(60);
/// Fewer mismatches than this in a window never warn.
const WARN_MIN: u64 = 5;
/// Pending routings one pod may have (beyond, its oldest ends).
pub const MAX_PENDING_PER_POD: usize = 4096;

pub struct Feedback {
    pub approximate: Approximate,
    pub handles: PromptHandles,
    pub ttl: TtlPolicy,
    /// Each worker's share of the routings-in-flight budget.
    pub tracked_bytes_per_worker: usize,
    metrics: Arc<Metrics>,
    diagnostics: Mutex<Diagnostics>,
}

#[derive(Default)]
struct Diagnostics {
    recent: VecDeque<Diagnosed>,
    /// Per model: this window's start, confirmed, mismatches by cause.
    window: HashMap<String, Window>,
}

struct Window {
    since: Instant,
    confirmed: u64,
    mismatches: HashMap<Cause, u64>,
}

impl Window {
    fn new(now: Instant) -> Self {
        Window {
            since: now,
            confirmed: 0,
            mismatches: HashMap::new(),
        }
    }

    /// Counts an outcome; at the end of a window in which mismatches
    /// (at least `WARN_MIN`) outnumbered confirmations, says which cause
    /// led, how often, and how many were confirmed.
    fn tally(&mut self, outcome: &Outcome, now: Instant) -> Option<(Cause, u64, u64)> {
        match outcome {
            Outcome::Confirmed { .. } => self.confirmed += 1,
            Outcome::Mismatch(m) => *self.mismatches.entry(m.cause).or_default() += 1,
            Outcome::Unconfirmed => {}
        }
        if now.duration_since(self.since) < WARN_WINDOW {
            return None;
        }
        let total: u64 = self.mismatches.values().sum();
        let verdict = (total >= WARN_MIN && total > self.confirmed)
            .then(|| {
                self.mismatches
                    .iter()
                    .max_by_key(|(c, n)| (**n, c.label()))
                    .map(|(c, n)| (*c, *n, self.confirmed))
            })
            .flatten();
        *self = Window::new(now);
        verdict
    }
}

/// A mismatch as `Diagnose` shows it.
#[derive(Clone, Debug)]
pub struct Diagnosed {
    pub at: Instant,
    pub model: String,
    pub pod: String,
    pub mismatch: Mismatch,
}

impl Feedback {
    pub fn new(config: &RoutingConfig, workers: usize, metrics: Arc<Metrics>) -> Self {
        Feedback {
            approximate: Approximate::new(
                config.approximate_models.iter().cloned(),
                config.approximate_capacity,
                config.approximate_entries(),
            ),
            handles: PromptHandles::new(config.handle_bytes()),
            ttl: config.ttl,
            tracked_bytes_per_worker: config.tracked_bytes() / workers.max(1),
            metrics,
            diagnostics: Mutex::default(),
        }
    }

    /// Counts routings that ended, keeps their mismatches, warns when a
    /// model's mismatches dominate.
    pub fn ended(&self, ended: &[Ended]) {
        if ended.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut warn = Vec::new();
        let mut d = self.diagnostics.lock();
        for e in ended {
            self.metrics.routing_outcome(&e.model, e.outcome.label());
            if let Outcome::Confirmed { delay: Some(delay) } = &e.outcome {
                self.metrics
                    .routing_confirm_seconds
                    .observe(delay.as_secs_f64());
            }
            if let Outcome::Mismatch(m) = &e.outcome {
                self.metrics.routing_mismatch(&e.model, m.cause.label());
            }
            let window = d
                .window
                .entry(e.model.clone())
                .or_insert_with(|| Window::new(now));
            if let Some((cause, n, confirmed)) = window.tally(&e.outcome, now) {
                warn.push((e.model.clone(), cause, n, confirmed));
            }
            if let Outcome::Mismatch(m) = &e.outcome {
                if d.recent.len() == RECENT_MISMATCHES {
                    d.recent.pop_back();
                }
                d.recent.push_front(Diagnosed {
                    at: now,
                    model: e.model.clone(),
                    pod: e.pod.clone(),
                    mismatch: m.clone(),
                });
            }
        }
        drop(d);
        for (model, cause, n, confirmed) in warn {
            tracing::warn!(
                %model,
                cause = cause.label(),
                mismatches = n,
                confirmed,
                "routed prompts are stored by the pods under other keys than ours, so they never \
                 match: {} (Diagnose shows both token sequences)",
                cause.fix()
            );
        }
    }

    /// The last mismatches, newest first (of `model`, if given).
    pub fn mismatches(&self, model: Option<&str>) -> Vec<Diagnosed> {
        self.diagnostics
            .lock()
            .recent
            .iter()
            .filter(|d| model.is_none_or(|m| d.model == m))
            .cloned()
            .collect()
    }
}

/// What a `Score` kept of a prompt for the `RecordRouting` after its pick.
#[derive(Debug)]
pub struct PromptHandle {
    pub model: String,
    /// Keys per block size that `Score` computed.
    pub keys: Vec<(u32, Arc<[BlockKey]>)>,
    /// Keys per page size for pods paging the prompt's bigrams (EAGLE).
    pub bigram_keys: Vec<(u32, Arc<[BlockKey]>)>,
    /// Leading tokens (at most `tracker::KEPT_TOKENS`), for the diagnosis.
    pub tokens: Vec<u32>,
    pub approximate: bool,
}

impl PromptHandle {
    fn cost(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.bigram_keys)
            .map(|(_, k)| k.len() * 8 + 32)
            .sum::<usize>()
            + self.tokens.len() * 4
            + self.model.len()
            + 128
    }
}

/// Recent prompt handles, bounded in bytes, oldest dropped first.
pub struct PromptHandles {
    max_bytes: usize,
    /// Mixed into handle numbers: a handle is not the next integer.
    secret: u64,
    inner: Mutex<Handles>,
}

#[derive(Default)]
struct Handles {
    by_id: HashMap<u64, Arc<PromptHandle>>,
    order: VecDeque<(u64, Instant, usize)>,
    bytes: usize,
    next: u64,
}

impl PromptHandles {
    pub fn new(max_bytes: usize) -> Self {
        let secret = std::collections::hash_map::RandomState::new();
        PromptHandles {
            max_bytes,
            secret: std::hash::BuildHasher::hash_one(&secret, 0x6b76u64),
            inner: Mutex::default(),
        }
    }

    /// Keeps `handle`; returns its number (never 0), or 0 if it does not fit.
    pub fn insert(&self, handle: PromptHandle) -> u64 {
        let cost = handle.cost();
        if cost > self.max_bytes {
            return 0;
        }
        let now = Instant::now();
        let mut h = self.inner.lock();
        while let Some(&(id, at, c)) = h.order.front() {
            if now.duration_since(at) < HANDLE_TTL && h.bytes + cost <= self.max_bytes {
                break;
            }
            h.order.pop_front();
            h.by_id.remove(&id);
            h.bytes -= c;
        }
        h.next += 1;
        let id = xxhash_rust::xxh3::xxh3_64_with_seed(&h.next.to_le_bytes(), self.secret) | 1;
        h.by_id.insert(id, Arc::new(handle));
        h.order.push_back((id, now, cost));
        h.bytes += cost;
        id
    }

    /// A handle not yet expired.
    pub fn get(&self, id: u64) -> Option<Arc<PromptHandle>> {
        let h = self.inner.lock();
        let found = h.by_id.get(&id)?.clone();
        // Expired ones go at the next insert; until then they are refused.
        let fresh = h
            .order
            .iter()
            .find(|(i, _, _)| *i == id)
            .is_some_and(|(_, at, _)| at.elapsed() < HANDLE_TTL);
        fresh.then_some(found)
    }
}

/// The topic's pod name of a cache domain id (`<pod>#dp<r>` -> `<pod>`):
/// what picks the pod's owner.
pub fn topic_pod(name: &str) -> &str {
    match name.rsplit_once("#dp") {
        Some((pod, rank)) if !rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()) => pod,
        _ => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(blocks: usize) -> PromptHandle {
        PromptHandle {
            model: "m".into(),
            keys: vec![(16, (0..blocks as u64).map(BlockKey).collect())],
            bigram_keys: Vec::new(),
            tokens: vec![1; 16],
            approximate: false,
        }
    }

    #[test]
    fn handles_are_bounded_in_bytes_and_oldest_go_first() {
        let one = handle(100).cost();
        let h = PromptHandles::new(one * 3);
        let ids: Vec<u64> = (0..4).map(|_| h.insert(handle(100))).collect();
        assert!(ids.iter().all(|id| *id != 0));
        assert!(h.get(ids[0]).is_none());
        assert!(ids[1..].iter().all(|id| h.get(*id).is_some()));
        assert!(h.get(12345).is_none());
        // Larger than the whole budget: not kept.
        assert_eq!(h.insert(handle(10_000)), 0);
    }

    fn mismatch(cause: Cause) -> Outcome {
        Outcome::Mismatch(Mismatch {
            cause,
            block: 0,
            offset: 0,
            window_start: 0,
            ours: vec![],
            theirs: vec![],
            our_block_size: 16,
            their_block_size: 16,
            agreement: 0,
        })
    }

    #[test]
    fn a_window_where_mismatches_dominate_warns_once_with_the_leading_cause() {
        let t0 = Instant::now();
        let mut w = Window::new(t0);
        for _ in 0..6 {
            assert_eq!(w.tally(&mismatch(Cause::Bos), t0), None);
        }
        w.tally(&mismatch(Cause::Tokens), t0);
        w.tally(&Outcome::Confirmed { delay: None }, t0);
        let end = t0 + WARN_WINDOW;
        assert_eq!(
            w.tally(&Outcome::Unconfirmed, end),
            Some((Cause::Bos, 6, 1))
        );
        // A new window: nothing yet.
        assert_eq!(w.tally(&mismatch(Cause::Bos), end + WARN_WINDOW), None);
        // Mostly confirmed, or too few mismatches: quiet.
        let mut w = Window::new(t0);
        for _ in 0..6 {
            w.tally(&mismatch(Cause::Bos), t0);
            w.tally(&Outcome::Confirmed { delay: None }, t0);
        }
        assert_eq!(w.tally(&Outcome::Unconfirmed, end), None);
        let mut w = Window::new(t0);
        w.tally(&mismatch(Cause::Bos), t0);
        assert_eq!(w.tally(&mismatch(Cause::Bos), end), None);
    }

    #[test]
    fn a_dp_rank_belongs_to_its_pods_owner() {
        assert_eq!(topic_pod("pod-a#dp3"), "pod-a");
        assert_eq!(topic_pod("pod-a"), "pod-a");
        assert_eq!(topic_pod("pod#dpx"), "pod#dpx");
    }
}

//! Every recorded routing, from `RecordRouting` to its one outcome.
//!
//! A pure state machine owned by the pod's writer (the ingest worker that
//! applies the pod's events): it is told of routings, of the pod's stores
//! (after they were applied) and of time, and answers with the routings
//! that ended and how. The writer does the I/O: speculative entries, the
//! metrics, the log.
//!
//! - `confirmed`: the pod holds every block of the prompt as we keyed it
//!   (stored after the routing, or held already), or by the TTL at least
//!   its leading ones;
//! - `mismatch`: nothing matched by the TTL, but the pod stored a chain
//!   that looks like this prompt tokenized otherwise (see `diagnose`);
//! - `unconfirmed`: nothing of it arrived before the TTL.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::diagnose::{diagnose, Mismatch, Ours, SeenStore};
use super::ttl::{TtlEstimator, TtlPolicy};
use crate::keys::BlockKey;

/// Leading tokens of a prompt kept for the diagnosis, per routing.
pub const KEPT_TOKENS: usize = 4096;

/// A routing as `RecordRouting` gave it.
#[derive(Clone, Debug)]
pub struct Routing {
    pub model: String,
    pub pod: String,
    /// The prompt's full blocks, keyed for the pod's block size.
    pub keys: Arc<[BlockKey]>,
    /// Its leading tokens (at most `KEPT_TOKENS`).
    pub tokens: Vec<u32>,
    pub block_size: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// `delay`: from the routing to the last block's store (`None` when the
    /// pod held them already, or only the leading ones arrived in time).
    Confirmed {
        delay: Option<Duration>,
    },
    Mismatch(Mismatch),
    Unconfirmed,
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Confirmed { .. } => "confirmed",
            Outcome::Mismatch(_) => "mismatch",
            Outcome::Unconfirmed => "unconfirmed",
        }
    }
}

/// A routing that ended.
#[derive(Clone, Debug)]
pub struct Ended {
    pub model: String,
    pub pod: String,
    pub outcome: Outcome,
}

struct Pending {
    routing: Routing,
    cost: usize,
    at: Instant,
    until: Instant,
    /// Leading blocks the pod holds exactly, as far as checked.
    held: usize,
    evidence: Option<Mismatch>,
}

/// What recording a routing did.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// When its speculative entries end.
    pub until: Instant,
    pub ttl: Duration,
    /// Set when it ended at once (held already, or not tracked).
    pub ended: Option<Outcome>,
}

/// What the pod's stores did to its routings.
#[derive(Debug, Default)]
pub struct Stored {
    pub ended: Vec<Ended>,
    /// Keys the pod now holds exactly: their speculative entries end.
    pub superseded: Vec<BlockKey>,
}

type PodKey = (String, String);

pub struct Tracker {
    policy: TtlPolicy,
    pending: HashMap<PodKey, Vec<Pending>>,
    ttl: HashMap<PodKey, TtlEstimator>,
    tracked: usize,
    /// Memory of the pending routings (`cost`), at most `max_bytes`.
    bytes: usize,
    max_bytes: usize,
    max_per_pod: usize,
}

/// What a pending routing holds in memory, roughly.
fn cost(r: &Routing) -> usize {
    r.keys.len() * 8 + r.tokens.len() * 4 + r.model.len() + r.pod.len() + 160
}

impl Tracker {
    /// Routings in at most `max_bytes` at once (beyond, a new routing ends
    /// at once, unconfirmed); a pod's beyond `max_per_pod` end its oldest
    /// (unconfirmed).
    pub fn new(policy: TtlPolicy, max_bytes: usize, max_per_pod: usize) -> Self {
        Tracker {
            policy,
            pending: HashMap::new(),
            ttl: HashMap::new(),
            tracked: 0,
            bytes: 0,
            max_bytes,
            max_per_pod: max_per_pod.max(1),
        }
    }

    /// Memory the pending routings hold.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Routings waiting for an outcome.
    pub fn tracked(&self) -> usize {
        self.tracked
    }

    /// The TTL a routing to this pod gets now.
    pub fn ttl(&self, model: &str, pod: &str) -> Duration {
        self.ttl
            .get(&(model.to_owned(), pod.to_owned()))
            .map_or_else(
                || TtlEstimator::default().ttl(self.policy),
                |e| e.ttl(self.policy),
            )
    }

    /// Whether stores of this pod concern any routing.
    pub fn watches(&self, model: &str, pod: &str) -> bool {
        // Allocation-free check first: most pods have nothing pending.
        !self.pending.is_empty()
            && self
                .pending
                .contains_key(&(model.to_owned(), pod.to_owned()))
    }

    /// A routing, of which the pod already holds the leading `held` blocks.
    pub fn record(
        &mut self,
        routing: Routing,
        held: usize,
        now: Instant,
    ) -> (Recorded, Vec<Ended>) {
        let ttl = self.ttl(&routing.model, &routing.pod);
        let until = now + ttl;
        let mut ended = Vec::new();
        if held >= routing.keys.len() {
            let outcome = Outcome::Confirmed { delay: None };
            return (
                Recorded {
                    until,
                    ttl,
                    ended: Some(outcome),
                },
                ended,
            );
        }
        let cost = cost(&routing);
        if self.bytes + cost > self.max_bytes {
            return (
                Recorded {
                    until,
                    ttl,
                    ended: Some(Outcome::Unconfirmed),
                },
                ended,
            );
        }
        let key = (routing.model.clone(), routing.pod.clone());
        let list = self.pending.entry(key).or_default();
        if list.len() >= self.max_per_pod {
            let oldest = list.remove(0);
            self.tracked -= 1;
            self.bytes -= oldest.cost;
            ended.push(end(oldest, Outcome::Unconfirmed));
        }
        self.bytes += cost;
        list.push(Pending {
            routing,
            cost,
            at: now,
            until,
            held,
            evidence: None,
        });
        self.tracked += 1;
        (
            Recorded {
                until,
                ttl,
                ended: None,
            },
            ended,
        )
    }

    /// The pod's stores were applied: `held(keys, from)` counts the leading
    /// blocks of `keys[from..]` it holds exactly now; `seen` are the chains
    /// it stored.
    pub fn stored(
        &mut self,
        model: &str,
        pod: &str,
        seen: &[SeenStore],
        held: impl Fn(&[BlockKey], usize) -> usize,
        now: Instant,
    ) -> Stored {
        let key = (model.to_owned(), pod.to_owned());
        let mut out = Stored::default();
        let Some(list) = self.pending.get_mut(&key) else {
            return out;
        };
        let mut delays = Vec::new();
        let mut i = 0;
        while i < list.len() {
            let p = &mut list[i];
            let now_held = p.held + held(&p.routing.keys, p.held);
            if now_held > p.held {
                out.superseded
                    .extend_from_slice(&p.routing.keys[p.held..now_held]);
                p.held = now_held;
            }
            if p.held >= p.routing.keys.len() {
                let p = list.swap_remove(i);
                self.bytes -= p.cost;
                let delay = now.saturating_duration_since(p.at);
                delays.push(delay);
                out.ended
                    .push(end(p, Outcome::Confirmed { delay: Some(delay) }));
                continue;
            }
            for s in seen {
                let ours = Ours {
                    keys: &p.routing.keys,
                    held: p.held,
                    tokens: &p.routing.tokens,
                    block_size: p.routing.block_size,
                };
                if let Some(m) = diagnose(ours, s) {
                    if p.evidence
                        .as_ref()
                        .is_none_or(|e| m.agreement > e.agreement)
                    {
                        p.evidence = Some(m);
                    }
                }
            }
            i += 1;
        }
        self.tracked -= out.ended.len();
        if list.is_empty() {
            self.pending.remove(&key);
        }
        if !delays.is_empty() {
            let est = self.ttl.entry(key).or_default();
            for d in delays {
                est.observe(d);
            }
        }
        out
    }

    /// Routings whose TTL passed end.
    pub fn expire(&mut self, now: Instant) -> Vec<Ended> {
        let mut ended = Vec::new();
        let mut freed = 0;
        self.pending.retain(|_, list| {
            let mut i = 0;
            while i < list.len() {
                if list[i].until <= now {
                    let p = list.swap_remove(i);
                    freed += p.cost;
                    ended.push(conclude(p));
                } else {
                    i += 1;
                }
            }
            !list.is_empty()
        });
        self.tracked -= ended.len();
        self.bytes -= freed;
        ended
    }

    /// The pod is gone: its routings end now as they stand, and what was
    /// learned of its delays is forgotten.
    pub fn forget_pod(&mut self, model: &str, pod: &str) -> Vec<Ended> {
        let key = (model.to_owned(), pod.to_owned());
        self.ttl.remove(&key);
        let list = self.pending.remove(&key).unwrap_or_default();
        self.bytes -= list.iter().map(|p| p.cost).sum::<usize>();
        let ended: Vec<Ended> = list.into_iter().map(conclude).collect();
        self.tracked -= ended.len();
        ended
    }

    /// Confirmation delays learned for the pod.
    pub fn ttl_samples(&self, model: &str, pod: &str) -> usize {
        self.ttl
            .get(&(model.to_owned(), pod.to_owned()))
            .map_or(0, TtlEstimator::samples)
    }
}

/// A routing's outcome at its TTL: what had arrived by then.
fn conclude(p: Pending) -> Ended {
    let outcome = match (p.held, p.evidence.clone()) {
        (1.., _) => Outcome::Confirmed { delay: None },
        (0, Some(m)) => Outcome::Mismatch(m),
        (0, None) => Outcome::Unconfirmed,
    };
    end(p, outcome)
}

fn end(p: Pending, outcome: Outcome) -> Ended {
    Ended {
        model: p.routing.model,
        pod: p.routing.pod,
        outcome,
    }
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::super::diagnose::{Cause, SeenParent};
    use super::*;

    const BS: u32 = 4;

    fn routing(pod: &str, n: u64) -> Routing {
        Routing {
            model: "m".into(),
            pod: pod.into(),
            keys: (1..=n).map(BlockKey).collect(),
            tokens: (0..n as u32 * BS).map(|t| t + 100).collect(),
            block_size: BS,
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// `held(keys, from)` for a pod holding keys 1..=upto.
    fn holding(upto: u64) -> impl Fn(&[BlockKey], usize) -> usize {
        move |keys, from| keys[from..].iter().take_while(|k| k.0 <= upto).count()
    }

    #[test]
    fn a_prompt_held_already_is_confirmed_at_once_without_a_delay_sample() {
        let mut t = Tracker::new(TtlPolicy::Auto, 1 << 20, 10);
        let (rec, ended) = t.record(routing("a", 3), 3, Instant::now());
        assert_eq!(rec.ended, Some(Outcome::Confirmed { delay: None }));
        assert!(ended.is_empty());
        assert_eq!((t.tracked(), t.ttl_samples("m", "a")), (0, 0));
    }

    #[test]
    fn stores_confirm_a_routing_supersede_its_entries_and_teach_the_ttl() {
        let mut t = Tracker::new(TtlPolicy::Auto, 1 << 20, 10);
        let t0 = Instant::now();
        let (rec, _) = t.record(routing("a", 3), 0, t0);
        assert_eq!((rec.ttl, rec.ended), (ms(2000), None));
        assert!(t.watches("m", "a") && !t.watches("m", "b"));
        // Two of three blocks arrive: not yet confirmed.
        let s = t.stored("m", "a", &[], holding(2), t0 + ms(100));
        assert!(s.ended.is_empty());
        assert_eq!(s.superseded, vec![BlockKey(1), BlockKey(2)]);
        let s = t.stored("m", "a", &[], holding(3), t0 + ms(300));
        assert_eq!(s.superseded, vec![BlockKey(3)]);
        assert_eq!(
            s.ended[0].outcome,
            Outcome::Confirmed {
                delay: Some(ms(300))
            }
        );
        assert_eq!((t.tracked(), t.bytes(), t.ttl_samples("m", "a")), (0, 0, 1));
        assert!(!t.watches("m", "a"));
        // Enough samples: auto follows the pod's delay.
        for i in 0..8 {
            let at = t0 + ms(1000 * (i + 1));
            t.record(routing("a", 1), 0, at);
            t.stored("m", "a", &[], holding(1), at + ms(200));
        }
        assert_eq!(t.ttl("m", "a"), ms(450));
        assert_eq!(t.ttl("m", "other"), ms(2000));
    }

    #[test]
    fn at_the_ttl_a_routing_ends_by_what_arrived() {
        let mut t = Tracker::new(TtlPolicy::Fixed(ms(500)), 1 << 20, 10);
        let t0 = Instant::now();
        t.record(routing("nothing", 3), 0, t0);
        t.record(routing("partly", 3), 0, t0);
        t.record(routing("otherwise", 3), 0, t0);
        t.stored("m", "partly", &[], holding(1), t0 + ms(10));
        let mut bos = vec![1];
        bos.extend(100..111);
        let seen = SeenStore {
            parent: SeenParent::Root,
            first_key: Some(BlockKey(77)),
            tokens: bos,
            block_size: BS,
        };
        t.stored("m", "otherwise", &[seen], holding(0), t0 + ms(10));
        assert!(t.expire(t0 + ms(499)).is_empty());
        let mut ended = t.expire(t0 + ms(500));
        ended.sort_by(|a, b| a.pod.cmp(&b.pod));
        let outcomes: Vec<(&str, &str)> = ended
            .iter()
            .map(|e| (e.pod.as_str(), e.outcome.label()))
            .collect();
        assert_eq!(
            outcomes,
            [
                ("nothing", "unconfirmed"),
                ("otherwise", "mismatch"),
                ("partly", "confirmed")
            ]
        );
        match &ended[1].outcome {
            Outcome::Mismatch(m) => assert_eq!(m.cause, Cause::Bos),
            o => panic!("{o:?}"),
        }
        assert_eq!(t.tracked(), 0);
    }

    #[test]
    fn routings_are_bounded_and_each_ends_once() {
        let three = 3 * cost(&routing("a", 2));
        let mut t = Tracker::new(TtlPolicy::Fixed(ms(500)), three, 2);
        let t0 = Instant::now();
        t.record(routing("a", 2), 0, t0);
        t.record(routing("a", 2), 0, t0);
        // The pod's third ends its oldest.
        let (_, ended) = t.record(routing("a", 2), 0, t0);
        assert_eq!(ended.len(), 1);
        t.record(routing("b", 2), 0, t0);
        assert_eq!(t.tracked(), 3);
        // Past the total bound a routing is not tracked: it ends at once.
        let (rec, _) = t.record(routing("c", 2), 0, t0);
        assert_eq!(rec.ended, Some(Outcome::Unconfirmed));
        assert_eq!(t.forget_pod("m", "a").len(), 2);
        assert_eq!(t.expire(t0 + ms(500)).len(), 1);
        assert_eq!((t.tracked(), t.bytes()), (0, 0));
    }
}

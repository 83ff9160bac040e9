//! Which ingest worker owns each pod: the one writer of its streams.
//!
//! A pod (a `(pod, model)` pair, every topic spelling and DP rank of it) is
//! given to the worker with the fewest pods when it is first seen, and
//! stays there while that worker has a stream of it. Hashing the name
//! instead, as before, left small fleets lopsided: the benchmark's 8 pods
//! fell 7 to 1 on 2 workers, so one core applied seven pods' events while
//! the other idled.
//!
//! One writer per pod, whatever the interleaving: receive threads ask
//! `owner` (which assigns a pod it has not seen), and a worker `claim`s the
//! pod before it creates a stream for it and `release`s it with the
//! stream, all under one lock. A claim by any other worker than the
//! recorded one is refused and names the owner, to which the worker then
//! forwards the work (a message queued just before its pod was released
//! and given to another worker). So a worker holds a stream of a pod only
//! while the table names it, and the table names one worker.
//!
//! Bounded: a pod is kept by a 64-bit hash of its name (two pods that
//! collide share a worker and a count, which is still exact), and an
//! assignment no stream claimed (a name seen once, or refused by the
//! index's bounds) is dropped when the table is full. A live entry is a
//! stream, which the index bounds.

use std::collections::HashMap;
use std::hash::BuildHasher;

use indexer::keys::KeyBuildHasher;
use parking_lot::Mutex;

/// Assignments kept before unclaimed ones are dropped.
pub const MAX_UNCLAIMED: usize = 1 << 16;

pub struct Owners {
    /// Seeds the pod keys: random per process, so that nobody can pick
    /// names that collide (collisions only cost balance, see above).
    seed: u64,
    state: Mutex<State>,
}

#[derive(Clone, Copy, Debug)]
struct Owner {
    worker: usize,
    /// Streams the worker has of the pod: 0 until it claims it.
    streams: u32,
}

struct State {
    /// By pod key: already a hash, so the table only mixes it.
    by_pod: HashMap<u64, Owner, KeyBuildHasher>,
    /// Pods (assigned or claimed) per worker.
    pods: Vec<usize>,
    unclaimed: usize,
}

impl Owners {
    pub fn new(workers: usize) -> Owners {
        Owners {
            seed: std::collections::hash_map::RandomState::new().hash_one(0u64),
            state: Mutex::new(State {
                by_pod: HashMap::default(),
                pods: vec![0; workers.max(1)],
                unclaimed: 0,
            }),
        }
    }

    /// xxh3 of the two names, not SipHash: this runs on the receive
    /// thread for every message (SipHash, and again for the table, was 4%
    /// of the dial thread's samples with 1-block batches).
    fn key(&self, pod: &str, model: &str) -> u64 {
        use xxhash_rust::xxh3::xxh3_64_with_seed;
        let pod = xxh3_64_with_seed(pod.as_bytes(), self.seed);
        xxh3_64_with_seed(model.as_bytes(), pod)
    }

    /// The pod's worker, assigned now (the one with the fewest pods) if it
    /// has none.
    pub fn owner(&self, pod: &str, model: &str) -> usize {
        let key = self.key(pod, model);
        let mut state = self.state.lock();
        if let Some(o) = state.by_pod.get(&key) {
            return o.worker;
        }
        if state.unclaimed >= MAX_UNCLAIMED {
            state.drop_unclaimed();
        }
        let worker = state.fewest();
        state.assign(key, worker, 0);
        worker
    }

    /// Pods assigned to each worker (claimed or not yet), for the metrics.
    pub fn pods_per_worker(&self) -> Vec<usize> {
        self.state.lock().pods.clone()
    }

    /// The pod's worker if it has one (nothing is assigned).
    pub fn find(&self, pod: &str, model: &str) -> Option<usize> {
        let key = self.key(pod, model);
        self.state.lock().by_pod.get(&key).map(|o| o.worker)
    }

    /// `worker` is about to create a stream of the pod: granted if the pod
    /// is its (or nobody's: then it becomes its), else the owner to hand
    /// the work to.
    pub fn claim(&self, pod: &str, model: &str, worker: usize) -> Result<(), usize> {
        let key = self.key(pod, model);
        let mut guard = self.state.lock();
        let state = &mut *guard;
        match state.by_pod.get_mut(&key) {
            Some(o) if o.worker != worker => Err(o.worker),
            Some(o) => {
                if o.streams == 0 {
                    state.unclaimed -= 1;
                }
                o.streams += 1;
                Ok(())
            }
            None => {
                state.assign(key, worker, 1);
                Ok(())
            }
        }
    }

    /// `worker` dropped a stream of the pod (one it claimed); the pod is
    /// nobody's once its last is gone.
    pub fn release(&self, pod: &str, model: &str, worker: usize) {
        let key = self.key(pod, model);
        let mut state = self.state.lock();
        let Some(o) = state.by_pod.get_mut(&key) else {
            return;
        };
        if o.worker != worker || o.streams == 0 {
            debug_assert!(false, "released a pod it did not claim");
            return;
        }
        o.streams -= 1;
        if o.streams == 0 {
            state.by_pod.remove(&key);
            state.pods[worker] -= 1;
        }
    }
}

impl State {
    fn fewest(&self) -> usize {
        (0..self.pods.len())
            .min_by_key(|w| self.pods[*w])
            .unwrap_or(0)
    }

    fn assign(&mut self, key: u64, worker: usize, streams: u32) {
        self.by_pod.insert(key, Owner { worker, streams });
        self.pods[worker] += 1;
        if streams == 0 {
            self.unclaimed += 1;
        }
    }

    /// Forgets every assignment no stream claimed: safe at any time, since
    /// a worker that gets work for such a pod claims it first.
    fn drop_unclaimed(&mut self) {
        let pods = &mut self.pods;
        self.by_pod.retain(|_, o| {
            if o.streams == 0 {
                pods[o.worker] -= 1;
            }
            o.streams > 0
        });
        self.unclaimed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn new_pods_go_to_the_worker_with_the_fewest() {
        let owners = Owners::new(2);
        let got: Vec<usize> = (0..8)
            .map(|i| owners.owner(&format!("ingest-{i}"), "m"))
            .collect();
        assert_eq!(got, [0, 1, 0, 1, 0, 1, 0, 1]);
        // Asked again, the same.
        assert_eq!(owners.owner("ingest-3", "m"), 1);
        assert_eq!(owners.pods_per_worker(), [4, 4]);
    }

    #[test]
    fn a_claim_by_another_worker_names_the_owner() {
        let owners = Owners::new(3);
        let w = owners.owner("p", "m");
        assert_eq!(owners.claim("p", "m", (w + 1) % 3), Err(w));
        assert_eq!(owners.claim("p", "m", w), Ok(()));
        assert_eq!(owners.claim("p", "m", w), Ok(()), "a second DP rank");
        owners.release("p", "m", w);
        assert_eq!(owners.find("p", "m"), Some(w), "one stream left");
        owners.release("p", "m", w);
        assert_eq!(owners.find("p", "m"), None);
        // Free again: whoever claims it first has it.
        assert_eq!(owners.claim("p", "m", 2), Ok(()));
        assert_eq!(owners.owner("p", "m"), 2);
    }

    #[test]
    fn unclaimed_assignments_are_bounded() {
        let owners = Owners::new(2);
        owners.claim("live", "m", 1).unwrap();
        for i in 0..3 * MAX_UNCLAIMED {
            owners.owner(&format!("flood-{i}"), "m");
        }
        let state = owners.state.lock();
        assert!(state.by_pod.len() <= MAX_UNCLAIMED + 1);
        assert_eq!(state.pods.iter().sum::<usize>(), state.by_pod.len());
        drop(state);
        assert_eq!(owners.find("live", "m"), Some(1), "claimed pods stay");
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// A receive thread routes a message of pod `p`.
        Route(u8),
        /// The message reaches its worker (or, forwarded, the owner): it
        /// creates a stream of `p` if it has none.
        Deliver(u8),
        /// A worker drops its stream of `p`, if it has one.
        Forget(u8),
        /// The table fills: unclaimed assignments go.
        Flood,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..6).prop_map(Op::Route),
            (0u8..6).prop_map(Op::Deliver),
            (0u8..6).prop_map(Op::Forget),
            Just(Op::Flood),
        ]
    }

    proptest! {
        /// Whatever the interleaving, at most one worker has streams of a
        /// pod, the table names that worker, and the counts add up.
        #[test]
        fn a_pod_has_at_most_one_writer(ops in prop::collection::vec(op(), 1..200)) {
            const WORKERS: usize = 3;
            let owners = Owners::new(WORKERS);
            // Messages routed but not yet delivered: (pod, worker).
            let mut in_flight: Vec<(u8, usize)> = Vec::new();
            // streams[w][p]: worker w has a stream of pod p.
            let mut streams = [[false; 6]; WORKERS];
            for op in ops {
                match op {
                    Op::Route(p) => in_flight.push((p, owners.owner(&p.to_string(), "m"))),
                    Op::Deliver(p) => {
                        let Some(i) = in_flight.iter().position(|(q, _)| *q == p) else {
                            continue;
                        };
                        let (_, mut w) = in_flight.remove(i);
                        // Forwarded until some worker may hold it.
                        loop {
                            if streams[w][p as usize] {
                                break;
                            }
                            match owners.claim(&p.to_string(), "m", w) {
                                Ok(()) => {
                                    streams[w][p as usize] = true;
                                    break;
                                }
                                Err(owner) => w = owner,
                            }
                        }
                    }
                    Op::Forget(p) => {
                        for (w, held) in streams.iter_mut().enumerate() {
                            if held[p as usize] {
                                held[p as usize] = false;
                                owners.release(&p.to_string(), "m", w);
                            }
                        }
                    }
                    Op::Flood => owners.state.lock().drop_unclaimed(),
                }
                for p in 0..6usize {
                    let holders: Vec<usize> = streams
                        .iter()
                        .enumerate()
                        .filter(|(_, held)| held[p])
                        .map(|(w, _)| w)
                        .collect();
                    prop_assert!(holders.len() <= 1, "pod {p} on {holders:?}");
                    if let Some(w) = holders.first() {
                        prop_assert_eq!(owners.find(&p.to_string(), "m"), Some(*w));
                    }
                }
                let state = owners.state.lock();
                prop_assert_eq!(state.pods.iter().sum::<usize>(), state.by_pod.len());
                prop_assert_eq!(
                    state.unclaimed,
                    state.by_pod.values().filter(|o| o.streams == 0).count()
                );
            }
        }
    }
}

//! The serving model: each pod runs vLLM 0.33's scheduler loop
//! (`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule` and
//! `update_from_output`) over its own [`PodCache`], as a discrete-event
//! simulation in virtual time (no sleeps: a run is as fast as the CPU and
//! the same on every run).
//!
//! One step of a pod, as vLLM's scheduler runs it with chunked prefill on:
//!
//! 1. A token budget of `max_batched_tokens`.
//! 2. The running requests, in order: each gets its remaining tokens (a
//!    decode's one, or the next chunk of a prefill) up to the budget. If
//!    its blocks do not fit, the last running request is preempted (its
//!    blocks freed, back to the front of the queue, to be recomputed) and
//!    the allocation tried again; a request that preempts itself ends the
//!    pass.
//! 3. Unless this step preempted, the waiting requests in order, while the
//!    budget lasts and fewer than `max_running` run: the cached prefix
//!    (`get_computed_blocks`), then the rest of the sequence up to the
//!    budget, admitted only if the whole sequence fits
//!    (`scheduler_reserve_full_isl`); the first that does not fit blocks
//!    the ones behind it (FCFS).
//! 4. The step takes `decode_per_token` plus `prefill_per_token` for each
//!    token that is not a decode. At its end, every request whose whole
//!    sequence is now computed samples a token: the first one is its TTFT;
//!    the last one finishes it (and is never fed back, so its KV is never
//!    computed); the others are appended and decoded in the next steps.
//!
//! This is vLLM's synchronous loop (`--no-async-scheduling`): with 0.33's
//! default async scheduling, a decode's slots are allocated one step ahead
//! and a finished request's blocks are freed one step later; the cache
//! calls are otherwise the same. A step's events are published when the
//! step ends (`update_from_output` takes them), and the router sees each
//! pod's load at the moment of a pick.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use super::feed::Feed;
use super::op_log::OpLine;
use super::pod_cache::{Allocation, CacheEvent, PodCache, Sequence};
use super::policy::{Load, Policy};
use super::workload::Request;

#[derive(Clone, Copy, Debug)]
pub struct Serving {
    pub pods: usize,
    pub pod_blocks: usize,
    pub block_size: usize,
    /// vLLM's `max_num_seqs`.
    pub max_running: usize,
    /// vLLM's `max_num_batched_tokens`: the token budget of one step.
    pub max_batched_tokens: usize,
    pub prefill_per_token: f64,
    pub decode_per_token: f64,
}

/// What happened to one request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outcome {
    pub pod: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the pod's cache at its admission.
    pub cached_tokens: usize,
    /// Prompt tokens prefilled here that another pod held at admission
    /// (capped as vLLM caps a hit).
    pub reprefilled_tokens: usize,
    /// Prompt tokens no pod held at admission, short of the last block
    /// every pod computes anyway (the hit is capped at `len - 1` tokens).
    pub cold_tokens: usize,
    /// Times it was preempted (its blocks freed and its tokens recomputed).
    pub preemptions: u32,
    /// Its first admission (arrival to admission is its wait).
    pub admitted_at: f64,
    pub ttft: f64,
    pub finished_at: f64,
    /// The request can never fit a pod (more blocks than it has).
    pub rejected: bool,
}

/// A request and the pods' block hashes of its prompt, computed once.
pub struct Prepared<'a> {
    pub request: &'a Request,
    pub hashes: Vec<u64>,
}

/// One policy's run.
pub struct Run {
    pub outcomes: Vec<Outcome>,
    /// Per pod, its op log (empty unless asked for).
    pub ops: Vec<Vec<OpLine>>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// Sorted before arrivals at the same instant: a finish frees blocks
    /// the arrival may need.
    StepEnd {
        pod: usize,
    },
    Arrive {
        req: u32,
    },
}

/// Virtual time as a totally ordered key (times are finite and >= 0, so
/// their bit patterns order as the numbers do).
fn key(t: f64) -> u64 {
    t.max(0.0).to_bits()
}

/// A request on its pod (vLLM's `Request`).
struct Live {
    seq: Sequence,
    /// `num_computed_tokens`.
    computed: usize,
    /// Tokens sampled so far.
    sampled: usize,
}

struct PodState {
    cache: PodCache,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    /// The step in flight: (request, tokens scheduled).
    step: Vec<(u32, usize)>,
    /// What the step's scheduling stored and evicted, published at its end.
    step_events: Vec<CacheEvent>,
    busy: bool,
    ops: Option<Vec<OpLine>>,
}

impl PodState {
    fn log(&mut self, op: impl FnOnce() -> OpLine) {
        if let Some(ops) = &mut self.ops {
            ops.push(op());
        }
    }
}

pub struct Simulation<'a> {
    cfg: Serving,
    requests: &'a [Prepared<'a>],
    root_seed: u64,
    pods: Vec<PodState>,
    live: Vec<Option<Live>>,
    in_flight: Vec<usize>,
    events: BinaryHeap<Reverse<(u64, Event)>>,
    outcomes: Vec<Outcome>,
    /// Called with the number of requests finished (or rejected) so far.
    progress: &'a (dyn Fn(usize) + Sync),
    done: usize,
}

impl<'a> Simulation<'a> {
    pub fn new(
        cfg: Serving,
        requests: &'a [Prepared<'a>],
        root_seed: u64,
        log_ops: bool,
        progress: &'a (dyn Fn(usize) + Sync),
    ) -> Simulation<'a> {
        let pods = (0..cfg.pods)
            .map(|_| PodState {
                cache: PodCache::new(cfg.pod_blocks, cfg.block_size),
                waiting: VecDeque::new(),
                running: Vec::new(),
                step: Vec::new(),
                step_events: Vec::new(),
                busy: false,
                ops: log_ops.then(Vec::new),
            })
            .collect();
        let events = requests
            .iter()
            .map(|p| Reverse((key(p.request.arrival), Event::Arrive { req: p.request.id })))
            .collect();
        Simulation {
            cfg,
            requests,
            root_seed,
            pods,
            live: requests.iter().map(|_| None).collect(),
            in_flight: vec![0; cfg.pods],
            events,
            outcomes: vec![Outcome::default(); requests.len()],
            progress,
            done: 0,
        }
    }

    /// Runs every request to its end under `policy`, publishing each pod's
    /// events through `feed`.
    pub fn run(mut self, policy: &mut Policy, feed: &mut Feed) -> anyhow::Result<Run> {
        while let Some(Reverse((t, event))) = self.events.pop() {
            let now = f64::from_bits(t);
            match event {
                Event::Arrive { req } => self.arrive(req, now, policy, feed)?,
                Event::StepEnd { pod } => self.step_end(pod, now, feed)?,
            }
        }
        feed.deliver(f64::INFINITY);
        let ops = self
            .pods
            .iter_mut()
            .map(|p| p.ops.take().unwrap_or_default())
            .collect();
        Ok(Run {
            outcomes: self.outcomes,
            ops,
        })
    }

    fn arrive(
        &mut self,
        req: u32,
        now: f64,
        policy: &mut Policy,
        feed: &mut Feed,
    ) -> anyhow::Result<()> {
        let p = &self.requests[req as usize];
        let waiting: Vec<usize> = self.pods.iter().map(|s| s.waiting.len()).collect();
        let kv_usage: Vec<f64> = self.pods.iter().map(|s| s.cache.usage()).collect();
        let load = Load {
            in_flight: &self.in_flight,
            waiting: &waiting,
            kv_usage: &kv_usage,
        };
        let pod = policy.pick(p.request, &p.hashes, &load, feed, now)?;
        let out = &mut self.outcomes[req as usize];
        out.pod = pod;
        out.prompt_tokens = p.request.prompt.len();
        let longest = p.request.prompt.len() + fed_back(p.request);
        if self.pods[pod].cache.check_fits(longest).is_err() {
            out.rejected = true;
            self.done += 1;
            (self.progress)(self.done);
            return Ok(());
        }
        self.live[req as usize] = Some(Live {
            seq: Sequence::new(p.request.prompt.clone(), p.hashes.clone()),
            computed: 0,
            sampled: 0,
        });
        self.in_flight[pod] += 1;
        let state = &mut self.pods[pod];
        state.waiting.push_back(req);
        state.log(|| OpLine::Add {
            req: p.request.name.clone(),
            token_ids: p.request.prompt.clone(),
        });
        if !state.busy {
            self.schedule(pod, now);
        }
        Ok(())
    }

    /// One `Scheduler.schedule` on `pod` at `now`; starts the step.
    fn schedule(&mut self, pod: usize, now: f64) {
        // Names for the op log, cloned only when it is kept.
        let requests = self.requests;
        let name = move |req: u32| requests[req as usize].request.name.clone();
        let mut budget = self.cfg.max_batched_tokens;
        let mut step = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        // Running requests first.
        'running: while i < self.pods[pod].running.len() && budget > 0 {
            let req = self.pods[pod].running[i];
            let live = self.live[req as usize].as_ref().expect("running is live");
            let new_tokens = (live.seq.tokens.len() - live.computed).min(budget);
            loop {
                let live = self.live[req as usize].as_ref().expect("running is live");
                let alloc = Allocation {
                    computed: live.computed,
                    new_tokens,
                    hit_blocks: 0,
                    whole_sequence: false,
                };
                let state = &mut self.pods[pod];
                let ok = state.cache.allocate(req, &live.seq, alloc);
                state.log(|| OpLine::Allocate {
                    req: name(req),
                    new_tokens,
                    ok,
                });
                if ok {
                    break;
                }
                let victim = state.running.pop().expect("req itself is running");
                state.cache.free(victim);
                state.waiting.push_front(victim);
                preempted = true;
                self.pods[pod].log(|| OpLine::Free {
                    req: name(victim),
                    preempted: true,
                });
                self.live[victim as usize]
                    .as_mut()
                    .expect("running is live")
                    .computed = 0;
                self.outcomes[victim as usize].preemptions += 1;
                if victim == req {
                    break 'running;
                }
            }
            step.push((req, new_tokens));
            budget -= new_tokens;
            i += 1;
        }
        // Then the waiting ones, unless this step preempted.
        while !preempted && budget > 0 && self.pods[pod].running.len() < self.cfg.max_running {
            let Some(&req) = self.pods[pod].waiting.front() else {
                break;
            };
            let state = &mut self.pods[pod];
            let live = self.live[req as usize].as_ref().expect("waiting is live");
            let hit_blocks = state.cache.computed(&live.seq);
            let hit_tokens = hit_blocks * self.cfg.block_size;
            let new_tokens = (live.seq.tokens.len() - hit_tokens).min(budget);
            let alloc = Allocation {
                computed: 0,
                new_tokens,
                hit_blocks,
                whole_sequence: true,
            };
            let ok = state.cache.allocate(req, &live.seq, alloc);
            self.pods[pod].log(|| OpLine::Admit {
                req: name(req),
                hit_blocks,
                new_tokens,
                ok,
            });
            if !ok {
                break;
            }
            let state = &mut self.pods[pod];
            state.waiting.pop_front();
            state.running.push(req);
            self.live[req as usize]
                .as_mut()
                .expect("waiting is live")
                .computed = hit_tokens;
            if self.outcomes[req as usize].preemptions == 0 {
                self.first_admission(pod, req, hit_tokens, now);
            }
            step.push((req, new_tokens));
            budget -= new_tokens;
        }
        // What the step computes, and how long it takes.
        let mut prefill = 0;
        for &(req, n) in &step {
            let live = self.live[req as usize].as_mut().expect("scheduled is live");
            let decode = n == 1 && live.computed + 1 == live.seq.tokens.len() && live.sampled > 0;
            if !decode {
                prefill += n;
            }
            live.computed += n;
        }
        let state = &mut self.pods[pod];
        state.step_events = state.cache.take_events();
        if step.is_empty() {
            // Nothing to run: nothing was allocated either.
            debug_assert!(state.step_events.is_empty());
            state.busy = false;
            return;
        }
        let took = self.cfg.decode_per_token + prefill as f64 * self.cfg.prefill_per_token;
        state.step = step;
        state.busy = true;
        self.events
            .push(Reverse((key(now + took), Event::StepEnd { pod })));
    }

    /// The outcome's figures at a request's first admission.
    fn first_admission(&mut self, pod: usize, req: u32, hit_tokens: usize, now: f64) {
        let p = &self.requests[req as usize];
        // What the best other pod holds now, capped as vLLM caps a hit.
        let cap = p.request.prompt.len().saturating_sub(1) / self.cfg.block_size;
        let elsewhere = (0..self.pods.len())
            .filter(|&q| q != pod)
            .map(|q| self.pods[q].cache.holds(&p.hashes).min(cap))
            .max()
            .unwrap_or(0);
        let out = &mut self.outcomes[req as usize];
        out.cached_tokens = hit_tokens;
        out.reprefilled_tokens = (elsewhere * self.cfg.block_size).saturating_sub(hit_tokens);
        out.cold_tokens = cap * self.cfg.block_size - hit_tokens - out.reprefilled_tokens;
        out.admitted_at = now;
    }

    /// `update_from_output`: the step's tokens are computed; sample, append,
    /// finish; then the next step.
    fn step_end(&mut self, pod: usize, now: f64, feed: &mut Feed) -> anyhow::Result<()> {
        let step = std::mem::take(&mut self.pods[pod].step);
        let events = std::mem::take(&mut self.pods[pod].step_events);
        feed.publish(pod, now, &events)?;
        for (req, _) in step {
            let r = self.requests[req as usize].request;
            let live = self.live[req as usize].as_mut().expect("scheduled is live");
            if live.computed < live.seq.tokens.len() {
                // A prefill chunk: no token yet.
                continue;
            }
            live.sampled += 1;
            if live.sampled == 1 {
                self.outcomes[req as usize].ttft = now - r.arrival;
            }
            if live.sampled > fed_back(r) {
                let state = &mut self.pods[pod];
                state.cache.free(req);
                state.running.retain(|&q| q != req);
                state.log(|| OpLine::Free {
                    req: r.name.clone(),
                    preempted: false,
                });
                self.live[req as usize] = None;
                self.in_flight[pod] -= 1;
                self.outcomes[req as usize].finished_at = now;
                self.done += 1;
                (self.progress)(self.done);
                continue;
            }
            let token = r.output[live.sampled - 1];
            live.seq
                .append(&[token], self.cfg.block_size, self.root_seed);
            self.pods[pod].log(|| OpLine::Append {
                req: r.name.clone(),
                token_ids: vec![token],
            });
        }
        self.schedule(pod, now);
        Ok(())
    }
}

/// Output tokens whose KV is computed: all but the last, which is sampled
/// and never fed back.
fn fed_back(r: &Request) -> usize {
    r.output.len().saturating_sub(1)
}

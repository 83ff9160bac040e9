//! The serving model, as a discrete-event simulation in virtual time (no
//! sleeps: a run is as fast as the CPU and the same on every run).
//!
//! Per pod: at most `max_running` requests hold KV blocks at once; the rest
//! wait in arrival order, and the head of the queue blocks the others
//! (vLLM's FCFS scheduler). An admitted request is prefilled by the pod's
//! one prefill engine, one prompt at a time, for `prefill_per_token` per
//! uncached prompt token; its first token comes when its prefill ends
//! (TTFT = waiting for admission + waiting for the engine + its own
//! prefill); then it decodes its other output tokens at
//! `decode_per_token` each, alongside the other running requests, and
//! finishes.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use super::feed::Feed;
use super::pod_cache::{OpLine, PodCache};
use super::policy::{Load, Policy};
use super::workload::Request;

#[derive(Clone, Copy, Debug)]
pub struct Serving {
    pub pods: usize,
    pub pod_blocks: usize,
    pub block_size: usize,
    pub max_running: usize,
    pub prefill_per_token: f64,
    pub decode_per_token: f64,
}

/// What happened to one request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outcome {
    pub pod: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the pod's cache.
    pub cached_tokens: usize,
    /// Prompt tokens prefilled here that another pod held at admission.
    pub reprefilled_tokens: usize,
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
    Finish {
        pod: usize,
        req: u32,
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

struct PodState {
    cache: PodCache,
    waiting: VecDeque<u32>,
    running: usize,
    /// When the prefill engine is next free.
    engine_free_at: f64,
}

pub struct Simulation<'a> {
    cfg: Serving,
    requests: &'a [Prepared<'a>],
    pods: Vec<PodState>,
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
                cache: PodCache::new(cfg.pod_blocks, cfg.block_size, root_seed, log_ops),
                waiting: VecDeque::new(),
                running: 0,
                engine_free_at: 0.0,
            })
            .collect();
        let events = requests
            .iter()
            .map(|p| Reverse((key(p.request.arrival), Event::Arrive { req: p.request.id })))
            .collect();
        Simulation {
            cfg,
            requests,
            pods,
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
                Event::Finish { pod, req } => self.finish(pod, req, now, feed)?,
            }
        }
        feed.deliver(f64::INFINITY);
        let ops = self.pods.iter_mut().map(|p| p.cache.take_ops()).collect();
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
        if self.pods[pod]
            .cache
            .check_fits(p.request.prompt.len(), decode_tokens(p.request))
            .is_err()
        {
            out.rejected = true;
            self.done += 1;
            (self.progress)(self.done);
            return Ok(());
        }
        self.in_flight[pod] += 1;
        self.pods[pod].waiting.push_back(req);
        self.admit(pod, now, feed)
    }

    fn finish(&mut self, pod: usize, req: u32, now: f64, feed: &mut Feed) -> anyhow::Result<()> {
        let r = self.requests[req as usize].request;
        let state = &mut self.pods[pod];
        // The last output token is sampled but never fed back: its KV is
        // never computed.
        let fed_back = &r.output[..decode_tokens(r)];
        if !fed_back.is_empty() {
            state.cache.extend(req, fed_back);
        }
        state.cache.finish(req);
        state.running -= 1;
        let events = state.cache.take_events();
        feed.publish(pod, now, &events)?;
        self.in_flight[pod] -= 1;
        self.outcomes[req as usize].finished_at = now;
        self.done += 1;
        (self.progress)(self.done);
        self.admit(pod, now, feed)
    }

    /// Admits from the head of `pod`'s queue while requests fit.
    fn admit(&mut self, pod: usize, now: f64, feed: &mut Feed) -> anyhow::Result<()> {
        while self.pods[pod].running < self.cfg.max_running {
            let Some(&req) = self.pods[pod].waiting.front() else {
                break;
            };
            let p = &self.requests[req as usize];
            let r = p.request;
            // What the best other pod holds now, capped as vLLM caps a hit.
            let cap = r.prompt.len().saturating_sub(1) / self.cfg.block_size;
            let elsewhere = (0..self.pods.len())
                .filter(|&q| q != pod)
                .map(|q| self.pods[q].cache.holds(&p.hashes).min(cap))
                .max()
                .unwrap_or(0);
            let state = &mut self.pods[pod];
            let Some(adm) = state
                .cache
                .admit(req, &r.name, &r.prompt, &p.hashes, decode_tokens(r))
            else {
                break;
            };
            state.waiting.pop_front();
            state.running += 1;
            let events = state.cache.take_events();
            let uncached = r.prompt.len() - adm.cached_tokens;
            let start = now.max(state.engine_free_at);
            let first_token = start + uncached as f64 * self.cfg.prefill_per_token;
            state.engine_free_at = first_token;
            let decode = r.output.len().saturating_sub(1) as f64 * self.cfg.decode_per_token;
            let out = &mut self.outcomes[req as usize];
            out.cached_tokens = adm.cached_tokens;
            out.reprefilled_tokens =
                (elsewhere * self.cfg.block_size).saturating_sub(adm.cached_tokens);
            out.admitted_at = now;
            out.ttft = first_token - r.arrival;
            self.events.push(Reverse((
                key(first_token + decode),
                Event::Finish { pod, req },
            )));
            feed.publish(pod, now, &events)?;
        }
        Ok(())
    }
}

/// Output tokens whose KV is computed (all but the last).
fn decode_tokens(r: &Request) -> usize {
    r.output.len().saturating_sub(1)
}

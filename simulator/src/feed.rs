//! The pods' events into an index and the index's answers back: every batch
//! a simulated pod publishes is encoded as vLLM 0.33 writes it
//! (`vllm_wire`), then either decoded by our real decoder
//! (`wire::decode_batch`) into a real in-process [`Indexer`], or sent to a
//! running service (a [`Service`]: the binary's `simulate --against` sends
//! it over ZeroMQ and asks `Score` over gRPC).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indexer::{wire, Indexer, IndexerConfig, Pod, ScoreQuery};

use super::pod_cache::CacheEvent;
use crate::vllm_wire::{self, WireEvent};

/// A running kv-indexer the simulation feeds instead of an in-process
/// index: one connection per policy (each policy's pods are their own
/// model there).
pub trait Service: Sync {
    /// Connects for `model`'s pods `names`, each announced to the service
    /// with seq 0 (so nothing is lost to a PUB socket's slow join).
    fn connect(&self, model: &str, names: &[String]) -> anyhow::Result<Box<dyn Connection>>;
}

/// One policy's connection to a running service.
pub trait Connection {
    /// Publishes one batch of `pod`'s: its seq and vLLM's payload.
    fn publish(&mut self, pod: &str, seq: u64, payload: Vec<u8>) -> anyhow::Result<()>;

    /// Waits, bounded, until the service applied every batch published
    /// (pod `names[i]`'s up to seq `next[i] - 1`), so a `Score` sees what an
    /// in-process index would: a real router sees events milliseconds
    /// late, a simulation in virtual time would see them seconds late.
    fn wait_applied(&mut self, names: &[String], next: &[u64]) -> anyhow::Result<()>;

    /// `Score` for `tokens` over the pods `names`: (pod, matched blocks).
    fn score(&mut self, tokens: &[u32], names: &[String]) -> anyhow::Result<Vec<(String, u32)>>;
}

/// What went through the wire, for the decoder-path check.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct FeedStats {
    pub batches: u64,
    pub events_encoded: u64,
    /// Events our decoder returned (in process only).
    pub events_decoded: u64,
    /// Batches the decoder refused, and events it skipped.
    pub decode_errors: u64,
    pub events_skipped: u64,
}

/// The cost of asking the index.
#[derive(Clone, Debug, Default)]
pub struct ScoreCost {
    pub calls: u64,
    /// Wall-clock latency of each call, in microseconds.
    pub latencies_us: Vec<f64>,
}

enum Target {
    Local {
        indexer: Box<Indexer>,
        pods: Vec<Arc<Pod>>,
        /// Batches published and not yet applied: (due, pod, seq, payload),
        /// due in order (one delay for all).
        in_transit: VecDeque<(f64, usize, u64, Vec<u8>)>,
    },
    Remote {
        connection: Box<dyn Connection>,
        /// Batches were published since the service last applied them all.
        unconfirmed: bool,
    },
}

pub struct Feed {
    model: String,
    /// Virtual seconds between a pod's publish and the index applying it.
    delay: f64,
    block_size: usize,
    names: Vec<String>,
    position: HashMap<String, usize>,
    /// Next seq per pod.
    seq: Vec<u64>,
    target: Target,
    pub stats: FeedStats,
    pub cost: ScoreCost,
}

impl Feed {
    /// A fresh in-process index for `pods` pods of `model`, applying each
    /// batch `delay` virtual seconds after it was published.
    pub fn local(model: &str, pods: usize, block_size: usize, delay: f64) -> Feed {
        let indexer = Box::new(Indexer::new(IndexerConfig {
            default_block_size: block_size as u32,
            ..IndexerConfig::default()
        }));
        let names = pod_names(pods);
        let handles = names.iter().map(|n| indexer.pod(model, n, None)).collect();
        let mut feed = Feed::new(
            model,
            names,
            block_size,
            0,
            Target::Local {
                indexer,
                pods: handles,
                in_transit: VecDeque::new(),
            },
        );
        feed.delay = delay;
        feed
    }

    /// A running service, reached through `service`.
    pub fn remote(
        model: &str,
        pods: usize,
        block_size: usize,
        service: &dyn Service,
    ) -> anyhow::Result<Feed> {
        let names = pod_names(pods);
        let connection = service.connect(model, &names)?;
        Ok(Feed::new(
            model,
            names,
            block_size,
            1,
            Target::Remote {
                connection,
                unconfirmed: false,
            },
        ))
    }

    fn new(
        model: &str,
        names: Vec<String>,
        block_size: usize,
        first_seq: u64,
        target: Target,
    ) -> Feed {
        Feed {
            model: model.to_owned(),
            delay: 0.0,
            block_size,
            position: names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.clone(), i))
                .collect(),
            seq: vec![first_seq; names.len()],
            names,
            target,
            stats: FeedStats::default(),
            cost: ScoreCost::default(),
        }
    }

    /// Publishes one batch of `pod`'s events, stamped `ts` (virtual seconds).
    pub fn publish(&mut self, pod: usize, ts: f64, events: &[CacheEvent]) -> anyhow::Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let wire_events: Vec<WireEvent<'_>> = events
            .iter()
            .map(|e| match e {
                CacheEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                } => WireEvent::Stored {
                    hashes,
                    parent: *parent,
                    tokens,
                    block_size: self.block_size,
                },
                CacheEvent::Removed { hash } => WireEvent::Removed {
                    hashes: std::slice::from_ref(hash),
                },
            })
            .collect();
        let payload = vllm_wire::encode_batch_at(ts, &wire_events);
        let seq = self.seq[pod];
        self.seq[pod] += 1;
        self.stats.batches += 1;
        self.stats.events_encoded += events.len() as u64;
        match &mut self.target {
            Target::Local { in_transit, .. } => {
                in_transit.push_back((ts + self.delay, pod, seq, payload));
            }
            Target::Remote {
                connection,
                unconfirmed,
            } => {
                connection.publish(&self.names[pod], seq, payload)?;
                *unconfirmed = true;
            }
        }
        Ok(())
    }

    /// Decodes and applies every batch due by `now` (all of them at the
    /// end of a run: `f64::INFINITY`).
    pub fn deliver(&mut self, now: f64) {
        let Target::Local {
            indexer,
            pods,
            in_transit,
        } = &mut self.target
        else {
            return;
        };
        while in_transit.front().is_some_and(|(due, ..)| *due <= now) {
            let Some((_, pod, seq, payload)) = in_transit.pop_front() else {
                break;
            };
            match wire::decode_batch(&payload) {
                Ok(batch) => {
                    self.stats.events_decoded += batch.events.len() as u64;
                    self.stats.events_skipped += u64::from(batch.skipped.unknown_event_types)
                        + u64::from(batch.skipped.malformed_events);
                    indexer.apply(&pods[pod], seq, &batch);
                }
                Err(_) => self.stats.decode_errors += 1,
            }
        }
    }

    /// Leading blocks of `tokens` each pod holds at virtual `now`, as our
    /// index answers `Score`; the call is counted and timed.
    pub fn matched_blocks(&mut self, tokens: &[u32], now: f64) -> anyhow::Result<Vec<usize>> {
        self.deliver(now);
        let mut matched = vec![0; self.names.len()];
        match &mut self.target {
            Target::Local { indexer, .. } => {
                let started = Instant::now();
                let out = indexer.score(&ScoreQuery {
                    model: &self.model,
                    tokens,
                    lora_name: None,
                    cache_salt: None,
                    mm_items: &[],
                    pods: &self.names,
                });
                self.cost.latencies_us.push(micros(started.elapsed()));
                for p in out.pods {
                    if let Some(&i) = self.position.get(&p.pod) {
                        matched[i] = p.matched.matched_blocks as usize;
                    }
                }
            }
            Target::Remote {
                connection,
                unconfirmed,
            } => {
                if *unconfirmed {
                    connection.wait_applied(&self.names, &self.seq)?;
                    *unconfirmed = false;
                }
                let started = Instant::now();
                let pods = connection.score(tokens, &self.names)?;
                self.cost.latencies_us.push(micros(started.elapsed()));
                for (pod, blocks) in pods {
                    if let Some(&i) = self.position.get(&pod) {
                        matched[i] = blocks as usize;
                    }
                }
            }
        }
        self.cost.calls += 1;
        Ok(matched)
    }
}

fn pod_names(pods: usize) -> Vec<String> {
    (0..pods).map(|i| format!("pod-{i}")).collect()
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

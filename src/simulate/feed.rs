//! The pods' events into an index and the index's answers back: every batch
//! a simulated pod publishes is encoded as vLLM 0.33 writes it
//! (`vllm_wire`), then either decoded by our real decoder
//! (`wire::decode_batch`) into a real in-process [`Indexer`], or sent over
//! ZeroMQ to a running service that is asked `Score` over gRPC.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indexer::{wire, Indexer, IndexerConfig, Pod, ScoreQuery};
use tonic::transport::Channel;

use super::pod_cache::CacheEvent;
use crate::proto::kvindexer::v1 as pb;
use crate::vllm_wire::{self, WireEvent};
use crate::zmq_io::Publisher;

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
    Remote(Box<Remote>),
}

struct Remote {
    runtime: tokio::runtime::Runtime,
    client: pb::kv_indexer_client::KvIndexerClient<Channel>,
    publisher: Publisher,
    /// Batches were published since the service last applied them all.
    unconfirmed: bool,
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

    /// A running service: events to its ZeroMQ SUB `zmq`, Score from its
    /// gRPC `grpc`. Each pod announces itself first (seq 0), so nothing
    /// is lost to the PUB socket's slow join.
    pub fn remote(
        model: &str,
        pods: usize,
        block_size: usize,
        grpc: &str,
        zmq: &str,
        context: &zmq::Context,
    ) -> anyhow::Result<Feed> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let grpc = match grpc.starts_with("http") {
            true => grpc.to_owned(),
            false => format!("http://{grpc}"),
        };
        let mut client = runtime
            .block_on(pb::kv_indexer_client::KvIndexerClient::connect(
                grpc.clone(),
            ))
            .map_err(|e| anyhow::anyhow!("no kv-indexer answers at {grpc}: {e}"))?;
        let publisher = Publisher::connect(context, zmq)?;
        let names = pod_names(pods);
        runtime.block_on(crate::publish::announce_pods(
            &publisher,
            model,
            &names,
            &mut client,
        ))?;
        Ok(Feed::new(
            model,
            names,
            block_size,
            1,
            Target::Remote(Box::new(Remote {
                runtime,
                client,
                publisher,
                unconfirmed: false,
            })),
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
            Target::Remote(r) => {
                r.publisher.send(&vllm_wire::frames(
                    &self.names[pod],
                    &self.model,
                    seq,
                    payload,
                ))?;
                r.unconfirmed = true;
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
                    pods: &self.names,
                });
                self.cost.latencies_us.push(micros(started.elapsed()));
                for p in out.pods {
                    if let Some(&i) = self.position.get(&p.pod) {
                        matched[i] = p.matched.matched_blocks as usize;
                    }
                }
            }
            Target::Remote(r) => {
                if r.unconfirmed {
                    wait_applied(r, &self.model, &self.names, &self.seq)?;
                    r.unconfirmed = false;
                }
                let started = Instant::now();
                let resp = r.runtime.block_on(r.client.score(pb::ScoreRequest {
                    model: self.model.clone(),
                    input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                        ids: tokens.to_vec(),
                    })),
                    pods: self.names.clone(),
                    ..Default::default()
                }))?;
                self.cost.latencies_us.push(micros(started.elapsed()));
                for p in resp.into_inner().pods {
                    if let Some(&i) = self.position.get(&p.pod) {
                        matched[i] = p.matched_blocks as usize;
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

/// Waits (bounded) until the service applied every batch published, so a
/// Score sees what an in-process index would: a real router sees events
/// milliseconds late, a simulation in virtual time would see them seconds
/// late.
fn wait_applied(r: &mut Remote, model: &str, names: &[String], next: &[u64]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pods = r
            .runtime
            .block_on(crate::publish::listed(&mut r.client, model))?;
        let done = names.iter().zip(next).all(|(name, &next)| {
            pods.iter()
                .any(|p| &p.pod == name && p.last_seq.is_some_and(|s| s + 1 >= next))
        });
        if done {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the service at --against did not apply the simulated pods' batches within 10 s \
             (is --zmq its SUB endpoint?)"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

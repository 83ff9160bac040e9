//! Prometheus metrics (`kv_indexer_*`) and the HTTP endpoints beside them:
//! `/metrics`, `/healthz` (liveness: the process answers) and `/readyz`
//! (readiness: the sockets are up).
//!
//! Counters on hot paths are plain atomics inside `prometheus-client`
//! metrics; state that already lives in the index (pods, blocks per tier,
//! seq gaps) and in the tokenizers (cache counters) is read at scrape time by
//! a collector instead of being mirrored.
//!
//! Why one file of ~630 lines: every metric's name, help and labels are
//! defined here once, so `/metrics` and docs/operations.md can be read side
//! by side.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indexer::Indexer;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

/// Every metric the service updates directly.
pub struct Metrics {
    registry: Registry,
    /// ZeroMQ messages received, before any check.
    pub messages_received: Counter,
    /// Messages skipped whole, by reason (frame_count, topic, seq, decode).
    pub messages_skipped: Family<Labels, Counter>,
    pub batches_applied: Counter,
    pub events_applied: Counter,
    /// Events or blocks skipped, by reason.
    pub events_skipped: Family<Labels, Counter>,
    pub blocks_stored: Counter,
    pub blocks_removed: Counter,
    pub receive_errors: Counter,
    /// Valid messages dropped because their worker's queue was full.
    pub messages_dropped: Counter,
    /// Event connections open now (pods connected to us, pods we dialed).
    pub zmq_connections: Gauge,
    /// Event connections closed: by the peer, or by libzmq for a frame
    /// over --max-event-message or a protocol error.
    pub zmq_disconnects: Counter,
    /// New pods, models and connections refused by a bound, by `what`.
    pub refused: Family<Labels, Counter>,
    /// gRPC and HTTP connections open, by `listener`.
    pub connections: Family<Labels, Gauge>,
    /// Connections closed to make room for a newer one (`reason="full"`)
    /// or for sending nothing in time (`"first_bytes"`), by `listener`.
    pub connections_shed: Family<Labels, Counter>,
    /// Engine mode: stores whose recomputed hashes disagreed with the pod's.
    pub engine_hash_mismatches: Counter,
    /// Score requests by input kind (token_ids, prompt, chat) and status code.
    pub score_requests: Family<Labels, Counter>,
    /// Score latency in seconds, by input kind.
    pub score_seconds: Family<Labels, Histogram>,
    /// Tokenization (and chat rendering) latency in seconds, by input kind.
    pub tokenize_seconds: Family<Labels, Histogram>,
    /// Replays requested from pods' replay sockets (gaps and catch-up).
    pub replays_requested: Counter,
    /// Batches recovered through replay.
    pub replay_batches: Counter,
    /// Gaps that replay could not fill (the pod is marked incomplete).
    pub unrecoverable_gaps: Counter,
    /// Scoring requests refused because too many were in flight.
    pub rejected_overload: Counter,
    /// Request handlers that panicked (answered INTERNAL).
    pub handler_panics: Counter,
    /// Batches whose application panicked (the pod was reset).
    pub ingest_panics: Counter,
    /// Recorded routings by how they ended (confirmed, mismatch, unconfirmed).
    pub routing_outcomes: Family<Labels, Counter>,
    /// Mismatched routings by cause (bos, block_size, lora_or_salt, tokens).
    pub routing_mismatches: Family<Labels, Counter>,
    /// From RecordRouting to the pod's store of the prompt's last block.
    pub routing_confirm_seconds: Histogram,
    /// Blocks of approximate routing history held.
    pub approximate_entries: Gauge,
    /// Snapshot requests of peer replicas, by outcome (sent, refused,
    /// busy, aborted).
    pub peer_snapshots_served: Family<Labels, Counter>,
    /// Bytes of snapshots sent to peer replicas.
    pub peer_snapshot_bytes_sent: Counter,
    /// Peers this replica could not copy its index from, by reason (keys,
    /// format, auth, busy, unavailable, invalid).
    pub peer_bootstrap_failures: Family<Labels, Counter>,
    /// Routings forwarded to peer replicas, by outcome (sent, dropped: a
    /// peer's queue full, failed: the peer refused or did not answer).
    pub peer_routings_forwarded: Family<Labels, Counter>,
    /// Routings other replicas forwarded here, by outcome (written, ended,
    /// dropped, refused).
    pub peer_routings_received: Family<Labels, Counter>,
    /// From a routing's acceptance to its peer's answer, seconds.
    pub peer_forward_seconds: Histogram,
    /// Where this replica's index started from (`from`: peer, snapshot,
    /// empty): 1 on that one.
    pub started_from: Family<Labels, Gauge>,
    /// Chats sent to a model's render server (`--render-url`), by outcome.
    pub renders: Family<Labels, Counter>,
}

fn latency_buckets() -> Histogram {
    // 10 us .. ~10 s.
    Histogram::new(exponential_buckets(1e-5, 2.5, 16))
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kv_indexer");
        let m = Metrics {
            messages_received: Counter::default(),
            messages_skipped: Family::default(),
            batches_applied: Counter::default(),
            events_applied: Counter::default(),
            events_skipped: Family::default(),
            blocks_stored: Counter::default(),
            blocks_removed: Counter::default(),
            receive_errors: Counter::default(),
            messages_dropped: Counter::default(),
            zmq_connections: Gauge::default(),
            zmq_disconnects: Counter::default(),
            refused: Family::default(),
            connections: Family::default(),
            connections_shed: Family::default(),
            engine_hash_mismatches: Counter::default(),
            score_requests: Family::default(),
            score_seconds: Family::new_with_constructor(latency_buckets),
            tokenize_seconds: Family::new_with_constructor(latency_buckets),
            replays_requested: Counter::default(),
            replay_batches: Counter::default(),
            unrecoverable_gaps: Counter::default(),
            rejected_overload: Counter::default(),
            handler_panics: Counter::default(),
            ingest_panics: Counter::default(),
            routing_outcomes: Family::default(),
            routing_mismatches: Family::default(),
            // 1 ms .. ~30 s.
            routing_confirm_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 16)),
            approximate_entries: Gauge::default(),
            peer_snapshots_served: Family::default(),
            peer_snapshot_bytes_sent: Counter::default(),
            peer_bootstrap_failures: Family::default(),
            started_from: Family::default(),
            renders: Family::default(),
            peer_routings_forwarded: Family::default(),
            peer_routings_received: Family::default(),
            peer_forward_seconds: latency_buckets(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "messages_received",
            "ZeroMQ messages received",
            m.messages_received.clone(),
        );
        r.register(
            "messages_skipped",
            "ZeroMQ messages skipped whole, by reason (frame_count, topic, seq, decode)",
            m.messages_skipped.clone(),
        );
        r.register(
            "batches_applied",
            "Event batches applied to the index",
            m.batches_applied.clone(),
        );
        r.register(
            "events_applied",
            "KV events applied to the index",
            m.events_applied.clone(),
        );
        r.register(
            "events_skipped",
            "Events (or blocks of events) skipped, by reason",
            m.events_skipped.clone(),
        );
        r.register(
            "blocks_stored",
            "Block stores applied (per block and tier)",
            m.blocks_stored.clone(),
        );
        r.register(
            "blocks_removed",
            "Block removals applied (per block and tier)",
            m.blocks_removed.clone(),
        );
        r.register(
            "receive_errors",
            "ZeroMQ receive errors (broken peer streams)",
            m.receive_errors.clone(),
        );
        r.register(
            "messages_dropped",
            "Valid ZeroMQ messages dropped because the ingest queue was full (gaps repaired through replay)",
            m.messages_dropped.clone(),
        );
        r.register(
            "zmq_connections",
            "ZeroMQ event connections open",
            m.zmq_connections.clone(),
        );
        r.register(
            "zmq_disconnects",
            "ZeroMQ event connections closed (by the peer, or for a frame over --max-event-message)",
            m.zmq_disconnects.clone(),
        );
        r.register(
            "refused",
            "New pods, models and connections refused by a bound (--max-pods, --max-models, --max-memory, --zmq-allow), by what",
            m.refused.clone(),
        );
        r.register(
            "connections",
            "gRPC and HTTP connections open, by listener (at most --max-connections each)",
            m.connections.clone(),
        );
        r.register(
            "connections_shed",
            "Connections closed to admit a newer one when --max-connections were open (reason=full: the one silent longest) or for sending nothing within 5 s (reason=first_bytes), by listener",
            m.connections_shed.clone(),
        );
        r.register(
            "engine_hash_mismatches",
            "Engine key mode: stores whose hashes differ from ours (configuration differs from the pods')",
            m.engine_hash_mismatches.clone(),
        );
        r.register(
            "score_requests",
            "Score requests by input kind and gRPC status code",
            m.score_requests.clone(),
        );
        r.register(
            "score_seconds",
            "Score latency by input kind",
            m.score_seconds.clone(),
        );
        r.register(
            "tokenize_seconds",
            "Tokenization (with chat rendering) latency by input kind",
            m.tokenize_seconds.clone(),
        );
        r.register(
            "replays_requested",
            "Replays requested from pods' replay sockets (seq gaps, catch-up on start)",
            m.replays_requested.clone(),
        );
        r.register(
            "replay_batches",
            "Batches recovered through replay",
            m.replay_batches.clone(),
        );
        r.register(
            "unrecoverable_gaps",
            "Seq gaps replay could not fill (the pod is marked incomplete)",
            m.unrecoverable_gaps.clone(),
        );
        r.register(
            "rejected_overload",
            "Scoring requests refused with RESOURCE_EXHAUSTED (too many in flight)",
            m.rejected_overload.clone(),
        );
        r.register(
            "handler_panics",
            "Request handlers that panicked (answered INTERNAL)",
            m.handler_panics.clone(),
        );
        r.register(
            "ingest_panics",
            "Event batches whose application panicked (that pod was reset and flagged incomplete)",
            m.ingest_panics.clone(),
        );
        r.register(
            "routing_outcomes",
            "Recorded routings (RecordRouting) by outcome: confirmed (the pod stored or held the \
             prompt as we keyed it), mismatch (it stored it under other keys), unconfirmed \
             (nothing arrived before the TTL)",
            m.routing_outcomes.clone(),
        );
        r.register(
            "routing_mismatches",
            "Mismatched routings by cause: bos, block_size, lora_or_salt, tokens",
            m.routing_mismatches.clone(),
        );
        r.register(
            "routing_confirm_seconds",
            "Delay from RecordRouting to the pod's store of the prompt's last block",
            m.routing_confirm_seconds.clone(),
        );
        r.register(
            "approximate_entries",
            "Blocks of routing history held for --approximate-model models",
            m.approximate_entries.clone(),
        );
        let build: Family<Labels, Gauge> = Family::default();
        build
            .get_or_create(&vec![("version", env!("CARGO_PKG_VERSION").to_owned())])
            .set(1);
        r.register("build_info", "Build information (value 1)", build);
        r.register(
            "peer_snapshots_served",
            "Snapshot requests of peer replicas, by outcome (sent, refused, busy, aborted)",
            m.peer_snapshots_served.clone(),
        );
        r.register(
            "peer_snapshot_bytes_sent",
            "Bytes of snapshots sent to peer replicas",
            m.peer_snapshot_bytes_sent.clone(),
        );
        r.register(
            "peer_bootstrap_failures",
            "Peers this replica could not copy its index from at start, by reason (keys, format, auth, busy, unavailable, invalid)",
            m.peer_bootstrap_failures.clone(),
        );
        r.register(
            "peer_routings_forwarded",
            "Routings forwarded to peer replicas, by outcome (sent, dropped, failed)",
            m.peer_routings_forwarded.clone(),
        );
        r.register(
            "peer_routings_received",
            "Routings other replicas forwarded here, by outcome (written, ended, dropped, refused)",
            m.peer_routings_received.clone(),
        );
        r.register(
            "peer_forward_seconds",
            "From a routing's acceptance here to a peer replica's answer",
            m.peer_forward_seconds.clone(),
        );
        r.register(
            "renders",
            "Chats sent to a model's render server (--render-url), by outcome (ok, busy, timeout, unreachable, refused, failed)",
            m.renders.clone(),
        );
        r.register(
            "started_from",
            "Where the index started from at this replica's start (from: peer, snapshot, empty): 1 on that one",
            m.started_from.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Counts one more on `family` labelled `label=value`.
    pub fn count(family: &Family<Labels, Counter>, label: &'static str, value: &str) {
        family.get_or_create(&vec![(label, value.to_owned())]).inc();
    }

    pub fn skip_message(&self, reason: &'static str) {
        Metrics::count(&self.messages_skipped, "reason", reason);
    }

    pub fn refuse(&self, what: &'static str) {
        Metrics::count(&self.refused, "what", what);
    }

    pub fn refused(&self, what: &'static str) -> u64 {
        self.refused
            .get_or_create(&vec![("what", what.to_owned())])
            .get()
    }

    pub fn skip_events(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.events_skipped
                .get_or_create(&vec![("reason", reason.to_owned())])
                .inc_by(n);
        }
    }

    pub fn observe_score(&self, input: &'static str, code: tonic::Code, elapsed: Duration) {
        self.score_requests
            .get_or_create(&vec![
                ("input", input.to_owned()),
                ("code", format!("{code:?}")),
            ])
            .inc();
        self.score_seconds
            .get_or_create(&vec![("input", input.to_owned())])
            .observe(elapsed.as_secs_f64());
    }

    pub fn routing_outcome(&self, model: &str, outcome: &'static str) {
        self.routing_outcomes
            .get_or_create(&vec![
                ("model", model.to_owned()),
                ("outcome", outcome.to_owned()),
            ])
            .inc();
    }

    pub fn routing_mismatch(&self, model: &str, cause: &'static str) {
        self.routing_mismatches
            .get_or_create(&vec![
                ("model", model.to_owned()),
                ("cause", cause.to_owned()),
            ])
            .inc();
    }

    pub fn observe_tokenize(&self, input: &'static str, elapsed: Duration) {
        self.tokenize_seconds
            .get_or_create(&vec![("input", input.to_owned())])
            .observe(elapsed.as_secs_f64());
    }

    /// Adds the scrape-time collector over the index and tokenizers.
    pub fn register_state(
        &mut self,
        indexer: Arc<Indexer>,
        tokenizers: Arc<tokenizer::Registry>,
        last_snapshot: crate::snapshots::LastSnapshot,
        owners: Arc<crate::owners::Owners>,
    ) {
        self.registry.register_collector(Box::new(StateCollector {
            indexer,
            tokenizers,
            last_snapshot,
            owners,
        }));
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Gauges and counters read from the index and tokenizers at scrape time.
struct StateCollector {
    indexer: Arc<Indexer>,
    tokenizers: Arc<tokenizer::Registry>,
    last_snapshot: crate::snapshots::LastSnapshot,
    owners: Arc<crate::owners::Owners>,
}

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateCollector")
    }
}

fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: Vec<(Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in rows {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let pods = self.indexer.list_pods(None);
        let mut per_model: std::collections::BTreeMap<&str, i64> = Default::default();
        let mut tiers = [0i64; indexer::event::TIERS];
        let mut gaps = 0u64;
        for p in &pods {
            *per_model.entry(p.model.as_str()).or_default() += 1;
            for (t, n) in p.blocks_per_tier.iter().enumerate() {
                tiers[t] += *n as i64;
            }
            gaps += p.seq_gaps;
        }
        family(
            &mut encoder,
            "pods",
            "Cache domains (pods, DP ranks) seen, by model",
            MetricType::Gauge,
            per_model
                .into_iter()
                .map(|(m, n)| (vec![("model", m.to_owned())], ConstGauge::new(n)))
                .collect(),
        )?;
        family(
            &mut encoder,
            "indexed_blocks",
            "Blocks held, summed over pods, by tier",
            MetricType::Gauge,
            indexer::event::Tier::ALL
                .iter()
                .map(|t| {
                    (
                        vec![("tier", t.name().to_owned())],
                        ConstGauge::new(tiers[t.index()]),
                    )
                })
                .collect(),
        )?;
        family(
            &mut encoder,
            "ingest_worker_pods",
            "Pods each ingest worker applies the events of (each pod has one)",
            MetricType::Gauge,
            self.owners
                .pods_per_worker()
                .into_iter()
                .enumerate()
                .map(|(w, n)| (vec![("worker", w.to_string())], ConstGauge::new(n as i64)))
                .collect(),
        )?;
        family(
            &mut encoder,
            "indexed_keys",
            "Distinct block keys held by at least one pod",
            MetricType::Gauge,
            vec![(vec![], ConstGauge::new(self.indexer.indexed_keys() as i64))],
        )?;
        family(
            &mut encoder,
            "speculative_entries",
            "Speculative (pod, block) entries: routed to the pod, its store not arrived yet",
            MetricType::Gauge,
            vec![(
                vec![],
                ConstGauge::new(self.indexer.speculative().len() as i64),
            )],
        )?;
        family(
            &mut encoder,
            "snapshot_age_seconds",
            "Seconds since the last snapshot was written or loaded (-1: none)",
            MetricType::Gauge,
            vec![(
                vec![],
                ConstGauge::new(crate::snapshots::age_seconds(&self.last_snapshot)),
            )],
        )?;
        family(
            &mut encoder,
            "index_entries",
            "(pod, block) entries held, the unit of --max-blocks",
            MetricType::Gauge,
            vec![(vec![], ConstGauge::new(self.indexer.entries() as i64))],
        )?;
        family(
            &mut encoder,
            "evictions",
            "Blocks evicted to stay within --max-blocks / --max-memory",
            MetricType::Counter,
            vec![(vec![], ConstCounter::new(self.indexer.evictions()))],
        )?;
        family(
            &mut encoder,
            "seq_gaps",
            "Batches whose seq did not follow the pod's previous one",
            MetricType::Counter,
            vec![(vec![], ConstCounter::new(gaps))],
        )?;
        let counts = self.tokenizers.counts();
        family(
            &mut encoder,
            "tokenizers",
            "Tokenizers held, one per source (aliases of a directory share one), by state",
            MetricType::Gauge,
            [
                ("loaded", counts.loaded),
                ("loading", counts.loading),
                ("failed", counts.failed),
            ]
            .into_iter()
            .map(|(state, n)| (vec![("state", state.to_owned())], ConstGauge::new(n as i64)))
            .collect(),
        )?;
        let tokenizers = self.tokenizers.loaded();
        let cache =
            |f: fn(&tokenizer::pieces::CacheStats) -> u64| -> Vec<(Labels, ConstCounter<u64>)> {
                tokenizers
                    .iter()
                    .map(|t| {
                        (
                            vec![("model", t.model.clone())],
                            ConstCounter::new(f(&t.cache().stats)),
                        )
                    })
                    .collect()
            };
        family(
            &mut encoder,
            "tokenization_cache_hits",
            "Prompt pieces served from the tokenization cache, by model",
            MetricType::Counter,
            cache(|s| s.hits.load(Ordering::Relaxed)),
        )?;
        family(
            &mut encoder,
            "tokenization_cache_misses",
            "Prompt pieces tokenized, by model",
            MetricType::Counter,
            cache(|s| s.misses.load(Ordering::Relaxed)),
        )?;
        family(
            &mut encoder,
            "tokenization_cache_hit_bytes",
            "Prompt bytes served from the tokenization cache, by model",
            MetricType::Counter,
            cache(|s| s.hit_bytes.load(Ordering::Relaxed)),
        )?;
        family(
            &mut encoder,
            "tokenization_cache_miss_bytes",
            "Prompt bytes tokenized, by model",
            MetricType::Counter,
            cache(|s| s.miss_bytes.load(Ordering::Relaxed)),
        )?;
        family(
            &mut encoder,
            "tokenization_cache_bytes",
            "Bytes held by the tokenization cache, by model",
            MetricType::Gauge,
            tokenizers
                .iter()
                .map(|t| {
                    (
                        vec![("model", t.model.clone())],
                        ConstGauge::new(t.cache().bytes() as i64),
                    )
                })
                .collect(),
        )?;
        Ok(())
    }
}

/// How long a client of the HTTP port has to send a request's headers
/// (and how long a kept-alive connection may sit idle): a scraper or a
/// kubelet probe sends at once; a connection that sends nothing must not
/// hold a file descriptor and a connection slot forever.
pub const HTTP_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `/metrics`, `/healthz` and `/readyz` until `shutdown` resolves,
/// at most `max_connections` connections at once: a new one takes the slot
/// of the one silent longest (see `admission`), so probes answer whatever
/// holds connections open.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    max_connections: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::http::{header, StatusCode};
    use axum::routing::get;
    let scraped = metrics.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = scraped.clone();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.encode(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.load(Ordering::Relaxed);
                async move {
                    if ready {
                        (StatusCode::OK, "ready\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                    }
                }
            }),
        );
    let admission = crate::admission::Admission::new("http", max_connections, metrics.clone());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let warn = crate::ratelimit::RateLimited::new(Duration::from_secs(10));
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // EMFILE and the like: back off instead of spinning.
                    warn.warn(|suppressed| tracing::warn!(error = %e, suppressed, "cannot accept an HTTP connection"));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(stream) = admission.admit(stream) else {
            continue; // refused and counted; dropping the stream closes it
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HTTP_HEADER_TIMEOUT)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    Ok(())
}

//! Wiring: the index, ingestion, the gRPC server and the HTTP endpoints, up
//! and down.

use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use indexer::Indexer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;
use tonic::codegen::http;
use tonic::transport::Server;

use crate::config::Config;
use crate::first_catch_ups::{FirstCatchUps, Waits};
use crate::grpc::KvIndexerService;
use crate::ingest::Ingest;
use crate::metrics::{serve_http, Metrics};
use crate::proto::kvindexer::v1::kv_indexer_peer_server::KvIndexerPeerServer;
use crate::proto::kvindexer::v1::kv_indexer_server::KvIndexerServer;
use crate::proto::llmd::v1::indexer_service_server::IndexerServiceServer;
use crate::proto::FILE_DESCRIPTOR_SET;

/// tonic refuses a request over `--max-message` with OUT_OF_RANGE; to a
/// client that is a resource limit, RESOURCE_EXHAUSTED, like our other
/// limits. (The refusal comes before any handler runs, as a trailers-only
/// response: the status is in the headers.)
fn oversize_is_resource_exhausted<B>(mut res: http::Response<B>) -> http::Response<B> {
    let oversize = res.headers().get("grpc-status").is_some_and(|v| v == "11")
        && res
            .headers()
            .get("grpc-message")
            .and_then(|m| m.to_str().ok())
            .is_some_and(|m| {
                m.contains("message%20length%20too%20large")
                    || m.contains("message length too large")
            });
    if oversize {
        res.headers_mut()
            .insert("grpc-status", http::HeaderValue::from_static("8"));
    }
    res
}

/// The largest HTTP/2 frame clients may send: a 32K-token Score request
/// (~95-130 KB) in one DATA frame. A frame is read whole before it is handed
/// on, so this is also what one connection may make us buffer at once
/// (the stream window, 2 MiB, bounds it anyway).
const MAX_FRAME_SIZE: u32 = 256 << 10;

/// Largest message between replicas, per 4 (see `peer`).
const CHUNK_LIMIT: usize = 1 << 20;

/// How long in-flight RPCs get to finish after a shutdown signal.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How many connections the kernel queues for `accept`. With the usual 128
/// a burst of new connections (clients reconnecting at once, a flood)
/// overflows the queue, and a probe's SYN is dropped and resent after 1 s:
/// past the kubelet's timeout before we ever see it. The kernel caps this
/// at `net.core.somaxconn` (4,096 by default).
const ACCEPT_BACKLOG: u32 = 4096;

fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind`: a restarted process rebinds at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// Runs the service until `shutdown` resolves, then stops gracefully:
/// ingestion first, then in-flight RPCs finish.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
    let indexer = Arc::new(Indexer::new(config.indexer.clone()));
    let mut sources = config.tokenizers.clone();
    if let Some(hub) = &mut sources.hub {
        hub.timeout = config.hub_timeout;
    }
    let tokenizers = Arc::new(tokenizer::Registry::new(
        sources,
        config.tokenization_cache_bytes,
    ));
    let last_snapshot: crate::snapshots::LastSnapshot = Default::default();
    let mut metrics = Metrics::new();
    // Before any socket opens: readiness means the index is in. From a
    // Ready peer replica if there is one, else the snapshot file.
    let replica = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
    let from_peer = match config.peers.targets.is_empty() {
        true => None,
        false => crate::peer::bootstrap::run(&config, &indexer, &metrics, replica).await,
    };
    let started_from = match (&from_peer, &config.snapshot_dir) {
        (Some(_), _) => "peer",
        (None, Some(dir)) if crate::snapshots::load(dir, &indexer, &last_snapshot) => "snapshot",
        _ => "empty",
    };
    if !config.peers.targets.is_empty() && from_peer.is_none() {
        tracing::warn!(from = started_from, "starting without a peer's index");
    }
    metrics
        .started_from
        .get_or_create(&vec![("from", started_from.to_owned())])
        .set(1);
    // Which ingest worker writes each pod: ingest assigns, metrics show
    // the balance.
    let owners = Arc::new(crate::owners::Owners::new(config.ingest_workers));
    metrics.register_state(
        indexer.clone(),
        tokenizers.clone(),
        last_snapshot.clone(),
        owners.clone(),
    );
    let metrics = Arc::new(metrics);
    let ready = Arc::new(AtomicBool::new(false));

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_not_serving::<KvIndexerServer<KvIndexerService>>()
        .await;

    let listener = listen(config.grpc_addr).map_err(|e| {
        anyhow::anyhow!(
            "cannot listen for gRPC on {}: {e} (change --grpc-addr)",
            config.grpc_addr
        )
    })?;
    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let http = match config.metrics_addr {
        Some(addr) => {
            let l = listen(addr)
                .map_err(|e| {
                    anyhow::anyhow!(
                        "cannot listen for metrics on {addr}: {e} (change --metrics-addr, or `none` to disable)"
                    )
                })?;
            tracing::info!(addr = %l.local_addr()?, "metrics and health on HTTP (/metrics, /healthz, /readyz)");
            Some(tokio::spawn(serve_http(
                l,
                metrics.clone(),
                ready.clone(),
                config.max_connections,
                async {
                    let _ = http_stopped.await;
                },
            )))
        }
        None => None,
    };
    let feedback = Arc::new(crate::feedback::Feedback::new(
        &config.routing,
        config.ingest_workers,
        metrics.clone(),
    ));
    // A restored index is exact once each pod is followed to now, from its
    // replay buffer: fetched when a dialed pod's connection comes up, or when
    // a bound pod with a replay endpoint is adopted.
    let dialing = !config.zmq_connect.is_empty() || config.discovery.is_enabled();
    let first_catch_ups = FirstCatchUps::new(match started_from {
        "empty" => Waits::Nothing,
        _ if dialing => Waits::Dialed,
        _ => Waits::Restored,
    });
    let ingest = Ingest::start(
        &config,
        indexer.clone(),
        metrics.clone(),
        feedback.clone(),
        owners,
        first_catch_ups.clone(),
    )
    .await?;
    // The peer's live speculative entries, to their pods' writers.
    let live = from_peer.map(|c| c.live).unwrap_or_default();
    crate::peer::serve::write_live(&ingest.control(), &indexer, &metrics, live);
    let left = first_catch_ups.wait(config.catch_up_wait).await;
    if left > 0 {
        tracing::warn!(
            pods = left,
            wait = ?config.catch_up_wait,
            "pods not caught up from their replay buffers within --catch-up-wait: ready without them"
        );
    }
    let snapshotter = config.snapshot_dir.clone().map(|dir| {
        tokio::spawn(crate::snapshots::every(
            dir,
            config.snapshot_interval,
            indexer.clone(),
            last_snapshot.clone(),
        ))
    });

    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    tracing::info!(addr = %listener.local_addr()?, "gRPC listening");
    // Sockets are up: ready for queries.
    health
        .set_serving::<KvIndexerServer<KvIndexerService>>()
        .await;
    ready.store(true, Ordering::Relaxed);
    // A dead ingest worker means events for its pods are dropped from now
    // on: not ready, not serving, so the orchestrator restarts us.
    let watchdog = {
        let (dead, ready, health) = (ingest.worker_died(), ready.clone(), health.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
            loop {
                tick.tick().await;
                if dead.load(Ordering::Relaxed) {
                    tracing::error!("an ingest worker thread died: reporting NOT_SERVING");
                    ready.store(false, Ordering::Relaxed);
                    health
                        .set_not_serving::<KvIndexerServer<KvIndexerService>>()
                        .await;
                    return;
                }
            }
        })
    };

    let (stop_rpc, rpc_stopped) = tokio::sync::oneshot::channel::<()>();
    let service = Arc::new(
        KvIndexerService::new(
            indexer.clone(),
            tokenizers,
            metrics.clone(),
            config.limits.clone(),
            config.allow_request_chat_template,
        )
        .with_admin(config.admin.then(|| ingest.control()))
        .with_render(crate::render::RenderServers::new(&config.render))
        .with_feedback(feedback, ingest.control())
        .with_forwarder(crate::peer::forward::Forwarder::start(
            &config,
            metrics.clone(),
        )),
    );
    let max_message = config.limits.max_message_bytes;
    let llmd = crate::llmd::LlmdIndexerService::new(service.clone());
    // Our own listener (bound before readiness), so tonic's `tcp_nodelay`
    // does not apply: without it a 100 KB Score request waits out Nagle and
    // delayed ACKs (~40 ms on loopback).
    let admission =
        crate::admission::Admission::new("grpc", config.max_connections, metrics.clone());
    let accepted = TcpListenerStream::new(listener).then(|conn| async move {
        // tonic retries a failed accept at once: out of file descriptors,
        // that is a busy loop on a runtime worker. Back off first.
        if conn.is_err() {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        conn
    });
    let accepted = accepted.filter_map(move |conn| {
        let conn = match conn {
            Ok(conn) => conn,
            Err(e) => return Some(Err(e)),
        };
        if let Err(e) = conn.set_nodelay(true) {
            return Some(Err(e));
        }
        // `None`: refused and counted.
        admission.admit(conn).map(Ok::<_, std::io::Error>)
    });
    // Token-id prompts are large (32K tokens ~ 100 KB): windows that take
    // one without waiting for WINDOW_UPDATEs, and frames that carry one
    // whole (with HTTP/2's default 16 KiB frames such a request was 6 DATA
    // frames and 13 socket reads; now 4.5 reads per Score).
    let peer = crate::peer::serve::PeerService::new(
        indexer.clone(),
        metrics.clone(),
        config.peers.token.clone(),
        config
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca_pem.is_some()),
        replica,
        ingest.control(),
        ready.clone(),
    );
    let mut builder = Server::builder()
        .max_frame_size(MAX_FRAME_SIZE)
        // A peer that vanished without a FIN (a node lost, a partition)
        // must not hold its connection slot forever.
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)))
        .initial_stream_window_size(2 << 20)
        .initial_connection_window_size(8 << 20)
        .layer(tower::util::MapResponseLayer::new(
            oversize_is_resource_exhausted,
        ));
    if let Some(tls) = &config.tls {
        let mut tls_config = tonic::transport::ServerTlsConfig::new().identity(
            tonic::transport::Identity::from_pem(&tls.cert_pem, &tls.key_pem),
        );
        if let Some(ca) = &tls.client_ca_pem {
            tls_config = tls_config.client_ca_root(tonic::transport::Certificate::from_pem(ca));
        }
        builder = builder
            .tls_config(tls_config)
            .map_err(|e| anyhow::anyhow!("invalid TLS configuration: {e}"))?;
        tracing::info!(mtls = tls.client_ca_pem.is_some(), "gRPC over TLS");
    }
    let mut server = tokio::spawn(
        builder
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(KvIndexerServer::from_arc(service).max_decoding_message_size(max_message))
            .add_service(IndexerServiceServer::new(llmd).max_decoding_message_size(max_message))
            // A snapshot's chunks are 1 MiB; forwarded batches at most 1 MiB.
            .add_service(KvIndexerPeerServer::new(peer).max_decoding_message_size(4 * CHUNK_LIMIT))
            .serve_with_incoming_shutdown(accepted, async {
                let _ = rpc_stopped.await;
            }),
    );
    tokio::select! {
        res = &mut server => return Ok(res??),
        () = shutdown => {}
    }
    tracing::info!("shutting down: stopping ingestion, then draining RPCs");
    watchdog.abort();
    ready.store(false, Ordering::Relaxed);
    health
        .set_not_serving::<KvIndexerServer<KvIndexerService>>()
        .await;
    tokio::task::spawn_blocking(move || ingest.shutdown()).await?;
    let _ = stop_rpc.send(());
    // Clients such as an EPP keep HTTP/2 connections open; do not wait on
    // them forever once in-flight calls had their chance.
    match tokio::time::timeout(DRAIN_TIMEOUT, server).await {
        Ok(res) => res??,
        Err(_) => {
            tracing::warn!(timeout = ?DRAIN_TIMEOUT, "connections still open after drain timeout; exiting")
        }
    }
    if let (Some(dir), Some(task)) = (config.snapshot_dir.clone(), snapshotter) {
        task.abort();
        // Ingestion stopped and in-flight RPCs (RemovePod too) are done:
        // this is the final state.
        let (indexer, last) = (indexer.clone(), last_snapshot.clone());
        match tokio::task::spawn_blocking(move || crate::snapshots::write(&dir, &indexer, &last))
            .await
        {
            Ok(Ok(())) => tracing::info!("final snapshot written"),
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot write the final snapshot"),
            Err(e) => tracing::warn!(error = %e, "final snapshot task failed"),
        }
    }
    let _ = stop_http.send(());
    if let Some(http) = http {
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, http).await;
    }
    Ok(())
}

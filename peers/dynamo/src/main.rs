//! `peer-dynamo-indexer`: Dynamo's standalone KV indexer
//! (`dynamo-kv-router` 1.6.1, `services::indexer`), as its own
//! `run_server` sets it up, but listening on the one address given instead
//! of `0.0.0.0`, so that a benchmark keeps it on loopback.
//!
//! ```text
//! peer-dynamo-indexer [--addr 127.0.0.1:8090] [--threads 2]
//! ```
//!
//! Workers are registered over HTTP (`POST /register`, as in a Dynamo
//! deployment); each gets a ZeroMQ SUB socket that dials the worker's PUB
//! endpoint. `/query` answers token ids, `/metrics` counts applied events
//! (`dynamo_kvrouter_kv_cache_events_applied`). Logs go to stderr at `warn`
//! unless `RUST_LOG` says otherwise.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{bail, Context};
use dynamo_kv_router::services::indexer::server::{create_router, AppState};
use tokio::net::TcpListener;

struct Args {
    addr: SocketAddr,
    /// Indexer event threads: 1 is Dynamo's CLI default (one actor); more
    /// is its `ThreadPoolIndexer`, what its services and tests run.
    threads: usize,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        addr: "127.0.0.1:8090".parse().context("default address")?,
        threads: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => a.addr = value()?.parse().context("--addr: want HOST:PORT")?,
            "--threads" => a.threads = value()?.parse().context("--threads: want a count")?,
            "-h" | "--help" => {
                println!("peer-dynamo-indexer [--addr 127.0.0.1:8090] [--threads 2]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    if a.threads == 0 {
        bail!("--threads: want at least 1");
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = args()?;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let state = AppState::new(a.threads)?;
    // run_server's readiness gate with no initial workers and no peers:
    // listeners start receiving as soon as they are registered.
    state.registry.signal_ready();
    let app = create_router(Arc::new(state));
    let listener = TcpListener::bind(a.addr)
        .await
        .with_context(|| format!("cannot listen on {}", a.addr))?;
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

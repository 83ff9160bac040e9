//! `kv-indexer`: the service binary, and its tools: `demo`, `publish`,
//! `simulate` (the `simulator` crate; `--against` a running service through
//! `simulate_service`), `check`.

mod cli;
mod demo;
mod publish;
mod simulate_service;

use cli::{Args, Command};
use kv_indexer::config::{Config, LogFormat};
use kv_indexer::malloc::Pinned;
use tracing_subscriber::EnvFilter;

fn main() -> std::process::ExitCode {
    // Before anything allocates much (see `malloc`).
    let pinned = kv_indexer::malloc::pin_mmap_threshold();
    let mut args = Args::parse_or_exit();
    let mut command = args.command.take();
    let publishing = matches!(command, Some(Command::Publish { .. }));
    if publishing || matches!(command, Some(Command::Simulate(_))) {
        // A client: its output is the point.
        args.settings.log_level.get_or_insert_with(|| "warn".into());
    }
    if matches!(command, Some(Command::Demo { .. })) {
        // The demo's output is the point: keep the service's logs quiet.
        let s = &mut args.settings;
        s.log_level.get_or_insert_with(|| "warn".into());
        // A demo is for this machine: loopback unless told otherwise.
        s.zmq_bind
            .get_or_insert_with(|| "tcp://127.0.0.1:5557".parse().expect("an endpoint"));
        s.grpc_addr
            .get_or_insert_with(|| "127.0.0.1:50051".parse().expect("an address"));
        s.metrics_addr
            .get_or_insert_with(|| "127.0.0.1:9090".parse().expect("an address"));
    }
    let config = match Config::load(args.settings, args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kv-indexer: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if matches!(command, Some(Command::Check)) {
        println!("configuration is valid:\n{config:#?}");
        return std::process::ExitCode::SUCCESS;
    }
    if let Some(Command::Simulate(options)) = &mut command {
        // Virtual time, no service: runs before (and without) the runtime.
        let block_size = config.indexer.default_block_size as usize;
        options.speculative_ttl = match config.routing.ttl {
            indexer::routing::ttl::TtlPolicy::Fixed(d) => d.as_secs_f64(),
            indexer::routing::ttl::TtlPolicy::Auto => {
                indexer::routing::ttl::AUTO_START.as_secs_f64()
            }
        };
        let service = match (&options.against, &options.zmq) {
            (Some(grpc), Some(zmq)) => Some(simulate_service::Against::new(grpc, zmq)),
            _ => None,
        };
        let service = service.as_ref().map(|s| s as &dyn simulator::Service);
        return match simulator::main(options, block_size, service) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kv-indexer simulate: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    init_logging(&config);
    match pinned {
        Pinned::Set | Pinned::ByEnvironment | Pinned::NotGlibc => {
            tracing::debug!(?pinned, "allocator's mmap threshold")
        }
        Pinned::Refused => tracing::warn!("glibc refused the mmap threshold (see src/malloc.rs)"),
    }
    raise_open_files_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the async runtime");
            return std::process::ExitCode::FAILURE;
        }
    };
    let run = async move {
        match command {
            Some(Command::Demo {
                pods,
                turns,
                interval,
            }) => demo::run(config, pods.max(1), turns, interval.into()).await,
            Some(Command::Publish { frames, zmq, grpc }) => {
                publish::run(&frames, &zmq, &grpc).await
            }
            _ => kv_indexer::app::run(config, shutdown_signal()).await,
        }
    };
    let result = runtime.block_on(run);
    // A replay fetch or a tokenizer download still running on the blocking
    // pool must not hold the exit past the orchestrator's grace period.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "fatal");
            if publishing {
                eprintln!("kv-indexer publish: {e}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_logging(config: &Config) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&config.log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match config.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// Every connection (gRPC clients, pods, scrapers) is a file descriptor;
/// a soft limit of 1,024 (a common default) lets a thousand idle clients
/// lock everyone else out. The hard limit is what the operator allows:
/// take all of it.
fn raise_open_files_limit() {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => tracing::info!(limit, "open-files limit raised to the hard limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-files limit"),
    }
}

/// SIGINT (Ctrl-C) or SIGTERM (Kubernetes stopping the pod).
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

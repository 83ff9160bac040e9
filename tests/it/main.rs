//! The service's integration tests: one binary, a module per area, all on
//! real processes, real ZeroMQ sockets, real gRPC and HTTP over loopback.
//!
//! `common` is the one harness: it starts a service (`Service`), publishes
//! vLLM's recorded streams and stand-in pods (`common::vllm_pod`), reads the
//! fixtures under `tests/fixtures/`, and scales every wait budget by
//! `KV_INDEXER_TEST_SLOWDOWN` (see `common::budget`).

mod common;

mod config;
mod demo;
mod deploy;
mod discovery;
mod engine_mode;
mod grpcurl;
mod hostile;
mod lifecycle;
mod limits;
mod llmd;
mod memory;
mod metrics;
mod multimodal;
mod offload;
mod peers;
mod publish;
mod replay;
mod routing;
mod service;
mod sglang;
mod simulate;
mod snapshots;
mod stress;
mod supervised;
mod tls;
mod tokenization;
mod untrusted_input;

//! KV-cache index core: no sockets, no threads, no clocks beyond `Instant`.
//!
//! Data flows one way: payload bytes -> [`wire`] -> [`event`]s ->
//! [`pod_feed`] (the rules of `pod::rules`) -> each model's [`runs`]; a
//! prompt's tokens -> [`keys`] -> [`run_score`]. [`Indexer`] ties them
//! together for the service. [`index`], [`pod`]'s block map and [`score`]'s
//! walk are the former per-block index, kept as the reference the runs
//! are tested against (`pod_feed`'s property test).

pub mod block_map;
pub mod closure;
pub mod engine_hash;
pub mod event;
pub mod holders;
pub mod index;
mod indexer;
pub mod keys;
pub mod offload;
pub mod pod;
pub mod pod_feed;
pub mod repeats;
pub mod routing;
pub mod run_score;
pub mod runs;
pub mod scheme;
pub mod score;
pub mod snapshot;
pub mod stream;
#[cfg(test)]
mod test_rng;
pub mod topic;
pub mod wire;

pub use crate::indexer::{
    pod_id, Connection, Indexer, IndexerConfig, KeyHolders, Pod, PodScore, PodSummary, Refused,
    ScoreOutcome, ScoreQuery, StreamCount,
};

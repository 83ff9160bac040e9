//! KV-cache index core: no sockets, no threads, no clocks beyond `Instant`.
//!
//! ```text
//!  events in                                   prompts in
//!  payload bytes --wire--> event::EventBatch   token ids --keys--> BlockKey chain
//!  topic: which pod        stream: seq rules           |
//!        |                 (gaps, replays, restarts)   |
//!        v                          v                  v
//!  Indexer (indexer/: pod table, apply, query, persist)
//!        |  one writer per pod          |  readers, no lock
//!        v                              v
//!  pod: a pod's events -> index     score: per pod, leading blocks held
//!   (pod/rules: vLLM's rules)        (closure, offloaded chunks, tiers)
//!        \                             /
//!         `--> index: RunIndex <------'    snapshot: the index on disk
//!              (write/, read, published, dump)
//!  routing: RecordRouting's speculative entries, outcomes, approximate index
//! ```
//!
//! Arrows point one way: `wire`, `event`, `topic`, `stream` and `keys`
//! know nothing of the index; `index` knows only keys and pod ids; `pod`
//! and `score` are the rules on top of it; `Indexer` ties them together
//! for the service (`src/` in the workspace root).

pub mod event;
pub mod index;
mod indexer;
pub mod keys;
#[cfg(test)]
mod model;
pub mod pod;
pub mod routing;
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

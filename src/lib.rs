//! The kv-indexer service: configuration, ZeroMQ ingestion and the gRPC API
//! around the `indexer` core. All I/O of the project lives in this crate.

pub mod proto {
    pub mod kvindexer {
        pub mod v1 {
            tonic::include_proto!("kvindexer.v1");
            pub use crate::token_ids::TokenIds;
        }
    }

    /// llm-d's indexer API (package `indexer.v1`).
    pub mod llmd {
        pub mod v1 {
            tonic::include_proto!("indexer.v1");
        }
    }

    /// Encoded `FileDescriptorSet` of every service, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("descriptor");
}

mod admission;
pub mod app;
pub mod codec;
pub mod config;
mod dial;
pub mod discovery;
mod dispatch;
pub mod error;
pub mod feedback;
mod first_catch_ups;
pub mod grpc;
pub mod ingest;
pub mod llmd;
pub mod malloc;
pub mod metrics;
mod owners;
mod peer;
mod priority;
mod ratelimit;
pub mod render;
pub mod replay;
pub mod snapshots;
pub mod token_ids;
mod worker;
mod zap;
pub mod zmq_io;

//! `simulate --against`: the simulated pods' batches to a running
//! kv-indexer's ZeroMQ SUB, `Score` over its gRPC, one connection per
//! policy (a `simulator::Service`).

use std::time::{Duration, Instant};

use kv_indexer::proto::kvindexer::v1 as pb;
use kv_indexer::zmq_io::Publisher;
use pb::kv_indexer_client::KvIndexerClient;
use tonic::transport::Channel;

use crate::publish::{announce_pods, listed};

/// The service at `--against` (gRPC) and `--zmq` (its SUB endpoint).
pub struct Against {
    grpc: String,
    zmq: String,
    context: zmq::Context,
}

impl Against {
    pub fn new(grpc: &str, zmq: &str) -> Against {
        Against {
            grpc: match grpc.starts_with("http") {
                true => grpc.to_owned(),
                false => format!("http://{grpc}"),
            },
            zmq: zmq.to_owned(),
            context: zmq::Context::new(),
        }
    }
}

impl simulator::Service for Against {
    fn connect(
        &self,
        model: &str,
        names: &[String],
    ) -> anyhow::Result<Box<dyn simulator::Connection>> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let mut client = runtime
            .block_on(KvIndexerClient::connect(self.grpc.clone()))
            .map_err(|e| anyhow::anyhow!("no kv-indexer answers at {}: {e}", self.grpc))?;
        let publisher = Publisher::connect(&self.context, &self.zmq)?;
        runtime.block_on(announce_pods(&publisher, model, names, &mut client))?;
        Ok(Box::new(Connection {
            model: model.to_owned(),
            runtime,
            client,
            publisher,
        }))
    }
}

struct Connection {
    model: String,
    runtime: tokio::runtime::Runtime,
    client: KvIndexerClient<Channel>,
    publisher: Publisher,
}

impl simulator::Connection for Connection {
    fn publish(&mut self, pod: &str, seq: u64, payload: Vec<u8>) -> anyhow::Result<()> {
        self.publisher.send(&simulator::vllm_wire::frames(
            pod,
            &self.model,
            seq,
            payload,
        ))?;
        Ok(())
    }

    fn wait_applied(&mut self, names: &[String], next: &[u64]) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pods = self
                .runtime
                .block_on(listed(&mut self.client, &self.model))?;
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

    fn score(&mut self, tokens: &[u32], names: &[String]) -> anyhow::Result<Vec<(String, u32)>> {
        let resp = self.runtime.block_on(self.client.score(pb::ScoreRequest {
            model: self.model.clone(),
            input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
                ids: tokens.to_vec(),
            })),
            pods: names.to_vec(),
            ..Default::default()
        }))?;
        Ok(resp
            .into_inner()
            .pods
            .into_iter()
            .map(|p| (p.pod, p.matched_blocks))
            .collect())
    }
}

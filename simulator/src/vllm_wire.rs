//! vLLM's KV-event wire form, produced the way vLLM 0.33 produces it
//! (msgspec maps tagged by `"type"` with every field 0.33 writes, batch
//! `[ts, [event, ...], dp_rank]`, frames `[topic, seq (8 bytes BE),
//! payload]`): for the demo's publisher, the simulator and the load tool,
//! never for the service itself.

use bytes::Bytes;
use serde::Serialize;

#[derive(Serialize)]
struct Stored<'a> {
    #[serde(rename = "type")]
    ty: &'static str,
    block_hashes: &'a [u64],
    parent_block_hash: Option<u64>,
    token_ids: &'a [u32],
    block_size: usize,
    lora_id: Option<u32>,
    medium: &'static str,
    lora_name: Option<String>,
    /// One entry per block; a text-only prompt without salt has none.
    extra_keys: Vec<Option<()>>,
    group_idx: u32,
    kv_cache_spec_kind: &'static str,
}

#[derive(Serialize)]
struct Removed<'a> {
    #[serde(rename = "type")]
    ty: &'static str,
    block_hashes: &'a [u64],
    medium: &'static str,
    group_idx: u32,
}

/// One event of a batch being built.
pub enum WireEvent<'a> {
    Stored {
        hashes: &'a [u64],
        parent: Option<u64>,
        tokens: &'a [u32],
        block_size: usize,
    },
    Removed {
        hashes: &'a [u64],
    },
}

/// The msgpack payload of one batch, stamped now.
pub fn encode_batch(events: &[WireEvent<'_>]) -> Vec<u8> {
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    encode_batch_at(ts, events)
}

/// The msgpack payload of one batch stamped `ts` (seconds): the simulator
/// stamps its virtual clock, so its streams are the same on every run.
pub fn encode_batch_at(ts: f64, events: &[WireEvent<'_>]) -> Vec<u8> {
    let mut payload = Vec::new();
    // Writes into a Vec cannot fail.
    let _ = rmp::encode::write_array_len(&mut payload, 3);
    let _ = rmp::encode::write_f64(&mut payload, ts);
    let _ = rmp::encode::write_array_len(&mut payload, events.len() as u32);
    for e in events {
        let _ = match e {
            WireEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
            } => rmp_serde::encode::write_named(
                &mut payload,
                &Stored {
                    ty: "BlockStored",
                    block_hashes: hashes,
                    parent_block_hash: *parent,
                    token_ids: tokens,
                    block_size: *block_size,
                    lora_id: None,
                    medium: "GPU",
                    lora_name: None,
                    extra_keys: vec![None; hashes.len()],
                    group_idx: 0,
                    kv_cache_spec_kind: "full_attention",
                },
            ),
            WireEvent::Removed { hashes } => rmp_serde::encode::write_named(
                &mut payload,
                &Removed {
                    ty: "BlockRemoved",
                    block_hashes: hashes,
                    medium: "GPU",
                    group_idx: 0,
                },
            ),
        };
    }
    let _ = rmp::encode::write_uint(&mut payload, 0);
    payload
}

/// `[topic, seq, payload]` for `kv@<pod>@<model>`.
pub fn frames(pod: &str, model: &str, seq: u64, payload: Vec<u8>) -> Vec<Bytes> {
    vec![
        Bytes::from(format!("kv@{pod}@{model}")),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ]
}

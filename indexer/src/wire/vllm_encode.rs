//! Test and bench support: `KVEventBatch` payloads laid out byte for byte the
//! way vLLM's msgspec encoder writes them, in each release's form. Compiled
//! into the crate's tests and, by path, into `benches/wire.rs`, so both
//! measure and check the same shapes. Depends on `rmp` only.

use rmp::encode as enc;

/// Which vLLM release's event layout to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// vLLM >= 0.24: maps tagged by a `"type"` key.
    Map,
    /// vLLM 0.22-0.23: tagged positional arrays, eleven fields after the tag.
    ArrayV023,
    /// vLLM 0.11-0.13: tagged positional arrays, six fields after the tag.
    ArrayV011,
}

/// A block hash as vLLM publishes it: the 64-bit int form (the default) or
/// raw digest bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
#[derive(Clone, Debug)]
pub enum Hash {
    Int(u64),
    Bytes(Vec<u8>),
}

/// One `extra_keys` item (a LoRA name, a cache salt, a multimodal hash...).
#[derive(Clone, Debug)]
pub enum Key {
    Str(String),
    Int(i64),
}

#[derive(Clone, Debug)]
pub struct Stored {
    pub hashes: Vec<Hash>,
    pub parent: Option<Hash>,
    pub tokens: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    pub extra_keys: Option<Vec<Option<Vec<Key>>>>,
    pub group_idx: u32,
    pub kind: String,
}

#[derive(Clone, Debug)]
pub enum Event {
    Stored(Stored),
    Removed {
        hashes: Vec<Hash>,
        medium: Option<String>,
        group_idx: u32,
    },
    Cleared,
}

/// `[ts, [event, ...], dp_rank]` (vLLM always writes the rank; `None` here
/// leaves it out, as releases before it existed did).
pub fn encode_batch(ts: f64, events: &[Event], form: Form, rank: Option<u32>) -> Vec<u8> {
    let mut out = Vec::new();
    // Writes into a Vec cannot fail.
    let _ = enc::write_array_len(&mut out, if rank.is_some() { 3 } else { 2 });
    let _ = enc::write_f64(&mut out, ts);
    let _ = enc::write_array_len(&mut out, events.len() as u32);
    for e in events {
        encode_event(&mut out, e, form);
    }
    if let Some(r) = rank {
        let _ = enc::write_uint(&mut out, u64::from(r));
    }
    out
}

pub fn encode_event(out: &mut Vec<u8>, event: &Event, form: Form) {
    match (event, form) {
        (Event::Stored(s), Form::Map) => {
            let _ = enc::write_map_len(out, 11);
            field(out, "type");
            str(out, "BlockStored");
            field(out, "block_hashes");
            hashes(out, &s.hashes);
            field(out, "parent_block_hash");
            opt_hash(out, s.parent.as_ref());
            field(out, "token_ids");
            tokens(out, &s.tokens);
            field(out, "block_size");
            let _ = enc::write_uint(out, u64::from(s.block_size));
            field(out, "lora_id");
            opt_int(out, s.lora_id);
            field(out, "medium");
            opt_str(out, s.medium.as_deref());
            field(out, "lora_name");
            opt_str(out, s.lora_name.as_deref());
            field(out, "extra_keys");
            extra_keys(out, s.extra_keys.as_deref());
            field(out, "group_idx");
            let _ = enc::write_uint(out, u64::from(s.group_idx));
            field(out, "kv_cache_spec_kind");
            str(out, &s.kind);
        }
        (Event::Stored(s), Form::ArrayV023 | Form::ArrayV011) => {
            let v023 = form == Form::ArrayV023;
            let _ = enc::write_array_len(out, if v023 { 12 } else { 7 });
            str(out, "BlockStored");
            hashes(out, &s.hashes);
            opt_hash(out, s.parent.as_ref());
            tokens(out, &s.tokens);
            let _ = enc::write_uint(out, u64::from(s.block_size));
            opt_int(out, s.lora_id);
            opt_str(out, s.medium.as_deref());
            if v023 {
                opt_str(out, s.lora_name.as_deref());
                extra_keys(out, s.extra_keys.as_deref());
                let _ = enc::write_uint(out, u64::from(s.group_idx));
                str(out, &s.kind);
                // kv_cache_spec_sliding_window
                let _ = enc::write_nil(out);
            }
        }
        (
            Event::Removed {
                hashes: h,
                medium,
                group_idx,
            },
            _,
        ) => {
            match form {
                Form::Map => {
                    let _ = enc::write_map_len(out, 4);
                    field(out, "type");
                    str(out, "BlockRemoved");
                    field(out, "block_hashes");
                }
                Form::ArrayV023 => {
                    let _ = enc::write_array_len(out, 4);
                    str(out, "BlockRemoved");
                }
                Form::ArrayV011 => {
                    let _ = enc::write_array_len(out, 3);
                    str(out, "BlockRemoved");
                }
            }
            hashes(out, h);
            if form == Form::Map {
                field(out, "medium");
            }
            opt_str(out, medium.as_deref());
            match form {
                Form::Map => field(out, "group_idx"),
                Form::ArrayV023 => {}
                Form::ArrayV011 => return,
            }
            let _ = enc::write_uint(out, u64::from(*group_idx));
        }
        (Event::Cleared, Form::Map) => {
            let _ = enc::write_map_len(out, 1);
            field(out, "type");
            str(out, "AllBlocksCleared");
        }
        (Event::Cleared, _) => {
            let _ = enc::write_array_len(out, 1);
            str(out, "AllBlocksCleared");
        }
    }
}

fn field(out: &mut Vec<u8>, name: &str) {
    str(out, name);
}

fn str(out: &mut Vec<u8>, s: &str) {
    let _ = enc::write_str(out, s);
}

fn opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => str(out, s),
        None => {
            let _ = enc::write_nil(out);
        }
    }
}

fn opt_int(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(v) => {
            let _ = enc::write_sint(out, v);
        }
        None => {
            let _ = enc::write_nil(out);
        }
    }
}

fn hash(out: &mut Vec<u8>, h: &Hash) {
    match h {
        Hash::Int(v) => {
            let _ = enc::write_uint(out, *v);
        }
        Hash::Bytes(b) => {
            let _ = enc::write_bin(out, b);
        }
    }
}

fn opt_hash(out: &mut Vec<u8>, h: Option<&Hash>) {
    match h {
        Some(h) => hash(out, h),
        None => {
            let _ = enc::write_nil(out);
        }
    }
}

fn hashes(out: &mut Vec<u8>, hs: &[Hash]) {
    let _ = enc::write_array_len(out, hs.len() as u32);
    for h in hs {
        hash(out, h);
    }
}

fn tokens(out: &mut Vec<u8>, ts: &[u32]) {
    let _ = enc::write_array_len(out, ts.len() as u32);
    for t in ts {
        let _ = enc::write_uint(out, u64::from(*t));
    }
}

fn extra_keys(out: &mut Vec<u8>, keys: Option<&[Option<Vec<Key>>]>) {
    let Some(keys) = keys else {
        let _ = enc::write_nil(out);
        return;
    };
    let _ = enc::write_array_len(out, keys.len() as u32);
    for k in keys {
        match k {
            None => {
                let _ = enc::write_nil(out);
            }
            Some(items) => {
                let _ = enc::write_array_len(out, items.len() as u32);
                for item in items {
                    match item {
                        Key::Str(s) => str(out, s),
                        Key::Int(v) => {
                            let _ = enc::write_sint(out, *v);
                        }
                    }
                }
            }
        }
    }
}

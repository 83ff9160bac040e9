//! Decoding vLLM's msgpack `KVEventBatch` payloads, every release's form.
//!
//! A payload is `[ts, [event, ...], data_parallel_rank?]`. Events come as maps
//! with a `"type"` key (vLLM >= 0.24) or as positional tagged arrays
//! (`["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
//! medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]`,
//! vLLM <= 0.23, with any number of trailing slots).
//!
//! The outer structure is walked by hand so that every event is decoded from
//! its own byte span: one malformed or unknown event is counted and skipped
//! without losing its neighbours. Every length is checked against the bytes
//! actually present before anything is allocated, so a header claiming
//! gigabytes fails fast instead of allocating them.

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

use crate::event::{BlockRemoved, BlockStored, Engine, EngineHash, EventBatch, ExtraKey, KvEvent};

#[cfg(test)]
mod diff_tests;
mod fast;
#[cfg(test)]
mod vllm_encode;

/// Why a whole payload could not be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("payload is empty")]
    Empty,
    #[error("payload is truncated or has an invalid msgpack marker at byte {0}")]
    Truncated(usize),
    #[error("payload has {0} bytes after the batch")]
    TrailingBytes(usize),
    #[error("batch is not a msgpack array of 2 or more elements")]
    NotABatch,
    #[error("batch timestamp is not a number")]
    BadTimestamp,
    #[error("batch events are not an array")]
    BadEvents,
    #[error("batch data_parallel_rank is not a small non-negative integer")]
    BadRank,
}

/// Decodes one payload. Errors are reserved for payloads whose outer shape
/// is unusable; problems inside single events are counted in `skipped`.
///
/// Well-formed payloads of the shapes vLLM publishes take the one-pass path
/// in [`fast`]; anything it does not recognise (an unknown event type, a
/// malformed event, a bad outer shape) is decoded, event by event or whole,
/// by the serde path in [`decode_batch_reference`], whose results define
/// this function's.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, WireError> {
    fast::decode_batch(payload).map_or_else(|| decode_batch_reference(payload), Ok)
}

/// The serde decoder `decode_batch` must agree with on every input: it walks
/// the payload to validate it, then each event again for its span and depth
/// before handing it to `rmp_serde`. Public for the differential tests, the
/// fuzz target and the bench; the service calls `decode_batch`.
#[doc(hidden)]
pub fn decode_batch_reference(payload: &[u8]) -> Result<EventBatch, WireError> {
    if payload.is_empty() {
        return Err(WireError::Empty);
    }
    let end = skip_value(payload, 0)?;
    if end != payload.len() {
        return Err(WireError::TrailingBytes(payload.len() - end));
    }
    let mut cur = Cursor {
        buf: payload,
        pos: 0,
    };
    let len = cur.array_len().ok_or(WireError::NotABatch)?;
    if len < 2 {
        return Err(WireError::NotABatch);
    }
    let ts = cur.number().ok_or(WireError::BadTimestamp)?;
    let n_events = cur.array_len().ok_or(WireError::BadEvents)?;

    let mut batch = EventBatch {
        ts,
        events: Vec::with_capacity(n_events.min(1024)),
        ..Default::default()
    };
    for _ in 0..n_events {
        let start = cur.pos;
        // The whole payload was walked above, so spans are known to be valid.
        cur.pos = skip_value(payload, start)?;
        decode_event(&payload[start..cur.pos], &mut batch);
    }
    if len >= 3 {
        batch.data_parallel_rank = cur.optional_rank()?;
    }
    Ok(batch)
}

/// vLLM events nest at most five deep (event, extra_keys, a block's keys, a
/// tuple, its items); anything much deeper is hostile, and serde would
/// recurse once per level.
const MAX_EVENT_DEPTH: usize = 16;

fn decode_event(span: &[u8], batch: &mut EventBatch) {
    if nesting_depth(span) > MAX_EVENT_DEPTH {
        batch.skipped.malformed_events += 1;
        return;
    }
    match rmp_serde::from_slice::<WireEvent>(span) {
        Ok(WireEvent {
            event: Some(event),
            unknown_fields,
        }) => {
            batch.skipped.unknown_fields += unknown_fields;
            batch.events.push(event);
        }
        Ok(WireEvent { event: None, .. }) => batch.skipped.unknown_event_types += 1,
        Err(_) => batch.skipped.malformed_events += 1,
    }
}

/// How deeply containers nest in `span` (a value `skip_value` accepted),
/// measured without recursion. Stops counting past `MAX_EVENT_DEPTH`.
fn nesting_depth(span: &[u8]) -> usize {
    // Items still to read in each open container, innermost last.
    let mut open: Vec<usize> = Vec::new();
    let mut deepest = 0;
    let mut pos = 0;
    loop {
        let Ok(children) = skip_header(span, &mut pos) else {
            return usize::MAX;
        };
        // The value just read fills one slot of its parent.
        if let Some(left) = open.last_mut() {
            *left -= 1;
        }
        if children > 0 {
            open.push(children);
            deepest = deepest.max(open.len());
            if deepest > MAX_EVENT_DEPTH {
                return deepest;
            }
        }
        while open.last() == Some(&0) {
            open.pop();
        }
        if open.is_empty() {
            return deepest;
        }
    }
}

/// Reads one msgpack header at `pos`, skipping scalar payloads; returns how
/// many child values follow it (0 for scalars).
fn skip_header(buf: &[u8], pos: &mut usize) -> Result<usize, WireError> {
    let marker = *buf.get(*pos).ok_or(WireError::Truncated(*pos))?;
    let at = *pos;
    *pos += 1;
    let (skip, children) = match marker {
        0x80..=0x8f => (0, 2 * usize::from(marker & 0x0f)),
        0x90..=0x9f => (0, usize::from(marker & 0x0f)),
        0xdc => (0, read_len(buf, pos, 2, at)?),
        0xdd => (0, read_len(buf, pos, 4, at)?),
        0xde => (0, 2 * read_len(buf, pos, 2, at)?),
        0xdf => (0, 2 * read_len(buf, pos, 4, at)?),
        _ => {
            // A scalar: reuse the full walker for its size.
            *pos = skip_value(buf, at)?;
            (0, 0)
        }
    };
    *pos += skip;
    Ok(children)
}

/// Walks one msgpack value starting at `pos` and returns the offset just past
/// it. Iterative (no recursion limit to hit) and allocation-free.
fn skip_value(buf: &[u8], mut pos: usize) -> Result<usize, WireError> {
    // Values still to walk. Every value takes at least one byte, so a count
    // larger than the bytes left is a lie we can reject immediately.
    let mut pending: usize = 1;
    while pending > 0 {
        pending -= 1;
        let marker = *buf.get(pos).ok_or(WireError::Truncated(pos))?;
        let at = pos;
        pos += 1;
        let (skip, children): (usize, usize) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * usize::from(marker & 0x0f)),
            0x90..=0x9f => (0, usize::from(marker & 0x0f)),
            0xa0..=0xbf => (usize::from(marker & 0x1f), 0),
            0xc4 | 0xd9 => (read_len(buf, &mut pos, 1, at)?, 0),
            0xc5 | 0xda => (read_len(buf, &mut pos, 2, at)?, 0),
            0xc6 | 0xdb => (read_len(buf, &mut pos, 4, at)?, 0),
            0xc7 => (read_len(buf, &mut pos, 1, at)? + 1, 0),
            0xc8 => (read_len(buf, &mut pos, 2, at)? + 1, 0),
            0xc9 => (read_len(buf, &mut pos, 4, at)? + 1, 0),
            0xca | 0xce | 0xd2 => (4, 0),
            0xcb | 0xcf | 0xd3 => (8, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (0, read_len(buf, &mut pos, 2, at)?),
            0xdd => (0, read_len(buf, &mut pos, 4, at)?),
            0xde => (0, 2 * read_len(buf, &mut pos, 2, at)?),
            0xdf => (0, 2 * read_len(buf, &mut pos, 4, at)?),
            0xc1 => return Err(WireError::Truncated(at)),
        };
        pos = pos
            .checked_add(skip)
            .filter(|&p| p <= buf.len())
            .ok_or(WireError::Truncated(at))?;
        pending = pending
            .checked_add(children)
            .filter(|&p| p <= buf.len() - pos)
            .ok_or(WireError::Truncated(at))?;
    }
    Ok(pos)
}

fn read_len(buf: &[u8], pos: &mut usize, width: usize, at: usize) -> Result<usize, WireError> {
    let bytes = buf
        .get(*pos..*pos + width)
        .ok_or(WireError::Truncated(at))?;
    *pos += width;
    Ok(bytes
        .iter()
        .fold(0usize, |acc, b| (acc << 8) | usize::from(*b)))
}

/// Reads the few fixed parts of the outer batch. Every read is bounds
/// checked: the reference path calls it on a payload `skip_value` already
/// walked, the fast path on one nothing has checked yet.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn array_len(&mut self) -> Option<usize> {
        let marker = *self.buf.get(self.pos)?;
        let at = self.pos;
        self.pos += 1;
        match marker {
            0x90..=0x9f => Some(usize::from(marker & 0x0f)),
            0xdc => read_len(self.buf, &mut self.pos, 2, at).ok(),
            0xdd => read_len(self.buf, &mut self.pos, 4, at).ok(),
            _ => None,
        }
    }

    fn be(&mut self, width: usize) -> Option<u64> {
        let bytes = self.buf.get(self.pos..self.pos + width)?;
        self.pos += width;
        Some(bytes.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    fn int(&mut self) -> Option<Option<i128>> {
        let marker = *self.buf.get(self.pos)?;
        self.pos += 1;
        Some(match marker {
            0x00..=0x7f => Some(i128::from(marker)),
            0xe0..=0xff => Some(i128::from(marker as i8)),
            0xcc => Some(i128::from(self.be(1)?)),
            0xcd => Some(i128::from(self.be(2)?)),
            0xce => Some(i128::from(self.be(4)?)),
            0xcf => Some(i128::from(self.be(8)?)),
            0xd0 => Some(i128::from(self.be(1)? as u8 as i8)),
            0xd1 => Some(i128::from(self.be(2)? as u16 as i16)),
            0xd2 => Some(i128::from(self.be(4)? as u32 as i32)),
            0xd3 => Some(i128::from(self.be(8)? as i64)),
            _ => {
                self.pos -= 1;
                None
            }
        })
    }

    fn number(&mut self) -> Option<f64> {
        match *self.buf.get(self.pos)? {
            0xca => {
                self.pos += 1;
                Some(f64::from(f32::from_bits(self.be(4)? as u32)))
            }
            0xcb => {
                self.pos += 1;
                Some(f64::from_bits(self.be(8)?))
            }
            _ => self.int()?.map(|v| v as f64),
        }
    }

    fn optional_rank(&mut self) -> Result<Option<u32>, WireError> {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Ok(None);
        }
        match self.int() {
            Some(Some(v)) => u32::try_from(v).map(Some).map_err(|_| WireError::BadRank),
            _ => Err(WireError::BadRank),
        }
    }
}

/// One event as decoded from its own span.
struct WireEvent {
    /// `None`: a type this release does not know.
    event: Option<KvEvent>,
    unknown_fields: u32,
}

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";
const CLEARED: &str = "AllBlocksCleared";

/// Fields vLLM publishes that we read past on purpose; they are not "unknown".
const IGNORED_FIELDS: &[&str] = &[
    "kv_cache_spec_sliding_window",
    "ownership",
    "session_id",
    "block_mm_infos",
];

impl<'de> Deserialize<'de> for WireEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(EventVisitor)
    }
}

struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = WireEvent;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a vLLM KV event (map with \"type\" or tagged array)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireEvent, A::Error> {
        let mut tag: Option<String> = None;
        let mut f = Fields::default();
        let mut unknown = 0u32;
        let (mut lora_name_key, mut salt_key) = (false, false);
        while let Some(key) = map.next_key::<KeyName>()? {
            lora_name_key |= key.0 == "lora_name";
            salt_key |= key.0 == "cache_salt";
            match key.0.as_str() {
                "type" => tag = Some(map.next_value()?),
                "block_hashes" => f.block_hashes = Some(map.next_value()?),
                "parent_block_hash" => f.parent_block_hash = map.next_value()?,
                "token_ids" => {
                    let WireTokens(ids, bigram) = map.next_value()?;
                    f.token_ids = Some(ids);
                    f.bigram = bigram;
                }
                "block_size" => f.block_size = map.next_value()?,
                "lora_id" => f.lora_id = map.next_value()?,
                "medium" => f.medium = map.next_value()?,
                "lora_name" => f.lora_name = map.next_value()?,
                "cache_salt" => f.cache_salt = map.next_value()?,
                "extra_keys" => f.extra_keys = map.next_value()?,
                "group_idx" => f.group_idx = map.next_value()?,
                "kv_cache_spec_kind" => f.kv_cache_spec_kind = map.next_value()?,
                "locality" => f.locality = map.next_value()?,
                other => {
                    if !IGNORED_FIELDS.contains(&other) {
                        unknown += 1;
                    }
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let tag = tag.ok_or_else(|| de::Error::missing_field("type"))?;
        f.engine = if salt_key || !lora_name_key {
            Engine::Sglang
        } else {
            Engine::Vllm
        };
        f.into_event(&tag, unknown)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<WireEvent, A::Error> {
        let tag: String = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let mut f = Fields::default();
        match tag.as_str() {
            STORED => {
                f.block_hashes = seq.next_element()?;
                f.parent_block_hash = seq.next_element()?.flatten();
                f.token_ids = seq.next_element::<WireTokens>()?.map(|t| t.0);
                f.block_size = seq.next_element()?.flatten();
                f.lora_id = seq.next_element()?.flatten();
                f.medium = seq.next_element()?.flatten();
                f.lora_name = seq.next_element()?.flatten();
                f.extra_keys = seq.next_element()?.flatten();
                f.group_idx = seq.next_element()?.flatten();
                f.kv_cache_spec_kind = seq.next_element()?.flatten();
            }
            REMOVED => {
                f.block_hashes = seq.next_element()?;
                f.medium = seq.next_element()?.flatten();
                f.group_idx = seq.next_element()?.flatten();
            }
            _ => {}
        }
        // Trailing slots added by later releases.
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        f.engine = Engine::Vllm;
        f.into_event(&tag, 0)
    }
}

#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<WireHash>>,
    parent_block_hash: Option<WireHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    bigram: bool,
    engine: Engine,
    extra_keys: Option<Vec<WireExtraKeys>>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<String>,
    locality: Option<String>,
}

impl Fields {
    fn into_event<E: de::Error>(self, tag: &str, unknown: u32) -> Result<WireEvent, E> {
        let hashes = |h: Option<Vec<WireHash>>| -> Result<Vec<EngineHash>, E> {
            Ok(h.ok_or_else(|| E::missing_field("block_hashes"))?
                .into_iter()
                .map(|h| h.0)
                .collect())
        };
        let event = match tag {
            STORED => KvEvent::Stored(BlockStored {
                block_hashes: hashes(self.block_hashes)?,
                parent_block_hash: self.parent_block_hash.map(|h| h.0),
                token_ids: self.token_ids.unwrap_or_default(),
                block_size: self.block_size,
                lora_id: self.lora_id,
                medium: self.medium,
                lora_name: self.lora_name,
                cache_salt: self.cache_salt,
                bigram: self.bigram,
                engine: self.engine,
                extra_keys: self
                    .extra_keys
                    .map(|v| v.into_iter().map(|k| k.0).collect()),
                group_idx: self.group_idx,
                kv_cache_spec_kind: self.kv_cache_spec_kind,
                locality: self.locality,
            }),
            REMOVED => KvEvent::Removed(BlockRemoved {
                block_hashes: hashes(self.block_hashes)?,
                medium: self.medium,
                group_idx: self.group_idx,
                locality: self.locality,
            }),
            CLEARED => KvEvent::AllCleared,
            _ => {
                return Ok(WireEvent {
                    event: None,
                    unknown_fields: unknown,
                })
            }
        };
        Ok(WireEvent {
            event: Some(event),
            unknown_fields: unknown,
        })
    }
}

/// A map key: msgspec writes str keys; accept bin keys too.
struct KeyName(String);

impl<'de> Deserialize<'de> for KeyName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = KeyName;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyName, E> {
                Ok(KeyName(v.to_owned()))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<KeyName, E> {
                Ok(KeyName(String::from_utf8_lossy(v).into_owned()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A block hash in any of its wire forms: u64, i64 or raw digest bytes.
struct WireHash(EngineHash);

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireHash;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a block hash (integer or bytes)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireHash, E> {
                Ok(WireHash(EngineHash(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireHash, E> {
                Ok(WireHash(EngineHash::from_i64(v)))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<WireHash, E> {
                if v.is_empty() {
                    return Err(E::invalid_length(0, &self));
                }
                Ok(WireHash(EngineHash::from_digest(v)))
            }
            // Some encoders write byte strings as arrays of small ints.
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<WireHash, A::Error> {
                let mut bytes = Vec::with_capacity(32);
                while let Some(b) = seq.next_element::<u8>()? {
                    if bytes.len() == 64 {
                        return Err(de::Error::invalid_length(65, &self));
                    }
                    bytes.push(b);
                }
                self.visit_bytes(&bytes)
            }
        }
        d.deserialize_any(V)
    }
}

/// `token_ids`: ids, or (SGLang with EAGLE) `[a, b]` pairs, flattened;
/// and whether they were pairs. Not both in one list.
struct WireTokens(Vec<u32>, bool);

impl<'de> Deserialize<'de> for WireTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Unit {
            Id(u32),
            Pair(u32, u32),
        }
        let units: Vec<Unit> = Vec::deserialize(d)?;
        let pairs = matches!(units.first(), Some(Unit::Pair(..)));
        let mut out = Vec::with_capacity(units.len() * if pairs { 2 } else { 1 });
        for u in units {
            match (u, pairs) {
                (Unit::Id(t), false) => out.push(t),
                (Unit::Pair(a, b), true) => out.extend([a, b]),
                _ => return Err(de::Error::custom("token ids and pairs of them mixed")),
            }
        }
        Ok(WireTokens(out, pairs))
    }
}

/// One block's `extra_keys` entry: `None`, a tuple, or (leniently) a scalar.
struct WireExtraKeys(Option<Vec<ExtraKey>>);

impl<'de> Deserialize<'de> for WireExtraKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(WireExtraKeys(match ExtraKey::deserialize(d)? {
            ExtraKey::Nil => None,
            ExtraKey::List(items) => Some(items),
            scalar => Some(vec![scalar]),
        }))
    }
}

impl<'de> Deserialize<'de> for ExtraKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ExtraKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an extra key value")
            }
            fn visit_unit<E>(self) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Nil)
            }
            fn visit_none<E>(self) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Nil)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<ExtraKey, D::Error> {
                ExtraKey::deserialize(d)
            }
            fn visit_bool<E>(self, v: bool) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<ExtraKey, E> {
                // Out-of-range values keep their bit pattern: still distinct.
                Ok(ExtraKey::Int(v as i64))
            }
            fn visit_f64<E>(self, v: f64) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Float(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Str(v.to_owned()))
            }
            fn visit_bytes<E>(self, v: &[u8]) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Bytes(v.to_vec()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ExtraKey, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(ExtraKey::List(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ExtraKey, A::Error> {
                // Not produced by vLLM; keep the content so keys stay distinct.
                let mut items = Vec::new();
                while let Some((k, v)) = map.next_entry::<ExtraKey, ExtraKey>()? {
                    items.push(ExtraKey::List(vec![k, v]));
                }
                Ok(ExtraKey::List(items))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::DecodeSkips;
    use serde::Serialize;

    /// vLLM >= 0.24 map form, built the way msgspec lays it out.
    #[derive(Serialize)]
    struct MapStored<'a> {
        #[serde(rename = "type")]
        ty: &'a str,
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<&'a str>,
        lora_name: Option<&'a str>,
        extra_keys: Option<Vec<Option<Vec<&'a str>>>>,
        group_idx: u32,
        kv_cache_spec_kind: &'a str,
        kv_cache_spec_sliding_window: Option<u32>,
        some_future_field: u8,
    }

    fn encode<T: Serialize>(v: &T) -> Vec<u8> {
        rmp_serde::to_vec_named(v).unwrap()
    }

    fn stored_map() -> MapStored<'static> {
        MapStored {
            ty: "BlockStored",
            block_hashes: vec![1, 2],
            parent_block_hash: None,
            token_ids: (0..8).collect(),
            block_size: 4,
            lora_id: None,
            medium: Some("GPU"),
            lora_name: None,
            extra_keys: Some(vec![Some(vec!["salt"]), None]),
            group_idx: 0,
            kv_cache_spec_kind: "full_attention",
            kv_cache_spec_sliding_window: None,
            some_future_field: 7,
        }
    }

    #[test]
    fn decodes_map_form_and_counts_unknown_fields() {
        let payload = encode(&(1.5f64, (stored_map(),), 0u32));
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(batch.ts, 1.5);
        assert_eq!(batch.data_parallel_rank, Some(0));
        assert_eq!(batch.skipped.unknown_fields, 1);
        let KvEvent::Stored(s) = &batch.events[0] else {
            panic!("not a store")
        };
        assert_eq!(s.block_hashes, vec![EngineHash(1), EngineHash(2)]);
        assert_eq!(s.token_ids.len(), 8);
        assert_eq!(s.block_size, Some(4));
        assert_eq!(
            s.extra_keys,
            Some(vec![Some(vec![ExtraKey::Str("salt".into())]), None])
        );
        assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    }

    /// SGLang's form: signed hashes, a salt beside them, no `lora_name`
    /// key (its engine told by that); EAGLE's pairs flattened, and pairs
    /// mixed with ids refused as the whole event. Both decoders agree.
    #[test]
    fn decodes_sglang_stores_and_eagle_pairs() {
        #[derive(serde::Serialize)]
        struct Sglang<T> {
            #[serde(rename = "type")]
            kind: &'static str,
            block_hashes: Vec<i64>,
            parent_block_hash: Option<i64>,
            token_ids: Vec<T>,
            block_size: u32,
            lora_id: Option<i64>,
            medium: &'static str,
            cache_salt: &'static str,
        }
        fn store<T>(token_ids: Vec<T>) -> Sglang<T> {
            Sglang {
                kind: "BlockStored",
                block_hashes: vec![-5, 7],
                parent_block_hash: None,
                token_ids,
                block_size: 2,
                lora_id: None,
                medium: "CPU_PINNED",
                cache_salt: "tenant",
            }
        }
        let pairs = store(vec![(1u32, 2u32), (2, 3), (3, 4), (4, 5)]);
        let payload = rmp_serde::to_vec_named(&(1.0f64, [pairs], 0u32)).unwrap();
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(decode_batch_reference(&payload).unwrap(), batch);
        let KvEvent::Stored(s) = &batch.events[0] else {
            panic!("not a store")
        };
        assert_eq!(s.token_ids, vec![1, 2, 2, 3, 3, 4, 4, 5]);
        assert!(s.bigram);
        assert_eq!(s.block_hashes[0], EngineHash(-5i64 as u64));
        assert_eq!(s.cache_salt.as_deref(), Some("tenant"));
        assert_eq!(s.engine, Engine::Sglang);
        assert_eq!(batch.skipped, Default::default());
        let ids = store(vec![1u32, 2, 3, 4]);
        let payload = rmp_serde::to_vec_named(&(1.0f64, [ids], 0u32)).unwrap();
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(decode_batch_reference(&payload).unwrap(), batch);
        let KvEvent::Stored(s) = &batch.events[0] else {
            panic!("not a store")
        };
        assert!(!s.bigram && s.token_ids == vec![1, 2, 3, 4]);
        #[derive(serde::Serialize)]
        #[serde(untagged)]
        enum Mixed {
            Id(u32),
            Pair(u32, u32),
        }
        let mixed = store(vec![Mixed::Pair(1, 2), Mixed::Id(3)]);
        let payload = rmp_serde::to_vec_named(&(1.0f64, [mixed], 0u32)).unwrap();
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(decode_batch_reference(&payload).unwrap(), batch);
        assert!(batch.events.is_empty());
        assert_eq!(batch.skipped.malformed_events, 1);
    }

    #[test]
    fn decodes_array_forms_with_any_trailing_slots() {
        // vLLM 0.11: tag + six fields.
        let v011 = (
            "BlockStored",
            vec![10u64],
            Some(9u64),
            vec![1u32, 2, 3, 4],
            4u32,
            Option::<i64>::None,
            "CPU",
        );
        // vLLM 0.23: tag + eleven fields, plus one more a later release might add.
        let v023 = (
            "BlockStored",
            vec![-5i64],
            Option::<u64>::None,
            vec![1u32, 2, 3, 4],
            4u32,
            Some(3i64),
            "GPU",
            "my-lora",
            vec![Some(vec!["my-lora"])],
            0u32,
            "full_attention",
            Option::<u32>::None,
            "extra",
        );
        let removed = ("BlockRemoved", vec![10u64], "CPU", 0u32);
        let cleared = ("AllBlocksCleared",);
        let payload = rmp_serde::to_vec(&(2i64, (v011, v023, removed, cleared))).unwrap();
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(batch.ts, 2.0);
        assert_eq!(batch.data_parallel_rank, None);
        assert_eq!(batch.skipped, DecodeSkips::default());
        assert_eq!(batch.events.len(), 4);
        let KvEvent::Stored(a) = &batch.events[0] else {
            panic!()
        };
        assert_eq!(a.parent_block_hash, Some(EngineHash(9)));
        assert_eq!(a.medium.as_deref(), Some("CPU"));
        assert_eq!(a.lora_name, None);
        let KvEvent::Stored(b) = &batch.events[1] else {
            panic!()
        };
        assert_eq!(b.block_hashes, vec![EngineHash(-5i64 as u64)]);
        assert_eq!(b.lora_name.as_deref(), Some("my-lora"));
        assert_eq!(b.lora_id, Some(3));
        assert_eq!(
            batch.events[2],
            KvEvent::Removed(BlockRemoved {
                block_hashes: vec![EngineHash(10)],
                medium: Some("CPU".into()),
                group_idx: Some(0),
                locality: None,
            })
        );
        assert_eq!(batch.events[3], KvEvent::AllCleared);
    }

    #[test]
    fn byte_hashes_equal_their_int_form() {
        let digest: Vec<u8> = (1..=32).collect();
        let as_int = u64::from_be_bytes(digest[24..].try_into().unwrap());
        #[derive(Serialize)]
        struct Removed {
            #[serde(rename = "type")]
            ty: &'static str,
            #[serde(with = "serde_bytes_list")]
            block_hashes: Vec<Vec<u8>>,
            medium: Option<&'static str>,
        }
        mod serde_bytes_list {
            use serde::ser::{SerializeSeq, Serializer};
            pub fn serialize<S: Serializer>(v: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
                let mut seq = s.serialize_seq(Some(v.len()))?;
                for b in v {
                    seq.serialize_element(&Bytes(b))?;
                }
                seq.end()
            }
            struct Bytes<'a>(&'a [u8]);
            impl serde::Serialize for Bytes<'_> {
                fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                    s.serialize_bytes(self.0)
                }
            }
        }
        let ev = Removed {
            ty: "BlockRemoved",
            block_hashes: vec![digest],
            medium: None,
        };
        let batch = decode_batch(&encode(&(0.0f64, (ev,)))).unwrap();
        let KvEvent::Removed(r) = &batch.events[0] else {
            panic!()
        };
        assert_eq!(r.block_hashes, vec![EngineHash(as_int)]);
    }

    #[test]
    fn unknown_and_malformed_events_are_skipped_not_fatal() {
        #[derive(Serialize)]
        struct Unknown {
            #[serde(rename = "type")]
            ty: &'static str,
            x: u32,
        }
        #[derive(Serialize)]
        struct BadTokens {
            #[serde(rename = "type")]
            ty: &'static str,
            block_hashes: Vec<u64>,
            token_ids: Vec<i64>,
        }
        let payload = encode(&(
            0.0f64,
            (
                Unknown {
                    ty: "BlockPinned",
                    x: 1,
                },
                BadTokens {
                    ty: "BlockStored",
                    block_hashes: vec![1],
                    token_ids: vec![-1],
                },
                ("AllBlocksCleared",),
                42u8,
                ("TotallyNew", 1, 2),
            ),
        ));
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(batch.events, vec![KvEvent::AllCleared]);
        assert_eq!(
            batch.skipped,
            DecodeSkips {
                unknown_event_types: 2,
                malformed_events: 2,
                unknown_fields: 0,
            }
        );
    }

    #[test]
    fn rejects_bad_outer_shapes() {
        assert_eq!(decode_batch(&[]), Err(WireError::Empty));
        assert_eq!(
            decode_batch(&rmp_serde::to_vec(&(1.0f64,)).unwrap()),
            Err(WireError::NotABatch)
        );
        assert_eq!(
            decode_batch(&rmp_serde::to_vec(&("x", Vec::<u8>::new())).unwrap()),
            Err(WireError::BadTimestamp)
        );
        assert_eq!(
            decode_batch(&rmp_serde::to_vec(&(1.0f64, 3)).unwrap()),
            Err(WireError::BadEvents)
        );
        assert_eq!(
            decode_batch(&rmp_serde::to_vec(&(1.0f64, Vec::<u8>::new(), -1)).unwrap()),
            Err(WireError::BadRank)
        );
        let mut ok = rmp_serde::to_vec(&(1.0f64, Vec::<u8>::new())).unwrap();
        ok.push(0);
        assert_eq!(decode_batch(&ok), Err(WireError::TrailingBytes(1)));
    }

    #[test]
    fn huge_length_claims_fail_without_allocating() {
        // array32 claiming 4 billion events, then nothing.
        let payload = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(
            decode_batch(&payload),
            Err(WireError::Truncated(_))
        ));
        // bin32 claiming 4 GiB inside an event.
        let payload = [0x92, 0x00, 0x91, 0xc6, 0xff, 0xff, 0xff, 0xff, 0x00];
        assert!(matches!(
            decode_batch(&payload),
            Err(WireError::Truncated(_))
        ));
    }

    /// 60,000 nested arrays inside an event's extra keys (the most a
    /// 64 KiB message can hold): an error for that event, never a stack
    /// overflow.
    #[test]
    fn nesting_depth_counts_containers() {
        let v = rmp_serde::to_vec(&(1, vec![vec![2u8]], ("a", vec![Vec::<u8>::new()]))).unwrap();
        assert_eq!(nesting_depth(&v), 3);
        assert_eq!(nesting_depth(&rmp_serde::to_vec(&7u8).unwrap()), 0);
        assert_eq!(
            nesting_depth(&rmp_serde::to_vec(&Vec::<u8>::new()).unwrap()),
            0
        );
    }

    #[test]
    fn deeply_nested_values_are_rejected_without_exhausting_the_stack() {
        let depth = 60_000;
        let mut payload = vec![0x92, 0x00, 0x91, 0x82];
        payload.extend_from_slice(&[0xa4, b't', b'y', b'p', b'e']);
        payload.extend_from_slice(&[0xab]);
        payload.extend_from_slice(b"BlockStored");
        payload.extend_from_slice(&[0xaa]);
        payload.extend_from_slice(b"extra_keys");
        payload.extend(std::iter::repeat_n(0x91, depth));
        payload.push(0xc0);
        let batch = decode_batch(&payload).unwrap();
        assert!(batch.events.is_empty());
        assert_eq!(batch.skipped.malformed_events, 1);
        // Regression inputs found by fuzzing live in fuzz/regressions/.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions");
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let payload = std::fs::read(entry.path()).unwrap();
            assert_eq!(
                format!("{:?}", decode_batch(&payload)),
                format!("{:?}", decode_batch_reference(&payload)),
                "{}",
                entry.path().display()
            );
        }
    }

    #[test]
    fn every_truncation_of_a_valid_payload_is_an_error_not_a_panic() {
        let payload = encode(&(1.5f64, (stored_map(), ("AllBlocksCleared",)), 3u32));
        assert!(decode_batch(&payload).is_ok());
        for cut in 0..payload.len() {
            assert!(decode_batch(&payload[..cut]).is_err(), "cut at {cut}");
        }
    }
}

//! One-pass decoding of the payloads vLLM actually publishes.
//!
//! The reference path walks every byte three or four times (a validating
//! walk of the payload, a second one per event for its span, a third for its
//! nesting depth, then serde, which calls a visitor per array element). Here
//! one walk validates and decodes at once: `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared` in map and tagged-array form, int and byte hashes,
//! token ids read straight into their `Vec`.
//!
//! The contract is narrow on purpose: this path only ever answers when it is
//! sure the reference would give exactly the same batch. Anything else (an
//! unknown event type, a field of an unexpected type, a map key that is not
//! a string, an ext value, a short read) makes an event fall back to the
//! reference's per-event decoder, and any doubt about the payload as a whole
//! makes `decode_batch` return `None`, so the reference decodes it from
//! scratch and produces its own result or error. Malformed input is
//! therefore never decided here; it only has to be recognised as "not sure".

use super::{
    decode_event, skip_value, Cursor, CLEARED, IGNORED_FIELDS, MAX_EVENT_DEPTH, REMOVED, STORED,
};
use crate::event::{BlockRemoved, BlockStored, Engine, EngineHash, EventBatch, ExtraKey, KvEvent};

/// The batch the reference decoder would return for `payload`, or `None`
/// when this path cannot vouch for that (the payload may still be valid).
pub(super) fn decode_batch(payload: &[u8]) -> Option<EventBatch> {
    let mut cur = Cursor {
        buf: payload,
        pos: 0,
    };
    let len = cur.array_len()?;
    if len < 2 {
        return None;
    }
    let ts = cur.number()?;
    let n_events = cur.array_len()?;
    let mut batch = EventBatch {
        ts,
        // Every event takes a byte: a lying count cannot make this allocate.
        events: Vec::with_capacity(n_events.min(1024).min(payload.len() - cur.pos)),
        ..Default::default()
    };
    let mut r = Reader {
        buf: payload,
        pos: cur.pos,
    };
    for _ in 0..n_events {
        let start = r.pos;
        if let Some((event, unknown_fields)) = event(&mut r) {
            batch.skipped.unknown_fields += unknown_fields;
            batch.events.push(event);
        } else {
            // Not a shape this path decides: the reference decodes this one
            // event from its span, exactly as it would have.
            #[cfg(test)]
            FALLBACKS.with(|n| n.set(n.get() + 1));
            r.pos = skip_value(payload, start).ok()?;
            decode_event(&payload[start..r.pos], &mut batch);
        }
    }
    cur.pos = r.pos;
    if len >= 3 {
        batch.data_parallel_rank = cur.optional_rank().ok()?;
        // Elements after the rank are ignored, but must be valid msgpack.
        for _ in 3..len {
            cur.pos = skip_value(payload, cur.pos).ok()?;
        }
    }
    (cur.pos == payload.len()).then_some(batch)
}

#[cfg(test)]
thread_local! {
    /// Events handed to the reference decoder on this thread: lets tests
    /// check that vLLM's own shapes never need it.
    pub(super) static FALLBACKS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[derive(Clone, Copy)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

impl Tag {
    /// Only the three types decoded here; others go to the reference.
    fn parse(name: &[u8]) -> Option<Tag> {
        match name {
            n if n == STORED.as_bytes() => Some(Tag::Stored),
            n if n == REMOVED.as_bytes() => Some(Tag::Removed),
            n if n == CLEARED.as_bytes() => Some(Tag::Cleared),
            _ => None,
        }
    }
}

/// One event at `r`: the event and its count of unknown map keys, with `r`
/// just past it; `None` (with `r` anywhere) when the reference must decide.
fn event(r: &mut Reader) -> Option<(KvEvent, u32)> {
    match r.peek()? {
        0x80..=0x8f | 0xde | 0xdf => map_event(r),
        0x90..=0x9f | 0xdc | 0xdd => array_event(r),
        _ => None,
    }
}

/// Container depth of the event itself; a field's value sits one deeper.
/// Containers are counted empty or not (the reference counts only non-empty
/// ones), so staying within `MAX_EVENT_DEPTH` here implies it there too.
const EVENT_DEPTH: usize = 1;

/// vLLM >= 0.24: `{"type": ..., field: value, ...}` in any key order, later
/// duplicates overwriting earlier ones, as the reference's visitor does.
fn map_event(r: &mut Reader) -> Option<(KvEvent, u32)> {
    let n = r.map_len()?;
    let mut tag = None;
    let mut f = Fields::default();
    let mut unknown = 0u32;
    let (mut lora_name_key, mut salt_key) = (false, false);
    for _ in 0..n {
        let key = r.str()?;
        lora_name_key |= key == b"lora_name";
        salt_key |= key == b"cache_salt";
        match key {
            b"type" => tag = Some(Tag::parse(r.str()?)?),
            b"block_hashes" => f.block_hashes = Some(hashes(r)?),
            b"parent_block_hash" => f.parent_block_hash = opt_hash(r)?,
            b"token_ids" => {
                let (ids, bigram) = tokens(r)?;
                f.token_ids = Some(ids);
                f.bigram = bigram;
            }
            b"block_size" => f.block_size = r.opt(Reader::u32)?,
            b"lora_id" => f.lora_id = r.opt(Reader::i64)?,
            b"medium" => f.medium = r.opt(Reader::string)?,
            b"lora_name" => f.lora_name = r.opt(Reader::string)?,
            b"cache_salt" => f.cache_salt = r.opt(Reader::string)?,
            b"extra_keys" => f.extra_keys = extra_keys(r)?,
            b"group_idx" => f.group_idx = r.opt(Reader::u32)?,
            b"kv_cache_spec_kind" => f.kv_cache_spec_kind = r.opt(Reader::string)?,
            b"locality" => f.locality = r.opt(Reader::string)?,
            other => {
                // Byte comparison is exact: the reference compares the
                // (lossily decoded) key, and no known name contains U+FFFD.
                if !IGNORED_FIELDS.iter().any(|k| k.as_bytes() == other) {
                    unknown += 1;
                }
                skip(r, EVENT_DEPTH)?;
            }
        }
    }
    f.engine = if salt_key || !lora_name_key {
        Engine::Sglang
    } else {
        Engine::Vllm
    };
    Some((f.into_event(tag?)?, unknown))
}

/// vLLM <= 0.23: `[tag, field, ...]` by position, any number of trailing
/// slots (later releases add fields at the end).
fn array_event(r: &mut Reader) -> Option<(KvEvent, u32)> {
    let mut left = r.array_len()?.checked_sub(1)?;
    let tag = Tag::parse(r.str()?)?;
    let mut f = Fields::default();
    // Reads the next slot if the array has one (`Some(None)`: it has not).
    macro_rules! slot {
        ($read:expr) => {
            if left > 0 {
                left -= 1;
                Some($read?)
            } else {
                None
            }
        };
    }
    match tag {
        Tag::Stored => {
            f.block_hashes = slot!(hashes(r));
            f.parent_block_hash = slot!(opt_hash(r)).flatten();
            f.token_ids = slot!(tokens(r)).map(|(ids, _)| ids);
            f.block_size = slot!(r.opt(Reader::u32)).flatten();
            f.lora_id = slot!(r.opt(Reader::i64)).flatten();
            f.medium = slot!(r.opt(Reader::string)).flatten();
            f.lora_name = slot!(r.opt(Reader::string)).flatten();
            f.extra_keys = slot!(extra_keys(r)).flatten();
            f.group_idx = slot!(r.opt(Reader::u32)).flatten();
            f.kv_cache_spec_kind = slot!(r.opt(Reader::string)).flatten();
        }
        Tag::Removed => {
            f.block_hashes = slot!(hashes(r));
            f.medium = slot!(r.opt(Reader::string)).flatten();
            f.group_idx = slot!(r.opt(Reader::u32)).flatten();
        }
        Tag::Cleared => {}
    }
    for _ in 0..left {
        skip(r, EVENT_DEPTH)?;
    }
    f.engine = Engine::Vllm;
    Some((f.into_event(tag)?, 0))
}

/// The fields as read; mirrors the reference's `Fields`.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    bigram: bool,
    engine: Engine,
    extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<String>,
    locality: Option<String>,
}

impl Fields {
    /// `None` where the reference reports a missing field (a malformed
    /// event, which it then counts).
    fn into_event(self, tag: Tag) -> Option<KvEvent> {
        Some(match tag {
            Tag::Stored => KvEvent::Stored(BlockStored {
                block_hashes: self.block_hashes?,
                parent_block_hash: self.parent_block_hash,
                token_ids: self.token_ids.unwrap_or_default(),
                block_size: self.block_size,
                lora_id: self.lora_id,
                medium: self.medium,
                lora_name: self.lora_name,
                cache_salt: self.cache_salt,
                bigram: self.bigram,
                engine: self.engine,
                extra_keys: self.extra_keys,
                group_idx: self.group_idx,
                kv_cache_spec_kind: self.kv_cache_spec_kind,
                locality: self.locality,
            }),
            Tag::Removed => KvEvent::Removed(BlockRemoved {
                block_hashes: self.block_hashes?,
                medium: self.medium,
                group_idx: self.group_idx,
                locality: self.locality,
            }),
            Tag::Cleared => KvEvent::AllCleared,
        })
    }
}

/// An array of block hashes (serde reads a `bin` here as an array of u8
/// hashes; rare enough to leave to it).
fn hashes(r: &mut Reader) -> Option<Vec<EngineHash>> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Some(out)
}

/// One hash: any msgpack int (signed ones keep their bit pattern, as
/// `EngineHash::from_i64`) or non-empty digest bytes. The reference's other
/// accepted form, an array of byte values, is left to it.
fn hash(r: &mut Reader) -> Option<EngineHash> {
    let m = r.byte()?;
    let v = match m {
        0x00..=0x7f => u64::from(m),
        0xe0..=0xff => m as i8 as u64,
        0xcc => u64::from(r.byte()?),
        0xcd => u64::from(r.be16()?),
        0xce => u64::from(r.be32()?),
        0xcf | 0xd3 => r.be64()?,
        0xd0 => r.byte()? as i8 as u64,
        0xd1 => r.be16()? as i16 as u64,
        0xd2 => r.be32()? as i32 as u64,
        0xc4..=0xc6 => {
            let len = r.bin_len(m)?;
            if len == 0 {
                return None;
            }
            return Some(EngineHash::from_digest(r.take(len)?));
        }
        _ => return None,
    };
    Some(EngineHash(v))
}

fn opt_hash(r: &mut Reader) -> Option<Option<EngineHash>> {
    if r.nil() {
        Some(None)
    } else {
        hash(r).map(Some)
    }
}

/// `token_ids`: the hot loop of a prefill (32K ids). Each id is any msgpack
/// int in `u32` range, as serde's `u32` accepts.
///
/// A vocabulary of 150K mixes `uint16` and `uint32` ids about evenly, so a
/// branch on the marker mispredicts on every other id (a `match` here was
/// ~25% slower on 32K random ids). Instead each id of the four common forms
/// (positive fixint, `uint8`, `uint16`, `uint32`) is cut out of one 8-byte
/// big-endian load by a per-marker shift and mask, and the cursor advances
/// by the marker's size: no data-dependent branch. The last ids (less than
/// 8 bytes left) and rare markers take `Reader::u32`.
/// Token ids, and whether they came as EAGLE's pairs (then flattened).
fn tokens(r: &mut Reader) -> Option<(Vec<u32>, bool)> {
    let n = r.array_len()?;
    if r.peek() == Some(0x92) {
        let mut out = Vec::with_capacity(2 * n);
        for _ in 0..n {
            if r.array_len()? != 2 {
                return None;
            }
            out.push(r.u32()?);
            out.push(r.u32()?);
        }
        return Some((out, true));
    }
    let mut out = Vec::with_capacity(n);
    let buf = r.buf;
    let mut pos = r.pos;
    while out.len() < n {
        if let Some(word) = buf.get(pos..pos + 8) {
            let w = u64::from_be_bytes(word.try_into().ok()?);
            let (size, shift, mask) = TOKEN_FORMS[(w >> 56) as usize];
            if size != 0 {
                out.push(((w >> shift) as u32) & mask);
                pos += usize::from(size);
                continue;
            }
        }
        r.pos = pos;
        out.push(r.u32()?);
        pos = r.pos;
    }
    r.pos = pos;
    Some((out, false))
}

/// Per marker byte: (encoded size, shift of the value within the 8-byte
/// load, value mask); size 0 for markers `tokens` leaves to `Reader::u32`.
const TOKEN_FORMS: [(u8, u8, u32); 256] = {
    let mut t = [(0, 0, 0); 256];
    let mut m = 0;
    while m < 0x80 {
        t[m] = (1, 56, 0x7f);
        m += 1;
    }
    t[0xcc] = (2, 48, 0xff);
    t[0xcd] = (3, 40, 0xffff);
    t[0xce] = (5, 24, 0xffff_ffff);
    t
};

/// `extra_keys`: nil, or per block nil / a tuple / (leniently) a scalar.
fn extra_keys(r: &mut Reader) -> Option<Option<Vec<Option<Vec<ExtraKey>>>>> {
    if r.nil() {
        return Some(None);
    }
    let n = r.array_len()?;
    // An entry can be one byte but its slot is 24: reserve no more than a
    // prefill needs up front, so a lying count cannot multiply the payload.
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        let entry = match r.peek()? {
            0xc0 => {
                r.pos += 1;
                None
            }
            0x90..=0x9f | 0xdc | 0xdd => Some(key_list(r, EVENT_DEPTH + 1)?),
            _ => Some(vec![extra_key(r, EVENT_DEPTH + 1)?]),
        };
        out.push(entry);
    }
    Some(Some(out))
}

/// An array of extra keys whose parent container is at `depth`.
fn key_list(r: &mut Reader, depth: usize) -> Option<Vec<ExtraKey>> {
    if depth + 1 > MAX_EVENT_DEPTH {
        return None;
    }
    let n = r.array_len()?;
    // As in `extra_keys`: tuples are short, a count claiming more is grown to.
    let mut items = Vec::with_capacity(n.min(8));
    for _ in 0..n {
        items.push(extra_key(r, depth + 1)?);
    }
    Some(items)
}

/// One extra key as the reference's `ExtraKey` visitor builds it. Maps, ext
/// values and strings that are not UTF-8 (the reference turns those into
/// bytes) are left to it.
fn extra_key(r: &mut Reader, depth: usize) -> Option<ExtraKey> {
    let m = r.peek()?;
    Some(match m {
        0xc0 => {
            r.pos += 1;
            ExtraKey::Nil
        }
        0xc2 | 0xc3 => {
            r.pos += 1;
            ExtraKey::Bool(m == 0xc3)
        }
        0xca => {
            r.pos += 1;
            ExtraKey::Float(f64::from(f32::from_bits(r.be32()?)))
        }
        0xcb => {
            r.pos += 1;
            ExtraKey::Float(f64::from_bits(r.be64()?))
        }
        0xa0..=0xbf | 0xd9..=0xdb => ExtraKey::Str(r.string()?),
        0xc4..=0xc6 => {
            r.pos += 1;
            let len = r.bin_len(m)?;
            ExtraKey::Bytes(r.take(len)?.to_vec())
        }
        0x90..=0x9f | 0xdc | 0xdd => ExtraKey::List(key_list(r, depth)?),
        // Out-of-range unsigned values keep their bit pattern, as there.
        _ => ExtraKey::Int(r.i64_bits()?),
    })
}

/// Steps over one value whose parent container is at `depth`, accepting
/// exactly what serde's `IgnoredAny` does over rmp_serde, minus ext values
/// (left to the reference).
fn skip(r: &mut Reader, depth: usize) -> Option<()> {
    let m = r.byte()?;
    let (bytes, children) = match m {
        0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
        0xcc | 0xd0 => (1, 0),
        0xcd | 0xd1 => (2, 0),
        0xca | 0xce | 0xd2 => (4, 0),
        0xcb | 0xcf | 0xd3 => (8, 0),
        0xa0..=0xbf => (usize::from(m & 0x1f), 0),
        0xd9 | 0xc4 => (usize::from(r.byte()?), 0),
        0xda | 0xc5 => (usize::from(r.be16()?), 0),
        0xdb | 0xc6 => (r.be32()? as usize, 0),
        0x80..=0x8f | 0xde | 0xdf => {
            r.pos -= 1;
            (0, r.map_len()? * 2)
        }
        0x90..=0x9f | 0xdc | 0xdd => {
            r.pos -= 1;
            (0, r.array_len()?)
        }
        _ => return None,
    };
    r.take(bytes)?;
    if children > 0 {
        if depth + 1 > MAX_EVENT_DEPTH {
            return None;
        }
        for _ in 0..children {
            skip(r, depth + 1)?;
        }
    }
    Some(())
}

/// Bounds-checked reads over the payload; every `None` means "let the
/// reference decide".
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    fn byte(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Some(b)
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let bytes = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(bytes)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn be16(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    fn be32(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }

    fn be64(&mut self) -> Option<u64> {
        self.array().map(u64::from_be_bytes)
    }

    fn nil(&mut self) -> bool {
        let nil = self.peek() == Some(0xc0);
        self.pos += usize::from(nil);
        nil
    }

    /// `None` for nil, else `read`: how serde reads an `Option<T>`.
    fn opt<T>(&mut self, read: fn(&mut Self) -> Option<T>) -> Option<Option<T>> {
        if self.nil() {
            Some(None)
        } else {
            read(self).map(Some)
        }
    }

    /// An array header whose count the remaining bytes can hold (every
    /// element takes at least one), so callers may allocate that many.
    fn array_len(&mut self) -> Option<usize> {
        let n = match self.byte()? {
            m @ 0x90..=0x9f => usize::from(m & 0x0f),
            0xdc => usize::from(self.be16()?),
            0xdd => self.be32()? as usize,
            _ => return None,
        };
        (n <= self.buf.len() - self.pos).then_some(n)
    }

    /// A map header, checked like `array_len` (two values per entry).
    fn map_len(&mut self) -> Option<usize> {
        let n = match self.byte()? {
            m @ 0x80..=0x8f => usize::from(m & 0x0f),
            0xde => usize::from(self.be16()?),
            0xdf => self.be32()? as usize,
            _ => return None,
        };
        (n <= (self.buf.len() - self.pos) / 2).then_some(n)
    }

    /// The length after a `bin` marker `m` already read.
    fn bin_len(&mut self, m: u8) -> Option<usize> {
        Some(match m {
            0xc4 => usize::from(self.byte()?),
            0xc5 => usize::from(self.be16()?),
            _ => self.be32()? as usize,
        })
    }

    /// A msgpack `str`'s bytes, whatever they are.
    fn str(&mut self) -> Option<&'a [u8]> {
        let len = match self.byte()? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => usize::from(self.byte()?),
            0xda => usize::from(self.be16()?),
            0xdb => self.be32()? as usize,
            _ => return None,
        };
        self.take(len)
    }

    /// A `str` that is UTF-8, as serde's `String` requires.
    fn string(&mut self) -> Option<String> {
        std::str::from_utf8(self.str()?).ok().map(str::to_owned)
    }

    /// Any msgpack int as a sign-extended 64-bit pattern, plus whether it
    /// came from an unsigned marker (`uint64` above `i64::MAX` needs it).
    fn int(&mut self) -> Option<(u64, bool)> {
        let m = self.byte()?;
        Some(match m {
            0x00..=0x7f => (u64::from(m), true),
            0xe0..=0xff => (m as i8 as u64, false),
            0xcc => (u64::from(self.byte()?), true),
            0xcd => (u64::from(self.be16()?), true),
            0xce => (u64::from(self.be32()?), true),
            0xcf => (self.be64()?, true),
            0xd0 => (self.byte()? as i8 as u64, false),
            0xd1 => (self.be16()? as i16 as u64, false),
            0xd2 => (self.be32()? as i32 as u64, false),
            0xd3 => (self.be64()?, false),
            _ => return None,
        })
    }

    /// serde's `u32`: any int marker, value in range.
    fn u32(&mut self) -> Option<u32> {
        // The common markers first: this is the token-id loop.
        let m = self.peek()?;
        match m {
            0x00..=0x7f => {
                self.pos += 1;
                Some(u32::from(m))
            }
            0xcd => {
                self.pos += 1;
                self.be16().map(u32::from)
            }
            0xce => {
                self.pos += 1;
                self.be32()
            }
            _ => {
                let (v, unsigned) = self.int()?;
                if unsigned {
                    u32::try_from(v).ok()
                } else {
                    u32::try_from(v as i64).ok()
                }
            }
        }
    }

    /// serde's `i64`: any int marker, `uint64` only up to `i64::MAX`.
    fn i64(&mut self) -> Option<i64> {
        let (v, unsigned) = self.int()?;
        if unsigned {
            i64::try_from(v).ok()
        } else {
            Some(v as i64)
        }
    }

    /// Any int as `ExtraKey::Int` stores it: the value's bit pattern.
    fn i64_bits(&mut self) -> Option<i64> {
        self.int().map(|(v, _)| v as i64)
    }
}

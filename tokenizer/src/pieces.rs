//! Exact incremental tokenization: text is cut at *safe* points into pieces,
//! each piece is tokenized on its own (and cached), and the concatenation is
//! bit-identical to tokenizing the whole text.
//!
//! Why a cut is safe, for byte-level BPE tokenizers whose pre-tokenizer is a
//! GPT-style split regex (Qwen, Llama 3, GPT-2 families) and whose normalizer
//! is NFC or none:
//! - BPE merges never cross pre-token boundaries, so the token ids of a text
//!   are the ids of its pre-tokens, concatenated;
//! - we cut only where every such regex has a boundary whatever the context:
//!   (a) after `\n` before an ASCII letter (a newline run ends there; the
//!   letter run starts there, it can take an optional leading character but
//!   never `\n`), and (b) after an ASCII letter before a space followed by an
//!   ASCII letter (the letter run ends; ` word` starts). The regexes have no
//!   look-behind, so matching from the cut gives the same pre-tokens as the
//!   whole text did;
//! - the character at a cut is ASCII and never combining, so NFC does not
//!   compose across it;
//! - no added (special) token contains a space or a newline, or strips
//!   whitespace around itself, so no added token spans a cut.
//!
//! Whether a tokenizer has that shape is checked when it loads (structure,
//! plus a self-test on a probe text); otherwise the cache only serves
//! identical texts. The property tests in `tests/` check exactness on the
//! parity corpus over random cuts.
//!
//! Pieces are formed greedily from the start of the text, each at least
//! `MIN_PIECE` bytes: a text that extends an earlier one shares all its
//! pieces but the last, so a new turn of a conversation only tokenizes its
//! new part (plus at most one piece).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

/// Minimum piece length in bytes: large enough that per-call tokenizer
/// overhead is noise, small enough that re-tokenizing a prompt's last piece
/// is cheap.
pub const MIN_PIECE: usize = 2048;

/// Byte offsets where `text` may be cut (see the module docs).
pub fn safe_cuts(text: &str) -> impl Iterator<Item = usize> + '_ {
    let b = text.as_bytes();
    (1..b.len()).filter(move |&i| {
        let prev = b[i - 1];
        let cur = b[i];
        (prev == b'\n' && cur.is_ascii_alphabetic())
            || (cur == b' '
                && prev.is_ascii_alphabetic()
                && b.get(i + 1).is_some_and(u8::is_ascii_alphabetic))
    })
}

/// Splits `text` into pieces of at least `min` bytes at safe cuts.
pub fn pieces(text: &str, min: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for cut in safe_cuts(text) {
        if cut - start >= min {
            out.push(&text[start..cut]);
            start = cut;
        }
    }
    if start < text.len() || out.is_empty() {
        out.push(&text[start..]);
    }
    out
}

/// Hit and miss counts, in pieces and bytes.
#[derive(Debug, Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub hit_bytes: AtomicU64,
    pub miss_bytes: AtomicU64,
}

struct Entry {
    text: Arc<str>,
    ids: Arc<[u32]>,
    /// LRU clock value of the last use.
    used: u64,
}

/// Piece text -> token ids, bounded by bytes, least recently used evicted.
pub struct PieceCache {
    inner: Mutex<Inner>,
    pub stats: CacheStats,
}

struct Inner {
    map: HashMap<u64, Entry>,
    bytes: usize,
    capacity: usize,
    clock: u64,
}

impl PieceCache {
    pub fn new(capacity_bytes: usize) -> PieceCache {
        PieceCache {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                bytes: 0,
                capacity: capacity_bytes,
                clock: 0,
            }),
            stats: CacheStats::default(),
        }
    }

    fn cost(text: &str, ids: &[u32]) -> usize {
        text.len() + ids.len() * 4 + 64
    }

    /// Cached ids of `text` (compared in full: a hash collision is a miss).
    pub fn get(&self, text: &str) -> Option<Arc<[u32]>> {
        let mut inner = self.inner.lock();
        inner.clock += 1;
        let clock = inner.clock;
        let hit = inner
            .map
            .get_mut(&xxh3_64(text.as_bytes()))
            .filter(|e| &*e.text == text)
            .map(|e| {
                e.used = clock;
                e.ids.clone()
            });
        drop(inner);
        let (count, bytes) = if hit.is_some() {
            (&self.stats.hits, &self.stats.hit_bytes)
        } else {
            (&self.stats.misses, &self.stats.miss_bytes)
        };
        count.fetch_add(1, Ordering::Relaxed);
        bytes.fetch_add(text.len() as u64, Ordering::Relaxed);
        hit
    }

    pub fn insert(&self, text: &str, ids: Arc<[u32]>) {
        let cost = Self::cost(text, &ids);
        let mut inner = self.inner.lock();
        if cost > inner.capacity {
            return;
        }
        inner.clock += 1;
        let used = inner.clock;
        let key = xxh3_64(text.as_bytes());
        if let Some(old) = inner.map.insert(
            key,
            Entry {
                text: text.into(),
                ids,
                used,
            },
        ) {
            inner.bytes -= Self::cost(&old.text, &old.ids);
        }
        inner.bytes += cost;
        if inner.bytes > inner.capacity {
            inner.evict();
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }
}

impl Inner {
    /// Drops the least recently used entries down to 3/4 of capacity, in
    /// one pass: eviction cost is amortised over many inserts.
    fn evict(&mut self) {
        let target = self.capacity / 4 * 3;
        let mut by_age: Vec<(u64, u64)> = self.map.iter().map(|(k, e)| (e.used, *k)).collect();
        by_age.sort_unstable();
        for (_, key) in by_age {
            if self.bytes <= target {
                break;
            }
            if let Some(e) = self.map.remove(&key) {
                self.bytes -= PieceCache::cost(&e.text, &e.ids);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_are_where_the_rules_say() {
        let text = "ab cd\nEf 12 x\n\ny z";
        let cuts: Vec<usize> = safe_cuts(text).collect();
        // "ab| cd", "\n|Ef", "\n\n|y", "y| z"
        assert_eq!(cuts, vec![2, 6, 15, 16]);
        for c in cuts {
            assert!(text.is_char_boundary(c));
        }
    }

    #[test]
    fn pieces_cover_the_text_and_respect_the_minimum() {
        let text = "word ".repeat(1000);
        let parts = pieces(&text, 100);
        assert_eq!(parts.concat(), text);
        assert!(parts[..parts.len() - 1].iter().all(|p| p.len() >= 100));
        // An extension shares every piece but the last.
        let longer = format!("{text}and more words here");
        let more = pieces(&longer, 100);
        assert_eq!(&more[..parts.len() - 1], &parts[..parts.len() - 1]);
        assert_eq!(pieces("", 100), vec![""]);
        assert_eq!(pieces("短い", 1), vec!["短い"]);
    }

    #[test]
    fn cache_is_bounded_and_evicts_least_recently_used() {
        let cache = PieceCache::new(1000);
        let ids: Arc<[u32]> = vec![1u32; 10].into();
        for i in 0..100 {
            cache.insert(&format!("piece {i}"), ids.clone());
            let _ = cache.get("piece 0"); // keep piece 0 hot
        }
        assert!(cache.bytes() <= 1000);
        assert!(cache.get("piece 0").is_some());
        assert!(cache.get("piece 1").is_none());
        assert!(cache.get("piece 99").is_some());
        assert!(cache.stats.hits.load(Ordering::Relaxed) > 0);
    }
}

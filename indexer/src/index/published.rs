//! What readers of a `RunIndex` see, and how they see it without waiting
//! for the writer: the table of run heads (probed once per run a lookup
//! crosses), and each run's blocks and holdings, published into atomics
//! under a per-run sequence lock; all of it read with no lock.
//!
//! Why a sequence lock per run, not a read lock: a lookup that takes a
//! lock writes its cache line, which the writer's core then has to take
//! back; with one writer applying back to back, a reader of a run the
//! writer just touched waited for it each time (the comparison bench's
//! mixed pass made a third of the lookups SMG did with one lock for the
//! whole index). Here a reader writes nothing: it reads the run's version,
//! the run, and the version again, and reads again if the writer was there
//! in between.
//!
//! All in safe Rust: every word a reader reads is an atomic, a run's words
//! are replaced (when they grow) through `ArcSwapOption`, so a reader that
//! still holds the old ones reads memory that stays alive, and the run
//! slots themselves never move (`Arena`).

use std::hash::BuildHasher;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwapOption;
use smallvec::SmallVec;

use super::write::Span;
use crate::event::TIERS;
use crate::keys::KeyBuildHasher;

#[inline]
pub(super) fn hash(h: u64) -> u64 {
    KeyBuildHasher::default().hash_one(h)
}

/// The first block of every run -> the run: all a reader needs to find a
/// run. A lookup's first key starts a chain, so it is a run's first block;
/// where a lookup leaves a run, its next key is a block stored under the
/// one it left at, so it is in that run (and did not leave it) or starts
/// one. (Chained keys: a block is stored under its one parent, and it is
/// in one place.) The writer's table of every block is its own (see
/// `write`): readers need only this one, one entry per run.
///
/// Open addressing over atomics, so that readers take no lock: each slot
/// is a key word and a state word (`FULL << 32 | run`, `EMPTY` or a
/// tombstone). The writer writes a slot's key before its state (release),
/// a reader reads the state (acquire) before the key. Entries never move
/// (a removal leaves a tombstone), so a reader finds every entry that was
/// there for all of its probe; one removed or reused meanwhile may give it
/// a run that no longer starts with its key, which the reader checks under
/// the run's sequence lock anyway (`RunIndex::prefix_matches`). The table
/// grows (and sheds tombstones) by copying into a new one, swapped in.
#[derive(Default)]
pub(super) struct Heads {
    table: ArcSwapOption<HeadSlots>,
    /// The writer's counts of the current table's full and dead slots.
    full: AtomicUsize,
    dead: AtomicUsize,
}

pub(super) struct HeadSlots {
    /// `[key, state]` per slot.
    words: Box<[AtomicU64]>,
    mask: usize,
}

const EMPTY: u64 = 0;
const FULL: u64 = 1 << 32;
const DEAD: u64 = 2 << 32;

/// A state word names a run (its low half) only if it is `FULL`.
fn is_full(state: u64) -> bool {
    state >> 32 == FULL >> 32
}

impl HeadSlots {
    fn new(slots: usize) -> HeadSlots {
        HeadSlots {
            words: atomics(2 * slots),
            mask: slots - 1,
        }
    }

    /// Slot indices from `h`'s home on.
    fn probe(&self, h: u64) -> impl Iterator<Item = usize> + '_ {
        let home = hash(h) as usize;
        (0..=self.mask).map(move |i| (home + i) & self.mask)
    }

    fn state(&self, slot: usize) -> u64 {
        self.words[2 * slot + 1].load(Ordering::Acquire)
    }

    fn key(&self, slot: usize) -> u64 {
        self.words[2 * slot].load(Ordering::Relaxed)
    }

    /// The run `h` starts, if any: the writer's lookup, on the table it
    /// holds (`Writer::heads`, the one `Heads::insert` last returned): the
    /// writer alone changes the heads, so it needs no `arc-swap` load (two
    /// atomic operations a block, a third of a page-size-1 store's time).
    pub fn find(&self, h: u64) -> Option<u32> {
        for slot in self.probe(h) {
            let state = self.state(slot);
            if state == EMPTY {
                return None;
            }
            if is_full(state) && self.key(slot) == h {
                return Some(state as u32);
            }
        }
        None
    }

    fn fill(&self, slot: usize, h: u64, run: u32) {
        self.words[2 * slot].store(h, Ordering::Relaxed);
        self.words[2 * slot + 1].store(FULL | u64::from(run), Ordering::Release);
    }
}

impl Heads {
    /// The run `h` starts, if any (or, while the writer changes it, a run
    /// that did: see the type's doc).
    pub fn find(&self, h: u64) -> Option<u32> {
        self.table.load().as_ref()?.find(h)
    }

    /// `run` starts with `h`, which starts no other run. The writer alone
    /// calls this and `remove`. Returns the new table when it had to grow
    /// (see `HeadSlots::find`).
    pub fn insert(&self, h: u64, run: u32) -> Option<Arc<HeadSlots>> {
        let (full, dead) = (
            self.full.load(Ordering::Relaxed),
            self.dead.load(Ordering::Relaxed),
        );
        let current = self.table.load_full();
        let mut grown = None;
        let t = match current {
            // At most half full, tombstones counted, so probes stay short.
            Some(t) if (full + dead + 1) * 2 <= t.mask + 1 => t,
            old => {
                let t = self.rebuilt(old.as_deref(), full + 1);
                grown = Some(t.clone());
                t
            }
        };
        let slot = t
            .probe(h)
            .find(|s| !is_full(t.state(*s)))
            .expect("a free slot: the table is at most half full");
        if t.state(slot) == DEAD {
            self.dead.fetch_sub(1, Ordering::Relaxed);
        }
        t.fill(slot, h, run);
        self.full.fetch_add(1, Ordering::Relaxed);
        grown
    }

    pub fn remove(&self, h: u64) {
        let guard = self.table.load();
        let Some(t) = guard.as_ref() else { return };
        for slot in t.probe(h) {
            let state = t.state(slot);
            if state == EMPTY {
                return;
            }
            if is_full(state) && t.key(slot) == h {
                t.words[2 * slot + 1].store(DEAD, Ordering::Release);
                self.full.fetch_sub(1, Ordering::Relaxed);
                self.dead.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }

    /// A new table with room for `entries` at a quarter full, holding
    /// `old`'s live entries, swapped in (readers on the old one finish
    /// there; it is not written again).
    fn rebuilt(&self, old: Option<&HeadSlots>, entries: usize) -> Arc<HeadSlots> {
        let t = HeadSlots::new((entries * 4).next_power_of_two().max(64));
        if let Some(old) = old {
            for slot in 0..=old.mask {
                let state = old.state(slot);
                if is_full(state) {
                    let h = old.key(slot);
                    let free = t.probe(h).find(|s| t.state(*s) == EMPTY).expect("room");
                    t.fill(free, h, state as u32);
                }
            }
        }
        let t = Arc::new(t);
        self.table.store(Some(t.clone()));
        self.dead.store(0, Ordering::Relaxed);
        t
    }
}

/// A run's words: its block hashes, then its holdings, each holding a
/// header word (`pod << 32 | spans`) followed by its spans (`start << 32
/// | end`), sorted by pod. Readers read the first `len` hashes and
/// `holding_words` holdings, both set when the run is published; the
/// writer appends hashes past `len` at any time (no reader looks there),
/// and changes the rest only while the run's version is odd.
pub(super) struct Words {
    len: AtomicU32,
    holding_words: AtomicU32,
    hashes: Box<[AtomicU64]>,
    holdings: Box<[AtomicU64]>,
}

fn atomics(n: usize) -> Box<[AtomicU64]> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

impl Words {
    /// Room for `hashes` hashes (exactly) and `holding_words` holding
    /// words, and `from`'s first `len` hashes.
    pub fn grown(
        from: Option<&Words>,
        len: usize,
        hashes: usize,
        holding_words: usize,
    ) -> Arc<Words> {
        let w = Words {
            len: AtomicU32::new(0),
            holding_words: AtomicU32::new(0),
            hashes: atomics(hashes),
            holdings: atomics(holding_words.next_power_of_two().max(2)),
        };
        if let Some(from) = from {
            for (to, h) in w.hashes.iter().zip(&from.hashes[..len]) {
                to.store(h.load(Ordering::Relaxed), Ordering::Relaxed);
            }
        }
        Arc::new(w)
    }

    pub fn capacity(&self) -> usize {
        self.hashes.len()
    }

    pub fn holding_capacity(&self) -> usize {
        self.holdings.len()
    }

    pub fn hash(&self, off: usize) -> u64 {
        self.hashes[off].load(Ordering::Relaxed)
    }

    /// Writes hash `off`, which no reader reads: at or past the published
    /// length, or while the run's version is odd.
    pub fn set_hash(&self, off: usize, h: u64) {
        self.hashes[off].store(h, Ordering::Relaxed);
    }
}

/// One run's published state. The version is even while the run is
/// stable and odd while the writer changes it.
#[derive(Default)]
pub(super) struct Published {
    version: AtomicU64,
    words: ArcSwapOption<Words>,
}

/// A holding as the writer publishes it.
pub(super) struct HoldingView<'a> {
    pub holder: u32,
    pub spans: &'a [Span],
}

impl Published {
    /// Publishes a run: its first `len` hashes, already in `words` (which
    /// is replaced by a larger copy if the holdings do not fit), and its
    /// holdings. The writer alone calls this.
    pub fn publish<'a>(
        &self,
        words: &mut Arc<Words>,
        len: usize,
        holdings: impl Iterator<Item = HoldingView<'a>> + Clone,
    ) {
        // A header per pod, a word per span.
        let mut last_pod = None;
        let holding_words: usize = holdings
            .clone()
            .map(|h| {
                let pod = h.holder >> TIER_BITS;
                let header = usize::from(last_pod != Some(pod));
                last_pod = Some(pod);
                header + h.spans.len()
            })
            .sum();
        if holding_words > words.holdings.len() {
            *words = Words::grown(Some(words), len, words.capacity(), holding_words);
        }
        let v = self.version.load(Ordering::Relaxed);
        self.version.store(v + 1, Ordering::Relaxed);
        // Orders the odd version before the writes below, for a reader
        // that sees any of them (the sequence lock's writer side).
        fence(Ordering::Release);
        let current = self.words.load();
        if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, words)) {
            self.words.store(Some(words.clone()));
        }
        drop(current);
        // Only the words that changed are written: a store takes its line
        // from every reader's cache, and most publishes move one span end
        // of one holding among many.
        let put = |at: &mut usize, word: u64| {
            let slot = &words.holdings[*at];
            if slot.load(Ordering::Relaxed) != word {
                slot.store(word, Ordering::Relaxed);
            }
            *at += 1;
        };
        let mut at = 0;
        // Each pod: a header (`pod << 32 | tiers << 24 | spans`), then its
        // spans (`tier << 62 | start << 32 | end`), tier by tier.
        let mut holdings = holdings.peekable();
        while let Some(first) = holdings.peek() {
            let pod = first.holder >> TIER_BITS;
            let header_at = at;
            at += 1;
            let (mut tiers, mut spans) = (0u64, 0u64);
            while let Some(h) = holdings.next_if(|h| h.holder >> TIER_BITS == pod) {
                let tier = u64::from(tier_of(h.holder));
                tiers |= 1 << tier;
                for span in h.spans {
                    debug_assert!(span.start < MAX_RUN);
                    put(
                        &mut at,
                        tier << 62 | u64::from(span.start) << 32 | u64::from(span.end),
                    );
                    spans += 1;
                }
            }
            let header = u64::from(pod) << 32 | tiers << 24 | spans;
            let slot = &words.holdings[header_at];
            if slot.load(Ordering::Relaxed) != header {
                slot.store(header, Ordering::Relaxed);
            }
        }
        words.len.store(len as u32, Ordering::Relaxed);
        words
            .holding_words
            .store(holding_words as u32, Ordering::Relaxed);
        self.version.store(v + 2, Ordering::Release);
    }

    /// Runs `read` on a consistent view of the run (`None` if it was never
    /// published). `read` may run several times, each on a view that may
    /// be torn; only the result of a run the version check accepts is
    /// returned, so `read` must undo nothing and may not panic on any
    /// words (bounds are the view's own).
    pub fn read<R>(&self, mut read: impl FnMut(View<'_>) -> R) -> Option<R> {
        let mut spins = 0u32;
        loop {
            let v1 = self.version.load(Ordering::Acquire);
            if v1 & 1 == 1 {
                // The writer is publishing (a few hundred nanoseconds); if
                // it was descheduled meanwhile, let it run.
                spins += 1;
                if spins.is_multiple_of(64) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let guard = self.words.load();
            let result = guard.as_ref().map(|w| {
                let len = (w.len.load(Ordering::Relaxed) as usize).min(w.hashes.len());
                let held = (w.holding_words.load(Ordering::Relaxed) as usize).min(w.holdings.len());
                read(View {
                    hashes: &w.hashes[..len],
                    holdings: &w.holdings[..held],
                })
            });
            // The reader's side: the reads above before the check below.
            fence(Ordering::Acquire);
            if self.version.load(Ordering::Relaxed) == v1 {
                return result;
            }
        }
    }
}

/// A run's words as one read saw them.
#[derive(Clone, Copy)]
pub(super) struct View<'a> {
    hashes: &'a [AtomicU64],
    holdings: &'a [AtomicU64],
}

impl View<'_> {
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn hash(&self, off: usize) -> Option<u64> {
        self.hashes.get(off).map(|h| h.load(Ordering::Relaxed))
    }

    /// Each pod's holdings of the run, in pod order.
    #[inline]
    pub fn pods(&self) -> impl Iterator<Item = PodSpans<'_>> + '_ {
        let words = self.holdings;
        let mut at = 0;
        std::iter::from_fn(move || {
            let header = words.get(at)?.load(Ordering::Relaxed);
            let first = at + 1;
            at = first.saturating_add((header & 0xff_ffff) as usize);
            Some(PodSpans {
                pod: (header >> 32) as u32,
                // Masked: a torn read may hold anything.
                tiers: (header >> 24) as u8 & ((1 << TIERS) - 1),
                spans: words.get(first..at.min(words.len()))?,
            })
        })
    }
}

/// Bits of a holder id that are its tier (`pod << TIER_BITS | tier`).
pub(super) const TIER_BITS: u32 = 2;
const TIER_MASK: u32 = (1 << TIER_BITS) - 1;

/// A holder id's tier (its index in `Tier::ALL`).
pub(super) fn tier_of(holder: u32) -> u8 {
    (holder & TIER_MASK) as u8
}

/// Runs are at most this long (a block past it starts a run), so that a
/// published span's start leaves room for its tier and a pod's spans in a
/// run (at most half its length) fit its header's 24-bit count.
pub(super) const MAX_RUN: u32 = 1 << 24;

/// Where the writer starts a new run: `MAX_RUN`, and a few blocks in tests
/// (so that they cross it).
#[cfg(not(test))]
pub(super) const RUN_CAP: u32 = MAX_RUN;
#[cfg(test)]
pub(super) const RUN_CAP: u32 = 8;

/// On which tiers a pod holds the blocks `PodSpans::matched` counted: all
/// on one, or so many on each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Held {
    One(usize),
    Many(Counts),
}

/// Of some blocks, how many are held on each tier, and how many have each
/// tier as the best one holding them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Counts {
    pub per_tier: [u32; TIERS],
    pub best: [u32; TIERS],
}

impl Counts {
    /// `n` blocks, all on `tier`.
    pub fn one(tier: usize, n: u32) -> Counts {
        let on: [u32; TIERS] = std::array::from_fn(|t| if t == tier { n } else { 0 });
        Counts {
            per_tier: on,
            best: on,
        }
    }

    pub fn add(&mut self, other: &Counts) {
        for t in 0..TIERS {
            self.per_tier[t] = self.per_tier[t].saturating_add(other.per_tier[t]);
            self.best[t] = self.best[t].saturating_add(other.best[t]);
        }
    }
}

/// One pod's spans of one run (each tagged with its tier), as one read
/// saw them.
pub(super) struct PodSpans<'a> {
    pub pod: u32,
    /// Bit `t`: the pod holds some of the run on tier `t`.
    tiers: u8,
    spans: &'a [AtomicU64],
}

/// A span word: (tier, start, end).
fn span(word: &AtomicU64) -> (usize, u32, u32) {
    let s = word.load(Ordering::Relaxed);
    (
        (s >> 62) as usize,
        (s >> 32) as u32 & (MAX_RUN - 1),
        s as u32,
    )
}

impl PodSpans<'_> {
    /// Of the run's first `len` blocks, how many leading ones the pod
    /// holds (on any tier), and on which tiers (`better`: tiers, best
    /// first).
    #[inline]
    pub fn matched(&self, len: u32, better: &[usize; TIERS]) -> (u32, Held) {
        // Most pods hold a run on one tier, in one span from its start.
        if self.tiers.count_ones() == 1 {
            let n = match self.spans.first().map(span) {
                Some((_, 0, end)) => end.min(len),
                _ => 0,
            };
            return (n, Held::One(self.tiers.trailing_zeros() as usize));
        }
        let n = self.covered().min(len);
        (
            n,
            Held::Many(Counts {
                per_tier: self.held_below(n),
                best: self.best_below(n, better),
            }),
        )
    }

    /// Of the run's first `n` blocks, how many have each tier as the best
    /// (first in `better`) of those holding them. The spans' ends cut the
    /// blocks into stretches that each tier holds whole or not at all.
    fn best_below(&self, n: u32, better: &[usize; TIERS]) -> [u32; TIERS] {
        let mut cuts: SmallVec<[u32; 8]> = SmallVec::new();
        for (_, start, stop) in self.spans.iter().map(span) {
            cuts.push(start.min(n));
            cuts.push(stop.min(n));
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut best = [0u32; TIERS];
        for w in cuts.windows(2) {
            let (from, to) = (w[0], w[1]);
            let on = |t: usize| {
                self.spans
                    .iter()
                    .map(span)
                    .any(|(tier, start, stop)| tier == t && start <= from && to <= stop)
            };
            if let Some(&t) = better.iter().find(|t| on(**t)) {
                best[t] = best[t].saturating_add(to - from);
            }
        }
        best
    }

    /// Each span: (tier index, start, end), end excluded.
    pub fn spans(&self) -> impl Iterator<Item = (usize, u32, u32)> + '_ {
        self.spans
            .iter()
            .map(span)
            .filter(|&(tier, start, end)| tier < TIERS && start < end)
    }

    /// How many of the run's first blocks the pod holds, on any tier.
    fn covered(&self) -> u32 {
        let mut end = 0;
        // Each pass moves `end` past a span that holds it, or stops: at
        // most one pass per span, whatever a torn read holds.
        loop {
            let next = self
                .spans
                .iter()
                .map(span)
                .filter(|(_, start, stop)| *start <= end && end < *stop)
                .map(|(_, _, stop)| stop)
                .max();
            match next {
                Some(stop) => end = stop,
                None => return end,
            }
        }
    }

    /// Of the run's first `n` blocks, how many the pod holds on each tier.
    pub(super) fn held_below(&self, n: u32) -> [u32; TIERS] {
        let mut held = [0u32; TIERS];
        for (tier, start, stop) in self.spans.iter().map(span) {
            if let Some(h) = held.get_mut(tier) {
                *h = h.saturating_add(stop.min(n).saturating_sub(start));
            }
        }
        held
    }
}

/// Published runs by id, in segments that never move: segment `k` holds
/// `FIRST << k` runs, allocated when the first of them is.
pub(super) struct Arena {
    segments: [OnceLock<Box<[Published]>>; SEGMENTS],
}

const FIRST: usize = 1024;
/// Enough segments for every `u32` id.
const SEGMENTS: usize = 23;

impl Default for Arena {
    fn default() -> Self {
        Arena {
            segments: [const { OnceLock::new() }; SEGMENTS],
        }
    }
}

impl Arena {
    /// Run `id`'s segment and index in it.
    fn place(id: u32) -> (usize, usize) {
        let n = id as usize / FIRST + 1;
        let k = (usize::BITS - 1 - n.leading_zeros()) as usize;
        (k, id as usize - FIRST * ((1 << k) - 1))
    }

    /// Run `id`, its segment allocated if it was not: the writer's, when
    /// it makes a run (before any reader can find it).
    pub fn get(&self, id: u32) -> &Published {
        let (k, i) = Self::place(id);
        &self.segments[k].get_or_init(|| (0..FIRST << k).map(|_| Published::default()).collect())[i]
    }

    /// Run `id` if its segment exists: the readers', which never allocate
    /// (a segment is up to 2^22 slots) nor wait for the writer to.
    pub fn find(&self, id: u32) -> Option<&Published> {
        let (k, i) = Self::place(id);
        self.segments[k].get().map(|segment| &segment[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Through growth, tombstones and slots reused: every head present is
    /// found, every one removed is not.
    #[test]
    fn heads_are_found_while_present() {
        let heads = Heads::default();
        let key = |i: u32| hash(u64::from(i) ^ 0xabcd);
        let mut present = std::collections::HashMap::new();
        for round in 0..6u32 {
            for i in 0..5_000 {
                let id = round * 5_000 + i;
                heads.insert(key(id), id);
                present.insert(id, id);
            }
            // Every third of all so far goes.
            let gone: Vec<u32> = present
                .keys()
                .copied()
                .filter(|id| id % 3 == round % 3)
                .collect();
            for id in gone {
                heads.remove(key(id));
                present.remove(&id);
            }
            for id in 0..(round + 1) * 5_000 {
                assert_eq!(
                    heads.find(key(id)),
                    present.get(&id).copied(),
                    "round {round}, id {id}"
                );
            }
        }
        let t = heads.table.load_full().expect("a table");
        assert!(heads.full.load(Ordering::Relaxed) * 4 <= t.mask + 1 + 64 * 4);
    }

    #[test]
    fn run_ids_map_to_distinct_slots() {
        let mut last = (0, 0);
        assert_eq!(Arena::place(0), (0, 0));
        for id in 1..200_000u32 {
            let p = Arena::place(id);
            let next = if last.1 + 1 == FIRST << last.0 {
                (last.0 + 1, 0)
            } else {
                (last.0, last.1 + 1)
            };
            assert_eq!(p, next, "id {id}");
            last = p;
        }
        assert_eq!(Arena::place(u32::MAX).0, SEGMENTS - 1);
    }
}

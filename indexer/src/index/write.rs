//! The writer's side of a `RunIndex`: the runs as plain vectors and which
//! of them changed since they were last published (see `published`). The
//! rules that change them are each a file: `store`, `remove` (removals and
//! clears), `evict` (each pod's store order, and eviction by it).

use std::collections::hash_map::{Entry, HashMap};
use std::sync::Arc;

use hashbrown::hash_table::HashTable;
use smallvec::SmallVec;

use crate::event::TIERS;

mod evict;
mod remove;
mod store;

use evict::{Pods, Touch};

use super::published::{
    hash, tier_of, Arena, HeadSlots, Heads, HoldingView, Words, RUN_CAP, TIER_BITS,
};

/// A block's place: its run and its offset in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Loc {
    pub run: u32,
    pub off: u32,
}

/// One distinct block in the writer's table: its hash, kept beside its
/// place so a probe reads one slot, not the run too.
#[derive(Clone, Copy, Debug)]
struct Slot {
    hash: u64,
    loc: Loc,
}

/// Every block in a run -> its place: the writer's alone (readers find
/// runs by their heads, see `published::Heads`), so it takes no lock.
#[derive(Default)]
pub(super) struct Table(HashTable<Slot>);

impl Table {
    pub fn find(&self, h: u64) -> Option<Loc> {
        self.0.find(hash(h), |s| s.hash == h).map(|s| s.loc)
    }

    fn insert(&mut self, h: u64, loc: Loc) {
        self.0
            .insert_unique(hash(h), Slot { hash: h, loc }, |s| hash(s.hash));
    }

    /// Inserts `h` at `loc` unless the table has it: one probe. Whether
    /// it did.
    fn insert_new(&mut self, h: u64, loc: Loc) -> bool {
        match self.0.entry(hash(h), |s| s.hash == h, |s| hash(s.hash)) {
            hashbrown::hash_table::Entry::Occupied(_) => false,
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(Slot { hash: h, loc });
                true
            }
        }
    }

    fn remove(&mut self, h: u64) {
        if let Ok(e) = self.0.find_entry(hash(h), |s| s.hash == h) {
            e.remove();
        }
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// A half-open range of a run's offsets a pod holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Span {
    pub start: u32,
    pub end: u32,
}

/// What one pod holds of one run: disjoint spans, sorted, none touching
/// (touching spans are merged). A pod whose cache is prefix-closed, as
/// vLLM's leaf-first eviction keeps it, has one.
#[derive(Clone, Debug)]
pub(super) struct Holding {
    /// A pod and a tier (`pod << TIER_BITS | tier`, see `RunIndex`).
    pub holder: u32,
    /// When the holder last stored into it or under it (`Writer::clock`):
    /// eviction takes the oldest holdings' blocks first. A store stamps
    /// the holdings along its chain and above it, deepest oldest, so
    /// leaves go first (see `Writer::stamp`), and no two holdings share a
    /// stamp: what is evicted depends on the order of stores alone, not on
    /// how runs are numbered. (It fills padding: a holding is 32 bytes
    /// either way.)
    pub stamp: u32,
    pub spans: SmallVec<[Span; 1]>,
}

impl Holding {
    /// Adds `off`; false if it was held.
    #[inline]
    fn insert(&mut self, off: u32) -> bool {
        // A chain stored in order extends the last span.
        if let Some(last) = self.spans.last_mut() {
            if last.end == off {
                last.end += 1;
                return true;
            }
        }
        let i = self.spans.partition_point(|s| s.end < off);
        match self.spans.get(i).copied() {
            Some(s) if s.start <= off && off < s.end => false,
            Some(s) if s.end == off => {
                // Extends span i, maybe into the next one.
                let merge = self.spans.get(i + 1).is_some_and(|n| n.start == off + 1);
                if merge {
                    self.spans[i].end = self.spans[i + 1].end;
                    self.spans.remove(i + 1);
                } else {
                    self.spans[i].end = off + 1;
                }
                true
            }
            Some(s) if s.start == off + 1 => {
                self.spans[i].start = off;
                true
            }
            _ => {
                self.spans.insert(
                    i,
                    Span {
                        start: off,
                        end: off + 1,
                    },
                );
                true
            }
        }
    }

    /// Drops `off`; false if it was not held.
    fn remove(&mut self, off: u32) -> bool {
        let i = self.spans.partition_point(|s| s.end <= off);
        let Some(s) = self.spans.get(i).copied().filter(|s| s.start <= off) else {
            return false;
        };
        match (s.start == off, s.end == off + 1) {
            (true, true) => {
                self.spans.remove(i);
            }
            (true, false) => self.spans[i].start = off + 1,
            (false, true) => self.spans[i].end = off,
            (false, false) => {
                self.spans[i].end = off;
                self.spans.insert(
                    i + 1,
                    Span {
                        start: off + 1,
                        end: s.end,
                    },
                );
            }
        }
        true
    }
}

/// Room for a run's blocks once `len` fill it: half as many again (one
/// at first). A run grows at its end only, and is kept as long as it is
/// held: doubling left its per-block arrays a third empty on average
/// (measured: 54% more room than blocks on the comparison bench's
/// 16-pod trace), where half again leaves a fifth, at the cost of a
/// third more copying while runs grow.
fn room_after(len: usize) -> usize {
    (len + len / 2).max(len + 1)
}

/// `v.push(x)`, growing `v` as runs' words grow (`room_after`).
fn push_growing<T>(v: &mut Vec<T>, x: T) {
    if v.len() == v.capacity() {
        v.reserve_exact(room_after(v.len()) - v.len());
    }
    v.push(x);
}

/// A run's hashes and, with token keys, the engine names of its blocks
/// (from a run's fields, so that its other fields stay free to change);
/// `None` if it has no blocks (or, with token keys, no names).
fn hashes_and_names<'a>(
    words: &'a Option<Arc<Words>>,
    names: &'a Option<Box<Names>>,
    token_keys: bool,
) -> Option<(&'a Words, Option<&'a [u64]>)> {
    let words = words.as_deref()?;
    match (names, token_keys) {
        (_, false) => Some((words, None)),
        (Some(names), true) => Some((words, Some(&names.engines))),
        (None, true) => None,
    }
}

/// A stretch of one chain: block `k + 1` was stored under block `k`.
#[derive(Default)]
pub(super) struct Run {
    /// The blocks' hashes, in the words readers read (one copy, see
    /// `published::Words`); the first `len`.
    words: Option<Arc<Words>>,
    len: u32,
    /// Pods holding each block. A block nobody holds stays only while a
    /// held block comes after it in the run (a dead tail is cut at once).
    pub holders_of: Vec<u32>,
    /// Sorted by pod.
    pub holdings: Vec<Holding>,
    /// Token keys only (boxed: most runs are short, and a run's fixed cost
    /// is a good part of an entry's bytes).
    names: Option<Box<Names>>,
    /// In `Writer::changed`.
    listed: bool,
    /// The block its first block was stored under, if the index had it:
    /// a store restamps the pod's holdings up this path (see `stamp`). It
    /// may outlive that block (the place then holds another, or none),
    /// which only the eviction order could notice.
    pub parent: Option<Loc>,
}

/// What a run's blocks are named by, where names are not keys.
#[derive(Default)]
pub(super) struct Names {
    /// Each block's engine hash, as the pod that stored it first named it
    /// (what its table entry is under).
    pub engines: Vec<u64>,
    /// Other engine hashes pods named a block by (pods whose hash seed
    /// differs), sorted by offset, each also in the table.
    pub aliases: Vec<(u32, u64)>,
}

impl Run {
    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn hash(&self, off: u32) -> Option<u64> {
        (off < self.len).then(|| {
            self.words
                .as_ref()
                .expect("a block has words")
                .hash(off as usize)
        })
    }

    /// Appends `h`. Readers do not see it until the run is published: it
    /// is past the length they read (every public call of the index ends
    /// by publishing, and only removals shorten a run, so the published
    /// length is never above `len` when a store appends).
    fn push_hash(&mut self, h: u64) {
        let len = self.len as usize;
        let words = match &self.words {
            Some(w) if w.capacity() > len => w,
            old => {
                let holdings = old.as_deref().map_or(0, Words::holding_capacity);
                let grown = Words::grown(old.as_deref(), len, room_after(len), holdings);
                self.words.insert(grown)
            }
        };
        words.set_hash(len, h);
        self.len += 1;
    }

    pub fn names(&self) -> Option<&Names> {
        self.names.as_deref()
    }

    #[cfg(test)]
    pub fn engine(&self, off: u32) -> u64 {
        self.names.as_ref().expect("token keys").engines[off as usize]
    }

    #[cfg(test)]
    pub fn aliases(&self) -> &[(u32, u64)] {
        self.names.as_ref().map_or(&[], |n| &n.aliases)
    }

    fn pop_hash(&mut self) -> u64 {
        self.len -= 1;
        self.words
            .as_ref()
            .expect("a block has words")
            .hash(self.len as usize)
    }

    /// The index of `holder`'s holding, added (empty) if it has none, and
    /// whether it was.
    fn holding(&mut self, holder: u32) -> (usize, bool) {
        match self.holdings.binary_search_by_key(&holder, |h| h.holder) {
            Ok(i) => (i, false),
            Err(i) => {
                // Most runs have one holding: room for it alone (and the
                // usual doubling from there).
                if self.holdings.capacity() == 0 {
                    self.holdings.reserve_exact(1);
                }
                self.holdings.insert(
                    i,
                    Holding {
                        holder,
                        stamp: 0,
                        spans: SmallVec::new(),
                    },
                );
                (i, true)
            }
        }
    }

    /// The index of `holder`'s holding, if it has one.
    fn holding_of(&self, holder: u32) -> Option<usize> {
        self.holdings
            .binary_search_by_key(&holder, |h| h.holder)
            .ok()
    }

    /// The index of `holder`'s holding, if it holds the block at `off`.
    pub fn holding_at(&self, holder: u32, off: u32) -> Option<usize> {
        self.holding_of(holder).filter(|&i| {
            self.holdings[i]
                .spans
                .iter()
                .any(|s| s.start <= off && off < s.end)
        })
    }

    /// Whether `pod` holds any of it, on any tier.
    fn held_by(&self, pod: u32) -> bool {
        self.holdings.iter().any(|h| h.holder >> TIER_BITS == pod)
    }
}

/// The runs by id, and what is left to publish.
#[derive(Default)]
pub(super) struct Writer {
    /// Token keys: a block's key is not its engine hash (see `Names`).
    pub token_keys: bool,
    /// Evicted by a capacity (`RunIndex::bounded`): a store restamps the
    /// holdings up its prefix too, which only eviction reads.
    pub bounded: bool,
    /// Engine hash -> block.
    pub table: Table,
    pub runs: Vec<Run>,
    /// Run ids whose run died, reused first.
    pub free: Vec<u32>,
    /// Runs changed since the last `publish`.
    changed: Vec<u32>,
    /// Stores of a block its holder held already, beyond the first, by
    /// (holder, the name it stored it by): vLLM can store a hash twice and
    /// remove it twice, and the block stays until the last removal. Empty
    /// almost always, so a removal looks here only when it is not.
    repeats: HashMap<(u32, u64), u32>,
    /// Each pod's holdings in store order, and its entries (see `evict`).
    pods: Pods,
    /// The newest stamp given (see `Holding::stamp`).
    pub clock: u32,
    /// The heads' current table, as `Heads::insert` last returned it: the
    /// writer's own lookups (`find_head`) skip readers' `arc-swap` load.
    heads: Option<Arc<HeadSlots>>,
}

/// Runs above a store whose holdings it restamps, at most: a chain that
/// branched more often keeps its older stamps further up (a prefix there
/// may then be evicted before a branch under it; answers only shorten).
const MAX_CLIMB: usize = 256;

/// Whether `t` is its holding's latest store (see `evict`).
fn is_live(runs: &[Run], t: &Touch) -> bool {
    let r = &runs[t.run as usize];
    r.holding_of(t.holder)
        .is_some_and(|i| r.holdings[i].stamp == t.stamp)
}

impl Writer {
    /// Notes that `run` changed.
    fn touch(&mut self, run: u32) {
        let r = &mut self.runs[run as usize];
        if !r.listed {
            r.listed = true;
            self.changed.push(run);
        }
    }

    /// Makes every change so far visible to readers.
    pub fn publish(&mut self, arena: &Arena) {
        for id in std::mem::take(&mut self.changed) {
            let r = &mut self.runs[id as usize];
            r.listed = false;
            // A run that was never given a block has nothing to show.
            let Some(words) = r.words.as_mut() else {
                continue;
            };
            arena.get(id).publish(
                words,
                r.len as usize,
                r.holdings.iter().map(|h| HoldingView {
                    holder: h.holder,
                    spans: &h.spans,
                }),
            );
        }
    }

    /// Whether `holder`'s holding of `run`, stamped `stamp`, is queued for
    /// its pod (every holding must be).
    #[cfg(test)]
    pub fn is_queued(&self, holder: u32, run: u32, stamp: u32) -> bool {
        let touch = Touch { stamp, run, holder };
        self.pods
            .get(&(holder >> TIER_BITS))
            .is_some_and(|p| p.contains(&touch))
    }

    /// Key `k` at `loc`, if `loc` is in its run.
    fn is_at(&self, k: u64, loc: Loc) -> bool {
        self.runs[loc.run as usize].hash(loc.off) == Some(k)
    }

    /// The block at `loc` was first named `e`, if `loc` is in its run.
    fn is_named(&self, e: u64, loc: Loc) -> bool {
        if self.token_keys {
            self.runs[loc.run as usize]
                .names
                .as_ref()
                .and_then(|n| n.engines.get(loc.off as usize))
                == Some(&e)
        } else {
            self.is_at(e, loc)
        }
    }

    /// The key of the block engine hash `e` names, if any.
    pub fn key_of(&self, e: u64) -> Option<u64> {
        let loc = self.table.find(e)?;
        self.runs[loc.run as usize].hash(loc.off)
    }

    pub(in crate::index) fn new_run(&mut self) -> u32 {
        match self.free.pop() {
            Some(id) => id,
            None => {
                self.runs.push(Run::default());
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// The (holder, block) entries `pod` has, per tier.
    pub fn entries(&self, pod: u32) -> [u64; TIERS] {
        self.pods.get(&pod).map_or([0; TIERS], |p| p.entries)
    }

    pub fn holdings(&self, pod: u32) -> u64 {
        self.pods.get(&pod).map_or(0, |p| p.holdings)
    }

    /// The keys of the leading `engines` (a chain under the block `parent`
    /// names, if any) that name blocks the index has by these first names:
    /// the next block of the run the chain is in, read in order, or any
    /// block the table has (a run's head, most often). Appended to `out`;
    /// stops at the first it does not have.
    pub fn keys_along(&self, parent: Option<u64>, engines: &[u64], out: &mut Vec<u64>) {
        let mut at = match parent.map(|p| self.table.find(p)) {
            Some(None) => return,
            Some(found) => found,
            None => None,
        };
        let mut rest = engines;
        while let Some(&e) = rest.first() {
            // Along the run: its names side by side with the chain's.
            if let Some(l) = at {
                let r = &self.runs[l.run as usize];
                if let (Some(names), Some(words)) = (r.names.as_deref(), r.words.as_deref()) {
                    let from = l.off as usize + 1;
                    let ahead = names.engines.get(from..r.len as usize).unwrap_or(&[]);
                    let n = ahead.iter().zip(rest).take_while(|(a, b)| a == b).count();
                    if n > 0 {
                        out.extend((from..from + n).map(|off| words.hash(off)));
                        rest = &rest[n..];
                        at = Some(Loc {
                            run: l.run,
                            off: (from + n - 1) as u32,
                        });
                        continue;
                    }
                }
            }
            // Anywhere else (a run's head, most often).
            let Some(found) = self.table.find(e).filter(|l| self.is_named(e, *l)) else {
                return;
            };
            let Some(k) = self.runs[found.run as usize].hash(found.off) else {
                return;
            };
            out.push(k);
            rest = &rest[1..];
            at = Some(found);
        }
    }

    /// The key of the block `e` names, if `pod` holds it on some tier.
    pub fn key_held_by(&self, pod: u32, e: u64) -> Option<u64> {
        let loc = self.table.find(e)?;
        let r = &self.runs[loc.run as usize];
        (0..TIERS as u32)
            .any(|tier| r.holding_at(pod << TIER_BITS | tier, loc.off).is_some())
            .then(|| r.hash(loc.off))
            .flatten()
    }
}

/// What restoring a dump (`dump`) sets directly.
impl Writer {
    /// Gives `holder` `spans` of `run` (it had none), stored at `stamp`;
    /// `holders_of` must count them (the caller's part).
    pub(in crate::index) fn adopt(
        &mut self,
        run: u32,
        holder: u32,
        stamp: u32,
        spans: SmallVec<[Span; 1]>,
    ) {
        let r = &mut self.runs[run as usize];
        debug_assert!(r.holding_of(holder).is_none());
        let held: u32 = spans.iter().map(|s| s.end - s.start).sum();
        let (i, _) = r.holding(holder);
        r.holdings[i].stamp = stamp;
        r.holdings[i].spans = spans;
        let pod = self.pods.entry(holder >> TIER_BITS);
        pod.entries[usize::from(tier_of(holder))] += u64::from(held);
        pod.holdings += 1;
        // Out of stamp order: `sort_queues` puts it in place, and nothing
        // is stale yet.
        pod.push_unordered(Touch { stamp, run, holder });
        self.touch(run);
    }

    /// After `adopt`s: each pod's queue in stamp order.
    pub(in crate::index) fn sort_queues(&mut self) {
        for pod in self.pods.values_mut() {
            pod.sort();
        }
    }

    /// Repeated stores, by (holder, name).
    pub(in crate::index) fn repeats(&self) -> impl Iterator<Item = ((u32, u64), u32)> + '_ {
        self.repeats.iter().map(|(k, v)| (*k, *v))
    }

    /// Counts `count` repeated stores of `name` by `holder`; false if some
    /// were counted already.
    pub(in crate::index) fn add_repeats(&mut self, holder: u32, name: u64, count: u32) -> bool {
        match self.repeats.entry((holder, name)) {
            Entry::Occupied(_) => false,
            Entry::Vacant(v) => {
                v.insert(count);
                true
            }
        }
    }
}

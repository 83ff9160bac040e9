//! The writer's side of a `RunIndex`: the runs as plain vectors, the
//! rules that apply a pod's stores and removals to them, and which runs
//! changed since they were last published (see `shared`).

use std::collections::hash_map::{Entry, HashMap};
use std::sync::Arc;

use hashbrown::hash_table::HashTable;
use smallvec::SmallVec;

use crate::event::TIERS;

use super::pods::{PodRuns, Pods, Touch};
use super::shared::{hash, tier_of, Arena, Heads, HoldingView, Words, RUN_CAP, TIER_BITS};

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
/// runs by their heads, see `shared::Heads`), so it takes no lock.
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
    /// `shared::Words`); the first `len`.
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
    /// Each pod's holdings in store order, and its entries (see `pods`).
    pods: Pods,
    /// The newest stamp given (see `Holding::stamp`).
    pub clock: u32,
}

/// Runs above a store whose holdings it restamps, at most: a chain that
/// branched more often keeps its older stamps further up (a prefix there
/// may then be evicted before a branch under it; answers only shorten).
const MAX_CLIMB: usize = 256;

/// Whether `t` is its holding's latest store (see `pods`).
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

    pub(super) fn new_run(&mut self) -> u32 {
        match self.free.pop() {
            Some(id) => id,
            None => {
                self.runs.push(Run::default());
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Puts a new block (engine hash `e`, key `k`) at the end of `run`.
    /// A run's first block makes it findable: its published slot is
    /// allocated first (readers never allocate one, see `Arena::find`).
    pub(super) fn push(&mut self, heads: &Heads, arena: &Arena, run: u32, e: u64, k: u64) -> Loc {
        let r = &mut self.runs[run as usize];
        let loc = Loc { run, off: r.len() };
        r.push_hash(k);
        push_growing(&mut r.holders_of, 0);
        if self.token_keys {
            push_growing(&mut r.names.get_or_insert_default().engines, e);
        }
        self.touch(run);
        self.table.insert(e, loc);
        if loc.off == 0 {
            arena.get(run);
            heads.insert(k, run);
        }
        loc
    }

    /// Makes the block at `loc` findable by `e` too, if it is not.
    pub(super) fn alias(&mut self, e: u64, loc: Loc) {
        if self.table.find(e).is_none() {
            self.table.insert(e, loc);
            let aliases = &mut self.runs[loc.run as usize]
                .names
                .get_or_insert_default()
                .aliases;
            // By offset (a pod walking a run adds them in order: at the
            // end), so a cut tail's are the last ones.
            let at = aliases.partition_point(|(off, _)| *off <= loc.off);
            aliases.insert(at, (loc.off, e));
        }
    }

    /// `pod` stored `blocks` ((engine hash, key) each), a chain under the
    /// block at `at` (if the parent is known). Returns how many blocks it
    /// could not store: from one whose engine hash the index knows as
    /// another block on (two pods' claims disagree; the rest of the chain
    /// is keyed from it, so it goes too).
    pub fn store(
        &mut self,
        heads: &Heads,
        arena: &Arena,
        pod: u32,
        at: Option<Loc>,
        blocks: impl ExactSizeIterator<Item = (u64, u64)>,
    ) -> usize {
        let total = blocks.len();
        let mut touched = SmallVec::new();
        let (skipped, repeated) = self.store_chain(heads, arena, pod, at, blocks, &mut touched);
        if !touched.is_empty() {
            let added = (total - skipped - repeated) as u64;
            self.stamp(pod, &touched, added);
        }
        skipped
    }

    /// Stamps the holdings `holder`'s store went through, in chain order
    /// (run, index of the holding), and the holder's holdings of the runs
    /// above them (the store's prefix was used again): the deepest gets
    /// the oldest of the new stamps. So a pod's holding is always newer
    /// than its holdings below it, and eviction, oldest first, never takes
    /// a block before the blocks the pod holds under it. Queues them for
    /// its pod, which gained `added` entries.
    fn stamp(&mut self, holder: u32, touched: &[(u32, usize)], added: u64) {
        let mut above: SmallVec<[(u32, usize); 8]> = SmallVec::new();
        let mut up = touched
            .first()
            .filter(|_| self.bounded)
            .and_then(|&(run, _)| self.runs[run as usize].parent);
        while let Some(p) = up.filter(|_| above.len() < MAX_CLIMB) {
            let r = &self.runs[p.run as usize];
            let Some(i) = r.holding_at(holder, p.off) else {
                break;
            };
            above.push((p.run, i));
            up = r.parent;
        }
        let chain: SmallVec<[(u32, usize); 8]> =
            above.iter().rev().chain(touched).copied().collect();
        let touched = &chain[..];
        let n = touched.len() as u32;
        if self.clock > u32::MAX - n {
            self.renumber();
        }
        let pod = self.pods.entry(holder >> TIER_BITS);
        pod.entries[usize::from(tier_of(holder))] += added;
        let runs = &mut self.runs;
        for (k, &(run, i)) in touched.iter().enumerate().rev() {
            let stamp = self.clock + n - k as u32;
            runs[run as usize].holdings[i].stamp = stamp;
            pod.push(Touch { stamp, run, holder }, |t| is_live(runs, t));
        }
        self.clock += n;
    }

    /// `store`, listing the holdings it goes through in `touched` (run,
    /// index of the holding). Returns the blocks not stored (see `store`)
    /// and those the holder held already.
    fn store_chain(
        &mut self,
        heads: &Heads,
        arena: &Arena,
        pod: u32,
        mut at: Option<Loc>,
        blocks: impl ExactSizeIterator<Item = (u64, u64)>,
        touched: &mut SmallVec<[(u32, usize); 4]>,
    ) -> (usize, usize) {
        let mut repeated = 0;
        let total = blocks.len();
        let mut blocks = blocks.peekable();
        // (run, index of the pod's holding in it).
        let mut holding: Option<(u32, usize)> = None;
        // Blocks stored or counted as repeats so far.
        let mut done = 0;
        loop {
            // Along the run whose held end the pod just stored: the blocks
            // the run has next, as a stretch (most of a store of a shared
            // prefix).
            if let (Some(l), Some((run, i))) = (at, holding) {
                if l.run == run {
                    let n = self.stretch(run, i, l.off + 1, &mut blocks);
                    if n > 0 {
                        done += n as usize;
                        at = Some(Loc {
                            run,
                            off: l.off + n,
                        });
                        continue;
                    }
                }
            }
            let Some((e, k)) = blocks.next() else {
                break;
            };
            let next = at.map(|l| Loc {
                run: l.run,
                off: l.off + 1,
            });
            let loc = match next {
                Some(n) if self.is_at(k, n) => {
                    if self.token_keys && !self.is_named(e, n) {
                        match self.table.find(e) {
                            None => self.alias(e, n),
                            Some(named) if named == n => {}
                            // `e` names another block: the claims disagree.
                            Some(_) => return (total - done, repeated),
                        }
                    }
                    n
                }
                _ => match self.table.find(e) {
                    // Engine keys: the table is by key, nothing to check.
                    Some(loc) if !self.token_keys || self.is_at(k, loc) => loc,
                    Some(_) => return (total - done, repeated),
                    // Under another engine hash, a block that is not where
                    // its parent's run goes on starts a run (see
                    // `shared::Heads`).
                    None => match self.token_keys.then(|| heads.find(k)).flatten() {
                        Some(run) => {
                            let loc = Loc { run, off: 0 };
                            self.alias(e, loc);
                            loc
                        }
                        // A new block: it extends its parent's run if the
                        // parent ends it, or starts a run.
                        None => match next {
                            Some(n)
                                if n.off == self.runs[n.run as usize].len() && n.off < RUN_CAP =>
                            {
                                self.push(heads, arena, n.run, e, k)
                            }
                            _ => {
                                let run = self.new_run();
                                self.runs[run as usize].parent = at;
                                self.push(heads, arena, run, e, k)
                            }
                        },
                    },
                },
            };
            // Along a run, the pod's holding is the one the last block used.
            let i = match holding {
                Some((r, i)) if r == loc.run => i,
                _ => {
                    let (i, new) = self.runs[loc.run as usize].holding(pod);
                    if new {
                        self.pods.entry(pod >> TIER_BITS).holdings += 1;
                    }
                    touched.push((loc.run, i));
                    i
                }
            };
            holding = Some((loc.run, i));
            let run = &mut self.runs[loc.run as usize];
            if run.holdings[i].insert(loc.off) {
                run.holders_of[loc.off as usize] += 1;
                self.touch(loc.run);
            } else {
                // Saturating: a count near 2^32 (a dump's) must not wrap.
                let count = self.repeats.entry((pod, e)).or_default();
                *count = count.saturating_add(1);
                repeated += 1;
            }
            at = Some(loc);
            done += 1;
        }
        (0, repeated)
    }

    /// Stores the blocks of `blocks` that are the next ones of `run` from
    /// `off` on, while `holder`'s holding `i` of it ends right at them (so
    /// it holds none of them: no repeats), and with the engine hashes the
    /// run's blocks go by; returns how many. The rest, whatever they are,
    /// are left to the block-by-block rules.
    fn stretch(
        &mut self,
        run: u32,
        i: usize,
        off: u32,
        blocks: &mut std::iter::Peekable<impl Iterator<Item = (u64, u64)>>,
    ) -> u32 {
        let r = &mut self.runs[run as usize];
        let Some(last) = r.holdings[i].spans.last() else {
            return 0;
        };
        if last.end != off {
            return 0;
        }
        let Some((words, engines)) = hashes_and_names(&r.words, &r.names, self.token_keys) else {
            return 0;
        };
        let mut end = off;
        while end < r.len {
            let Some(&(e, k)) = blocks.peek() else {
                break;
            };
            let named = engines.is_none_or(|n| n.get(end as usize) == Some(&e));
            if words.hash(end as usize) != k || !named {
                break;
            }
            blocks.next();
            r.holders_of[end as usize] += 1;
            end += 1;
        }
        if end == off {
            return 0;
        }
        r.holdings[i].spans.last_mut().expect("a span").end = end;
        self.touch(run);
        end - off
    }

    /// `pod` removed `hashes`; returns how many it did not hold.
    pub fn remove(&mut self, heads: &Heads, pod: u32, hashes: &[u64]) -> usize {
        let (mut unknown, mut released) = (0, 0);
        let mut last: Option<Loc> = None;
        // (run, index of the pod's holding in it), as in `store`.
        let mut holding: Option<(u32, usize)> = None;
        let mut rest = hashes;
        while let Some((&h, after)) = rest.split_first() {
            // Down the run whose block the pod just let go of: the blocks
            // before it, as a stretch (a tail evicted leaf first).
            if let (Some(l), Some((run, i))) = (last, holding) {
                if l.run == run && self.repeats.is_empty() {
                    let n = self.shrink(heads, run, i, l.off, rest);
                    if n > 0 {
                        released += n as u64;
                        rest = &rest[n as usize..];
                        last = Some(Loc {
                            run,
                            off: l.off - n,
                        });
                        continue;
                    }
                }
            }
            rest = after;
            // Leaf-first eviction names a chain tail first: the block
            // before the last one is the likeliest.
            let near = last.and_then(|l| {
                [l.off.checked_sub(1), l.off.checked_add(1)]
                    .into_iter()
                    .flatten()
                    .map(|off| Loc { run: l.run, off })
                    .find(|n| self.is_named(h, *n))
            });
            let Some(loc) = near.or_else(|| self.table.find(h)) else {
                unknown += 1;
                continue;
            };
            last = Some(loc);
            if !self.repeats.is_empty() {
                if let Entry::Occupied(mut repeated) = self.repeats.entry((pod, h)) {
                    *repeated.get_mut() -= 1;
                    if *repeated.get() == 0 {
                        repeated.remove();
                    }
                    continue;
                }
            }
            if self.release(heads, pod, loc, &mut holding) {
                released += 1;
            } else {
                unknown += 1;
            }
        }
        if released > 0 {
            self.count_released(pod, released);
        }
        unknown
    }

    /// Lets go of the blocks `hashes` name while they are the ones before
    /// `off` in `run`, going down, and the last of what `holder`'s holding
    /// `i` holds of it ends right before `off` (the holder just let go of
    /// `off`); returns how many. The span's first block, and whatever
    /// does not follow, is left to the block-by-block rules (the holding
    /// may go with it). Only while no store is repeated (those removals
    /// count down first).
    fn shrink(&mut self, heads: &Heads, run: u32, i: usize, off: u32, hashes: &[u64]) -> u32 {
        let r = &mut self.runs[run as usize];
        let Some(span) = r.holdings[i].spans.last() else {
            return 0;
        };
        let (start, mut end) = (span.start, span.end);
        if end != off {
            return 0;
        }
        let Some((words, engines)) = hashes_and_names(&r.words, &r.names, self.token_keys) else {
            return 0;
        };
        for &h in hashes {
            if end <= start + 1 {
                break;
            }
            let o = end - 1;
            let named = match engines {
                None => o < r.len && words.hash(o as usize) == h,
                Some(n) => n.get(o as usize) == Some(&h),
            };
            if !named {
                break;
            }
            r.holders_of[o as usize] -= 1;
            end = o;
        }
        if end == off {
            return 0;
        }
        r.holdings[i].spans.last_mut().expect("a span").end = end;
        let dead_tail = r.holders_of.last() == Some(&0);
        self.touch(run);
        if dead_tail {
            self.cut_dead_tail(heads, run);
        }
        off - end
    }

    /// `holder`'s pod let go of `n` entries on `holder`'s tier.
    fn count_released(&mut self, holder: u32, n: u64) {
        if let Some(pod) = self.pods.get_mut(&(holder >> TIER_BITS)) {
            pod.entries[usize::from(tier_of(holder))] -= n;
        }
    }

    /// Drops `pod`'s hold on `loc`; false if it had none. `holding`: where
    /// the pod's holding of a run was last found, kept up to date.
    fn release(
        &mut self,
        heads: &Heads,
        pod: u32,
        loc: Loc,
        holding: &mut Option<(u32, usize)>,
    ) -> bool {
        let run = &mut self.runs[loc.run as usize];
        let i = match *holding {
            Some((r, i)) if r == loc.run => i,
            _ => match run.holding_of(pod) {
                Some(i) => i,
                None => return false,
            },
        };
        *holding = Some((loc.run, i));
        if !run.holdings[i].remove(loc.off) {
            return false;
        }
        if run.holdings[i].spans.is_empty() {
            run.holdings.remove(i);
            *holding = None;
            if let Some(pod) = self.pods.get_mut(&(pod >> TIER_BITS)) {
                pod.holdings -= 1;
            }
        }
        let run = &mut self.runs[loc.run as usize];
        run.holders_of[loc.off as usize] -= 1;
        let tail = loc.off + 1 == run.len();
        self.touch(loc.run);
        if tail {
            self.cut_dead_tail(heads, loc.run);
        }
        true
    }

    /// Forgets the blocks nobody holds at the end of `run`, and the run
    /// once it is empty.
    fn cut_dead_tail(&mut self, heads: &Heads, run: u32) {
        let r = &mut self.runs[run as usize];
        while r.holders_of.last() == Some(&0) {
            r.holders_of.pop();
            let k = r.pop_hash();
            let (len, table) = (r.len, &mut self.table);
            match r.names.as_deref_mut() {
                None => table.remove(k),
                Some(names) => {
                    table.remove(names.engines.pop().expect("parallel to holders_of"));
                    while let Some(&(_, alias)) =
                        names.aliases.last().filter(|(off, _)| *off >= len)
                    {
                        names.aliases.pop();
                        table.remove(alias);
                    }
                }
            }
            if r.is_empty() {
                heads.remove(k);
            }
        }
        if r.is_empty() {
            debug_assert!(r.holdings.is_empty());
            // Its words stay (readers may hold them; a new run here reuses
            // them); it is listed, so its emptiness is published.
            r.holdings = Vec::new();
            r.holders_of = Vec::new();
            r.names = None;
            r.parent = None;
            self.free.push(run);
        }
    }

    /// Drops everything `pod` holds, on every tier.
    pub fn clear(&mut self, heads: &Heads, pod: u32) {
        let which = |holder: u32| holder >> TIER_BITS == pod;
        if !self.repeats.is_empty() {
            self.repeats.retain(|(holder, _), _| !which(*holder));
        }
        let Some(queued) = self.pods.remove(&pod) else {
            return;
        };
        // Let go of (and maybe reused since): skipped.
        for id in queued.runs() {
            let r = &mut self.runs[id as usize];
            if !r.held_by(pod) {
                continue;
            }
            for h in r.holdings.iter().filter(|h| which(h.holder)) {
                for s in &h.spans {
                    for off in s.start..s.end {
                        r.holders_of[off as usize] -= 1;
                    }
                }
            }
            r.holdings.retain(|h| !which(h.holder));
            self.touch(id);
            self.cut_dead_tail(heads, id);
        }
    }

    /// Gives `holder` `spans` of `run` (it had none), stored at `stamp`;
    /// `holders_of` must count them (the caller's part).
    pub(super) fn adopt(&mut self, run: u32, holder: u32, stamp: u32, spans: SmallVec<[Span; 1]>) {
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
    pub(super) fn sort_queues(&mut self) {
        for pod in self.pods.values_mut() {
            pod.sort();
        }
    }

    /// Repeated stores, by (holder, name).
    pub(super) fn repeats(&self) -> impl Iterator<Item = ((u32, u64), u32)> + '_ {
        self.repeats.iter().map(|(k, v)| (*k, *v))
    }

    /// Counts `count` repeated stores of `name` by `holder`; false if some
    /// were counted already.
    pub(super) fn add_repeats(&mut self, holder: u32, name: u64, count: u32) -> bool {
        match self.repeats.entry((holder, name)) {
            Entry::Occupied(_) => false,
            Entry::Vacant(v) => {
                v.insert(count);
                true
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

    /// Before the clock would wrap (after 2^32 holdings stamped): the
    /// stamps renumbered from 1, in the same order.
    fn renumber(&mut self) {
        let mut stamps: Vec<u32> = self
            .runs
            .iter()
            .flat_map(|r| r.holdings.iter().map(|h| h.stamp))
            .collect();
        stamps.sort_unstable();
        stamps.dedup();
        let new = |stamp: u32| stamps.binary_search(&stamp).expect("collected") as u32 + 1;
        // Stale entries' stamps are no holding's: dropped first.
        let runs = &self.runs;
        for pod in self.pods.values_mut() {
            pod.retain(|t| is_live(runs, t));
            pod.restamp(new);
        }
        for h in self.runs.iter_mut().flat_map(|r| r.holdings.iter_mut()) {
            h.stamp = new(h.stamp);
        }
        self.clock = stamps.len() as u32;
    }

    /// Drops up to `n` of `pod`'s entries, on any tier: the holdings it
    /// stored into least recently first, each from its end (leaf first, as
    /// vLLM evicts: what is left of the holding is still a prefix of what
    /// it was, so answers only shorten). Pushes each (holder, key) dropped
    /// onto `out`; returns how many.
    pub fn evict(&mut self, heads: &Heads, pod: u32, n: usize, out: &mut Vec<(u32, u64)>) -> usize {
        let mut dropped = 0;
        while dropped < n {
            let Some(t) = self.pods.get(&pod).and_then(PodRuns::oldest) else {
                break;
            };
            if !is_live(&self.runs, &t) {
                self.pods.get_mut(&pod).expect("found").pop_oldest();
                continue;
            }
            // From its end, until it is gone (its entry is stale then) or
            // enough went.
            let (run, holder) = (t.run, t.holder);
            while dropped < n {
                let r = &self.runs[run as usize];
                let Some(i) = r.holding_of(holder) else {
                    break;
                };
                let off = r.holdings[i]
                    .spans
                    .last()
                    .expect("a holding has a span")
                    .end
                    - 1;
                let key = r.hash(off).expect("held blocks are in the run");
                if !self.repeats.is_empty() {
                    for name in self.names_at(Loc { run, off }) {
                        self.repeats.remove(&(holder, name));
                    }
                }
                let mut at = Some((run, i));
                let released = self.release(heads, holder, Loc { run, off }, &mut at);
                debug_assert!(released);
                out.push((holder, key));
                dropped += 1;
                self.count_released(holder, 1);
            }
        }
        dropped
    }

    /// Every engine hash that names the block at `loc`.
    fn names_at(&self, loc: Loc) -> SmallVec<[u64; 2]> {
        let r = &self.runs[loc.run as usize];
        match r.names.as_deref() {
            None => r.hash(loc.off).into_iter().collect(),
            Some(names) => std::iter::once(names.engines[loc.off as usize])
                .chain(
                    names
                        .aliases
                        .iter()
                        .filter(|(off, _)| *off == loc.off)
                        .map(|(_, e)| *e),
                )
                .collect(),
        }
    }
}

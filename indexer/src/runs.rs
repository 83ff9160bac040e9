//! Runs of a chain as the unit of the index: the layout the index redesign
//! of issue #17 is measured with, before it replaces `index` and `pod`.
//!
//! Why: the index today keeps an entry per (pod, block) twice over (the
//! pod's map from engine hash, the shared table's holder lists), so every
//! applied block costs two random cache misses, and a lookup probes per
//! block. Both peers do at least one per block too, which is why the
//! comparison bench's floor (one hash-map operation per block) caps them.
//! Here the unit is a *run*: a stretch of one chain's distinct blocks, side
//! by side, shared by every pod that holds any of them. Per distinct block
//! the index keeps one table slot, its hash in the run and a holder count;
//! per (pod, run) the spans of the run the pod holds, usually one. So:
//! - a pod storing blocks others hold already walks the run (the next
//!   block is compared with the run's next hash, no probe) and widens its
//!   span: work per run, not per block;
//! - a removal finds its block by the same table (vLLM names removals by
//!   hash), and the next one, evicted leaf first, is the run's previous
//!   block: compared, not probed;
//! - a lookup probes once per run and finds where it leaves the run by
//!   binary search (keys are chained: two chains that differ at a block
//!   differ at every block after it), then reads each holder's span;
//! - memory per (pod, block) is a share of what the block costs once, plus
//!   a span per (pod, run).
//!
//! What it does not do yet (the index keeps doing it until this layout
//! carries it): tiers, repeated stores of a hash counted, keys that differ
//! from engine hashes, eviction by age, snapshots, concurrent readers
//! without a lock. Holdings here are sets: a second store of a held block
//! changes nothing, one removal drops it.

use std::hash::BuildHasher;

use hashbrown::hash_table::HashTable;
use smallvec::SmallVec;

use crate::index::KeyBuildHasher;

/// A block's place: its run and its offset in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loc {
    run: u32,
    off: u32,
}

/// One distinct block in the table: its hash, kept beside its place so a
/// probe reads one slot, not the run too.
#[derive(Clone, Copy, Debug)]
struct Slot {
    hash: u64,
    loc: Loc,
}

/// A half-open range of a run's offsets a pod holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    start: u32,
    end: u32,
}

/// What one pod holds of one run: disjoint spans, sorted, none touching
/// (touching spans are merged). A pod whose cache is prefix-closed, as
/// vLLM's leaf-first eviction keeps it, has one.
#[derive(Clone, Debug)]
struct Holding {
    pod: u32,
    spans: SmallVec<[Span; 1]>,
}

impl Holding {
    /// Where the span holding `off` ends, if one does.
    fn end_from(&self, off: u32) -> Option<u32> {
        let i = self.spans.partition_point(|s| s.end <= off);
        self.spans.get(i).filter(|s| s.start <= off).map(|s| s.end)
    }

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

/// A stretch of one chain: `hashes[k + 1]` was stored under `hashes[k]`.
#[derive(Default)]
struct Run {
    hashes: Vec<u64>,
    /// Pods holding each block. A block nobody holds stays only while a
    /// held block comes after it in the run (a dead tail is cut at once).
    holders_of: Vec<u32>,
    /// Sorted by pod.
    holdings: Vec<Holding>,
}

impl Run {
    fn len(&self) -> u32 {
        self.hashes.len() as u32
    }

    /// The index of `pod`'s holding, added (empty) if it has none.
    fn holding(&mut self, pod: u32) -> usize {
        match self.holdings.binary_search_by_key(&pod, |h| h.pod) {
            Ok(i) => i,
            Err(i) => {
                self.holdings.insert(
                    i,
                    Holding {
                        pod,
                        spans: SmallVec::new(),
                    },
                );
                i
            }
        }
    }
}

#[inline]
fn hash(h: u64) -> u64 {
    KeyBuildHasher::default().hash_one(h)
}

/// Pods' blocks by chain runs. One writer (`&mut self`); see the module
/// doc for what it covers.
#[derive(Default)]
pub struct RunIndex {
    table: HashTable<Slot>,
    runs: Vec<Run>,
    /// Run ids whose run died, reused first.
    free: Vec<u32>,
}

impl RunIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Distinct blocks indexed (held, or dead but followed by a held one).
    pub fn blocks(&self) -> usize {
        self.table.len()
    }

    fn locate(&self, h: u64) -> Option<Loc> {
        self.table.find(hash(h), |s| s.hash == h).map(|s| s.loc)
    }

    /// `h` at `loc`, if `loc` is in its run.
    fn is_at(&self, h: u64, loc: Loc) -> bool {
        self.runs[loc.run as usize].hashes.get(loc.off as usize) == Some(&h)
    }

    fn new_run(&mut self) -> u32 {
        match self.free.pop() {
            Some(id) => id,
            None => {
                self.runs.push(Run::default());
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Puts a new block `h` at the end of `run`.
    fn push(&mut self, run: u32, h: u64) -> Loc {
        let r = &mut self.runs[run as usize];
        let loc = Loc { run, off: r.len() };
        r.hashes.push(h);
        r.holders_of.push(0);
        let runs = &self.runs;
        self.table
            .insert_unique(hash(h), Slot { hash: h, loc }, |s| {
                debug_assert!(runs[s.loc.run as usize].hashes[s.loc.off as usize] == s.hash);
                hash(s.hash)
            });
        loc
    }

    /// `pod` stored `hashes`, a chain under `parent` (the block before the
    /// first, if it has one).
    pub fn store(&mut self, pod: u32, parent: Option<u64>, hashes: &[u64]) {
        let mut at = parent.and_then(|p| self.locate(p));
        // (run, index of the pod's holding in it).
        let mut holding: Option<(u32, usize)> = None;
        for &h in hashes {
            let next = at.map(|l| Loc {
                run: l.run,
                off: l.off + 1,
            });
            let loc = match next {
                Some(n) if self.is_at(h, n) => n,
                _ => match self.locate(h) {
                    Some(loc) => loc,
                    // A new block: it extends its parent's run if the
                    // parent ends it, or starts a run.
                    None => match next {
                        Some(n) if n.off == self.runs[n.run as usize].len() => self.push(n.run, h),
                        _ => {
                            let run = self.new_run();
                            self.push(run, h)
                        }
                    },
                },
            };
            let run = &mut self.runs[loc.run as usize];
            // Along a run, the pod's holding is the one the last block used.
            let i = match holding {
                Some((r, i)) if r == loc.run => i,
                _ => run.holding(pod),
            };
            holding = Some((loc.run, i));
            if run.holdings[i].insert(loc.off) {
                run.holders_of[loc.off as usize] += 1;
            }
            at = Some(loc);
        }
    }

    /// `pod` removed `hashes`; unknown ones (or ones it does not hold) are
    /// counted in the result, not applied.
    pub fn remove(&mut self, pod: u32, hashes: &[u64]) -> usize {
        let mut unknown = 0;
        let mut last: Option<Loc> = None;
        // (run, index of the pod's holding in it), as in `store`.
        let mut holding: Option<(u32, usize)> = None;
        for &h in hashes {
            // Leaf-first eviction names a chain tail first: the block
            // before the last one is the likeliest.
            let near = last.and_then(|l| {
                [l.off.checked_sub(1), l.off.checked_add(1)]
                    .into_iter()
                    .flatten()
                    .map(|off| Loc { run: l.run, off })
                    .find(|n| self.is_at(h, *n))
            });
            let Some(loc) = near.or_else(|| self.locate(h)) else {
                unknown += 1;
                continue;
            };
            if !self.release(pod, loc, &mut holding) {
                unknown += 1;
            }
            last = Some(loc);
        }
        unknown
    }

    /// Drops `pod`'s hold on `loc`; false if it had none. `holding`: where
    /// the pod's holding of a run was last found, kept up to date.
    fn release(&mut self, pod: u32, loc: Loc, holding: &mut Option<(u32, usize)>) -> bool {
        let run = &mut self.runs[loc.run as usize];
        let i = match *holding {
            Some((r, i)) if r == loc.run => i,
            _ => match run.holdings.binary_search_by_key(&pod, |h| h.pod) {
                Ok(i) => i,
                Err(_) => return false,
            },
        };
        *holding = Some((loc.run, i));
        if !run.holdings[i].remove(loc.off) {
            return false;
        }
        if run.holdings[i].spans.is_empty() {
            run.holdings.remove(i);
            *holding = None;
        }
        run.holders_of[loc.off as usize] -= 1;
        if loc.off + 1 == run.len() {
            self.cut_dead_tail(loc.run);
        }
        true
    }

    /// Forgets the blocks nobody holds at the end of `run`, and the run
    /// once it is empty.
    fn cut_dead_tail(&mut self, run: u32) {
        let r = &mut self.runs[run as usize];
        while r.holders_of.last() == Some(&0) {
            r.holders_of.pop();
            let h = r.hashes.pop().expect("parallel to holders_of");
            match self.table.find_entry(hash(h), |s| s.hash == h) {
                Ok(e) => {
                    e.remove();
                }
                Err(_) => unreachable!("every run block is in the table"),
            }
        }
        if r.hashes.is_empty() {
            debug_assert!(r.holdings.is_empty());
            *r = Run::default();
            self.free.push(run);
        }
    }

    /// Drops everything `pod` holds (its cache was cleared).
    pub fn clear(&mut self, pod: u32) {
        for id in 0..self.runs.len() as u32 {
            let r = &mut self.runs[id as usize];
            let Ok(i) = r.holdings.binary_search_by_key(&pod, |h| h.pod) else {
                continue;
            };
            let holding = r.holdings.remove(i);
            for s in holding.spans {
                for off in s.start..s.end {
                    r.holders_of[off as usize] -= 1;
                }
            }
            self.cut_dead_tail(id);
        }
    }

    /// For every pod holding `keys[0]`, how many leading keys it holds
    /// (pods holding none are left out), sorted by pod. `keys` must be
    /// chained, as block keys and engine hashes are: see the module doc.
    pub fn prefix_matches(&self, keys: &[u64]) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        // Pods that hold every key before `i`, sorted.
        let mut alive: Vec<u32> = Vec::new();
        let mut i = 0usize;
        while i < keys.len() {
            let Some(loc) = self.locate(keys[i]) else {
                break;
            };
            let run = &self.runs[loc.run as usize];
            let len = self.matched_in_run(run, loc.off, &keys[i..]);
            let (i0, through) = (i as u32, i + len as usize);
            let mut next = Vec::with_capacity(alive.len().max(run.holdings.len()));
            let held = |h: &Holding, next: &mut Vec<u32>, out: &mut Vec<(u32, u32)>| {
                let n = h.end_from(loc.off).map_or(0, |e| (e - loc.off).min(len));
                if n == len && through < keys.len() {
                    next.push(h.pod);
                } else if i0 + n > 0 {
                    out.push((h.pod, i0 + n));
                }
            };
            if i == 0 {
                for h in &run.holdings {
                    held(h, &mut next, &mut out);
                }
            } else {
                // Merge the pods still matching with the run's holders.
                let mut hs = run.holdings.iter().peekable();
                for &pod in &alive {
                    while hs.next_if(|h| h.pod < pod).is_some() {}
                    match hs.next_if(|h| h.pod == pod) {
                        Some(h) => held(h, &mut next, &mut out),
                        None => out.push((pod, i0)),
                    }
                }
            }
            alive = next;
            i = through;
            if alive.is_empty() {
                break;
            }
        }
        out.extend(alive.iter().map(|&pod| (pod, i as u32)));
        out.sort_unstable();
        out
    }

    /// How many of `keys` (whose first is at `off`) the run holds in order.
    /// Chained keys agree up to where two chains part and disagree after
    /// it, so the agreement is found by binary search, not compared key by
    /// key (an 8,192-block document is 13 reads, not 8,192).
    fn matched_in_run(&self, run: &Run, off: u32, keys: &[u64]) -> u32 {
        let room = (run.len() - off).min(keys.len() as u32) as usize;
        let rest = &run.hashes[off as usize..off as usize + room];
        // `keys[0]` is known to agree (its probe found it here): every
        // offset below `lo` agrees, none from `hi` on.
        let (mut lo, mut hi) = (1, room);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if rest[mid] == keys[mid] {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo as u32
    }
}

#[cfg(test)]
mod tests;

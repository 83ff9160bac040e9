//! Each pod's holdings in the order it stored into them: what eviction
//! takes first, what a clear reads (not every run), and how many entries
//! the pod has (what a capacity policy compares).
//!
//! A store stamps each holding it goes through (`Holding::stamp`, from one
//! clock, so stamps only grow) and appends it here: the queue is in stamp
//! order without sorting, and its front is the least recently stored
//! holding. A holding stored into again is appended again; the older entry
//! is stale (its stamp is not the holding's any more) and is skipped when
//! reached, and stale entries are dropped once the queue has doubled since
//! it was last compacted. So a store costs one push per run it goes
//! through, an eviction pops what it evicts (a sort of the pod's holdings
//! per eviction was what this replaced), and the queue stays within twice
//! the holdings it had at its last compaction (plus a few): after mass
//! removals, within twice the pod's peak until it next grows.

use std::collections::{HashMap, VecDeque};

use smallvec::SmallVec;

use super::{is_live, Heads, Loc, Writer};
use crate::event::TIERS;
use crate::keys::KeyBuildHasher;

/// A store into `holder`'s holding of `run`, stamped `stamp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Touch {
    pub stamp: u32,
    pub run: u32,
    pub holder: u32,
}

/// One pod's queue and count.
#[derive(Default)]
pub(super) struct PodRuns {
    queue: VecDeque<Touch>,
    /// The queue's length after its last compaction.
    compacted: usize,
    /// (Holder, block) entries the pod has, per tier.
    pub entries: [u64; TIERS],
    /// Holdings it has (runs it holds part of, per tier): what its runs'
    /// own bookkeeping costs scales with (see `RunIndex::usage`).
    pub holdings: u64,
}

/// Every pod's, by pod. A store or removal finds its pod here once per
/// call, and a batch's calls are one pod's: the last pod found is kept, so
/// most calls skip the hash map (its probe was a tenth of applying).
#[derive(Default)]
pub(super) struct Pods {
    slots: HashMap<u32, u32, KeyBuildHasher>,
    by_slot: Vec<PodRuns>,
    /// Slots of removed pods, reused first (they hold empty queues).
    free: Vec<u32>,
    /// The last pod found and its slot.
    last: Option<(u32, u32)>,
}

impl Pods {
    fn slot(&mut self, pod: u32) -> Option<u32> {
        match self.last {
            Some((p, slot)) if p == pod => Some(slot),
            _ => {
                let slot = *self.slots.get(&pod)?;
                self.last = Some((pod, slot));
                Some(slot)
            }
        }
    }

    /// `pod`'s, made (empty) if it has none.
    pub fn entry(&mut self, pod: u32) -> &mut PodRuns {
        let slot = match self.slot(pod) {
            Some(slot) => slot,
            None => {
                let slot = self.free.pop().unwrap_or_else(|| {
                    self.by_slot.push(PodRuns::default());
                    (self.by_slot.len() - 1) as u32
                });
                self.slots.insert(pod, slot);
                self.last = Some((pod, slot));
                slot
            }
        };
        &mut self.by_slot[slot as usize]
    }

    pub fn get(&self, pod: &u32) -> Option<&PodRuns> {
        let slot = match self.last {
            Some((p, slot)) if p == *pod => slot,
            _ => *self.slots.get(pod)?,
        };
        Some(&self.by_slot[slot as usize])
    }

    pub fn get_mut(&mut self, pod: &u32) -> Option<&mut PodRuns> {
        let slot = self.slot(*pod)?;
        Some(&mut self.by_slot[slot as usize])
    }

    /// Takes `pod`'s out.
    pub fn remove(&mut self, pod: &u32) -> Option<PodRuns> {
        let slot = self.slots.remove(pod)?;
        if self.last.is_some_and(|(p, _)| p == *pod) {
            self.last = None;
        }
        self.free.push(slot);
        Some(std::mem::take(&mut self.by_slot[slot as usize]))
    }

    /// Every pod's (and removed pods' empty ones).
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut PodRuns> {
        self.by_slot.iter_mut()
    }
}

/// Below this, a queue is not compacted.
const SLACK: usize = 16;

impl PodRuns {
    /// Appends `touch`, stamped after every entry queued. `live`: whether
    /// an entry is still its holding's stamp.
    pub fn push(&mut self, touch: Touch, live: impl Fn(&Touch) -> bool) {
        debug_assert!(self.queue.back().is_none_or(|b| b.stamp < touch.stamp));
        self.queue.push_back(touch);
        if self.queue.len() >= SLACK.max(2 * self.compacted) {
            self.retain(live);
        }
    }

    /// Appends `touch` whatever its stamp (`sort` must follow).
    pub fn push_unordered(&mut self, touch: Touch) {
        self.queue.push_back(touch);
        self.compacted = self.queue.len();
    }

    /// Keeps the entries `live` picks.
    pub fn retain(&mut self, live: impl Fn(&Touch) -> bool) {
        self.queue.retain(|t| live(t));
        self.compacted = self.queue.len();
    }

    /// The least recently stored entry (maybe stale).
    pub fn oldest(&self) -> Option<Touch> {
        self.queue.front().copied()
    }

    pub fn pop_oldest(&mut self) {
        self.queue.pop_front();
    }

    /// Every run the pod holds a part of (and some it held), once each.
    pub fn runs(&self) -> Vec<u32> {
        let mut runs: Vec<u32> = self.queue.iter().map(|t| t.run).collect();
        runs.sort_unstable();
        runs.dedup();
        runs
    }

    /// Entries added out of order (a restore): sorted by stamp.
    pub fn sort(&mut self) {
        self.queue
            .make_contiguous()
            .sort_unstable_by_key(|t| t.stamp);
    }

    /// Gives every entry the stamp `new` maps its stamp to (the order
    /// kept).
    pub fn restamp(&mut self, new: impl Fn(u32) -> u32) {
        for t in &mut self.queue {
            t.stamp = new(t.stamp);
        }
    }

    #[cfg(test)]
    pub fn contains(&self, touch: &Touch) -> bool {
        self.queue.contains(touch)
    }
}

impl Writer {
    /// Before the clock would wrap (after 2^32 holdings stamped): the
    /// stamps renumbered from 1, in the same order.
    pub(super) fn renumber(&mut self) {
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

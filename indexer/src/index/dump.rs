//! A `RunIndex` as data: every run with its keys, names and holdings, for
//! a snapshot on disk, and back.
//!
//! Why runs and not each pod's blocks: a run holds each distinct block's
//! key once and each pod's part of it as spans, so a dump is about the
//! size of the index (distinct blocks), not of its (pod, block) entries,
//! which repeat a shared prefix's keys once per pod holding it. And it
//! restores as it was: the same runs, the same store order (eviction
//! continues where it stopped), the same names for every pod (with token
//! keys a pod whose hash seed differs names a block by an alias; a
//! per-pod list of blocks would have to say whose each alias is, which the
//! index does not keep).
//!
//! A dump comes from a file: `RunIndex::restore` checks everything the
//! index's own invariants need and refuses the whole dump otherwise.

use serde::{Deserialize, Serialize};

use super::published::{tier_of, Arena, Heads, MAX_RUN, TIER_BITS};
use super::write::{Holding, Loc, Run, Span, Writer};
use crate::event::TIERS;

/// The whole index.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    /// Keys are computed from tokens (see `RunIndex::with_token_keys`).
    pub token_keys: bool,
    /// The store clock (holdings' stamps are below or at it).
    pub clock: u32,
    pub runs: Vec<RunRecord>,
    /// Stores of a held block beyond the first, not removed yet.
    pub repeats: Vec<RepeatRecord>,
}

/// One run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Its blocks' keys, in chain order.
    pub keys: Vec<u64>,
    /// Token keys: each block's engine hash (parallel to `keys`); empty
    /// with engine keys, where the key is the engine hash.
    pub engines: Vec<u64>,
    /// Token keys: other engine hashes naming a block, (offset, hash).
    pub aliases: Vec<(u32, u64)>,
    /// Sorted by (pod, tier).
    pub holdings: Vec<HoldingRecord>,
    /// The block its first block was stored under: (index of its run in
    /// `Dump::runs`, offset), if the index had it.
    #[serde(default)]
    pub parent: Option<(u32, u32)>,
}

/// What one pod holds of a run on one tier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HoldingRecord {
    pub pod: u32,
    pub tier: u8,
    /// When the pod last stored into it (the store clock).
    pub stamp: u32,
    /// Half-open offset ranges, sorted, apart.
    pub spans: Vec<(u32, u32)>,
}

/// `count` stores of the block `name` names by `pod` on `tier`, beyond
/// the first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RepeatRecord {
    pub pod: u32,
    pub tier: u8,
    pub name: u64,
    pub count: u32,
}

impl Dump {
    /// The pods holding anything in it, sorted.
    pub fn pods(&self) -> Vec<u32> {
        let mut pods: Vec<u32> = self
            .runs
            .iter()
            .flat_map(|r| r.holdings.iter().map(|h| h.pod))
            .chain(self.repeats.iter().map(|r| r.pod))
            .collect();
        pods.sort_unstable();
        pods.dedup();
        pods
    }

    /// Renames every pod by `to` (which must give distinct pods distinct
    /// ids): a restarted service gives pods new ids.
    pub fn rename_pods(&mut self, to: impl Fn(u32) -> u32) {
        for r in &mut self.runs {
            for h in &mut r.holdings {
                h.pod = to(h.pod);
            }
            r.holdings.sort_by_key(|h| (h.pod, h.tier));
        }
        for r in &mut self.repeats {
            r.pod = to(r.pod);
        }
    }
}

/// Why a dump was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DumpError {
    #[error("the dump was written with {0} keys, the index uses the other")]
    KeyMode(&'static str),
    #[error("run {run}: {why}")]
    Run { run: usize, why: &'static str },
    #[error("repeat {0}: it names no block its holder holds")]
    Repeat(usize),
    #[error("two holdings with the same store stamp")]
    Stamps,
}

fn holder_of(pod: u32, tier: u8) -> Option<u32> {
    (usize::from(tier) < TIERS && pod < u32::MAX >> TIER_BITS)
        .then(|| pod << TIER_BITS | u32::from(tier))
}

impl Writer {
    pub fn dump(&self) -> Dump {
        let at = self.dump_positions();
        Dump {
            token_keys: self.token_keys,
            clock: self.clock,
            runs: self
                .live_runs()
                .map(|id| self.run_record(id, &at))
                .collect(),
            repeats: self.repeat_records(),
        }
    }

    /// The ids of the runs a dump lists, in its order.
    fn live_runs(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.runs.len() as u32).filter(|&id| !self.runs[id as usize].is_empty())
    }

    /// Where each run lands in a dump (`u32::MAX`: nowhere, it is empty).
    fn dump_positions(&self) -> Vec<u32> {
        let mut at = vec![u32::MAX; self.runs.len()];
        for (i, id) in self.live_runs().enumerate() {
            at[id as usize] = i as u32;
        }
        at
    }

    /// Where `r`'s parent is in a dump (`at`: `dump_positions`), if it
    /// still is a block.
    fn dump_parent(&self, r: &Run, at: &[u32]) -> Option<(u32, u32)> {
        r.parent.and_then(|p| {
            let live = self.runs[p.run as usize].len() > p.off;
            live.then(|| (at[p.run as usize], p.off))
        })
    }

    /// Run `id` as a dump lists it (`at`: `dump_positions`); `RunView`
    /// serializes the same without the copy.
    fn run_record(&self, id: u32, at: &[u32]) -> RunRecord {
        let r = &self.runs[id as usize];
        let (engines, aliases) = run_names(r);
        RunRecord {
            keys: run_keys(r).collect(),
            engines: engines.to_vec(),
            aliases: aliases.to_vec(),
            holdings: r
                .holdings
                .iter()
                .map(|h| {
                    let (pod, tier) = pod_tier(h.holder);
                    HoldingRecord {
                        pod,
                        tier,
                        stamp: h.stamp,
                        spans: spans(h).collect(),
                    }
                })
                .collect(),
            parent: self.dump_parent(r, at),
        }
    }

    fn repeat_records(&self) -> Vec<RepeatRecord> {
        let mut repeats: Vec<RepeatRecord> = self
            .repeats()
            .map(|((holder, name), count)| {
                let (pod, tier) = pod_tier(holder);
                RepeatRecord {
                    pod,
                    tier,
                    name,
                    count,
                }
            })
            .collect();
        // In a stable order: two dumps of the same index are equal.
        repeats.sort_unstable_by_key(|r| (r.pod, r.tier, r.name));
        repeats
    }
}

/// The index as a `Dump` serializes, byte for byte, read from the writer
/// run by run while its lock is held: a snapshot written from it holds one
/// run's record at a time, never a copy of the index (a copy of every run
/// is about the size of the index itself).
pub struct DumpView<'a>(pub(super) parking_lot::MutexGuard<'a, Writer>);

impl DumpView<'_> {
    /// Nothing to dump.
    pub fn is_empty(&self) -> bool {
        self.0.live_runs().next().is_none()
    }
}

impl Serialize for DumpView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        // `Dump`'s fields, in its order.
        let w = &*self.0;
        let mut dump = s.serialize_struct("Dump", 4)?;
        dump.serialize_field("token_keys", &w.token_keys)?;
        dump.serialize_field("clock", &w.clock)?;
        dump.serialize_field("runs", &RunsView(w))?;
        dump.serialize_field("repeats", &w.repeat_records())?;
        dump.end()
    }
}

struct RunsView<'a>(&'a Writer);

impl Serialize for RunsView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let w = self.0;
        let at = w.dump_positions();
        let live = at.iter().filter(|&&i| i != u32::MAX).count();
        let mut runs = s.serialize_seq(Some(live))?;
        for id in w.live_runs() {
            runs.serialize_element(&RunView { w, id, at: &at })?;
        }
        runs.end()
    }
}

/// A run as its `RunRecord` serializes, read in place: no copy of its
/// keys and names per run (what a snapshot's writing, which ingest waits
/// for, spent most of its allocations on).
struct RunView<'a> {
    w: &'a Writer,
    id: u32,
    at: &'a [u32],
}

impl Serialize for RunView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let r = &self.w.runs[self.id as usize];
        let (engines, aliases) = run_names(r);
        // `RunRecord`'s fields, in its order.
        let mut run = s.serialize_struct("RunRecord", 5)?;
        run.serialize_field("keys", &Keys(r))?;
        run.serialize_field("engines", engines)?;
        run.serialize_field("aliases", aliases)?;
        run.serialize_field("holdings", &Holdings(r))?;
        run.serialize_field("parent", &self.w.dump_parent(r, self.at))?;
        run.end()
    }
}

struct Keys<'a>(&'a Run);

impl Serialize for Keys<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(run_keys(self.0))
    }
}

struct Holdings<'a>(&'a Run);

impl Serialize for Holdings<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.holdings.iter().map(HoldingView))
    }
}

/// A holding as its `HoldingRecord` serializes.
struct HoldingView<'a>(&'a Holding);

impl Serialize for HoldingView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let h = self.0;
        let (pod, tier) = pod_tier(h.holder);
        let mut record = s.serialize_struct("HoldingRecord", 4)?;
        record.serialize_field("pod", &pod)?;
        record.serialize_field("tier", &tier)?;
        record.serialize_field("stamp", &h.stamp)?;
        record.serialize_field("spans", &Spans(h))?;
        record.end()
    }
}

struct Spans<'a>(&'a Holding);

impl Serialize for Spans<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(spans(self.0))
    }
}

/// A run's keys, in chain order.
fn run_keys(r: &Run) -> impl ExactSizeIterator<Item = u64> + '_ {
    (0..r.len()).map(|off| r.hash(off).expect("within the run"))
}

/// A run's other names (token keys): each block's engine hash and the
/// aliases; none with engine keys.
fn run_names(r: &Run) -> (&[u64], &[(u32, u64)]) {
    r.names().map_or((&[], &[]), |n| (&n.engines, &n.aliases))
}

/// A holding's spans as a dump lists them.
fn spans(h: &Holding) -> impl ExactSizeIterator<Item = (u32, u32)> + '_ {
    h.spans.iter().map(|s| (s.start, s.end))
}

/// A holder's pod and tier.
fn pod_tier(holder: u32) -> (u32, u8) {
    (holder >> TIER_BITS, tier_of(holder))
}

/// A restore under way: a dump's runs arrive one at a time (`RunIndex::
/// restore_run`), so restoring from a file holds one run's record, not the
/// dump. What a rule needs of runs yet to come (each parent is a run of the
/// dump, no two holdings share a stamp) is checked at the end, from a few
/// numbers per run kept meanwhile.
pub struct Restore {
    clock: u32,
    /// Each holding's stamp.
    stamps: Vec<u32>,
    runs: Vec<Restored>,
}

/// A run restored: its length, its id now and its parent in the dump
/// (run, offset).
type Restored = (u32, u32, Option<(u32, u32)>);

impl Writer {
    /// Rebuilds an empty writer's runs from `dump`, checking it first as
    /// it goes; on an error the writer must be dropped (it holds part).
    pub fn restore(&mut self, heads: &Heads, arena: &Arena, dump: Dump) -> Result<(), DumpError> {
        let mut restore = self.restore_begin(dump.token_keys, dump.clock)?;
        for record in dump.runs {
            self.restore_run(heads, arena, &mut restore, record)?;
        }
        self.restore_end(arena, restore, dump.repeats)
    }

    /// Starts restoring a dump of `token_keys` keys whose clock was
    /// `clock` into this empty writer.
    pub fn restore_begin(&self, token_keys: bool, clock: u32) -> Result<Restore, DumpError> {
        debug_assert!(self.runs.is_empty(), "restored into an empty index");
        if token_keys != self.token_keys {
            return Err(DumpError::KeyMode(if token_keys {
                "token"
            } else {
                "engine"
            }));
        }
        Ok(Restore {
            clock,
            stamps: Vec::new(),
            runs: Vec::new(),
        })
    }

    /// The dump's next run, checked as it is restored.
    pub fn restore_run(
        &mut self,
        heads: &Heads,
        arena: &Arena,
        restore: &mut Restore,
        record: RunRecord,
    ) -> Result<(), DumpError> {
        let i = restore.runs.len();
        let why = |why| DumpError::Run { run: i, why };
        let len = record.keys.len();
        if len == 0 || len > MAX_RUN as usize {
            return Err(why("no blocks, or more than a run holds"));
        }
        let engines = if self.token_keys {
            if record.engines.len() != len {
                return Err(why("not an engine hash per block"));
            }
            &record.engines
        } else {
            if !record.engines.is_empty() || !record.aliases.is_empty() {
                return Err(why("engine keys have no other names"));
            }
            &record.keys
        };
        // Every name new, every key new where readers look it up (the runs
        // restored before this one are in the table already).
        let mut names = engines.clone();
        names.extend(record.aliases.iter().map(|(_, e)| *e));
        names.sort_unstable();
        let distinct = names.windows(2).all(|w| w[0] != w[1]);
        if !distinct
            || names.iter().any(|e| self.table.find(*e).is_some())
            || self.find_head(record.keys[0]).is_some()
        {
            return Err(why("a block named twice"));
        }
        if record.aliases.iter().any(|(off, _)| *off as usize >= len) {
            return Err(why("an alias past the run"));
        }
        // Holders counted by their spans' edges, then summed: a span
        // costs two steps however long it is.
        let mut edges = vec![0i64; len + 1];
        let mut last = None;
        for h in &record.holdings {
            let holder = holder_of(h.pod, h.tier).ok_or_else(|| why("no such holder"))?;
            if last.is_some_and(|l| l >= holder) || h.spans.is_empty() {
                return Err(why("holdings out of order, or empty"));
            }
            last = Some(holder);
            let mut end = None;
            for &(s, e) in &h.spans {
                if s >= e || e as usize > len || end.is_some_and(|end| end >= s) {
                    return Err(why("spans out of order, touching or past the run"));
                }
                end = Some(e);
                edges[s as usize] += 1;
                edges[e as usize] -= 1;
            }
        }
        // A pod's spans in a run, over its tiers, are counted in 24 bits
        // where readers read them (`published`).
        let mut per_pod: Vec<(u32, usize)> = Vec::new();
        for h in &record.holdings {
            match per_pod.last_mut() {
                Some((pod, n)) if *pod == h.pod => *n += h.spans.len(),
                _ => per_pod.push((h.pod, h.spans.len())),
            }
        }
        if per_pod.iter().any(|(_, n)| *n >= MAX_RUN as usize) {
            return Err(why("a pod with more spans than a run can say"));
        }
        let mut holders_of = Vec::with_capacity(len);
        let mut held = 0i64;
        for edge in &edges[..len] {
            held += edge;
            holders_of.push(held as u32);
        }
        if holders_of.last() == Some(&0) {
            return Err(why("its last block is held by no one"));
        }
        let run = self.new_run();
        restore.runs.push((len as u32, run, record.parent));
        for (off, (&k, &e)) in record.keys.iter().zip(engines).enumerate() {
            let loc = self.push(heads, arena, run, e, k);
            debug_assert_eq!(loc.off, off as u32);
        }
        for (off, e) in record.aliases {
            self.alias(e, Loc { run, off });
        }
        for h in record.holdings {
            restore.stamps.push(h.stamp);
            let holder = holder_of(h.pod, h.tier).expect("checked");
            let spans = h
                .spans
                .iter()
                .map(|&(start, end)| Span { start, end })
                .collect();
            self.adopt(run, holder, h.stamp, spans);
        }
        self.runs[run as usize].holders_of = holders_of;
        Ok(())
    }

    /// Ends a restore: the runs' parents, the store order, the repeats
    /// (after every run: they name blocks anywhere), then readers see it.
    pub fn restore_end(
        &mut self,
        arena: &Arena,
        mut restore: Restore,
        repeats: Vec<RepeatRecord>,
    ) -> Result<(), DumpError> {
        // Every store stamps the holdings it goes through afresh, so no two
        // holdings share a stamp (eviction's order relies on it).
        restore.stamps.sort_unstable();
        if restore.stamps.windows(2).any(|w| w[0] == w[1]) {
            return Err(DumpError::Stamps);
        }
        let runs = &restore.runs;
        for (i, &(_, run, parent)) in runs.iter().enumerate() {
            let parent = match parent {
                None => None,
                Some((of, off)) => match runs.get(of as usize) {
                    Some(&(len, id, _)) if off < len => Some(Loc { run: id, off }),
                    _ => {
                        return Err(DumpError::Run {
                            run: i,
                            why: "a parent that is no block of the dump",
                        })
                    }
                },
            };
            self.runs[run as usize].parent = parent;
        }
        self.clock = restore
            .clock
            .max(restore.stamps.last().copied().unwrap_or(0));
        self.sort_queues();
        for (i, r) in repeats.into_iter().enumerate() {
            let holder = holder_of(r.pod, r.tier).ok_or(DumpError::Repeat(i))?;
            let held = self.table.find(r.name).is_some_and(|loc| {
                self.runs[loc.run as usize]
                    .holding_at(holder, loc.off)
                    .is_some()
            });
            // Repeats are stores not yet removed: a count near 2^32 is not
            // one an engine made.
            let plausible = r.count > 0 && r.count < 1 << 24;
            if !held || !plausible || !self.add_repeats(holder, r.name, r.count) {
                return Err(DumpError::Repeat(i));
            }
        }
        self.publish(arena);
        Ok(())
    }
}

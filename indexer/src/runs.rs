//! Runs of a chain as the unit of the index: the service's index (one per
//! model and key kind, fed by `pod_feed`, read by `run_score`).
//!
//! Why: the former index (`index` and `pod`, now the tests' reference)
//! kept an entry per (pod, block) twice over (the
//! pod's map from engine hash, the shared table's holder lists), so every
//! applied block costs two random cache misses, and a lookup probes per
//! block. Both peers do at least one per block too, which is why the
//! comparison bench's floor (one hash-map operation per block) caps them.
//! Here the unit is a *run*: a stretch of one chain's distinct blocks, side
//! by side, shared by every pod that holds any of them. Per distinct block
//! the index keeps one table slot, its key in the run and a holder count;
//! per (pod, tier, run) the spans of the run the pod holds, usually one.
//! So:
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
//! Readers take no lock and write nothing shared but `arc-swap`'s own
//! per-thread slots (see `shared`); writers take turns (one mutex), which
//! costs little: applying is a small part of ingesting (the service's
//! profile: messaging and wake-ups bound it, not the index).
//!
//! Keys are the engine hashes (`store`), or computed from the blocks'
//! tokens (`with_token_keys`, `store_tokens`), removals still naming
//! engine hashes: the writer's table is by engine hash, runs hold keys.
//!
//! A pod holds blocks per tier (a holder is a pod and a tier); a lookup
//! answers each pod's leading blocks on any tier and how many of those are
//! on each.
//!
//! A second store of a block its holder holds is counted (vLLM can store a
//! hash twice and remove it twice): the block stays until the last
//! removal.
//!
//! Beyond first-miss answers, `held_along` lists every stretch of a prompt
//! each pod holds, per tier, wherever it is: what Score's other rules read
//! (prefix closure, offloaded chunks, speculative entries).
//!
//! Bounded by eviction: the least recently stored holdings lose their
//! blocks first, leaf first (`evict`, with per-pod entry counts for a
//! capacity policy to compare; `pods`). Saved and restored as data, run by
//! run (`dump`). Answers count each block's best tier, what a score
//! weighs (`with_best_tiers`). Keys the caller computed (adapters, images)
//! are taken as given (`store_keyed`).
//!
//! A run costs about 400 bytes of its own whatever its length, so each
//! pod's holdings are counted (`usage`) for a capacity to charge: blocks
//! stored one by one are each a run. BENCHMARKS.md ("The index against
//! its peers") has its numbers against the peers.

mod dump;
mod pods;
mod shared;
mod writer;

pub use dump::{Dump, DumpError, HoldingRecord, RepeatRecord, RunRecord};

use parking_lot::Mutex;

use crate::event::{Tier, TIERS};
use shared::{tier_of, Arena, Counts, Heads, Held, View, TIER_BITS};
use writer::Writer;

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Pods' blocks by chain runs; see the module doc for what it covers.
pub struct RunIndex {
    heads: Heads,
    published: Arena,
    writer: Mutex<Writer>,
    /// Tier indices, best first (`RunMatch::best_tier`).
    better: [usize; TIERS],
}

impl Default for RunIndex {
    fn default() -> Self {
        RunIndex {
            heads: Heads::default(),
            published: Arena::default(),
            writer: Mutex::default(),
            better: std::array::from_fn(|t| t),
        }
    }
}

impl RunIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Ranks the tiers for `RunMatch::best_tier`: `better` names them all,
    /// best first (by default, in `Tier::ALL`'s order).
    pub fn with_best_tiers(mut self, better: [Tier; TIERS]) -> Self {
        let order = better.map(Tier::index);
        let mut seen = order;
        seen.sort_unstable();
        assert!(
            seen.iter().enumerate().all(|(i, t)| i == *t),
            "every tier once"
        );
        self.better = order;
        self
    }

    /// Distinct blocks indexed (held, or dead but followed by a held one).
    pub fn blocks(&self) -> usize {
        self.writer.lock().table.len()
    }

    /// An index whose keys are not the engine hashes: blocks are stored
    /// with `store_tokens` and keyed from their tokens, and removals still
    /// name engine hashes.
    pub fn with_token_keys() -> Self {
        let ix = Self::default();
        ix.writer.lock().token_keys = true;
        ix
    }

    /// For an index whose memory a capacity bounds by `evict`: each store
    /// then also restamps the pod's holdings up the prefix it was stored
    /// under, so that eviction never takes a block before the pod's blocks
    /// under it (a few more reads per store: 5-9% of applying, measured).
    /// Without it `evict` still works, and answers still only shorten, but
    /// a prefix a pod stored once may go before the branches it later
    /// stored under it.
    pub fn bounded(self) -> Self {
        self.writer.lock().bounded = true;
        self
    }

    /// `pod` stored `hashes` on `tier`, a chain under `parent` (the block
    /// before the first, if it has one); the engine hashes are the keys.
    pub fn store(&self, pod: u32, tier: Tier, parent: Option<u64>, hashes: &[u64]) {
        let mut w = self.writer.lock();
        debug_assert!(!w.token_keys, "store_tokens");
        let at = parent.and_then(|p| w.table.find(p));
        w.store(
            &self.heads,
            &self.published,
            holder(pod, tier),
            at,
            hashes.iter().map(|h| (*h, *h)),
        );
        w.publish(&self.published);
    }

    /// `pod` stored the blocks `engines` name on `tier`, a chain under
    /// `parent`, with `tokens` (`block_size` per block): each keyed from
    /// its parent's key (`root_seed` for a chain's first block), as a
    /// prompt's keys are (`keys::prompt_keys`). Returns how many blocks
    /// were not stored: all of them if the parent is unknown, the tokens
    /// do not fit or the index is not `with_token_keys`, or from a block
    /// whose engine hash names another block.
    #[allow(clippy::too_many_arguments)]
    pub fn store_tokens(
        &self,
        pod: u32,
        tier: Tier,
        parent: Option<u64>,
        engines: &[u64],
        tokens: &[u32],
        block_size: usize,
        root_seed: u64,
    ) -> usize {
        if block_size == 0 || tokens.len() != engines.len() * block_size {
            return engines.len();
        }
        let mut w = self.writer.lock();
        // An index of engine keys has no room for other names.
        if !w.token_keys {
            return engines.len();
        }
        let (at, mut prev) = match parent {
            None => (None, root_seed),
            Some(p) => match w.table.find(p).zip(w.key_of(p)) {
                Some(found) => (Some(found.0), found.1),
                None => return engines.len(),
            },
        };
        let blocks = engines
            .iter()
            .zip(tokens.chunks_exact(block_size))
            .map(|(e, t)| {
                prev = crate::keys::chain(prev, t).0;
                (*e, prev)
            });
        let skipped = w.store(&self.heads, &self.published, holder(pod, tier), at, blocks);
        w.publish(&self.published);
        skipped
    }

    /// `pod` stored on `tier` the blocks `blocks` names, (engine hash,
    /// key) each, keyed by the caller (token keys whose blocks carry more
    /// than tokens: an adapter, images), a chain under the block `parent`
    /// names. Returns how many blocks were not stored: all of them if the
    /// parent is unknown (the caller keyed them from a parent key the
    /// index does not have, and a block already in a run under another
    /// engine hash could not be found by its key: only runs' first blocks
    /// are) or the index is not `with_token_keys`, or from a block whose
    /// engine hash names another block on.
    pub fn store_keyed(
        &self,
        pod: u32,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[(u64, u64)],
    ) -> usize {
        let mut w = self.writer.lock();
        if !w.token_keys {
            return blocks.len();
        }
        let at = match parent.map(|p| w.table.find(p)) {
            None => None,
            Some(Some(at)) => Some(at),
            Some(None) => return blocks.len(),
        };
        let skipped = w.store(
            &self.heads,
            &self.published,
            holder(pod, tier),
            at,
            blocks.iter().copied(),
        );
        w.publish(&self.published);
        skipped
    }

    /// `pod` removed from `tier` the blocks its engine hashes `hashes`
    /// name; unknown ones (or ones it does not hold there) are counted in
    /// the result, not applied.
    pub fn remove(&self, pod: u32, tier: Tier, hashes: &[u64]) -> usize {
        let mut w = self.writer.lock();
        let unknown = w.remove(&self.heads, holder(pod, tier), hashes);
        w.publish(&self.published);
        unknown
    }

    /// Everything the index holds, as data (see `dump`). It is copied under
    /// the writer's lock: stores wait meanwhile, and the copy is about the
    /// size of the index.
    pub fn dump(&self) -> Dump {
        self.writer.lock().dump()
    }

    /// An index holding what `dump` does, with token keys or not (a dump
    /// of the other kind is refused). A dump that breaks any rule the
    /// index keeps (a block named twice, spans out of order, a dead last
    /// block...) is refused as a whole.
    pub fn from_dump(dump: Dump, token_keys: bool) -> Result<RunIndex, DumpError> {
        let ix = if token_keys {
            RunIndex::with_token_keys()
        } else {
            RunIndex::new()
        };
        ix.writer.lock().restore(&ix.heads, &ix.published, dump)?;
        Ok(ix)
    }

    /// Restores `dump` into this index, which must hold nothing yet (its
    /// best tiers and bound stay as built): `from_dump` in place.
    pub fn restore(&self, dump: Dump) -> Result<(), DumpError> {
        self.writer
            .lock()
            .restore(&self.heads, &self.published, dump)
    }

    /// Drops up to `n` of `pod`'s (tier, block) entries to bound memory:
    /// from the holdings it stored into least recently, each leaf first,
    /// so its answers only shorten (see `bounded`). Returns each entry
    /// dropped, as (tier, key).
    pub fn evict(&self, pod: u32, n: usize) -> Vec<(Tier, u64)> {
        let mut dropped = Vec::new();
        let mut w = self.writer.lock();
        w.evict(&self.heads, pod, n, &mut dropped);
        w.publish(&self.published);
        drop(w);
        dropped
            .into_iter()
            .map(|(holder, key)| (Tier::ALL[usize::from(tier_of(holder))], key))
            .collect()
    }

    /// The (tier, block) entries `pod` has: what `evict` can drop.
    pub fn entries(&self, pod: u32) -> u64 {
        self.writer.lock().entries(pod).iter().sum()
    }

    /// `pod`'s entries (all tiers) and holdings (runs it holds part of,
    /// per tier): a run's own bookkeeping (its record, words, table slots,
    /// about 400 bytes) is paid per run whatever its length, and every run
    /// has a holding, so the holdings bound it where entries cannot (blocks
    /// stored one by one, each its own run, as offloads without a parent
    /// are).
    pub fn usage(&self, pod: u32) -> (u64, u64) {
        let w = self.writer.lock();
        (w.entries(pod).iter().sum(), w.holdings(pod))
    }

    /// The blocks `pod` has on each tier (`Tier::index` order).
    pub fn held_per_tier(&self, pod: u32) -> [u64; TIERS] {
        self.writer.lock().entries(pod)
    }

    /// The key of the block engine hash `e` names, if `pod` holds it on
    /// some tier: what a store under it, or a tier-only store of it, is
    /// keyed from. Only blocks the pod holds: a hash no block of the pod
    /// goes by never keys its stores. (With token keys a block can go by
    /// several pods' hashes, and any of them finds it: see `pod_feed`.)
    pub fn key_held_by(&self, pod: u32, e: u64) -> Option<u64> {
        self.writer.lock().key_held_by(pod, e)
    }

    /// Token keys: the keys of the leading blocks of a store (under the
    /// block engine hash `parent` names, if any) that the index has under
    /// the same engine hashes (`engines`, in chain order), appended to
    /// `out` (none if the parent is unknown). What a store whose keys its
    /// engine hashes fix (see `pod_feed`) need not compute from its tokens
    /// again: most of a store is a prefix other pods stored.
    pub fn keys_along(&self, parent: Option<u64>, engines: &[u64], out: &mut Vec<u64>) {
        let w = self.writer.lock();
        if w.token_keys {
            w.keys_along(parent, engines, out);
        }
    }

    /// Drops everything `pod` holds, on every tier (its cache was cleared).
    pub fn clear(&self, pod: u32) {
        let mut w = self.writer.lock();
        w.clear(&self.heads, pod);
        w.publish(&self.published);
    }

    /// For every pod holding `keys[0]` (on any tier), how many leading
    /// keys it holds and how many of those on each tier (pods holding none
    /// are left out), in pod order. `keys` must be a chain from
    /// its first block, as a prompt's keys are: see `shared::Heads`.
    ///
    /// Each run is read as one consistent view, but the runs of one lookup
    /// at different instants: under writes, an answer is one the index
    /// could have given at some point during the lookup, per run.
    pub fn prefix_matches(&self, keys: &[u64]) -> Vec<RunMatch> {
        self.prefix_matches_as(keys, |m| m)
    }

    /// `prefix_matches`, each answer made into what the caller returns as
    /// it is found: no second list to allocate and copy into (at 128
    /// blocks and 128 pods that copy was 8% of a lookup's instructions).
    pub fn prefix_matches_as<T>(&self, keys: &[u64], make: impl Fn(RunMatch) -> T) -> Vec<T> {
        let mut out = Vec::new();
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => self.walk(keys, &mut scratch, &mut out, &make),
            Err(_) => self.walk(keys, &mut Scratch::default(), &mut out, &make),
        });
        out
    }

    /// Every stretch of `keys` each pod holds, per tier, wherever it is in
    /// the prompt: what a first-miss answer leaves out and Score's other
    /// rules read (prefix closure credits the deepest block held on GPU,
    /// offloaded chunks count by each chunk's last block, speculative
    /// entries stop at a block held exactly). Pods in order, each one's
    /// stretches by tier, then start; adjacent ones merged.
    ///
    /// Complete: a prompt key in any run is found, because a run holding
    /// it holds it from a run head that is itself a prompt key (keys are
    /// chained, so the run's blocks before it are the prompt's). The walk
    /// reads a run from each head it meets and probes the heads at every
    /// position no run covers: a prompt no pod holds costs a probe per
    /// block. Each run is read as one consistent view, as `prefix_matches`
    /// reads them; a run a writer kept changing ends the walk there.
    pub fn held_along(&self, keys: &[u64]) -> Vec<HeldAlong> {
        self.held_in_runs(keys, true)
    }

    /// `held_along` for keys that may be no chain (a list someone typed):
    /// each key is compared with the run's block at its place, not found
    /// by binary search, so a key is found only where the list reaches it
    /// from a run's first block, and no key is said held that is not.
    pub fn held_at_each(&self, keys: &[u64]) -> Vec<HeldAlong> {
        self.held_in_runs(keys, false)
    }

    fn held_in_runs(&self, keys: &[u64], chained: bool) -> Vec<HeldAlong> {
        let mut by_pod: std::collections::BTreeMap<u32, Vec<(Tier, u32, u32)>> =
            std::collections::BTreeMap::new();
        let mut i = 0usize;
        while i < keys.len() {
            let Some(run) = self.heads.find(keys[i]) else {
                i += 1;
                continue;
            };
            let rest = &keys[i..];
            let Some(published) = self.published.find(run) else {
                break;
            };
            let mut found: Vec<(u32, Tier, u32, u32)> = Vec::new();
            let read = published.read(|run| {
                found.clear();
                // Since the table named it, the run may have died and its
                // slot gone to another.
                if run.hash(0) != Some(rest[0]) {
                    return None;
                }
                let len = if chained {
                    matched_in_run(run, rest)
                } else {
                    (0..run.len().min(rest.len()))
                        .take_while(|off| run.hash(*off) == Some(rest[*off]))
                        .count()
                } as u32;
                for pod in run.pods() {
                    for (tier, start, end) in pod.spans() {
                        if start < len.min(end) {
                            found.push((pod.pod, Tier::ALL[tier], start, end.min(len)));
                        }
                    }
                }
                Some(len)
            });
            match read {
                Some(Some(len)) => {
                    for (pod, tier, start, end) in found {
                        let at = i as u32;
                        by_pod
                            .entry(pod)
                            .or_default()
                            .push((tier, at + start, at + end));
                    }
                    i += len as usize;
                }
                // Not the run the table named: the key starts none now.
                Some(None) => i += 1,
                None => break,
            }
        }
        by_pod
            .into_iter()
            .map(|(pod, mut spans)| {
                spans.sort_unstable_by_key(|&(tier, start, _)| (tier.index(), start));
                let mut merged: Vec<(Tier, u32, u32)> = Vec::with_capacity(spans.len());
                for (tier, start, end) in spans {
                    match merged.last_mut() {
                        Some((t, _, e)) if *t == tier && *e >= start => *e = (*e).max(end),
                        _ => merged.push((tier, start, end)),
                    }
                }
                HeldAlong { pod, spans: merged }
            })
            .collect()
    }

    fn walk<T>(
        &self,
        keys: &[u64],
        scratch: &mut Scratch,
        out: &mut Vec<T>,
        make: &impl Fn(RunMatch) -> T,
    ) {
        let Scratch {
            alive,
            next,
            mixed,
            ends,
        } = scratch;
        alive.clear();
        mixed.clear();
        ends.clear();
        let better = &self.better;
        let mut i = 0usize;
        while i < keys.len() {
            // The run this key starts (see `shared::Heads`).
            let Some(run) = self.heads.find(keys[i]) else {
                break;
            };
            let rest = &keys[i..];
            let mixed_before = mixed.len();
            // A run the table names is in an allocated segment; `None`
            // only from a torn read of the table.
            let Some(published) = self.published.find(run) else {
                break;
            };
            let read = published.read(|run| {
                // A read the version check turns down leaves nothing. (The
                // ends it wrote are written again: every pod it decided is
                // decided again, or answered from `alive` below.)
                next.clear();
                mixed.truncate(mixed_before);
                if i == 0 {
                    ends.clear();
                }
                // The run may have died, and its slot gone to another,
                // since the table named it.
                if run.hash(0) != Some(rest[0]) {
                    return None;
                }
                let len = matched_in_run(run, rest);
                let more = len < rest.len();
                // Each pod of the first run, or each still matching with
                // its holding of this run (if any), in pod order: it goes
                // on into the next run (`next`), or its match ends here.
                let mut pods = run.pods().peekable();
                let mut matching = alive.iter();
                loop {
                    let (m, spans) = if i == 0 {
                        let Some(p) = pods.next() else {
                            break;
                        };
                        // Its answer goes at its rank.
                        let rank = ends.len() as u32;
                        ends.push(Ended {
                            pod: p.pod,
                            blocks: 0,
                            tiers: Tiers::NONE,
                        });
                        let m = Matching {
                            pod: p.pod,
                            rank,
                            tiers: Tiers::NONE,
                        };
                        (m, Some(p))
                    } else {
                        let Some(&m) = matching.next() else {
                            break;
                        };
                        while pods.next_if(|p| p.pod < m.pod).is_some() {}
                        (m, pods.next_if(|p| p.pod == m.pod))
                    };
                    let (n, held) = spans.map_or((0, Held::Many(Counts::default())), |s| {
                        s.matched(len as u32, better)
                    });
                    // Where the pod's blocks so far and these are.
                    let tiers = match (m.tiers.get(), held) {
                        (_, _) if n == 0 => m.tiers,
                        (None, Held::One(t)) => Tiers::one(t),
                        (Some(Ok(a)), Held::One(t)) if a == t => m.tiers,
                        (before, held) => {
                            let mut counts = match before {
                                None => Counts::default(),
                                Some(Ok(a)) => Counts::one(a, i as u32),
                                Some(Err(at)) => mixed[at],
                            };
                            match held {
                                Held::One(t) => counts.add(&Counts::one(t, n)),
                                Held::Many(here) => counts.add(&here),
                            }
                            mixed.push(counts);
                            Tiers::mixed(mixed.len() - 1)
                        }
                    };
                    if n as usize == len && more {
                        next.push(Matching { tiers, ..m });
                    } else {
                        ends[m.rank as usize] = Ended {
                            pod: m.pod,
                            blocks: (i as u32).saturating_add(n),
                            tiers,
                        };
                    }
                }
                Some(len)
            });
            let Some(len) = read.flatten() else {
                if i == 0 {
                    // No first run read: no pod matched.
                    ends.clear();
                }
                break;
            };
            std::mem::swap(alive, next);
            i += len;
            if alive.is_empty() {
                break;
            }
        }
        for m in alive.iter() {
            ends[m.rank as usize] = Ended {
                pod: m.pod,
                blocks: i as u32,
                tiers: m.tiers,
            };
        }
        // In rank order, so in pod order: no sort for the callers.
        out.reserve(ends.len());
        out.extend(ends.iter().filter(|e| e.blocks > 0).map(|e| {
            let counts = match e.tiers.get() {
                None => Counts::default(),
                Some(Ok(t)) => Counts::one(t, e.blocks),
                Some(Err(at)) => mixed[at],
            };
            make(RunMatch {
                pod: e.pod,
                blocks: e.blocks,
                per_tier: counts.per_tier,
                best_tier: counts.best,
            })
        }));
    }
}

/// A pod still matching a lookup: its id, its rank among the first run's
/// holders (where its answer goes) and where its blocks so far are.
#[derive(Clone, Copy, Debug)]
struct Matching {
    pod: u32,
    rank: u32,
    tiers: Tiers,
}

/// A pod's answer, once its match ended: blocks 0 for none.
#[derive(Clone, Copy, Debug)]
struct Ended {
    pod: u32,
    blocks: u32,
    tiers: Tiers,
}

/// Where a pod still matching holds the blocks it matched so far: nowhere
/// yet, all on one tier (most pods), or as counted in `Scratch::mixed`.
/// Four bytes, as it is copied per pod per run a lookup crosses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tiers(u32);

impl Tiers {
    const NONE: Tiers = Tiers(u32::MAX);
    const MIXED: u32 = 1 << 31;

    fn one(tier: usize) -> Tiers {
        Tiers(tier as u32)
    }

    fn mixed(at: usize) -> Tiers {
        Tiers(Self::MIXED | at as u32)
    }

    /// (the one tier, or the index of the counts in `Scratch::mixed`).
    fn get(self) -> Option<Result<usize, usize>> {
        match self.0 {
            u32::MAX => None,
            t if t & Self::MIXED != 0 => Some(Err((t & !Self::MIXED) as usize)),
            t => Some(Ok(t as usize)),
        }
    }
}

/// A lookup's lists of pods still matching (and the tier counts of those
/// whose blocks are on several tiers), kept for the thread's next lookup
/// (a lookup of a prompt many pods share fills them).
#[derive(Default)]
struct Scratch {
    alive: Vec<Matching>,
    next: Vec<Matching>,
    mixed: Vec<Counts>,
    /// Every pod of the first run, in pod order, and its answer so far.
    ends: Vec<Ended>,
}

/// What a pod holds of a prompt: its leading blocks held on any tier, and
/// of those, how many on each tier and how many have each tier as the best
/// one holding them (see `RunIndex::with_best_tiers`; a score weighs each
/// block by its best tier).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RunMatch {
    pub pod: u32,
    pub blocks: u32,
    pub per_tier: [u32; TIERS],
    pub best_tier: [u32; TIERS],
}

/// Pod ids are below this: a holder is a pod and its tier in 32 bits.
pub const MAX_POD: u32 = u32::MAX >> TIER_BITS;

/// The stretches of a prompt one pod holds (see `RunIndex::held_along`):
/// (tier, start, end) in prompt positions, end excluded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldAlong {
    pub pod: u32,
    pub spans: Vec<(Tier, u32, u32)>,
}

/// A holder: one pod's blocks on one tier.
fn holder(pod: u32, tier: Tier) -> u32 {
    debug_assert!(pod < MAX_POD);
    pod << TIER_BITS | tier.index() as u32
}

/// How many of `keys` (whose first starts the run) the run holds in order.
/// Chained keys agree up to where two chains part and disagree after it,
/// so the agreement is found by binary search, not compared key by key (an
/// 8,192-block document is 13 reads, not 8,192).
fn matched_in_run(run: View<'_>, keys: &[u64]) -> usize {
    let room = run.len().min(keys.len());
    // `keys[0]` is known to agree (checked by the caller): every offset
    // below `lo` agrees, none from `hi` on.
    let (mut lo, mut hi) = (1, room);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if run.hash(mid) == Some(keys[mid]) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests;

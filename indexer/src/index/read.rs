//! Lookups: for a prompt's keys, what each pod holds of it, read from the
//! published runs with no lock (see `published`). A lookup probes the
//! table of run heads once per run it crosses and finds where the prompt
//! leaves a run by binary search (`matched_in_run`).

use super::*;

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
    /// Probes of the run heads' table made on this thread (`head_probes`).
    static PROBES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times lookups on this thread have probed a table of run heads,
/// ever: read before and after a lookup, the difference is what it cost in
/// table probes (one per run it crossed, plus, for `held_along` and
/// `held_at_each`, one per position no run covers or where the run the
/// table named had changed), however many blocks it matched. Per thread,
/// so counting takes no shared write.
pub fn head_probes() -> u64 {
    PROBES.with(std::cell::Cell::get)
}

fn count_probes(n: u64) {
    PROBES.with(|p| p.set(p.get() + n));
}

impl RunIndex {
    /// For every pod holding `keys[0]` (on any tier), how many leading
    /// keys it holds and how many of those on each tier (pods holding none
    /// are left out), in pod order. `keys` must be a chain from
    /// its first block, as a prompt's keys are: see `published::Heads`.
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
        let mut probes = 0;
        while i < keys.len() {
            probes += 1;
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
        count_probes(probes);
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
        let mut probes = 0;
        while i < keys.len() {
            // The run this key starts (see `published::Heads`).
            probes += 1;
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
        count_probes(probes);
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

//! Stores: a pod's chain of blocks into the runs, walking a run the chain
//! continues (the next block compared with the run's next key, no probe)
//! and starting or splitting runs where it leaves them; and the stamps
//! that keep each pod's holdings in store order for eviction.

use super::*;

impl Writer {
    /// Puts a new block (engine hash `e`, key `k`) at the end of `run`.
    /// A run's first block makes it findable: its published slot is
    /// allocated first (readers never allocate one, see `Arena::find`).
    pub(in crate::index) fn push(
        &mut self,
        heads: &Heads,
        arena: &Arena,
        run: u32,
        e: u64,
        k: u64,
    ) -> Loc {
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
            if let Some(grown) = heads.insert(k, run) {
                self.heads = Some(grown);
            }
        }
        loc
    }

    /// The run a key starts, if any (`Heads::find`, from the writer).
    pub(in crate::index) fn find_head(&self, k: u64) -> Option<u32> {
        self.heads.as_ref()?.find(k)
    }

    /// Makes the block at `loc` findable by `e` too, if it is not.
    pub(in crate::index) fn alias(&mut self, e: u64, loc: Loc) {
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
                    let n = if l.off + 1 == self.runs[run as usize].len() {
                        self.fresh(run, i, &mut blocks)
                    } else {
                        self.stretch(run, i, l.off + 1, &mut blocks)
                    };
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
                    // `published::Heads`).
                    None => match self.token_keys.then(|| self.find_head(k)).flatten() {
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

    /// Appends to `run`, whose last block `holder`'s holding `i` ends
    /// with, the leading blocks of `blocks` the index does not have: the
    /// rest of a new chain, most of a long store at SGLang's page size 1.
    /// What the block-by-block rules do for each (a table probe for its
    /// name and one for its key among run heads, then `push` and the
    /// holding extended), in one probe for the name and with the holding's
    /// span and the run's change noted once. Stops at a block the index
    /// has (or whose key starts a run) and at the run's cap; returns how
    /// many it appended.
    fn fresh(
        &mut self,
        run: u32,
        i: usize,
        blocks: &mut std::iter::Peekable<impl Iterator<Item = (u64, u64)>>,
    ) -> u32 {
        let r = &self.runs[run as usize];
        let start = r.len();
        match r.holdings[i].spans.last() {
            Some(last) if last.end == start => {}
            _ => return 0,
        }
        let mut end = start;
        while end < RUN_CAP {
            let Some(&(e, k)) = blocks.peek() else {
                break;
            };
            if self.token_keys && self.find_head(k).is_some() {
                break;
            }
            let loc = Loc { run, off: end };
            if !self.table.insert_new(e, loc) {
                break;
            }
            blocks.next();
            let r = &mut self.runs[run as usize];
            r.push_hash(k);
            push_growing(&mut r.holders_of, 1);
            if self.token_keys {
                push_growing(&mut r.names.get_or_insert_default().engines, e);
            }
            end += 1;
        }
        if end > start {
            let r = &mut self.runs[run as usize];
            r.holdings[i].spans.last_mut().expect("a span").end = end;
            self.touch(run);
        }
        end - start
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
}

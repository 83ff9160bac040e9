//! Removals and clears: a pod's blocks released from the runs, each from
//! where it sits (a removal names a block by its engine hash; a clear reads
//! the pod's holdings in store order, not every run).

use super::*;

impl Writer {
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
    pub(super) fn count_released(&mut self, holder: u32, n: u64) {
        if let Some(pod) = self.pods.get_mut(&(holder >> TIER_BITS)) {
            pod.entries[usize::from(tier_of(holder))] -= n;
        }
    }

    /// Drops `pod`'s hold on `loc`; false if it had none. `holding`: where
    /// the pod's holding of a run was last found, kept up to date.
    pub(super) fn release(
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
}

//! A pod's store order and capacity eviction: which of its blocks is the
//! least recently stored, and which may go first (leaves before the blocks
//! they extend, so an eviction only shortens a match from its end).

use std::cmp::Reverse;

use super::*;

impl PodState {
    /// Evicts up to `n` blocks (every tier of each), least recently stored
    /// leaves first: a block another held block extends goes only after
    /// that one, so the held set stays prefix-closed where it was and an
    /// eviction only ever shortens a match from its end. Returns how many
    /// were evicted: `n`, or every block if fewer (a non-empty held set
    /// always has a leaf: links make no cycle, as a store links only to an
    /// entry that was there before it, and `import` breaks any cycle a
    /// snapshot holds).
    ///
    /// O(log) amortised per block: `order` is walked once, a block passed
    /// for its children waits for its last child to go (`became_leaf`).
    pub fn evict_oldest(&mut self, index: &BlockIndex, n: usize) -> usize {
        let mut evicted = 0;
        while evicted < n {
            // Released blocks first: they are the older ones.
            let next = match self.released.pop() {
                Some(Reverse((time, slot))) => Some((slot, Stamp(time as u32))),
                None => self.order.pop_front(),
            };
            let Some((slot, stamp)) = next else {
                break;
            };
            let (hash, leaf) = match self.by_hash.at_slot(slot) {
                Some((hash, b)) if self.stamps.get(slot) == stamp => {
                    (hash, b.links.children() == 0)
                }
                // Re-stored or removed since (the slot maybe reused).
                _ => continue,
            };
            if !leaf {
                // Passed: `released` takes it when its last child goes.
                continue;
            }
            if let Some((held, key)) = self.forget(hash) {
                for tier in Tier::ALL {
                    if held.links.holds(tier) {
                        self.extra.forget(hash, tier);
                        self.pending.push(Change::release(key, self.id, tier));
                        self.held_per_tier[tier.index()] -= 1;
                    }
                }
                evicted += 1;
            }
        }
        self.flush(index);
        evicted
    }

    /// The block in `slot`, stored at `stamp`, just lost its last child. If eviction
    /// passed its `order` entry meanwhile (it is not newer than the front:
    /// `order` is in store order), it is evictable again: into `released`.
    /// A block still queued may be pushed too (equal stamps, after
    /// `age_out`): the second entry is stale by the time it is reached.
    pub(super) fn became_leaf(&mut self, slot: u32, stamp: Stamp) {
        let passed = self
            .order
            .front()
            .is_none_or(|(_, front)| self.age(stamp) >= self.age(*front));
        if !passed {
            return;
        }
        let time = self.clock.saturating_sub(u64::from(self.age(stamp)));
        self.released.push(Reverse((time, slot)));
        // A child that comes and goes again and again pushes its parent
        // each time: rebuild before they outnumber the live blocks.
        if self.released.len() > self.by_hash.len() + 64 {
            self.rebuild_order();
        }
    }

    /// Advances the store clock: the new stamp.
    pub(super) fn tick(&mut self) -> Stamp {
        self.clock += 1;
        if self.clock % AGE_PASS == 0 {
            self.age_out();
        }
        Stamp(self.clock as u32)
    }

    /// Stores since `stamp` (see `Stamp`).
    pub(super) fn age(&self, stamp: Stamp) -> u32 {
        (self.clock as u32).wrapping_sub(stamp.0)
    }

    /// Clamps the age of blocks not stored for `MAX_AGE` stores to that
    /// (see `Stamp`). Their order among themselves is lost (they are all
    /// the oldest), and the eviction order is rebuilt from the new stamps.
    /// O(blocks) once every 2^30 stores.
    pub(super) fn age_out(&mut self) {
        let clock = self.clock as u32;
        let oldest = Stamp(clock.wrapping_sub(MAX_AGE));
        // Only bounded pods keep stamps (see `stamps`).
        if !self.bounded {
            return;
        }
        for (slot, _, _) in self.by_hash.iter_slots() {
            if clock.wrapping_sub(self.stamps.get(slot).0) >= MAX_AGE {
                self.stamps.set(slot, oldest);
            }
        }
        self.rebuild_order();
    }

    /// The eviction order of the live entries, oldest first (every one
    /// queued again: nothing is left passed or released).
    pub(super) fn rebuild_order(&mut self) {
        self.released.clear();
        let order = self
            .oldest_first()
            .into_iter()
            .map(|(slot, _, _)| (slot, self.stamps.get(slot)))
            .collect();
        self.order = order;
    }

    /// The held blocks with their slots, least recently stored first (ties
    /// by hash; an unbounded pod keeps no stamps, so all of its blocks tie).
    pub(super) fn oldest_first(&self) -> Vec<(u32, EngineHash, &HeldBlock)> {
        let mut held: Vec<(u32, EngineHash, &HeldBlock)> = self
            .by_hash
            .iter_slots()
            .map(|(slot, h, b)| (slot, *h, b))
            .collect();
        held.sort_unstable_by_key(|(slot, h, _)| (Reverse(self.age(self.stamps.get(*slot))), *h));
        held
    }
}

//! Repeat references to a tier: the one mechanism behind both levels of
//! reference counting (a pod storing one engine hash twice, and two engine
//! hashes of a pod resolving to one of our keys).
//!
//! The holder's tier bit stands for the first reference; this counts the
//! rest, so the bit is cleared only when the last one goes. Repeats are
//! rare, so they live in a side table instead of a count in every slot.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::hash::Hash;

use crate::event::Tier;

/// References to `(K, tier)` beyond the first; saturating, 65535 is far
/// beyond any engine's duplicates.
#[derive(Debug)]
pub struct Repeats<K>(HashMap<(K, Tier), u16>);

impl<K> Default for Repeats<K> {
    fn default() -> Self {
        Repeats(HashMap::new())
    }
}

impl<K: Hash + Eq> Repeats<K> {
    /// One more reference beyond the first.
    pub fn add(&mut self, key: K, tier: Tier) {
        let n = self.0.entry((key, tier)).or_default();
        *n = n.saturating_add(1);
    }

    /// Sets the references beyond the first (a restored count minus one).
    pub fn set(&mut self, key: K, tier: Tier, n: u32) {
        let n = n.min(u32::from(u16::MAX)) as u16;
        if n == 0 {
            self.0.remove(&(key, tier));
        } else {
            self.0.insert((key, tier), n);
        }
    }

    /// Takes back one reference beyond the first, if there is one: then the
    /// tier stays held. The empty check inline (every removal asks, and
    /// repeats are rare), the lookup not.
    #[inline]
    pub fn take(&mut self, key: K, tier: Tier) -> bool {
        !self.0.is_empty() && self.take_repeat(key, tier)
    }

    fn take_repeat(&mut self, key: K, tier: Tier) -> bool {
        let Entry::Occupied(mut n) = self.0.entry((key, tier)) else {
            return false;
        };
        *n.get_mut() -= 1;
        if *n.get() == 0 {
            n.remove();
        }
        true
    }

    /// References beyond the first.
    pub fn count(&self, key: K, tier: Tier) -> u32 {
        if self.0.is_empty() {
            return 0;
        }
        self.0.get(&(key, tier)).map_or(0, |n| u32::from(*n))
    }

    /// Drops every reference beyond the first (the holder let the tier go).
    pub fn forget(&mut self, key: K, tier: Tier) {
        if !self.0.is_empty() {
            self.0.remove(&(key, tier));
        }
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_beyond_the_first_per_key_and_tier() {
        let mut r: Repeats<u64> = Repeats::default();
        assert!(!r.take(1, Tier::Gpu));
        r.add(1, Tier::Gpu);
        r.add(1, Tier::Gpu);
        r.add(1, Tier::Cpu);
        assert_eq!((r.count(1, Tier::Gpu), r.count(1, Tier::Cpu)), (2, 1));
        assert!(r.take(1, Tier::Gpu) && r.take(1, Tier::Gpu));
        assert!(!r.take(1, Tier::Gpu));
        r.forget(1, Tier::Cpu);
        assert!(r.is_empty());
        r.set(2, Tier::Storage, 100_000);
        assert_eq!(r.count(2, Tier::Storage), 65_535);
        r.set(2, Tier::Storage, 0);
        assert!(r.is_empty());
    }
}

//! A pod's map from engine hash to what it knows of the block, in two
//! parts: a hash table of 4-byte slot numbers, and the entries themselves
//! in fixed-size chunks, removed entries' slots reused.
//!
//! The map holds one entry per (pod, block), most of the index's memory. A
//! hash table's buckets are a power of two at most 7/8 full, so after it
//! grows up to half of them are empty: with the (then 40-byte) entries in
//! the buckets, an entry cost 47-94 bytes. Here an empty bucket costs 5
//! bytes and the chunks are full, so an entry costs its own bytes (16 now,
//! see `pod::HeldBlock`) and 6-12 more.
//! In the comparison bench (full trace) that took bytes per (pod, block)
//! entry from 115 to 79 (16 pods) and from 89 to 71 (128 pods). A lookup reads one line
//! more (the slot number, then the entry), but the table of slot numbers is
//! an eighth of the old table's size and mostly stays in cache: last-level
//! misses per applied block went from 4.3 to 3.1 and apply got faster,
//! though it runs a fifth more instructions (rehashing reads each entry's
//! hash from its chunk).

use std::hash::BuildHasher;

use hashbrown::hash_table::{self, HashTable};

use crate::event::EngineHash;
use crate::index::KeyBuildHasher;

/// Entries per chunk: a pod with few blocks wastes at most one chunk.
const CHUNK: usize = 256;
const CHUNK_BITS: u32 = CHUNK.trailing_zeros();

/// Filled by pushing: a new chunk is not written twice (the first grows by
/// doubling, see `VacantEntry::insert`).
type Chunk<V> = Vec<(EngineHash, V)>;

pub struct BlockMap<V> {
    /// Slot numbers, hashed by their entry's engine hash.
    table: HashTable<u32>,
    /// Entries by slot number: slot `s` is `chunks[s / CHUNK][s % CHUNK]`.
    /// Every chunk but the last is full (of live or free slots).
    chunks: Vec<Chunk<V>>,
    /// Slots whose entry was removed, reused first.
    free: Vec<u32>,
}

impl<V> Default for BlockMap<V> {
    fn default() -> Self {
        BlockMap {
            table: HashTable::new(),
            chunks: Vec::new(),
            free: Vec::new(),
        }
    }
}

#[inline]
fn hash(h: EngineHash) -> u64 {
    KeyBuildHasher::default().hash_one(h)
}

#[inline]
fn at<V>(chunks: &[Chunk<V>], slot: u32) -> &(EngineHash, V) {
    &chunks[(slot >> CHUNK_BITS) as usize][slot as usize & (CHUNK - 1)]
}

#[inline]
fn at_mut<V>(chunks: &mut [Chunk<V>], slot: u32) -> &mut (EngineHash, V) {
    &mut chunks[(slot >> CHUNK_BITS) as usize][slot as usize & (CHUNK - 1)]
}

impl<V: Copy> BlockMap<V> {
    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Entries the table takes before it grows.
    pub fn capacity(&self) -> usize {
        self.table.capacity()
    }

    /// Replaces the table of slot numbers by one with room for `n` entries
    /// whose every bucket was touched once (filled, then cleared: capacity
    /// stays, no tombstones), so its memory is resident now rather than
    /// creeping in as churn reaches its pages. Entries stay in their slots.
    pub fn regrow(&mut self, n: usize) {
        let mut fresh = HashTable::with_capacity(n);
        for i in 0..fresh.capacity() as u32 {
            fresh.insert_unique(u64::from(i), i, |_| 0);
        }
        fresh.clear();
        let chunks = &self.chunks;
        for slot in self.table.drain() {
            let h = hash(at(chunks, slot).0);
            fresh.insert_unique(h, slot, |s| hash(at(chunks, *s).0));
        }
        self.table = fresh;
    }

    #[inline]
    fn find(&self, key: EngineHash) -> Option<u32> {
        let chunks = &self.chunks;
        self.table
            .find(hash(key), |s| at(chunks, *s).0 == key)
            .copied()
    }

    pub fn contains_key(&self, key: &EngineHash) -> bool {
        self.find(*key).is_some()
    }

    /// Looks every key up and forgets the answers: an event's blocks are
    /// known up front, and these probes do not wait on each other, so
    /// their cache misses overlap. The event's own pass then finds its
    /// lines in cache, where each probe came after the last one's
    /// changes and took its misses one at a time.
    pub fn touch(&self, keys: &[EngineHash]) {
        for key in keys {
            std::hint::black_box(self.find(*key).is_some());
        }
    }

    #[inline]
    pub fn get(&self, key: &EngineHash) -> Option<&V> {
        self.find(*key).map(|s| &at(&self.chunks, s).1)
    }

    #[inline]
    pub fn get_mut(&mut self, key: &EngineHash) -> Option<&mut V> {
        self.find(*key).map(|s| &mut at_mut(&mut self.chunks, s).1)
    }

    /// Always inlined, as `VacantEntry::insert_with_slot` is.
    #[inline(always)]
    pub fn entry(&mut self, key: EngineHash) -> Entry<'_, V> {
        let h = hash(key);
        let BlockMap {
            table,
            chunks,
            free,
        } = self;
        let found = table.entry(h, |s| at(chunks, *s).0 == key, |s| hash(at(chunks, *s).0));
        match found {
            hash_table::Entry::Occupied(entry) => Entry::Occupied(OccupiedEntry {
                entry,
                chunks,
                free,
            }),
            hash_table::Entry::Vacant(entry) => Entry::Vacant(VacantEntry {
                entry,
                chunks,
                free,
                key,
            }),
        }
    }

    /// Inserts or replaces `key`'s entry; the old value if there was one.
    pub fn insert(&mut self, key: EngineHash, value: V) -> Option<V> {
        match self.entry(key) {
            Entry::Occupied(mut e) => Some(std::mem::replace(e.get_mut(), value)),
            Entry::Vacant(v) => {
                v.insert(value);
                None
            }
        }
    }

    /// `key`'s entry if it has one. Unlike `entry`, a miss never grows the
    /// table: for removals, which often name blocks the pod never had.
    #[inline]
    pub fn find_entry(&mut self, key: EngineHash) -> Option<OccupiedEntry<'_, V>> {
        let BlockMap {
            table,
            chunks,
            free,
        } = self;
        let entry = table
            .find_entry(hash(key), |s| at(chunks, *s).0 == key)
            .ok()?;
        Some(OccupiedEntry {
            entry,
            chunks,
            free,
        })
    }

    pub fn remove(&mut self, key: &EngineHash) -> Option<V> {
        self.find_entry(*key).map(OccupiedEntry::remove)
    }

    /// The entry in `slot`, if one is live there (in the table: not
    /// detached, not freed): a slot names an entry for as long as it is in
    /// the table, and is reused after it is freed.
    #[inline]
    pub fn at_slot(&self, slot: u32) -> Option<(EngineHash, &V)> {
        let (key, value) = self
            .chunks
            .get((slot >> CHUNK_BITS) as usize)?
            .get(slot as usize & (CHUNK - 1))?;
        // A freed slot keeps its last entry's bytes: live only if the
        // table still maps that key here.
        (self.find(*key) == Some(slot)).then_some((*key, value))
    }

    /// Puts an entry in a slot of its own without a place in the table: a
    /// *detached* entry, which no lookup finds, `len` does not count and
    /// `at_slot` calls dead, kept for whoever holds its slot number until
    /// they `free` it. Pods keep blocks that left but still have children
    /// linked to them so (see `pod`).
    pub fn insert_detached(&mut self, key: EngineHash, value: V) -> u32 {
        alloc_slot(&mut self.chunks, &mut self.free, key, value)
    }

    /// Slots handed out so far (live, detached or free): every slot number
    /// is below it.
    pub fn slot_count(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }

    /// Hands back a detached entry's slot (see `insert_detached`), to be
    /// reused by the next insert.
    pub fn free(&mut self, slot: u32) {
        self.free.push(slot);
    }

    /// The entry in `slot`, live or detached, whatever it is: for callers
    /// that know the slot names the entry they linked to.
    #[inline]
    pub fn any_at(&self, slot: u32) -> (EngineHash, &V) {
        let (key, value) = at(&self.chunks, slot);
        (*key, value)
    }

    /// As `any_at`, mutably.
    #[inline]
    pub fn any_at_mut(&mut self, slot: u32) -> &mut V {
        &mut at_mut(&mut self.chunks, slot).1
    }

    /// Slots holding detached entries (see `insert_detached`): neither
    /// live nor freed.
    #[cfg(test)]
    pub(crate) fn detached_slots(&self) -> Vec<u32> {
        (0..self.slot_count() as u32)
            .filter(|s| !self.free.contains(s) && self.at_slot(*s).is_none())
            .collect()
    }

    /// `key`'s value and its slot.
    #[inline]
    pub fn get_with_slot(&self, key: &EngineHash) -> Option<(u32, &V)> {
        let slot = self.find(*key)?;
        Some((slot, &at(&self.chunks, slot).1))
    }

    /// `key`'s value and its slot.
    #[inline]
    pub fn get_mut_with_slot(&mut self, key: &EngineHash) -> Option<(u32, &mut V)> {
        let slot = self.find(*key)?;
        Some((slot, &mut at_mut(&mut self.chunks, slot).1))
    }

    /// Entries with their slots, in no particular order.
    pub fn iter_slots(&self) -> impl Iterator<Item = (u32, &EngineHash, &V)> {
        let chunks = &self.chunks;
        self.table.iter().map(move |s| {
            let (k, v) = at(chunks, *s);
            (*s, k, v)
        })
    }

    /// Entries in no particular order (table order, not slot order).
    pub fn iter(&self) -> impl Iterator<Item = (&EngineHash, &V)> {
        self.iter_slots().map(|(_, k, v)| (k, v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &EngineHash> {
        self.iter().map(|(k, _)| k)
    }

    /// Empties the map, handing each entry to `f` first, and frees its
    /// memory.
    /// (Detached entries go without a call.)
    pub fn clear_each(&mut self, mut f: impl FnMut(u32, EngineHash, V)) {
        for (s, k, v) in self.iter_slots() {
            f(s, *k, *v);
        }
        *self = BlockMap::default();
    }
}

impl<V: Copy> std::ops::Index<&EngineHash> for BlockMap<V> {
    type Output = V;

    fn index(&self, key: &EngineHash) -> &V {
        self.get(key).expect("no entry for this hash")
    }
}

pub enum Entry<'a, V> {
    Occupied(OccupiedEntry<'a, V>),
    Vacant(VacantEntry<'a, V>),
}

pub struct OccupiedEntry<'a, V> {
    entry: hash_table::OccupiedEntry<'a, u32>,
    chunks: &'a mut Vec<Chunk<V>>,
    free: &'a mut Vec<u32>,
}

impl<'a, V: Copy> OccupiedEntry<'a, V> {
    /// Where the entry is kept (see `BlockMap::at_slot`).
    #[inline]
    pub fn slot(&self) -> u32 {
        *self.entry.get()
    }

    #[inline]
    pub fn get_mut(&mut self) -> &mut V {
        &mut at_mut(self.chunks, *self.entry.get()).1
    }

    #[inline]
    pub fn into_mut(self) -> &'a mut V {
        &mut at_mut(self.chunks, *self.entry.get()).1
    }

    /// Removes the entry; its slot is reused by the next insert.
    #[inline]
    pub fn remove(self) -> V {
        let (slot, _) = self.entry.remove();
        self.free.push(slot);
        at(self.chunks, slot).1
    }

    /// Takes the entry out of the table but leaves it in its slot, detached
    /// (see `BlockMap::insert_detached`): its slot and value.
    #[inline]
    pub fn detach(self) -> (u32, V) {
        let (slot, _) = self.entry.remove();
        (slot, at(self.chunks, slot).1)
    }
}

/// A slot for a new entry: a freed one, else the next one of the last chunk.
#[inline(always)]
fn alloc_slot<V>(
    chunks: &mut Vec<Chunk<V>>,
    free: &mut Vec<u32>,
    key: EngineHash,
    value: V,
) -> u32 {
    if let Some(slot) = free.pop() {
        *at_mut(chunks, slot) = (key, value);
        return slot;
    }
    match chunks.last() {
        // The first chunk grows as a vector does (to exactly CHUNK, a
        // power of two): a pod holding a few blocks costs a few entries,
        // not a whole chunk, so a flood of pod names cannot multiply that
        // by itself.
        None => chunks.push(Vec::new()),
        Some(c) if c.len() == CHUNK => chunks.push(Vec::with_capacity(CHUNK)),
        Some(_) => {}
    }
    let n = chunks.len() - 1;
    let last = &mut chunks[n];
    last.push((key, value));
    ((n << CHUNK_BITS) + last.len() - 1) as u32
}

/// Values kept beside a `BlockMap`'s entries, by slot number, for the maps
/// that need them: a column instead of a wider entry, so a map that does
/// without it pays nothing (see `pod`: keys that differ from the engine
/// hash, store stamps under a capacity). Chunked as the entries are.
#[derive(Default)]
pub struct Column<T> {
    chunks: Vec<Vec<T>>,
}

impl<T: Copy + Default> Column<T> {
    /// The value in `slot` (the default if none was ever set).
    #[inline]
    pub fn get(&self, slot: u32) -> T {
        self.chunks
            .get((slot >> CHUNK_BITS) as usize)
            .and_then(|c| c.get(slot as usize & (CHUNK - 1)))
            .copied()
            .unwrap_or_default()
    }

    #[inline]
    pub fn set(&mut self, slot: u32, value: T) {
        let (c, i) = ((slot >> CHUNK_BITS) as usize, slot as usize & (CHUNK - 1));
        if c >= self.chunks.len() {
            self.chunks.resize_with(c + 1, Vec::new);
        }
        let chunk = &mut self.chunks[c];
        if i >= chunk.len() {
            // Grows as a vector does, but to CHUNK at most (slots can be
            // set out of order: from 201 to 256 entries a vector would
            // double to 402).
            if i >= chunk.capacity() {
                let want = (2 * chunk.capacity()).clamp(i + 1, CHUNK);
                chunk.reserve_exact(want - chunk.len());
            }
            chunk.resize(i + 1, T::default());
        }
        chunk[i] = value;
    }

    pub fn clear(&mut self) {
        self.chunks = Vec::new();
    }
}

pub struct VacantEntry<'a, V> {
    entry: hash_table::VacantEntry<'a, u32>,
    chunks: &'a mut Vec<Chunk<V>>,
    free: &'a mut Vec<u32>,
    key: EngineHash,
}

impl<'a, V: Copy> VacantEntry<'a, V> {
    #[inline]
    pub fn insert(self, value: V) -> &'a mut V {
        self.insert_with_slot(value).1
    }

    /// Inserts; returns where the entry is kept (see `BlockMap::at_slot`).
    /// Always inlined: called once per stored block, and as a call it cost
    /// that path 8% more instructions.
    #[inline(always)]
    pub fn insert_with_slot(self, value: V) -> (u32, &'a mut V) {
        let slot = alloc_slot(self.chunks, self.free, self.key, value);
        self.entry.insert(slot);
        (slot, &mut at_mut(self.chunks, slot).1)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::test_rng::xorshift;

    #[test]
    fn behaves_like_a_hash_map_under_random_churn() {
        let mut rnd = xorshift(11);
        let mut ours: BlockMap<u64> = BlockMap::default();
        let mut model: HashMap<u64, u64> = HashMap::new();
        for step in 0..200_000u64 {
            // Keys from a small range so inserts hit existing entries and
            // removals hit live ones; the range moves so the map grows and
            // shrinks.
            let range = 1 + (step / 20_000) % 5 * 3_000;
            let k = rnd(range);
            match rnd(10) {
                0..=3 => {
                    assert_eq!(ours.insert(EngineHash(k), step), model.insert(k, step));
                }
                4..=5 => match ours.entry(EngineHash(k)) {
                    Entry::Occupied(mut e) => {
                        *e.get_mut() += 1;
                        *model.get_mut(&k).unwrap() += 1;
                    }
                    Entry::Vacant(v) => {
                        assert_eq!(*v.insert(step), step);
                        assert!(model.insert(k, step).is_none());
                    }
                },
                6..=8 => assert_eq!(ours.remove(&EngineHash(k)), model.remove(&k)),
                _ => assert_eq!(ours.get(&EngineHash(k)), model.get(&k)),
            }
            assert_eq!(ours.len(), model.len());
            if step % 50_000 == 0 {
                ours.regrow(2 * ours.len() + 2);
            }
        }
        let mut all: Vec<(u64, u64)> = ours.iter().map(|(k, v)| (k.0, *v)).collect();
        all.sort_unstable();
        let mut want: Vec<(u64, u64)> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(all, want);
        // Freed slots are reused: the chunks hold no more than the peak.
        let slots: usize = ours.chunks.iter().map(Vec::len).sum();
        assert_eq!(slots, ours.len() + ours.free.len());
        assert!(slots <= 15_000, "{slots}");
    }

    #[test]
    fn a_slot_names_its_entry_until_removed_and_not_after() {
        let mut m: BlockMap<u64> = BlockMap::default();
        let a = match m.entry(EngineHash(7)) {
            Entry::Vacant(v) => v.insert_with_slot(70).0,
            Entry::Occupied(_) => unreachable!(),
        };
        assert_eq!(m.at_slot(a), Some((EngineHash(7), &70)));
        assert_eq!(m.get_mut_with_slot(&EngineHash(7)).map(|(s, _)| s), Some(a));
        assert_eq!(m.remove(&EngineHash(7)), Some(70));
        // The freed slot still holds the old bytes.
        assert_eq!(m.at_slot(a), None);
        assert_eq!(m.at_slot(a + 1), None);
        m.insert(EngineHash(8), 80);
        assert_eq!(m.at_slot(a), Some((EngineHash(8), &80)));
        let Entry::Occupied(e) = m.entry(EngineHash(8)) else {
            unreachable!()
        };
        assert_eq!(e.slot(), a);
        m.regrow(100);
        assert_eq!(m.at_slot(a), Some((EngineHash(8), &80)));
        assert_eq!(
            m.iter_slots().map(|(s, k, _)| (s, *k)).collect::<Vec<_>>(),
            vec![(a, EngineHash(8))]
        );
    }

    #[test]
    fn a_column_keeps_values_by_slot_in_chunks_of_at_most_chunk() {
        let mut c: Column<u64> = Column::default();
        assert_eq!(c.get(5), 0);
        // Out of order, as a backfill in table order sets them.
        for s in [200u32, 255, 3, 256 + 7, 256 + 255, 100] {
            c.set(s, u64::from(s) + 1);
        }
        for s in [200u32, 255, 3, 256 + 7, 256 + 255, 100] {
            assert_eq!(c.get(s), u64::from(s) + 1);
        }
        assert_eq!(c.get(4), 0);
        assert!(c.chunks.iter().all(|chunk| chunk.capacity() <= CHUNK));
        c.clear();
        assert_eq!(c.get(200), 0);
        assert!(c.chunks.is_empty());
    }

    #[test]
    fn detached_entries_keep_their_slot_until_freed() {
        let mut m: BlockMap<u64> = BlockMap::default();
        m.insert(EngineHash(1), 10);
        let Some(e) = m.find_entry(EngineHash(1)) else {
            unreachable!()
        };
        let (slot, value) = e.detach();
        assert_eq!((value, m.len(), m.get(&EngineHash(1))), (10, 0, None));
        assert_eq!(m.at_slot(slot), None, "detached is not live");
        assert_eq!(m.any_at(slot), (EngineHash(1), &10));
        // Not reused while detached.
        m.insert(EngineHash(2), 20);
        let other = m.insert_detached(EngineHash(3), 30);
        assert_eq!(m.detached_slots(), vec![slot, other]);
        m.free(slot);
        m.insert(EngineHash(4), 40);
        assert_eq!(m.at_slot(slot), Some((EngineHash(4), &40)), "freed, reused");
        assert_eq!(m.detached_slots(), vec![other]);
    }

    #[test]
    fn removing_a_missing_key_from_a_full_table_does_not_grow_it() {
        let mut m: BlockMap<u64> = BlockMap::default();
        m.insert(EngineHash(0), 0);
        let mut k = 1;
        while m.len() < m.capacity() {
            m.insert(EngineHash(k), k);
            k += 1;
        }
        let capacity = m.capacity();
        assert_eq!(m.remove(&EngineHash(u64::MAX)), None);
        assert!(m.find_entry(EngineHash(u64::MAX)).is_none());
        assert_eq!(m.capacity(), capacity);
    }
}

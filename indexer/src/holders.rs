//! The pods holding one key, and on which tiers: a short list for the
//! common key (one or two holders, kept in the table slot), a bit set over
//! pod ids for a key much of a fleet holds (a system prompt's blocks, a
//! popular document's).
//!
//! Why bits as well as a list: with 128 pods a widely held key's sorted list is 512
//! bytes, eight cache lines a lookup reads and a scan over up to 128 pods
//! for every probe of the prefix search (with 128 pods and 8,192-block
//! prompts that scan was most of a lookup). As bits it is 64 bytes (and
//! the vector's 16-byte header), and the search answers "which of these
//! pods hold it" with a word operation per 64 pods (`HolderSet::mark`).

use thin_vec::ThinVec;

use crate::event::{Tier, TIERS};
use crate::index::{PodId, TierMask};

/// One pod holding one key, in one word: the pod's id in the low bits and
/// the tiers it holds the key on in the top `TIERS` bits. A word, not a
/// struct with per-tier counts, so a key's holder list stays inline in its
/// table slot for up to `INLINE_HOLDERS` pods: a spilled list is a second
/// cache miss on every change and lookup of a shared key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder(u32);

const TIER_SHIFT: u32 = u32::BITS - TIERS as u32;

/// Pod ids must leave room for the tier bits.
pub const MAX_PODS: u32 = 1 << TIER_SHIFT;

impl Holder {
    pub(crate) fn new(pod: PodId, tier: Tier) -> Holder {
        Holder::on(pod, TierMask(1 << tier.index()))
    }

    fn on(pod: PodId, tiers: TierMask) -> Holder {
        debug_assert!(pod.0 < MAX_PODS);
        Holder(pod.0 | u32::from(tiers.0) << TIER_SHIFT)
    }

    pub fn pod(self) -> PodId {
        PodId(self.0 & (MAX_PODS - 1))
    }

    pub fn tiers(self) -> TierMask {
        TierMask((self.0 >> TIER_SHIFT) as u8)
    }

    fn with(self, tier: Tier) -> Holder {
        Holder(self.0 | 1 << (TIER_SHIFT + tier.index() as u32))
    }

    fn without(self, tier: Tier) -> Holder {
        Holder(self.0 & !(1 << (TIER_SHIFT + tier.index() as u32)))
    }
}

/// Holders kept in the table slot itself before the list spills: three
/// keep `Holders` at 16 bytes and a slot at 24, where four took 32 (bytes
/// per entry -1.6 to -3.7 in the comparison bench, the keys with a
/// fourth holder paying a list of their own).
pub const INLINE_HOLDERS: usize = 3;

/// 64 pod ids' holdings of a key: pods `index * 64 ..` on each tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Word {
    index: u32,
    tiers: [u64; TIERS],
}

impl Word {
    /// The pods holding the key on any tier.
    fn any(&self) -> u64 {
        self.tiers.iter().fold(0, |a, t| a | t)
    }

    fn tiers_of(&self, bit: u32) -> TierMask {
        let mut mask = 0;
        for (i, t) in self.tiers.iter().enumerate() {
            mask |= (((t >> bit) & 1) as u8) << i;
        }
        TierMask(mask)
    }
}

/// A list turns into bits once it has at least this many holders per word
/// of pod ids it spans (a word's 32 bytes against this many 4-byte
/// holders), checked as it reaches a power of two from `DENSE_MIN`...
const DENSE_PER_WORD: usize = 8;
const DENSE_MIN: usize = 8;
/// ...and back into a list below half that (so a key at the boundary does
/// not flip at every change).
const SPARSE_PER_WORD: usize = DENSE_PER_WORD / 2;

/// The holders of a key: never empty while in the index.
#[derive(Clone, Debug)]
pub enum Holders {
    /// Sorted by pod id.
    Inline {
        len: u8,
        holders: [Holder; INLINE_HOLDERS],
    },
    /// Sorted by pod id; at least `INLINE_HOLDERS` (see `remove`).
    Spilled(ThinVec<Holder>),
    /// `words` sorted by index, no word without a holder; `holders` pods
    /// hold the key (kept, so that every removal can check in O(1) whether
    /// the bits should turn back into a list).
    Dense { holders: u32, words: ThinVec<Word> },
}

impl Holders {
    /// `pod` alone, on `tier`.
    pub fn one(pod: PodId, tier: Tier) -> Holders {
        Holders::Inline {
            len: 1,
            holders: [Holder::new(pod, tier); INLINE_HOLDERS],
        }
    }

    pub fn view(&self) -> HolderSet<'_> {
        HolderSet(Some(self))
    }

    pub fn is_empty(&self) -> bool {
        match self {
            Holders::Inline { len, .. } => *len == 0,
            Holders::Spilled(list) => list.is_empty(),
            Holders::Dense { words, .. } => words.is_empty(),
        }
    }

    /// Reads the ends of an out-of-line form, so that its cache miss is
    /// taken now, overlapping others (see `BlockIndex::apply`).
    #[inline]
    pub fn touch(&self) {
        match self {
            Holders::Inline { .. } => {}
            Holders::Spilled(list) => {
                std::hint::black_box((list.first().copied(), list.last().copied()));
            }
            Holders::Dense { words, .. } => {
                std::hint::black_box(words.first().copied());
            }
        }
    }

    /// Adds `tier` to `pod`'s holding; false if it held the key on that
    /// tier already (nothing changed).
    pub fn add(&mut self, pod: PodId, tier: Tier) -> bool {
        match self {
            Holders::Inline { len, holders } => {
                let list = &mut holders[..usize::from(*len)];
                match list.binary_search_by_key(&pod, |h| h.pod()) {
                    Ok(i) => return with_tier(&mut list[i], tier),
                    Err(i) if list.len() < INLINE_HOLDERS => {
                        holders.copy_within(i..usize::from(*len), i + 1);
                        holders[i] = Holder::new(pod, tier);
                        *len += 1;
                    }
                    Err(i) => {
                        let mut spilled = ThinVec::with_capacity(2 * INLINE_HOLDERS);
                        spilled.extend_from_slice(&holders[..i]);
                        spilled.push(Holder::new(pod, tier));
                        spilled.extend_from_slice(&holders[i..]);
                        *self = Holders::Spilled(spilled);
                    }
                }
                true
            }
            Holders::Spilled(list) => {
                match list.binary_search_by_key(&pod, |h| h.pod()) {
                    Ok(i) => return with_tier(&mut list[i], tier),
                    Err(i) => list.insert(i, Holder::new(pod, tier)),
                }
                if list.len() >= DENSE_MIN && list.len().is_power_of_two() {
                    let words = words_spanned(list);
                    if list.len() >= DENSE_PER_WORD * words {
                        *self = Holders::Dense {
                            holders: list.len() as u32,
                            words: to_words(list, words),
                        };
                    }
                }
                true
            }
            Holders::Dense { holders, words } => {
                let index = pod.0 / 64;
                let (at, new_word) = match find_word(words, index) {
                    Ok(at) => (at, false),
                    Err(at) => {
                        let word = Word {
                            index,
                            tiers: [0; TIERS],
                        };
                        words.insert(at, word);
                        (at, true)
                    }
                };
                let word = &mut words[at];
                let bit = 1 << (pod.0 % 64);
                if word.any() & bit == 0 {
                    *holders += 1;
                }
                let added = word.tiers[tier.index()] & bit == 0;
                word.tiers[tier.index()] |= bit;
                // Holders arriving one per word (ids far apart) would make
                // bits cost up to 8x the list.
                if new_word {
                    self.sparse_back();
                }
                added
            }
        }
    }

    /// Takes `tier` from `pod`'s holding, and the pod from the list once it
    /// holds the key on no tier. The pod must hold it on that tier.
    pub fn remove(&mut self, pod: PodId, tier: Tier) {
        match self {
            Holders::Inline { len, holders } => {
                let n = usize::from(*len);
                if let Ok(i) = holders[..n].binary_search_by_key(&pod, |h| h.pod()) {
                    holders[i] = holders[i].without(tier);
                    if holders[i].tiers().is_empty() {
                        holders.copy_within(i + 1..n, i);
                        *len -= 1;
                    }
                }
            }
            Holders::Spilled(list) => {
                if let Ok(i) = list.binary_search_by_key(&pod, |h| h.pod()) {
                    list[i] = list[i].without(tier);
                    if list[i].tiers().is_empty() {
                        list.remove(i);
                    }
                }
                // Back into the slot once a holder short of full (not at
                // full: a key at the boundary would move at every change),
                // freeing the list: under churn most keys that ever had a
                // fourth holder are down to one or two again.
                if list.len() < INLINE_HOLDERS && !list.is_empty() {
                    *self = Holders::inline(list);
                }
            }
            Holders::Dense { holders, words } => {
                let Ok(at) = find_word(words, pod.0 / 64) else {
                    return;
                };
                let bit = 1 << (pod.0 % 64);
                let word = &mut words[at];
                let held = word.any() & bit != 0;
                word.tiers[tier.index()] &= !bit;
                if held && word.any() & bit == 0 {
                    *holders -= 1;
                    if word.any() == 0 {
                        words.remove(at);
                    }
                }
                self.sparse_back();
            }
        }
    }

    /// Turns bits back into a list once they hold fewer than
    /// `SPARSE_PER_WORD` holders per word (or very few in all): checked
    /// after every change that could bring them there, so bits never cost
    /// more than `32 / SPARSE_PER_WORD` bytes per holder.
    fn sparse_back(&mut self) {
        let Holders::Dense { holders, words } = self else {
            return;
        };
        let holders = *holders as usize;
        if holders < SPARSE_PER_WORD * words.len() || holders < DENSE_MIN / 2 {
            let list: ThinVec<Holder> = self.view().iter().collect();
            *self = if list.len() <= INLINE_HOLDERS {
                Holders::inline(&list)
            } else {
                Holders::Spilled(list)
            };
        }
    }

    /// `list` (sorted, 1 to `INLINE_HOLDERS` long) in the slot.
    fn inline(list: &[Holder]) -> Holders {
        let mut holders = [list[0]; INLINE_HOLDERS];
        holders[..list.len()].copy_from_slice(list);
        Holders::Inline {
            len: list.len() as u8,
            holders,
        }
    }
}

/// Adds `tier` to `holder`; false if it was there.
fn with_tier(holder: &mut Holder, tier: Tier) -> bool {
    let had = holder.tiers().contains(tier);
    *holder = holder.with(tier);
    !had
}

/// Words of 64 pod ids that a sorted list has holders in.
fn words_spanned(list: &[Holder]) -> usize {
    let mut words = 0;
    let mut last = None;
    for h in list {
        let w = h.pod().0 / 64;
        if last != Some(w) {
            words += 1;
            last = Some(w);
        }
    }
    words
}

fn to_words(list: &[Holder], words: usize) -> ThinVec<Word> {
    let mut out: ThinVec<Word> = ThinVec::with_capacity(words);
    for h in list {
        let (index, bit) = (h.pod().0 / 64, h.pod().0 % 64);
        if out.last().is_none_or(|w| w.index != index) {
            out.push(Word {
                index,
                tiers: [0; TIERS],
            });
        }
        let word = out.last_mut().expect("pushed");
        for tier in h.tiers().tiers() {
            word.tiers[tier.index()] |= 1 << bit;
        }
    }
    out
}

/// Where the word of pod ids `index * 64 ..` is, or would go.
fn find_word(words: &[Word], index: u32) -> Result<usize, usize> {
    if words.len() <= 8 {
        // Most dense keys span a word or two: a scan beats halving.
        match words.iter().position(|w| w.index >= index) {
            Some(at) if words[at].index == index => Ok(at),
            Some(at) => Err(at),
            None => Err(words.len()),
        }
    } else {
        words.binary_search_by_key(&index, |w| w.index)
    }
}

/// A read-only view of a key's holders; empty for a key nobody holds.
#[derive(Clone, Copy)]
pub struct HolderSet<'a>(Option<&'a Holders>);

impl<'a> HolderSet<'a> {
    pub const EMPTY: HolderSet<'static> = HolderSet(None);

    pub fn is_empty(self) -> bool {
        self.0.is_none_or(Holders::is_empty)
    }

    /// True when held as bits: `mark` then costs a word operation per 64
    /// pod ids, not a pass over the holders.
    pub fn is_dense(self) -> bool {
        matches!(self.0, Some(Holders::Dense { .. }))
    }

    /// The number of pods holding the key.
    pub fn len(self) -> usize {
        match self.0 {
            None => 0,
            Some(Holders::Inline { len, .. }) => usize::from(*len),
            Some(Holders::Spilled(list)) => list.len(),
            Some(Holders::Dense { holders, .. }) => *holders as usize,
        }
    }

    /// The tiers `pod` holds the key on, if any.
    pub fn get(self, pod: PodId) -> Option<TierMask> {
        let list = match self.0? {
            Holders::Inline { len, holders } => &holders[..usize::from(*len)],
            Holders::Spilled(list) => list.as_slice(),
            Holders::Dense { words, .. } => {
                let word = &words[find_word(words, pod.0 / 64).ok()?];
                let tiers = word.tiers_of(pod.0 % 64);
                return (!tiers.is_empty()).then_some(tiers);
            }
        };
        // Most keys have one or two holders.
        let found = if list.len() <= 8 {
            list.iter().find(|h| h.pod() == pod)
        } else {
            list.binary_search_by_key(&pod, |h| h.pod())
                .ok()
                .map(|i| &list[i])
        };
        found.map(|h| h.tiers())
    }

    /// The holders in pod id order.
    pub fn iter(self) -> impl Iterator<Item = Holder> + 'a {
        let (list, words): (&[Holder], &[Word]) = match self.0 {
            None => (&[], &[]),
            Some(Holders::Inline { len, holders }) => (&holders[..usize::from(*len)], &[]),
            Some(Holders::Spilled(list)) => (list.as_slice(), &[]),
            Some(Holders::Dense { words, .. }) => (&[], words.as_slice()),
        };
        let from_words = words.iter().flat_map(|w| {
            Bits(w.any()).map(move |bit| Holder::on(PodId(w.index * 64 + bit), w.tiers_of(bit)))
        });
        list.iter().copied().chain(from_words)
    }

    /// `mark`, a set per tier: sets, in `held[t]`, the bits of the holders
    /// on tier `t` among pod ids `base * 64 .. (base + W) * 64`.
    pub fn mark_tiers<const W: usize>(self, base: u32, held: &mut [[u64; W]; TIERS]) {
        self.mark_words::<W>(base, |w, tiers| {
            for (on_tier, bits) in held.iter_mut().zip(tiers) {
                on_tier[w] |= bits;
            }
        });
    }

    /// Sets, in `held`, the bits of the holders among pod ids
    /// `base * 64 .. (base + W) * 64` (bit `i` of word `w` for pod
    /// `(base + w) * 64 + i`), leaving the other bits as they were.
    pub fn mark<const W: usize>(self, base: u32, held: &mut [u64; W]) {
        self.mark_words::<W>(base, |w, tiers| {
            held[w] |= tiers.iter().fold(0, |a, t| a | t);
        });
    }

    /// Calls `mark(w, tiers)` with the holders among pod ids
    /// `base * 64 .. (base + W) * 64`, as bits per tier of word `w` of that
    /// range: a word of bits at a time, or holder by holder.
    #[inline]
    fn mark_words<const W: usize>(self, base: u32, mut mark: impl FnMut(usize, [u64; TIERS])) {
        let end = base.saturating_add(W as u32);
        match self.0 {
            Some(Holders::Dense { words, .. }) => {
                let from = match find_word(words, base) {
                    Ok(at) | Err(at) => at,
                };
                for w in words[from..].iter().take_while(|w| w.index < end) {
                    mark((w.index - base) as usize, w.tiers);
                }
            }
            _ => {
                let base = u64::from(base) * 64;
                for h in self.iter() {
                    let off = u64::from(h.pod().0).wrapping_sub(base);
                    if off < (W * 64) as u64 {
                        let bit = 1 << (off % 64);
                        let tiers: [u64; TIERS] =
                            std::array::from_fn(|t| bit * u64::from((h.tiers().0 >> t) & 1));
                        mark(off as usize / 64, tiers);
                    }
                }
            }
        }
    }
}

/// The positions of the set bits of a word, lowest first.
pub(crate) struct Bits(pub(crate) u64);

impl Iterator for Bits {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            return None;
        }
        let bit = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(bit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn as_map(set: HolderSet<'_>) -> BTreeMap<u32, u8> {
        set.iter().map(|h| (h.pod().0, h.tiers().0)).collect()
    }

    fn form(h: &Holders) -> &'static str {
        match h {
            Holders::Inline { .. } => "inline",
            Holders::Spilled(_) => "spilled",
            Holders::Dense { .. } => "dense",
        }
    }

    /// Random adds and removes over pod ids packed into a few words and
    /// spread over many, against a plain map: every form answers the same,
    /// and the forms are the ones the thresholds call for.
    #[test]
    fn every_form_holds_the_same_set() {
        // (seed, pods, id stride): ids 97 apart never share a word.
        for (seed, span, stride) in [
            (1u64, 40u64, 1),
            (2, 130, 1),
            (3, 700, 1),
            (4, 60, 97),
            (5, 16, 1),
        ] {
            let id = |r: u64| PodId((r * stride) as u32);
            let mut rnd = crate::test_rng::xorshift(seed);
            let mut holders = Holders::one(PodId(0), Tier::Gpu);
            let mut want = BTreeMap::from([(0u32, 1u8)]);
            let mut forms = std::collections::BTreeSet::new();
            for step in 0..20_000 {
                let pod = id(rnd(span));
                let tier = Tier::ALL[rnd(TIERS as u64) as usize];
                let bit = 1u8 << tier.index();
                // Fill up, then drain, then fill again.
                let adding = (step / 3000) % 2 == 0;
                let held = want.get(&pod.0).is_some_and(|t| t & bit != 0);
                if adding {
                    assert_eq!(holders.add(pod, tier), !held, "{seed} {step}");
                    *want.entry(pod.0).or_default() |= bit;
                } else if held && want.len() > 1 {
                    holders.remove(pod, tier);
                    let t = want.get_mut(&pod.0).unwrap();
                    *t &= !bit;
                    if *t == 0 {
                        want.remove(&pod.0);
                    }
                }
                forms.insert(form(&holders));
                let set = holders.view();
                assert_eq!(as_map(set), want, "{seed} {step}");
                assert_eq!(set.len(), want.len());
                let probe = id(rnd(span));
                assert_eq!(
                    set.get(probe).map(|t| t.0),
                    want.get(&probe.0).copied(),
                    "{seed} {step}"
                );
                let base = rnd(span * stride / 64 + 1) as u32;
                let mut marked = [0u64; 2];
                set.mark(base, &mut marked);
                let mut expect = [0u64; 2];
                for &p in want.keys() {
                    let off = p.wrapping_sub(base * 64) as usize;
                    if off < 128 {
                        expect[off / 64] |= 1 << (off % 64);
                    }
                }
                assert_eq!(marked, expect, "{seed} {step} base {base}");
            }
            // Packed ids go dense and back; spread out, they never do.
            let want_forms = if stride == 1 { 3 } else { 2 };
            assert_eq!(forms.contains("dense"), stride == 1, "{seed}: {forms:?}");
            assert_eq!(forms.len(), want_forms, "{seed}: {forms:?}");
        }
    }

    #[test]
    fn a_fleet_holding_a_key_takes_a_word_per_64_pods() {
        let mut holders = Holders::one(PodId(0), Tier::Gpu);
        for pod in 1..128 {
            holders.add(PodId(pod), Tier::Gpu);
        }
        holders.add(PodId(5), Tier::Cpu);
        let Holders::Dense { words, .. } = &holders else {
            panic!("{}", form(&holders));
        };
        assert_eq!(words.len(), 2);
        assert_eq!(holders.view().get(PodId(5)), Some(TierMask(0b011)));
        // Thinned out, it is a list again.
        for pod in 0..126 {
            holders.remove(PodId(pod), Tier::Gpu);
        }
        assert_eq!(form(&holders), "spilled");
        assert_eq!(
            as_map(holders.view()),
            BTreeMap::from([(5, 0b010), (126, 1), (127, 1)])
        );
        // Two holders: back in the slot.
        holders.remove(PodId(126), Tier::Gpu);
        assert_eq!(form(&holders), "inline");
        assert_eq!(
            as_map(holders.view()),
            BTreeMap::from([(5, 0b010), (127, 1)])
        );
    }

    /// Bits for a key a packed fleet holds; then holders one per word of
    /// ids, far apart: the bits turn back into a list before they cost
    /// more than `SPARSE_PER_WORD` holders' worth per word.
    #[test]
    fn holders_far_apart_turn_bits_back_into_a_list() {
        let mut holders = Holders::one(PodId(0), Tier::Gpu);
        for pod in 1..64 {
            holders.add(PodId(pod), Tier::Gpu);
        }
        assert_eq!(form(&holders), "dense");
        let mut added = 0;
        while form(&holders) == "dense" && added < 100 {
            added += 1;
            holders.add(PodId(64 * (1 + added)), Tier::Gpu);
        }
        // 64 + n holders over 1 + n words: below 4 per word from n = 21.
        assert_eq!(added, 21, "{}", form(&holders));
        assert_eq!(holders.view().len(), 64 + 21);
    }

    /// Bits spanning many words, then thinned within one word that never
    /// drops below `SPARSE_PER_WORD`: the removals themselves turn them
    /// back into a list (they were checked only when a word ran thin).
    #[test]
    fn thinned_bits_turn_back_into_a_list_whichever_word_thins() {
        let mut holders = Holders::one(PodId(0), Tier::Gpu);
        for pod in (1..64).chain((1..16).map(|w| w * 64)) {
            holders.add(PodId(pod), Tier::Gpu);
        }
        let Holders::Dense { words, .. } = &holders else {
            panic!("{}", form(&holders));
        };
        assert_eq!(words.len(), 16);
        for pod in 4..64 {
            holders.remove(PodId(pod), Tier::Gpu);
        }
        assert_eq!(form(&holders), "spilled");
        assert_eq!(holders.view().len(), 4 + 15);
    }

    #[test]
    fn a_slot_is_three_words_with_three_holders_inline() {
        assert_eq!(std::mem::size_of::<(u64, Holders)>(), 24);
    }
}

//! One pod's prefix cache: vLLM 0.33's `KVCacheManager` over one
//! full-attention group with prefix caching on (`kv_cache_manager.py`,
//! `single_type_kv_cache_manager.py`, `block_pool.py`,
//! `kv_cache_utils.py`), call for call, so the simulator's hits are vLLM's:
//!
//! - a pool of `capacity` usable blocks (vLLM has one more, its null
//!   block) and a free queue (`FreeKVCacheBlockQueue`) that starts in
//!   block-id order and hands out blocks from its head;
//! - [`PodCache::computed`] is `get_computed_blocks`: the first-miss walk
//!   over a request's block hashes, capped at `num_tokens - 1` tokens (the
//!   last token is always recomputed for its logits);
//! - [`PodCache::allocate`] is `allocate_slots`: refuse unless the blocks
//!   fit (with `full_sequence_must_fit`, the scheduler's admission gate,
//!   the whole sequence must), touch the hit blocks (out of the free queue
//!   if nobody held them), take new blocks from the queue's head (evicting
//!   a cached one: `BlockRemoved`), then cache every full block computed
//!   by the end of the step (one `BlockStored`, chained to its parent);
//! - [`PodCache::free`] is `free`: the request's blocks in reverse, those
//!   with a hash to the free queue's tail (evicted last, LRU), those
//!   without one (a partial last block) to its head, reused first ("LIFO
//!   reuse of non-cached blocks", `BlockPool.free_blocks`).
//!
//! The request's tokens and how many of them are computed belong to the
//! scheduler (`serving.rs`), as they belong to vLLM's `Request`; this file
//! owns only blocks. `op_log` drives a pod from an op log, as
//! `tests/fixtures/simulator/vllm_answers.py` drives vLLM's own class.

use std::collections::HashMap;

use indexer::keys;

/// The end of a list in `FreeQueue`.
const NIL: u32 = u32::MAX;

/// vLLM's `FreeKVCacheBlockQueue`: a doubly linked list threaded through
/// the blocks, so removing a hit block from the middle is O(1).
struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// Every block free, in id order, as vLLM starts.
    fn new(blocks: usize) -> FreeQueue {
        let mut q = FreeQueue {
            prev: vec![NIL; blocks],
            next: vec![NIL; blocks],
            queued: vec![false; blocks],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in 0..blocks as u32 {
            q.append(id);
        }
        q
    }

    fn link(&mut self, id: u32, prev: u32, next: u32) {
        debug_assert!(!self.queued[id as usize]);
        self.prev[id as usize] = prev;
        self.next[id as usize] = next;
        match prev {
            NIL => self.head = id,
            p => self.next[p as usize] = id,
        }
        match next {
            NIL => self.tail = id,
            n => self.prev[n as usize] = id,
        }
        self.queued[id as usize] = true;
        self.len += 1;
    }

    fn append(&mut self, id: u32) {
        self.link(id, self.tail, NIL);
    }

    /// `prepend_n`: `ids` go to the front, keeping their order.
    fn prepend(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            self.link(id, NIL, self.head);
        }
    }

    fn remove(&mut self, id: u32) {
        debug_assert!(self.queued[id as usize]);
        let (p, n) = (self.prev[id as usize], self.next[id as usize]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.queued[id as usize] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.remove(id);
        Some(id)
    }
}

#[derive(Clone, Copy, Default)]
struct Block {
    ref_cnt: u32,
    /// Set once the block is full and cached; cleared when it is evicted.
    hash: Option<u64>,
}

/// What a pod tells its index: vLLM's `BlockStored` / `BlockRemoved`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Removed {
        hash: u64,
    },
}

/// A request as the cache sees it: its tokens and the hashes of their full
/// blocks (vLLM's `Request.all_token_ids` and `block_hashes`).
#[derive(Clone, Debug, Default)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    pub hashes: Vec<u64>,
}

impl Sequence {
    pub fn new(tokens: Vec<u32>, hashes: Vec<u64>) -> Sequence {
        Sequence { tokens, hashes }
    }

    /// `append_output_token_ids`: the tokens, and the hash of every block
    /// they fill (chained from `root_seed`).
    pub fn append(&mut self, tokens: &[u32], block_size: usize, root_seed: u64) {
        self.tokens.extend_from_slice(tokens);
        // The chain goes on from the last full block.
        let prev = self.hashes.last().copied().unwrap_or(root_seed);
        let unhashed = &self.tokens[self.hashes.len() * block_size..];
        let more = keys::prompt_keys(prev, unhashed, block_size);
        self.hashes.extend(more.into_iter().map(|k| k.0));
    }
}

/// The blocks a request holds (`req_to_blocks`, `num_cached_block`).
#[derive(Default)]
struct Held {
    blocks: Vec<u32>,
    /// Leading blocks already cached.
    cached: usize,
}

/// Why a request can never be admitted by this pod.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("needs {needed} blocks, the pod has {capacity}")]
pub struct TooLarge {
    pub needed: usize,
    pub capacity: usize,
}

/// One call of `allocate_slots`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Tokens of the request already computed (`num_computed_tokens`).
    pub computed: usize,
    /// Tokens to compute in this step (`num_new_tokens`).
    pub new_tokens: usize,
    /// Leading blocks found cached just now (`new_computed_blocks`, from
    /// [`PodCache::computed`]); 0 for a running request.
    pub hit_blocks: usize,
    /// `full_sequence_must_fit`: the whole sequence must fit, not only
    /// this step's tokens (the scheduler admits with it).
    pub whole_sequence: bool,
}

pub struct PodCache {
    block_size: usize,
    blocks: Vec<Block>,
    free: FreeQueue,
    /// Hash -> cached blocks holding it, first cached first (vLLM's
    /// `BlockHashToBlockMap`; a lookup takes the first).
    cached: HashMap<u64, Vec<u32>>,
    held: HashMap<u32, Held>,
    events: Vec<CacheEvent>,
}

impl PodCache {
    pub fn new(capacity: usize, block_size: usize) -> PodCache {
        PodCache {
            block_size,
            blocks: vec![Block::default(); capacity],
            free: FreeQueue::new(capacity),
            cached: HashMap::new(),
            held: HashMap::new(),
            events: Vec::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// vLLM's `get_usage`: the share of blocks not in the free queue.
    pub fn usage(&self) -> f64 {
        match self.capacity() {
            0 => 0.0,
            c => 1.0 - self.free.len as f64 / c as f64,
        }
    }

    /// Leading blocks of `hashes` cached here (the first-miss walk, uncapped).
    pub fn holds(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// `get_computed_blocks`: the leading cached blocks of `seq`, capped so
    /// that at least its last token is computed.
    pub fn computed(&self, seq: &Sequence) -> usize {
        let cap = seq.tokens.len().saturating_sub(1) / self.block_size;
        self.holds(&seq.hashes[..cap.min(seq.hashes.len())])
    }

    /// Blocks that hold `tokens` tokens.
    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Whether a sequence of `tokens` tokens could ever fit this pod, even
    /// empty.
    pub fn check_fits(&self, tokens: usize) -> Result<(), TooLarge> {
        let needed = self.blocks_for(tokens);
        if needed > self.capacity() {
            return Err(TooLarge {
                needed,
                capacity: self.capacity(),
            });
        }
        Ok(())
    }

    /// `get_num_blocks_to_allocate` for `tokens` slots: the blocks the
    /// request lacks, plus the hit blocks that must leave the free queue.
    fn to_allocate(&self, id: u32, tokens: usize, hit: &[u32]) -> usize {
        let have = self.held.get(&id).map_or(0, |h| h.blocks.len());
        let evictable = hit
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count();
        self.blocks_for(tokens).saturating_sub(have + hit.len()) + evictable
    }

    /// `allocate_slots`: `false` if the blocks do not fit, and then nothing
    /// changed.
    pub fn allocate(&mut self, id: u32, seq: &Sequence, a: Allocation) -> bool {
        let hit: Vec<u32> = seq.hashes[..a.hit_blocks]
            .iter()
            .map(|h| self.cached[h][0])
            .collect();
        let computed = a.computed + a.hit_blocks * self.block_size;
        if a.whole_sequence && self.to_allocate(id, seq.tokens.len(), &hit) > self.free.len {
            return false;
        }
        let slots = computed + a.new_tokens;
        if self.to_allocate(id, slots, &hit) > self.free.len {
            return false;
        }
        for &b in &hit {
            if self.blocks[b as usize].ref_cnt == 0 {
                self.free.remove(b);
            }
            self.blocks[b as usize].ref_cnt += 1;
        }
        let mut held = self.held.remove(&id).unwrap_or_default();
        if !hit.is_empty() {
            held.blocks.extend(&hit);
            held.cached = held.blocks.len();
        }
        while held.blocks.len() < self.blocks_for(slots) {
            held.blocks.push(self.new_block());
        }
        let full = (slots.min(seq.tokens.len()) / self.block_size).min(seq.hashes.len());
        self.cache_full_blocks(&mut held, seq, full);
        self.held.insert(id, held);
        true
    }

    /// `free`: the request's blocks, tail first; cached ones to the free
    /// queue's tail, the others to its head.
    pub fn free(&mut self, id: u32) {
        let Some(held) = self.held.remove(&id) else {
            return;
        };
        let mut first = Vec::new();
        for &b in held.blocks.iter().rev() {
            let block = &mut self.blocks[b as usize];
            block.ref_cnt -= 1;
            if block.ref_cnt == 0 {
                match block.hash {
                    None => first.push(b),
                    Some(_) => self.free.append(b),
                }
            }
        }
        self.free.prepend(&first);
    }

    /// The events since the last call, in the order vLLM queues them.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// The free queue's head, evicted if it was cached (vLLM's
    /// `get_new_blocks` + `_maybe_evict_cached_block`). Callers checked
    /// that the queue holds enough blocks.
    fn new_block(&mut self) -> u32 {
        let id = self
            .free
            .pop_front()
            .expect("allocate checked the free blocks");
        let block = &mut self.blocks[id as usize];
        if let Some(hash) = block.hash.take() {
            if let Some(ids) = self.cached.get_mut(&hash) {
                ids.retain(|&b| b != id);
                if ids.is_empty() {
                    self.cached.remove(&hash);
                }
            }
            self.events.push(CacheEvent::Removed { hash });
        }
        block.ref_cnt = 1;
        id
    }

    /// vLLM's `cache_full_blocks`: every block past `held.cached` up to
    /// `full` gets its hash and enters the map; one `BlockStored` names them.
    fn cache_full_blocks(&mut self, held: &mut Held, seq: &Sequence, full: usize) {
        if held.cached >= full {
            return;
        }
        for i in held.cached..full {
            let b = held.blocks[i];
            self.blocks[b as usize].hash = Some(seq.hashes[i]);
            self.cached.entry(seq.hashes[i]).or_default().push(b);
        }
        let bs = self.block_size;
        self.events.push(CacheEvent::Stored {
            hashes: seq.hashes[held.cached..full].to_vec(),
            parent: held.cached.checked_sub(1).map(|i| seq.hashes[i]),
            tokens: seq.tokens[held.cached * bs..full * bs].to_vec(),
        });
        held.cached = full;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: usize = 4;
    const SEED: u64 = 7;

    /// `blocks` full blocks of distinct tokens, starting at token `from`,
    /// plus `extra` tokens.
    fn seq(from: u32, blocks: usize, extra: usize) -> Sequence {
        let mut s = Sequence::default();
        let tokens: Vec<u32> = (from..from + (blocks * B + extra) as u32).collect();
        s.append(&tokens, B, SEED);
        s
    }

    /// Admits `s` whole, as the scheduler does with a budget to spare.
    fn admit(p: &mut PodCache, id: u32, s: &Sequence) -> Option<usize> {
        let hit = p.computed(s);
        let a = Allocation {
            computed: 0,
            new_tokens: s.tokens.len() - hit * B,
            hit_blocks: hit,
            whole_sequence: true,
        };
        p.allocate(id, s, a).then_some(hit)
    }

    fn removed(events: &[CacheEvent]) -> Vec<u64> {
        events
            .iter()
            .filter_map(|e| match e {
                CacheEvent::Removed { hash } => Some(*hash),
                CacheEvent::Stored { .. } => None,
            })
            .collect()
    }

    #[test]
    fn a_finished_requests_blocks_stay_hit_able_in_the_free_queue() {
        let mut p = PodCache::new(8, B);
        let a = seq(0, 3, 0);
        assert_eq!(admit(&mut p, 1, &a), Some(0));
        p.free(1);
        // Same prompt plus one token: all three blocks hit.
        let mut again = a.clone();
        again.append(&[99], B, SEED);
        assert_eq!(admit(&mut p, 2, &again), Some(3));
    }

    #[test]
    fn a_fully_cached_prompt_recomputes_its_last_block_in_a_duplicate() {
        let mut p = PodCache::new(8, B);
        let a = seq(0, 2, 0);
        admit(&mut p, 1, &a).unwrap();
        p.free(1);
        p.take_events();
        // Both blocks are held, but the hit is capped at len - 1 tokens.
        assert_eq!(p.holds(&a.hashes), 2);
        assert_eq!(admit(&mut p, 2, &a), Some(1));
        assert_eq!(
            p.take_events(),
            vec![CacheEvent::Stored {
                hashes: vec![a.hashes[1]],
                parent: Some(a.hashes[0]),
                tokens: a.tokens[4..].to_vec(),
            }]
        );
        assert_eq!(p.cached[&a.hashes[1]].len(), 2);
    }

    #[test]
    fn eviction_takes_the_least_recently_freed_block_tail_first() {
        let mut p = PodCache::new(4, B);
        let (a, b) = (seq(0, 2, 0), seq(100, 2, 0));
        admit(&mut p, 1, &a).unwrap();
        admit(&mut p, 2, &b).unwrap();
        p.free(1);
        p.free(2);
        p.take_events();
        // Free queue now: a1 a0 b1 b0 (each request's tail first).
        admit(&mut p, 3, &seq(200, 1, 0)).unwrap();
        assert_eq!(removed(&p.take_events()), vec![a.hashes[1]]);
        admit(&mut p, 4, &seq(300, 2, 0)).unwrap();
        assert_eq!(removed(&p.take_events()), vec![a.hashes[0], b.hashes[1]]);
        assert_eq!(p.holds(&b.hashes), 1);
        assert_eq!(p.holds(&a.hashes), 0);
    }

    #[test]
    fn a_partial_block_is_freed_to_the_head_and_reused_before_any_cached_one() {
        let mut p = PodCache::new(4, B);
        let b = seq(100, 1, 0);
        // Two full blocks and a partial third.
        let a = seq(0, 2, 1);
        admit(&mut p, 1, &b).unwrap();
        admit(&mut p, 2, &a).unwrap();
        p.free(1);
        p.free(2);
        p.take_events();
        // Free queue: [a's partial block] b0 a1 a0. A one-block request
        // takes the partial block back and evicts nothing (appended to the
        // tail, the partial block would come after b0, which it would evict).
        admit(&mut p, 3, &seq(200, 0, 3)).unwrap();
        assert_eq!(removed(&p.take_events()), Vec::<u64>::new());
        assert_eq!(p.holds(&b.hashes), 1);
        admit(&mut p, 4, &seq(300, 0, 3)).unwrap();
        assert_eq!(removed(&p.take_events()), vec![b.hashes[0]]);
    }

    #[test]
    fn a_hit_takes_its_block_back_out_of_the_free_queue() {
        let mut p = PodCache::new(4, B);
        let a = seq(0, 2, 0);
        admit(&mut p, 1, &a).unwrap();
        p.free(1);
        // a's first block is hit and leaves the free queue, so the three
        // new blocks come from the two never-used ones and a's tail.
        let mut x = Sequence::default();
        let mut tokens = a.tokens[..B].to_vec();
        tokens.extend(100..108);
        tokens.push(1);
        x.append(&tokens, B, SEED);
        assert_eq!(admit(&mut p, 2, &x), Some(1));
        assert_eq!(removed(&p.take_events()), vec![a.hashes[1]]);
        assert_eq!(p.holds(&a.hashes), 1);
        assert_eq!(p.usage(), 1.0);
    }

    #[test]
    fn admission_needs_room_for_the_whole_sequence_a_chunk_only_its_own() {
        let mut p = PodCache::new(4, B);
        let big = seq(0, 3, 0);
        let a = Allocation {
            computed: 0,
            new_tokens: 4,
            hit_blocks: 0,
            whole_sequence: true,
        };
        admit(&mut p, 1, &seq(100, 2, 0)).unwrap();
        // 3 blocks, 2 free: the first chunk alone would fit.
        assert!(!p.allocate(2, &big, a));
        assert!(p.allocate(
            2,
            &big,
            Allocation {
                whole_sequence: false,
                ..a
            }
        ));
        assert_eq!(
            p.check_fits(17),
            Err(TooLarge {
                needed: 5,
                capacity: 4
            })
        );
    }

    #[test]
    fn decode_blocks_are_cached_once_full() {
        let mut p = PodCache::new(4, B);
        let mut a = seq(0, 1, 0);
        admit(&mut p, 1, &a).unwrap();
        p.take_events();
        for (computed, t) in (4..).zip(900..905) {
            a.append(&[t], B, SEED);
            let alloc = Allocation {
                computed,
                new_tokens: 1,
                hit_blocks: 0,
                whole_sequence: false,
            };
            assert!(p.allocate(1, &a, alloc));
        }
        assert_eq!(
            p.take_events(),
            vec![CacheEvent::Stored {
                hashes: vec![a.hashes[1]],
                parent: Some(a.hashes[0]),
                tokens: (900..904).collect(),
            }]
        );
    }
}

//! One pod's prefix cache, kept the way vLLM's v1 `KVCacheManager` and
//! `BlockPool` keep it (`vllm/v1/core/kv_cache_manager.py`, `block_pool.py`,
//! `kv_cache_utils.py`), so the simulator's hit counts are vLLM's:
//!
//! - a pool of `capacity` physical blocks; a free queue (vLLM's
//!   `FreeKVCacheBlockQueue`) that starts in block-id order, takes freed
//!   blocks at its tail and gives new blocks from its head;
//! - a block that fills up gets its chained hash and enters the hash map;
//!   it stays there, still hit-able, while it sits in the free queue, and
//!   leaves only when the head of the queue hands it out again (eviction:
//!   one `BlockRemoved`);
//! - a prompt's cached prefix is the first-miss walk over its block hashes;
//!   vLLM caps the hit at `len - 1` tokens (the last token is always
//!   recomputed for its logits), which can leave a whole cached block to be
//!   recomputed in a new block with the same hash (vLLM does not
//!   de-duplicate, and neither do we);
//! - hit blocks are touched first (taken out of the free queue if nobody
//!   held them), then new blocks are allocated, then every full block not
//!   yet cached is cached (one `BlockStored`, chained to its parent);
//! - a finished request frees its blocks tail first, so its last block is
//!   the first of them to be evicted.
//!
//! What is *not* vLLM: a request is admitted only when its prompt *and* the
//! decode blocks it will need fit (vLLM admits on the prompt and preempts
//! later); the reservation is bookkeeping only and touches no block, so the
//! cache operations stay exactly the ones vLLM would run in this order.

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

    fn append(&mut self, id: u32) {
        debug_assert!(!self.queued[id as usize]);
        self.prev[id as usize] = self.tail;
        self.next[id as usize] = NIL;
        match self.tail {
            NIL => self.head = id,
            t => self.next[t as usize] = id,
        }
        self.tail = id;
        self.queued[id as usize] = true;
        self.len += 1;
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

struct Running {
    name: String,
    tokens: Vec<u32>,
    /// Hashes of every full block of `tokens`.
    hashes: Vec<u64>,
    blocks: Vec<u32>,
    /// Leading blocks already cached (vLLM's `num_cached_block`).
    cached: usize,
    /// Blocks set aside for the decode still to come.
    reserved: usize,
}

/// The outcome of an admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Leading full blocks the pod held just before, uncapped.
    pub hit_blocks: usize,
    /// Prompt tokens served from the cache (vLLM's capped hit).
    pub cached_tokens: usize,
}

/// Why a request can never be admitted by this pod.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("needs {needed} blocks, the pod has {capacity}")]
pub struct TooLarge {
    pub needed: usize,
    pub capacity: usize,
}

pub struct PodCache {
    block_size: usize,
    /// Where every hash chain starts (the model's root seed).
    root_seed: u64,
    blocks: Vec<Block>,
    free: FreeQueue,
    /// Hash -> cached blocks holding it, first cached first (vLLM's
    /// `BlockHashToBlockMap`; a lookup takes the first).
    cached: HashMap<u64, Vec<u32>>,
    running: HashMap<u32, Running>,
    /// Sum of the running requests' `reserved`.
    reserved: usize,
    events: Vec<CacheEvent>,
    /// The op log (JSONL without the pod name), when asked for.
    ops: Option<Vec<OpLine>>,
}

/// One line of the op log; `report` adds the pod's name.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpLine {
    Admit {
        req: String,
        token_ids: Vec<u32>,
        hit_blocks: usize,
    },
    Extend {
        req: String,
        token_ids: Vec<u32>,
    },
    Finish {
        req: String,
    },
}

impl PodCache {
    pub fn new(capacity: usize, block_size: usize, root_seed: u64, log_ops: bool) -> PodCache {
        PodCache {
            block_size,
            root_seed,
            blocks: vec![Block::default(); capacity],
            free: FreeQueue::new(capacity),
            cached: HashMap::new(),
            running: HashMap::new(),
            reserved: 0,
            events: Vec::new(),
            ops: log_ops.then(Vec::new),
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

    /// The chained hashes of every full block of `tokens`.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        keys::prompt_keys(self.root_seed, tokens, self.block_size)
            .into_iter()
            .map(|k| k.0)
            .collect()
    }

    /// Leading blocks of `hashes` cached here (the first-miss walk, uncapped).
    pub fn holds(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Blocks that hold `tokens` tokens.
    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Whether the request could ever fit this pod, even empty.
    pub fn check_fits(&self, prompt: usize, decode: usize) -> Result<(), TooLarge> {
        let needed = self.blocks_for(prompt + decode);
        if needed > self.capacity() {
            return Err(TooLarge {
                needed,
                capacity: self.capacity(),
            });
        }
        Ok(())
    }

    /// Looks `tokens` (whose full blocks hash to `hashes`, see
    /// [`PodCache::block_hashes`]) up and, if it fits with `decode` more
    /// tokens to come, allocates and caches its blocks as vLLM's
    /// `get_computed_blocks` + `allocate_slots` do. `None`: it does not fit
    /// now, and nothing changed.
    pub fn admit(
        &mut self,
        id: u32,
        name: &str,
        tokens: &[u32],
        hashes: &[u64],
        decode: usize,
    ) -> Option<Admission> {
        debug_assert_eq!(hashes.len(), tokens.len() / self.block_size);
        let hit_blocks = self.holds(hashes);
        // The last prompt token is recomputed for its logits.
        let capped = hit_blocks.min(tokens.len().saturating_sub(1) / self.block_size);
        let hit: Vec<u32> = hashes[..capped].iter().map(|h| self.cached[h][0]).collect();
        let required = self.blocks_for(tokens.len());
        let new = required - capped;
        // Hit blocks in the free queue leave it when touched.
        let evictable = hit
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count();
        let reserve = self.blocks_for(tokens.len() + decode) - required;
        if new + evictable + reserve + self.reserved > self.free.len {
            return None;
        }
        for &b in &hit {
            if self.blocks[b as usize].ref_cnt == 0 {
                self.free.remove(b);
            }
            self.blocks[b as usize].ref_cnt += 1;
        }
        let mut blocks = hit;
        for _ in 0..new {
            blocks.push(self.new_block());
        }
        let mut req = Running {
            name: name.to_owned(),
            tokens: tokens.to_vec(),
            hashes: hashes.to_vec(),
            blocks,
            cached: capped,
            reserved: reserve,
        };
        self.reserved += reserve;
        self.cache_full_blocks(&mut req);
        if let Some(ops) = &mut self.ops {
            ops.push(OpLine::Admit {
                req: name.to_owned(),
                token_ids: tokens.to_vec(),
                hit_blocks,
            });
        }
        self.running.insert(id, req);
        Some(Admission {
            hit_blocks,
            cached_tokens: capped * self.block_size,
        })
    }

    /// Appends generated tokens to a running request: blocks for them come
    /// out of its reservation, and every block then full is cached, as vLLM
    /// caches decode blocks.
    pub fn extend(&mut self, id: u32, tokens: &[u32]) {
        let Some(mut req) = self.running.remove(&id) else {
            return;
        };
        if let Some(ops) = &mut self.ops {
            ops.push(OpLine::Extend {
                req: req.name.clone(),
                token_ids: tokens.to_vec(),
            });
        }
        let full_before = req.hashes.len();
        req.tokens.extend_from_slice(tokens);
        let mut prev = req.hashes.last().copied().unwrap_or(self.root_seed);
        for block in req.tokens[full_before * self.block_size..].chunks_exact(self.block_size) {
            prev = keys::chain(prev, block).0;
            req.hashes.push(prev);
        }
        let required = self.blocks_for(req.tokens.len());
        while req.blocks.len() < required {
            let taken = req.reserved.min(1);
            req.reserved -= taken;
            self.reserved -= taken;
            req.blocks.push(self.new_block());
        }
        self.cache_full_blocks(&mut req);
        self.running.insert(id, req);
    }

    /// Frees a request's blocks, tail first (vLLM's `free`).
    pub fn finish(&mut self, id: u32) {
        let Some(req) = self.running.remove(&id) else {
            return;
        };
        if let Some(ops) = &mut self.ops {
            ops.push(OpLine::Finish { req: req.name });
        }
        self.reserved -= req.reserved;
        for &b in req.blocks.iter().rev() {
            let block = &mut self.blocks[b as usize];
            block.ref_cnt -= 1;
            if block.ref_cnt == 0 {
                self.free.append(b);
            }
        }
    }

    /// The events since the last call, in the order vLLM queues them.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// The op log so far, emptied.
    pub fn take_ops(&mut self) -> Vec<OpLine> {
        self.ops.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The free queue's head, evicted if it was cached (vLLM's
    /// `get_new_blocks` + `_maybe_evict_cached_block`). Callers checked
    /// that the queue holds enough blocks.
    fn new_block(&mut self) -> u32 {
        let id = self
            .free
            .pop_front()
            .expect("admission checked the free blocks");
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

    /// vLLM's `cache_full_blocks`: every full block past `req.cached` gets
    /// its hash and enters the map; one `BlockStored` names them all.
    fn cache_full_blocks(&mut self, req: &mut Running) {
        let full = req.tokens.len() / self.block_size;
        if req.cached >= full {
            return;
        }
        for i in req.cached..full {
            let b = req.blocks[i];
            self.blocks[b as usize].hash = Some(req.hashes[i]);
            self.cached.entry(req.hashes[i]).or_default().push(b);
        }
        self.events.push(CacheEvent::Stored {
            hashes: req.hashes[req.cached..full].to_vec(),
            parent: req.cached.checked_sub(1).map(|i| req.hashes[i]),
            tokens: req.tokens[req.cached * self.block_size..full * self.block_size].to_vec(),
        });
        req.cached = full;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: usize = 4;

    fn pod(capacity: usize) -> PodCache {
        PodCache::new(capacity, B, 7, true)
    }

    impl PodCache {
        fn put(&mut self, id: u32, tokens: &[u32], decode: usize) -> Option<Admission> {
            let hashes = self.block_hashes(tokens);
            self.admit(id, &format!("r{id}"), tokens, &hashes, decode)
        }
    }

    /// `blocks` full blocks of distinct tokens, starting at token `from`.
    fn prompt(from: u32, blocks: usize) -> Vec<u32> {
        (from..from + (blocks * B) as u32).collect()
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
        let mut p = pod(8);
        let a = prompt(0, 3);
        let first = p.put(1, &a, 0).unwrap();
        assert_eq!(first.hit_blocks, 0);
        p.finish(1);
        // Same prompt plus one token: all three blocks hit, none capped.
        let mut again = a.clone();
        again.push(99);
        let second = p.put(2, &again, 0).unwrap();
        assert_eq!(second.hit_blocks, 3);
        assert_eq!(second.cached_tokens, 12);
    }

    #[test]
    fn a_fully_cached_prompt_recomputes_its_last_block_in_a_duplicate() {
        let mut p = pod(8);
        let a = prompt(0, 2);
        p.put(1, &a, 0).unwrap();
        p.finish(1);
        p.take_events();
        let hit = p.put(2, &a, 0).unwrap();
        // Both blocks are held, but vLLM caps the hit at len - 1 tokens.
        assert_eq!(hit.hit_blocks, 2);
        assert_eq!(hit.cached_tokens, 4);
        let hashes = p.block_hashes(&a);
        assert_eq!(
            p.take_events(),
            vec![CacheEvent::Stored {
                hashes: vec![hashes[1]],
                parent: Some(hashes[0]),
                tokens: a[4..].to_vec(),
            }]
        );
        assert_eq!(p.cached[&hashes[1]].len(), 2);
    }

    #[test]
    fn eviction_takes_the_least_recently_freed_block_tail_first() {
        let mut p = pod(4);
        let a = prompt(0, 2);
        let b = prompt(100, 2);
        p.put(1, &a, 0).unwrap();
        p.put(2, &b, 0).unwrap();
        p.finish(1);
        p.finish(2);
        p.take_events();
        let (ha, hb) = (p.block_hashes(&a), p.block_hashes(&b));
        // Free queue now: a1 a0 b1 b0 (each request's tail first).
        p.put(3, &prompt(200, 1), 0).unwrap();
        assert_eq!(removed(&p.take_events()), vec![ha[1]]);
        p.put(4, &prompt(300, 2), 0).unwrap();
        assert_eq!(removed(&p.take_events()), vec![ha[0], hb[1]]);
        assert_eq!(p.holds(&hb), 1);
        assert_eq!(p.holds(&ha), 0);
    }

    #[test]
    fn a_hit_takes_its_block_back_out_of_the_free_queue() {
        let mut p = pod(4);
        let a = prompt(0, 2);
        p.put(1, &a, 0).unwrap();
        p.finish(1);
        // a's first block is hit and leaves the free queue, so the three
        // new blocks come from the two never-used ones and a's tail.
        let mut x = a[..B].to_vec();
        x.extend(prompt(500, 2));
        x.push(1);
        let ha = p.block_hashes(&a);
        let hit = p.put(2, &x, 0).unwrap();
        assert_eq!(hit.hit_blocks, 1);
        assert_eq!(removed(&p.take_events()), vec![ha[1]]);
        assert_eq!(p.holds(&ha), 1);
        assert_eq!(p.usage(), 1.0);
    }

    #[test]
    fn a_request_waits_while_running_ones_hold_the_pool() {
        let mut p = pod(4);
        p.put(1, &prompt(0, 3), 0).unwrap();
        assert_eq!(p.put(2, &prompt(100, 2), 0), None);
        // Nothing changed: no event, no op.
        assert_eq!(p.take_ops().len(), 1);
        p.finish(1);
        assert!(p.put(2, &prompt(100, 2), 0).is_some());
        assert_eq!(
            p.check_fits(17, 0),
            Err(TooLarge {
                needed: 5,
                capacity: 4
            })
        );
    }

    #[test]
    fn decode_blocks_are_reserved_at_admission_and_cached_when_full() {
        let mut p = pod(4);
        let a = prompt(0, 1);
        // 4 prompt tokens + 5 decode tokens = 3 blocks.
        p.put(1, &a, 5).unwrap();
        assert_eq!(p.put(2, &prompt(100, 2), 0), None);
        p.take_events();
        let out: Vec<u32> = (900..905).collect();
        p.extend(1, &out);
        let mut all = a.clone();
        all.extend(&out);
        let h = p.block_hashes(&all);
        assert_eq!(h.len(), 2);
        assert_eq!(
            p.take_events(),
            vec![CacheEvent::Stored {
                hashes: vec![h[1]],
                parent: Some(h[0]),
                tokens: out[..4].to_vec(),
            }]
        );
        p.finish(1);
        let mut next = all.clone();
        next.push(7);
        assert_eq!(p.put(3, &next, 0).unwrap().hit_blocks, 2);
    }
}

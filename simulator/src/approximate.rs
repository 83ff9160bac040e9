//! The approximate producer llm-d's EPP uses by default: no events at all,
//! only a record of where requests were sent.
//!
//! Its rules, kept here until the routing-feedback issue (#18) gives the
//! service an approximate mode to share them with: the prompt is chunked
//! into 256-byte blocks (text as UTF-8; token ids as 4-byte pseudo-tokens,
//! 64 per block), the partial tail kept as a block of its own; block hashes
//! are chained from a seed over the model name; a pod's score is found by
//! walking the blocks and counting, per pod, those it was sent, stopping at
//! the first block no pod was sent (the global break, not a per-pod one);
//! after the pick every block of the prompt is written to that pod's LRU,
//! which is bounded per pod.

use std::collections::{HashMap, VecDeque};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Bytes per block: 64 pseudo-tokens of 4 bytes.
pub const BLOCK_BYTES: usize = 256;
/// llm-d's `maxPrefixBlocksToMatch`.
pub const MAX_BLOCKS: usize = 256;

/// Blocks a pod remembers, least recently written evicted first.
struct Lru {
    /// Block -> the stamp of its latest write.
    stamp: HashMap<u64, u64>,
    /// Writes in order; entries whose stamp is stale are skipped.
    order: VecDeque<(u64, u64)>,
}

impl Lru {
    fn write(&mut self, block: u64, now: u64, capacity: usize) {
        self.stamp.insert(block, now);
        self.order.push_back((now, block));
        while self.stamp.len() > capacity {
            let Some((s, b)) = self.order.pop_front() else {
                break;
            };
            if self.stamp.get(&b) == Some(&s) {
                self.stamp.remove(&b);
            }
        }
        // Stale entries would otherwise grow the queue without bound.
        if self.order.len() > 2 * capacity.max(1024) {
            let stamp = &self.stamp;
            self.order.retain(|(s, b)| stamp.get(b) == Some(s));
        }
    }
}

pub struct Approximate {
    seed: u64,
    capacity: usize,
    pods: Vec<Lru>,
    writes: u64,
}

impl Approximate {
    /// `capacity` blocks per pod (llm-d's `lruCapacityPerServer`).
    pub fn new(model: &str, pods: usize, capacity: usize) -> Approximate {
        Approximate {
            seed: xxh3_64(model.as_bytes()),
            capacity,
            pods: (0..pods)
                .map(|_| Lru {
                    stamp: HashMap::new(),
                    order: VecDeque::new(),
                })
                .collect(),
            writes: 0,
        }
    }

    /// The chained hashes of a prompt's 256-byte blocks, the tail included.
    pub fn block_hashes(&self, text: Option<&str>, tokens: &[u32]) -> Vec<u64> {
        let bytes: Vec<u8> = match text {
            Some(t) => t.as_bytes().to_vec(),
            None => tokens.iter().flat_map(|t| t.to_le_bytes()).collect(),
        };
        let mut prev = self.seed;
        bytes
            .chunks(BLOCK_BYTES)
            .take(MAX_BLOCKS)
            .map(|chunk| {
                prev = xxh3_64_with_seed(chunk, prev);
                prev
            })
            .collect()
    }

    /// Per pod, the blocks counted before the global break.
    pub fn scores(&self, blocks: &[u64]) -> Vec<usize> {
        let mut counts = vec![0; self.pods.len()];
        for b in blocks {
            let mut anyone = false;
            for (p, lru) in self.pods.iter().enumerate() {
                if lru.stamp.contains_key(b) {
                    counts[p] += 1;
                    anyone = true;
                }
            }
            if !anyone {
                break;
            }
        }
        counts
    }

    /// Write after pick: `pod` was sent every block.
    pub fn record(&mut self, pod: usize, blocks: &[u64]) {
        for &b in blocks {
            self.writes += 1;
            self.pods[pod].write(b, self.writes, self.capacity);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_are_64_pseudo_tokens_a_block_and_the_tail_counts() {
        let a = Approximate::new("m", 2, 100);
        assert_eq!(a.block_hashes(None, &[1; 130]).len(), 3);
        assert_eq!(a.block_hashes(Some(&"x".repeat(256)), &[]).len(), 1);
        assert_ne!(
            a.block_hashes(None, &[1; 64]),
            Approximate::new("other", 2, 100).block_hashes(None, &[1; 64])
        );
    }

    #[test]
    fn the_walk_breaks_only_where_no_pod_was_sent_the_block() {
        let mut a = Approximate::new("m", 3, 100);
        let p: Vec<u32> = (0..64 * 4).collect();
        let h = a.block_hashes(None, &p);
        a.record(0, &h[..1]);
        a.record(1, &h[..3]);
        // Pod 0 misses block 1 but pod 1 has it: pod 0 keeps counting.
        a.record(0, &h[2..3]);
        assert_eq!(a.scores(&h), vec![2, 3, 0]);
    }

    #[test]
    fn each_pod_forgets_its_least_recently_written_blocks() {
        let mut a = Approximate::new("m", 1, 2);
        let h = a.block_hashes(None, &(0..64 * 3).collect::<Vec<u32>>());
        a.record(0, &h[..2]);
        a.record(0, &h[..1]);
        a.record(0, &h[2..]);
        assert_eq!(a.pods[0].stamp.len(), 2);
        assert!(a.pods[0].stamp.contains_key(&h[0]));
        assert!(!a.pods[0].stamp.contains_key(&h[1]));
    }
}

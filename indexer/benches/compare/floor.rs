//! The apply floor: what the trace's block operations cost when each one is
//! a single hash-map insert or remove and nothing else, measured beside the
//! indexers (pre-hashed only: it hashes nothing).
//!
//! Every indexer here does at least that much per block: a `BlockRemoved`
//! names a pod's blocks by engine hash alone, so something keyed by (pod,
//! hash) is touched for each of them, and a store must make it findable.
//! The floor is a per-pod `HashMap<engine hash, parent hash>` (the shape of
//! SMG's per-worker block map) with our key table's hasher. An indexer can
//! beat it only by touching fewer than one random slot per block (a radix
//! tree that stores a chain as one node) or by applying on several threads
//! (Dynamo's two event threads); a goal above it is out of reach for a
//! single writer that indexes block by block.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::hint::black_box;
use std::time::Instant;

use indexer::keys::KeyHasher;

use crate::trace::{Event, Trace};

type BlockMap = HashMap<u64, u64, BuildHasherDefault<KeyHasher>>;

/// One event of a pod's batch, engine hashes resolved beforehand (as every
/// indexer's input is built before its apply is timed).
enum Op {
    Store { parent: u64, hashes: Vec<u64> },
    Remove { hashes: Vec<u64> },
}

/// Stored + removed blocks per second, from empty maps, one thread.
pub fn apply_pass(trace: &Trace) -> f64 {
    let engine = |n: &u32| trace.nodes.engine[*n as usize];
    let batches: Vec<(usize, Vec<Op>)> = trace
        .batches
        .iter()
        .map(|b| {
            let ops = b
                .events
                .iter()
                .map(|e| match e {
                    Event::Stored { parent, nodes } => Op::Store {
                        parent: parent.as_ref().map_or(0, engine),
                        hashes: nodes.iter().map(engine).collect(),
                    },
                    Event::Removed { nodes } => Op::Remove {
                        hashes: nodes.iter().map(engine).collect(),
                    },
                })
                .collect();
            (b.pod as usize, ops)
        })
        .collect();
    let mut maps: Vec<BlockMap> = (0..trace.pods).map(|_| BlockMap::default()).collect();
    let t = Instant::now();
    apply_ops(&mut maps, &batches);
    let rate = trace.block_ops() as f64 / t.elapsed().as_secs_f64();
    black_box(&maps);
    rate
}

/// The timed part, on its own for `--profile-apply` with
/// `COMPARE_ONLY=floor` (callgrind: `--toggle-collect='compare::floor::apply_ops'`).
#[inline(never)]
fn apply_ops(maps: &mut [BlockMap], batches: &[(usize, Vec<Op>)]) {
    for (pod, ops) in batches {
        let map = &mut maps[*pod];
        for op in ops {
            match op {
                Op::Store { parent, hashes } => {
                    let mut parent = *parent;
                    for h in hashes {
                        map.insert(*h, parent);
                        parent = *h;
                    }
                }
                Op::Remove { hashes } => {
                    for h in hashes {
                        black_box(map.remove(h));
                    }
                }
            }
        }
    }
}

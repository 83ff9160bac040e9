//! The per-pod rules: counts, links and orphans, eviction order, tiers,
//! LoRA and salt keys, on hand-made and random histories.

use std::collections::HashMap;

use super::*;
use crate::event::ExtraKey;
use crate::keys::{prompt_keys, request_root_seed};
use crate::scheme::KeySchemes;

const BS: usize = 4;

impl PodState {
    /// Token-mode store, for brevity.
    fn store_t(&mut self, index: &BlockIndex, ev: &BlockStored, stats: &mut ApplyStats) {
        self.store(index, ev, &KeyMode::Token, stats)
    }
}

fn tokens(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

fn store(hashes: &[u64], parent: Option<u64>, toks: &[u32]) -> BlockStored {
    BlockStored {
        block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
        parent_block_hash: parent.map(EngineHash),
        token_ids: toks.to_vec(),
        block_size: Some(BS as u32),
        ..Default::default()
    }
}

/// Engine keys (SHA-256, vLLM's default seed, tagged extra keys).
fn engine_keys() -> KeyMode {
    let hasher = crate::engine_hash::EngineHasher::new(
        crate::engine_hash::HashAlgo::Sha256,
        crate::engine_hash::DEFAULT_SEED,
        crate::engine_hash::ExtraKeyStyle::Tagged,
    );
    KeySchemes::engine(hasher, false, 0).default
}

fn removed(hashes: &[u64]) -> BlockRemoved {
    BlockRemoved {
        block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
        ..Default::default()
    }
}

fn held_keys(index: &BlockIndex, keys: &[BlockKey], pod: PodId) -> usize {
    keys.iter()
        .take_while(|k| index.with_holders(**k, |h| h.get(pod).is_some()))
        .count()
}

#[test]
fn stored_blocks_match_request_keys_across_batches() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let t = tokens(12, 100);
    pod.store_t(&index, &store(&[1, 2], None, &t[..8]), &mut stats);
    pod.store_t(&index, &store(&[3], Some(2), &t[8..]), &mut stats);
    let keys = prompt_keys(request_root_seed("m", None, None), &t, BS);
    assert_eq!(held_keys(&index, &keys, PodId(0)), 3);
    assert_eq!(stats.stored_blocks, 3);
    assert_eq!(pod.block_size(), Some(BS as u32));
}

#[test]
fn double_store_needs_double_remove() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let t = tokens(4, 0);
    let keys = prompt_keys(request_root_seed("m", None, None), &t, BS);
    pod.store_t(&index, &store(&[1], None, &t), &mut stats);
    pod.store_t(&index, &store(&[1], None, &t), &mut stats);
    pod.remove(&index, &removed(&[1]), &mut stats);
    assert_eq!(held_keys(&index, &keys, PodId(0)), 1);
    pod.remove(&index, &removed(&[1]), &mut stats);
    assert_eq!(held_keys(&index, &keys, PodId(0)), 0);
    pod.remove(&index, &removed(&[1]), &mut stats);
    assert_eq!(stats.unknown_removals, 1);
    assert!(index.is_empty());
}

#[test]
fn eviction_drops_the_least_recently_stored_blocks_first() {
    // Every block a prompt start, so every one a leaf: plain store order.
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m").bounded();
    let mut stats = ApplyStats::default();
    for h in 1..=5u64 {
        pod.store_t(
            &index,
            &store(&[h], None, &tokens(4, h as u32 * 10)),
            &mut stats,
        );
    }
    // Re-storing 1 makes it the most recent.
    pod.store_t(&index, &store(&[1], None, &tokens(4, 10)), &mut stats);
    pod.remove(&index, &removed(&[3]), &mut stats);
    assert_eq!(pod.evict_oldest(&index, 2), 2); // 2 and 4 (3 is gone)
    let left: Vec<u64> = {
        let mut v: Vec<u64> = pod.by_hash.keys().map(|h| h.0).collect();
        v.sort_unstable();
        v
    };
    assert_eq!(left, vec![1, 5]);
    assert_eq!(index.len(), 2);
    assert_eq!(pod.held_per_tier(), [2, 0, 0]);
    // Many re-stores do not grow the order queue without bound.
    for _ in 0..1000 {
        pod.store_t(&index, &store(&[5], None, &tokens(4, 50)), &mut stats);
    }
    assert!(pod.order.len() <= 2 * pod.entries() + 64);
}

/// The eviction order names blocks by slot: a removed block's slot, taken
/// by a newer block, must not make the newer one look old.
#[test]
fn a_reused_slot_does_not_inherit_its_last_blocks_place_in_line() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m").bounded();
    let mut stats = ApplyStats::default();
    for h in 1..=3u64 {
        pod.store_t(&index, &store(&[h], None, &tokens(4, h as u32)), &mut stats);
    }
    pod.remove(&index, &removed(&[1]), &mut stats);
    // Takes block 1's slot; its place in line is last.
    pod.store_t(&index, &store(&[9], None, &tokens(4, 9)), &mut stats);
    assert_eq!(pod.evict_oldest(&index, 1), 1);
    let mut left: Vec<u64> = pod.by_hash.keys().map(|h| h.0).collect();
    left.sort_unstable();
    assert_eq!(left, vec![3, 9]);
}

/// A bounded pod's table under churn at a steady share keeps the size that
/// share needs: 1,000 blocks fit 2,048 buckets (hashbrown's capacity 1,792)
/// at 56%, where keeping it half full took 4,096.
#[test]
fn a_bounded_pods_table_keeps_its_size_under_churn() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m").bounded();
    let mut stats = ApplyStats::default();
    let mut most = 0;
    for h in 1..=20_000u64 {
        pod.store_t(&index, &store(&[h], None, &tokens(4, h as u32)), &mut stats);
        if pod.entries() > 1000 {
            assert_eq!(pod.evict_oldest(&index, 1), 1);
        }
        most = most.max(pod.by_hash.capacity());
    }
    assert_eq!(pod.entries(), 1000);
    assert!(most <= 1792, "capacity {most}");
}

/// Children and orphans counted from scratch: what `link_to`, the links
/// made in advance and `unlink` must keep. Children per slot: the held
/// blocks linked to it, held itself or detached.
fn recount(pod: &PodState) -> (u64, HashMap<u32, u32>) {
    let mut orphans = 0;
    let mut children: HashMap<u32, u32> = HashMap::new();
    for (_, _, held) in pod.by_hash.iter_slots() {
        if !held.links.has_parent() {
            continue;
        }
        *children.entry(held.parent).or_default() += 1;
        if pod.by_hash.at_slot(held.parent).is_none() {
            orphans += 1;
        }
    }
    (orphans, children)
}

/// The pod's children and orphan counts equal a recount; a detached entry
/// stays exactly while children name it.
fn assert_counts_exact(pod: &PodState, what: &str) {
    let (orphans, mut children) = recount(pod);
    assert_eq!(pod.orphans, orphans, "{what}");
    for (slot, hash, held) in pod.by_hash.iter_slots() {
        let want = children.remove(&slot).unwrap_or(0);
        assert_eq!(held.links.children(), want, "{what}, block {hash:?}");
    }
    for slot in pod.by_hash.detached_slots() {
        let (hash, held) = pod.by_hash.any_at(slot);
        let want = children.remove(&slot).unwrap_or(0);
        assert!(want > 0, "{what}: detached {hash:?} kept for no child");
        assert_eq!(held.links.children(), want, "{what}, detached {hash:?}");
        assert!(!held.links.holds_any() && !held.links.has_parent());
    }
    assert!(children.is_empty(), "{what}: links to freed slots");
}

#[test]
fn child_and_orphan_counts_stay_exact_under_random_events() {
    let index = BlockIndex::new();
    let mut rnd = crate::test_rng::xorshift(0x5eed_0fc4_11d5);
    let engine = engine_keys();
    for mode in [KeyMode::Token, engine] {
        // Bounded, so evictions take part too.
        let mut pod = PodState::new(PodId(0), "m").bounded();
        let mut stats = ApplyStats::default();
        let mut restores = 0;
        for step in 0..3000 {
            // A small hash space: re-stores, repeats within an event,
            // blocks that are their own parent, unknown parents.
            let n = 1 + rnd(6) as usize;
            let hashes: Vec<u64> = (0..n).map(|_| 1 + rnd(40)).collect();
            match rnd(10) {
                0..=5 => {
                    let parent = (rnd(3) > 0).then(|| 1 + rnd(40));
                    let mut ev = store(&hashes, parent, &tokens(n * BS, rnd(3) as u32));
                    if rnd(8) == 0 {
                        ev.token_ids.clear();
                        ev.medium = Some("CPU".into());
                    }
                    pod.store(&index, &ev, &mode, &mut stats);
                }
                6..=7 => pod.remove(&index, &removed(&hashes), &mut stats),
                8 => {
                    pod.evict_oldest(&index, n);
                }
                _ if rnd(20) == 0 => pod.clear(&index, &mut stats),
                _ => {}
            }
            assert_counts_exact(&pod, &format!("step {step}"));
            // Now and then a snapshot of it, restored: counted exactly too,
            // and every block of it evictable (links make no cycle, which
            // the live pod's store order rules out but a snapshot does
            // not: see `import`).
            if step % 50 == 0 {
                let export = pod.export();
                let mut restored = PodState::new(PodId(0), "m").bounded();
                let restored_index = BlockIndex::new();
                restored.import(
                    &restored_index,
                    &export.blocks,
                    &export.parents,
                    &export.non_full_groups,
                    Some(BS as u32),
                    None,
                );
                let what = format!("step {step}, restored");
                assert_counts_exact(&restored, &what);
                assert_eq!(restored.entries(), pod.entries(), "{what}");
                let all = restored.entries();
                assert_eq!(
                    restored.evict_oldest(&restored_index, usize::MAX),
                    all,
                    "{what}"
                );
                assert!(restored_index.is_empty(), "{what}");
                restores += 1;
            }
        }
        assert!(
            stats.stored_blocks > 1000 && stats.removed_blocks > 300 && restores > 50,
            "{stats:?}"
        );
    }
}

/// Each held block's slot and whether it is linked to a held parent.
type Linked = HashMap<EngineHash, (u32, bool)>;

fn links_of(pod: &PodState) -> Linked {
    pod.by_hash
        .iter_slots()
        .map(|(slot, h, b)| {
            let held_parent = b.links.has_parent() && pod.by_hash.at_slot(b.parent).is_some();
            (*h, (slot, held_parent))
        })
        .collect()
}

/// What eviction must keep: a block still held that extended a held
/// parent before still has that parent (so an evicted block only ever
/// shortened a match from its end).
fn assert_prefixes_kept(before: &Linked, pod: &PodState, what: &str) {
    let now = links_of(pod);
    for (hash, (slot, held_parent)) in before {
        if let Some((now_slot, now_parent)) = now.get(hash) {
            assert!(
                !held_parent || slot != now_slot || *now_parent,
                "{what}: {hash:?} kept, its parent evicted"
            );
        }
    }
}

#[test]
fn eviction_takes_leaves_first_and_keeps_the_prefixes_a_pod_extends() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m").bounded();
    let mut stats = ApplyStats::default();
    let held = |pod: &PodState| -> Vec<u64> {
        let mut v: Vec<u64> = pod.by_hash.keys().map(|h| h.0).collect();
        v.sort_unstable();
        v
    };
    // 1 <- 2 <- 3 first (the oldest blocks), 4 and 5 alone, 6 under 1.
    pod.store_t(&index, &store(&[1, 2, 3], None, &tokens(12, 0)), &mut stats);
    pod.store_t(&index, &store(&[4], None, &tokens(4, 40)), &mut stats);
    pod.store_t(&index, &store(&[5], None, &tokens(4, 50)), &mut stats);
    pod.store_t(&index, &store(&[6], Some(1), &tokens(4, 60)), &mut stats);
    let before = links_of(&pod);
    // 1 and 2 are the oldest, but 3 extends them: 3 goes, then 2 (a
    // leaf now, and older than 4). 1 still has 6.
    assert_eq!(pod.evict_oldest(&index, 2), 2);
    assert_eq!(held(&pod), vec![1, 4, 5, 6]);
    assert_prefixes_kept(&before, &pod, "first");
    assert_eq!(pod.closed_tier(), Some(Tier::Gpu));
    assert_eq!(pod.evict_oldest(&index, 2), 2);
    assert_eq!(held(&pod), vec![1, 6]);
    // 6, then 1 (its last child gone).
    assert_eq!(pod.evict_oldest(&index, 1), 1);
    assert_eq!(held(&pod), vec![1]);
    assert_eq!(pod.evict_oldest(&index, 5), 1);
    assert!(index.is_empty() && pod.entries() == 0);

    // A parent eviction passed while it had a child is evicted once
    // that child is removed by the pod itself.
    pod.store_t(&index, &store(&[1, 2], None, &tokens(8, 0)), &mut stats);
    pod.store_t(&index, &store(&[3], None, &tokens(4, 40)), &mut stats);
    pod.store_t(&index, &store(&[2], Some(1), &tokens(4, 4)), &mut stats);
    assert_eq!(pod.evict_oldest(&index, 1), 1);
    assert_eq!(held(&pod), vec![1, 2], "3, the oldest leaf");
    pod.remove(&index, &removed(&[2]), &mut stats);
    pod.remove(&index, &removed(&[2]), &mut stats);
    assert_eq!(held(&pod), vec![1]);
    assert_eq!(pod.evict_oldest(&index, 1), 1);
    assert!(index.is_empty() && pod.entries() == 0);
}

/// Random histories (prompts under held, unknown or no parents, repeated
/// hashes, offloads, removals that leave holes, clears), evicting at
/// random points: every eviction takes what it was asked for (a held
/// set always has a leaf), makes no orphan, and keeps every prefix.
#[test]
fn eviction_keeps_every_prefix_under_random_histories() {
    let engine = engine_keys();
    let mut evictions = 0;
    for seed in 1..=24u64 {
        let mode = if seed % 2 == 0 {
            &engine
        } else {
            &KeyMode::Token
        };
        let mut rnd = crate::test_rng::xorshift(0x9e37_79b9_7f4a_7c15 ^ seed);
        let index = BlockIndex::new();
        let mut pod = PodState::new(PodId(0), "m").bounded();
        let mut stats = ApplyStats::default();
        let mut fresh = 0u64;
        for step in 0..600 {
            let what = format!("seed {seed}, step {step}");
            match rnd(12) {
                0..=6 => {
                    let n = 1 + rnd(5) as usize;
                    let hashes: Vec<u64> = (0..n)
                        .map(|_| match rnd(5) {
                            0 => 1 + rnd(fresh + 1),
                            _ => {
                                fresh += 1;
                                fresh
                            }
                        })
                        .collect();
                    let parent = (rnd(4) > 0).then(|| 1 + rnd(fresh + 1));
                    let mut ev = store(&hashes, parent, &tokens(n * BS, rnd(3) as u32));
                    if rnd(8) == 0 {
                        ev.token_ids.clear();
                        ev.medium = Some("CPU".into());
                    }
                    pod.store(&index, &ev, mode, &mut stats);
                }
                7..=8 => {
                    let hashes: Vec<u64> = (0..1 + rnd(3)).map(|_| 1 + rnd(fresh + 1)).collect();
                    pod.remove(&index, &removed(&hashes), &mut stats);
                }
                9..=10 => {
                    let before = links_of(&pod);
                    let orphans = pod.orphans;
                    let n = 1 + rnd(8) as usize;
                    let want = n.min(pod.entries());
                    assert_eq!(pod.evict_oldest(&index, n), want, "{what}");
                    assert!(pod.orphans <= orphans, "{what}: eviction made an orphan");
                    assert_prefixes_kept(&before, &pod, &what);
                    evictions += want;
                }
                _ if rnd(30) == 0 => pod.clear(&index, &mut stats),
                _ => {}
            }
            assert!(pod.released.len() <= pod.entries() + 64, "{what}");
        }
    }
    assert!(evictions > 5000, "{evictions}");
}

#[test]
fn a_slot_is_sixteen_bytes() {
    assert_eq!(std::mem::size_of::<(EngineHash, HeldBlock)>(), 16);
}

#[test]
fn an_evicted_block_takes_its_extra_stores_with_it() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m").bounded();
    let mut stats = ApplyStats::default();
    let t = tokens(4, 0);
    for _ in 0..3 {
        pod.store_t(&index, &store(&[1], None, &t), &mut stats);
    }
    assert_eq!(
        pod.export().blocks,
        vec![(1, pod.key_of(EngineHash(1)).unwrap().0, [3, 0, 0])]
    );
    assert_eq!(pod.evict_oldest(&index, 1), 1);
    assert!(pod.extra.is_empty() && index.is_empty());
    // Stored again: one removal takes it.
    pod.store_t(&index, &store(&[1], None, &t), &mut stats);
    pod.remove(&index, &removed(&[1]), &mut stats);
    assert!(index.is_empty());
    assert_eq!(pod.entries(), 0);
}

#[test]
fn store_order_survives_the_32_bit_stamp_wrap_and_long_lived_blocks() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m").bounded();
    let mut stats = ApplyStats::default();
    let put = |pod: &mut PodState, h: u64, stats: &mut ApplyStats| {
        pod.store_t(&index, &store(&[h], None, &tokens(4, h as u32 * 10)), stats)
    };
    let exported =
        |pod: &PodState| -> Vec<u64> { pod.export().blocks.iter().map(|(h, _, _)| *h).collect() };
    // The clock moved on by `n` stores of other blocks.
    let skip = |pod: &mut PodState, n: u64| {
        let target = pod.clock + n;
        while pod.clock < target {
            pod.clock = (target - 1).min((pod.clock / AGE_PASS + 1) * AGE_PASS - 1);
            pod.tick();
        }
    };
    // 9, 8, 7 stored around the wrap of the 32-bit stamps.
    pod.clock = (1 << 32) - 2;
    for h in [9, 8, 7] {
        put(&mut pod, h, &mut stats);
    }
    assert_eq!(exported(&pod), vec![9, 8, 7]);
    // 2^31 stores later, 6: the passes have clamped 9 and 8, not 7.
    skip(&mut pod, (1 << 31) - 1);
    put(&mut pod, 6, &mut stats);
    assert_eq!(exported(&pod), vec![8, 9, 7, 6], "clamped ones by hash");
    // 2^31 more: 7 is clamped too, 6 not yet, and all are older than 5
    // (without the passes, 9's stamp would read as one store old).
    skip(&mut pod, (1 << 31) - 1);
    put(&mut pod, 5, &mut stats);
    assert_eq!(exported(&pod), vec![7, 8, 9, 6, 5]);
    assert_eq!(pod.evict_oldest(&index, 4), 4);
    assert_eq!(exported(&pod), vec![5]);
    assert_eq!(index.len(), 1);
}

#[test]
fn unknown_parent_is_counted_and_touches_nothing() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    pod.store_t(&index, &store(&[5, 6], Some(99), &tokens(8, 0)), &mut stats);
    assert_eq!(stats.parent_unknown_blocks, 2);
    assert!(index.is_empty());
    pod.remove(&index, &removed(&[5]), &mut stats);
    assert_eq!(stats.unknown_removals, 1);
}

/// An engine-keyed model with an adapter it cannot engine key: a block
/// offloaded by hash alone is keyed by its hash, so a store under it with
/// the adapter (token keyed) has no token key to chain from. Its blocks
/// would get keys no prompt has; they are counted as under an unknown
/// parent instead, as the run layout's `pod_feed` does.
#[test]
fn an_adapter_store_under_a_hash_keyed_parent_is_under_an_unknown_parent() {
    let index = BlockIndex::new();
    let mode = engine_keys();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let offload = BlockStored {
        block_hashes: vec![EngineHash(5)],
        medium: Some("CPU".into()),
        ..Default::default()
    };
    pod.store(&index, &offload, &mode, &mut stats);
    assert_eq!(pod.key_of(EngineHash(5)), Some(BlockKey(5)));
    let mut child = store(&[6], Some(5), &tokens(4, 0));
    child.lora_name = Some("sql".into());
    pod.store(&index, &child, &mode, &mut stats);
    assert_eq!(stats.parent_unknown_blocks, 1);
    assert_eq!(stats.stored_blocks, 1, "the offload only");
    assert_eq!(pod.key_of(EngineHash(6)), None);
}

#[test]
fn tier_only_store_adds_a_tier_to_known_hashes() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let t = tokens(4, 0);
    let keys = prompt_keys(request_root_seed("m", None, None), &t, BS);
    pod.store_t(&index, &store(&[1], None, &t), &mut stats);
    let mut offload = store(&[1, 2], None, &[]);
    offload.medium = Some("CPU".into());
    pod.store_t(&index, &offload, &mut stats);
    assert_eq!(stats.unkeyable_blocks, 1);
    assert_eq!(pod.held_per_tier(), [1, 1, 0]);
    pod.remove(&index, &removed(&[1]), &mut stats);
    // Still on CPU.
    assert_eq!(held_keys(&index, &keys, PodId(0)), 1);
    index.with_holders(keys[0], |h| {
        assert_eq!(
            h.iter().next().unwrap().tiers().tiers().collect::<Vec<_>>(),
            vec![Tier::Cpu]
        )
    });
}

#[test]
fn clear_drops_only_this_pod() {
    let index = BlockIndex::new();
    let mut a = PodState::new(PodId(0), "m");
    let mut b = PodState::new(PodId(1), "m");
    let mut stats = ApplyStats::default();
    let t = tokens(8, 0);
    let keys = prompt_keys(request_root_seed("m", None, None), &t, BS);
    a.store_t(&index, &store(&[1, 2], None, &t), &mut stats);
    b.store_t(&index, &store(&[1, 2], None, &t), &mut stats);
    a.clear(&index, &mut stats);
    assert_eq!(held_keys(&index, &keys, PodId(0)), 0);
    assert_eq!(held_keys(&index, &keys, PodId(1)), 2);
    assert_eq!(a.held_per_tier(), [0; TIERS]);
    // Stores after a clear start from scratch again.
    a.store_t(&index, &store(&[3], Some(1), &t[4..]), &mut stats);
    assert_eq!(stats.parent_unknown_blocks, 1);
}

#[test]
fn non_full_attention_groups_are_ignored_including_their_removals() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let t = tokens(4, 0);
    let mut full = store(&[1], None, &t);
    full.group_idx = Some(0);
    full.kv_cache_spec_kind = Some("full_attention".into());
    let mut swa = full.clone();
    swa.group_idx = Some(1);
    swa.kv_cache_spec_kind = Some("sliding_window".into());
    pod.store_t(&index, &full, &mut stats);
    pod.store_t(&index, &swa, &mut stats);
    let mut rm = removed(&[1]);
    rm.group_idx = Some(1);
    pod.remove(&index, &rm, &mut stats);
    assert_eq!(stats.non_full_attention_events, 2);
    assert_eq!(pod.held_per_tier(), [1, 0, 0]);
}

#[test]
fn lora_and_salt_extra_keys_make_request_compatible_keys() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let t = tokens(8, 0);
    // Bare form (as vLLM 0.33 events carry it): salt on block 0, LoRA on all.
    let mut ev = store(&[1, 2], None, &t);
    ev.lora_name = Some("sql".into());
    ev.extra_keys = Some(vec![
        Some(vec![
            ExtraKey::Str("sql".into()),
            ExtraKey::Str("tenant".into()),
        ]),
        Some(vec![ExtraKey::Str("sql".into())]),
    ]);
    pod.store_t(&index, &ev, &mut stats);
    // Tagged form (0.31+ hashing tuples), no lora_name field.
    let mut tagged = store(&[3, 4], None, &t);
    let lora = ExtraKey::List(vec![
        ExtraKey::Str("lora".into()),
        ExtraKey::Str("chat".into()),
        ExtraKey::Str("/p".into()),
    ]);
    tagged.extra_keys = Some(vec![
        Some(vec![
            lora.clone(),
            ExtraKey::List(vec![
                ExtraKey::Str("cache_salt".into()),
                ExtraKey::Str("t2".into()),
            ]),
        ]),
        Some(vec![lora]),
    ]);
    pod.store_t(&index, &tagged, &mut stats);
    let want = |lora, salt| prompt_keys(request_root_seed("m", lora, salt), &t, BS);
    assert_eq!(
        held_keys(&index, &want(Some("sql"), Some("tenant")), PodId(0)),
        2
    );
    assert_eq!(
        held_keys(&index, &want(Some("chat"), Some("t2")), PodId(0)),
        2
    );
    assert_eq!(held_keys(&index, &want(Some("sql"), None), PodId(0)), 0);
    assert_eq!(held_keys(&index, &want(None, Some("tenant")), PodId(0)), 0);
    assert_eq!(held_keys(&index, &want(None, None), PodId(0)), 0);
}

#[test]
fn id_only_lora_never_matches_a_plain_prompt() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let t = tokens(4, 0);
    let mut ev = store(&[1], None, &t);
    ev.lora_id = Some(3);
    pod.store_t(&index, &ev, &mut stats);
    let plain = prompt_keys(request_root_seed("m", None, None), &t, BS);
    assert_eq!(held_keys(&index, &plain, PodId(0)), 0);
}

#[test]
fn malformed_token_counts_are_rejected() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    pod.store_t(&index, &store(&[1, 2], None, &tokens(7, 0)), &mut stats);
    let mut zero = store(&[1], None, &tokens(4, 0));
    zero.block_size = Some(0);
    pod.store_t(&index, &zero, &mut stats);
    assert_eq!(stats.malformed_stores, 2);
    assert!(index.is_empty());
}

#[test]
fn prefix_closure_is_tracked_through_holes_and_re_stores() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let remove = |pod: &mut PodState, h: u64, stats: &mut ApplyStats| {
        pod.remove(
            &index,
            &BlockRemoved {
                block_hashes: vec![EngineHash(h)],
                ..Default::default()
            },
            stats,
        )
    };
    // 1 <- 2 <- 3, one store.
    pod.store_t(&index, &store(&[1, 2, 3], None, &tokens(12, 0)), &mut stats);
    assert_eq!(pod.closed_tier(), Some(Tier::Gpu));
    // A hole: 3 is an orphan now.
    remove(&mut pod, 2, &mut stats);
    assert_eq!(pod.closed_tier(), None);
    // 2 comes back: a new incarnation; 3 stays counted as the orphan it
    // was (conservative), until it goes.
    pod.store_t(&index, &store(&[2], Some(1), &tokens(4, 4)), &mut stats);
    assert_eq!(pod.closed_tier(), None);
    remove(&mut pod, 3, &mut stats);
    assert_eq!(pod.closed_tier(), Some(Tier::Gpu));
    // The new 2's own children are counted against it, not the old one.
    pod.store_t(&index, &store(&[9], Some(2), &tokens(4, 8)), &mut stats);
    remove(&mut pod, 9, &mut stats);
    remove(&mut pod, 2, &mut stats);
    assert_eq!(pod.closed_tier(), Some(Tier::Gpu));
    assert_eq!(pod.orphans, 0);
    // A CPU copy makes two tiers: not the single-tier fast path.
    let mut cpu = store(&[1], None, &[]);
    cpu.medium = Some("CPU".into());
    pod.store_t(&index, &cpu, &mut stats);
    assert_eq!(pod.closed_tier(), None);
}

#[test]
fn a_restored_pod_keeps_its_prefix_closure() {
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    pod.store_t(&index, &store(&[1, 2, 3], None, &tokens(12, 0)), &mut stats);
    // Re-storing the root makes it newer than its children: the export
    // lists children before their parent.
    pod.store_t(&index, &store(&[1], None, &tokens(4, 0)), &mut stats);
    pod.store_t(&index, &store(&[4], Some(3), &tokens(4, 5)), &mut stats);
    pod.store_t(&index, &store(&[5], Some(1), &tokens(4, 9)), &mut stats);
    // A hole: 2 goes, 3 (and through it 4) is cut off.
    pod.remove(
        &index,
        &BlockRemoved {
            block_hashes: vec![EngineHash(2)],
            ..Default::default()
        },
        &mut stats,
    );
    assert_eq!(pod.orphans, 1);
    let export = pod.export();

    let restored_index = BlockIndex::new();
    let mut restored = PodState::new(PodId(0), "m");
    restored.import(
        &restored_index,
        &export.blocks,
        &export.parents,
        &export.non_full_groups,
        Some(4),
        None,
    );
    assert_eq!(restored.orphans, 1, "3 is still the one orphan");
    let remove = |pod: &mut PodState, index: &BlockIndex, h: u64| {
        let mut stats = ApplyStats::default();
        pod.remove(
            index,
            &BlockRemoved {
                block_hashes: vec![EngineHash(h)],
                ..Default::default()
            },
            &mut stats,
        )
    };
    remove(&mut restored, &restored_index, 4);
    remove(&mut restored, &restored_index, 3);
    assert_eq!(restored.closed_tier(), Some(Tier::Gpu));
    // 1 was stored twice: it goes on the second removal.
    remove(&mut restored, &restored_index, 1);
    assert_eq!(restored.closed_tier(), Some(Tier::Gpu));
    remove(&mut restored, &restored_index, 1);
    assert_eq!(restored.closed_tier(), None, "5 lost its parent");

    // An old snapshot (no parents): every block is an orphan.
    let mut old = PodState::new(PodId(1), "m");
    old.import(&BlockIndex::new(), &export.blocks, &[], &[], Some(4), None);
    assert_eq!(old.orphans, 4);
    assert_eq!(old.closed_tier(), None);
}

/// Blocks first seen in an offload that names no parent (vLLM's
/// connectors name none) are orphans: the pod is walked, never
/// binary-searched as if each began a chain, also once restored, even
/// when the pod holds a block whose hash is the one such orphans are
/// kept under.
#[test]
fn offloaded_blocks_of_unnamed_parents_are_orphans_also_once_restored() {
    let engine = engine_keys();
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let mut offload = store(&[0, 5, 6], None, &[]);
    offload.medium = Some("CPU".into());
    pod.store(&index, &offload, &engine, &mut stats);
    assert_eq!(pod.held_per_tier(), [0, 3, 0]);
    assert_eq!(pod.orphans, 3);
    assert_eq!(pod.closed_tier(), None);
    // Named, the parent links the event's blocks as a chain.
    let mut chained = store(&[8, 9], Some(7), &[]);
    chained.medium = Some("CPU".into());
    pod.store(&index, &chained, &engine, &mut stats);
    assert_eq!(pod.orphans, 4, "8 under the unheld 7; 9 under 8");
    let export = pod.export();
    let mut restored = PodState::new(PodId(0), "m");
    restored.import(
        &BlockIndex::new(),
        &export.blocks,
        &export.parents,
        &export.non_full_groups,
        None,
        None,
    );
    assert_eq!(restored.orphans, 4, "not linked to the held block 0");
    assert_eq!(restored.closed_tier(), None);
}

/// Engine keys are the hashes: a pod keeps no key column until a block
/// needs a key of its own (an adapter whose hashes engine keys cannot
/// reproduce is keyed by its tokens). Then the column is filled in for
/// the blocks held before, and every block is released under the key it
/// was acquired with.
#[test]
fn keys_are_kept_only_once_one_differs_from_its_hash() {
    let engine = engine_keys();
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    pod.store(
        &index,
        &store(&[1, 2], None, &tokens(8, 0)),
        &engine,
        &mut stats,
    );
    assert!(pod.keys.is_none());
    assert_eq!(pod.key_of(EngineHash(2)), Some(BlockKey(2)));
    let mut adapter = store(&[3], None, &tokens(4, 50));
    adapter.lora_name = Some("unknown-adapter".into());
    pod.store(&index, &adapter, &engine, &mut stats);
    assert!(pod.keys.is_some());
    let token_key = pod.key_of(EngineHash(3)).unwrap();
    assert_ne!(token_key, BlockKey(3));
    assert_eq!(pod.key_of(EngineHash(1)), Some(BlockKey(1)));
    assert_eq!(index.len(), 3);
    index.with_holders(token_key, |h| assert!(!h.is_empty()));
    pod.remove(&index, &removed(&[1, 2, 3]), &mut stats);
    assert!(index.is_empty(), "every block released under its own key");
    // A clear forgets the column with the blocks.
    pod.store(&index, &adapter, &engine, &mut stats);
    pod.clear(&index, &mut stats);
    assert!(pod.keys.is_none() && index.is_empty());
}

/// An orphan left by a parentless offload is adopted when vLLM loads it
/// back to GPU under its (held) parent, and the pod, once the CPU copies
/// go, is binary-searched again; a block something is linked to is not
/// adopted (its new parent could be its descendant).
#[test]
fn an_orphan_is_adopted_when_a_store_names_its_held_parent() {
    let engine = engine_keys();
    let index = BlockIndex::new();
    let mut pod = PodState::new(PodId(0), "m");
    let mut stats = ApplyStats::default();
    let cpu = |hashes: &[u64], parent: Option<u64>| {
        let mut ev = store(hashes, parent, &[]);
        ev.medium = Some("CPU".into());
        ev
    };
    let mut remove_cpu = removed(&[5, 6, 7]);
    remove_cpu.medium = Some("CPU".into());
    pod.store(
        &index,
        &store(&[1, 2, 3, 4], None, &tokens(16, 0)),
        &engine,
        &mut stats,
    );
    pod.store(&index, &cpu(&[5, 6, 7], None), &engine, &mut stats);
    assert_eq!(pod.orphans, 3);
    pod.store(
        &index,
        &store(&[5, 6, 7], Some(4), &tokens(12, 16)),
        &engine,
        &mut stats,
    );
    assert_counts_exact(&pod, "adopted");
    assert_eq!(pod.orphans, 0);
    pod.remove(&index, &remove_cpu, &mut stats);
    assert_eq!(pod.closed_tier(), Some(Tier::Gpu));

    // 9 under a parent nobody holds, 10 under 9: 9 is not adopted.
    pod.store(
        &index,
        &store(&[9, 10], Some(8), &tokens(8, 40)),
        &engine,
        &mut stats,
    );
    pod.store(
        &index,
        &store(&[9], Some(4), &tokens(4, 40)),
        &engine,
        &mut stats,
    );
    assert_counts_exact(&pod, "not adopted");
    assert_eq!(pod.orphans, 1);
}

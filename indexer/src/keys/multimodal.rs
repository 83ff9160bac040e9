//! A prompt's multimodal items, and the extra keys vLLM gives the blocks
//! they overlap.
//!
//! vLLM 0.33 keys a block that overlaps an item (an image's placeholder
//! tokens, an audio clip's) with `("mm", identifier, item offset - block
//! start)` (`_gen_mm_extra_hash_keys` in `vllm/v1/core/kv_cache_utils.py`)
//! and publishes it in `BlockStored.extra_keys` as the pair
//! `[identifier, offset]`: negative in a block that continues an item, one
//! pair per item the block overlaps, in the items' order. Two prompts whose
//! placeholder token ids are equal but whose images differ therefore hold
//! different blocks from the first block an image touches. The event side
//! folds those pairs into the keys (`keys::fold_extras`, block 0's into the
//! root seed); `block_extras` gives a request's blocks the same pairs, so a
//! prompt's keys are what a pod's store of it made.

use crate::event::ExtraKey;

/// One item of a prompt: which item its placeholder tokens stand for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmItem {
    /// vLLM's identifier of the item: its `mm_hash` (the render server's
    /// `features.mm_hashes`), or `"<lora>:<hash>"` on pods that run a
    /// tower-connector LoRA.
    pub identifier: String,
    /// The first placeholder token's index in the prompt.
    pub offset: u32,
    /// Placeholder tokens (at least one).
    pub length: u32,
}

/// Most items in one prompt, and the longest identifier: bounds on what a
/// request may make us key (a sha256 hex digest is 64 characters).
pub const MAX_ITEMS: usize = 4096;
pub const MAX_IDENTIFIER: usize = 512;

/// Why a request's items cannot be keyed.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum MmError {
    #[error("{0} multimodal items; at most {MAX_ITEMS}")]
    TooMany(usize),
    #[error("multimodal item {0}: empty identifier, or longer than {MAX_IDENTIFIER} bytes")]
    Identifier(usize),
    #[error("multimodal item {0}: length 0")]
    Empty(usize),
    #[error("multimodal item {0} ends at token {1}, past the prompt's {2} tokens")]
    PastEnd(usize, u64, usize),
    #[error("multimodal items {0} and {1} overlap")]
    Overlap(usize, usize),
}

/// The items in prompt order, checked: each inside the prompt, none
/// overlapping (as vLLM's render server requires), bounded.
pub fn sorted_items(mut items: Vec<MmItem>, prompt_tokens: usize) -> Result<Vec<MmItem>, MmError> {
    if items.len() > MAX_ITEMS {
        return Err(MmError::TooMany(items.len()));
    }
    for (i, item) in items.iter().enumerate() {
        if item.identifier.is_empty() || item.identifier.len() > MAX_IDENTIFIER {
            return Err(MmError::Identifier(i));
        }
        if item.length == 0 {
            return Err(MmError::Empty(i));
        }
        let end = u64::from(item.offset) + u64::from(item.length);
        if end > prompt_tokens as u64 {
            return Err(MmError::PastEnd(i, end, prompt_tokens));
        }
    }
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| items[i].offset);
    for w in order.windows(2) {
        let (a, b) = (&items[w[0]], &items[w[1]]);
        if u64::from(a.offset) + u64::from(a.length) > u64::from(b.offset) {
            return Err(MmError::Overlap(w[0], w[1]));
        }
    }
    items.sort_by_key(|i| i.offset);
    Ok(items)
}

/// The extra keys of the block `[start, end)`: one `[identifier, item
/// offset - start]` pair per item it overlaps, in order (`items` sorted).
pub fn block_extras(items: &[MmItem], start: usize, end: usize) -> Vec<ExtraKey> {
    // The first item not wholly before the block.
    let first =
        items.partition_point(|i| (u64::from(i.offset) + u64::from(i.length)) as usize <= start);
    items[first..]
        .iter()
        .take_while(|i| (i.offset as usize) < end)
        .map(|i| {
            ExtraKey::List(vec![
                ExtraKey::Str(i.identifier.clone()),
                ExtraKey::Int(i64::from(i.offset) - start as i64),
            ])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: &str, offset: u32, length: u32) -> MmItem {
        MmItem {
            identifier: id.into(),
            offset,
            length,
        }
    }

    fn pairs(extras: &[ExtraKey]) -> Vec<(String, i64)> {
        extras
            .iter()
            .map(|e| match e {
                ExtraKey::List(p) => match p.as_slice() {
                    [ExtraKey::Str(s), ExtraKey::Int(o)] => (s.clone(), *o),
                    _ => panic!("{e:?}"),
                },
                _ => panic!("{e:?}"),
            })
            .collect()
    }

    /// The pairs of vLLM 0.33's published `extra_keys` for these items
    /// (read off `qwen3-multimodal`'s recorded stream).
    #[test]
    fn blocks_get_the_pairs_vllm_publishes() {
        // An image of 40 placeholders from token 10, blocks of 16.
        let items = vec![item("b", 10, 40)];
        let got: Vec<_> = (0..5)
            .map(|b| pairs(&block_extras(&items, b * 16, b * 16 + 16)))
            .collect();
        let b = |o| vec![("b".to_owned(), o)];
        assert_eq!(got, vec![b(10), b(-6), b(-22), b(-38), vec![]]);
        // Two items in one block, and an item ending where a block ends.
        let items = vec![item("c", 2, 4), item("d", 8, 8), item("e", 16, 4)];
        assert_eq!(
            pairs(&block_extras(&items, 0, 16)),
            vec![("c".into(), 2), ("d".into(), 8)]
        );
        assert_eq!(pairs(&block_extras(&items, 16, 32)), vec![("e".into(), 0)]);
    }

    #[test]
    fn items_are_sorted_and_checked() {
        let sorted = sorted_items(vec![item("b", 20, 4), item("a", 2, 4)], 32).unwrap();
        assert_eq!(sorted[0].identifier, "a");
        assert_eq!(
            sorted_items(vec![item("a", 2, 4), item("b", 5, 4)], 32),
            Err(MmError::Overlap(0, 1))
        );
        assert_eq!(
            sorted_items(vec![item("a", 30, 4)], 32),
            Err(MmError::PastEnd(0, 34, 32))
        );
        assert_eq!(
            sorted_items(vec![item("a", 0, 0)], 32),
            Err(MmError::Empty(0))
        );
        assert_eq!(
            sorted_items(vec![item("", 0, 1)], 32),
            Err(MmError::Identifier(0))
        );
    }
}

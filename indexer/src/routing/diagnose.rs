//! Why a pod's blocks for a prompt did not match ours: the tokenization
//! parity check.
//!
//! The most reported failure of precise routing is silent: the router's
//! tokens differ from the engine's (a BOS token, `add_special_tokens`, a
//! chat template detail, a block size), no block ever matches, and nothing
//! says why. After a routing we know the tokens we keyed; when the pod then
//! stores a chain that starts where ours does (at the prompt's start, or
//! right after a block of ours it holds) but whose first block has another
//! key, comparing its tokens with ours says how the two sides differ.

use crate::keys::BlockKey;

/// How the pod's tokens differ from ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cause {
    /// One side has one extra leading token (typically a BOS).
    Bos,
    /// The pod chunks its tokens into blocks of another size.
    BlockSize,
    /// Same tokens, different keys: the LoRA adapter, the cache salt (or,
    /// in engine key mode, the hash settings).
    LoraOrSalt,
    /// Anything else (a chat template detail, normalisation, another
    /// tokenizer).
    Tokens,
}

impl Cause {
    pub const ALL: [Cause; 4] = [
        Cause::Bos,
        Cause::BlockSize,
        Cause::LoraOrSalt,
        Cause::Tokens,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Cause::Bos => "bos",
            Cause::BlockSize => "block_size",
            Cause::LoraOrSalt => "lora_or_salt",
            Cause::Tokens => "tokens",
        }
    }

    /// What to try, for the warning.
    pub fn fix(self) -> &'static str {
        match self {
            Cause::Bos => {
                "one side adds a BOS token the other does not: set add_special_tokens on the \
                 request to what the engine does (vLLM adds them for completions, not for \
                 rendered chats)"
            }
            Cause::BlockSize => {
                "the pods run another block size: set --block-size to the pods' \
                 --block-size (it is learned from their stores once they publish)"
            }
            Cause::LoraOrSalt => {
                "the tokens agree but the keys do not: check lora_name and cache_salt on the \
                 request (and, in engine key mode, --engine-hash-algo/--engine-hash-seed)"
            }
            Cause::Tokens => {
                "the tokens differ: check the chat template (the model's, or the request's), \
                 the tokenizer revision and add_special_tokens"
            }
        }
    }
}

/// Where a chain the pod stored starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeenParent {
    /// At a prompt's start.
    Root,
    /// After the block that has this key of ours.
    Key(BlockKey),
    /// After a block we could not key.
    Unknown,
}

/// A chain the pod stored, as far as the diagnosis needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct SeenStore {
    pub parent: SeenParent,
    /// Our key of its first block, if it could be keyed.
    pub first_key: Option<BlockKey>,
    /// Its leading tokens (at most `SEEN_TOKENS`).
    pub tokens: Vec<u32>,
    pub block_size: u32,
}

/// Tokens of a seen chain kept for the comparison.
pub const SEEN_TOKENS: usize = 256;
/// Tokens shown on each side of the first difference.
const CONTEXT: usize = 8;

/// Our side of a routing.
#[derive(Clone, Copy, Debug)]
pub struct Ours<'a> {
    pub keys: &'a [BlockKey],
    /// Leading blocks of `keys` the pod holds exactly: a chain of this
    /// prompt that went wrong starts right after them.
    pub held: usize,
    /// The prompt's leading tokens (as many as were kept).
    pub tokens: &'a [u32],
    pub block_size: u32,
}

/// One diagnosed mismatch: both token sequences around the first difference.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    pub cause: Cause,
    /// The first block of ours the pod's chain should have matched.
    pub block: usize,
    /// Index in the prompt of the first token that differs (the chain's
    /// start for `bos`, `lora_or_salt` and `block_size`).
    pub offset: usize,
    /// Our tokens from `window_start`, and the pod's from the same place.
    pub window_start: usize,
    pub ours: Vec<u32>,
    pub theirs: Vec<u32>,
    pub our_block_size: u32,
    pub their_block_size: u32,
    /// How many of the chain's tokens agree with ours: the more, the
    /// likelier the chain was this request's (see `Tracker`).
    pub agreement: usize,
}

/// What the pod's stored chain says about our keying of the prompt:
/// `None` if the chain agrees with it, does not start where the pod's
/// exact match of it ends, or resembles another prompt rather than a
/// mis-tokenized copy of this one.
pub fn diagnose(ours: Ours<'_>, seen: &SeenStore) -> Option<Mismatch> {
    let bs = ours.block_size as usize;
    let block = ours.held;
    let starts_there = match seen.parent {
        SeenParent::Root => block == 0,
        SeenParent::Key(k) => block > 0 && ours.keys.get(block - 1) == Some(&k),
        SeenParent::Unknown => false,
    };
    if !starts_there || block >= ours.keys.len() || seen.first_key == Some(ours.keys[block]) {
        return None;
    }
    let start = block * bs;
    let mine = ours.tokens.get(start..).filter(|t| !t.is_empty())?;
    let theirs = &seen.tokens[..];
    let overlap = mine.len().min(theirs.len());
    if overlap == 0 {
        return None;
    }
    let common = common_prefix(mine, theirs);
    let found = |cause: Cause, offset: usize, agreement: usize| {
        let from = offset.saturating_sub(start).saturating_sub(CONTEXT);
        let window = |t: &[u32]| t[from.min(t.len())..(from + 2 * CONTEXT).min(t.len())].to_vec();
        Some(Mismatch {
            cause,
            block,
            offset,
            window_start: start + from,
            ours: window(mine),
            theirs: window(theirs),
            our_block_size: ours.block_size,
            their_block_size: seen.block_size,
            agreement,
        })
    };
    let shifted = |a: &[u32], b: &[u32]| {
        a.len() > 1 && overlap >= 2 && a[1..].starts_with(&b[..overlap.min(a.len()) - 1])
    };
    if seen.block_size != ours.block_size {
        // The same prompt cut differently: the tokens agree (perhaps but
        // for a BOS), the blocks do not.
        let resembles = common == overlap || shifted(theirs, mine) || shifted(mine, theirs);
        return resembles
            .then(|| found(Cause::BlockSize, start, overlap))
            .flatten();
    }
    if common == overlap {
        return found(Cause::LoraOrSalt, start, overlap);
    }
    if block == 0 && (shifted(theirs, mine) || shifted(mine, theirs)) {
        return found(Cause::Bos, start, overlap);
    }
    // A chain at the prompt's start that shares less than half a block
    // with ours is another prompt; after a block of ours the pod already
    // holds, any difference is this prompt's.
    if block == 0 && common < bs / 2 {
        return None;
    }
    found(Cause::Tokens, start + common, start + common)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u32 = 4;

    fn keys(n: u64) -> Vec<BlockKey> {
        (1..=n).map(BlockKey).collect()
    }

    fn seen(parent: SeenParent, tokens: &[u32], block_size: u32) -> SeenStore {
        SeenStore {
            parent,
            first_key: Some(BlockKey(999)),
            tokens: tokens.to_vec(),
            block_size,
        }
    }

    /// The pod holds as many of our blocks as the chain's parent says.
    fn check(tokens: &[u32], s: &SeenStore) -> Option<Mismatch> {
        let held = match s.parent {
            SeenParent::Key(k) if k.0 <= 3 => k.0 as usize,
            _ => 0,
        };
        check_held(tokens, s, held)
    }

    fn check_held(tokens: &[u32], s: &SeenStore, held: usize) -> Option<Mismatch> {
        let k = keys((tokens.len() / BS as usize) as u64);
        diagnose(
            Ours {
                keys: &k,
                held,
                tokens,
                block_size: BS,
            },
            s,
        )
    }

    const PROMPT: [u32; 12] = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21];

    #[test]
    fn an_extra_leading_token_on_either_side_is_bos() {
        let mut with_bos = vec![1];
        with_bos.extend_from_slice(&PROMPT[..11]);
        let m = check(&PROMPT, &seen(SeenParent::Root, &with_bos, BS)).unwrap();
        assert_eq!((m.cause, m.block, m.offset), (Cause::Bos, 0, 0));
        assert_eq!(m.theirs[..3], [1, 10, 11]);
        let m = check(&with_bos, &seen(SeenParent::Root, &PROMPT, BS)).unwrap();
        assert_eq!(m.cause, Cause::Bos);
    }

    #[test]
    fn same_tokens_other_keys_is_lora_or_salt() {
        let m = check(&PROMPT, &seen(SeenParent::Root, &PROMPT, BS)).unwrap();
        assert_eq!(m.cause, Cause::LoraOrSalt);
    }

    #[test]
    fn another_chunking_is_block_size() {
        let m = check(&PROMPT, &seen(SeenParent::Root, &PROMPT[..8], 8)).unwrap();
        assert_eq!((m.cause, m.their_block_size), (Cause::BlockSize, 8));
    }

    #[test]
    fn a_difference_after_a_held_block_is_tokens_with_both_sides_shown() {
        // The pod holds our block 0 (key 1), then stored a chain whose
        // tokens differ from ours at prompt index 6.
        let theirs = [14, 15, 99, 98, 97, 96, 95, 94];
        let m = check(&PROMPT, &seen(SeenParent::Key(BlockKey(1)), &theirs, BS)).unwrap();
        assert_eq!((m.cause, m.block, m.offset), (Cause::Tokens, 1, 6));
        assert_eq!(m.window_start, 4);
        assert_eq!(m.ours, PROMPT[4..].to_vec());
        assert_eq!(m.theirs, theirs.to_vec());
    }

    #[test]
    fn unrelated_or_agreeing_chains_are_not_mismatches() {
        // Another prompt altogether.
        assert_eq!(
            check(&PROMPT, &seen(SeenParent::Root, &[7, 7, 7, 7], BS)),
            None
        );
        // Our own key: it agrees.
        let mut s = seen(SeenParent::Root, &PROMPT, BS);
        s.first_key = Some(BlockKey(1));
        assert_eq!(check(&PROMPT, &s), None);
        // After a block that is not ours, or that we cannot key.
        assert_eq!(
            check(&PROMPT, &seen(SeenParent::Key(BlockKey(77)), &PROMPT, BS)),
            None
        );
        assert_eq!(
            check(&PROMPT, &seen(SeenParent::Unknown, &PROMPT, BS)),
            None
        );
        // Past our last full block.
        assert_eq!(
            check(
                &PROMPT,
                &seen(SeenParent::Key(BlockKey(3)), &[1, 2, 3, 4], BS)
            ),
            None
        );
    }
}

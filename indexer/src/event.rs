//! The event model: what a vLLM pod tells us about its KV cache, independent of
//! the wire form it arrived in (see `wire` for decoding).

use std::fmt;

/// Where a cached block lives on a pod. Ordered by how cheap a hit is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Gpu = 0,
    Cpu = 1,
    Storage = 2,
}

/// Number of tiers; arrays indexed by `Tier as usize` have this length.
pub const TIERS: usize = 3;

impl Tier {
    pub const ALL: [Tier; TIERS] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    /// An engine's `medium` string. `None` is GPU (vLLM omits it for the
    /// device cache); CPU memory is `CPU` (vLLM) or `CPU_PINNED` (SGLang's
    /// HiCache host tier); anything else (`DISK`, SGLang's `EXTERNAL`,
    /// remote stores, connector-specific names) is the storage tier.
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") || m.eq_ignore_ascii_case("cuda") => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("cpu") || m.eq_ignore_ascii_case("cpu_pinned") => {
                Tier::Cpu
            }
            Some(_) => Tier::Storage,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "GPU",
            Tier::Cpu => "CPU",
            Tier::Storage => "STORAGE",
        }
    }
}

/// Bit set of tiers (`1 << Tier as usize`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierMask(pub u8);

impl TierMask {
    pub fn contains(self, tier: Tier) -> bool {
        self.0 & (1 << tier.index()) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn tiers(self) -> impl Iterator<Item = Tier> {
        Tier::ALL.into_iter().filter(move |t| self.contains(*t))
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A block hash as the engine put it on the wire, normalised to 64 bits.
///
/// vLLM sends either the 64-bit integer form (the low 8 bytes of the digest,
/// big-endian: `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default) or the
/// raw digest bytes. Taking the last 8 bytes of a raw digest yields exactly
/// the integer vLLM would have sent, so both forms of one block compare equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

impl EngineHash {
    pub fn from_digest(bytes: &[u8]) -> EngineHash {
        let tail = &bytes[bytes.len().saturating_sub(8)..];
        EngineHash(tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    /// Signed integers come from older publishers that sent Python `hash()`
    /// values; the bit pattern is what identifies the block.
    pub fn from_i64(v: i64) -> EngineHash {
        EngineHash(v as u64)
    }
}

/// One element of a block's `extra_keys` tuple (LoRA name, cache salt,
/// multimodal identifiers...), kept structurally so keys can be derived from it.
#[derive(Clone, Debug, PartialEq)]
pub enum ExtraKey {
    Nil,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<ExtraKey>),
}

/// The engine a pod runs, as its events show it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum Engine {
    /// No store seen yet.
    #[default]
    Unknown = 0,
    Vllm = 1,
    Sglang = 2,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Unknown => "",
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }

    pub fn from_u8(v: u8) -> Engine {
        match v {
            1 => Engine::Vllm,
            2 => Engine::Sglang,
            _ => Engine::Unknown,
        }
    }
}

/// `BlockStored`: the pod now holds these blocks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    /// Hash of the block before the first one; `None` = start of a prompt.
    pub parent_block_hash: Option<EngineHash>,
    /// `block_size` tokens per block; empty for stores that only add a tier
    /// (CPU offload) to blocks already known by hash.
    pub token_ids: Vec<u32>,
    pub block_size: Option<u32>,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// SGLang: the request's cache salt, named beside the blocks (vLLM
    /// puts it in block 0's `extra_keys`). It scopes a chain's first block.
    pub cache_salt: Option<String>,
    /// SGLang with EAGLE speculative decoding: each unit of a page is a
    /// pair of ids (a token and the next), published as `[a, b]`;
    /// `token_ids` holds them flattened, two words a unit, and
    /// `block_size` counts units.
    pub bigram: bool,
    /// Who published it, by its form: vLLM's map form always has a
    /// `lora_name` key and never `cache_salt`; SGLang's omits `lora_name`
    /// when there is none and names a salt in `cache_salt` (a store under
    /// an adapter and no salt looks like vLLM's: a pod's other stores
    /// tell). Positional forms are vLLM's.
    pub engine: Engine,
    /// Per block: `None` or the block's extra keys.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    pub group_idx: Option<u32>,
    pub kv_cache_spec_kind: Option<String>,
    /// `LOCAL` or `REMOTE` relative to the publisher (newer vLLM).
    pub locality: Option<String>,
}

impl BlockStored {
    pub fn tier(&self) -> Tier {
        tier_of(self.medium.as_deref(), self.locality.as_deref())
    }
}

/// A block held `REMOTE` (relative to the publisher) is on the storage tier,
/// whatever its medium; otherwise the medium names the tier.
fn tier_of(medium: Option<&str>, locality: Option<&str>) -> Tier {
    if locality.is_some_and(|l| l.eq_ignore_ascii_case("remote")) {
        return Tier::Storage;
    }
    Tier::from_medium(medium)
}

/// `BlockRemoved`: the pod dropped these blocks from one tier.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<EngineHash>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
    /// As `BlockStored::locality`: vLLM's offloading events send it on
    /// both, so a `REMOTE` copy's removal names the tier its store did.
    pub locality: Option<String>,
}

impl BlockRemoved {
    pub fn tier(&self) -> Tier {
        tier_of(self.medium.as_deref(), self.locality.as_deref())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    Stored(BlockStored),
    Removed(BlockRemoved),
    /// The pod dropped every block (prefix-cache reset).
    AllCleared,
}

/// Whether a `kv_cache_spec_kind` names a full-attention group: only those
/// groups' blocks make a prefix reusable for any prompt length.
pub fn is_full_attention_kind(kind: &str) -> bool {
    matches!(
        kind,
        "full_attention" | "mla_attention" | "sink_full_attention"
    )
}

/// What a payload held, after decoding: the events we understood and
/// counts of what we skipped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<u32>,
    pub skipped: DecodeSkips,
}

/// Per-batch counts of what the decoder ignored. None of these are fatal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeSkips {
    /// Events whose type we do not know (newer vLLM releases add some).
    pub unknown_event_types: u32,
    /// Events that had a known type but unusable content.
    pub malformed_events: u32,
    /// Map keys we do not know, inside otherwise fine events.
    pub unknown_fields: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_tail_equals_int_wire_value() {
        // From vllm-0.33-engine-hashes.json: digest 7b25...4caf -> 1403909460543360175.
        let digest: Vec<u8> = (0..32)
            .map(|i| {
                u8::from_str_radix(
                    &"7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf"
                        [2 * i..2 * i + 2],
                    16,
                )
                .unwrap()
            })
            .collect();
        assert_eq!(
            EngineHash::from_digest(&digest),
            EngineHash(1403909460543360175)
        );
    }

    #[test]
    fn short_digests_are_right_aligned() {
        assert_eq!(EngineHash::from_digest(&[1, 2]), EngineHash(0x0102));
        assert_eq!(EngineHash::from_digest(&[]), EngineHash(0));
    }

    #[test]
    fn medium_maps_to_tier() {
        assert_eq!(Tier::from_medium(None), Tier::Gpu);
        assert_eq!(Tier::from_medium(Some("GPU")), Tier::Gpu);
        assert_eq!(Tier::from_medium(Some("cpu")), Tier::Cpu);
        assert_eq!(
            Tier::from_medium(Some("CPU_PINNED")),
            Tier::Cpu,
            "SGLang's host tier"
        );
        assert_eq!(Tier::from_medium(Some("DISK")), Tier::Storage);
        assert_eq!(Tier::from_medium(Some("EXTERNAL")), Tier::Storage);
        assert_eq!(Tier::from_medium(Some("lmcache")), Tier::Storage);
        let remote = BlockStored {
            medium: Some("GPU".into()),
            locality: Some("REMOTE".into()),
            ..Default::default()
        };
        assert_eq!(remote.tier(), Tier::Storage);
    }

    #[test]
    fn full_attention_kinds() {
        assert!(is_full_attention_kind("full_attention"));
        assert!(is_full_attention_kind("mla_attention"));
        assert!(!is_full_attention_kind("sliding_window"));
        assert!(!is_full_attention_kind("mamba"));
        assert!(!is_full_attention_kind("unknown"));
    }
}

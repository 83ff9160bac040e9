//! The index on disk: every pod's blocks (hash, key, per-tier counts), its
//! last seq and flags, so a restarted indexer continues where it stopped and
//! asks the pods' replay buffers only for what came after.
//!
//! Format: `KVIXSNAP`, version (u32 LE), xxh3-64 of the body (u64 LE), body
//! (msgpack). A wrong magic, version or checksum, or a snapshot written
//! under another key configuration, is refused as a whole.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 8] = b"KVIXSNAP";
pub const VERSION: u32 = 1;

/// One held block: (engine hash, key, count per tier).
pub type SnapshotBlock = (u64, u64, [u32; crate::event::TIERS]);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Fingerprint of the key configuration the keys were computed with.
    pub keys_fingerprint: u64,
    pub pods: Vec<PodSnapshot>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PodSnapshot {
    pub model: String,
    /// The pod name from its topic (without the DP rank suffix).
    pub pod: String,
    pub dp_rank: Option<u32>,
    pub block_size: Option<u32>,
    pub last_seq: Option<u64>,
    pub incomplete: bool,
    pub non_full_groups: Vec<u32>,
    /// (engine hash, key, counts per tier), least recently stored first.
    pub blocks: Vec<SnapshotBlock>,
    /// Each block's parent hash, parallel to `blocks` (what keeps a restored
    /// pod's prefix closure known). Last, and defaulted: snapshots written
    /// before it existed still load, their blocks counted as orphans.
    #[serde(default)]
    pub parents: Vec<Option<u64>>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotError {
    #[error("not a kv-indexer snapshot")]
    NotASnapshot,
    #[error("snapshot format version {0} (this build reads version {VERSION})")]
    Version(u32),
    #[error("snapshot is corrupt (checksum mismatch)")]
    Checksum,
    #[error("snapshot cannot be decoded: {0}")]
    Decode(String),
    #[error(
        "snapshot was written with another key configuration (key mode, hash algorithm or seed)"
    )]
    KeysChanged,
}

pub fn encode(s: &Snapshot) -> Vec<u8> {
    // Serialising plain data to a Vec cannot fail.
    let body = rmp_serde::to_vec(s).unwrap_or_default();
    let mut out = Vec::with_capacity(body.len() + 20);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&xxh3_64(&body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

pub fn decode(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    if bytes.len() < 20 || &bytes[..8] != MAGIC {
        return Err(SnapshotError::NotASnapshot);
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default());
    if version != VERSION {
        return Err(SnapshotError::Version(version));
    }
    let sum = u64::from_le_bytes(bytes[12..20].try_into().unwrap_or_default());
    let body = &bytes[20..];
    if xxh3_64(body) != sum {
        return Err(SnapshotError::Checksum);
    }
    rmp_serde::from_slice(body).map_err(|e| SnapshotError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Snapshot {
        Snapshot {
            keys_fingerprint: 7,
            pods: vec![PodSnapshot {
                model: "m".into(),
                pod: "p".into(),
                dp_rank: Some(0),
                block_size: Some(16),
                last_seq: Some(41),
                incomplete: false,
                non_full_groups: vec![1],
                blocks: vec![(1, 2, [1, 0, 0]), (3, 4, [0, 2, 0])],
                parents: vec![None, Some(1)],
            }],
        }
    }

    #[test]
    fn round_trips_and_refuses_damage() {
        let bytes = encode(&sample());
        assert_eq!(decode(&bytes).unwrap(), sample());
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(decode(&flipped), Err(SnapshotError::Checksum));
        assert_eq!(decode(b"hello"), Err(SnapshotError::NotASnapshot));
        let mut v2 = bytes.clone();
        v2[8] = 2;
        assert_eq!(decode(&v2), Err(SnapshotError::Version(2)));
        for cut in [0, 10, 19, 25, bytes.len() - 1] {
            assert!(decode(&bytes[..cut]).is_err());
        }
    }

    /// A snapshot from before `parents` existed (same version, one field
    /// fewer) still loads, with no parents.
    #[test]
    fn snapshots_without_parents_still_load() {
        #[derive(Serialize)]
        struct OldPod {
            model: String,
            pod: String,
            dp_rank: Option<u32>,
            block_size: Option<u32>,
            last_seq: Option<u64>,
            incomplete: bool,
            non_full_groups: Vec<u32>,
            blocks: Vec<SnapshotBlock>,
        }
        #[derive(Serialize)]
        struct Old {
            keys_fingerprint: u64,
            pods: Vec<OldPod>,
        }
        let old = Old {
            keys_fingerprint: 7,
            pods: vec![OldPod {
                model: "m".into(),
                pod: "p".into(),
                dp_rank: Some(0),
                block_size: Some(16),
                last_seq: Some(41),
                incomplete: false,
                non_full_groups: vec![1],
                blocks: vec![(1, 2, [1, 0, 0]), (3, 4, [0, 2, 0])],
            }],
        };
        let body = rmp_serde::to_vec(&old).unwrap();
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.extend_from_slice(&xxh3_64(&body).to_le_bytes());
        bytes.extend_from_slice(&body);
        let mut want = sample();
        want.pods[0].parents.clear();
        assert_eq!(decode(&bytes).unwrap(), want);
    }
}

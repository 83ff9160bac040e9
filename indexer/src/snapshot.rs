//! The index on disk: every pod's blocks (hash, key, per-tier counts), its
//! last seq and flags, so a restarted indexer continues where it stopped and
//! asks the pods' replay buffers only for what came after.
//!
//! Format (version 3):
//!
//! ```text
//! "KVIXSNAP"  version (u32 LE)  key fingerprint (u64 LE)
//! { 1, pod (msgpack PodSnapshot) }*  { 2, runs (msgpack [model, runs::Dump]) }*  0
//! xxh3-64 of every byte before it (u64 LE)
//! ```
//!
//! Each pod's record keeps what its events taught (block sizes, groups
//! that are not full attention) and its stream's place, and names the id
//! its blocks go by in the runs; the blocks are the runs themselves, one
//! record per model and key kind (engine keys, token keys), about the size
//! of the index: a shared prefix's keys once, not once per pod holding it.
//!
//! Version 2, which this build still reads, listed each pod's blocks in its
//! own record, (engine hash, key, stores per tier) with each one's parent,
//! written one pod at a time; its blocks are stored into the runs on
//! restore (`PodFeed::import_blocks`).
//!
//! The checksum is a trailer because a stream only knows it at its end. A
//! wrong magic, version or checksum, a record that does not decode, or a
//! snapshot written under another key configuration, is refused as a whole:
//! the reader checks the whole file before it hands out the first pod.
//! (Version 1 was one msgpack body with its checksum in the header: it had
//! to be built in memory whole before a byte was written.)

use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};

use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::index::{RepeatRecord, RunRecord};

const MAGIC: &[u8; 8] = b"KVIXSNAP";
pub const VERSION: u32 = 3;
/// The oldest version read.
const OLDEST: u32 = 2;
/// Magic, version, key fingerprint.
const HEADER: u64 = 20;
/// The checksum.
const TRAILER: u64 = 8;
const POD: u8 = 1;
const RUNS: u8 = 2;
const END: u8 = 0;

/// One held block: (engine hash, key, count per tier).
pub type SnapshotBlock = (u64, u64, [u32; crate::event::TIERS]);

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
    /// (engine hash, key, counts per tier), least recently stored first
    /// (by hash when written by an unbounded index, which keeps no store
    /// order: a capacity set at the restart then evicts them in that order).
    pub blocks: Vec<SnapshotBlock>,
    /// Each block's parent hash, parallel to `blocks` (what keeps a restored
    /// pod's prefix closure known).
    pub parents: Vec<Option<u64>>,
    /// The offloaded block size the pod's events gave (older vLLM's
    /// token-less stores), which its chunks are counted by. Last, and
    /// defaulted: snapshots written before it was kept still read.
    #[serde(default)]
    pub offload_block_size: Option<u32>,
    /// The fingerprint of the batch `last_seq` names: a restarted indexer
    /// checks the pod's replay buffer still holds that batch, or the pod
    /// restarted meanwhile. Defaulted, as `offload_block_size`.
    #[serde(default)]
    pub last_fingerprint: Option<u64>,
    /// The pod's id in the snapshot's runs records (version 3; its
    /// `blocks` are then empty).
    #[serde(default)]
    pub runs_id: Option<u32>,
    /// Its pages are EAGLE's bigrams (SGLang). Defaulted, as the others.
    #[serde(default)]
    pub bigram: bool,
    /// The engine its stores showed (`event::Engine` as a number).
    #[serde(default)]
    pub engine: u8,
}

/// One record of a snapshot.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    Pod(Box<PodSnapshot>),
    /// Every block of one model of one key kind (version 3), handed to the
    /// reader's `RunsSink` run by run as it was read.
    Runs {
        model: String,
    },
}

/// Takes a runs record as it is read, a run at a time: a dump is about
/// the size of the index, and restoring it from a decoded copy would hold
/// the index twice. `begin`, then `run` for each run in order, then `end`;
/// an error refuses the snapshot.
pub trait RunsSink {
    fn begin(&mut self, model: &str, token_keys: bool, clock: u32) -> Result<(), String>;
    fn run(&mut self, run: RunRecord) -> Result<(), String>;
    fn end(&mut self, repeats: Vec<RepeatRecord>) -> Result<(), String>;
}

/// Reads runs and keeps none (a check that they decode).
pub struct SkipRuns;

impl RunsSink for SkipRuns {
    fn begin(&mut self, _: &str, _: bool, _: u32) -> Result<(), String> {
        Ok(())
    }
    fn run(&mut self, _: RunRecord) -> Result<(), String> {
        Ok(())
    }
    fn end(&mut self, _: Vec<RepeatRecord>) -> Result<(), String> {
        Ok(())
    }
}

/// Each runs record whole, as a `Dump` (tests, tools: small snapshots).
#[derive(Debug, Default)]
pub struct CollectRuns(pub Vec<(String, crate::index::Dump)>);

impl RunsSink for CollectRuns {
    fn begin(&mut self, model: &str, token_keys: bool, clock: u32) -> Result<(), String> {
        let dump = crate::index::Dump {
            token_keys,
            clock,
            ..Default::default()
        };
        self.0.push((model.to_string(), dump));
        Ok(())
    }
    fn run(&mut self, run: RunRecord) -> Result<(), String> {
        self.0.last_mut().expect("begun").1.runs.push(run);
        Ok(())
    }
    fn end(&mut self, repeats: Vec<RepeatRecord>) -> Result<(), String> {
        self.0.last_mut().expect("begun").1.repeats = repeats;
        Ok(())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotError {
    #[error("not a kv-indexer snapshot")]
    NotASnapshot,
    #[error("snapshot format version {0} (this build reads versions {OLDEST} to {VERSION})")]
    Version(u32),
    #[error("snapshot is corrupt (checksum mismatch)")]
    Checksum,
    #[error("snapshot cannot be decoded: {0}")]
    Decode(String),
    #[error(
        "snapshot was written with another key configuration (key mode, hash algorithm or seed)"
    )]
    KeysChanged,
    #[error("cannot read snapshot: {0}")]
    Io(String),
}

impl From<io::Error> for SnapshotError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof => SnapshotError::Decode("truncated".into()),
            _ => SnapshotError::Io(e.to_string()),
        }
    }
}

/// Writes a snapshot to `out`, one pod at a time, hashing as it goes; it
/// buffers what it writes (64 KiB at a time reach `out`), so `out` need
/// not.
pub struct SnapshotWriter<W: Write> {
    out: W,
    hash: Xxh3,
    /// Bytes not yet hashed and written: the encoder writes a value at a
    /// time (9 bytes a key), and hashing that many small pieces took most
    /// of a snapshot's writing, which ingest waits for.
    pending: Vec<u8>,
}

/// Bytes hashed and written at once.
const PENDING: usize = 1 << 16;

impl<W: Write> Write for SnapshotWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.pending.extend_from_slice(buf);
        if self.pending.len() >= PENDING {
            self.drain()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.drain()?;
        self.out.flush()
    }
}

impl<W: Write> SnapshotWriter<W> {
    /// Starts a snapshot of keys computed under `keys_fingerprint`.
    pub fn new(out: W, keys_fingerprint: u64) -> io::Result<Self> {
        let mut w = SnapshotWriter {
            out,
            hash: Xxh3::new(),
            pending: Vec::with_capacity(PENDING),
        };
        w.write_all(MAGIC)?;
        w.write_all(&VERSION.to_le_bytes())?;
        w.write_all(&keys_fingerprint.to_le_bytes())?;
        Ok(w)
    }

    /// Hashes and writes what is pending.
    fn drain(&mut self) -> io::Result<()> {
        self.hash.update(&self.pending);
        self.out.write_all(&self.pending)?;
        self.pending.clear();
        Ok(())
    }

    pub fn pod(&mut self, pod: &PodSnapshot) -> io::Result<()> {
        self.write_all(&[POD])?;
        rmp_serde::encode::write(self, pod).map_err(io::Error::other)
    }

    /// The blocks of one model of one key kind, after every pod: a `Dump`,
    /// or a `DumpView` of the index itself.
    pub fn runs(&mut self, model: &str, dump: &impl Serialize) -> io::Result<()> {
        self.write_all(&[RUNS])?;
        rmp_serde::encode::write(self, &(model, dump)).map_err(io::Error::other)
    }

    /// Ends the snapshot (end mark, checksum) and flushes it; returns the
    /// writer it went to.
    pub fn finish(mut self) -> io::Result<W> {
        self.write_all(&[END])?;
        self.drain()?;
        let sum = self.hash.digest();
        self.out.write_all(&sum.to_le_bytes())?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Reads a snapshot one record at a time, after `open` checked all of it.
pub struct SnapshotReader<R: Read + Seek> {
    input: Counted<BufReader<R>>,
    version: u32,
    keys_fingerprint: u64,
    /// Where the end mark is.
    end: u64,
}

impl<R: Read + Seek> SnapshotReader<R> {
    /// Checks the whole snapshot (magic, version, checksum, every record
    /// decodes and they end where the checksum begins), two passes over the
    /// input that keep at most one pod in memory, so that nothing is
    /// restored from a snapshot that is then refused.
    pub fn open(input: R) -> Result<Self, SnapshotError> {
        let mut input = BufReader::with_capacity(1 << 16, input);
        let len = input.seek(SeekFrom::End(0))?;
        input.rewind()?;
        let mut head = [0u8; 12];
        if input.read_exact(&mut head).is_err() || &head[..8] != MAGIC {
            return Err(SnapshotError::NotASnapshot);
        }
        let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if !(OLDEST..=VERSION).contains(&version) {
            return Err(SnapshotError::Version(version));
        }
        if len < HEADER + 1 + TRAILER {
            return Err(SnapshotError::Decode("truncated".into()));
        }
        input.rewind()?;
        let mut hash = Xxh3::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut left = len - TRAILER;
        while left > 0 {
            let n = (buf.len() as u64).min(left) as usize;
            input.read_exact(&mut buf[..n])?;
            hash.update(&buf[..n]);
            left -= n as u64;
        }
        if u64::from_le_bytes(read_array(&mut input)?) != hash.digest() {
            return Err(SnapshotError::Checksum);
        }
        let mut reader = SnapshotReader {
            input: Counted { inner: input, n: 0 },
            version,
            keys_fingerprint: 0,
            end: len - TRAILER - 1,
        };
        reader.start()?;
        while reader.next_record(&mut SkipRuns)?.is_some() {}
        reader.start()?;
        Ok(reader)
    }

    /// Back to the first pod.
    fn start(&mut self) -> Result<(), SnapshotError> {
        self.input.inner.seek(SeekFrom::Start(12))?;
        self.input.n = 12;
        self.keys_fingerprint = u64::from_le_bytes(read_array(&mut self.input)?);
        Ok(())
    }

    /// Fingerprint of the key configuration the keys were computed with.
    pub fn keys_fingerprint(&self) -> u64 {
        self.keys_fingerprint
    }

    /// The format version it was written in.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The next record, or `None` after the last. A runs record's runs go
    /// to `sink` as they are read.
    pub fn next_record(
        &mut self,
        sink: &mut dyn RunsSink,
    ) -> Result<Option<Record>, SnapshotError> {
        let [mark] = read_array(&mut self.input)?;
        let decoded = |e: rmp_serde::decode::Error| SnapshotError::Decode(e.to_string());
        match mark {
            END if self.input.n == self.end + 1 => Ok(None),
            END => Err(SnapshotError::Decode("ends before its checksum".into())),
            POD if self.input.n <= self.end => rmp_serde::from_read(&mut self.input)
                .map(|p| Some(Record::Pod(Box::new(p))))
                .map_err(decoded),
            RUNS if self.input.n <= self.end && self.version >= 3 => {
                let mut input = rmp_serde::Deserializer::new(&mut self.input);
                RunsRecord(sink)
                    .deserialize(&mut input)
                    .map(|model| Some(Record::Runs { model }))
                    .map_err(decoded)
            }
            _ => Err(SnapshotError::Decode(format!(
                "record mark {mark} at byte {}",
                self.input.n - 1
            ))),
        }
    }
}

/// A runs record, `(model, Dump)`, read into a sink: `Dump`'s fields in
/// its order, its runs one at a time.
struct RunsRecord<'s>(&'s mut dyn RunsSink);

impl<'de> DeserializeSeed<'de> for RunsRecord<'_> {
    type Value = String;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        d.deserialize_tuple(2, self)
    }
}

impl<'de> Visitor<'de> for RunsRecord<'_> {
    type Value = String;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a model and its runs")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<String, A::Error> {
        let missing = || de::Error::custom("a runs record ends early");
        let model: String = seq.next_element()?.ok_or_else(missing)?;
        seq.next_element_seed(DumpFields {
            model: &model,
            sink: self.0,
        })?
        .ok_or_else(missing)?;
        Ok(model)
    }
}

struct DumpFields<'a, 's> {
    model: &'a str,
    sink: &'s mut dyn RunsSink,
}

impl<'de> DeserializeSeed<'de> for DumpFields<'_, '_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        const FIELDS: &[&str] = &["token_keys", "clock", "runs", "repeats"];
        d.deserialize_struct("Dump", FIELDS, self)
    }
}

impl<'de> Visitor<'de> for DumpFields<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a dump")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let missing = || de::Error::custom("a dump ends early");
        let token_keys: bool = seq.next_element()?.ok_or_else(missing)?;
        let clock: u32 = seq.next_element()?.ok_or_else(missing)?;
        self.sink
            .begin(self.model, token_keys, clock)
            .map_err(de::Error::custom)?;
        seq.next_element_seed(Runs(&mut *self.sink))?
            .ok_or_else(missing)?;
        let repeats: Vec<RepeatRecord> = seq.next_element()?.ok_or_else(missing)?;
        self.sink.end(repeats).map_err(de::Error::custom)
    }
}

struct Runs<'s>(&'s mut dyn RunsSink);

impl<'de> DeserializeSeed<'de> for Runs<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Runs<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("runs")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(run) = seq.next_element::<RunRecord>()? {
            self.0.run(run).map_err(de::Error::custom)?;
        }
        Ok(())
    }
}

fn read_array<const N: usize>(input: &mut impl Read) -> io::Result<[u8; N]> {
    let mut a = [0u8; N];
    input.read_exact(&mut a)?;
    Ok(a)
}

/// A reader that counts the bytes read through it (where a record ends).
struct Counted<R> {
    inner: R,
    n: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;
    use crate::index::Dump;

    fn pod(name: &str, blocks: Vec<SnapshotBlock>) -> PodSnapshot {
        let parents = (0..blocks.len())
            .map(|i| i.checked_sub(1).map(|p| blocks[p].0))
            .collect();
        PodSnapshot {
            model: "m".into(),
            pod: name.into(),
            dp_rank: Some(0),
            block_size: Some(16),
            offload_block_size: Some(64),
            last_fingerprint: Some(0xf1),
            last_seq: Some(41),
            incomplete: false,
            non_full_groups: vec![1],
            blocks,
            parents,
            runs_id: Some(3),
            bigram: false,
            engine: 2,
        }
    }

    fn sample() -> Vec<PodSnapshot> {
        vec![
            pod("p", vec![(1, 2, [1, 0, 0]), (3, 4, [0, 2, 0])]),
            pod("empty", vec![]),
            pod("q", (0..1000).map(|h| (h, h * 7, [1, 1, 0])).collect()),
        ]
    }

    fn encode(fingerprint: u64, pods: &[PodSnapshot]) -> Vec<u8> {
        encode_with(fingerprint, pods, &[])
    }

    fn encode_with(fingerprint: u64, pods: &[PodSnapshot], runs: &[(String, Dump)]) -> Vec<u8> {
        let mut w = SnapshotWriter::new(Vec::new(), fingerprint).unwrap();
        for p in pods {
            w.pod(p).unwrap();
        }
        for (model, d) in runs {
            w.runs(model, d).unwrap();
        }
        w.finish().unwrap()
    }

    fn decode(bytes: &[u8]) -> Result<(u64, Vec<PodSnapshot>), SnapshotError> {
        let (fingerprint, pods, runs) = decode_all(bytes)?;
        assert!(runs.is_empty());
        Ok((fingerprint, pods))
    }

    type Decoded = (u64, Vec<PodSnapshot>, Vec<(String, Dump)>);

    fn decode_all(bytes: &[u8]) -> Result<Decoded, SnapshotError> {
        let mut r = SnapshotReader::open(Cursor::new(bytes))?;
        let (mut pods, mut runs) = (Vec::new(), CollectRuns::default());
        let mut models = Vec::new();
        while let Some(record) = r.next_record(&mut runs)? {
            match record {
                Record::Pod(p) => pods.push(*p),
                Record::Runs { model } => models.push(model),
            }
        }
        let named: Vec<&String> = runs.0.iter().map(|(m, _)| m).collect();
        assert_eq!(models.iter().collect::<Vec<_>>(), named);
        Ok((r.keys_fingerprint(), pods, runs.0))
    }

    /// Both key kinds' runs, after the pods, as an index dumps them.
    fn sample_runs() -> Vec<(String, Dump)> {
        let engine = crate::index::RunIndex::new();
        engine.store(3, crate::event::Tier::Gpu, None, &[11, 12, 13]);
        engine.store(4, crate::event::Tier::Cpu, Some(11), &[14]);
        let token = crate::index::RunIndex::with_token_keys();
        token.store_keyed(3, crate::event::Tier::Gpu, None, &[(21, 5), (22, 6)]);
        vec![("m".into(), engine.dump()), ("m".into(), token.dump())]
    }

    /// The checksum a damaged body is given again, so that what is tested
    /// is the check behind it.
    fn resum(bytes: &mut [u8]) {
        let n = bytes.len() - TRAILER as usize;
        let sum = xxhash_rust::xxh3::xxh3_64(&bytes[..n]);
        bytes[n..].copy_from_slice(&sum.to_le_bytes());
    }

    /// A record written before `offload_block_size` and `last_fingerprint`
    /// were kept (the same fields, two fewer) still reads, with both
    /// unknown.
    #[test]
    fn a_record_without_the_newer_fields_reads() {
        let p = pod("a", vec![(7, 8, [1, 0, 0])]);
        let before = (
            &p.model,
            &p.pod,
            p.dp_rank,
            p.block_size,
            p.last_seq,
            p.incomplete,
            &p.non_full_groups,
            &p.blocks,
            &p.parents,
        );
        let bytes = rmp_serde::to_vec(&before).unwrap();
        let read: PodSnapshot = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(
            read,
            PodSnapshot {
                offload_block_size: None,
                last_fingerprint: None,
                runs_id: None,
                bigram: false,
                engine: 0,
                ..p
            }
        );
    }

    #[test]
    fn round_trips_pod_by_pod() {
        assert_eq!(decode(&encode(7, &sample())).unwrap(), (7, sample()));
        assert_eq!(decode(&encode(9, &[])).unwrap(), (9, vec![]));
        let bytes = encode_with(7, &sample(), &sample_runs());
        assert_eq!(decode_all(&bytes).unwrap(), (7, sample(), sample_runs()));
    }

    /// An index's view writes what its dump does, byte for byte: the
    /// format is `Dump`'s, whichever wrote it.
    #[test]
    fn a_view_of_the_index_writes_its_dump() {
        let ix = crate::index::RunIndex::new();
        ix.store(3, crate::event::Tier::Gpu, None, &[11, 12, 13]);
        ix.store(4, crate::event::Tier::Cpu, Some(12), &[14, 15]);
        ix.store(4, crate::event::Tier::Cpu, Some(12), &[14]);
        ix.remove(3, crate::event::Tier::Gpu, &[13]);
        let dump = ix.dump();
        assert!(dump.runs.len() > 1 && !dump.repeats.is_empty());
        let written = rmp_serde::to_vec(&("m", &dump)).unwrap();
        let view = ix.dump_view();
        assert!(!view.is_empty());
        assert_eq!(rmp_serde::to_vec(&("m", &view)).unwrap(), written);
        drop(view);
        assert!(crate::index::RunIndex::new().dump_view().is_empty());
    }

    /// A version 2 file (pods with their blocks) still reads; a runs
    /// record, which version 2 did not have, in one is refused.
    #[test]
    fn reads_version_2_and_refuses_runs_in_it() {
        let mut bytes = encode(7, &sample());
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        resum(&mut bytes);
        let mut r = SnapshotReader::open(Cursor::new(&bytes)).unwrap();
        assert_eq!(r.version(), 2);
        assert_eq!(
            r.next_record(&mut SkipRuns).unwrap(),
            Some(Record::Pod(Box::new(sample()[0].clone())))
        );
        let mut bytes = encode_with(7, &sample(), &sample_runs());
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        resum(&mut bytes);
        assert!(matches!(decode_all(&bytes), Err(SnapshotError::Decode(_))));
    }

    #[test]
    fn the_checksum_covers_every_byte() {
        let bytes = encode(7, &sample()[..2]);
        for i in 0..bytes.len() - TRAILER as usize {
            let mut flipped = bytes.clone();
            flipped[i] ^= 0x10;
            let err = decode(&flipped).unwrap_err();
            // The magic and version are checked before the checksum.
            match i {
                0..8 => assert_eq!(err, SnapshotError::NotASnapshot, "byte {i}"),
                8..12 => assert!(matches!(err, SnapshotError::Version(_)), "byte {i}"),
                _ => assert_eq!(err, SnapshotError::Checksum, "byte {i}"),
            }
        }
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(decode(&flipped), Err(SnapshotError::Checksum));
    }

    #[test]
    fn refuses_wrong_magic_version_and_truncation() {
        let bytes = encode(7, &sample());
        assert_eq!(decode(b"hello"), Err(SnapshotError::NotASnapshot));
        let mut other = bytes.clone();
        other[..8].copy_from_slice(b"KVIXSNAQ");
        assert_eq!(decode(&other), Err(SnapshotError::NotASnapshot));
        for v in [1, 4] {
            let mut old = bytes.clone();
            old[8..12].copy_from_slice(&u32::to_le_bytes(v));
            assert_eq!(decode(&old), Err(SnapshotError::Version(v)));
        }
        for cut in [0, 10, 19, 20, 25, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    /// Bodies with a valid checksum that are still not a snapshot (what a
    /// writer bug would leave) are refused before any pod is handed out.
    #[test]
    fn refuses_bad_records_under_a_valid_checksum() {
        let bytes = encode(7, &sample());
        let n = bytes.len() - TRAILER as usize;
        // A record mark that is neither pod nor end.
        let mut bad = bytes.clone();
        bad[HEADER as usize] = 7;
        resum(&mut bad);
        assert!(matches!(decode(&bad), Err(SnapshotError::Decode(_))));
        // The end mark early: pods after it.
        let mut early = encode(7, &sample()[..1]);
        early.truncate(early.len() - TRAILER as usize);
        early.push(END);
        early.extend_from_slice(&[0; TRAILER as usize]);
        resum(&mut early);
        assert!(matches!(decode(&early), Err(SnapshotError::Decode(_))));
        // No end mark: the last pod runs into the checksum.
        let mut endless = bytes[..n - 1].to_vec();
        endless.extend_from_slice(&[0; TRAILER as usize]);
        resum(&mut endless);
        assert!(matches!(decode(&endless), Err(SnapshotError::Decode(_))));
        // A pod record that is not a pod.
        let mut garbage = bytes[..HEADER as usize].to_vec();
        garbage.extend_from_slice(&[POD, 0xc1, END, 0, 0, 0, 0, 0, 0, 0, 0]);
        resum(&mut garbage);
        assert!(matches!(decode(&garbage), Err(SnapshotError::Decode(_))));
    }
}

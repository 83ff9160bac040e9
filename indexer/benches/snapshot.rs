//! What writing and loading a snapshot allocates beyond the index: an
//! index of 1M (pod, block) entries (8 pods, 64-block prompts) written
//! to a temp file as the service does, then loaded
//! into an empty indexer. Counted by the compare bench's allocator: the
//! most allocated at once during each step, and what it left allocated.
//! `cargo bench -p indexer --bench snapshot` prints the numbers; nothing is
//! asserted.

#[path = "compare/alloc.rs"]
mod alloc;

use std::fs::File;
use std::time::Instant;

use indexer::event::{BlockStored, EngineHash, EventBatch, KvEvent};
use indexer::{Indexer, IndexerConfig};

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

const BLOCK: usize = 16;
const PROMPT: usize = 64;
const PODS: usize = 8;

fn mib(bytes: isize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn fill(entries: usize) -> Indexer {
    let ix = Indexer::new(IndexerConfig::default());
    let mut x = 42u64;
    let mut rnd = move || {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        x >> 33
    };
    for p in 0..PODS {
        let pod = ix.pod("m", &format!("pod-{p}"), None);
        let mut next = 0u64;
        for seq in 0..(entries / PODS).div_ceil(PROMPT) as u64 {
            let hashes: Vec<EngineHash> = (0..PROMPT)
                .map(|_| {
                    next += 1;
                    EngineHash((p as u64) << 40 | next)
                })
                .collect();
            let tokens = (0..PROMPT * BLOCK)
                .map(|_| rnd() as u32 % 150_000)
                .collect();
            let batch = EventBatch {
                events: vec![KvEvent::Stored(BlockStored {
                    block_hashes: hashes,
                    token_ids: tokens,
                    block_size: Some(BLOCK as u32),
                    ..Default::default()
                })],
                ..Default::default()
            };
            ix.apply(&pod, seq, &batch);
        }
    }
    ix
}

fn main() {
    // `cargo test --all-targets` runs benches without `--bench`: keep that short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let entries = if quick { 20_000 } else { 1_000_000 };
    let (ix, index) = alloc::retained(|| fill(entries));
    let file =
        std::env::temp_dir().join(format!("kv-indexer-bench-{}.snapshot", std::process::id()));
    println!(
        "snapshot of {} entries ({PODS} pods), index {} allocated",
        ix.entries(),
        mib(index)
    );

    let t = Instant::now();
    let mut cut = None;
    let (written, kept, peak) = alloc::allocated(|| {
        let out = ix.export(File::create(&file)?)?;
        // What ingest waits for: `export` holds the pods' locks throughout.
        cut = Some(t.elapsed());
        out.sync_all()
    });
    written.expect("snapshot written");
    let bytes = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    println!(
        "write: {:?} (ingest waits {:?} of it), {:.1} MiB file, peak {} above the index ({} left)",
        t.elapsed(),
        cut.expect("written"),
        bytes as f64 / (1 << 20) as f64,
        mib(peak),
        mib(kept)
    );
    drop(ix);

    let restored = Indexer::new(IndexerConfig::default());
    let t = Instant::now();
    let (pods, kept, peak) =
        alloc::allocated(|| restored.import(File::open(&file).expect("snapshot")));
    println!(
        "load: {:?}, {} pods, peak {} above the index it built ({})",
        t.elapsed(),
        pods.expect("snapshot loads"),
        mib(peak - kept),
        mib(kept)
    );
    let _ = std::fs::remove_file(&file);
}

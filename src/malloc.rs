//! glibc's allocator, told to give large blocks their own mappings.
//!
//! Why: glibc serves an allocation of at least its mmap threshold
//! (128 KiB at start) from a mapping of its own, returned to the system
//! on free, and anything smaller from its heaps. But the threshold is
//! dynamic: each time a mapped block is freed, it rises to that block's
//! size (up to 32 MiB). The index's large tables (its run list, its hash
//! tables, the readers' table of run heads, rebuilt under churn) are
//! exactly such blocks, so after the first one is freed the next ones
//! land in the heaps among small live blocks, and every rebuild leaves a
//! hole there that only small blocks fill again. At capacity, under
//! endless stores (`tests/it/memory.rs`), the process grew by 70-109 bytes
//! per capacity unit after it was first full (14-21 MiB), and settled at
//! 200-238 bytes per unit, of the 256 `--max-memory` assumes. With the
//! threshold pinned (which also turns the dynamic rule off) it grows by
//! about 10 and settles at about 140: the same index, half the
//! fragmentation.
//!
//! 1 MiB, not glibc's 128 KiB: a Score request's buffers (a 32K-token
//! prompt is ~130 KB) come and go per request, and from the heap they are
//! reused without a system call; 128 KiB measured the same at capacity.
//! The trim threshold is set with it (see `TRIM_THRESHOLD`). Score under
//! ingest (2,000/s, 100K blocks/s) measured the same with and without
//! both, in alternating runs. An operator's `MALLOC_MMAP_THRESHOLD_`
//! (glibc's own setting) wins: then neither is set.
//! Other allocators and C libraries have their own rules: nothing is done
//! there.

/// The threshold set, in bytes.
pub const MMAP_THRESHOLD: usize = 1 << 20;

/// What a heap keeps free at its top before it gives it back: twice the
/// mmap threshold, glibc's own rule while the threshold is dynamic. (Left
/// at its 128 KiB default, the ingest threads' heaps were trimmed and
/// touched again 60 times a second under load, each trim a system call of
/// ~70 us and page faults after it.)
pub const TRIM_THRESHOLD: usize = 2 * MMAP_THRESHOLD;

/// What `pin_mmap_threshold` did, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pinned {
    /// Set to `MMAP_THRESHOLD` (and the trim threshold to `TRIM_THRESHOLD`).
    Set,
    /// The environment set it (`MALLOC_MMAP_THRESHOLD_`).
    ByEnvironment,
    /// glibc refused it.
    Refused,
    /// Not glibc.
    NotGlibc,
}

/// Pins glibc's mmap threshold at `MMAP_THRESHOLD` and its trim threshold
/// at `TRIM_THRESHOLD`; call it first thing in `main`, before the threads
/// and tables it is for.
pub fn pin_mmap_threshold() -> Pinned {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return Pinned::ByEnvironment;
    }
    pin()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn pin() -> Pinned {
    // One call that no crate in the tree wraps.
    // SAFETY: `mallopt` takes two integers and changes only the
    // allocator's parameters (under its own lock); no pointer is involved.
    #[allow(unsafe_code)]
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
    };
    if ok {
        Pinned::Set
    } else {
        Pinned::Refused
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn pin() -> Pinned {
    Pinned::NotGlibc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_both_thresholds() {
        // `pin`, not `pin_mmap_threshold`: whatever the test's environment.
        assert_eq!(pin(), Pinned::Set);
    }
}

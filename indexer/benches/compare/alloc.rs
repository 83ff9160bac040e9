//! A counting global allocator, switched on only around a memory pass so the
//! timed passes pay one relaxed load per allocation and nothing else. The
//! snapshot bench includes it too (by path).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

pub struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

/// `LIVE` grew by `by` bytes: raise `PEAK` to it.
fn grew(by: isize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// The one unsafe item in the workspace: `GlobalAlloc` is an unsafe trait.
// Every call forwards to `System` unchanged; only the counter is ours.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ON.load(Ordering::Relaxed) {
            grew(layout.size() as isize);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if ON.load(Ordering::Relaxed) {
            grew(layout.size() as isize);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if ON.load(Ordering::Relaxed) {
            LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ON.load(Ordering::Relaxed) {
            grew(new_size as isize - layout.size() as isize);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Bytes allocated and not freed while `f` ran (everything `f` leaves
/// behind, e.g. an index it filled), and `f`'s result.
pub fn retained<R>(f: impl FnOnce() -> R) -> (R, isize) {
    let (r, kept, _) = allocated(f);
    (r, kept)
}

/// `f`'s result, the bytes it left allocated (as `retained`) and the most
/// it had allocated at once (blocks it freed before it returned included).
pub fn allocated<R>(f: impl FnOnce() -> R) -> (R, isize, isize) {
    LIVE.store(0, Ordering::SeqCst);
    PEAK.store(0, Ordering::SeqCst);
    ON.store(true, Ordering::SeqCst);
    let r = f();
    ON.store(false, Ordering::SeqCst);
    (r, LIVE.load(Ordering::SeqCst), PEAK.load(Ordering::SeqCst))
}

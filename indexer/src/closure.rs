//! What a reader may assume about one pod's blocks in the index without
//! taking the pod's lock: whether they are prefix-closed on one tier, which
//! is what lets `score::jump` binary-search the pod.
//!
//! A seqlock, but one the writer opens only when it must. Each index flush
//! of a pod (one event's changes) is all acquires or all releases. If the
//! pod is closed on tier T before the flush and after it, every state a
//! reader can see meanwhile lies between the two (a superset of the smaller,
//! a subset of the larger), so a binary search over it still lands between
//! the pod's match before and its match after: an answer the pod had, or one
//! the event passed through, just as a block-by-block walk racing the same
//! event would give. Only a flush that breaks or restores closure (a hole
//! from lost events, an eviction of inner blocks, a second tier, a snapshot
//! import) opens the seqlock, and a reader that overlapped it walks instead.
//! So ingest, which is almost all closure-keeping, no longer sends every
//! concurrent reader of the pod being written down the slow walk.

use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};

use crate::event::Tier;

const NOT_CLOSED: u8 = u8::MAX;

/// Published by the pod's writer (under its lock), read by anyone.
#[derive(Debug)]
pub struct Closure {
    /// Odd while a closure-changing flush is being applied.
    version: AtomicU64,
    /// The tier every held block is on, if the held set is prefix-closed.
    tier: AtomicU8,
}

impl Default for Closure {
    /// An empty pod: closed (vacuously), on any tier.
    fn default() -> Self {
        Closure {
            version: AtomicU64::new(0),
            tier: AtomicU8::new(Tier::Gpu.index() as u8),
        }
    }
}

/// A reader's view, to check with [`Closure::unchanged`] after reading.
#[derive(Clone, Copy, Debug)]
pub struct ClosedView {
    pub tier: Tier,
    version: u64,
}

impl Closure {
    /// The pod's tier if it may be binary-searched now.
    pub fn view(&self) -> Option<ClosedView> {
        let version = self.version.load(Ordering::Acquire);
        let tier = self.tier.load(Ordering::Relaxed);
        if version % 2 == 1 || tier == NOT_CLOSED {
            return None;
        }
        Some(ClosedView {
            tier: Tier::ALL[tier as usize],
            version,
        })
    }

    /// True if no closure-changing flush overlapped the reads made since
    /// `view`.
    pub fn unchanged(&self, view: ClosedView) -> bool {
        fence(Ordering::Acquire);
        self.version.load(Ordering::Relaxed) == view.version
    }

    pub fn is_closed(&self) -> bool {
        self.tier.load(Ordering::Relaxed) != NOT_CLOSED
    }

    /// Before changing the index in a way readers must not binary-search.
    pub(crate) fn open(&self) {
        self.version.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
    }

    /// After those changes: publishes the new closure state.
    pub(crate) fn close(&self, tier: Option<Tier>) {
        self.tier.store(
            tier.map_or(NOT_CLOSED, |t| t.index() as u8),
            Ordering::Relaxed,
        );
        self.version.fetch_add(1, Ordering::Release);
    }
}

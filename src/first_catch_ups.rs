//! What readiness waits for after a restored start (a peer's index or the
//! snapshot file): the first catch-up of every pod.
//!
//! A restored index is the pods as they were when it was cut. Until each
//! pod's stream is followed from there to now the index could still
//! credit a pod with blocks it has since evicted. So the service reports
//! Ready once every pod is caught up, or its catch-up failed (the pod is
//! flagged incomplete, or the stream repairs on its next gap), or the wait
//! (`--catch-up-wait`) is over: a pod that never connects or never
//! publishes does not hold a replica back for longer.
//!
//! - Dial mode (`Waits::Dialed`): each pod dialed at start; its replay
//!   buffer, fetched when its connection comes up, brings it to now.
//! - Bind mode (`Waits::Restored`): each restored pod with a replay
//!   endpoint (`--replay-endpoint`): its buffer is fetched when its writer
//!   adopts it, without waiting for it to publish (it may be idle). A pod
//!   without one has nothing to catch up from; its next batch shows any
//!   gap, and a gap it cannot repair flags it incomplete.
//!
//! Each such pod holds a `Pending`, passed with its catch-up to the worker
//! that applies it; the last clone dropped counts that pod done.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which pods readiness waits for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Waits {
    /// None: the index started empty.
    #[default]
    Nothing,
    /// The pods dialed at start.
    Dialed,
    /// The pods restored (they connect to us).
    Restored,
}

#[derive(Default)]
pub struct FirstCatchUps {
    waits: Waits,
    /// Pods tracked from now on are waited for.
    open: AtomicBool,
    /// The dial thread has taken its first list of targets.
    listed: AtomicBool,
    pending: AtomicUsize,
}

/// One dialed pod's first catch-up, outstanding while any clone lives.
pub struct Pending(Arc<FirstCatchUps>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

impl FirstCatchUps {
    /// Waiting for `waits`' pods until the wait is over.
    pub fn new(waits: Waits) -> Arc<FirstCatchUps> {
        Arc::new(FirstCatchUps {
            waits,
            open: AtomicBool::new(waits != Waits::Nothing),
            ..FirstCatchUps::default()
        })
    }

    /// A pod being dialed: waited for, if the window is open.
    pub fn track(self: &Arc<Self>) -> Option<Arc<Pending>> {
        self.track_if(Waits::Dialed)
    }

    /// A restored pod given to its writer: waited for in bind mode.
    pub fn track_restored(self: &Arc<Self>) -> Option<Arc<Pending>> {
        self.track_if(Waits::Restored)
    }

    /// Whether restored pods are what is waited for.
    pub fn waits_for_restored(&self) -> bool {
        self.waits == Waits::Restored
    }

    fn track_if(self: &Arc<Self>, waits: Waits) -> Option<Arc<Pending>> {
        if self.waits != waits || !self.open.load(Ordering::Acquire) {
            return None;
        }
        self.pending.fetch_add(1, Ordering::AcqRel);
        Some(Arc::new(Pending(self.clone())))
    }

    /// Every pod waited for is tracked: the dial thread's first list of
    /// targets, or every restored pod.
    pub fn listed(&self) {
        self.listed.store(true, Ordering::Release);
    }

    /// Waits until every tracked pod was caught up, or `wait` has passed;
    /// then tracks no more. Returns how many were still outstanding.
    pub async fn wait(&self, wait: Duration) -> usize {
        let deadline = Instant::now() + wait;
        let left = loop {
            // `listed` first: the dial thread tracks a list's pods before
            // it says it has one, so pods counted after this read are in
            // the `pending` read next.
            let listed = self.listed.load(Ordering::Acquire);
            let left = self.pending.load(Ordering::Acquire);
            if !self.open.load(Ordering::Acquire) || (listed && left == 0) {
                break 0;
            }
            if Instant::now() >= deadline {
                break left;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        self.open.store(false, Ordering::Release);
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waits_for_every_clone_of_every_pending_pod() {
        let first = FirstCatchUps::new(Waits::Dialed);
        let a = first.track().unwrap();
        let b = first.track().unwrap();
        let a2 = a.clone();
        first.listed();
        drop(a);
        drop(b);
        assert_eq!(first.wait(Duration::from_millis(30)).await, 1, "a2 lives");
        assert!(first.track().is_none(), "closed after the wait");
        drop(a2);
        assert_eq!(first.pending.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn each_mode_waits_for_its_own_pods() {
        let bound = FirstCatchUps::new(Waits::Restored);
        assert!(bound.track().is_none(), "nothing is dialed");
        let held = bound.track_restored().unwrap();
        bound.listed();
        assert_eq!(bound.wait(Duration::from_millis(20)).await, 1);
        drop(held);
        let dialing = FirstCatchUps::new(Waits::Dialed);
        assert!(dialing.track_restored().is_none(), "dialed pods only");
        assert!(dialing.track().is_some());
    }

    #[tokio::test]
    async fn a_closed_window_waits_for_nothing() {
        let first = FirstCatchUps::new(Waits::Nothing);
        assert!(first.track().is_none());
        assert_eq!(first.wait(Duration::from_secs(60)).await, 0);
    }

    #[tokio::test]
    async fn nothing_listed_yet_is_not_done() {
        let first = FirstCatchUps::new(Waits::Dialed);
        assert_eq!(first.wait(Duration::from_millis(20)).await, 0);
        let first = FirstCatchUps::new(Waits::Dialed);
        let _held = first.track();
        assert_eq!(first.wait(Duration::from_millis(20)).await, 1);
    }
}

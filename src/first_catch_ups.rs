//! What readiness waits for after a restored start (a peer's index or the
//! snapshot file): the first catch-up of every pod dialed at start.
//!
//! A restored index is the pods as they were when it was cut; each dialed
//! pod's replay buffer, fetched when its connection comes up, brings it to
//! now (or shows that the pod restarted, or that the gap cannot be
//! repaired: the pod is then flagged incomplete). Until that is applied the
//! index could still credit a pod with blocks it has since evicted. So the
//! service reports Ready once every pod it dials at start has been caught
//! up, or its catch-up failed (the stream repairs on its next gap), or the
//! wait (`--catch-up-wait`) is over: a pod that never connects does not
//! hold a replica back for longer.
//!
//! Each pod dialed while the window is open holds a `Pending`, passed with
//! its catch-up to the workers that apply it; the last clone dropped counts
//! that pod done.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Default)]
pub struct FirstCatchUps {
    /// Pods dialed from now on are waited for.
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
    /// Waiting for nothing (`open: false`), or for the pods dialed until
    /// `close`.
    pub fn new(open: bool) -> Arc<FirstCatchUps> {
        Arc::new(FirstCatchUps {
            open: AtomicBool::new(open),
            ..FirstCatchUps::default()
        })
    }

    /// A pod being dialed: waited for, if the window is open.
    pub fn track(self: &Arc<Self>) -> Option<Arc<Pending>> {
        if !self.open.load(Ordering::Acquire) {
            return None;
        }
        self.pending.fetch_add(1, Ordering::AcqRel);
        Some(Arc::new(Pending(self.clone())))
    }

    /// The dial thread has its first list of targets (they are tracked).
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
        let first = FirstCatchUps::new(true);
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
    async fn a_closed_window_waits_for_nothing() {
        let first = FirstCatchUps::new(false);
        assert!(first.track().is_none());
        assert_eq!(first.wait(Duration::from_secs(60)).await, 0);
    }

    #[tokio::test]
    async fn nothing_listed_yet_is_not_done() {
        let first = FirstCatchUps::new(true);
        assert_eq!(first.wait(Duration::from_millis(20)).await, 0);
        let first = FirstCatchUps::new(true);
        let _held = first.track();
        assert_eq!(first.wait(Duration::from_millis(20)).await, 1);
    }
}

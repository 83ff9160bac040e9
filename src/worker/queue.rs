//! The bytes the queues between the receive loops and the workers may
//! hold, and what a full queue refused (for its worker to fetch from the
//! pods' replay buffers).

use super::*;

/// What the ingest queues may hold, in bytes, per worker: a count alone is
/// either too shallow for a stream of 1-block decode batches (a worker
/// descheduled for 80 ms dropped 4,096 of them) or, times a 4 MiB message,
/// far more memory than anyone budgeted. And what each queue had to refuse
/// (see `DroppedBatches`).
pub struct QueueBudget {
    queued: Vec<AtomicUsize>,
    max_bytes: usize,
    dropped: Vec<parking_lot::Mutex<DroppedBatches>>,
}

/// Live batches a worker's full queue refused, newest seq per (topic,
/// connection), for the worker to fetch from the pods' replay buffers
/// rather than wait for each pod's next batch to show the gap (which for a
/// pod gone quiet never comes).
///
/// Not a message on a queue: a notice must not overtake the pod's batches
/// still queued before it (a repair started then would ask for batches
/// that are on their way, and take them for another run when they come),
/// and under overload a notice per drop would fill any bounded queue. The
/// worker takes them only once its queue is empty, when every batch queued
/// before a drop has been seen; coalesced per topic, they are bounded.
pub type DroppedBatches = HashMap<(Bytes, ConnId), u64>;

/// Topics with drops noted per worker; past it, a drop is left for the
/// pod's next batch to show.
const MAX_DROPPED_TOPICS: usize = 4096;

impl QueueBudget {
    pub fn new(workers: usize, max_bytes: usize) -> Self {
        QueueBudget {
            queued: (0..workers).map(|_| AtomicUsize::new(0)).collect(),
            max_bytes,
            dropped: (0..workers).map(|_| Default::default()).collect(),
        }
    }

    /// What a queued frame holds: its bytes and its bookkeeping.
    pub fn cost(frame: &Frame) -> usize {
        frame.payload.len() + frame.topic.len() + 128
    }

    /// Room for `n` more bytes in `worker`'s queue, taken; false if full.
    pub fn take(&self, worker: usize, n: usize) -> bool {
        let queued = &self.queued[worker];
        let mut now = queued.load(Ordering::Relaxed);
        loop {
            if now + n > self.max_bytes {
                return false;
            }
            match queued.compare_exchange_weak(now, now + n, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(actual) => now = actual,
            }
        }
    }

    pub fn release(&self, worker: usize, n: usize) {
        self.queued[worker].fetch_sub(n, Ordering::Relaxed);
    }

    /// Notes that `worker`'s queue refused `frame`.
    pub(super) fn note_dropped(&self, worker: usize, frame: Frame) {
        let mut dropped = self.dropped[worker].lock();
        let at_bound = dropped.len() >= MAX_DROPPED_TOPICS;
        match dropped.entry((frame.topic, frame.conn)) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                *e.get_mut() = (*e.get()).max(frame.seq);
            }
            std::collections::hash_map::Entry::Vacant(e) if !at_bound => {
                e.insert(frame.seq);
            }
            std::collections::hash_map::Entry::Vacant(_) => {}
        }
    }

    /// The drops noted for `worker` so far, taken.
    pub(super) fn take_dropped(&self, worker: usize) -> DroppedBatches {
        std::mem::take(&mut *self.dropped[worker].lock())
    }
}

/// Queues a live batch for `worker` within its queue's bounds in messages
/// and bytes, never waiting on them: false, with nothing queued and the
/// drop noted for the worker (see `DroppedBatches`), when either is full.
/// Disconnected only when shutting down: counted as queued.
pub fn offer_live(
    queues: &[flume::Sender<Work>],
    budget: &QueueBudget,
    worker: usize,
    frame: Frame,
) -> bool {
    let cost = QueueBudget::cost(&frame);
    if !budget.take(worker, cost) {
        budget.note_dropped(worker, frame);
        return false;
    }
    match queues[worker].try_send(Work::Live(frame)) {
        Ok(()) | Err(flume::TrySendError::Disconnected(_)) => true,
        Err(flume::TrySendError::Full(work)) => {
            budget.release(worker, cost);
            if let Work::Live(frame) = work {
                budget.note_dropped(worker, frame);
            }
            false
        }
    }
}

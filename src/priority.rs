//! `--ingest-priority idle`: the ingest threads yield the CPU to everything
//! else.
//!
//! Why: on a machine whose cores the service shares (with itself: Score and
//! ingest), a Score request that needs a core while an ingest worker
//! applies a 2,048-block prefill waits for the scheduler to switch, up to a
//! time slice. Under Linux's `SCHED_IDLE` policy a thread runs only when no
//! other thread of the machine wants its CPU, and a waking thread of the
//! normal policy preempts it at once. Score, whose caller waits, then never
//! waits for ingest, which has queues to absorb the delay. The price: while
//! the cores are saturated, ingest does not run at all, its queues fill and
//! then drop (counted, as always); hence opt-in.
//!
//! A thread's policy is its own: each ingest thread sets it as it starts,
//! and the threads it creates (libzmq's I/O threads, started by a context's
//! first socket) inherit it. An unprivileged thread may always lower itself
//! to `SCHED_IDLE`, but not come back, so nothing here ever raises it.

use crate::config::IngestPriority;

/// Applies `priority` to the calling thread.
pub fn apply(priority: IngestPriority) -> std::io::Result<()> {
    match priority {
        IngestPriority::Normal => Ok(()),
        IngestPriority::Idle => idle(),
    }
}

#[cfg(target_os = "linux")]
fn idle() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // One system call that no crate in the tree wraps (`thread-priority`
    // would, as a new dependency for these lines).
    // SAFETY: `param` is a valid `sched_param` for the call's duration; pid 0
    // is the calling thread (Linux's scheduling policies are per thread).
    #[allow(unsafe_code)]
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn idle() -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "--ingest-priority idle needs Linux's SCHED_IDLE",
    ))
}

/// Applies `priority` to an ingest thread as it starts; logs, and carries
/// on at the normal priority, if the system refuses (it cannot, once
/// `Ingest::start` has checked it on its first thread).
pub fn apply_or_warn(priority: IngestPriority) {
    if let Err(e) = apply(priority) {
        tracing::warn!(error = %e, "ingest thread: cannot lower its CPU priority");
    }
}

//! Rate-limited logging: per-event problems can arrive thousands of times a
//! second; one line per interval, with how many were suppressed, is enough.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub struct RateLimited {
    interval: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimited {
    pub fn new(interval: Duration) -> Self {
        RateLimited {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// Calls `log(suppressed_since_last)` at most once per interval.
    pub fn warn(&self, log: impl FnOnce(u64)) {
        let mut state = self.state.lock();
        let now = Instant::now();
        match state.0 {
            Some(last) if now.duration_since(last) < self.interval => state.1 += 1,
            _ => {
                let suppressed = std::mem::take(&mut state.1);
                state.0 = Some(now);
                drop(state);
                log(suppressed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_once_per_interval_and_reports_suppressed() {
        let r = RateLimited::new(Duration::from_secs(3600));
        let mut logged = Vec::new();
        for _ in 0..5 {
            r.warn(|s| logged.push(s));
        }
        assert_eq!(logged, vec![0]);
        let r = RateLimited::new(Duration::ZERO);
        r.warn(|s| logged.push(s));
        r.warn(|s| logged.push(s));
        assert_eq!(logged, vec![0, 0, 0]);
    }
}

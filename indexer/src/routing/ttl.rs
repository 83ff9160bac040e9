//! How long a pod's speculative entries live: fixed, or (`auto`) learned
//! from how long that pod's stores take to follow a routing.
//!
//! vLLM stores a request's blocks when it schedules it: a few ms after the
//! pick on an idle pod, hundreds of ms behind a queue, more over a slow
//! event path. A fixed TTL is either too short for the slow pods (the burst
//! scatters again) or too long for the fast ones (a request that went
//! elsewhere keeps attracting traffic). `auto` takes a high quantile of the
//! pod's recent confirmation delays times a safety factor.

use std::collections::VecDeque;
use std::time::Duration;

/// `--speculative-ttl`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TtlPolicy {
    Fixed(Duration),
    Auto,
}

/// Before a pod has this many samples, `auto` uses `AUTO_START`.
pub const MIN_SAMPLES: usize = 8;
/// The TTL of a pod `auto` knows nothing of yet (llm-d's default).
pub const AUTO_START: Duration = Duration::from_secs(2);
pub const AUTO_MIN: Duration = Duration::from_millis(100);
pub const AUTO_MAX: Duration = Duration::from_secs(10);
/// Recent delays kept per pod: old enough to ride out a spike, young
/// enough to follow a pod whose queue grew.
const WINDOW: usize = 64;
const QUANTILE: f64 = 0.95;
const SAFETY: f64 = 1.5;

/// One pod's recent confirmation delays.
#[derive(Clone, Debug, Default)]
pub struct TtlEstimator {
    delays: VecDeque<Duration>,
}

impl TtlEstimator {
    pub fn observe(&mut self, delay: Duration) {
        if self.delays.len() == WINDOW {
            self.delays.pop_front();
        }
        self.delays.push_back(delay);
    }

    pub fn samples(&self) -> usize {
        self.delays.len()
    }

    pub fn ttl(&self, policy: TtlPolicy) -> Duration {
        match policy {
            TtlPolicy::Fixed(d) => d,
            TtlPolicy::Auto if self.delays.len() < MIN_SAMPLES => AUTO_START,
            TtlPolicy::Auto => {
                let mut sorted: Vec<Duration> = self.delays.iter().copied().collect();
                sorted.sort_unstable();
                let at = ((sorted.len() - 1) as f64 * QUANTILE).round() as usize;
                sorted[at].mul_f64(SAFETY).clamp(AUTO_MIN, AUTO_MAX)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn auto_starts_at_two_seconds_then_follows_the_delays() {
        let mut t = TtlEstimator::default();
        for _ in 0..MIN_SAMPLES - 1 {
            t.observe(ms(300));
        }
        assert_eq!(t.ttl(TtlPolicy::Auto), AUTO_START);
        t.observe(ms(300));
        assert_eq!(t.ttl(TtlPolicy::Auto), ms(450));
        assert_eq!(t.ttl(TtlPolicy::Fixed(ms(700))), ms(700));
    }

    #[test]
    fn auto_is_clamped_and_forgets_old_delays() {
        let mut t = TtlEstimator::default();
        for _ in 0..WINDOW {
            t.observe(ms(1));
        }
        assert_eq!(t.ttl(TtlPolicy::Auto), AUTO_MIN);
        for _ in 0..WINDOW {
            t.observe(Duration::from_secs(30));
        }
        assert_eq!(t.ttl(TtlPolicy::Auto), AUTO_MAX);
        // A few slow ones among many fast: the quantile takes the slow.
        let mut t = TtlEstimator::default();
        for i in 0..40 {
            t.observe(if i % 10 == 0 { ms(800) } else { ms(200) });
        }
        assert_eq!(t.ttl(TtlPolicy::Auto), ms(1200));
    }
}

//! Repeated timing for the benches that print medians: `keys` and `score`
//! here and the service's `decode`, which includes this file by path (there
//! is no bench crate they all depend on).

use std::time::{Duration, Instant};

/// Runs `f` repeatedly for about `budget` (at least 10 times, after one
/// warm-up call) and returns (median, p90) per call.
pub fn measure(budget: Duration, mut f: impl FnMut()) -> (Duration, Duration) {
    f();
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || samples.len() < 10 {
        let t = Instant::now();
        f();
        samples.push(t.elapsed());
    }
    samples.sort();
    (samples[samples.len() / 2], samples[samples.len() * 9 / 10])
}

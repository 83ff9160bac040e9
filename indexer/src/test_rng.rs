//! A seeded xorshift for randomized tests: `rnd(n)` is in `0..n`, the same
//! sequence every run, so a failing case can be replayed.

pub fn xorshift(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut x = seed;
    move |n| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    }
}

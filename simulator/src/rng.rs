//! The simulator's one source of randomness: SplitMix64, seeded. Small,
//! fast and the same on every platform, so a seed names one run exactly
//! (a crate's generator may change its stream between versions).

#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for one named part of a run, independent of how much the
    /// other parts drew.
    pub fn fork(seed: u64, stream: u64) -> Rng {
        let mut r = Rng(seed ^ stream.wrapping_mul(0xd1b5_4a32_d192_ed03));
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, n); 0 when n is 0.
    pub fn below(&mut self, n: usize) -> usize {
        match n {
            0 => 0,
            n => ((self.next_u64() as u128 * n as u128) >> 64) as usize,
        }
    }

    /// Exponentially distributed with this mean (Poisson gaps).
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// Uniform around `mean`, from half of it to one and a half times it,
    /// at least 1.
    pub fn around(&mut self, mean: usize) -> usize {
        let half = mean / 2;
        (half + self.below(mean + 1)).max(1)
    }

    /// About `mean` token ids (see [`Rng::around`]).
    pub fn tokens_around(&mut self, mean: usize) -> Vec<u32> {
        let n = self.around(mean);
        self.tokens(n)
    }

    /// `n` token ids of a vocabulary the size of Qwen3's.
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(151_000) as u32).collect()
    }
}

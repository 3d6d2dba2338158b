//! The data's own randomness: generators keyed by (seed, purpose, index), never torch's global
//! generator, so shuffles, splits and augmentation are the same on every machine.

/// SplitMix64 (Steele, Lea & Flood 2014): tiny, fast, and good enough for shuffles and noise.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 bits.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (n > 0), without modulo bias.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        let limit = u64::MAX - u64::MAX % n;
        loop {
            let r = self.next_u64();
            if r < limit {
                return r % n;
            }
        }
    }

    /// Two independent N(0, 1) values (Box–Muller).
    pub(crate) fn normal_pair(&mut self) -> (f64, f64) {
        let u1 = 1.0 - self.unit(); // (0, 1]: ln is finite
        let u2 = self.unit();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        (r * c, r * s)
    }
}

/// An independent generator for (seed, purpose, index).
pub(crate) fn stream(seed: i64, tag: u64, index: i64) -> SplitMix64 {
    let mut a = SplitMix64(seed as u64 ^ tag);
    let mut b = SplitMix64(a.next_u64() ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    SplitMix64(b.next_u64())
}

//! A small deterministic random number generator (SplitMix64) for weight init and tests.

/// SplitMix64: fast, statistically good enough for initialization, fully reproducible.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// An independent generator for stream `stream` of `seed` (e.g. one per tensor).
    pub fn stream(seed: u64, stream: u64) -> Self {
        let mut mixer = Rng::new(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        Rng::new(mixer.next_u64())
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in `[0, 1)` with 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// A uniform value in `[low, high)`.
    pub fn uniform(&mut self, low: f32, high: f32) -> f32 {
        low + (high - low) * self.next_f32()
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn same_seed_same_values_and_range() {
        let a: Vec<f32> = {
            let mut r = Rng::stream(7, 3);
            (0..1000).map(|_| r.uniform(-2.0, 2.0)).collect()
        };
        let b: Vec<f32> = {
            let mut r = Rng::stream(7, 3);
            (0..1000).map(|_| r.uniform(-2.0, 2.0)).collect()
        };
        let c: Vec<f32> = {
            let mut r = Rng::stream(7, 4);
            (0..1000).map(|_| r.uniform(-2.0, 2.0)).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|v| (-2.0..2.0).contains(v)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.15, "mean {mean}");
    }
}

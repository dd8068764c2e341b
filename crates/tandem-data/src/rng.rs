//! A counter-based random number generator: every random draw is a pure function of
//! (seed, stream, epoch, sample index), so any sample of any epoch can be recomputed
//! without replaying the ones before it (mid-epoch resume needs only the step number).

/// SplitMix64's increment (the golden ratio in 64 bits).
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function: a bijective mix of 64 bits.
fn mix64(mut value: u64) -> u64 {
    value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    value ^ (value >> 31)
}

/// A SplitMix64 stream whose starting point is a hash of its key.
#[derive(Debug, Clone)]
pub struct SampleRng {
    state: u64,
}

impl SampleRng {
    /// The stream for one (seed, stream tag, epoch, index) key. Stream tags keep the
    /// generators of different purposes (augmentation, shuffling, synthetic pixels) apart.
    pub fn new(seed: u64, stream: u64, epoch: u64, index: u64) -> SampleRng {
        let mut state = mix64(seed.wrapping_add(GOLDEN_GAMMA));
        for word in [stream, epoch, index] {
            state = mix64(state ^ mix64(word.wrapping_add(GOLDEN_GAMMA)));
        }
        SampleRng { state }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// A uniform integer in `0..bound` (`bound` > 0), without modulo bias.
    pub fn below(&mut self, bound: u64) -> u64 {
        let bound = bound.max(1);
        let zone = u64::MAX - u64::MAX % bound;
        loop {
            let value = self.next_u64();
            if value < zone {
                return value % bound;
            }
        }
    }

    /// A fair coin.
    pub fn coin(&mut self) -> bool {
        self.next_u64() >> 63 == 1
    }

    /// A uniform float in the open interval (0, 1).
    pub fn open_unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Two independent standard-normal values (Box-Muller).
    pub fn normal_pair(&mut self) -> (f64, f64) {
        let radius = (-2.0 * self.open_unit().ln()).sqrt();
        let angle = 2.0 * std::f64::consts::PI * self.open_unit();
        (radius * angle.cos(), radius * angle.sin())
    }

    /// Shuffles `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for last in (1..items.len()).rev() {
            let other = self.below(last as u64 + 1) as usize;
            items.swap(last, other);
        }
    }
}

/// Stream tags of [`SampleRng::new`].
pub(crate) mod stream {
    /// Per-sample augmentation draws.
    pub const AUGMENT: u64 = 1;
    /// The sampler's permutation of an epoch.
    pub const SHUFFLE: u64 = 2;
    /// Synthetic pixels.
    pub const SYNTHETIC_PIXELS: u64 = 3;
    /// Synthetic label order.
    pub const SYNTHETIC_LABELS: u64 = 4;
}

//! bfloat16 on the host: the reference of the kernels' rounding (`narrow_bits` in
//! `kernels/activations.cuh`), bit for bit.
//!
//! bfloat16 is float32's upper 16 bits. Narrowing rounds to nearest, ties to even; finite
//! values past the largest bfloat16 become infinity; subnormals round as any other value; a
//! NaN stays a NaN with its sign and upper payload, the quiet bit set (a NaN whose payload
//! lies only in the dropped bits would otherwise become infinity). Widening is exact.

/// The bfloat16 nearest to `value` (ties to even), as its bits.
pub fn f32_to_bf16_bits(value: f32) -> u16 {
    let bits = value.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 0x0040) as u16;
    }
    let lsb = (bits >> 16) & 1;
    // No overflow: past the NaNs, the largest bit pattern is -inf's 0xff80_0000.
    ((bits + 0x7fff + lsb) >> 16) as u16
}

/// The float32 of bfloat16 `bits` (exact).
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `value` rounded to bfloat16 and widened back: what a bfloat16 operand holds of it.
pub fn round_to_bf16(value: f32) -> f32 {
    bf16_bits_to_f32(f32_to_bf16_bits(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts that each float32, given by its bits, narrows to its bfloat16 bits.
    fn assert_narrows(cases: &[(u32, u16)]) {
        for &(bits, narrowed) in cases {
            assert_eq!(f32_to_bf16_bits(f32::from_bits(bits)), narrowed);
        }
    }

    #[test]
    fn exact_values_are_kept() {
        for value in [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            0.15625,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            assert_eq!(round_to_bf16(value).to_bits(), value.to_bits(), "{value}");
        }
        assert_eq!(f32_to_bf16_bits(1.0), 0x3f80);
        assert_eq!(f32_to_bf16_bits(-2.0), 0xc000);
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16_bits(f32::NEG_INFINITY), 0xff80);
        for bits in [0x0000u16, 0x8000, 0x0001, 0x7f7f, 0xff7f, 0x3f81] {
            assert_eq!(
                f32_to_bf16_bits(bf16_bits_to_f32(bits)),
                bits,
                "{bits:#06x}"
            );
        }
    }

    #[test]
    fn rounding_is_to_nearest_ties_to_even() {
        assert_narrows(&[
            // 1 + 2^-8 lies halfway between 1 (even mantissa) and 1 + 2^-7: down to 1.
            (0x3f80_8000, 0x3f80),
            // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
            (0x3f81_8000, 0x3f82),
            // Just above and below the halfway point.
            (0x3f80_8001, 0x3f81),
            (0x3f80_7fff, 0x3f80),
            // The same for negative values (rounding is on the magnitude).
            (0xbf80_8000, 0xbf80),
            (0xbf81_8000, 0xbf82),
            // A carry out of the mantissa raises the exponent: 2 - 2^-9 rounds up to 2.
            (0x3fff_ffff, 0x4000),
        ]);
    }

    #[test]
    fn large_values_overflow_to_infinity() {
        assert_narrows(&[
            // The largest bfloat16 is 0x7f7f (about 3.39e38); float32's largest rounds past it.
            (f32::MAX.to_bits(), 0x7f80),
            (f32::MIN.to_bits(), 0xff80),
            // Halfway between 0x7f7f and infinity ties to even: infinity (0x7f80 is even).
            (0x7f7f_8000, 0x7f80),
            // Below halfway it stays finite.
            (0x7f7f_7fff, 0x7f7f),
        ]);
    }

    #[test]
    fn nans_stay_nans() {
        for bits in [
            0x7fc0_0000u32,
            0x7f80_0001,
            0xff80_0001,
            0x7fa0_0000,
            0xffff_ffff,
        ] {
            let narrowed = f32_to_bf16_bits(f32::from_bits(bits));
            assert!(bf16_bits_to_f32(narrowed).is_nan(), "{bits:#010x}");
            assert_eq!(
                narrowed & 0x8000,
                (bits >> 16) as u16 & 0x8000,
                "sign of {bits:#010x}"
            );
        }
        assert_narrows(&[
            // A signalling NaN whose payload is only in the dropped bits: quiet, not infinity.
            (0x7f80_0001, 0x7fc0),
            (0xff80_0001, 0xffc0),
            // The upper payload is kept.
            (0x7fa0_0000, 0x7fe0),
        ]);
    }

    #[test]
    fn subnormals_round_like_other_values() {
        assert_narrows(&[
            // The smallest float32 subnormal is below half the smallest bfloat16 subnormal
            // (2^-133): to zero, keeping the sign.
            (0x0000_0001, 0x0000),
            (0x8000_0001, 0x8000),
            // Halfway to the smallest bfloat16 subnormal ties to even (zero); above it, up.
            (0x0000_8000, 0x0000),
            (0x0000_8001, 0x0001),
            (0x0001_8000, 0x0002),
            // The largest subnormal rounds up into the smallest normal.
            (0x007f_ffff, 0x0080),
        ]);
        assert_eq!(bf16_bits_to_f32(0x0001), f32::from_bits(0x0001_0000));
    }

    #[test]
    fn rounding_agrees_with_the_half_crate() {
        // An independent implementation, over bit patterns spread across all of float32.
        let mut bits = 0u32;
        loop {
            let value = f32::from_bits(bits);
            assert_eq!(
                f32_to_bf16_bits(value),
                half::bf16::from_f32(value).to_bits(),
                "{bits:#010x}"
            );
            match bits.checked_add(65_521) {
                Some(next) => bits = next,
                None => break,
            }
        }
    }

    #[test]
    fn widening_then_narrowing_gives_every_bfloat16_back() {
        for bits in 0..=u16::MAX {
            let value = bf16_bits_to_f32(bits);
            if value.is_nan() {
                assert!(bf16_bits_to_f32(f32_to_bf16_bits(value)).is_nan());
            } else {
                assert_eq!(f32_to_bf16_bits(value), bits, "{bits:#06x}");
            }
        }
    }
}

//! Float comparisons for tests: within a stated tolerance, or to the bit.
//!
//! The arithmetic runs in the values' own type, so an `f32` comparison rounds as an `f32`
//! one written out by hand does.

use std::fmt::Display;
use std::ops::{Add, Mul, Sub};

/// A float type the comparisons work in.
pub trait Real:
    Copy + PartialOrd + Display + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self>
{
    /// One.
    const ONE: Self;
    /// The absolute value.
    fn abs(self) -> Self;
    /// The larger of the two.
    fn max(self, other: Self) -> Self;
}

/// Implements [`Real`] for a float type through its inherent methods.
macro_rules! real {
    ($float:ty) => {
        impl Real for $float {
            const ONE: Self = 1.0;
            fn abs(self) -> Self {
                <$float>::abs(self)
            }
            fn max(self, other: Self) -> Self {
                <$float>::max(self, other)
            }
        }
    };
}

real!(f32);
real!(f64);

/// How far a value may be from the one expected, for an expected value `e`.
#[derive(Clone, Copy, Debug)]
pub enum Tolerance<T> {
    /// `tolerance * max(|e|, 1)`: relative for large values, absolute for small ones.
    Scaled(T),
    /// `tolerance * (1 + |e|)`.
    OnePlus(T),
    /// `tolerance * max(1, the largest |e| of the slice)`: one bound for every element.
    OfLargest(T),
}

impl<T: Real> Tolerance<T> {
    /// The bound for one expected value `e` of a slice whose largest magnitude is `largest`.
    fn bound(self, e: T, largest: T) -> T {
        match self {
            Tolerance::Scaled(tolerance) => tolerance * e.abs().max(T::ONE),
            Tolerance::OnePlus(tolerance) => tolerance * (T::ONE + e.abs()),
            Tolerance::OfLargest(tolerance) => tolerance * largest,
        }
    }
}

/// Asserts `actual` as long as `expected` and each element within `tolerance`, naming the
/// first that is not: `what[index]: actual vs expected`.
pub fn assert_close<T: Real>(what: &str, actual: &[T], expected: &[T], tolerance: Tolerance<T>) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    let largest = expected.iter().fold(T::ONE, |m, v| m.max(v.abs()));
    for (index, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= tolerance.bound(e, largest),
            "{what}[{index}]: {a} vs {e}"
        );
    }
}

/// Asserts one value within `tolerance` of `expected`: `what: actual vs expected`.
pub fn assert_close_one<T: Real>(what: &str, actual: T, expected: T, tolerance: Tolerance<T>) {
    let largest = expected.abs().max(T::ONE);
    assert!(
        (actual - expected).abs() <= tolerance.bound(expected, largest),
        "{what}: {actual} vs {expected}"
    );
}

/// Asserts `actual` bit-identical to `expected`, naming the first element that differs.
pub fn assert_bits_equal(what: &str, actual: &[f32], expected: &[f32]) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (index, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert_eq!(a.to_bits(), e.to_bits(), "{what}[{index}]: {a} against {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tolerance_bounds_as_its_formula_says() {
        assert_close("scaled", &[100.5f32], &[100.0], Tolerance::Scaled(0.01));
        assert_close("one plus", &[0.0f64], &[1e-6], Tolerance::OnePlus(1e-6));
        assert_close(
            "largest",
            &[0.9f64, 100.0],
            &[0.0, 100.0],
            Tolerance::OfLargest(0.01),
        );
        assert_close_one("one", 2.0f64, 2.0 + 1e-6, Tolerance::Scaled(1e-6));
        assert_bits_equal("bits", &[0.1, -0.0], &[0.1, -0.0]);
    }

    #[test]
    #[should_panic(expected = "scaled[1]: 1.1 vs 1")]
    fn a_value_past_the_bound_names_its_index() {
        assert_close(
            "scaled",
            &[0.0f32, 1.1],
            &[0.0, 1.0],
            Tolerance::Scaled(0.01),
        );
    }

    #[test]
    #[should_panic(expected = "bits[0]: 0 against -0")]
    fn signed_zeros_differ_in_their_bits() {
        assert_bits_equal("bits", &[0.0], &[-0.0]);
    }
}

//! The element types collectives work on, and the reduction operators.

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum over ranks (wrapping for integers).
    Sum,
    /// The sum divided once by the world size (truncating toward zero for integers).
    Mean,
    /// The largest value; for floats a NaN anywhere gives NaN.
    Max,
    /// The smallest value; for floats a NaN anywhere gives NaN.
    Min,
}

mod sealed {
    /// Keeps [`Element`](super::Element) implemented only here.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for i64 {}
}

/// A type collectives can carry: `f32`, `f64` or `i64`, sent in the machine's byte order.
pub trait Element:
    bytemuck::Pod + Send + Sync + PartialEq + std::fmt::Debug + sealed::Sealed
{
    /// The type's name in error messages.
    const NAME: &'static str;
    /// A code that peers compare, so that mismatched types are caught.
    const CODE: u32;

    /// Combines the value accumulated so far with this rank's value.
    fn combine(op: ReduceOp, accumulated: Self, local: Self) -> Self;

    /// Divides a finished sum by the world size (the last step of [`ReduceOp::Mean`]).
    fn divide(self, count: usize) -> Self;
}

macro_rules! float_element {
    ($type:ty, $name:literal, $code:literal) => {
        impl Element for $type {
            const NAME: &'static str = $name;
            const CODE: u32 = $code;

            fn combine(op: ReduceOp, accumulated: Self, local: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Mean => accumulated + local,
                    ReduceOp::Max if accumulated > local || accumulated.is_nan() => accumulated,
                    ReduceOp::Min if accumulated < local || accumulated.is_nan() => accumulated,
                    ReduceOp::Max | ReduceOp::Min => local,
                }
            }

            fn divide(self, count: usize) -> Self {
                self / count as $type
            }
        }
    };
}

float_element!(f32, "f32", 1);
float_element!(f64, "f64", 2);

impl Element for i64 {
    const NAME: &'static str = "i64";
    const CODE: u32 = 3;

    fn combine(op: ReduceOp, accumulated: Self, local: Self) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => accumulated.wrapping_add(local),
            ReduceOp::Max => accumulated.max(local),
            ReduceOp::Min => accumulated.min(local),
        }
    }

    fn divide(self, count: usize) -> Self {
        // count is a world size >= 1, so the division cannot fail.
        self.wrapping_div(count.max(1) as i64)
    }
}

/// Combines `arrived` into `local` element by element. The operator is chosen once, outside
/// the loop, so each loop is a plain vectorizable pass.
pub(crate) fn combine_slices<T: Element>(op: ReduceOp, local: &mut [T], arrived: &[T]) {
    fn apply<T: Element>(local: &mut [T], arrived: &[T], combine: impl Fn(T, T) -> T) {
        for (local, arrived) in local.iter_mut().zip(arrived) {
            *local = combine(*arrived, *local);
        }
    }
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            apply(local, arrived, |a, b| T::combine(ReduceOp::Sum, a, b))
        }
        ReduceOp::Max => apply(local, arrived, |a, b| T::combine(ReduceOp::Max, a, b)),
        ReduceOp::Min => apply(local, arrived, |a, b| T::combine(ReduceOp::Min, a, b)),
    }
}

/// The elements `[start, end)` of chunk `chunk` when `len` elements are split into
/// `world_size` chunks: the first `len % world_size` chunks hold one element more.
/// This is the part of the input that [`reduce_scatter`](crate::ProcessGroup::reduce_scatter)
/// returns to rank `chunk`.
pub fn chunk_range(len: usize, world_size: usize, chunk: usize) -> std::ops::Range<usize> {
    let world_size = world_size.max(1);
    let base = len / world_size;
    let extra = len % world_size;
    let start = chunk * base + chunk.min(extra);
    let size = base + usize::from(chunk < extra);
    start.min(len)..(start + size).min(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_in_order() {
        for len in [0usize, 1, 2, 3, 7, 100] {
            for world_size in 1..=5 {
                let mut next = 0;
                for chunk in 0..world_size {
                    let range = chunk_range(len, world_size, chunk);
                    assert_eq!(range.start, next);
                    assert!(range.len() == len / world_size || range.len() == len / world_size + 1);
                    next = range.end;
                }
                assert_eq!(next, len);
            }
        }
        assert_eq!(chunk_range(7, 3, 0), 0..3);
        assert_eq!(chunk_range(7, 3, 2), 5..7);
    }

    #[test]
    fn float_max_and_min_propagate_nan() {
        assert!(f32::combine(ReduceOp::Max, f32::NAN, 1.0).is_nan());
        assert!(f32::combine(ReduceOp::Max, 1.0, f32::NAN).is_nan());
        assert!(f64::combine(ReduceOp::Min, 2.0, f64::NAN).is_nan());
        assert_eq!(f32::combine(ReduceOp::Max, -1.0, 3.0), 3.0);
        assert_eq!(f32::combine(ReduceOp::Min, -1.0, 3.0), -1.0);
        assert_eq!(i64::combine(ReduceOp::Sum, i64::MAX, 1), i64::MIN);
        assert_eq!((-7i64).divide(2), -3);
    }
}

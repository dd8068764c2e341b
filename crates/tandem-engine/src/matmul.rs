//! Matrix product on strided `f32` views, backed by the `gemm` crate.

use gemm::Parallelism;

/// A read-only strided matrix: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    /// The backing values.
    pub data: &'a [f32],
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
    /// Distance between consecutive rows.
    pub row_stride: usize,
    /// Distance between consecutive columns.
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A contiguous row-major `rows x cols` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of this matrix (no copy).
    pub fn transposed(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// The smallest backing length that holds every element.
    fn required_len(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride + 1
        }
    }
}

/// `dst = lhs × rhs`, or `dst += lhs × rhs` when `accumulate`; `dst` is row-major
/// `lhs.rows x rhs.cols` with rows `dst_row_stride` apart. Runs on the calling thread.
///
/// # Panics
/// If the shapes disagree or a view is shorter than its shape needs (a bug in the caller).
pub fn matmul(dst: &mut [f32], dst_row_stride: usize, lhs: MatRef, rhs: MatRef, accumulate: bool) {
    matmul_with(dst, dst_row_stride, lhs, rhs, accumulate, Parallelism::None)
}

/// [`matmul`] with an explicit `gemm` parallelism, for large single products.
pub fn matmul_with(
    dst: &mut [f32],
    dst_row_stride: usize,
    lhs: MatRef,
    rhs: MatRef,
    accumulate: bool,
    parallelism: Parallelism,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert_eq!(k, rhs.rows, "matmul: inner dimensions differ");
    assert!(
        lhs.data.len() >= lhs.required_len(),
        "matmul: lhs too short"
    );
    assert!(
        rhs.data.len() >= rhs.required_len(),
        "matmul: rhs too short"
    );
    let dst_needed = if m == 0 || n == 0 {
        0
    } else {
        (m - 1) * dst_row_stride + n
    };
    assert!(dst.len() >= dst_needed, "matmul: dst too short");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in dst.chunks_mut(dst_row_stride.max(1)).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: the asserts above guarantee every accessed element lies inside the slices,
    // and `dst` is borrowed mutably so it cannot alias `lhs` or `rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_row_stride as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn matmul_matches_naive_product_and_accumulates() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let expected = naive(&a, &b, m, k, n);
        let mut c = vec![1.0; m * n];
        // Overwriting gives the product; accumulating onto it doubles it.
        for (accumulate, times) in [(false, 1.0), (true, 2.0)] {
            matmul(
                &mut c,
                n,
                MatRef::row_major(&a, m, k),
                MatRef::row_major(&b, k, n),
                accumulate,
            );
            for (x, y) in c.iter().zip(&expected) {
                assert!((x - times * y).abs() < 1e-5);
            }
        }
        // b^T stored as [n, k]: the transposed view gives the same product.
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        matmul(
            &mut c,
            n,
            MatRef::row_major(&a, m, k),
            MatRef::row_major(&bt, n, k).transposed(),
            false,
        );
        for (x, y) in c.iter().zip(&expected) {
            assert!((x - y).abs() < 1e-5);
        }
    }
}

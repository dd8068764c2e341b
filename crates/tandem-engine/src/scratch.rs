//! Scratch buffers that the kernels grow on first use and reuse after.

/// Grows `buffer` to at least `len` values (never shrinks it; new values are zero), so
/// scratch buffers are allocated on first use and reused after.
pub(crate) fn grow<T: Copy + Default>(buffer: &mut Vec<T>, len: usize) {
    if buffer.len() < len {
        buffer.resize(len, T::default());
    }
}

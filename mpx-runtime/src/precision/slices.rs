//! Scratch sizing.

/// The first `n` values of a scratch buffer, grown when shorter (never shrunk, so a buffer reused
/// for tensors of different sizes is not zeroed again each time). The values are whatever the
/// last use left: callers overwrite them.
pub(crate) fn sized<T: Copy + Default>(buf: &mut Vec<T>, n: usize) -> &mut [T] {
    if buf.len() < n {
        buf.resize(n, T::default());
    }
    &mut buf[..n]
}

//! The operands of a product as f32 values: f16 operands widened and bf16 operands rounded
//! into buffers each thread keeps between products, f32 operands read as they are. The blocked
//! driver and the small-product kernel both read their operands through here.

use std::cell::RefCell;

use super::mat::MatRef;
use super::zip_parts;
use crate::FloatSlice;

/// Runs `f` with this thread's three reusable buffers for widened, rounded or transposed
/// operands (fresh ones if re-entered).
pub(crate) fn with_wide<R>(f: impl FnOnce(&mut [Vec<f32>; 3]) -> R) -> R {
    thread_local! {
        static WIDE: RefCell<[Vec<f32>; 3]> =
            const { RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
    }
    WIDE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => f(&mut bufs),
        Err(_) => f(&mut Default::default()),
    })
}

/// The first `n` values of `buf`, grown when shorter (never shrunk: operands of different sizes
/// do not zero it again each call). The caller overwrites them.
pub(crate) fn grown(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

/// An operand's values as f32: f32 operands as they are, f16 operands widened (SIMD slice
/// conversion) and bf16 operands rounded into `buf`, a long operand in parts on the pool's
/// threads ([`zip_parts`]).
pub(crate) fn prepared<'s>(m: &MatRef<'s>, buf: &'s mut Vec<f32>) -> &'s [f32] {
    let n = m.needed().expect("checked by `check`");
    match m.values() {
        FloatSlice::F32(v) => &v[..n],
        FloatSlice::F16(v) => converted(&v[..n], buf, crate::convert::widen_f16),
        FloatSlice::Bf16(v) => converted(&v[..n], buf, crate::convert::round_bf16),
    }
}

/// `src` converted by `convert` into the first `src.len()` values of `buf`, in parts on the
/// pool's threads when long.
fn converted<'s, S: Sync>(
    src: &[S],
    buf: &'s mut Vec<f32>,
    convert: fn(&[S], &mut [f32]),
) -> &'s [f32] {
    let buf = grown(buf, src.len());
    zip_parts(buf, src, &|d, s| {
        convert(s, d);
        true
    });
    buf
}

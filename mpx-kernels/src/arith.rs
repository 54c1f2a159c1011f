//! f16 element-wise arithmetic, each op in one pass over the values, with dfdx's f16 bits (each
//! result computed in f32 and rounded once; dfdx converts every value through a function call):
//! an f16 tensor's op with a scalar ([`apply_scalar_f16`]), the same op of two f16 tensors
//! ([`zip_f16`]), and the gradient pass of an op whose derivative is a constant,
//! `g += round(d * dy)` summed in f32 and rounded once ([`add_scaled_f16`]).
//!
//! # Examples
//! ```
//! use half::f16;
//! use mpx_kernels::{Arith, add_scaled_f16, apply_scalar_f16, zip_f16};
//!
//! let mut v = [f16::ONE, f16::from_f32(3.0)];
//! apply_scalar_f16(&mut v, Arith::Mul, 0.5);
//! assert_eq!(v, [f16::from_f32(0.5), f16::from_f32(1.5)]);
//! let mut sum = [f16::ZERO; 2];
//! zip_f16(&v, &v, Arith::Add, &mut sum);
//! assert_eq!(sum, [f16::ONE, f16::from_f32(3.0)]);
//! let mut g = [f16::ONE; 2];
//! add_scaled_f16(&v, f16::from_f32(2.0), &mut g); // g += round(2 v)
//! assert_eq!(g, [f16::from_f32(2.0), f16::from_f32(4.0)]);
//! ```

use half::f16;

use super::convert::has_f16c;

/// One of the four ops of [`apply_scalar_f16`] and [`zip_f16`]: `x + y`, `x - y`, `x * y`,
/// `x / y`.
///
/// # Examples
/// ```
/// assert_eq!(mpx_kernels::Arith::Div.of(1.0, 4.0), 0.25);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arith {
    /// `x + y`
    Add,
    /// `x - y`
    Sub,
    /// `x * y`
    Mul,
    /// `x / y`
    Div,
}

impl Arith {
    /// `x op y` in f32.
    #[inline(always)]
    #[must_use]
    pub fn of(self, x: f32, y: f32) -> f32 {
        match self {
            Arith::Add => x + y,
            Arith::Sub => x - y,
            Arith::Mul => x * y,
            Arith::Div => x / y,
        }
    }
}

/// `v = round_f16(f32(v) op s)` for every value: the op in f32, rounded once (nearest, ties to
/// even; past f16's range to infinity). With F16C, 8 values per instruction.
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_kernels::{Arith, apply_scalar_f16};
/// let mut v = [f16::from_f32(65504.0), f16::ONE];
/// apply_scalar_f16(&mut v, Arith::Add, 16.0);
/// assert!(v[0].is_infinite()); // 65520 rounds past f16's max
/// assert_eq!(v[1], f16::from_f32(17.0));
/// ```
pub fn apply_scalar_f16(values: &mut [f16], op: Arith, s: f32) {
    if has_f16c() {
        // SAFETY: F16C and AVX detected just above.
        unsafe { x86::apply(values, op, s) };
    } else {
        portable::apply(values, op, s);
    }
}

/// `out = round_f16(f32(a) op f32(b))` for every pair: the op in f32, rounded once. With F16C,
/// 8 values per instruction.
///
/// # Panics
/// When the lengths differ.
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_kernels::{Arith, zip_f16};
/// let mut out = [f16::ZERO; 2];
/// zip_f16(&[f16::ONE, f16::MAX], &[f16::from_f32(3.0), f16::MAX], Arith::Div, &mut out);
/// assert_eq!(out, [f16::from_f32(1.0 / 3.0), f16::ONE]);
/// ```
pub fn zip_f16(a: &[f16], b: &[f16], op: Arith, out: &mut [f16]) {
    assert!(
        a.len() == b.len() && a.len() == out.len(),
        "zip_f16: lengths differ"
    );
    if has_f16c() {
        // SAFETY: F16C and AVX detected just above; the lengths match.
        unsafe { x86::zip(a, b, op, out) };
    } else {
        portable::zip(a, b, op, out);
    }
}

/// `g = round_f16(f32(g) + f32(round_f16(f32(d) * f32(dy))))` for every pair, or with `d = 1`
/// `g = round_f16(f32(g) + f32(dy))`: the gradient pass of an op of a tensor and a scalar whose
/// derivative is the constant `d`, with dfdx's f16 roundings (the product rounded before it is
/// added, the sum rounded once). With F16C, 8 values per instruction.
///
/// # Panics
/// When the lengths differ.
///
/// # Examples
/// ```
/// use half::f16;
/// use mpx_kernels::add_scaled_f16;
/// let mut g = [f16::ONE];
/// add_scaled_f16(&[f16::from_f32(3.0)], f16::from_f32(-0.5), &mut g);
/// assert_eq!(g, [f16::from_f32(-0.5)]);
/// ```
pub fn add_scaled_f16(dy: &[f16], d: f16, g: &mut [f16]) {
    assert_eq!(dy.len(), g.len(), "add_scaled_f16: lengths differ");
    let unit = d == f16::ONE;
    if has_f16c() {
        // SAFETY: F16C and AVX detected just above; the lengths match.
        unsafe { x86::add_scaled(dy, d.to_f32(), unit, g) };
    } else {
        portable::add_scaled(dy, d, g);
    }
}

/// The ops value by value through `half`'s conversions: the path of a CPU without F16C, and
/// the definition the F16C loops are tested against.
mod portable {
    use half::f16;

    use super::Arith;

    pub(super) fn apply(values: &mut [f16], op: Arith, s: f32) {
        for v in values {
            *v = f16::from_f32(op.of(v.to_f32(), s));
        }
    }

    pub(super) fn zip(a: &[f16], b: &[f16], op: Arith, out: &mut [f16]) {
        for ((o, a), b) in out.iter_mut().zip(a).zip(b) {
            *o = f16::from_f32(op.of(a.to_f32(), b.to_f32()));
        }
    }

    pub(super) fn add_scaled(dy: &[f16], d: f16, g: &mut [f16]) {
        for (g, dy) in g.iter_mut().zip(dy) {
            let add = if d == f16::ONE {
                *dy
            } else {
                f16::from_f32(d.to_f32() * dy.to_f32())
            };
            *g = f16::from_f32(g.to_f32() + add.to_f32());
        }
    }
}

/// Never called: [`has_f16c`] is `false` off x86-64.
#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::Arith;
    use half::f16;

    pub(super) unsafe fn apply(_: &mut [f16], _: Arith, _: f32) {
        unreachable!("F16C off x86-64")
    }
    pub(super) unsafe fn zip(_: &[f16], _: &[f16], _: Arith, _: &mut [f16]) {
        unreachable!("F16C off x86-64")
    }
    pub(super) unsafe fn add_scaled(_: &[f16], _: f32, _: bool, _: &mut [f16]) {
        unreachable!("F16C off x86-64")
    }
}

// `_mm_loadu_si128` / `_mm_storeu_si128` take `__m128i` pointers but access them unaligned: the
// casts from 2-byte-aligned f16 pointers are what the intrinsics expect.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::cast_ptr_alignment)]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256, _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128,
        _mm256_add_ps, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_div_ps, _mm256_mul_ps,
        _mm256_set1_ps, _mm256_sub_ps,
    };

    use half::f16;

    use super::Arith;

    /// Values per register.
    const LANES: usize = 8;

    /// A group of 8 f16 values.
    type Group = [f16; LANES];

    /// 8 f16 values widened.
    #[inline]
    #[target_feature(enable = "avx,f16c")]
    fn load(v: &Group) -> __m256 {
        // SAFETY: `v` holds 8 f16 values, the 128 bits read (unaligned).
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(v.as_ptr().cast::<__m128i>()) })
    }

    /// 8 f32 values rounded to f16 into `v`.
    #[inline]
    #[target_feature(enable = "avx,f16c")]
    fn store(v: &mut Group, x: __m256) {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
        // SAFETY: `v` holds 8 f16 values, the 128 bits written (unaligned).
        unsafe { _mm_storeu_si128(v.as_mut_ptr().cast::<__m128i>(), h) };
    }

    /// `x op y`, lane by lane.
    #[inline]
    #[target_feature(enable = "avx")]
    fn arith(op: Arith, x: __m256, y: __m256) -> __m256 {
        match op {
            Arith::Add => _mm256_add_ps(x, y),
            Arith::Sub => _mm256_sub_ps(x, y),
            Arith::Mul => _mm256_mul_ps(x, y),
            Arith::Div => _mm256_div_ps(x, y),
        }
    }

    /// `slice`'s values from `at` on (fewer than 8) in a group padded with zeros.
    fn padded(slice: &[f16], at: usize) -> Group {
        let mut g = [f16::ZERO; LANES];
        g[..slice.len() - at].copy_from_slice(&slice[at..]);
        g
    }

    /// [`apply_scalar_f16`](super::apply_scalar_f16): whole groups of 8 values, then the values past the last one padded into one group on the
    /// stack: every value goes through the same instructions.
    ///
    /// # Safety
    /// The CPU must support AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn apply(values: &mut [f16], op: Arith, s: f32) {
        let s = _mm256_set1_ps(s);
        let full = values.len() / LANES * LANES;
        for v in values[..full].chunks_exact_mut(LANES) {
            let v: &mut Group = v.try_into().expect("chunks of LANES");
            let x = arith(op, load(v), s);
            store(v, x);
        }
        if full < values.len() {
            let mut g = padded(values, full);
            let x = arith(op, load(&g), s);
            store(&mut g, x);
            let rest = values.len() - full;
            values[full..].copy_from_slice(&g[..rest]);
        }
    }

    /// See [`zip_f16`](super::zip_f16), as [`apply`] goes.
    ///
    /// # Safety
    /// The CPU must support AVX and F16C; the three lengths are equal.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn zip(a: &[f16], b: &[f16], op: Arith, out: &mut [f16]) {
        let full = a.len() / LANES * LANES;
        let groups = a[..full].chunks_exact(LANES).zip(b.chunks_exact(LANES));
        for ((a, b), o) in groups.zip(out.chunks_exact_mut(LANES)) {
            let (a, b): (&Group, &Group) = (
                a.try_into().expect("chunks of LANES"),
                b.try_into().expect("chunks of LANES"),
            );
            store(
                o.try_into().expect("chunks of LANES"),
                arith(op, load(a), load(b)),
            );
        }
        if full < a.len() {
            let (ga, gb, mut go) = (padded(a, full), padded(b, full), [f16::ZERO; LANES]);
            store(&mut go, arith(op, load(&ga), load(&gb)));
            let rest = a.len() - full;
            out[full..].copy_from_slice(&go[..rest]);
        }
    }

    /// One group of [`add_scaled`].
    #[inline]
    #[target_feature(enable = "avx,f16c")]
    fn add_scaled_group(g: &mut Group, dy: &Group, d: __m256, unit: bool) {
        let mut add = load(dy);
        if !unit {
            // dfdx's f16 product, rounded before it is added
            add = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(
                d, add,
            )));
        }
        let sum = _mm256_add_ps(load(g), add);
        store(g, sum);
    }

    /// See [`add_scaled_f16`](super::add_scaled_f16), as [`apply`] goes; `unit` when `d` is 1
    /// (no product).
    ///
    /// # Safety
    /// The CPU must support AVX and F16C; `dy.len() == g.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn add_scaled(dy: &[f16], d: f32, unit: bool, g: &mut [f16]) {
        let d = _mm256_set1_ps(d);
        let full = dy.len() / LANES * LANES;
        for (g, dy) in g[..full]
            .chunks_exact_mut(LANES)
            .zip(dy.chunks_exact(LANES))
        {
            let dy: &Group = dy.try_into().expect("chunks of LANES");
            add_scaled_group(g.try_into().expect("chunks of LANES"), dy, d, unit);
        }
        if full < dy.len() {
            let (mut pg, pd) = (padded(g, full), padded(dy, full));
            add_scaled_group(&mut pg, &pd, d, unit);
            let rest = dy.len() - full;
            g[full..].copy_from_slice(&pg[..rest]);
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::{Arith, add_scaled_f16, apply_scalar_f16, portable, zip_f16};

    /// f16 values of every kind: both zeros, subnormals, normals near 1 and near the top of the
    /// range, infinities and NaN, in a length that leaves a partial last group.
    fn values() -> Vec<f16> {
        let mut v: Vec<f16> = (0..997u16)
            .map(|i| f16::from_bits(i.wrapping_mul(40503) ^ (i << 3)))
            .collect();
        v.extend([
            f16::ZERO,
            f16::NEG_ZERO,
            f16::INFINITY,
            f16::NEG_INFINITY,
            f16::NAN,
            f16::MAX,
            f16::MIN_POSITIVE_SUBNORMAL,
        ]);
        v
    }

    /// The F16C loop's value (`got`, the public function's on this CPU) and the portable path's
    /// are both `want`: the same bits, or both NaN (a NaN's payload is not part of the ops'
    /// contract).
    fn check(got: f16, portable: f16, want: f16, case: &dyn std::fmt::Display) {
        let same = |v: f16| v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan());
        assert!(same(got), "{case}: gave {got}, want {want}");
        assert!(
            same(portable),
            "portable, {case}: gave {portable}, want {want}"
        );
    }

    /// Each op against the same op written value by value with `half`'s conversions (dfdx's
    /// f16 arithmetic), for scalars that round, overflow and divide by zero.
    #[test]
    fn each_op_is_the_op_in_f32_rounded_once() {
        for op in [Arith::Add, Arith::Sub, Arith::Mul, Arith::Div] {
            for s in [0.1f32, -3.0, 1e5, 0.0, 1.0 / 3.0] {
                let (mut got, mut port) = (values(), values());
                apply_scalar_f16(&mut got, op, s);
                portable::apply(&mut port, op, s);
                for ((g, p), v) in got.iter().zip(&port).zip(values()) {
                    let want = f16::from_f32(op.of(v.to_f32(), s));
                    check(*g, *p, want, &format_args!("{v} {op:?} {s}"));
                }
            }
        }
    }

    /// Each op of two slices against the op written value by value with `half`'s conversions,
    /// every value paired with every kind of value (the second slice is the first reversed).
    #[test]
    fn each_op_of_two_slices_is_the_op_in_f32_rounded_once() {
        let a = values();
        let b: Vec<f16> = a.iter().rev().copied().collect();
        for op in [Arith::Add, Arith::Sub, Arith::Mul, Arith::Div] {
            let (mut got, mut port) = (vec![f16::ZERO; a.len()], vec![f16::ZERO; a.len()]);
            zip_f16(&a, &b, op, &mut got);
            portable::zip(&a, &b, op, &mut port);
            for (((g, p), x), y) in got.iter().zip(&port).zip(&a).zip(&b) {
                let want = f16::from_f32(op.of(x.to_f32(), y.to_f32()));
                check(*g, *p, want, &format_args!("{x} {op:?} {y}"));
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn an_op_of_two_slices_refuses_slices_of_two_lengths() {
        zip_f16(
            &[f16::ONE; 3],
            &[f16::ONE; 3],
            Arith::Add,
            &mut [f16::ONE; 2],
        );
    }

    #[test]
    fn the_gradient_pass_rounds_the_product_then_the_sum() {
        let dy = values();
        for d in [1.0f32, -1.0, 0.1, 3.0, 1e4] {
            let d = f16::from_f32(d);
            let mut got: Vec<f16> = dy.iter().rev().copied().collect();
            let (start, mut port) = (got.clone(), got.clone());
            add_scaled_f16(&dy, d, &mut got);
            portable::add_scaled(&dy, d, &mut port);
            for (((g, p), s), y) in got.iter().zip(&port).zip(&start).zip(&dy) {
                let add = if d == f16::ONE {
                    *y
                } else {
                    f16::from_f32(d.to_f32() * y.to_f32())
                };
                let want = f16::from_f32(s.to_f32() + add.to_f32());
                check(*g, *p, want, &format_args!("{s} + {d} * {y}"));
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn the_gradient_pass_refuses_slices_of_two_lengths() {
        add_scaled_f16(&[f16::ONE; 3], f16::ONE, &mut [f16::ONE; 2]);
    }
}

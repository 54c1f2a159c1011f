//! Bit patterns of float slices: the tests compare floats bit for bit (so `NaN == NaN` and
//! `0.0 != -0.0`), through these.

use half::f16;

/// The IEEE bit patterns of f32 values.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The IEEE bit patterns of f16 values.
pub fn f16_bits(v: &[f16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

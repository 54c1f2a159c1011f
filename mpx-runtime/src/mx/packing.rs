//! Packing element codes at 4, 6 or 8 bits: element `i` takes bits `[i*b, (i+1)*b)` of a
//! little-endian bit stream (FP4: low nibble first; FP6: 4 elements in 3 bytes).

/// Bytes that `n` elements of `bits` bits take.
pub(crate) fn packed_len(n: usize, bits: u32) -> usize {
    // n * bits / 8 rounded up, without overflowing for huge n.
    let b = bits as usize;
    (n / 8) * b + ((n % 8) * b).div_ceil(8)
}

/// Packs `codes` (each below `2^bits`) into `out`, which holds exactly `packed_len(codes.len())`
/// bytes. Unused high bits of the last byte are written as 0.
#[inline(always)]
pub(crate) fn pack(bits: u32, codes: &[u8], out: &mut [u8]) {
    match bits {
        4 => {
            let pairs = codes.chunks_exact(2);
            let rest = pairs.remainder();
            let n = codes.len() / 2;
            for (o, p) in out[..n].iter_mut().zip(pairs) {
                // one 16-bit word per pair: low byte | high byte << 4 (vectorizes as words)
                let w = u16::from_le_bytes([p[0], p[1]]);
                *o = (w | (w >> 4)) as u8;
            }
            if let [last] = rest {
                out[n] = *last;
            }
        }
        6 => {
            let quads = codes.chunks_exact(4);
            let rest = quads.remainder();
            let n = codes.len() / 4;
            for (o, q) in out[..n * 3].chunks_exact_mut(3).zip(quads) {
                let w = u32::from(q[0])
                    | (u32::from(q[1]) << 6)
                    | (u32::from(q[2]) << 12)
                    | (u32::from(q[3]) << 18);
                o[0] = w as u8;
                o[1] = (w >> 8) as u8;
                o[2] = (w >> 16) as u8;
            }
            if !rest.is_empty() {
                let mut w = 0u32;
                for (j, &c) in rest.iter().enumerate() {
                    w |= u32::from(c) << (6 * j);
                }
                for (j, o) in out[n * 3..].iter_mut().enumerate() {
                    *o = (w >> (8 * j)) as u8;
                }
            }
        }
        _ => out[..codes.len()].copy_from_slice(codes),
    }
}

/// Unpacks `codes.len()` codes from `packed` (the inverse of [`pack`]).
#[inline(always)]
pub(crate) fn unpack(bits: u32, packed: &[u8], codes: &mut [u8]) {
    match bits {
        4 => {
            let n = codes.len() / 2;
            for (p, &b) in codes[..n * 2].chunks_exact_mut(2).zip(packed) {
                p[0] = b & 0xf;
                p[1] = b >> 4;
            }
            if codes.len() % 2 == 1 {
                codes[n * 2] = packed[n] & 0xf;
            }
        }
        6 => {
            let n = codes.len() / 4;
            for (q, p) in codes[..n * 4]
                .chunks_exact_mut(4)
                .zip(packed.chunks_exact(3))
            {
                let w = u32::from(p[0]) | (u32::from(p[1]) << 8) | (u32::from(p[2]) << 16);
                q[0] = (w & 0x3f) as u8;
                q[1] = ((w >> 6) & 0x3f) as u8;
                q[2] = ((w >> 12) & 0x3f) as u8;
                q[3] = (w >> 18) as u8;
            }
            let rest = codes.len() - n * 4;
            if rest > 0 {
                let mut w = 0u32;
                for (j, &b) in packed[n * 3..].iter().take(3).enumerate() {
                    w |= u32::from(b) << (8 * j);
                }
                for (j, c) in codes[n * 4..].iter_mut().enumerate() {
                    *c = ((w >> (6 * j)) & 0x3f) as u8;
                }
            }
        }
        _ => codes.copy_from_slice(&packed[..codes.len()]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths() {
        assert_eq!(packed_len(0, 4), 0);
        assert_eq!(packed_len(3, 4), 2);
        assert_eq!(packed_len(5, 6), 4);
        assert_eq!(packed_len(8, 6), 6);
        assert_eq!(packed_len(9, 8), 9);
    }

    #[test]
    fn round_trip_every_length() {
        for bits in [4u32, 6, 8] {
            for n in 0..20 {
                let codes: Vec<u8> = (0..n)
                    .map(|i| ((i * 37 + 11) % (1 << bits)) as u8)
                    .collect();
                let mut packed = vec![0u8; packed_len(n, bits)];
                pack(bits, &codes, &mut packed);
                let mut back = vec![0u8; n];
                unpack(bits, &packed, &mut back);
                assert_eq!(back, codes, "bits {bits}, n {n}");
            }
        }
    }

    #[test]
    fn bit_order() {
        let mut out = [0u8; 3];
        pack(6, &[0x3f, 0, 0x3f, 0], &mut out);
        assert_eq!(out, [0x3f, 0xf0, 0x03]);
        let mut out = [0u8; 1];
        pack(4, &[0x1, 0xa], &mut out);
        assert_eq!(out, [0xa1]);
    }
}

//! The ring all-reduce of half-precision payloads, over MPI point-to-point messages.
//!
//! MPI has no 16-bit float type, and a user-defined reduction needs rsmpi's libffi feature; so
//! the half all-reduce is the bandwidth-optimal ring that NCCL and Horovod use: a reduce-scatter
//! (`N - 1` steps, each rank adds the chunk its left neighbour sends into its own), then an
//! all-gather (`N - 1` steps, the reduced chunks travel round). Each rank sends `2 (N - 1) / N`
//! times the payload, the same as MPI's own large-message all-reduce. The order of the additions
//! is fixed (chunk `c` is summed from rank `c` onwards round the ring), and every rank ends with
//! the same bits: the all-gather copies, it does not recompute.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};
use mpi::point_to_point::send_receive_into;
use mpi::topology::SimpleCommunicator;
use mpi::traits::Communicator;

/// The 16-bit float on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Half {
    F16,
    Bf16,
}

impl Half {
    /// Rounds `src` to the wire type.
    pub(super) fn encode(self, src: &[f32], dst: &mut [u16]) {
        match self {
            Half::F16 => dst
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(src),
            Half::Bf16 => dst
                .reinterpret_cast_mut::<bf16>()
                .convert_from_f32_slice(src),
        }
    }

    /// Widens `src` to f32.
    pub(super) fn decode(self, src: &[u16], dst: &mut [f32]) {
        match self {
            Half::F16 => src.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
            Half::Bf16 => src.reinterpret_cast::<bf16>().convert_to_f32_slice(dst),
        }
    }
}

/// Elements added per block (widened into stack buffers, added, rounded back).
const BLOCK: usize = 512;

/// `acc[i] = round(acc[i] + other[i])` in the wire type.
fn add_into(half: Half, acc: &mut [u16], other: &[u16]) {
    let (mut a, mut b) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
    for (acc, other) in acc.chunks_mut(BLOCK).zip(other.chunks(BLOCK)) {
        let n = acc.len();
        half.decode(acc, &mut a[..n]);
        half.decode(other, &mut b[..n]);
        for (x, y) in a[..n].iter_mut().zip(&b[..n]) {
            *x += *y;
        }
        half.encode(&a[..n], acc);
    }
}

/// The bounds of chunk `k` of `n` elements split `size` ways.
fn chunk(n: usize, size: usize, k: usize) -> std::ops::Range<usize> {
    (k * n / size)..((k + 1) * n / size)
}

/// Sums `buf` across the ranks of `comm`, in place, in the wire type; `scratch` is resized to
/// hold one chunk.
pub(super) fn all_reduce_sum(
    comm: &SimpleCommunicator,
    half: Half,
    buf: &mut [u16],
    scratch: &mut Vec<u16>,
) {
    let size = comm.size() as usize;
    if size == 1 {
        return;
    }
    let rank = comm.rank() as usize;
    let n = buf.len();
    scratch.resize(n / size + 1, 0);
    let next = comm.process_at_rank(((rank + 1) % size) as i32);
    let prev = comm.process_at_rank(((rank + size - 1) % size) as i32);
    // reduce-scatter: after step s, the chunk received holds the sum of s + 2 ranks
    for s in 0..size - 1 {
        let send = chunk(n, size, (rank + size - s) % size);
        let recv = chunk(n, size, (rank + 2 * size - s - 1) % size);
        let got = &mut scratch[..recv.len()];
        send_receive_into(&buf[send], &next, got, &prev);
        add_into(half, &mut buf[recv], got);
    }
    // all-gather: rank r now owns chunk r + 1; pass the reduced chunks round
    for s in 0..size - 1 {
        let send = chunk(n, size, (rank + 1 + size - s) % size);
        let recv = chunk(n, size, (rank + size - s) % size);
        let got = &mut scratch[..recv.len()];
        send_receive_into(&buf[send], &next, got, &prev);
        buf[recv].copy_from_slice(got);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_once() {
        for n in [0, 1, 2, 5, 7, 100] {
            for size in 1..5 {
                let mut next = 0;
                for k in 0..size {
                    let c = chunk(n, size, k);
                    assert_eq!(c.start, next);
                    next = c.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn half_addition_rounds_to_the_wire_type() {
        let enc = |h: Half, v: &[f32]| {
            let mut out = vec![0u16; v.len()];
            h.encode(v, &mut out);
            out
        };
        for h in [Half::F16, Half::Bf16] {
            let mut a = enc(h, &[1.0, 60000.0, -2.5]);
            let b = enc(h, &[2.0, 60000.0, 2.5]);
            add_into(h, &mut a, &b);
            let mut back = [0.0f32; 3];
            h.decode(&a, &mut back);
            assert_eq!(back[0], 3.0);
            assert_eq!(back[2], 0.0);
            // 120000 overflows f16 (max 65504) but not bf16
            assert_eq!(back[1].is_finite(), h == Half::Bf16);
        }
    }
}

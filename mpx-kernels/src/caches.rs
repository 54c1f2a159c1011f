//! The data caches' sizes, read once per process, and the GEMM blocking sized to them.
//!
//! # Reading the caches
//! On Linux, from `/sys/devices/system/cpu/cpu0/cache/index*/{level,type,size,shared_cpu_list}`
//! (the entries of type `Data` or `Unified`; sizes such as `48K`, `1024K`, `32768K`, `1M`), once,
//! on first use. Where the files are missing or unreadable (another OS, a container without
//! sysfs, text that is not a size), or have no L1 data cache or no L2, the blocking uses
//! [`Caches::ZEN3`]: the commonest CPU of mpx's users, whose small L1 and L2 make it the safe
//! guess. The L3's share of one core is its size over the cores that share it
//! (`shared_cpu_list` of the L3 over that of the L2, so SMT siblings count once).
//!
//! # The rule
//! BLIS's analytical blocking (Low, Igual, Smith, Quintana-Ortí, "Analytical Modeling Is Enough
//! for High-Performance BLIS", 2016), for a micro-tile of `mr x nr` elements of `s` bytes:
//!
//! - `kc`: BLIS sizes it so that a `kc x nr` micro-panel of B plus an `mr x kc` micro-panel of A
//!   fit in half of L1d; here it is the kernel's own (see "Where it applies");
//! - `mc`: the packed `mc x kc` block of A fits in half of L2: `mc = (L2 / 2) / (kc·s)`, rounded
//!   down to a multiple of `mr`, clamped to `[mr, 1024]`;
//! - `nc`: the packed `kc x nc` block of B fits in one core's share of L3 (in half of L2 when
//!   there is no L3): `nc = share / (kc·s)`, rounded down to a multiple of `nr`, clamped to
//!   `[nr, 4096]`.
//!
//! Where a clamp wins (tiny caches), the bound it overrides is not met; the tests check every
//! other bound on Zen 3's, Zen 5's, Sapphire Rapids' and tiny caches.
//!
//! # Where it applies
//! [`KernelPath::Avx2Fma`](crate::KernelPath) takes `mc` and `nc` from this rule and keeps
//! `kc = 256`: its micro-kernel adds each k block's FMA chain into `C` (`avx2.rs`), so `kc`
//! decides where the roundings fall, and it must equal the AVX-512 kernel's `kc` for the two paths
//! to compute the same bits (the [calibration](crate::calibration) picks between them by speed
//! only). `mc` and `nc` only choose which tiles are computed together, never an element's
//! operations, so results stay bit-identical for any caches, as for any thread count (the tests
//! compare Zen 3's, Zen 5's, tiny caches' and the fixed blocking bit for bit). `kc = 256` is also
//! BLIS's own choice for its 6 x 16 f32 kernel on Zen 3. The other paths keep their fixed
//! blocking (`tile.rs`'s `Micro::new`; the bf16 path's pairs are laid out per k block of
//! `bf16::KC`).
//!
//! # Measured
//! `cargo run --release --example bench_kernels` (its AVX2 blocking table: f32, the 9 products
//! of the MLP step, medians of 31 interleaved rounds, % of the AVX2 FMA peak measured in the same
//! rounds, 135 GFLOP/s per thread), at `f166a5a` on an AMD EPYC Zen 5, 2 shared cores, forced
//! AVX2 path; ms per step:
//!
//! | blocking (kc x mc x nc) | 1 thread | 2 threads |
//! |---|---|---|
//! | fixed (256 x 72 x 512) | 20.61 (87%) | 11.77 (76%) |
//! | this CPU's caches (256 x 510 x 4096) | 20.39 (88%) | 11.54 (78%) |
//! | Zen 3's caches (256 x 252 x 4096) | 20.44 (88%) | 11.47 (78%) |
//!
//! Within 2% of each other: Zen 5's 1 MiB L2 held the fixed 512 KiB B block with room to spare.
//! Zen 3's blocking measured here says nothing of Zen 3's caches; there the fixed B block filled
//! all of L2 and the sized one moves it to L3, with the A block in half of L2, as BLIS does (its
//! Zen 3 f32 blocking: 256 x 144 x 4080). Whether that reaches 75% of Zen 3's peak needs a Zen 3
//! to tell.

use std::cell::Cell;
use std::sync::OnceLock;

/// A CPU core's data caches as the GEMM's blocking sees them, in bytes.
///
/// # Examples
/// ```
/// use mpx_kernels::Caches;
///
/// let here = Caches::detected();
/// assert!(here.l1d > 0 && here.l2 > 0);
/// // one core's share of Zen 3's 32 MiB L3, shared by 8 cores
/// assert_eq!(Caches::ZEN3.l3_share(), Some(4 << 20));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caches {
    /// The L1 data cache of one core.
    pub l1d: usize,
    /// The L2 cache (data or unified) of one core.
    pub l2: usize,
    /// The L3 cache, all of it; `None` where there is none.
    pub l3: Option<usize>,
    /// The cores that share the L3 (at least 1).
    pub l3_cores: usize,
}

impl Caches {
    /// AMD Zen 3 (Ryzen 5000, EPYC 7003): L1d 32 KiB, L2 512 KiB, L3 32 MiB shared by 8
    /// cores. The fallback where the caches cannot be read.
    ///
    /// # Examples
    /// ```
    /// let z3 = mpx_kernels::Caches::ZEN3;
    /// assert_eq!((z3.l1d, z3.l2, z3.l3), (32 << 10, 512 << 10, Some(32 << 20)));
    /// ```
    pub const ZEN3: Caches = Caches {
        l1d: 32 << 10,
        l2: 512 << 10,
        l3: Some(32 << 20),
        l3_cores: 8,
    };

    /// This CPU's caches, read once per process (on Linux from
    /// `/sys/devices/system/cpu/cpu0/cache/index*/`: the `Data` and `Unified` caches' `level`,
    /// `size` and `shared_cpu_list`), or [`Caches::ZEN3`] where they cannot be read (no such
    /// files, text that is not a size, no L1 data cache or no L2).
    ///
    /// # Examples
    /// ```
    /// let c = mpx_kernels::Caches::detected();
    /// assert!(c.l1d <= c.l2 && c.l3_cores >= 1);
    /// ```
    pub fn detected() -> Caches {
        static DETECTED: OnceLock<Caches> = OnceLock::new();
        *DETECTED.get_or_init(|| read_sysfs().unwrap_or(Caches::ZEN3))
    }

    /// One core's share of the L3: its size over the cores that share it.
    ///
    /// # Examples
    /// ```
    /// use mpx_kernels::Caches;
    /// let no_l3 = Caches { l3: None, ..Caches::ZEN3 };
    /// assert_eq!(no_l3.l3_share(), None);
    /// ```
    pub fn l3_share(&self) -> Option<usize> {
        self.l3.map(|l3| l3 / self.l3_cores.max(1))
    }
}

/// A GEMM blocking: `kc` values of k per block, `mc` rows of A, `nc` columns of B.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Blocking {
    pub(crate) kc: usize,
    pub(crate) mc: usize,
    pub(crate) nc: usize,
}

const MC_MAX: usize = 1024;
const NC_MAX: usize = 4096;

/// The blocking for `caches`, an `mr x nr` micro-tile of `elem`-byte values and the kernel's `kc`
/// (the rule of the [module docs](self)).
pub(crate) fn blocking(
    caches: &Caches,
    (mr, nr, elem): (usize, usize, usize),
    kc: usize,
) -> Blocking {
    let (mr, nr, elem) = (mr.max(1), nr.max(1), elem.max(1));
    // `x` rounded down to a multiple of `q`, within `[lo, hi]` (both rounded to `q`, `lo >= q`)
    let fit = |x: usize, q: usize, lo: usize, hi: usize| {
        let (lo, hi) = (lo.next_multiple_of(q), (hi / q * q).max(q));
        (x / q * q).clamp(lo.min(hi), hi)
    };
    let kc = kc.max(1);
    let mc = fit(caches.l2 / 2 / (kc * elem), mr, mr, MC_MAX);
    let b_room = caches.l3_share().unwrap_or(caches.l2 / 2);
    let nc = fit(b_room / (kc * elem), nr, nr, NC_MAX);
    Blocking { kc, mc, nc }
}

/// The fixed blocking the AVX2 path used before it was sized to the caches (kept for
/// comparison: [`Sizing::Fixed`]).
pub(crate) const AVX2_FIXED: Blocking = Blocking {
    kc: AVX2_KC,
    mc: 72,
    nc: 512,
};

/// How the AVX2 path sizes its blocking: a benchmark's knob ([`with_blocking`]), not a public API.
///
/// # Examples
/// ```
/// use mpx_kernels::{Caches, Sizing};
/// // kc stays 256 (see the module docs); mc and nc follow the caches
/// assert_eq!(Sizing::Fixed.avx2_blocking(), (256, 72, 512));
/// assert_eq!(Sizing::Caches(Caches::ZEN3).avx2_blocking(), (256, 252, 4096));
/// ```
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sizing {
    /// The fixed blocking used before: `kc` 256, `mc` 72, `nc` 512.
    Fixed,
    /// Sized to these caches.
    Caches(Caches),
}

impl Sizing {
    /// The AVX2 path's `(kc, mc, nc)` under this sizing.
    ///
    /// # Examples
    /// See [`Sizing`].
    pub fn avx2_blocking(&self) -> (usize, usize, usize) {
        let b = avx2_blocking_for(*self);
        (b.kc, b.mc, b.nc)
    }
}

/// The AVX2 kernel's micro-tile and the `kc` its arithmetic fixes (see the module docs).
pub(crate) const AVX2_TILE: (usize, usize, usize) = (6, 16, 4);
pub(crate) const AVX2_KC: usize = super::tile::KC;

fn avx2_blocking_for(sizing: Sizing) -> Blocking {
    match sizing {
        Sizing::Fixed => AVX2_FIXED,
        Sizing::Caches(c) => blocking(&c, AVX2_TILE, AVX2_KC),
    }
}

thread_local! {
    static SIZING: Cell<Option<Sizing>> = const { Cell::new(None) };
}

/// The AVX2 path's blocking for a product started on this thread: sized to
/// [`Caches::detected`], unless [`with_blocking`] forces another.
pub(crate) fn avx2_blocking() -> Blocking {
    let sizing = SIZING
        .with(Cell::get)
        .unwrap_or_else(|| Sizing::Caches(Caches::detected()));
    avx2_blocking_for(sizing)
}

/// Runs `f` with the AVX2 path's blocking on this thread sized by `sizing` (products started
/// here; their helper threads follow), then restores the previous one. For benchmarks and tests:
/// not a public API. The blocking never changes a result's bits, only speed.
///
/// # Examples
/// ```
/// use mpx_kernels::{Caches, KernelPath, MatRef, Sizing, gemm_on, with_blocking};
///
/// let a = MatRef::row_major_f32(&[1.0, 2.0], 1, 2)?;
/// let b = MatRef::row_major_f32(&[3.0, 4.0], 2, 1)?;
/// let mut c = [0.0f32];
/// if KernelPath::Avx2Fma.is_supported() {
///     with_blocking(Sizing::Caches(Caches::ZEN3), || {
///         gemm_on(KernelPath::Avx2Fma, a, b, &mut c, false)
///     })?;
///     assert_eq!(c, [11.0]);
/// }
/// # Ok::<(), mpx_kernels::KernelError>(())
/// ```
#[doc(hidden)]
pub fn with_blocking<R>(sizing: Sizing, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Sizing>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SIZING.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(SIZING.with(|c| c.replace(Some(sizing))));
    f()
}

/// A sysfs cache size (`"48K"`, `"1024K"`, `"1M"`, a plain byte count; surrounding white
/// space ignored) in bytes; `None` for anything else, zero, or a size that overflows.
pub(crate) fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let scale: usize = match unit {
        "" | "B" => 1,
        "K" | "k" | "KB" | "KiB" => 1 << 10,
        "M" | "MB" | "MiB" => 1 << 20,
        "G" | "GB" | "GiB" => 1 << 30,
        _ => return None,
    };
    if digits.is_empty() {
        return None;
    }
    let n: usize = digits.parse().ok()?;
    n.checked_mul(scale).filter(|&b| b > 0)
}

/// The number of CPUs in a sysfs CPU list (`"0"`, `"0-15"`, `"0,8"`, `"0-3,8-11"`); `None`
/// for anything else.
pub(crate) fn count_cpus(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.trim().split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi) = (lo.parse::<usize>().ok()?, hi.parse::<usize>().ok()?);
        n = n.checked_add(hi.checked_sub(lo)? + 1)?;
    }
    Some(n)
}

/// One cache as sysfs describes it: level, type, size and sharing CPU list, as text.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry<'a> {
    pub(crate) level: &'a str,
    pub(crate) kind: &'a str,
    pub(crate) size: &'a str,
    pub(crate) shared: Option<&'a str>,
}

/// The caches of a core from its sysfs entries: `None` without a readable L1 data cache and L2.
/// Instruction caches and entries that do not parse are skipped; a missing or unreadable CPU
/// list counts as one CPU.
pub(crate) fn from_entries(entries: &[Entry<'_>]) -> Option<Caches> {
    let mut found: [Option<(usize, usize)>; 3] = [None; 3];
    for e in entries {
        if !matches!(e.kind.trim(), "Data" | "Unified") {
            continue;
        }
        let (Ok(level @ 1..=3), Some(size)) = (e.level.trim().parse::<usize>(), parse_size(e.size))
        else {
            continue;
        };
        let cpus = e.shared.and_then(count_cpus).unwrap_or(1).max(1);
        found[level - 1].get_or_insert((size, cpus));
    }
    let ((l1d, _), (l2, l2_cpus)) = (found[0]?, found[1]?);
    Some(Caches {
        l1d,
        l2,
        l3: found[2].map(|(s, _)| s),
        l3_cores: found[2].map_or(1, |(_, cpus)| (cpus / l2_cpus).max(1)),
    })
}

/// The caches of CPU 0 from Linux's sysfs; `None` where it cannot be read.
fn read_sysfs() -> Option<Caches> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut texts = vec![];
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let p = entry.path();
        let is_index = p
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("index"));
        if !is_index {
            continue;
        }
        let read = |f: &str| std::fs::read_to_string(p.join(f)).ok();
        if let (Some(level), Some(kind), Some(size)) = (read("level"), read("type"), read("size")) {
            texts.push((level, kind, size, read("shared_cpu_list")));
        }
    }
    let entries: Vec<Entry<'_>> = texts
        .iter()
        .map(|(level, kind, size, shared)| Entry {
            level,
            kind,
            size,
            shared: shared.as_deref(),
        })
        .collect();
    from_entries(&entries)
}

/// Sample cache sets for the tests: Zen 5 (this machine's EPYC as its sysfs shows it, the L3
/// shared by its 2 CPUs), Sapphire Rapids (1.875 MiB of L3 per core), and a tiny, odd set
/// without L3.
#[cfg(test)]
pub(crate) const ZEN5: Caches = Caches {
    l1d: 48 << 10,
    l2: 1 << 20,
    l3: Some(32 << 20),
    l3_cores: 2,
};
#[cfg(test)]
pub(crate) const SPR: Caches = Caches {
    l1d: 48 << 10,
    l2: 2 << 20,
    l3: Some(105 << 20),
    l3_cores: 56,
};
#[cfg(test)]
pub(crate) const TINY: Caches = Caches {
    l1d: 3 << 10,
    l2: 20 << 10,
    l3: None,
    l3_cores: 1,
};

#[cfg(test)]
mod tests {
    use super::{
        AVX2_FIXED, AVX2_KC, AVX2_TILE, Blocking, Caches, Entry, MC_MAX, NC_MAX, SPR, TINY, ZEN5,
        blocking, count_cpus, from_entries, parse_size,
    };

    const K: usize = 1 << 10;
    const M: usize = 1 << 20;

    #[test]
    fn sizes_parse_as_sysfs_writes_them_and_garbage_does_not() {
        assert_eq!(parse_size("48K"), Some(48 * K));
        assert_eq!(parse_size("1024K\n"), Some(M));
        assert_eq!(parse_size("32768K"), Some(32 * M));
        assert_eq!(parse_size("1M"), Some(M));
        assert_eq!(parse_size(" 2G "), Some(2 << 30));
        assert_eq!(parse_size("512"), Some(512));
        for bad in [
            "",
            "K",
            "12Q",
            "-1K",
            "1.5M",
            "0K",
            "0",
            "4 K",
            "99999999999999999999K",
            "abc",
        ] {
            assert_eq!(parse_size(bad), None, "{bad:?}");
        }
        assert_eq!(count_cpus("0-1\n"), Some(2));
        assert_eq!(count_cpus("0"), Some(1));
        assert_eq!(count_cpus("0,8"), Some(2));
        assert_eq!(count_cpus("0-3,8-11"), Some(8));
        for bad in ["", "3-1", "a", "0-", "0,,1"] {
            assert_eq!(count_cpus(bad), None, "{bad:?}");
        }
    }

    fn e<'a>(level: &'a str, kind: &'a str, size: &'a str, shared: &'a str) -> Entry<'a> {
        Entry {
            level,
            kind,
            size,
            shared: Some(shared),
        }
    }

    #[test]
    fn sysfs_entries_give_the_data_caches_or_nothing() {
        // Zen 3 as Linux shows it: SMT pairs share L1 and L2, 16 CPUs the L3
        let zen3 = [
            e("1\n", "Data\n", "32K\n", "0,16\n"),
            e("1", "Instruction", "32K", "0,16"),
            e("2", "Unified", "512K", "0,16"),
            e("3", "Unified", "32768K", "0-7,16-23"),
        ];
        assert_eq!(from_entries(&zen3), Some(Caches::ZEN3));
        // this machine's: no SMT, the L3 shared by 2 CPUs
        let zen5 = [
            e("1", "Data", "48K", "0"),
            e("1", "Instruction", "32K", "0"),
            e("2", "Unified", "1024K", "0"),
            e("3", "Unified", "32768K", "0-1"),
        ];
        assert_eq!(from_entries(&zen5), Some(ZEN5));
        // no L3, no CPU lists: one core
        let none = Entry {
            shared: None,
            ..e("2", "Unified", "20K", "")
        };
        assert_eq!(from_entries(&[e("1", "Data", "3K", "x"), none]), Some(TINY));
        // an instruction cache is no L1d; garbage sizes and levels are skipped: no L1d, no L2
        assert_eq!(from_entries(&[e("1", "Instruction", "32K", "0")]), None);
        assert_eq!(
            from_entries(&[e("1", "Data", "lots", "0"), e("2", "Unified", "1M", "0")]),
            None
        );
        assert_eq!(
            from_entries(&[e("one", "Data", "48K", "0"), e("2", "Unified", "1M", "0")]),
            None
        );
        assert_eq!(from_entries(&[]), None);
        // whatever this machine's sysfs holds, detection gives usable sizes
        let here = Caches::detected();
        assert!(here.l1d > 0 && here.l2 > 0 && here.l3_cores >= 1);
    }

    /// The bounds of the rule, each unless its clamp won, and the kernel's `kc` kept.
    fn check(c: &Caches, (mr, nr, elem): (usize, usize, usize), kc: usize, b: Blocking) {
        let what = format!("{c:?} {mr}x{nr}x{elem} kc {kc} -> {b:?}");
        assert_eq!(b.kc, kc, "{what}");
        assert!(
            b.mc.is_multiple_of(mr) && (mr..=MC_MAX).contains(&b.mc),
            "{what}"
        );
        assert!(b.mc * b.kc * elem <= c.l2 / 2 || b.mc == mr, "{what}");
        assert!(
            b.nc.is_multiple_of(nr) && (nr..=NC_MAX).contains(&b.nc),
            "{what}"
        );
        let room = c.l3_share().unwrap_or(c.l2 / 2);
        assert!(b.kc * b.nc * elem <= room || b.nc == nr, "{what}");
    }

    #[test]
    fn blocking_fits_each_cache_level() {
        let tiles = [(AVX2_TILE.0, AVX2_TILE.1), (8, 32), (4, 16), (8, 64)];
        for c in [Caches::ZEN3, ZEN5, SPR, TINY] {
            for (mr, nr) in tiles {
                for elem in [2, 4] {
                    for kc in [256, 7, 1000] {
                        check(&c, (mr, nr, elem), kc, blocking(&c, (mr, nr, elem), kc));
                    }
                }
            }
        }
        // the figures the module docs quote
        let f32_6x16 = (6, 16, 4);
        let avx2 = |c: &Caches| blocking(c, f32_6x16, AVX2_KC);
        let b = |kc, mc, nc| Blocking { kc, mc, nc };
        assert_eq!(avx2(&Caches::ZEN3), b(256, 252, 4096));
        assert_eq!(avx2(&ZEN5), b(256, 510, 4096));
        assert_eq!(avx2(&SPR), b(256, 1020, 1920));
        assert_eq!(avx2(&TINY), b(256, 6, 16));
        // the fixed blocking put a 512 KiB B block in Zen 3's 512 KiB L2; the sized one keeps
        // B in L3 and A in half of L2
        assert_eq!(AVX2_FIXED.kc * AVX2_FIXED.nc * 4, Caches::ZEN3.l2);
    }
}

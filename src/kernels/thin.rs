//! Matrix products with one small dimension, without packing: a convolution's products.
//!
//! A convolution over a batch multiplies an im2col matrix of `n * oh * ow` rows (tens of
//! thousands) by a filter of a few dozen columns. A general sgemm (OpenBLAS) copies both
//! operands into packed panels before its kernel runs; when one side is that thin, the
//! copy of the large side costs about half as much as the arithmetic. These kernels read
//! the large side where it lies and keep a tile of the output in AVX2 registers, so the
//! product streams through memory once:
//!
//! - `C = A B` (`A` stored `m x k`, `B` `k x n`): the forward product (`k` the window,
//!   `n` the filters) and the column gradient (`k` the filters);
//! - `C = A^T B` (`A` stored `k x m`): the filter gradient, a sum over the batch's rows,
//!   blocked so that a block of `A` stays in the L2 cache while every tile of `C` reads it.
//!
//! A tile's sum walks segments, so [`conv_into`] and [`conv_filter_grad_into`] read a
//! convolution's window rows straight from a padded copy of the input: no im2col matrix.
//!
//! [`suits`] says when a call takes this path (an x86-64 CPU with AVX2 and FMA, a product
//! of the thin kind, `n` a multiple of 8); [`super::gemm`] asks it before calling BLAS, so
//! every caller (the built-in layers and a user's) gets it. [`set_enabled`] turns it off,
//! for benchmarks that compare the two.

use std::sync::atomic::{AtomicU8, Ordering};

use super::conv::Window2d;
use super::KernelError;

/// The largest small dimension the thin path takes.
const THIN: usize = 64;

/// The terms of a sum taken per pass over `C`: a block of `B`'s rows (`n` wide) that
/// stays in the L1 cache (16 KiB) while every tile of `C` reads it.
fn sum_block(n: usize) -> usize {
    (4096 / n.max(1)).max(16)
}

/// 0: not yet known, 1: usable, 2: unusable or turned off.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Turns the thin path on (if the CPU has AVX2 and FMA) or off.
pub fn set_enabled(on: bool) {
    STATE.store(if on && cpu_has_it() { 1 } else { 2 }, Ordering::Relaxed);
}

/// Whether products take the thin path when they suit it.
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            set_enabled(true);
            enabled()
        }
        s => s == 1,
    }
}

fn cpu_has_it() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether `C (m x n) = alpha op(A) op(B) + beta C` takes the thin path: `alpha` 1, `beta`
/// 0 or 1, `n` a multiple of 8, and one dimension at most 64 beside a long one.
#[allow(clippy::too_many_arguments)]
pub fn suits(ta: bool, tb: bool, m: usize, n: usize, k: usize, alpha: f32, beta: f32) -> bool {
    let shape = n.is_multiple_of(8)
        && n > 0
        && match (ta, tb) {
            // Forward (thin `n`) and column gradient (thin `k`, B given transposed).
            (false, _) => m >= 16 && (n <= THIN || k <= THIN),
            // Filter gradient: a thin output summed over many rows.
            (true, false) => n <= THIN && k >= 4 * THIN,
            (true, true) => false,
        };
    shape && alpha == 1.0 && (beta == 0.0 || beta == 1.0) && enabled()
}

/// `C = op(A) op(B) + beta C` on the thin path; the caller checked [`suits`] and the
/// slice lengths (`A` `m * k`, `B` `k * n`, `C` `m * n`).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm(
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n && n.is_multiple_of(8));
    // B's rows must be contiguous: a transposed B (the filter, small) is transposed here.
    let transposed;
    let b = if tb {
        transposed = {
            let mut t = vec![0.0f32; k * n];
            super::transpose_into(b, n, k, &mut t);
            t
        };
        &transposed[..]
    } else {
        b
    };
    #[cfg(target_arch = "x86_64")]
    {
        assert!(cpu_has_it(), "thin gemm called without AVX2 and FMA");
        let add = beta == 1.0;
        // SAFETY: the CPU has AVX2 and FMA (asserted at run time), and the slices hold
        // the shapes asserted above.
        unsafe {
            if ta {
                avx::gemm_tn(m, n, k, a, b, c, add)
            } else {
                avx::gemm_nn(m, n, k, a, b, c, add)
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ta, m, a, b, beta, c);
        unreachable!("the thin path is x86-64 only; suits() refuses it elsewhere");
    }
}

/// Whether a convolution with `filters` outputs runs on [`conv_into`].
pub fn suits_conv(filters: usize) -> bool {
    filters > 0 && filters.is_multiple_of(8) && enabled()
}

/// A convolution's forward product without im2col: `out (+= if add) = cols(xp) W` for
/// `n` images `xp` padded as [`super::conv::pad_into`] lays them out, `wts` `k x
/// filters`; the caller checked [`suits_conv`].
pub fn conv_into(
    g: &Window2d,
    n: usize,
    xp: &[f32],
    wts: &[f32],
    filters: usize,
    out: &mut [f32],
    add: bool,
) -> Result<(), KernelError> {
    direct_shapes(
        "conv",
        g,
        n,
        xp,
        filters,
        [
            ("filter", wts.len(), g.k() * filters),
            ("output", out.len(), n * g.pixels() * filters),
        ],
    )?;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 and FMA present (asserted), the shapes checked above.
    unsafe {
        avx::conv(g, n, xp, wts, filters, out, add)
    };
    Ok(())
}

/// Checks a direct convolution's operands (the padded input and two more, each as
/// `(what, len, need)`) and that it suits the direct path ([`suits_conv`]).
fn direct_shapes(
    kernel: &'static str,
    g: &Window2d,
    n: usize,
    xp: &[f32],
    filters: usize,
    more: [(&'static str, usize, usize); 2],
) -> Result<(), KernelError> {
    super::need(kernel, "padded input", xp.len(), n * g.padded_len())?;
    for (what, len, need) in more {
        super::need(kernel, what, len, need)?;
    }
    if !(filters.is_multiple_of(8) && cpu_has_it()) {
        return Err(KernelError::Layer(format!(
            "{kernel}: the direct path needs AVX2 and FMA and filters a multiple of 8 \
             ({filters}); ask suits_conv first"
        )));
    }
    Ok(())
}

/// A convolution's filter gradient without im2col: `gw (+= if add) = cols(xp)^T dy` for
/// `n` padded images `xp` and the output gradient `dy` (`n oh ow x filters`); the caller
/// checked [`suits_conv`].
pub fn conv_filter_grad_into(
    g: &Window2d,
    n: usize,
    xp: &[f32],
    dy: &[f32],
    filters: usize,
    gw: &mut [f32],
    add: bool,
) -> Result<(), KernelError> {
    let (out_len, k) = (n * g.pixels() * filters, g.k() * filters);
    let shapes = [
        ("output gradient", dy.len(), out_len),
        ("filter gradient", gw.len(), k),
    ];
    direct_shapes("conv filter gradient", g, n, xp, filters, shapes)?;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 and FMA present (asserted), the shapes checked above.
    unsafe {
        avx::conv_filter_grad(g, n, xp, dy, filters, gw, add)
    };
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    /// How a tile's sum walks its operands: `segs` segments of `len` terms; term `t` of
    /// segment `s` reads the left operand of tile row `j` at `a[j sj + t st + s seg_a]`
    /// and the right operand's row at `b[t ldb + s seg_b]`. With one segment, `sj = lda,
    /// st = 1` walks `A`'s rows (`A B`), `sj = 1, st = lda` its columns (`A^T B`); with
    /// a convolution's window rows as segments, the padded image itself is the left
    /// operand (no im2col).
    #[derive(Clone, Copy)]
    pub(super) struct Sum {
        pub len: usize,
        pub segs: usize,
        pub sj: usize,
        pub st: usize,
        pub seg_a: usize,
        pub ldb: usize,
        pub seg_b: usize,
    }

    impl Sum {
        /// One segment of `len` terms.
        pub fn plain(len: usize, (sj, st): (usize, usize), ldb: usize) -> Sum {
            Sum {
                len,
                segs: 1,
                sj,
                st,
                seg_a: 0,
                ldb,
                seg_b: 0,
            }
        }
    }

    /// One tile of `R` rows by `8 V` columns of `C` (rows `ldc` apart): `C[j][..] (+)=`
    /// the sum `w` describes. Twelve accumulators at most (`R V <= 12`), the `V` vectors
    /// of `B`'s row and a broadcast: within the 16 AVX registers.
    ///
    /// # Safety
    /// AVX2 and FMA present; every address `w` names for `j < R`, and `c[j ldc + 8 V - 1]`
    /// for `j < R`, in bounds.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const V: usize>(
        w: &Sum,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        add: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); V]; R];
        if add {
            for (j, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    // SAFETY: C's tile is in bounds (the caller's contract).
                    *x = unsafe { _mm256_loadu_ps(c.add(j * ldc + 8 * v)) };
                }
            }
        }
        for s in 0..w.segs {
            // SAFETY: the segment's first terms are in bounds (the caller's contract).
            let (mut ap, mut bp) = unsafe { (a.add(s * w.seg_a), b.add(s * w.seg_b)) };
            for _ in 0..w.len {
                let mut bv = [_mm256_setzero_ps(); V];
                for (v, x) in bv.iter_mut().enumerate() {
                    // SAFETY: B's row of this term is in bounds.
                    *x = unsafe { _mm256_loadu_ps(bp.add(8 * v)) };
                }
                for (j, row) in acc.iter_mut().enumerate() {
                    // SAFETY: row j's term is in bounds for j < R.
                    let x = unsafe { _mm256_broadcast_ss(&*ap.add(j * w.sj)) };
                    for (acc, b) in row.iter_mut().zip(&bv) {
                        *acc = _mm256_fmadd_ps(x, *b, *acc);
                    }
                }
                // The next term's addresses; one step past the last is never read.
                (ap, bp) = (ap.wrapping_add(w.st), bp.wrapping_add(w.ldb));
            }
        }
        for (j, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                // SAFETY: C's tile is in bounds (the caller's contract).
                unsafe { _mm256_storeu_ps(c.add(j * ldc + 8 * v), *x) };
            }
        }
    }

    /// `rows` (at most 6) consecutive rows of `C` (left operand rows `w.sj` apart) over
    /// every column below `n` (a multiple of 8): 16 columns per tile, then 8. Row `j`'s left operand starts at `a + j w.sj`.
    ///
    /// # Safety
    /// As [`tile`], for every row below `rows` and column below `n`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_of(
        rows: usize,
        n: usize,
        w: &Sum,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        add: bool,
    ) {
        let mut col = 0;
        while col < n {
            let wide = n - col >= 16;
            let mut j = 0;
            while j < rows {
                let r = (rows - j).min(6);
                // SAFETY (every call): rows j..j + r are below `rows`, columns col..col +
                // 16 (or 8) below n; the caller's contract covers them.
                unsafe {
                    let (a, b, c) = (a.add(j * w.sj), b.add(col), c.add(j * ldc + col));
                    match (r, wide) {
                        (6, true) => tile::<6, 2>(w, a, b, c, ldc, add),
                        (5, true) => tile::<5, 2>(w, a, b, c, ldc, add),
                        (4, true) => tile::<4, 2>(w, a, b, c, ldc, add),
                        (3, true) => tile::<3, 2>(w, a, b, c, ldc, add),
                        (2, true) => tile::<2, 2>(w, a, b, c, ldc, add),
                        (_, true) => tile::<1, 2>(w, a, b, c, ldc, add),
                        (6, false) => tile::<6, 1>(w, a, b, c, ldc, add),
                        (5, false) => tile::<5, 1>(w, a, b, c, ldc, add),
                        (4, false) => tile::<4, 1>(w, a, b, c, ldc, add),
                        (3, false) => tile::<3, 1>(w, a, b, c, ldc, add),
                        (2, false) => tile::<2, 1>(w, a, b, c, ldc, add),
                        (_, false) => tile::<1, 1>(w, a, b, c, ldc, add),
                    }
                }
                j += r;
            }
            col += if wide { 16 } else { 8 };
        }
    }

    /// Every tile of `C` (`rows x n`, rows `n` apart), 6 rows at a time: a block's rows
    /// of `A` stay in L1 while every column tile reads them.
    ///
    /// # Safety
    /// As [`tile`], for every row below `rows` and column below `n`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tiles(
        rows: usize,
        n: usize,
        w: &Sum,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        add: bool,
    ) {
        for i in (0..rows).step_by(6) {
            // SAFETY: rows i..i + 6 (or fewer) are below `rows`.
            unsafe {
                let (a, c) = (a.add(i * w.sj), c.add(i * n));
                rows_of((rows - i).min(6), n, w, a, b, c, n, add);
            }
        }
    }

    /// `C (m x n) (+)= A (m x k) B (k x n)`.
    ///
    /// # Safety
    /// AVX2 and FMA present; `a`, `b`, `c` hold `m k`, `k n`, `m n` values; `n % 8 == 0`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gemm_nn(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        add: bool,
    ) {
        // SAFETY: row i of A is a[i k..], B's row t is b[t n..], C's row i is c[i n..]:
        // all in bounds for i < m, t < k, columns < n.
        unsafe {
            let w = Sum::plain(k, (k, 1), n);
            tiles(m, n, &w, a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), add);
        }
    }

    /// `C (m x n) (+)= A^T B` with `A` stored `k x m` and `B` `k x n`: a sum over `k`
    /// (the long side) in blocks of rows that stay in cache.
    ///
    /// # Safety
    /// AVX2 and FMA present; `a`, `b`, `c` hold `k m`, `k n`, `m n` values; `n % 8 == 0`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gemm_tn(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        add: bool,
    ) {
        if k == 0 && !add {
            c[..m * n].fill(0.0);
        }
        let block = super::sum_block(n);
        let mut t0 = 0;
        while t0 < k {
            let len = block.min(k - t0);
            // SAFETY: rows t0..t0 + len of A (m values each) and of B (n each) are in
            // bounds; C's row i (element i of A's rows) is c[i n..], i < m.
            unsafe {
                let (a, b) = (a.as_ptr().add(t0 * m), b.as_ptr().add(t0 * n));
                let w = Sum::plain(len, (1, m), n);
                tiles(m, n, &w, a, b, c.as_mut_ptr(), add || t0 > 0);
            }
            t0 += len;
        }
    }

    /// A convolution's filter gradient `gw (k x oc) (+)= cols(xp)^T dy` for `n` padded
    /// images, read where they lie: tile rows are up to 6 consecutive values of one
    /// window row (`kw c` of them, consecutive in the image too), each tile's sum runs
    /// over an image's output pixels, its rows as segments.
    ///
    /// # Safety
    /// AVX2 and FMA present; `xp` holds `n` padded images, `dy` `n oh ow oc` values,
    /// `gw` `k x oc`; `oc % 8 == 0`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn conv_filter_grad(
        g: &crate::kernels::conv::Window2d,
        n: usize,
        xp: &[f32],
        dy: &[f32],
        oc: usize,
        gw: &mut [f32],
        add: bool,
    ) {
        let (_, wp) = g.padded();
        let (c, run) = (g.c, g.kw * g.c);
        let w = Sum {
            len: g.ow,
            segs: g.oh,
            sj: 1,
            st: g.stride * c,
            seg_a: g.stride * wp * c,
            ldb: oc,
            seg_b: g.ow * oc,
        };
        if n == 0 && !add {
            gw[..g.k() * oc].fill(0.0);
        }
        for b in 0..n {
            for ky in 0..g.kh {
                for u in (0..run).step_by(6) {
                    // SAFETY: tile row j is window value (ky, u + j) < (kh, kw c); its
                    // term (oy, ox) reads padded pixel (oy stride + ky, ox stride) of
                    // image b plus u + j, inside the image; dy's term is pixel (oy, ox)
                    // of image b; gw's row is ky kw c + u + j < k.
                    unsafe {
                        let a = xp.as_ptr().add(b * g.padded_len() + ky * wp * c + u);
                        let d = dy.as_ptr().add(b * g.pixels() * oc);
                        let o = gw.as_mut_ptr().add((ky * run + u) * oc);
                        rows_of((run - u).min(6), oc, &w, a, d, o, oc, add || b > 0);
                    }
                }
            }
        }
    }

    /// A convolution's output `out (+)= xp * W` for `n` padded images `xp`, read where
    /// they lie: each output row's pixels in tiles of up to 6, each tile's sum over the
    /// window's `kh` rows (segments) of `kw c` consecutive values.
    ///
    /// # Safety
    /// AVX2 and FMA present; `xp` holds `n` padded images, `wts` `k x oc`, `out` `n oh ow
    /// oc` values; `oc % 8 == 0`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn conv(
        g: &crate::kernels::conv::Window2d,
        n: usize,
        xp: &[f32],
        wts: &[f32],
        oc: usize,
        out: &mut [f32],
        add: bool,
    ) {
        let (hp, wp) = g.padded();
        let c = g.c;
        let w = Sum {
            len: g.kw * c,
            segs: g.kh,
            sj: g.stride * c,
            st: 1,
            seg_a: wp * c,
            ldb: oc,
            seg_b: g.kw * c * oc,
        };
        for b in 0..n {
            for oy in 0..g.oh {
                let first = (b * hp + oy * g.stride) * wp * c;
                let row = (b * g.oh + oy) * g.ow * oc;
                // SAFETY: pixel ox's window starts at first + ox stride c and spans kh
                // rows of the padded image b (oy stride + kh <= hp, ox stride + kw <=
                // wp); the output row holds ow pixels of oc values.
                unsafe {
                    let (a, o) = (xp.as_ptr().add(first), out.as_mut_ptr().add(row));
                    for ox in (0..g.ow).step_by(6) {
                        let (a, o) = (a.add(ox * w.sj), o.add(ox * oc));
                        rows_of((g.ow - ox).min(6), oc, &w, a, wts.as_ptr(), o, oc, add);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;

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
//! [`suits`] says when a call takes this path (an x86-64 CPU with AVX2 and FMA, a product
//! of the thin kind, `n` a multiple of 8); [`super::gemm`] asks it before calling BLAS, so
//! every caller (the built-in layers and a user's) gets it. [`set_enabled`] turns it off,
//! for benchmarks that compare the two.

use std::sync::atomic::{AtomicU8, Ordering};

/// The largest small dimension the thin path takes.
const THIN: usize = 64;

/// The terms of a sum taken per pass over `C`: a block of `B`'s rows (`n` wide) that
/// stays in the L1 cache (16 KiB) while every tile of `C` reads it.
fn sum_block(n: usize) -> usize {
    std::env::var("THIN_BLOCK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| (4096 / n.max(1)).max(16))
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
        let mut t = vec![0.0f32; k * n];
        for (col, row) in b.chunks_exact(k.max(1)).take(n).enumerate() {
            for (t_, v) in row.iter().enumerate() {
                t[t_ * n + col] = *v;
            }
        }
        transposed = t;
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

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    /// One tile of `R` rows by `8 V` columns of `C`:
    /// `C[j][..] (+)= sum_{t < len} a[j * sj + t * st] * b[t * ldb + ..]`.
    /// With `sj = lda, st = 1` the left operand is `A`'s rows (`A B`); with `sj = 1, st =
    /// lda` its columns (`A^T B`).
    ///
    /// # Safety
    /// AVX2 and FMA present; every address named above, and `c[j * ldc + 8 V - 1]` for
    /// `j < R`, in bounds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const V: usize>(
        len: usize,
        a: *const f32,
        sj: usize,
        st: usize,
        b: *const f32,
        ldb: usize,
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
        let (mut ap, mut bp) = (a, b);
        for _ in 0..len {
            let mut bv = [_mm256_setzero_ps(); V];
            for (v, x) in bv.iter_mut().enumerate() {
                // SAFETY: B's row `t` is in bounds for `t < len`.
                *x = unsafe { _mm256_loadu_ps(bp.add(8 * v)) };
            }
            for (j, row) in acc.iter_mut().enumerate() {
                // SAFETY: a[j * sj + t * st] is in bounds for j < R, t < len.
                let x = unsafe { _mm256_broadcast_ss(&*ap.add(j * sj)) };
                for (acc, b) in row.iter_mut().zip(&bv) {
                    *acc = _mm256_fmadd_ps(x, *b, *acc);
                }
            }
            // SAFETY: one past the last row read at most (wrapping_add would do as well).
            unsafe {
                ap = ap.add(st);
                bp = bp.add(ldb);
            }
        }
        for (j, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                // SAFETY: C's tile is in bounds (the caller's contract).
                unsafe { _mm256_storeu_ps(c.add(j * ldc + 8 * v), *x) };
            }
        }
    }

    /// Every tile of `C` (`rows x n`, `n` a multiple of 8), a block of 6 rows at a time
    /// (its rows of `A` stay in L1 while every column tile reads them): 16 columns per
    /// tile (twelve accumulators, two rows of `B` and a broadcast: 15 of the 16 AVX
    /// registers), then 8; the last rows one at a time. `(sj, st)` as in [`tile`]; `C`'s
    /// rows are `n` apart.
    ///
    /// # Safety
    /// As [`tile`], for every row below `rows` and column below `n`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tiles(
        rows: usize,
        n: usize,
        len: usize,
        a: *const f32,
        (sj, st): (usize, usize),
        b: *const f32,
        c: *mut f32,
        add: bool,
    ) {
        const R: usize = 6;
        let mut i = 0;
        while i < rows {
            let r = (rows - i).min(R);
            let mut col = 0;
            while col < n {
                let wide = n - col >= 16;
                // SAFETY (all calls below): rows i..i + r are below `rows`, columns
                // col..col + 16 (or 8) below n; the caller's contract covers them.
                unsafe {
                    let (b, c) = (b.add(col), c.add(i * n + col));
                    let a = a.add(i * sj);
                    match (r == R, wide) {
                        (true, true) => tile::<R, 2>(len, a, sj, st, b, n, c, n, add),
                        (true, false) => tile::<R, 1>(len, a, sj, st, b, n, c, n, add),
                        (false, _) => {
                            for j in 0..r {
                                let (a, c) = (a.add(j * sj), c.add(j * n));
                                if wide {
                                    tile::<1, 2>(len, a, sj, st, b, n, c, n, add)
                                } else {
                                    tile::<1, 1>(len, a, sj, st, b, n, c, n, add)
                                }
                            }
                        }
                    }
                }
                col += if wide { 16 } else { 8 };
            }
            i += r;
        }
    }

    /// `C (m x n) (+)= A (m x k) B (k x n)`.
    ///
    /// # Safety
    /// AVX2 and FMA present; `a`, `b`, `c` hold `m k`, `k n`, `m n` values; `n.is_multiple_of(8)`.
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
            tiles(m, n, k, a.as_ptr(), (k, 1), b.as_ptr(), c.as_mut_ptr(), add);
        }
    }

    /// `C (m x n) (+)= A^T B` with `A` stored `k x m` and `B` `k x n`: a sum over `k`
    /// (the long side) in blocks of rows that stay in cache.
    ///
    /// # Safety
    /// AVX2 and FMA present; `a`, `b`, `c` hold `k m`, `k n`, `m n` values; `n.is_multiple_of(8)`.
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
                tiles(
                    m,
                    n,
                    len,
                    a.as_ptr().add(t0 * m),
                    (1, m),
                    b.as_ptr().add(t0 * n),
                    c.as_mut_ptr(),
                    add || t0 > 0,
                );
            }
            t0 += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(ta: bool, tb: bool, m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for t in 0..k {
                    let av = if ta { a[t * m + i] } else { a[i * k + t] };
                    let bv = if tb { b[j * k + t] } else { b[t * n + j] };
                    s += f64::from(av) * f64::from(bv);
                }
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    fn fill(len: usize, salt: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 31 + salt * 17) % 23) as f32 - 11.0) / 7.0)
            .collect()
    }

    #[test]
    fn thin_products_equal_naive_loops_on_odd_shapes() {
        if !enabled() {
            eprintln!("no AVX2/FMA here: the thin path is not taken");
            return;
        }
        // Row counts that leave tails of every tile height, widths of every tile, long
        // sums across row blocks, one-element sums, and a sum shorter than a block.
        for (ta, tb, m, n, k) in [
            (false, false, 37, 32, 25),
            (false, false, 100, 16, 400),
            (false, false, 19, 8, 3),
            (false, false, 23, 56, 7),
            (false, true, 41, 400, 32),
            (false, true, 17, 24, 1),
            (false, false, 16, 64, 64),
            (true, false, 25, 16, 1000),
            (true, false, 33, 40, 513),
            (true, false, 7, 8, 256),
        ] {
            assert!(suits(ta, tb, m, n, k, 1.0, 0.0), "{ta} {tb} {m} {n} {k}");
            let (a, b) = (fill(m * k, 1), fill(k * n, 2));
            let want = naive(ta, tb, m, n, k, &a, &b);
            for beta in [0.0, 1.0] {
                let start = fill(m * n, 3);
                let mut c = start.clone();
                gemm(ta, tb, m, n, k, &a, &b, beta, &mut c);
                for (i, (got, w)) in c.iter().zip(&want).enumerate() {
                    let w = w + beta * start[i];
                    assert!(
                        (got - w).abs() <= 1e-3 * (1.0 + w.abs()),
                        "{ta} {tb} {m}x{n}x{k} beta {beta} at {i}: {got} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn wide_or_square_products_and_other_scalings_stay_with_blas() {
        assert!(!suits(false, false, 512, 512, 512, 1.0, 0.0));
        assert!(!suits(false, false, 1000, 10, 400, 1.0, 0.0));
        assert!(!suits(false, false, 1000, 32, 400, 2.0, 0.0));
        assert!(!suits(false, false, 1000, 32, 400, 1.0, 0.5));
        assert!(!suits(true, true, 1000, 32, 400, 1.0, 0.0));
        assert!(!suits(true, false, 1568, 128, 64, 1.0, 0.0));
    }
}

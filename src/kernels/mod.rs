//! Dense kernels: BLAS through `cblas` on OpenBLAS (Debian's system library), and the
//! element-wise layers of an MLP in plain Rust loops the compiler vectorises.
//!
//! Matrices are row-major `f32` slices with explicit shapes; every BLAS call checks the
//! slice lengths against the shapes first, so a wrong shape is an error, never an
//! out-of-bounds read inside OpenBLAS.

use cblas::{Layout, Transpose};

// Link OpenBLAS (the `system` feature finds Debian's libopenblas).
extern crate openblas_src;

pub mod conv;
pub mod thin;

/// Errors from kernel calls with inconsistent shapes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("{kernel}: {what} has {len} elements, shape needs {need}")]
    Shape {
        kernel: &'static str,
        what: &'static str,
        len: usize,
        need: usize,
    },
    #[error("{kernel}: dimension {dim} does not fit a 32-bit BLAS integer")]
    TooLarge { kernel: &'static str, dim: usize },
    #[error("{0}")]
    Layer(String),
}

pub(crate) fn need(
    kernel: &'static str,
    what: &'static str,
    len: usize,
    need: usize,
) -> Result<(), KernelError> {
    if len < need {
        Err(KernelError::Shape {
            kernel,
            what,
            len,
            need,
        })
    } else {
        Ok(())
    }
}

fn int(kernel: &'static str, dim: usize) -> Result<i32, KernelError> {
    i32::try_from(dim).map_err(|_| KernelError::TooLarge { kernel, dim })
}

unsafe extern "C" {
    fn openblas_set_num_threads(n: std::os::raw::c_int);
    fn openblas_get_num_threads() -> std::os::raw::c_int;
}

/// The OpenBLAS kernel family (`OPENBLAS_CORETYPE`) for this CPU's instruction set.
///
/// OpenBLAS picks its kernels by CPU model when it loads; on virtual machines that report a
/// generic model ("Intel Xeon Processor"), Debian's OpenBLAS 0.3.21 falls back to
/// `Prescott`, an SSE3 kernel, several times slower than the AVX-512 one on the same CPU
/// (`benches/results/2026-11-22.md` has the sgemm rates). Choosing by instruction set avoids the
/// fallback.
pub fn openblas_coretype() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
            return Some("SkylakeX");
        }
        if has!("avx2") && has!("fma") {
            return Some("Haswell");
        }
    }
    None
}

/// Sets the number of OpenBLAS threads of this process (`openblas_set_num_threads`).
pub fn set_blas_threads(n: usize) {
    // SAFETY: a plain setter of OpenBLAS's global thread count.
    unsafe { openblas_set_num_threads(n.max(1) as std::os::raw::c_int) }
}

/// The number of OpenBLAS threads (`openblas_get_num_threads`).
pub fn blas_threads() -> usize {
    // SAFETY: a plain getter.
    unsafe { openblas_get_num_threads() as usize }
}

/// `C = alpha * op(A) * op(B) + beta * C` (`cblas_sgemm`), where `op(A)` is `m x k` and
/// `op(B)` is `k x n`; `A` is stored `m x k` (or `k x m` if `ta`), `B` `k x n` (or `n x k`).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) -> Result<(), KernelError> {
    need("gemm", "A", a.len(), m * k)?;
    need("gemm", "B", b.len(), k * n)?;
    need("gemm", "C", c.len(), m * n)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if thin::suits(ta, tb, m, n, k, alpha, beta) {
        thin::gemm(ta, tb, m, n, k, a, b, beta, c);
        return Ok(());
    }
    let (lda, ldb) = (if ta { m } else { k }, if tb { k } else { n });
    let t = |x: bool| {
        if x {
            Transpose::Ordinary
        } else {
            Transpose::None
        }
    };
    let (mi, ni, ki) = (int("gemm", m)?, int("gemm", n)?, int("gemm", k)?);
    let (lda, ldb, ldc) = (int("gemm", lda.max(1))?, int("gemm", ldb.max(1))?, ni);
    // SAFETY: the slice lengths were checked against the shapes and leading dimensions.
    unsafe {
        cblas::sgemm(
            Layout::RowMajor,
            t(ta),
            t(tb),
            mi,
            ni,
            ki,
            alpha,
            a,
            lda,
            b,
            ldb,
            beta,
            c,
            ldc,
        )
    };
    Ok(())
}

/// `y = alpha * op(A) * x + beta * y` (`cblas_sgemv`), `A` stored `m x n`.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    ta: bool,
    m: usize,
    n: usize,
    alpha: f32,
    a: &[f32],
    x: &[f32],
    beta: f32,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let (xl, yl) = if ta { (m, n) } else { (n, m) };
    need("gemv", "A", a.len(), m * n)?;
    need("gemv", "x", x.len(), xl)?;
    need("gemv", "y", y.len(), yl)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let t = if ta {
        Transpose::Ordinary
    } else {
        Transpose::None
    };
    let (mi, ni) = (int("gemv", m)?, int("gemv", n)?);
    // SAFETY: lengths checked above.
    unsafe { cblas::sgemv(Layout::RowMajor, t, mi, ni, alpha, a, ni, x, 1, beta, y, 1) };
    Ok(())
}

/// `y += alpha * x` (`cblas_saxpy`).
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    need("axpy", "y", y.len(), x.len())?;
    let n = int("axpy", x.len())?;
    // SAFETY: both slices hold at least n elements.
    unsafe { cblas::saxpy(n, alpha, x, 1, y, 1) };
    Ok(())
}

/// `x *= alpha` (`cblas_sscal`).
pub fn scal(alpha: f32, x: &mut [f32]) -> Result<(), KernelError> {
    let n = int("scal", x.len())?;
    // SAFETY: x holds n elements.
    unsafe { cblas::sscal(n, alpha, x, 1) };
    Ok(())
}

/// `x . y` (`cblas_sdot`).
pub fn dot(x: &[f32], y: &[f32]) -> Result<f32, KernelError> {
    need("dot", "y", y.len(), x.len())?;
    let n = int("dot", x.len())?;
    // SAFETY: both slices hold at least n elements.
    Ok(unsafe { cblas::sdot(n, x, 1, y, 1) })
}

/// Sets every row of `x` to `bias`: the start of `x = bias + A B` by [`gemm`] with
/// `beta = 1`, which adds the product in the same pass that would otherwise clear `x`.
pub fn broadcast_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        row.copy_from_slice(bias);
    }
}

/// Writes `x` (`rows x cols`, row-major) transposed into `t` (`cols x rows`).
pub fn transpose_into(x: &[f32], rows: usize, cols: usize, t: &mut [f32]) {
    for (r, row) in x.chunks_exact(cols.max(1)).take(rows).enumerate() {
        for (c, v) in row.iter().enumerate() {
            t[c * rows + r] = *v;
        }
    }
}

/// Sums the rows of `g` (`rows x cols`) into `out` (length `cols`): the bias gradient.
pub fn sum_rows(g: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for row in g.chunks_exact(out.len()) {
        out.iter_mut().zip(row).for_each(|(o, v)| *o += v);
    }
}

/// `out = max(x, 0)`, element-wise (`out` as long as `x`; NaN gives 0).
pub fn relu_into(x: &[f32], out: &mut [f32]) {
    out.iter_mut().zip(x).for_each(|(o, v)| *o = v.max(0.0));
}

/// ReLU's backward: `dx = dy` where the forward output was positive, +0.0 elsewhere.
///
/// `dy`'s bits through a mask (all ones where the output is positive, else zero) over
/// slices of one length, which the compiler makes vector compares and bitwise ands; the
/// branch it replaces stayed scalar and mispredicted on a sign that is a coin toss (ReLU's
/// backward was 7-8% of a CNN step).
pub fn relu_backward_into(out: &[f32], dy: &[f32], dx: &mut [f32]) {
    let n = dx.len();
    let (out, dy) = (&out[..n], &dy[..n]);
    for ((d, &g), &o) in dx.iter_mut().zip(dy).zip(out) {
        let keep = u32::from(o > 0.0).wrapping_neg();
        *d = f32::from_bits(g.to_bits() & keep);
    }
}

/// Softmax cross-entropy over `logits` (`rows x classes`) with integer labels: returns the
/// mean loss and writes the gradient of the mean loss w.r.t. the logits into `grad`.
pub fn softmax_cross_entropy(
    logits: &[f32],
    labels: &[u8],
    classes: usize,
    grad: &mut [f32],
) -> f32 {
    let rows = labels.len();
    let mut loss = 0.0f64;
    for (r, (row, g)) in logits
        .chunks_exact(classes)
        .zip(grad.chunks_exact_mut(classes))
        .enumerate()
    {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (gi, v) in g.iter_mut().zip(row) {
            *gi = (v - max).exp();
            sum += *gi;
        }
        let label = labels[r] as usize;
        loss += f64::from(sum.ln() - (row[label] - max));
        let scale = 1.0 / (sum * rows as f32);
        g.iter_mut().for_each(|gi| *gi *= scale);
        g[label] -= 1.0 / rows as f32;
    }
    (loss / rows.max(1) as f64) as f32
}

/// Mean squared error of `outputs` against `targets` (both `rows x width`, flat): returns
/// the mean over rows of each row's mean squared difference, and writes its gradient
/// w.r.t. the outputs into `grad`.
pub fn mean_squared_error(outputs: &[f32], targets: &[f32], width: usize, grad: &mut [f32]) -> f32 {
    let n = (outputs.len() / width.max(1)).max(1) as f32;
    let per = 2.0 / (n * width.max(1) as f32);
    let mut loss = 0.0f64;
    for ((g, o), t) in grad.iter_mut().zip(outputs).zip(targets) {
        let d = o - t;
        loss += f64::from(d * d);
        *g = per * d;
    }
    (loss / f64::from(n) / width.max(1) as f64) as f32
}

/// Index of the largest value of each row.
pub fn argmax_rows(x: &[f32], cols: usize) -> Vec<usize> {
    x.chunks_exact(cols)
        .map(|row| {
            row.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (i, v)| {
                    if *v > best.1 {
                        (i, *v)
                    } else {
                        best
                    }
                })
                .0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relu_keeps_positives_and_zeroes_the_rest_at_every_lane() {
        // 37 values: whole vectors and a tail; the specials in the middle.
        let mut x: Vec<f32> = (0..37).map(|i| i as f32 - 18.5).collect();
        x[10..16].copy_from_slice(&[
            f32::NAN,
            f32::NEG_INFINITY,
            f32::INFINITY,
            -0.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
        ]);
        let mut out = vec![7.0; x.len()];
        relu_into(&x, &mut out);
        for (v, o) in x.iter().zip(&out) {
            let want = if *v > 0.0 { *v } else { 0.0 };
            assert_eq!(o.to_bits(), want.to_bits(), "relu({v}) = {o}");
        }
        // The backward passes dy's bits where the output was positive, else +0.0, whatever
        // dy holds there.
        let dy: Vec<f32> = (0..37)
            .map(|i| match i % 4 {
                0 => f32::NAN,
                1 => -1.5 * i as f32,
                2 => f32::INFINITY,
                _ => -0.0,
            })
            .collect();
        let mut dx = vec![7.0; dy.len()];
        relu_backward_into(&out, &dy, &mut dx);
        for ((o, g), d) in out.iter().zip(&dy).zip(&dx) {
            let want = if *o > 0.0 { *g } else { 0.0 };
            assert_eq!(d.to_bits(), want.to_bits(), "out {o}, dy {g}: dx {d}");
        }
    }

    fn naive(ta: bool, tb: bool, m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
        let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] };
        let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] };
        (0..m * n)
            .map(|ij| (0..k).map(|p| at(ij / n, p) * bt(p, ij % n)).sum())
            .collect()
    }

    fn fill(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }

    #[test]
    fn gemm_matches_naive_loops_on_odd_shapes() {
        for (m, n, k) in [(1, 1, 1), (3, 5, 7), (17, 1, 9), (13, 11, 1), (33, 65, 31)] {
            for ta in [false, true] {
                for tb in [false, true] {
                    let (a, b) = (fill(m * k, 1), fill(k * n, 2));
                    let mut c = fill(m * n, 3);
                    let c0 = c.clone();
                    gemm(ta, tb, m, n, k, 2.0, &a, &b, 0.5, &mut c).unwrap();
                    let want = naive(ta, tb, m, n, k, &a, &b);
                    for i in 0..m * n {
                        let w = 2.0 * want[i] + 0.5 * c0[i];
                        assert!(
                            (c[i] - w).abs() < 1e-4 * (1.0 + w.abs()),
                            "{m}x{n}x{k} {ta} {tb} at {i}"
                        );
                    }
                }
            }
        }
        let mut c = vec![0.0; 4];
        assert!(matches!(
            gemm(false, false, 2, 2, 2, 1.0, &[1.0; 3], &[1.0; 4], 0.0, &mut c),
            Err(KernelError::Shape { .. })
        ));
    }

    #[test]
    fn blas1_and_gemv() {
        let (x, mut y) = (vec![1.0, 2.0, 3.0], vec![1.0, 1.0, 1.0]);
        axpy(2.0, &x, &mut y).unwrap();
        assert_eq!(y, [3.0, 5.0, 7.0]);
        scal(0.5, &mut y).unwrap();
        assert_eq!(y, [1.5, 2.5, 3.5]);
        assert_eq!(dot(&x, &y).unwrap(), 1.5 + 5.0 + 10.5);
        let a = fill(15, 4); // 3 x 5
        let v = fill(5, 5);
        let mut out = vec![0.0; 3];
        gemv(false, 3, 5, 1.0, &a, &v, 0.0, &mut out).unwrap();
        let want = naive(false, false, 3, 1, 5, &a, &v);
        out.iter()
            .zip(&want)
            .for_each(|(o, w)| assert!((o - w).abs() < 1e-5));
        let v3 = fill(3, 6);
        let mut out5 = vec![0.0; 5];
        gemv(true, 3, 5, 1.0, &a, &v3, 0.0, &mut out5).unwrap();
        let want = naive(true, false, 5, 1, 3, &a, &v3);
        out5.iter()
            .zip(&want)
            .for_each(|(o, w)| assert!((o - w).abs() < 1e-5));
    }

    #[test]
    fn softmax_cross_entropy_and_its_gradient() {
        let logits = vec![1.0, 2.0, 3.0, 0.5, 0.5, 0.5];
        let mut g = vec![0.0; 6];
        let loss = softmax_cross_entropy(&logits, &[2, 0], 3, &mut g);
        let p: Vec<f32> = [1.0f32, 2.0, 3.0]
            .iter()
            .map(|x| x.exp() / (1f32.exp() + 2f32.exp() + 3f32.exp()))
            .collect();
        let want = (-(p[2].ln()) + 3f32.ln()) / 2.0;
        assert!((loss - want).abs() < 1e-6);
        assert!((g[2] - (p[2] - 1.0) / 2.0).abs() < 1e-6);
        assert!((g[3] - (1.0 / 3.0 - 1.0) / 2.0).abs() < 1e-6);
        // Rows of the gradient sum to zero.
        assert!(g[..3].iter().sum::<f32>().abs() < 1e-6);
        assert_eq!(argmax_rows(&logits, 3), [2, 0]);
    }
}

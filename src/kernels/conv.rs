//! Convolution and pooling kernels on channels-last (NHWC) images.
//!
//! A 2-D convolution is one matrix product: [`im2col`] lays each output pixel's receptive
//! field out as a row (`kh * kw * c` values, in the filter's own `[KH, KW, C, OC]` order,
//! TensorFlow's layout), so for a batch of `n` images the output is the `(n * oh * ow) x k`
//! column matrix times the `k x oc` filter: one sgemm, and the result is already NHWC.
//! The backward pass is two more products (filter gradient `cols^T dY`, column gradient
//! `dY W^T`) and [`col2im_add`], which scatters the column gradient back onto the image.

use super::KernelError;

/// The shapes of one convolution (or pooling window): input `h x w x c`, window `kh x kw`,
/// `stride`, zero `pad` on every side, and the output `oh x ow` they give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window2d {
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: usize,
    pub pad: usize,
    pub oh: usize,
    pub ow: usize,
}

impl Window2d {
    /// The geometry, or an error when the window does not fit the padded input.
    pub fn new(
        [h, w, c]: [usize; 3],
        [kh, kw]: [usize; 2],
        stride: usize,
        pad: usize,
    ) -> Result<Window2d, KernelError> {
        let bad = |what: &'static str, len: usize, need: usize| KernelError::Shape {
            kernel: "conv2d",
            what,
            len,
            need,
        };
        if stride == 0 {
            return Err(bad("stride", 0, 1));
        }
        if kh == 0 || kw == 0 {
            return Err(bad("window", 0, 1));
        }
        if h + 2 * pad < kh {
            return Err(bad("padded input height", h + 2 * pad, kh));
        }
        if w + 2 * pad < kw {
            return Err(bad("padded input width", w + 2 * pad, kw));
        }
        Ok(Window2d {
            h,
            w,
            c,
            kh,
            kw,
            stride,
            pad,
            oh: (h + 2 * pad - kh) / stride + 1,
            ow: (w + 2 * pad - kw) / stride + 1,
        })
    }

    /// Values in one receptive field: `kh * kw * c`.
    pub fn k(&self) -> usize {
        self.kh * self.kw * self.c
    }

    /// Values in one input image.
    pub fn input_len(&self) -> usize {
        self.h * self.w * self.c
    }

    /// Output pixels of one image.
    pub fn pixels(&self) -> usize {
        self.oh * self.ow
    }

    /// The input row and column under output pixel `(oy, ox)`, window offset `(dy, dx)`,
    /// or `None` in the zero padding.
    #[inline]
    fn source(&self, oy: usize, ox: usize, dy: usize, dx: usize) -> Option<(usize, usize)> {
        let iy = (oy * self.stride + dy).checked_sub(self.pad)?;
        let ix = (ox * self.stride + dx).checked_sub(self.pad)?;
        (iy < self.h && ix < self.w).then_some((iy, ix))
    }
}

/// Visits the column matrix of `n` images in order, one window row at a time, in runs:
/// `f(at, from, len)` says that the `len` values at offset `at` of the column matrix are
/// the `len` consecutive input values at offset `from`, or zero padding (`from` is
/// `None`). A window row's taps read consecutive input pixels whatever the stride, so a
/// row is at most three runs (left padding, the image, right padding). The one loop both
/// [`im2col`] and its adjoint [`col2im_add`] run.
#[inline]
fn for_each_run(g: &Window2d, n: usize, mut f: impl FnMut(usize, Option<usize>, usize)) {
    let (c, row) = (g.c, g.kw * g.c);
    let mut at = 0;
    for b in 0..n {
        let base = b * g.input_len();
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                // Window columns `lo..hi` fall on the image; padded column `x0 + dx` is
                // input column `x0 + dx - pad`.
                let x0 = ox * g.stride;
                let lo = g.pad.saturating_sub(x0).min(g.kw);
                let hi = (g.w + g.pad).saturating_sub(x0).clamp(lo, g.kw);
                for dy in 0..g.kh {
                    let iy = (oy * g.stride + dy)
                        .checked_sub(g.pad)
                        .filter(|iy| *iy < g.h);
                    match iy {
                        Some(iy) if hi > lo => {
                            if lo > 0 {
                                f(at, None, lo * c);
                            }
                            let from = base + (iy * g.w + x0 + lo - g.pad) * c;
                            f(at + lo * c, Some(from), (hi - lo) * c);
                            if hi < g.kw {
                                f(at + hi * c, None, (g.kw - hi) * c);
                            }
                        }
                        _ => f(at, None, row),
                    }
                    at += row;
                }
            }
        }
    }
}

/// Lays out the receptive fields of `n` images `x` (`n x h x w x c`) as rows of `cols`
/// (`n * oh * ow` rows of `k` values; padding reads as zero).
pub fn im2col(g: &Window2d, x: &[f32], n: usize, cols: &mut [f32]) -> Result<(), KernelError> {
    super::need("im2col", "input", x.len(), n * g.input_len())?;
    super::need("im2col", "columns", cols.len(), n * g.pixels() * g.k())?;
    for_each_run(g, n, |at, from, len| {
        let dst = &mut cols[at..at + len];
        match from {
            Some(i) => dst.copy_from_slice(&x[i..i + len]),
            None => dst.fill(0.0),
        }
    });
    Ok(())
}

/// The adjoint of [`im2col`]: adds each row of `cols` back onto the pixels it was read
/// from, into `dx` (`n x h x w x c`, not cleared here).
pub fn col2im_add(g: &Window2d, cols: &[f32], n: usize, dx: &mut [f32]) -> Result<(), KernelError> {
    super::need("col2im", "columns", cols.len(), n * g.pixels() * g.k())?;
    super::need("col2im", "input gradient", dx.len(), n * g.input_len())?;
    for_each_run(g, n, |at, from, len| {
        if let Some(i) = from {
            dx[i..i + len]
                .iter_mut()
                .zip(&cols[at..at + len])
                .for_each(|(d, s)| *d += s);
        }
    });
    Ok(())
}

/// Max pooling of `n` images (`g.kh x g.kw` windows, `g.stride`, no padding): writes
/// `out` (`n x oh x ow x c`) and, per output value, the index into `x` it came from.
pub fn max_pool(
    g: &Window2d,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    argmax: &mut [u32],
) -> Result<(), KernelError> {
    let len = n * g.pixels() * g.c;
    super::need("max_pool", "input", x.len(), n * g.input_len())?;
    super::need("max_pool", "output", out.len(), len)?;
    super::need("max_pool", "argmax", argmax.len(), len)?;
    if x.len() > u32::MAX as usize {
        return Err(KernelError::TooLarge {
            kernel: "max_pool",
            dim: x.len(),
        });
    }
    let c = g.c;
    let mut o = 0;
    for b in 0..n {
        let base = b * g.input_len();
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                for ch in 0..c {
                    let (mut best, mut at) = (f32::NEG_INFINITY, usize::MAX);
                    for dy in 0..g.kh {
                        for dx in 0..g.kw {
                            if let Some((iy, ix)) = g.source(oy, ox, dy, dx) {
                                let i = base + (iy * g.w + ix) * c + ch;
                                // `>` keeps the first maximum; NaN never wins but is kept
                                // if the whole window is NaN (at stays the first index).
                                if x[i] > best || at == usize::MAX {
                                    best = x[i];
                                    at = i;
                                }
                            }
                        }
                    }
                    out[o] = best;
                    argmax[o] = at as u32;
                    o += 1;
                }
            }
        }
    }
    Ok(())
}

/// Max pooling's backward: each output gradient goes to the input value that won.
pub fn max_pool_backward(argmax: &[u32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
    super::need(
        "max_pool_backward",
        "output gradient",
        dy.len(),
        argmax.len(),
    )?;
    dx.fill(0.0);
    for (a, g) in argmax.iter().zip(dy) {
        let i = *a as usize;
        super::need("max_pool_backward", "input gradient", dx.len(), i + 1)?;
        dx[i] += g;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::gemm;

    fn data(n: usize, salt: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7 + salt * 13) % 17) as f32 - 8.0) / 5.0)
            .collect()
    }

    /// A convolution by its definition: four nested loops per output value.
    fn naive_conv(g: &Window2d, x: &[f32], n: usize, wts: &[f32], oc: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; n * g.pixels() * oc];
        for b in 0..n {
            for oy in 0..g.oh {
                for ox in 0..g.ow {
                    for o in 0..oc {
                        let mut s = 0.0f64;
                        for dy in 0..g.kh {
                            for dx in 0..g.kw {
                                let iy = (oy * g.stride + dy) as isize - g.pad as isize;
                                let ix = (ox * g.stride + dx) as isize - g.pad as isize;
                                if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                    continue;
                                }
                                for ch in 0..g.c {
                                    let xv =
                                        x[((b * g.h + iy as usize) * g.w + ix as usize) * g.c + ch];
                                    let wv = wts[((dy * g.kw + dx) * g.c + ch) * oc + o];
                                    s += f64::from(xv) * f64::from(wv);
                                }
                            }
                        }
                        out[((b * g.oh + oy) * g.ow + ox) * oc + o] = s as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn im2col_and_sgemm_equal_the_naive_convolution_on_odd_shapes() {
        // (h, w, c, kh, kw, stride, pad, oc, n): odd sizes, strides that skip, padding
        // wider than needed, wider than the window (windows all padding), a window as
        // large as the padded input.
        for (h, w, c, kh, kw, s, p, oc, n) in [
            (5, 7, 3, 3, 3, 1, 1, 4, 2),
            (2, 3, 2, 2, 2, 1, 3, 2, 2),
            (5, 4, 1, 3, 2, 3, 4, 3, 1),
            (9, 6, 2, 5, 3, 2, 2, 3, 3),
            (4, 4, 1, 2, 2, 2, 0, 5, 1),
            (7, 5, 5, 3, 1, 3, 0, 2, 2),
            (3, 3, 2, 5, 5, 1, 1, 3, 1),
        ] {
            let g = Window2d::new([h, w, c], [kh, kw], s, p).unwrap();
            let x = data(n * g.input_len(), 1);
            let wts = data(g.k() * oc, 2);
            // Reused buffers hold stale values: im2col must write every one.
            let mut cols = vec![f32::NAN; n * g.pixels() * g.k()];
            im2col(&g, &x, n, &mut cols).unwrap();
            let mut out = vec![0.0; n * g.pixels() * oc];
            gemm(
                false,
                false,
                n * g.pixels(),
                oc,
                g.k(),
                1.0,
                &cols,
                &wts,
                0.0,
                &mut out,
            )
            .unwrap();
            let want = naive_conv(&g, &x, n, &wts, oc);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "{g:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn col2im_is_the_adjoint_of_im2col() {
        // <im2col(x), y> == <x, col2im(y)> for any x, y: the backward pass is exact.
        for g in [
            Window2d::new([6, 5, 3], [3, 2], 2, 1).unwrap(),
            Window2d::new([3, 2, 2], [2, 3], 1, 3).unwrap(),
        ] {
            let n = 2;
            let x = data(n * g.input_len(), 3);
            let y = data(n * g.pixels() * g.k(), 4);
            let mut cols = vec![0.0; y.len()];
            im2col(&g, &x, n, &mut cols).unwrap();
            let mut back = vec![0.0; x.len()];
            col2im_add(&g, &y, n, &mut back).unwrap();
            let lhs: f64 = cols.iter().zip(&y).map(|(a, b)| f64::from(a * b)).sum();
            let rhs: f64 = x.iter().zip(&back).map(|(a, b)| f64::from(a * b)).sum();
            assert!((lhs - rhs).abs() < 1e-3, "{g:?}: {lhs} vs {rhs}");
        }
    }

    #[test]
    fn max_pool_takes_each_windows_maximum_and_routes_its_gradient() {
        let g = Window2d::new([5, 4, 2], [2, 2], 2, 0).unwrap();
        assert_eq!((g.oh, g.ow), (2, 2));
        let x = data(g.input_len(), 5);
        let mut out = vec![0.0; g.pixels() * 2];
        let mut arg = vec![0u32; out.len()];
        max_pool(&g, &x, 1, &mut out, &mut arg).unwrap();
        for oy in 0..2 {
            for ox in 0..2 {
                for ch in 0..2 {
                    let mut m = f32::NEG_INFINITY;
                    for dy in 0..2 {
                        for dx in 0..2 {
                            m = m.max(x[((oy * 2 + dy) * 4 + ox * 2 + dx) * 2 + ch]);
                        }
                    }
                    let o = (oy * 2 + ox) * 2 + ch;
                    assert_eq!(out[o], m);
                    assert_eq!(x[arg[o] as usize], m);
                }
            }
        }
        let dy: Vec<f32> = (0..out.len()).map(|i| i as f32 + 1.0).collect();
        let mut dx = vec![9.0; x.len()];
        max_pool_backward(&arg, &dy, &mut dx).unwrap();
        assert_eq!(dx.iter().sum::<f32>(), dy.iter().sum::<f32>());
        assert_eq!(dx.iter().filter(|v| **v != 0.0).count(), dy.len());
    }

    #[test]
    fn a_window_larger_than_the_padded_input_is_an_error() {
        let e = Window2d::new([3, 3, 1], [5, 5], 1, 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "conv2d: padded input height has 3 elements, shape needs 5"
        );
        assert!(Window2d::new([3, 3, 1], [2, 2], 0, 0).is_err());
    }
}

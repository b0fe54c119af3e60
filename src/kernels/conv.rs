//! Convolution and pooling kernels on channels-last (NHWC) images.
//!
//! A 2-D convolution is one matrix product: [`im2col`] lays each output pixel's receptive
//! field out as a row (`kh * kw * c` values, in the filter's own `[KH, KW, C, OC]` order,
//! TensorFlow's layout), so for a batch of `n` images the output is the `(n * oh * ow) x k`
//! column matrix times the `k x oc` filter: one sgemm, and the result is already NHWC.
//! The backward pass is two more products (filter gradient `cols^T dY`, column gradient
//! `dY W^T`) and [`col2im_add`], which scatters the column gradient back onto the image.

use std::ops::Range;

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

impl Window2d {
    /// Height and width of the input with its zero padding.
    pub fn padded(&self) -> (usize, usize) {
        (self.h + 2 * self.pad, self.w + 2 * self.pad)
    }

    /// Values in one padded input image.
    pub fn padded_len(&self) -> usize {
        let (hp, wp) = self.padded();
        hp * wp * self.c
    }
}

/// Visits rows `rows` of the column matrix (row `r` is output pixel `r % pixels` of image
/// `r / pixels`), one window row at a time: `f(at, from)` says that the `kw * c` values at
/// offset `at` (from the first visited row) are the `kw * c` consecutive values of the
/// padded input (see [`pad_into`]) at offset `from`. With the padding laid out, every
/// window row is one run, whatever the stride. The one loop both [`im2col_rows`] and its
/// adjoint [`col2im_add_rows`] run.
#[inline]
fn for_each_run(g: &Window2d, rows: Range<usize>, mut f: impl FnMut(usize, usize)) {
    let (hp, wp) = g.padded();
    let (c, run) = (g.c, g.kw * g.c);
    let pixels = g.pixels().max(1);
    let (mut b, p) = (rows.start / pixels, rows.start % pixels);
    let (mut oy, mut ox) = (p / g.ow.max(1), p % g.ow.max(1));
    let mut at = 0;
    for _ in rows {
        let first = ((b * hp + oy * g.stride) * wp + ox * g.stride) * c;
        for dy in 0..g.kh {
            f(at, first + dy * wp * c);
            at += run;
        }
        ox += 1;
        if ox == g.ow {
            (ox, oy) = (0, oy + 1);
            if oy == g.oh {
                (oy, b) = (0, b + 1);
            }
        }
    }
}

/// The images rows `rows` of the column matrix read from: all of them up to the last.
fn images_under(g: &Window2d, rows: &Range<usize>) -> usize {
    rows.end.div_ceil(g.pixels().max(1))
}

/// Copies `n` images `x` into `xp` (`n x (h + 2 pad) x (w + 2 pad) x c`) inside a zero
/// border: the input [`im2col_rows`] reads.
pub fn pad_into(g: &Window2d, x: &[f32], n: usize, xp: &mut [f32]) -> Result<(), KernelError> {
    super::need("pad", "input", x.len(), n * g.input_len())?;
    super::need("pad", "padded input", xp.len(), n * g.padded_len())?;
    let (_, wp) = g.padded();
    let (row, prow) = (g.w * g.c, wp * g.c);
    for (img, pimg) in x
        .chunks_exact(g.input_len().max(1))
        .zip(xp.chunks_exact_mut(g.padded_len().max(1)))
        .take(n)
    {
        let (top, rest) = pimg.split_at_mut(g.pad * prow);
        top.fill(0.0);
        for (src, dst) in img
            .chunks_exact(row.max(1))
            .zip(rest.chunks_exact_mut(prow))
        {
            let (left, rest) = dst.split_at_mut(g.pad * g.c);
            left.fill(0.0);
            let (mid, right) = rest.split_at_mut(row);
            mid.copy_from_slice(src);
            right.fill(0.0);
        }
        rest[g.h * prow..].fill(0.0);
    }
    Ok(())
}

/// Adds the inside of the padded gradient `xp` (the shape [`pad_into`] writes) onto `dx`
/// (`n x h x w x c`): the adjoint of [`pad_into`].
pub fn unpad_add(g: &Window2d, xp: &[f32], n: usize, dx: &mut [f32]) -> Result<(), KernelError> {
    super::need("unpad", "padded gradient", xp.len(), n * g.padded_len())?;
    super::need("unpad", "input gradient", dx.len(), n * g.input_len())?;
    let (_, wp) = g.padded();
    let (row, prow) = (g.w * g.c, wp * g.c);
    for (img, pimg) in dx
        .chunks_exact_mut(g.input_len().max(1))
        .zip(xp.chunks_exact(g.padded_len().max(1)))
        .take(n)
    {
        let inside = pimg[g.pad * prow..].chunks_exact(prow);
        for (dst, src) in img.chunks_exact_mut(row.max(1)).zip(inside) {
            let src = &src[g.pad * g.c..g.pad * g.c + row];
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        }
    }
    Ok(())
}

/// Lays out the receptive fields of `n` images `x` (`n x h x w x c`) as rows of `cols`
/// (`n * oh * ow` rows of `k` values; padding reads as zero).
pub fn im2col(g: &Window2d, x: &[f32], n: usize, cols: &mut [f32]) -> Result<(), KernelError> {
    let mut xp = vec![0.0; n * g.padded_len()];
    pad_into(g, x, n, &mut xp)?;
    im2col_rows(g, &xp, 0..n * g.pixels(), cols)
}

/// Rows `rows` of [`im2col`]'s column matrix into `cols` (`rows.len() * k` values), from
/// the padded images `xp` ([`pad_into`]): a block of the product at a time, so the
/// columns of a whole batch never exist at once.
pub fn im2col_rows(
    g: &Window2d,
    xp: &[f32],
    rows: Range<usize>,
    cols: &mut [f32],
) -> Result<(), KernelError> {
    super::need(
        "im2col",
        "padded input",
        xp.len(),
        images_under(g, &rows) * g.padded_len(),
    )?;
    super::need("im2col", "columns", cols.len(), rows.len() * g.k())?;
    let run = g.kw * g.c;
    for_each_run(g, rows, |at, from| {
        copy_run(&mut cols[at..at + run], &xp[from..from + run]);
    });
    Ok(())
}

/// `dst = src` for a window row (a few to a few hundred values): four at a time inline.
/// A plain loop would not do: the compiler turns it into a call to memcpy, which costs
/// more than such a copy (a first layer's rows are 5 values).
#[inline]
fn copy_run(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_loadu_ps, _mm_storeu_ps};
        let quads = dst.len() / 4;
        for q in 0..quads {
            // The compiler sees through the intrinsics too; an opaque offset keeps the
            // loop a loop.
            let at = std::hint::black_box(4 * q);
            // SAFETY: at + 3 < len for both slices (equal lengths, asserted); SSE is part
            // of x86-64's baseline.
            unsafe { _mm_storeu_ps(dst.as_mut_ptr().add(at), _mm_loadu_ps(src.as_ptr().add(at))) };
        }
        // At most three left: one by one (a loop here would become a memcpy call too).
        let (dst, src) = (&mut dst[4 * quads..], &src[4 * quads..]);
        if let (Some(d), Some(s)) = (dst.first_mut(), src.first()) {
            *d = *s;
        }
        if let (Some(d), Some(s)) = (dst.get_mut(1), src.get(1)) {
            *d = *s;
        }
        if let (Some(d), Some(s)) = (dst.get_mut(2), src.get(2)) {
            *d = *s;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// The adjoint of [`im2col`]: adds each row of `cols` back onto the pixels it was read
/// from, into `dx` (`n x h x w x c`, not cleared here).
pub fn col2im_add(g: &Window2d, cols: &[f32], n: usize, dx: &mut [f32]) -> Result<(), KernelError> {
    let mut xp = vec![0.0; n * g.padded_len()];
    col2im_add_rows(g, cols, 0..n * g.pixels(), &mut xp)?;
    unpad_add(g, &xp, n, dx)
}

/// The adjoint of [`im2col_rows`]: rows `rows` of the column gradient added onto the
/// padded gradient `xp` (then [`unpad_add`] onto the input's).
pub fn col2im_add_rows(
    g: &Window2d,
    cols: &[f32],
    rows: Range<usize>,
    xp: &mut [f32],
) -> Result<(), KernelError> {
    super::need("col2im", "columns", cols.len(), rows.len() * g.k())?;
    super::need(
        "col2im",
        "padded gradient",
        xp.len(),
        images_under(g, &rows) * g.padded_len(),
    )?;
    let run = g.kw * g.c;
    for_each_run(g, rows, |at, from| {
        xp[from..from + run]
            .iter_mut()
            .zip(&cols[at..at + run])
            .for_each(|(d, s)| *d += s);
    });
    Ok(())
}

/// Rows of the column matrix per block for a window of `k` values: a block of columns
/// (about 384 KiB) stays in the L2 cache while the products read it, and the sum of the
/// filter gradient over a block is long enough for [`super::thin`].
pub fn row_block(g: &Window2d) -> usize {
    (96 * 1024 / g.k().max(1)).clamp(256, 4096)
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
    let pixels = out
        .chunks_exact_mut(c.max(1))
        .zip(argmax.chunks_exact_mut(c.max(1)));
    let mut pixels = pixels.take(n * g.pixels());
    for b in 0..n {
        let base = b * g.input_len();
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let Some((best, at)) = pixels.next() else {
                    return Ok(());
                };
                let (best, at) = (&mut best[..c], &mut at[..c]);
                // Every channel at once: the window's first tap, then each later tap where
                // it is larger. `>` keeps the first maximum; NaN never wins, and a window
                // whose first tap is NaN keeps it (and its index).
                let mut first = true;
                for dy in 0..g.kh {
                    for dx in 0..g.kw {
                        let Some((iy, ix)) = g.source(oy, ox, dy, dx) else {
                            continue;
                        };
                        let i0 = base + (iy * g.w + ix) * c;
                        let (tap, i0) = (&x[i0..i0 + c], i0 as u32);
                        // Lane loops over equal lengths, selects written back whole: the
                        // compiler makes them vector compares and blends.
                        if first {
                            for ch in 0..c {
                                best[ch] = tap[ch];
                                at[ch] = i0 + ch as u32;
                            }
                            first = false;
                            continue;
                        }
                        for ch in 0..c {
                            let (v, b) = (tap[ch], best[ch]);
                            let wins = v > b;
                            let mask = 0u32.wrapping_sub(u32::from(wins));
                            best[ch] = if wins { v } else { b };
                            at[ch] = ((i0 + ch as u32) & mask) | (at[ch] & !mask);
                        }
                    }
                }
                if first {
                    // A window all in padding (pooling has none): no winner.
                    best.fill(f32::NEG_INFINITY);
                    at.fill(u32::MAX);
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

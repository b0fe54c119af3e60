//! Floats in memory aligned to cache lines: a table's rows of 16 values (64 bytes) each
//! take one line instead of straddling two, so a row read or updated is one miss, not two.

/// One cache line of floats.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

const PER_LINE: usize = 16;

/// A growable run of floats whose first starts a cache line.
#[derive(Debug, Clone, Default)]
pub(super) struct Lines {
    lines: Vec<Line>,
    len: usize,
}

impl Lines {
    /// Makes it `len` floats long, new ones `value`.
    pub(super) fn resize(&mut self, len: usize, value: f32) {
        let old = self.len;
        self.lines
            .resize(len.div_ceil(PER_LINE), Line([0.0; PER_LINE]));
        self.len = len;
        if len > old {
            self[old..].fill(value);
        }
    }
}

impl std::ops::Deref for Lines {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `Line` is `repr(C)` over `[f32; 16]` and 64 bytes long (its alignment),
        // so the lines are `16 x lines` contiguous, initialised floats, of which `len` are
        // used (`len <= 16 x lines`, kept by `resize`).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl std::ops::DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`; the borrow of `self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

/// Appends `row` to `out`: rows of the common widths (8, 16, 32, 64 values) copied by
/// code of their length, not a call to `memcpy` per row.
#[inline(always)]
pub(crate) fn append_row(out: &mut Vec<f32>, row: &[f32]) {
    #[inline(always)]
    fn fixed<const D: usize>(out: &mut Vec<f32>, row: &[f32]) {
        let row: &[f32; D] = row.try_into().expect("a row of D values");
        out.extend_from_slice(row);
    }
    match row.len() {
        8 => fixed::<8>(out, row),
        16 => fixed::<16>(out, row),
        32 => fixed::<32>(out, row),
        64 => fixed::<64>(out, row),
        _ => out.extend_from_slice(row),
    }
}

/// Copies `row` into `dst` (of its length), by code of its length for the common widths.
#[inline(always)]
pub(crate) fn copy_row(dst: &mut [f32], row: &[f32]) {
    #[inline(always)]
    fn fixed<const D: usize>(dst: &mut [f32], row: &[f32]) {
        let dst: &mut [f32; D] = dst.try_into().expect("a row of D values");
        let row: &[f32; D] = row.try_into().expect("a row of D values");
        *dst = *row;
    }
    match (row.len(), dst.len() == row.len()) {
        (8, true) => fixed::<8>(dst, row),
        (16, true) => fixed::<16>(dst, row),
        (32, true) => fixed::<32>(dst, row),
        (64, true) => fixed::<64>(dst, row),
        _ => dst.copy_from_slice(row),
    }
}

/// `w -= lr x (scale x g)`, element by element: plain SGD of one row, by code of its
/// length for the common widths.
#[inline(always)]
pub(super) fn sgd_row(w: &mut [f32], g: &[f32], lr: f32, scale: f32) {
    #[inline(always)]
    fn fixed<const D: usize>(w: &mut [f32], g: &[f32], lr: f32, scale: f32) {
        let w: &mut [f32; D] = w.try_into().expect("a row of D values");
        let g: &[f32; D] = g.try_into().expect("a gradient row of D values");
        // The row into a local and back whole: vector loads and stores, so that the misses
        // of many rows are in flight at once (element by element, the compiler kept it
        // scalar).
        let mut row = *w;
        row.iter_mut()
            .zip(g)
            .for_each(|(w, g)| *w -= lr * (scale * g));
        *w = row;
    }
    match w.len() {
        8 => fixed::<8>(w, g, lr, scale),
        16 => fixed::<16>(w, g, lr, scale),
        32 => fixed::<32>(w, g, lr, scale),
        64 => fixed::<64>(w, g, lr, scale),
        _ => w
            .iter_mut()
            .zip(g)
            .for_each(|(w, g)| *w -= lr * (scale * g)),
    }
}

/// Adagrad of one row: `g = scale x v`, `acc += g x g`, `w -= lr x g / sqrt(acc)`, element
/// by element; by code of its length, the row and its state loaded and stored whole, for
/// the common widths.
#[inline(always)]
pub(super) fn adagrad_row(w: &mut [f32], acc: &mut [f32], v: &[f32], lr: f32, scale: f32) {
    #[inline(always)]
    fn step(w: &mut f32, acc: &mut f32, v: f32, lr: f32, scale: f32) {
        let g = scale * v;
        *acc += g * g;
        *w -= lr * g / acc.sqrt();
    }
    #[inline(always)]
    fn fixed<const D: usize>(w: &mut [f32], acc: &mut [f32], v: &[f32], lr: f32, scale: f32) {
        let w: &mut [f32; D] = w.try_into().expect("a row of D values");
        let acc: &mut [f32; D] = acc.try_into().expect("a state of D values");
        let v: &[f32; D] = v.try_into().expect("a gradient row of D values");
        let (mut row, mut sum) = (*w, *acc);
        for i in 0..D {
            step(&mut row[i], &mut sum[i], v[i], lr, scale);
        }
        (*w, *acc) = (row, sum);
    }
    match (w.len(), acc.len() == w.len() && v.len() == w.len()) {
        (8, true) => fixed::<8>(w, acc, v, lr, scale),
        (16, true) => fixed::<16>(w, acc, v, lr, scale),
        (32, true) => fixed::<32>(w, acc, v, lr, scale),
        (64, true) => fixed::<64>(w, acc, v, lr, scale),
        _ => (w.iter_mut().zip(acc.iter_mut()).zip(v))
            .for_each(|((w, acc), v)| step(w, acc, *v, lr, scale)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_sixteen_start_lines_and_values_survive_growth() {
        let mut v = Lines::default();
        assert!(v.is_empty());
        for n in 1..100usize {
            v.resize(n * 16, n as f32);
            assert_eq!(v.len(), n * 16);
            assert_eq!(v.as_ptr() as usize % 64, 0);
            assert!((0..n).all(|r| v[r * 16..(r + 1) * 16].iter().all(|x| *x == (r + 1) as f32)));
        }
        v.resize(5, 0.0);
        assert_eq!(&v[..], &[1.0; 5]);
        v.resize(7, 2.0);
        assert_eq!(&v[5..], &[2.0, 2.0]);
    }

    #[test]
    fn rows_of_every_width_are_appended_and_updated_alike() {
        for d in [1, 8, 15, 16, 32, 33, 64] {
            let row: Vec<f32> = (0..d).map(|i| i as f32).collect();
            let mut out = vec![-1.0];
            append_row(&mut out, &row);
            assert_eq!(out[1..], row[..], "{d}");
            let mut copy = vec![-1.0; d];
            copy_row(&mut copy, &row);
            assert_eq!(copy, row, "{d}");
            let mut w = row.clone();
            sgd_row(&mut w, &row, 0.5, 2.0);
            assert!(w.iter().all(|x| *x == 0.0), "{d}: {w:?}");
            // Adagrad by the row and element by element: the same bits.
            let (mut w, mut acc) = (row.clone(), vec![0.1; d]);
            adagrad_row(&mut w, &mut acc, &row, 0.3, 0.5);
            for (i, v) in row.iter().enumerate() {
                let (g, a0) = (0.5 * v, 0.1f32);
                let a = a0 + g * g;
                assert_eq!(acc[i].to_bits(), a.to_bits(), "{d}");
                assert_eq!(w[i].to_bits(), (v - 0.3 * g / a.sqrt()).to_bits(), "{d}");
            }
        }
    }
}

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
fn the_direct_convolution_and_its_filter_gradient_equal_im2col_products_on_odd_shapes() {
    if !enabled() {
        return;
    }
    use crate::kernels::conv::{im2col, pad_into};
    // (h, w, c, kh, kw, stride, pad, filters, n): rows of 1 to 13 pixels (every tail
    // of the tiles), strides that skip, wide padding, one channel and many.
    for (h, w, c, kh, kw, s, p, oc, n) in [
        (7, 13, 3, 3, 3, 1, 1, 8, 2),
        (9, 9, 1, 5, 5, 2, 2, 16, 3),
        (4, 5, 16, 5, 5, 1, 2, 24, 2),
        (6, 1, 2, 1, 1, 1, 0, 8, 1),
        (3, 11, 4, 2, 3, 3, 3, 40, 2),
    ] {
        let g = Window2d::new([h, w, c], [kh, kw], s, p).unwrap();
        let x = fill(n * g.input_len(), 5);
        let wts = fill(g.k() * oc, 6);
        let rows = n * g.pixels();
        let mut cols = vec![0.0; rows * g.k()];
        im2col(&g, &x, n, &mut cols).unwrap();
        let want = naive(false, false, rows, oc, g.k(), &cols, &wts);
        let mut xp = vec![f32::NAN; n * g.padded_len()];
        pad_into(&g, &x, n, &mut xp).unwrap();
        let dy = fill(rows * oc, 8);
        let want_gw = naive(true, false, g.k(), oc, rows, &cols, &dy);
        for add in [false, true] {
            let start = fill(rows * oc, 7);
            let mut out = start.clone();
            conv_into(&g, n, &xp, &wts, oc, &mut out, add).unwrap();
            for (i, (got, w)) in out.iter().zip(&want).enumerate() {
                let w = w + if add { start[i] } else { 0.0 };
                assert!(
                    (got - w).abs() <= 1e-3 * (1.0 + w.abs()),
                    "{g:?} at {i}: {got} vs {w}"
                );
            }
            let start = fill(g.k() * oc, 9);
            let mut gw = start.clone();
            conv_filter_grad_into(&g, n, &xp, &dy, oc, &mut gw, add).unwrap();
            for (i, (got, w)) in gw.iter().zip(&want_gw).enumerate() {
                let w = w + if add { start[i] } else { 0.0 };
                assert!(
                    (got - w).abs() <= 1e-3 * (1.0 + w.abs()),
                    "{g:?} dW at {i}: {got} vs {w}"
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

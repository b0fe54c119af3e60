use super::*;

fn data(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 13 + salt * 7) % 29) as f32 - 14.0) / 9.0)
        .collect()
}

#[test]
fn a_convolution_in_blocks_equals_the_whole_product() {
    // 16 input channels and a 5x5 window: blocks of 256 rows, so 3 images of 10x10
    // are two blocks (256 and 44 rows); 16 and 24 filters take the thin products, 5
    // the BLAS ones.
    for filters in [16, 24, 5] {
        let conv = Conv2d {
            kh: 5,
            kw: 5,
            filters,
            stride: 1,
            pad: 2,
        };
        let (input, n) = ([10, 10, 16], 3);
        let g = conv.window(&input).unwrap();
        assert_eq!(conv::row_block(&g), 256);
        let (k, rows) = (g.k(), n * g.pixels());
        let (x, w, bias) = (
            data(n * g.input_len(), 1),
            data(k * filters, 2),
            data(filters, 3),
        );
        let dy = data(rows * filters, 4);
        // The unblocked reference in f64: the whole batch's columns.
        let mut cols = vec![0.0; rows * k];
        conv::im2col(&g, &x, n, &mut cols).unwrap();
        let dot = |a: &mut dyn Iterator<Item = (f32, f32)>| -> f64 {
            a.map(|(a, b)| f64::from(a) * f64::from(b)).sum()
        };
        let mut saved = Saved::Nothing;
        let mut out = Vec::new();
        conv.forward_into(&[&w, &bias], &input, &x, n, &mut out, &mut saved)
            .unwrap();
        for r in 0..rows {
            for o in 0..filters {
                let want = f64::from(bias[o])
                    + dot(&mut (0..k).map(|t| (cols[r * k + t], w[t * filters + o])));
                let got = f64::from(out[r * filters + o]);
                assert!((got - want).abs() < 1e-3, "y[{r}][{o}] {got} vs {want}");
            }
        }
        let (mut gw, mut gb) = (vec![f32::NAN; k * filters], vec![f32::NAN; filters]);
        let mut dx = vec![f32::NAN; 7];
        let back = Backward {
            x: &x,
            y: &out,
            saved: &mut saved,
            n,
            dy: &dy,
        };
        conv.backward_into(
            &[&w, &bias],
            &input,
            back,
            &mut [&mut gw, &mut gb],
            Some(&mut dx),
        )
        .unwrap();
        for t in 0..k {
            for o in 0..filters {
                let want = dot(&mut (0..rows).map(|r| (cols[r * k + t], dy[r * filters + o])));
                let got = f64::from(gw[t * filters + o]);
                assert!((got - want).abs() < 1e-2, "dW[{t}][{o}] {got} vs {want}");
            }
        }
        let mut dcols = vec![0.0; rows * k];
        for r in 0..rows {
            for t in 0..k {
                dcols[r * k + t] =
                    dot(&mut (0..filters).map(|o| (dy[r * filters + o], w[t * filters + o])))
                        as f32;
            }
        }
        let mut want_dx = vec![0.0; x.len()];
        conv::col2im_add(&g, &dcols, n, &mut want_dx).unwrap();
        assert_eq!(dx.len(), x.len());
        for (i, (a, b)) in dx.iter().zip(&want_dx).enumerate() {
            assert!((a - b).abs() < 1e-3, "dx[{i}] {a} vs {b}");
        }
        let want_b: Vec<f64> = (0..filters)
            .map(|o| (0..rows).map(|r| f64::from(dy[r * filters + o])).sum())
            .collect();
        for (a, b) in gb.iter().zip(&want_b) {
            assert!((f64::from(*a) - b).abs() < 1e-3);
        }
    }
}

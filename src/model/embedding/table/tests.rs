use super::*;

fn grad(ids: &[u64], dim: usize, v: f32) -> SparseGrad {
    SparseGrad {
        ids: ids.to_vec(),
        values: vec![v; ids.len() * dim],
    }
}

/// A table of 10^12 rows of which 3 are touched holds 3; a row's first values are the
/// same in every table of the same seed, whether pulled or pushed first.
#[test]
fn rows_exist_once_touched_and_start_the_same_everywhere() {
    let spec = TableSpec::new("big", 1_000_000_000_000, 4);
    assert_eq!(spec.dense_bytes(), 16_000_000_000_000);
    let mut a = Table::new(spec.clone(), 9, SparseOptimizer::Sgd { lr: 0.0 });
    let mut b = Table::new(spec.clone(), 9, SparseOptimizer::Sgd { lr: 0.0 });
    let mut out = Vec::new();
    a.pull_into(&[999_999_999_999, 3, 3], &mut out).unwrap();
    assert_eq!(a.len(), 2);
    b.apply(&grad(&[3], 4, 1.0), 1.0).unwrap();
    assert_eq!(a.row(3), b.row(3));
    assert_eq!(&out[4..8], &out[8..12]);
    assert_ne!(&out[0..4], &out[4..8]);
    assert!(out.iter().all(|v| v.abs() <= 0.05 && *v != 0.0));
    let other_seed = Table::new(spec.clone(), 10, SparseOptimizer::Sgd { lr: 0.0 });
    let mut c = other_seed;
    let mut out_c = Vec::new();
    c.pull_into(&[3], &mut out_c).unwrap();
    assert_ne!(out_c, out[4..8].to_vec());
    assert_eq!(a.hottest(5), vec![(3, 2), (999_999_999_999, 1)]);
    // A read gives what a pull would, and makes nothing.
    let (fresh, mut read) = (
        Table::new(spec.clone(), 9, SparseOptimizer::Sgd { lr: 0.0 }),
        Vec::new(),
    );
    fresh
        .read_into(&[999_999_999_999, 3, 3], &mut read)
        .unwrap();
    assert_eq!((read, fresh.len()), (out.clone(), 0));
    assert!(fresh.read_into(&[spec.rows], &mut Vec::new()).is_err());
    assert_eq!(
        a.pull_into(&[spec.rows], &mut out).unwrap_err().to_string(),
        "table big: id 1000000000000 is no row of its 1000000000000"
    );
}

/// Each optimizer moves exactly the named rows by its formula; untouched rows keep
/// their values and state.
#[test]
fn sparse_optimizers_update_only_the_rows_named() {
    let mut spec = TableSpec::new("t", 100, 2);
    spec.init = super::super::RowInit::Zeros;
    for opt in [
        SparseOptimizer::Sgd { lr: 0.5 },
        SparseOptimizer::adagrad(0.5),
        SparseOptimizer::lazy_adam(0.5),
    ] {
        let mut t = Table::new(spec.clone(), 1, opt);
        let mut out = Vec::new();
        t.pull_into(&[1, 2], &mut out).unwrap();
        let before: Vec<f32> = t.rows().flat_map(|(_, _, s)| s.to_vec()).collect();
        t.apply(&grad(&[2], 2, 2.0), 0.5).unwrap();
        assert_eq!(t.row(1), Some(&[0.0, 0.0][..]), "{opt:?}");
        let row1_state: Vec<f32> = t.rows().next().unwrap().2.to_vec();
        assert_eq!(row1_state, before[..before.len() / 2].to_vec(), "{opt:?}");
        // g = 0.5 x 2 = 1 for row 2.
        let want = match opt {
            SparseOptimizer::Sgd { lr } => -lr,
            SparseOptimizer::Adagrad { lr, initial } => -lr / (initial + 1.0).sqrt(),
            // Bias-corrected first step: lr x m / sqrt(v) = lr (up to eps).
            SparseOptimizer::LazyAdam { lr, .. } => -lr,
        };
        let got = t.row(2).unwrap()[0];
        assert!((got - want).abs() < 1e-5, "{opt:?}: {got} vs {want}");
    }
}

/// A push of the rows a requester last pulled (found where its pull found them) and
/// any other push (looked up) update a table as pushes to a table that never saw the
/// pulls do, with the map index and the array one, SGD and Adagrad; a pull that fails
/// leaves its output as it was, and its requester's next push is looked up.
#[test]
fn pushes_of_the_rows_a_requester_pulled_update_them_as_any_push_does() {
    for (rows, opt) in [
        (1000, SparseOptimizer::Sgd { lr: 0.1 }),
        (1000, SparseOptimizer::adagrad(0.1)),
        (1 << 30, SparseOptimizer::Sgd { lr: 0.1 }),
        (1 << 30, SparseOptimizer::adagrad(0.1)),
    ] {
        let spec = TableSpec::new("t", rows, 16);
        let (mut a, mut b) = (Table::new(spec.clone(), 7, opt), Table::new(spec, 7, opt));
        let ids = [5u64, 999, 3, 77];
        let (mut out, mut want) = (vec![9.0], Vec::new());
        a.pull_extend_by(1, &ids, &mut out).unwrap();
        b.pull_into(&ids, &mut want).unwrap();
        assert_eq!((out[0], &out[1..]), (9.0, &want[..]));
        let pushes = [
            (1, &ids[..], 0.5),
            (0, &[3, 5][..], 2.0),
            (1, &[5, 999][..], -1.0),
        ];
        for (by, push, v) in pushes {
            let g = grad(push, 16, v);
            a.apply_rows_by(by, push, &g.values, 0.5).unwrap();
            b.apply(&g, 0.5).unwrap();
        }
        let mut failed = vec![1.0];
        assert!(a.pull_extend_by(1, &[8, rows], &mut failed).is_err());
        assert_eq!(failed, [1.0]);
        let g = grad(&[8, rows], 16, 1.0);
        assert!(a.apply_rows_by(1, &[8, rows], &g.values, 1.0).is_err());
        let (mut got, mut want) = (Vec::new(), Vec::new());
        a.read_into(&[5, 999, 3, 77, 8], &mut got).unwrap();
        b.read_into(&[5, 999, 3, 77, 8], &mut want).unwrap();
        assert_eq!(got, want, "{rows} rows, {opt:?}");
        assert_eq!(a.hottest(2), [(3, 1), (5, 1)]);
    }
}

#[test]
fn a_restored_row_must_have_its_tables_shape() {
    let mut t = Table::new(
        TableSpec::new("emb", 10, 3),
        1,
        SparseOptimizer::adagrad(0.1),
    );
    t.insert(4, &[1.0, 2.0, 3.0], &[0.5, 0.5, 0.5]).unwrap();
    assert_eq!(t.row(4), Some(&[1.0, 2.0, 3.0][..]));
    assert_eq!(
        t.insert(5, &[1.0], &[]).unwrap_err().to_string(),
        "table emb: row 5 restored with 1 values and 0 of state, not 3 and 3"
    );
}

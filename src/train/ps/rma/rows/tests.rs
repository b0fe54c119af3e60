//! Where everything is in the rows' windows: every region inside its window, none
//! overlapping another; rows split over the ps tasks exactly.

use super::*;
use crate::model::embedding::SparseOptimizer;

fn config(tables: &[(u64, usize)], rows_per_table: u64, per_push: usize) -> RowsConfig {
    RowsConfig {
        tables: (tables.iter().enumerate())
            .map(|(t, (rows, dim))| TableSpec::new(&format!("t{t}"), *rows, *dim))
            .collect(),
        sparse: SparseOptimizer::adagrad(0.1),
        seed: 1,
        rows_per_table,
        rows_per_push: per_push,
        peer_timeout: Duration::from_secs(1),
        checkpoint_dir: None,
        memory: None,
        asynchronous: false,
    }
}

/// Marks `len` words from `at` in `used` (a window's words), failing on any marked twice
/// or past the end.
fn claim(used: &mut [bool], at: usize, len: usize, what: &str) {
    assert!(
        at + len <= used.len(),
        "{what}: {at}+{len} past {}",
        used.len()
    );
    for u in &mut used[at..at + len] {
        assert!(!*u, "{what} overlaps another region at {at}");
        *u = true;
    }
}

#[test]
fn every_region_of_every_ps_window_is_inside_it_and_apart() {
    let cfg = config(&[(1000, 8), (7, 3), (1 << 40, 16)], 300, 5);
    let (nps, nw) = (3, 2);
    let lay = Layout::new(&cfg, nps, nw).unwrap();
    let nt = cfg.tables.len();
    for k in 0..nps {
        let (mut ctl, mut data) = (vec![false; lay.ctl_len[k]], vec![false; lay.data_len[k]]);
        claim(&mut ctl, 0, HEAD, "the header");
        for w in 0..nw {
            claim(&mut ctl, lay.pushed(w), 1, "pushes");
            for t in 0..nt {
                claim(&mut ctl, lay.count(w, t), 1, "a count");
                claim(
                    &mut ctl,
                    lay.staged_ids(k, w, t),
                    2 * lay.per_push,
                    "staged ids",
                );
                let values = lay.per_push * lay.dims[t];
                claim(
                    &mut data,
                    lay.staged_values(k, w, t),
                    values,
                    "staged values",
                );
            }
        }
        for t in 0..nt {
            claim(&mut ctl, lay.stats(t), STATS, "a report");
            let n = lay.buckets[t][k];
            assert!(n.is_power_of_two(), "{n} buckets");
            claim(&mut ctl, lay.bucket_at[t][k], n, "buckets");
            claim(&mut data, lay.values_at[t][k], n * lay.dims[t], "values");
            // Room for twice the rows the ps may hold of the table.
            let held = owned(cfg.tables[t].rows, k, nps).min(cfg.rows_per_table);
            assert!(
                n as u64 >= 2 * held,
                "table {t}: {n} buckets for {held} rows"
            );
            for id in [0u64, 1, 17, 999, 123_456_789] {
                assert!(lay.home(t, k, id) < n);
            }
        }
        assert!(ctl.iter().all(|u| *u), "ps {k}: ctl words unused");
        assert!(data.iter().all(|u| *u), "ps {k}: data words unused");
        assert_eq!(lay.bytes(k), 8 * ctl.len() as u64 + 4 * data.len() as u64);
    }
}

#[test]
fn rows_split_over_the_ps_tasks_as_row_owner_puts_them() {
    for (rows, nps) in [(10u64, 3usize), (7, 7), (5, 8), (1 << 20, 4)] {
        let total: u64 = (0..nps).map(|k| owned(rows, k, nps)).sum();
        assert_eq!(total, rows, "{rows} rows over {nps}");
        if rows < 1000 {
            for k in 0..nps {
                let mine = (0..rows)
                    .filter(|id| crate::train::ps::protocol::row_owner(*id, nps) == k)
                    .count() as u64;
                assert_eq!(mine, owned(rows, k, nps));
            }
        }
    }
}

#[test]
fn a_table_too_large_for_one_window_is_refused_naming_it() {
    let cfg = config(&[(1 << 40, 4)], 1 << 40, 1);
    let e = Layout::new(&cfg, 1, 1).unwrap_err();
    assert!(e.starts_with("table t0: "), "{e}");
}

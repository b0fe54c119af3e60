use std::sync::Barrier;
use std::time::Duration;

use super::super::test_support::{cfg, layout};
use super::super::{server, PsConfig, Roles};
use crate::model::embedding::{SparseGrad, SparseOptimizer, TableSpec};
use crate::train::engine::Session;
use crate::transport::comm::Comm;
use crate::transport::local::LocalComm;

/// Runs a job of `ps` ps tasks and 2 workers whose workers do `work` in their session
/// (a barrier between them); what each worker returned.
fn job<T: Send>(
    ps: usize,
    c: &PsConfig,
    work: impl Fn(&Session<'_, '_, super::super::Ps<'_, LocalComm>>, usize, &Barrier) -> T + Sync,
) -> Vec<T> {
    let l = layout(ps + 2, ps);
    let model = crate::model::mlp(4, &[3], 2).unwrap();
    let both = Barrier::new(2);
    let out = LocalComm::run(ps + 2, |comm| {
        let roles = Roles::new(&l).unwrap();
        if let Some(k) = roles.ps_index(comm.rank()) {
            server::serve(&comm, &roles, k, Duration::from_secs(10)).unwrap();
            return None;
        }
        let w = roles.worker_index(comm.rank()).unwrap();
        let sess = Session::for_worker(&comm, &roles, &model, c).unwrap();
        let got = work(&sess, w, &both);
        sess.close().unwrap();
        Some(got)
    });
    out.into_iter().flatten().collect()
}

/// The rows that exist are in the ps tasks' checkpoint with their optimizer state: a
/// second job, on three ps tasks instead of two, restores them (each on the ps that
/// holds it now) and goes on from them as one table would.
#[test]
fn touched_rows_survive_a_checkpoint_and_a_restore_on_other_ps_tasks() {
    let dir = std::env::temp_dir().join(format!("mpiflow-rows-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = cfg(3, true);
    c.train.checkpoint_dir = Some(dir.clone());
    c.tables = vec![TableSpec::new("emb", 1 << 40, 2)];
    c.sparse = SparseOptimizer::adagrad(0.5);
    let ids: Vec<u64> = (0..40u64).map(|i| i * 1_000_003 + 5).collect();
    let grad = SparseGrad {
        ids: ids.clone(),
        values: (0..ids.len() * 2).map(|i| (i % 5) as f32 - 2.0).collect(),
    };
    // Job 1: worker 0 pushes twice (Adagrad's state matters for the second), both save.
    let first = job(2, &c, |sess, w, both| {
        if w == 0 {
            sess.strategy().push_rows(0, &grad, 1.0).unwrap();
            sess.strategy().push_rows(0, &grad, 1.0).unwrap();
        }
        both.wait();
        let mut rows = Vec::new();
        sess.strategy().pull_rows(0, &ids, &mut rows).unwrap();
        rows
    });
    // Job 2, three ps tasks: restored, then one more push.
    let second = job(3, &c, |sess, w, both| {
        let mut restored = Vec::new();
        sess.strategy().pull_rows(0, &ids, &mut restored).unwrap();
        both.wait();
        if w == 0 {
            sess.strategy().push_rows(0, &grad, 1.0).unwrap();
        }
        both.wait();
        let mut after = Vec::new();
        sess.strategy().pull_rows(0, &ids, &mut after).unwrap();
        (restored, after)
    });
    // The same three pushes on one table.
    let mut one = crate::model::embedding::Table::new(c.tables[0].clone(), c.train.seed, c.sparse);
    (0..3).for_each(|_| one.apply(&grad, 1.0).unwrap());
    let mut want = Vec::new();
    one.pull_into(&ids, &mut want).unwrap();
    for (restored, after) in &second {
        assert_eq!(restored, &first[0]);
        assert_eq!(after, &want);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

use std::sync::Barrier;
use std::time::Duration;

use super::super::test_support::{cfg, layout};
use super::super::{server, PsConfig, Roles};
use crate::model::embedding::{SparseGrad, SparseOptimizer, Table, TableSpec};
use crate::train::engine::Session;
use crate::transport::comm::Comm;
use crate::transport::local::LocalComm;

/// Runs a job of `ps` ps tasks and one worker whose session of `c` does `work`: what it
/// returned.
fn one_worker<T: Send>(
    ps: usize,
    c: &PsConfig,
    work: impl Fn(&Session<'_, '_, super::super::Ps<'_, LocalComm>>) -> T + Sync,
) -> T {
    let l = layout(ps + 1, ps);
    let model = crate::model::mlp(4, &[3], 2).unwrap();
    let out = LocalComm::run(ps + 1, |comm| {
        let roles = Roles::new(&l).unwrap();
        if let Some(k) = roles.ps_index(comm.rank()) {
            server::serve(&comm, &roles, k, Duration::from_secs(10)).unwrap();
            return None;
        }
        let sess = Session::for_worker(&comm, &roles, &model, c).unwrap();
        let got = work(&sess);
        sess.close().unwrap();
        Some(got)
    });
    out.into_iter().flatten().next().unwrap()
}

/// Two ps tasks hold a table of 2^40 rows: two workers pull rows (ids on both ps,
/// repeated ones too) equal to a local table's, each pushes a sparse gradient, and
/// both then pull the rows as the local table has them after both gradients; only the
/// touched rows exist, so the job needs no memory for the rest.
#[test]
fn rows_pulled_and_pushed_over_two_ps_tasks_equal_a_local_table() {
    let l = layout(4, 2); // ps:0, ps:1, worker:0, worker:1
    let mut c = cfg(3, true);
    let spec = TableSpec::new("emb", 1 << 40, 3);
    c.tables = vec![spec.clone()];
    c.sparse = SparseOptimizer::Sgd { lr: 0.5 };
    let model = crate::model::mlp(4, &[3], 2).unwrap();
    let ids = [7u64, (1 << 40) - 1, 10, 7, 123_456_789_012];
    let grads = [
        SparseGrad {
            ids: vec![7, 10],
            values: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        },
        SparseGrad {
            ids: vec![7, 123_456_789_012],
            values: vec![-1.0, 0.5, 0.0, 2.0, 2.0, 2.0],
        },
    ];
    let mut local = Table::new(spec.clone(), c.train.seed, c.sparse);
    let mut before = Vec::new();
    local.pull_into(&ids, &mut before).unwrap();
    grads.iter().for_each(|g| local.apply(g, 0.5).unwrap());
    let mut after = Vec::new();
    local.pull_into(&ids, &mut after).unwrap();
    // Enough rows per ps for the rows to travel as pieces, not in the header's message.
    let many: Vec<u64> = (0..12_000u64).map(|i| i * 7919).collect();
    let many_grad = SparseGrad {
        ids: many.clone(),
        values: (0..many.len() * 3).map(|i| (i % 7) as f32).collect(),
    };
    let mut many_before = Vec::new();
    local.pull_into(&many, &mut many_before).unwrap();
    local.apply(&many_grad, 1.0).unwrap();
    let mut many_after = Vec::new();
    local.pull_into(&many, &mut many_after).unwrap();
    let both = Barrier::new(2);
    let out = LocalComm::run(4, |comm| {
        let roles = Roles::new(&l).unwrap();
        if let Some(k) = roles.ps_index(comm.rank()) {
            server::serve(&comm, &roles, k, Duration::from_secs(10)).unwrap();
            return None;
        }
        let w = roles.worker_index(comm.rank()).unwrap();
        let sess = Session::for_worker(&comm, &roles, &model, &c).unwrap();
        let ps = sess.strategy();
        let (mut first, mut last) = (Vec::new(), Vec::new());
        ps.pull_rows(0, &ids, &mut first).unwrap();
        both.wait();
        ps.push_rows(0, &grads[w], 0.5).unwrap();
        both.wait();
        ps.pull_rows(0, &ids, &mut last).unwrap();
        let bad = ps
            .pull_rows(1, &ids, &mut Vec::new())
            .unwrap_err()
            .to_string();
        sess.close().unwrap();
        Some((first, last, bad))
    });
    for (first, last, bad) in out.into_iter().flatten() {
        assert_eq!(first, before);
        // The two pushes to row 7 may land in either order: equal up to rounding.
        let close = last.iter().zip(&after).all(|(a, b)| (a - b).abs() < 1e-6);
        assert!(close && last.len() == after.len(), "{last:?} vs {after:?}");
        assert!(
            bad.ends_with("no embedding table 1 (the session has 1)"),
            "{bad}"
        );
    }
}

/// A push that carries the next pull gives the rows a local table has after the push,
/// on one ps task and on two, for rows in the reply's message and rows as pieces (two
/// rounds on two ps tasks, where one would risk a cycle).
#[test]
fn a_push_carrying_the_next_pull_gives_the_rows_after_the_push() {
    use crate::train::tables::Tables;
    let spec = TableSpec::new("emb", 1 << 30, 3);
    let few: Vec<u64> = (0..5u64).map(|i| i * 101).collect();
    let many: Vec<u64> = (0..12_000u64).map(|i| i * 7919).collect();
    for ps in [1, 2] {
        for ids in [&few, &many] {
            let mut c = cfg(3, true);
            c.tables = vec![spec.clone()];
            c.sparse = SparseOptimizer::adagrad(0.5);
            let grad = SparseGrad {
                ids: ids.clone(),
                values: (0..ids.len() * 3).map(|i| (i % 5) as f32 - 2.0).collect(),
            };
            let next: Vec<u64> = ids.iter().map(|i| i + 1).chain([ids[0]]).collect();
            let mut local = Table::new(spec.clone(), c.train.seed, c.sparse);
            let mut want = Vec::new();
            local.pull_into(ids, &mut want).unwrap();
            local.apply(&grad, 0.25).unwrap();
            local.pull_into(&next, &mut want).unwrap();
            let got = one_worker(ps, &c, |sess| {
                let ps = sess.strategy();
                ps.pull_rows(0, ids, &mut Vec::new()).unwrap();
                let mut got = vec![Vec::new()];
                ps.push_pull_tables(&[(0, &grad)], 0.25, &[(0, &next)], &mut got)
                    .unwrap();
                got.pop().unwrap()
            });
            assert_eq!(got, want, "{ps} ps, {} ids", ids.len());
        }
    }
}

/// Several tables' rows in one pull, each of its own width (one with no ids asked),
/// arrive each in its table's buffer equal to local tables', in the reply's message
/// and as pieces (a table's rows over two pieces), from one ps task and from two (each
/// ps's ids one run in every table: straight into the buffers; in some or none: placed);
/// a gradient whose values are not a row per id, or fewer buffers than tables, is an
/// error naming the worker, and the ps serves on.
#[test]
fn rows_of_several_tables_arrive_each_in_its_buffer_and_bad_calls_are_refused() {
    let specs = [(3, 5_000), (16, 20_000), (5, 0), (2, 7)];
    let tables: Vec<TableSpec> = (specs.iter().enumerate())
        .map(|(t, (d, _))| TableSpec::new(&format!("t{t}"), 1 << 40, *d))
        .collect();
    let many: Vec<Vec<u64>> = (specs.iter())
        .map(|(_, n)| (0..*n as u64).map(|i| i * 7919 + 3).collect())
        .collect();
    let few: Vec<Vec<u64>> = many
        .iter()
        .map(|ids| ids[..ids.len().min(4)].to_vec())
        .collect();
    // Each ps's ids one run (Unique's order), in every table or in one of them.
    let in_runs = |ids: &Vec<u64>| {
        let mut ids = ids.clone();
        ids.sort_unstable_by_key(|id| id.reverse_bits());
        ids
    };
    let runs: Vec<Vec<u64>> = many.iter().map(in_runs).collect();
    let mixed: Vec<Vec<u64>> = (many.iter().enumerate())
        .map(|(t, ids)| if t == 1 { in_runs(ids) } else { ids.clone() })
        .collect();
    for ps in [1, 2] {
        for ids in [&few, &many, &runs, &mixed] {
            let mut c = cfg(3, true);
            c.tables = tables.clone();
            let want: Vec<Vec<f32>> = (tables.iter().zip(ids))
                .map(|(spec, ids)| {
                    let mut rows = Vec::new();
                    let mut local = Table::new(spec.clone(), c.train.seed, c.sparse);
                    local.pull_into(ids, &mut rows).unwrap();
                    rows
                })
                .collect();
            let (got, again, refused) = one_worker(ps, &c, |sess| {
                let ps = sess.strategy();
                let asked: Vec<(usize, &[u64])> =
                    ids.iter().enumerate().map(|(t, i)| (t, &i[..])).collect();
                // Buffers of other lengths than the rows: each made right.
                let mut got = vec![vec![9.0; 3], Vec::new(), vec![1.0; 100_000], Vec::new()];
                ps.pull_tables(&asked, &mut got, true).unwrap();
                let bad = SparseGrad {
                    ids: vec![1, 2],
                    values: vec![0.0; 5],
                };
                let refused = [
                    ps.push_tables(&[(1, &bad)], 1.0).unwrap_err().to_string(),
                    (ps.pull_tables(&asked, &mut got[..1], true))
                        .unwrap_err()
                        .to_string(),
                ];
                let mut again = vec![Vec::new(); 4];
                ps.pull_tables(&asked, &mut again, true).unwrap();
                (got, again, refused)
            });
            let case = format!("{ps} ps, {} ids", ids[1].len());
            assert_eq!(got, want, "{case}");
            assert_eq!(again, want, "{case}");
            assert!(
                refused[0]
                    .ends_with("a gradient of embedding table 1 has 5 values for 2 rows of 16"),
                "{case}: {}",
                refused[0]
            );
            assert!(
                refused[1].ends_with("rows of 4 tables asked into 1 buffers"),
                "{case}: {}",
                refused[1]
            );
        }
    }
}

/// A ps asked for a row another ps holds (a worker that splits ids otherwise) answers
/// with one error naming the row and both ps tasks, wherever in a long list the row
/// is, and serves on.
#[test]
fn a_ps_asked_for_another_ps_row_names_it_and_serves_on() {
    use super::super::protocol::{Request, RowsPart};
    use super::super::worker::Client;
    let spec = TableSpec::new("emb", 1 << 20, 4);
    let l = layout(3, 2); // ps:0, ps:1, worker:0
    let out = LocalComm::run(3, |comm| {
        let roles = Roles::new(&l).unwrap();
        if let Some(k) = roles.ps_index(comm.rank()) {
            server::serve(&comm, &roles, k, Duration::from_secs(10)).unwrap();
            return None;
        }
        let client = Client::new(&comm, &roles, Vec::new(), Duration::from_secs(10));
        client.init(&rows_setup(&spec), &mut Vec::new()).unwrap();
        // Ps 1 holds the odd rows: 1000 of them, then row 6 (ps 0's) last.
        let odd: Vec<u64> = (0..1000).map(|i| 2 * i + 1).collect();
        let errors: Vec<String> = [vec![6], [odd.clone(), vec![6]].concat()]
            .into_iter()
            .map(|astray| {
                let ids = |k: usize| match k {
                    0 => vec![2, 4],
                    _ => astray.clone(),
                };
                let parts = |k| {
                    vec![RowsPart {
                        table: 0,
                        ids: ids(k),
                    }]
                };
                let request = |k| Request::PullRows { parts: parts(k) };
                client
                    .round(request, |_| Vec::new())
                    .unwrap_err()
                    .to_string()
            })
            .collect();
        let mut rows = vec![Vec::new()];
        client.pull_rows(&[(0, 4, &odd)], &mut rows, true).unwrap();
        client.done(None).unwrap();
        Some((errors, rows.pop().unwrap().len()))
    });
    let (errors, pulled) = out.into_iter().flatten().next().unwrap();
    for e in &errors {
        assert!(e.contains("table emb: row 6 is ps:0's, not ps:1's"), "{e}");
    }
    assert_eq!(pulled, 4000);
}

/// Set once, awaited with a deadline (a test that would hang fails instead).
#[derive(Default)]
struct Flag(std::sync::Mutex<bool>, std::sync::Condvar);

impl Flag {
    fn set(&self) {
        *self.0.lock().unwrap() = true;
        self.1.notify_all();
    }

    /// True if set within `secs` seconds.
    fn wait(&self, secs: u64) -> bool {
        let set = self.0.lock().unwrap();
        let (set, _) = (self.1)
            .wait_timeout_while(set, Duration::from_secs(secs), |s| !*s)
            .unwrap();
        *set
    }
}

/// Rows asked for ahead: the ps serves another worker's pull and push while the rows it
/// sent wait for their worker (sends beyond 4 KiB complete only once received, as MPI's
/// rendezvous sends do: a ps that waited on them would hold the other worker up until
/// this one landed, and this one waits for the other first); they land equal to a local
/// table's, also after another round of the worker took them first; landing other ids
/// (fewer, or as many elsewhere), or none asked for, is an error naming the worker; rows asked for and never landed do
/// not hold up the end.
#[test]
fn rows_pulled_ahead_wait_for_their_worker_while_the_ps_serves_others() {
    use crate::train::tables::Tables;
    let l = layout(3, 1); // ps:0, worker:0, worker:1
    let mut c = cfg(3, false);
    let spec = TableSpec::new("emb", 1 << 40, 3);
    c.tables = vec![spec.clone()];
    c.sparse = SparseOptimizer::Sgd { lr: 0.5 };
    let model = crate::model::mlp(4, &[3], 2).unwrap();
    // Rows as pieces: 12000 x 3 floats. The other worker's rows are others.
    let ahead: Vec<u64> = (0..12_000u64).map(|i| 2 * i * 7919).collect();
    let other: Vec<u64> = (0..12_000u64).map(|i| 2 * i * 7919 + 1).collect();
    let grad = SparseGrad {
        ids: other.clone(),
        values: vec![1.0; other.len() * 3],
    };
    let mut local = Table::new(spec, c.train.seed, c.sparse);
    let mut want = Vec::new();
    local.pull_into(&ahead, &mut want).unwrap();
    let (asked, served) = (Flag::default(), Flag::default());
    let out = LocalComm::run_rendezvous(3, 4096, |comm| {
        let roles = Roles::new(&l).unwrap();
        if let Some(k) = roles.ps_index(comm.rank()) {
            server::serve(&comm, &roles, k, Duration::from_secs(10)).unwrap();
            return None;
        }
        let sess = Session::for_worker(&comm, &roles, &model, &c).unwrap();
        let ps = sess.strategy();
        let rows = [(0, &ahead[..])];
        if roles.worker_index(comm.rank()) == Some(1) {
            assert!(asked.wait(20), "worker 0 never asked");
            ps.pull_rows(0, &other, &mut Vec::new()).unwrap();
            ps.push_rows(0, &grad, 1.0).unwrap();
            served.set();
            sess.close().unwrap();
            return None;
        }
        ps.pull_ahead(&rows).unwrap();
        asked.set();
        let others_served = served.wait(10);
        let mut got = vec![Vec::new()];
        ps.land_tables(&rows, &mut got).unwrap();
        // Another round first: it takes the rows, kept for the landing.
        ps.pull_ahead(&rows).unwrap();
        ps.pull_rows(0, &other[..5], &mut Vec::new()).unwrap();
        let mut again = vec![Vec::new()];
        ps.land_tables(&rows, &mut again).unwrap();
        let none = ps.land_tables(&rows, &mut again).unwrap_err().to_string();
        ps.pull_ahead(&rows).unwrap();
        let fewer = [(0, &ahead[..10])];
        let wrong = ps.land_tables(&fewer, &mut again).unwrap_err().to_string();
        // As many ids, each elsewhere.
        ps.pull_ahead(&rows).unwrap();
        let shifted: Vec<u64> = ahead.iter().map(|id| id + 2).collect();
        let moved = (ps.land_tables(&[(0, &shifted)], &mut again))
            .unwrap_err()
            .to_string();
        assert_eq!(moved, wrong);
        // Asked for and never landed: the end takes them.
        ps.pull_ahead(&rows).unwrap();
        sess.close().unwrap();
        Some((
            others_served,
            got.pop().unwrap(),
            again.pop().unwrap(),
            none,
            wrong,
        ))
    });
    let (others_served, got, again, none, wrong) = out.into_iter().flatten().next().unwrap();
    assert!(
        others_served,
        "the ps held worker 1 up while worker 0's rows waited"
    );
    assert_eq!(got, want);
    assert_eq!(again, want);
    assert!(
        none.ends_with("worker:0 (rank 1): rows landed that were not asked for ahead"),
        "{none}"
    );
    assert!(
        wrong.ends_with("worker:0 (rank 1): rows landed for other ids than were asked for ahead"),
        "{wrong}"
    );
}

/// A ps's setup for table `spec` alone (no variables), rows by SGD.
fn rows_setup(spec: &TableSpec) -> super::super::protocol::Setup {
    use crate::train::optim::{Optimizer, OptimizerKind};
    super::super::protocol::Setup {
        shards: Vec::new(),
        optimizer: Optimizer::new(OptimizerKind::Sgd, 0.1),
        sync: None,
        stage: None,
        tables: vec![spec.clone()],
        sparse: Some(SparseOptimizer::Sgd { lr: 0.1 }),
        seed: 0,
    }
}

/// Rows asked for ahead and never landed (their reply held until received, as MPI's
/// rendezvous sends are) do not hold up an abort every worker agreed on: the worker takes
/// them first, and the ps ends quietly with the agreed error, not by losing the worker.
#[test]
fn rows_asked_ahead_and_never_landed_do_not_hold_up_an_agreed_abort() {
    use super::super::worker::Client;
    use super::super::PsError;
    let spec = TableSpec::new("emb", 1 << 20, 4);
    let l = layout(2, 1); // ps:0, worker:0
    let out = LocalComm::run_rendezvous(2, 4096, |comm| {
        let roles = Roles::new(&l).unwrap();
        if let Some(k) = roles.ps_index(comm.rank()) {
            return Some(server::serve(&comm, &roles, k, Duration::from_secs(10)));
        }
        let client = Client::new(&comm, &roles, Vec::new(), Duration::from_secs(10));
        client.init(&rows_setup(&spec), &mut Vec::new()).unwrap();
        let ids: Vec<u64> = (0..12_000).collect();
        client.pull_ahead(&[(0, 4, &ids)]).unwrap();
        client.abort_agreed("every worker stops");
        None
    });
    let ended = out.into_iter().flatten().next().unwrap();
    assert_eq!(ended, Err(PsError::Ended("every worker stops".into())));
}

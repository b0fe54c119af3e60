//! A worker's side of the embedding tables on the ps tasks: rows pulled by id and sparse
//! gradients pushed, each id to the ps that holds its row ([`row_owner`]), every ps asked
//! in one round (see [`Client::round_then`]).

use super::protocol::{row_owner, Reply, Request, RowsPart};
use super::worker::{Client, Misfit};
use super::PsError;
use crate::model::embedding::{SparseGrad, TableSpec};
use crate::train::tables::RowsReport;
use crate::transport::comm::Comm;

/// `ids` split by the ps that holds each: per ps, its ids and their places in `ids`.
fn by_owner(ids: &[u64], nps: usize) -> (Vec<Vec<u64>>, Vec<Vec<usize>>) {
    let (mut owned, mut places) = (vec![Vec::new(); nps], vec![Vec::new(); nps]);
    for (i, id) in ids.iter().enumerate() {
        let k = row_owner(*id, nps);
        owned[k].push(*id);
        places[k].push(i);
    }
    (owned, places)
}

/// One table's part of a pull or push: its index, its rows' width, and per ps the ids it
/// holds and their places in the caller's list.
struct Split {
    table: usize,
    dim: usize,
    owned: Vec<Vec<u64>>,
    places: Vec<Vec<usize>>,
}

impl Split {
    fn of(table: usize, dim: usize, ids: &[u64], nps: usize) -> Split {
        let (owned, places) = by_owner(ids, nps);
        Split {
            table,
            dim,
            owned,
            places,
        }
    }

    /// Ps `k`'s part of this table.
    fn part(&self, k: usize) -> RowsPart {
        RowsPart {
            table: self.table,
            ids: self.owned[k].clone(),
        }
    }

    /// The floats of ps `k`'s rows of this table.
    fn values(&self, k: usize) -> usize {
        self.owned[k].len() * self.dim
    }
}

/// A table's rows a caller asks for: the table, its rows' width, the ids.
pub type Wanted<'a> = (usize, usize, &'a [u64]);

/// Rows on their way from the ps tasks: what each ps was asked for, and its rows as they
/// arrive (all tables' rows of a ps in one reply, part by part).
struct Pulling {
    split: Vec<Split>,
    got: Vec<Vec<f32>>,
}

impl Pulling {
    fn new(want: &[Wanted<'_>], nps: usize) -> Pulling {
        let split: Vec<Split> = (want.iter())
            .map(|(t, dim, ids)| Split::of(*t, *dim, ids, nps))
            .collect();
        let got = (0..nps)
            .map(|k| vec![0.0; split.iter().map(|s| s.values(k)).sum()])
            .collect();
        Pulling { split, got }
    }

    /// Ps `k`'s parts of the request, of the tables `split`.
    fn parts(split: &[Split], k: usize) -> Vec<RowsPart> {
        split.iter().map(|s| s.part(k)).collect()
    }

    /// Ps `k`'s reply and its rows into `got` (inline in the reply's message, or the pieces
    /// after it).
    fn take<C: Comm>(
        client: &Client<'_, C>,
        k: usize,
        got: &mut [f32],
        reply: &Reply,
        inline_bytes: &[u8],
    ) -> Result<(), PsError> {
        let roles = client.roles;
        let wrong = |what: String| PsError::Remote {
            task: roles.task(roles.ps[k]),
            message: what,
        };
        let want = got.len();
        if *reply != (Reply::Rows { values: want }) {
            return Err(wrong(format!(
                "answered a pull of {want} values of rows with {reply:?}"
            )));
        }
        match client.take_floats(k, &mut [got], inline_bytes)? {
            None => Ok(()),
            Some(Misfit::Inline { sent }) => {
                Err(wrong(format!("sent {sent} values for rows of {want}")))
            }
            Some(Misfit::Piece { want }) => Err(wrong(format!(
                "sent a piece of rows of another length than {want} bytes"
            ))),
        }
    }

    /// The rows of a round that ended `taken` into each table's `out` (`ids.len() x dim`
    /// in the order of its ids); after an error the rows' memory is given up (receives
    /// into it may still be in flight).
    fn finish(self, taken: Result<(), PsError>, out: &mut [Vec<f32>]) -> Result<(), PsError> {
        if let Err(e) = taken {
            std::mem::forget(self.got);
            return Err(e);
        }
        let (split, got) = (self.split, self.got);
        let mut at = vec![0usize; got.len()];
        for (s, out) in split.iter().zip(out.iter_mut()) {
            let d = s.dim;
            out.clear();
            out.resize(s.places.iter().map(Vec::len).sum::<usize>() * d, 0.0);
            for (k, places) in s.places.iter().enumerate() {
                let rows = &got[k][at[k]..at[k] + places.len() * d];
                at[k] += places.len() * d;
                for (row, i) in rows.chunks_exact(d.max(1)).zip(places) {
                    out[i * d..(i + 1) * d].copy_from_slice(row);
                }
            }
        }
        Ok(())
    }
}

impl<C: Comm> Client<'_, C> {
    /// `want`'s tables (each a table's index and what goes with it) with their rows'
    /// widths among `specs`; an error naming this worker and a table it does not have.
    fn widths<T: Copy>(
        &self,
        specs: &[TableSpec],
        want: &[(usize, T)],
    ) -> Result<Vec<(usize, usize, T)>, PsError> {
        (want.iter())
            .map(|(t, x)| match specs.get(*t) {
                Some(spec) => Ok((*t, spec.dim, *x)),
                None => Err(PsError::Setup(format!(
                    "{}: no embedding table {t} (the session has {})",
                    self.me(),
                    specs.len()
                ))),
            })
            .collect()
    }

    /// [`Client::pull_rows`] of tables among `specs` (each a table and its ids).
    pub fn pull_tables(
        &self,
        specs: &[TableSpec],
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), PsError> {
        self.pull_rows(&self.widths(specs, want)?, out, make)
    }

    /// [`Client::push_rows`] of tables among `specs` (each a table and its gradient).
    pub fn push_tables(
        &self,
        specs: &[TableSpec],
        grads: &[(usize, &SparseGrad)],
        scale: f32,
    ) -> Result<(), PsError> {
        self.push_rows(&self.widths(specs, grads)?, scale)
    }

    /// [`Client::push_pull_rows`] of tables among `specs`.
    pub fn push_pull_tables(
        &self,
        specs: &[TableSpec],
        (grads, scale): (&[(usize, &SparseGrad)], f32),
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
    ) -> Result<(), PsError> {
        let (grads, want) = (self.widths(specs, grads)?, self.widths(specs, want)?);
        self.push_pull_rows(&grads, scale, &want, out)
    }

    /// The rows `want` names (each table's into its `out`, `ids.len() x dim` in the order
    /// of its ids), every ps asked once for all the tables; rows not yet touched are made
    /// by their ps (`make`), or read as their initial values.
    pub fn pull_rows(
        &self,
        want: &[Wanted<'_>],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), PsError> {
        let mut pulling = Pulling::new(want, self.roles.ps.len());
        let split = &pulling.split;
        let request = |k: usize| {
            let parts = Pulling::parts(split, k);
            match make {
                true => Request::PullRows { parts },
                false => Request::ReadRows { parts },
            }
        };
        let got = &mut pulling.got;
        let taken = self.round_then(
            request,
            |_| Vec::new(),
            |k, reply, bytes| Pulling::take(self, k, &mut got[k], reply, bytes),
        );
        pulling.finish(taken.map(drop), out)
    }

    /// Pushes the sparse gradients `grads` (each of table `table`, `dim` values a row)
    /// scaled by `scale`, every ps sent its rows of all of them at once: each applies its
    /// rows' part as it arrives.
    pub fn push_rows(
        &self,
        grads: &[(usize, usize, &SparseGrad)],
        scale: f32,
    ) -> Result<(), PsError> {
        self.push_pull_rows(grads, scale, &[], &mut [])
    }

    /// [`Client::push_rows`] whose requests also ask for the rows `want` names after the
    /// push is applied, as [`Client::pull_rows`] would (made where new) in a second round:
    /// one round trip per ps for a step's push and the next step's pull.
    pub fn push_pull_rows(
        &self,
        grads: &[(usize, usize, &SparseGrad)],
        scale: f32,
        want: &[Wanted<'_>],
        out: &mut [Vec<f32>],
    ) -> Result<(), PsError> {
        let nps = self.roles.ps.len();
        let split: Vec<Split> = (grads.iter())
            .map(|(t, dim, g)| Split::of(*t, *dim, &g.ids, nps))
            .collect();
        let payload: Vec<Vec<f32>> = (0..nps)
            .map(|k| {
                let mut v = Vec::with_capacity(split.iter().map(|s| s.values(k)).sum());
                for (s, (_, dim, g)) in split.iter().zip(grads) {
                    s.places[k]
                        .iter()
                        .for_each(|i| v.extend_from_slice(g.row(*i, *dim)));
                }
                v
            })
            .collect();
        let mut pulling = Pulling::new(want, nps);
        let pull = &pulling.split;
        let request = |k: usize| Request::PushRows {
            parts: Pulling::parts(&split, k),
            scale,
            values: payload[k].len(),
            pull: Pulling::parts(pull, k),
        };
        let (pulls, got) = (!want.is_empty(), &mut pulling.got);
        let taken = self.round_then(
            request,
            |k| vec![&payload[k][..]],
            |k, reply, bytes| match (pulls, reply) {
                (true, _) => Pulling::take(self, k, &mut got[k], reply, bytes),
                (false, Reply::Ok { .. }) => Ok(()),
                (false, other) => Err(PsError::Remote {
                    task: self.me(),
                    message: format!("a ps answered a push of rows with {other:?}"),
                }),
            },
        );
        if taken.is_err() {
            // MPI may still read the payload after an error.
            std::mem::forget(payload);
        }
        pulling.finish(taken.map(drop), out)
    }

    /// The chief: every ps's report of its tables' rows and the requests they served.
    pub fn stats(&self) -> Result<Vec<RowsReport>, PsError> {
        let replies = self.round(|_| Request::Stats, |_| Vec::new())?;
        (replies.into_iter().zip(&self.roles.ps))
            .map(|(reply, rank)| match reply {
                Reply::Stats { tables } => Ok(RowsReport {
                    task: self.roles.task(*rank),
                    tables,
                }),
                other => Err(PsError::Remote {
                    task: self.me(),
                    message: format!("a ps answered a report of its rows with {other:?}"),
                }),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::time::Duration;

    use super::super::test_support::{cfg, layout};
    use super::super::{server, Roles};
    use crate::model::embedding::{SparseGrad, SparseOptimizer, Table, TableSpec};
    use crate::train::engine::Session;
    use crate::transport::comm::Comm;
    use crate::transport::local::LocalComm;

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
                let l = layout(ps + 1, ps);
                let model = crate::model::mlp(4, &[3], 2).unwrap();
                let out = LocalComm::run(ps + 1, |comm| {
                    let roles = Roles::new(&l).unwrap();
                    if let Some(k) = roles.ps_index(comm.rank()) {
                        server::serve(&comm, &roles, k, Duration::from_secs(10)).unwrap();
                        return None;
                    }
                    let sess = Session::for_worker(&comm, &roles, &model, &c).unwrap();
                    let ps = sess.strategy();
                    ps.pull_rows(0, ids, &mut Vec::new()).unwrap();
                    let mut got = vec![Vec::new()];
                    ps.push_pull_tables(&[(0, &grad)], 0.25, &[(0, &next)], &mut got)
                        .unwrap();
                    sess.close().unwrap();
                    got.pop()
                });
                let got = out.into_iter().flatten().next().unwrap();
                assert_eq!(got, want, "{ps} ps, {} ids", ids.len());
            }
        }
    }
}

#[cfg(test)]
mod checkpoint_tests {
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
        let mut one =
            crate::model::embedding::Table::new(c.tables[0].clone(), c.train.seed, c.sparse);
        (0..3).for_each(|_| one.apply(&grad, 1.0).unwrap());
        let mut want = Vec::new();
        one.pull_into(&ids, &mut want).unwrap();
        for (restored, after) in &second {
            assert_eq!(restored, &first[0]);
            assert_eq!(after, &want);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

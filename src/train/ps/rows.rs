//! A worker's side of the embedding tables on the ps tasks: rows pulled by id and sparse
//! gradients pushed, each id to the ps that holds its row ([`row_owner`]), every ps asked
//! in one round (see [`Client::round_then`]).
//!
//! Where each ps's ids are one run of the caller's list (always with one ps; with a power
//! of 2 of them for ids in [`crate::model::embedding::Unique`]'s order), a pull's rows
//! arrive straight in the caller's buffers and a push's gradient rows go as one copy per
//! ps; otherwise each ps's rows arrive in a buffer of the client's, kept from one round to
//! the next, and are copied to their places.

use std::ops::Range;

use super::protocol::{row_owner, Reply, Request, RowsPart};
use super::worker::{Client, Misfit};
use super::PsError;
use crate::model::embedding::{append_row, copy_row, SparseGrad, TableSpec};
use crate::train::tables::RowsReport;
use crate::transport::comm::Comm;

/// One table's part of a pull or push: its index, its rows' width, its ids in the caller's
/// order, and which of them each ps holds.
struct Split<'a> {
    table: usize,
    dim: usize,
    ids: &'a [u64],
    owners: Owners,
}

/// Which of a table's ids each ps holds.
enum Owners {
    /// Each ps's ids are one run of the caller's list.
    Runs(Vec<Range<usize>>),
    /// Spread over the list: per ps, its ids and their places in the list.
    Spread {
        owned: Vec<Vec<u64>>,
        places: Vec<Vec<usize>>,
    },
}

impl Owners {
    /// Each ps's run of `ids`, if each ps's ids are one run.
    fn runs(ids: &[u64], nps: usize) -> Option<Vec<Range<usize>>> {
        if nps == 1 {
            return Some(std::iter::once(0..ids.len()).collect());
        }
        let mut runs: Vec<Option<Range<usize>>> = vec![None; nps];
        let mut start = 0;
        while start < ids.len() {
            let k = row_owner(ids[start], nps);
            let len = (ids[start..].iter())
                .position(|id| row_owner(*id, nps) != k)
                .unwrap_or(ids.len() - start);
            if runs[k].is_some() {
                return None;
            }
            runs[k] = Some(start..start + len);
            start += len;
        }
        Some(runs.into_iter().map(|r| r.unwrap_or(0..0)).collect())
    }

    fn of(ids: &[u64], nps: usize) -> Owners {
        if let Some(runs) = Owners::runs(ids, nps) {
            return Owners::Runs(runs);
        }
        // Each ps's share and some: one allocation per list for an even spread.
        let cap = ids.len() / nps + ids.len() / (4 * nps) + 16;
        let mut owned: Vec<Vec<u64>> = (0..nps).map(|_| Vec::with_capacity(cap)).collect();
        let mut places: Vec<Vec<usize>> = (0..nps).map(|_| Vec::with_capacity(cap)).collect();
        for (i, id) in ids.iter().enumerate() {
            let k = row_owner(*id, nps);
            owned[k].push(*id);
            places[k].push(i);
        }
        Owners::Spread { owned, places }
    }
}

impl<'a> Split<'a> {
    fn of(table: usize, dim: usize, ids: &'a [u64], nps: usize) -> Split<'a> {
        Split {
            table,
            dim,
            ids,
            owners: Owners::of(ids, nps),
        }
    }

    /// Ps `k`'s ids of this table.
    fn owned(&self, k: usize) -> &[u64] {
        match &self.owners {
            Owners::Runs(runs) => &self.ids[runs[k].clone()],
            Owners::Spread { owned, .. } => &owned[k],
        }
    }

    /// Ps `k`'s run of this table's values (of rows in the caller's order), if its ids
    /// are one run.
    fn run(&self, k: usize) -> Option<Range<usize>> {
        match &self.owners {
            Owners::Runs(runs) => Some(runs[k].start * self.dim..runs[k].end * self.dim),
            Owners::Spread { .. } => None,
        }
    }

    /// Ps `k`'s part of this table.
    fn part(&self, k: usize) -> RowsPart {
        RowsPart {
            table: self.table,
            ids: self.owned(k).to_vec(),
        }
    }

    /// The floats of ps `k`'s rows of this table.
    fn values(&self, k: usize) -> usize {
        self.owned(k).len() * self.dim
    }

    /// Ps `k`'s rows of `g` (a gradient of this table's ids) appended to `out`.
    fn gather(&self, k: usize, g: &SparseGrad, out: &mut Vec<f32>) {
        match &self.owners {
            Owners::Runs(_) => out.extend_from_slice(&g.values[self.run(k).expect("a run")]),
            Owners::Spread { places, .. } => {
                (places[k].iter()).for_each(|i| append_row(out, g.row(*i, self.dim)))
            }
        }
    }

    /// Ps `k`'s rows `rows` (in its order) to their places in `out`.
    fn place(&self, k: usize, rows: &[f32], out: &mut [f32]) {
        let d = self.dim;
        match &self.owners {
            Owners::Runs(_) => out[self.run(k).expect("a run")].copy_from_slice(rows),
            Owners::Spread { places, .. } => {
                for (row, i) in rows.chunks_exact(d.max(1)).zip(&places[k]) {
                    copy_row(&mut out[i * d..(i + 1) * d], row);
                }
            }
        }
    }
}

/// A table's rows a caller asks for: the table, its rows' width, the ids.
pub type Wanted<'a> = (usize, usize, &'a [u64]);

/// Rows on their way from the ps tasks: what each ps was asked for, and where its rows
/// arrive (all tables' rows of a ps in one reply, part by part): where every table's ids
/// are runs, the callers' own buffers, taken from them until [`Pulling::finish`]; else one
/// buffer per ps.
struct Pulling<'a> {
    split: Vec<Split<'a>>,
    got: Vec<Vec<f32>>,
    direct: bool,
}

impl<'a> Pulling<'a> {
    /// A pull of `want` into `out` (one buffer per table), each ps's rows into one of
    /// `spare` where they cannot go straight to `out`.
    fn new(
        want: &[Wanted<'a>],
        nps: usize,
        out: &mut [Vec<f32>],
        mut spare: Vec<Vec<f32>>,
    ) -> Pulling<'a> {
        let split: Vec<Split> = (want.iter())
            .map(|(t, dim, ids)| Split::of(*t, *dim, ids, nps))
            .collect();
        let direct = (split.iter()).all(|s| matches!(s.owners, Owners::Runs(_)));
        let got: Vec<Vec<f32>> = match direct {
            true => (split.iter().zip(out.iter_mut()))
                .map(|(s, out)| sized(std::mem::take(out), s.ids.len() * s.dim))
                .collect(),
            false => {
                spare.resize_with(nps, Vec::new);
                (spare.into_iter().enumerate())
                    .map(|(k, got)| sized(got, split.iter().map(|s| s.values(k)).sum()))
                    .collect()
            }
        };
        Pulling { split, got, direct }
    }

    /// Ps `k`'s parts of the request, of the tables `split`.
    fn parts(split: &[Split], k: usize) -> Vec<RowsPart> {
        split.iter().map(|s| s.part(k)).collect()
    }

    /// Where ps `k`'s rows of the tables `split` arrive, a place per table in the order
    /// it sends them (it sends each table's rows in pieces of their own).
    fn places<'g>(
        split: &[Split],
        got: &'g mut [Vec<f32>],
        direct: bool,
        k: usize,
    ) -> Vec<&'g mut [f32]> {
        if direct {
            return (got.iter_mut().zip(split))
                .map(|(g, s)| &mut g[s.run(k).expect("runs")])
                .collect();
        }
        let mut rest = &mut got[k][..];
        (split.iter())
            .map(|s| {
                let (part, after) = std::mem::take(&mut rest).split_at_mut(s.values(k));
                rest = after;
                part
            })
            .collect()
    }

    /// Ps `k`'s reply and its rows into `places` (inline in the reply's message, or the
    /// pieces after it).
    fn take<C: Comm>(
        client: &Client<'_, C>,
        k: usize,
        places: &mut [&mut [f32]],
        reply: &Reply,
        inline_bytes: &[u8],
    ) -> Result<(), PsError> {
        let roles = client.roles;
        let wrong = |what: String| PsError::Remote {
            task: roles.task(roles.ps[k]),
            message: what,
        };
        let want: usize = places.iter().map(|p| p.len()).sum();
        if *reply != (Reply::Rows { values: want }) {
            return Err(wrong(format!(
                "answered a pull of {want} values of rows with {reply:?}"
            )));
        }
        match client.take_floats(k, places, inline_bytes)? {
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
    /// in the order of its ids); the per-ps buffers back to the client. After an error the
    /// rows' memory is given up (receives into it may still be in flight) and, where the
    /// rows were coming straight to them, the buffers of `out` are left empty.
    fn finish<C: Comm>(
        self,
        client: &Client<'_, C>,
        taken: Result<(), PsError>,
        out: &mut [Vec<f32>],
    ) -> Result<(), PsError> {
        if let Err(e) = taken {
            std::mem::forget(self.got);
            return Err(e);
        }
        let (split, got) = (self.split, self.got);
        if self.direct {
            out.iter_mut().zip(got).for_each(|(out, got)| *out = got);
            return Ok(());
        }
        let mut at = vec![0usize; got.len()];
        for (s, out) in split.iter().zip(out.iter_mut()) {
            // Every row is written below: a buffer of the right length needs no zeroes.
            out.resize(s.ids.len() * s.dim, 0.0);
            for (k, got) in got.iter().enumerate() {
                let n = s.values(k);
                s.place(k, &got[at[k]..at[k] + n], out);
                at[k] += n;
            }
        }
        client.give_rows(got);
        Ok(())
    }
}

/// `v` made `len` long, its values whatever they were (each is written before it is read).
fn sized(mut v: Vec<f32>, len: usize) -> Vec<f32> {
    v.resize(len, 0.0);
    v
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
        self.check_outputs(want, out)?;
        let mut pulling = Pulling::new(want, self.roles.ps.len(), out, self.take_rows());
        let split = &pulling.split;
        let request = |k: usize| {
            let parts = Pulling::parts(split, k);
            match make {
                true => Request::PullRows { parts },
                false => Request::ReadRows { parts },
            }
        };
        let (got, direct) = (&mut pulling.got, pulling.direct);
        let taken = self.round_then(
            request,
            |_| Vec::new(),
            |k, reply, bytes| {
                let places = &mut Pulling::places(split, got, direct, k);
                Pulling::take(self, k, places, reply, bytes)
            },
        );
        pulling.finish(self, taken.map(drop), out)
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
        self.check_gradients(grads)?;
        self.check_outputs(want, out)?;
        let nps = self.roles.ps.len();
        let split: Vec<Split> = (grads.iter())
            .map(|(t, dim, g)| Split::of(*t, *dim, &g.ids, nps))
            .collect();
        // The gradients' rows gathered per ps into the client's buffers (a copy, not the
        // caller's memory: MPI may still read it after an error).
        let mut payload = self.take_grads();
        payload.resize_with(nps, Vec::new);
        for (k, v) in payload.iter_mut().enumerate() {
            v.clear();
            for (s, (_, _, g)) in split.iter().zip(grads) {
                s.gather(k, g, v);
            }
        }
        let mut pulling = Pulling::new(want, nps, out, self.take_rows());
        let pull = &pulling.split;
        let request = |k: usize| Request::PushRows {
            parts: Pulling::parts(&split, k),
            scale,
            values: payload[k].len(),
            pull: Pulling::parts(pull, k),
        };
        let (pulls, got, direct) = (!want.is_empty(), &mut pulling.got, pulling.direct);
        let taken = self.round_then(
            request,
            |k| vec![&payload[k][..]],
            |k, reply, bytes| match (pulls, reply) {
                (true, _) => {
                    let places = &mut Pulling::places(pull, got, direct, k);
                    Pulling::take(self, k, places, reply, bytes)
                }
                (false, Reply::Ok { .. }) => Ok(()),
                (false, other) => Err(PsError::Remote {
                    task: self.me(),
                    message: format!("a ps answered a push of rows with {other:?}"),
                }),
            },
        );
        match &taken {
            Ok(_) => self.give_grads(payload),
            // MPI may still read the payload after an error.
            Err(_) => std::mem::forget(payload),
        }
        pulling.finish(self, taken.map(drop), out)
    }

    /// An error naming this worker where `out` has fewer buffers than `want` tables.
    fn check_outputs(&self, want: &[Wanted<'_>], out: &[Vec<f32>]) -> Result<(), PsError> {
        match out.len() >= want.len() {
            true => Ok(()),
            false => Err(PsError::Setup(format!(
                "{}: rows of {} tables asked into {} buffers",
                self.me(),
                want.len(),
                out.len()
            ))),
        }
    }

    /// An error naming this worker and the table where a gradient's values are not a row
    /// per id.
    fn check_gradients(&self, grads: &[(usize, usize, &SparseGrad)]) -> Result<(), PsError> {
        for (t, dim, g) in grads {
            if g.values.len() != g.ids.len() * dim {
                return Err(PsError::Setup(format!(
                    "{}: a gradient of embedding table {t} has {} values for {} rows of {dim}",
                    self.me(),
                    g.values.len(),
                    g.ids.len()
                )));
            }
        }
        Ok(())
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

    /// Several tables' rows in one pull, each of its own width (one with no ids asked),
    /// arrive each in its table's buffer equal to local tables', in the reply's message
    /// and as pieces (a table's rows over two pieces), from one ps task (straight into
    /// the buffers) and from two; a gradient whose values are not a row per id, or fewer
    /// buffers than tables, is an error naming the worker, and the ps serves on.
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
        for ps in [1, 2] {
            for ids in [&few, &many] {
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
                    sess.close().unwrap();
                    Some((got, again, refused))
                });
                let (got, again, refused) = out.into_iter().flatten().next().unwrap();
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
        use super::super::protocol::{Request, RowsPart, Setup};
        use super::super::worker::Client;
        use crate::train::optim::{Optimizer, OptimizerKind};
        let spec = TableSpec::new("emb", 1 << 20, 4);
        let l = layout(3, 2); // ps:0, ps:1, worker:0
        let out = LocalComm::run(3, |comm| {
            let roles = Roles::new(&l).unwrap();
            if let Some(k) = roles.ps_index(comm.rank()) {
                server::serve(&comm, &roles, k, Duration::from_secs(10)).unwrap();
                return None;
            }
            let client = Client::new(&comm, &roles, Vec::new(), Duration::from_secs(10));
            let setup = Setup {
                shards: Vec::new(),
                optimizer: Optimizer::new(OptimizerKind::Sgd, 0.1),
                sync: None,
                stage: None,
                tables: vec![spec.clone()],
                sparse: Some(SparseOptimizer::Sgd { lr: 0.1 }),
                seed: 0,
            };
            client.init(&setup, &mut Vec::new()).unwrap();
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

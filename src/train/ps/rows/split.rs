//! How a pull or push of rows is split over the ps tasks, and where a pull's rows arrive.

use std::ops::Range;

use super::super::protocol::{row_owner, RowsPart};
use super::super::worker::{places, Client};
use super::super::PsError;
use super::Wanted;
use crate::model::embedding::{append_row, copy_row, SparseGrad};
use crate::transport::comm::Comm;

/// One table's part of a pull or push: its index, its rows' width, its ids in the caller's
/// order, and which of them each ps holds.
pub(super) struct Split<'a> {
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
    pub(super) fn of(table: usize, dim: usize, ids: &'a [u64], nps: usize) -> Split<'a> {
        Split {
            table,
            dim,
            ids,
            owners: Owners::of(ids, nps),
        }
    }

    /// The splits of every table `want` names.
    pub(super) fn all(want: &[Wanted<'a>], nps: usize) -> Vec<Split<'a>> {
        (want.iter())
            .map(|(t, dim, ids)| Split::of(*t, *dim, ids, nps))
            .collect()
    }

    /// Per ps of `nps`, the floats of its rows of each table of `split`, in order.
    pub(super) fn values_per_ps(split: &[Split], nps: usize) -> Vec<Vec<usize>> {
        (0..nps)
            .map(|k| split.iter().map(|s| s.values(k)).collect())
            .collect()
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
    pub(super) fn values(&self, k: usize) -> usize {
        self.owned(k).len() * self.dim
    }

    /// Ps `k`'s rows of `g` (a gradient of this table's ids) appended to `out`.
    pub(super) fn gather(&self, k: usize, g: &SparseGrad, out: &mut Vec<f32>) {
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

/// Rows on their way from the ps tasks: what each ps was asked for, and where its rows
/// arrive (all tables' rows of a ps in one reply, part by part): where every table's ids
/// are runs, the callers' own buffers, taken from them until [`Pulling::finish`]; else one
/// buffer per ps.
pub(super) struct Pulling<'a> {
    pub(super) split: Vec<Split<'a>>,
    pub(super) got: Vec<Vec<f32>>,
    pub(super) direct: bool,
    /// The client's per-ps buffers, unused while the rows come straight to the caller's.
    spare: Vec<Vec<f32>>,
}

impl<'a> Pulling<'a> {
    /// A pull of `want` into `out` (one buffer per table), each ps's rows into one of
    /// `spare` where they cannot go straight to `out`.
    pub(super) fn new(
        want: &[Wanted<'a>],
        nps: usize,
        out: &mut [Vec<f32>],
        mut spare: Vec<Vec<f32>>,
    ) -> Pulling<'a> {
        let split = Split::all(want, nps);
        let direct = (split.iter()).all(|s| matches!(s.owners, Owners::Runs(_)));
        let got: Vec<Vec<f32>> = match direct {
            true => (split.iter().zip(out.iter_mut()))
                .map(|(s, out)| sized(std::mem::take(out), s.ids.len() * s.dim))
                .collect(),
            false => {
                spare.resize_with(nps, Vec::new);
                (std::mem::take(&mut spare).into_iter().enumerate())
                    .map(|(k, got)| sized(got, split.iter().map(|s| s.values(k)).sum()))
                    .collect()
            }
        };
        Pulling {
            split,
            got,
            direct,
            spare,
        }
    }

    /// Ps `k`'s parts of the request, of the tables `split`.
    pub(super) fn parts(split: &[Split], k: usize) -> Vec<RowsPart> {
        split.iter().map(|s| s.part(k)).collect()
    }

    /// Where ps `k`'s rows of the tables `split` arrive, a place per table in the order
    /// it sends them (it sends each table's rows in pieces of their own).
    pub(super) fn places<'g>(
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
        let values: Vec<usize> = split.iter().map(|s| s.values(k)).collect();
        places(&values, &mut got[k])
    }

    /// The rows of a round that ended `taken` into each table's `out` (`ids.len() x dim`
    /// in the order of its ids); the per-ps buffers back to the client. After an error the
    /// rows' memory is given up (receives into it may still be in flight) and, where the
    /// rows were coming straight to them, the buffers of `out` are left empty.
    pub(super) fn finish<C: Comm>(
        self,
        client: &Client<'_, C>,
        taken: Result<(), PsError>,
        out: &mut [Vec<f32>],
    ) -> Result<(), PsError> {
        if let Err(e) = taken {
            std::mem::forget(self.got);
            client.give_rows(self.spare);
            return Err(e);
        }
        let (split, got) = (self.split, self.got);
        if self.direct {
            out.iter_mut().zip(got).for_each(|(out, got)| *out = got);
            client.give_rows(self.spare);
            return Ok(());
        }
        place_all(&split, &got, out);
        client.give_rows(got);
        Ok(())
    }
}

/// Each ps's rows `got[k]` (its parts of the tables `split` end to end) to their places
/// in each table's `out` (`ids.len() x dim`, in the order of its ids).
pub(super) fn place_all(split: &[Split], got: &[Vec<f32>], out: &mut [Vec<f32>]) {
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
}

/// `v` made `len` long, its values whatever they were (each is written before it is read).
fn sized(mut v: Vec<f32>, len: usize) -> Vec<f32> {
    v.resize(len, 0.0);
    v
}

//! A worker's side of the embedding tables on the ps tasks: rows pulled by id and sparse
//! gradients pushed, each id to the ps that holds its row ([`row_owner`]), every ps asked
//! in one round (see [`Client::round_then`]).
//!
//! Where each ps's ids are one run of the caller's list (always with one ps; with a power
//! of 2 of them for ids in [`crate::model::embedding::Unique`]'s order), a pull's rows
//! arrive straight in the caller's buffers and a push's gradient rows go as one copy per
//! ps; otherwise each ps's rows arrive in a buffer of the client's, kept from one round to
//! the next, and are copied to their places.

mod split;

use super::protocol::{Reply, Request};
use super::worker::Client;
use super::PsError;
use crate::model::embedding::{SparseGrad, TableSpec};
use crate::train::tables::RowsReport;
use crate::transport::comm::Comm;
use split::{place_all, Pulling, Split};

/// A table's rows a caller asks for: the table, its rows' width, the ids.
pub type Wanted<'a> = (usize, usize, &'a [u64]);

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

    /// [`Client::pull_ahead`] of tables among `specs` (each a table and its ids).
    pub fn pull_tables_ahead(
        &self,
        specs: &[TableSpec],
        want: &[(usize, &[u64])],
    ) -> Result<(), PsError> {
        self.pull_ahead(&self.widths(specs, want)?)
    }

    /// [`Client::land_rows`] of tables among `specs`.
    pub fn land_tables(
        &self,
        specs: &[TableSpec],
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
    ) -> Result<(), PsError> {
        self.land_rows(&self.widths(specs, want)?, out)
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
                self.take_rows_reply(k, places, reply, bytes)
            },
        );
        pulling.finish(self, taken.map(drop), out)
    }

    /// Starts pulling the rows `want` names (made where new), to be taken by
    /// [`Client::land_rows`] with the same `want`: the requests go out now, and each ps
    /// serves them and leaves its reply in flight while this worker computes. The rows
    /// hold the updates their ps had applied when it served the request: a worker pulls
    /// ahead only rows its own pending push does not touch.
    pub fn pull_ahead(&self, want: &[Wanted<'_>]) -> Result<(), PsError> {
        let split = Split::all(want, self.roles.ps.len());
        let values = Split::values_per_ps(&split, self.roles.ps.len());
        let asked = (values, fingerprint(want));
        let request = |k: usize| Request::PullRows {
            parts: Pulling::parts(&split, k),
        };
        self.send_ahead(request, asked)
    }

    /// The rows [`Client::pull_ahead`] asked for (`want`: the same tables and ids), each
    /// table's into its `out` (`ids.len() x dim` in the order of its ids).
    pub fn land_rows(&self, want: &[Wanted<'_>], out: &mut [Vec<f32>]) -> Result<(), PsError> {
        self.check_outputs(want, out)?;
        let ahead = self.land_ahead()?;
        let split = Split::all(want, self.roles.ps.len());
        let values = Split::values_per_ps(&split, self.roles.ps.len());
        if (ahead.values != values) || ahead.asked != fingerprint(want) {
            self.keep_rows(ahead);
            return Err(PsError::Setup(format!(
                "{}: rows landed for other ids than were asked for ahead",
                self.me()
            )));
        }
        place_all(&split, &ahead.got, out);
        self.keep_rows(ahead);
        Ok(())
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
                    self.take_rows_reply(k, places, reply, bytes)
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

/// A fingerprint of the tables and ids of `want` (a multiply-rotate fold: a few cycles an
/// id), for a landing to check it lands what was asked for.
fn fingerprint(want: &[Wanted<'_>]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let fold = |h: u64, x: u64| (h ^ x).wrapping_mul(K).rotate_left(29);
    (want.iter()).fold(0, |h, (t, dim, ids)| {
        let h = fold(fold(fold(h, *t as u64), *dim as u64), ids.len() as u64);
        ids.iter().fold(h, |h, id| fold(h, *id))
    })
}

#[cfg(test)]
mod checkpoint_tests;
#[cfg(test)]
mod tests;

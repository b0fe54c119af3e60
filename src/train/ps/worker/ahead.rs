//! A round sent ahead: a worker asks every ps for rows, computes, and takes the replies
//! later (see `Client::pull_ahead`), while the ps tasks serve on (each leaves its reply in
//! flight until taken).
//!
//! The rows land in the client's per-ps buffers, whatever the caller's buffers are, so
//! that any round the client makes before the caller lands them (a step's error path, the
//! end of training) takes the replies first and keeps them: a ps's replies come in the
//! order of its requests, and a reply must never be read as another request's.

use super::{Client, Misfit};
use crate::train::ps::protocol::{Reply, Request};
use crate::train::ps::PsError;
use crate::transport::comm::Comm;

/// Rows asked for ahead and not landed yet.
pub(in crate::train::ps) struct Ahead {
    /// Per ps, its rows' floats per part of its request, in the order it sends them.
    pub values: Vec<Vec<usize>>,
    /// Per ps, where its rows arrive.
    pub got: Vec<Vec<f32>>,
    /// What the caller asked for, as it tells (for the landing to check).
    pub asked: u64,
    /// The replies taken so far, one place per ps.
    taken: Vec<Option<Reply>>,
    /// How the round ended, once it did.
    ended: Option<Result<(), PsError>>,
}

impl<C: Comm> Client<'_, C> {
    /// Sends every ps `request(k)` (a pull of rows, `values[k]` floats per part of it;
    /// `asked`: what the caller asked for, as it tells) and returns once the requests are
    /// out; the replies are taken by [`Client::land_ahead`] or by the client's next
    /// round, whichever comes first. Rows asked ahead earlier and never landed are
    /// dropped.
    pub(in crate::train::ps) fn send_ahead(
        &self,
        request: impl Fn(usize) -> Request,
        (values, asked): (Vec<Vec<usize>>, u64),
    ) -> Result<(), PsError> {
        // Rows asked for earlier and never landed are dropped, their buffers kept unless
        // their round failed (receives into them may be in flight).
        self.settle_ahead()?;
        match (self.ahead.take()).map(|old| (matches!(old.ended, Some(Ok(()))), old)) {
            Some((true, old)) => self.keep_rows(*old),
            Some((false, old)) => std::mem::forget(old),
            None => {}
        }
        let mut got = self.take_rows();
        got.resize_with(values.len(), Vec::new);
        for (g, v) in got.iter_mut().zip(&values) {
            // Every value is written before it is read.
            g.resize(v.iter().sum(), 0.0);
        }
        let taken = self.send_round(request, |_| Vec::new(), &mut |k, reply, bytes| {
            self.take_rows_reply(k, &mut places(&values[k], &mut got[k]), reply, bytes)
        });
        match taken {
            Ok(taken) => {
                let ahead = Ahead {
                    values,
                    got,
                    asked,
                    taken,
                    ended: None,
                };
                self.ahead.set(Some(Box::new(ahead)));
                Ok(())
            }
            Err(e) => {
                // Receives into the rows may be in flight.
                std::mem::forget(got);
                Err(e)
            }
        }
    }

    /// Takes every reply of the rows asked ahead, if any are still due: they arrive
    /// before any later reply of the same ps. The error of their round, if it failed
    /// (the next round would only wait on the same ps tasks again).
    pub(super) fn settle_ahead(&self) -> Result<(), PsError> {
        let Some(mut ahead) = self.ahead.take() else {
            return Ok(());
        };
        if ahead.ended.is_none() {
            let taken = std::mem::take(&mut ahead.taken);
            let Ahead { values, got, .. } = &mut *ahead;
            let ended = self.finish_round(taken, &mut |k, reply, bytes| {
                self.take_rows_reply(k, &mut places(&values[k], &mut got[k]), reply, bytes)
            });
            ahead.ended = Some(ended.map(drop));
        }
        let ended = ahead.ended.clone().expect("settled above");
        self.ahead.set(Some(ahead));
        ended
    }

    /// The rows asked ahead, once arrived: per ps its rows' floats per part and the rows.
    /// An error if none were asked for, or if their round failed (its buffers given up:
    /// receives into them may be in flight).
    pub(in crate::train::ps) fn land_ahead(&self) -> Result<Ahead, PsError> {
        // Its error is the landing's, below.
        let _ = self.settle_ahead();
        let Some(mut ahead) = self.ahead.take() else {
            return Err(PsError::Setup(format!(
                "{}: rows landed that were not asked for ahead",
                self.me()
            )));
        };
        match ahead.ended.take().expect("settled above") {
            Ok(()) => Ok(*ahead),
            Err(e) => {
                std::mem::forget(ahead);
                Err(e)
            }
        }
    }

    /// Gives the per-ps buffers of landed rows back for the next pull.
    pub(in crate::train::ps) fn keep_rows(&self, ahead: Ahead) {
        self.give_rows(ahead.got);
    }

    /// Ps `k`'s reply to a pull of rows and its rows into `places` (inline in the reply's
    /// message, or the pieces after it); an error naming the ps if it is not the rows
    /// asked for.
    pub(in crate::train::ps) fn take_rows_reply(
        &self,
        k: usize,
        places: &mut [&mut [f32]],
        reply: &Reply,
        inline_bytes: &[u8],
    ) -> Result<(), PsError> {
        let wrong = |what: String| PsError::Remote {
            task: self.roles.task(self.roles.ps[k]),
            message: what,
        };
        let want: usize = places.iter().map(|p| p.len()).sum();
        if *reply != (Reply::Rows { values: want }) {
            return Err(wrong(format!(
                "answered a pull of {want} values of rows with {reply:?}"
            )));
        }
        match self.take_floats(k, places, inline_bytes)? {
            None => Ok(()),
            Some(Misfit::Inline { sent }) => {
                Err(wrong(format!("sent {sent} values for rows of {want}")))
            }
            Some(Misfit::Piece { want }) => Err(wrong(format!(
                "sent a piece of rows of another length than {want} bytes"
            ))),
        }
    }
}

/// `got` cut into places of `values` floats each, in order.
pub(in crate::train::ps) fn places<'g>(values: &[usize], got: &'g mut [f32]) -> Vec<&'g mut [f32]> {
    let mut rest = got;
    (values.iter())
        .map(|n| {
            let (part, after) = std::mem::take(&mut rest).split_at_mut(*n);
            rest = after;
            part
        })
        .collect()
}

//! Taking a request's payload: from its header's message (small payloads) or as pieces
//! received straight into where they go (the parameters, a worker's staging buffer), or
//! applied piece by piece as they arrive (asynchronous pushes).

use std::time::Instant;

use super::super::protocol::{
    f32_bytes_mut, inline, payload_tag, pieces, read_inline, PIECE_FLOATS,
};
use super::super::store::Store;
use super::super::wire::{receive_all_within, Received};
use super::super::PsError;
use super::requests::Dest;
use super::{apply_all, Server};
use crate::observe::phases::Phase;
use crate::observe::timeline::Detail;
use crate::transport::comm::Comm;

impl<C: Comm> Server<'_, C> {
    /// Takes the payload of worker rank `from`'s request, parts of lengths `lens`, into
    /// `into`: from `inline_bytes` (the header's message) if it is small, else received as
    /// pieces. A payload that does not arrive in time loses the worker; one of the wrong
    /// shape is an error to it (`Ok(Err(message))`).
    pub(super) fn take_payload(
        &mut self,
        from: usize,
        lens: &[usize],
        inline_bytes: &[u8],
        into: Dest,
    ) -> Result<Result<(), String>, PsError> {
        if inline(lens.iter().copied()) {
            return Ok(self.take_inline(lens, inline_bytes, into));
        }
        let (tag, deadline) = (payload_tag(self.comm), self.timeout);
        let received = match into {
            Dest::Params | Dest::Staged(_) | Dest::Rows => {
                let dst = match into {
                    Dest::Staged(w) => {
                        self.staged[w].resize(self.store.len(), 0.0);
                        &mut self.staged[w][..]
                    }
                    Dest::Rows => {
                        self.rows.resize(lens.iter().sum(), 0.0);
                        &mut self.rows[..]
                    }
                    _ => self.store.all_mut(),
                };
                let mut incoming = Vec::new();
                let mut rest = dst;
                for len in lens {
                    let (part, after) = std::mem::take(&mut rest).split_at_mut(*len);
                    rest = after;
                    for piece in part.chunks_mut(PIECE_FLOATS) {
                        incoming.push((f32_bytes_mut(piece), from, tag));
                    }
                }
                let r = receive_all_within(self.comm, &mut incoming, deadline);
                drop(incoming);
                self.kept_alive_unless_done(r)?
            }
            Dest::Apply | Dest::Drop => {
                let apply = matches!(into, Dest::Apply);
                let ts: Vec<u64> = self.slots.iter().map(|s| s.t + 1).collect();
                self.piece.resize(PIECE_FLOATS, 0.0);
                let mut outcome = Received::Done;
                for p in pieces(lens.iter().copied()) {
                    let n = p.range.len();
                    let r = {
                        let mut one = [(f32_bytes_mut(&mut self.piece[..n]), from, tag)];
                        receive_all_within(self.comm, &mut one, deadline)
                    };
                    outcome = self.kept_alive_unless_done(r)?;
                    if outcome != Received::Done {
                        break;
                    }
                    if apply {
                        let t = Instant::now();
                        let at = self.store.range(p.part).start + p.range.start;
                        let param = &mut self.store.all_mut()[at..at + n];
                        let slots = &mut self.slots[p.part];
                        self.opt.apply_part(
                            param,
                            &self.piece[..n],
                            slots,
                            p.range.start,
                            ts[p.part],
                        );
                        let at = Detail::at(self.global_step);
                        self.clock.since_as(Phase::Compute, t, "update", at);
                    }
                }
                if apply && outcome == Received::Done {
                    self.slots.iter_mut().zip(ts).for_each(|(s, t)| s.t = t);
                }
                outcome
            }
        };
        match received {
            Received::Done => Ok(Ok(())),
            Received::TimedOut { from } => Err(self.lose(from)),
            Received::Length { want, .. } => Ok(Err(format!(
                "a payload piece is not the {want} bytes its header declares"
            ))),
        }
    }

    /// [`Server::take_payload`] of a payload that came in its header's message.
    fn take_inline(&mut self, lens: &[usize], bytes: &[u8], into: Dest) -> Result<(), String> {
        let total: usize = lens.iter().sum();
        if bytes.len() != 4 * total {
            return Err(format!(
                "the request carries {} floats where its header declares {total}",
                bytes.len() / 4
            ));
        }
        let dst = match into {
            Dest::Drop => return Ok(()),
            Dest::Params => self.store.all_mut(),
            Dest::Staged(w) => {
                self.staged[w].resize(total, 0.0);
                &mut self.staged[w][..]
            }
            Dest::Apply => {
                self.piece.resize(total, 0.0);
                &mut self.piece[..total]
            }
            Dest::Rows => {
                self.rows.resize(total, 0.0);
                &mut self.rows[..]
            }
        };
        read_inline(bytes, [dst]);
        if let Dest::Apply = into {
            let t = Instant::now();
            apply_all(&self.opt, &mut self.store, &mut self.slots, &self.piece);
            let at = Detail::at(self.global_step);
            self.clock.since_as(Phase::Compute, t, "update", at);
        }
        Ok(())
    }

    /// A receive's outcome; if receives may still be in flight, the memory they write is
    /// kept alive for the rest of the process (this ps stops).
    fn kept_alive_unless_done(
        &mut self,
        r: Result<Received, crate::transport::comm::TransportError>,
    ) -> Result<Received, PsError> {
        // A wrong length completed every receive; a timeout or an error may not have.
        if matches!(r, Ok(Received::TimedOut { .. }) | Err(_)) {
            std::mem::forget(std::mem::replace(&mut self.store, Store::new([])));
            std::mem::forget(std::mem::take(&mut self.staged));
            std::mem::forget(std::mem::take(&mut self.piece));
            std::mem::forget(std::mem::take(&mut self.rows));
        }
        Ok(r?)
    }
}

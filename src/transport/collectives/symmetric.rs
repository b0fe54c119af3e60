//! The allreduce of symmetric memory ([`crate::transport::symmetric`]): made by
//! [`Collectives::symmetric`], found by address by [`Collectives::allreduce`] and
//! [`Collectives::allreduce_into`].
//!
//! Protocol (one chunk number of the shared-memory allreduce, so that its calls and these
//! keep one order and one header check): every rank writes its header (with where its
//! buffers lie) and publishes `arrived`; once all have, the headers are compared (a rank
//! whose buffer is not symmetric, or at another offset, is the same error on every rank);
//! rank `r` then reduces sub-slice `r` of the input, reading it in every rank's region, in
//! the slot algorithm's order (its own first, then every other rank's: the same bits),
//! writes the result into its own output and copies it into every peer's; it publishes
//! `done` and waits until every rank has. Each rank moves its sub-slice's inputs once and
//! its outputs once: no copy through a slot, no copy out of one.

use super::shm::{CallHeader, Counter, Place, ShmAllreduce};
use super::Collectives;
use crate::tensor::DType;
use crate::transport::comm::{Comm, ReduceOp, TransportError};
use crate::transport::reduce::{divide_bytes, reduce_bytes, reduce_into_bytes};
use crate::transport::shm_object;
use crate::transport::symmetric::{Region, Symmetric};
use std::sync::atomic::Ordering;

/// Bytes reduced and copied out at a time: a piece stays in this core's caches between its
/// reduction and its copies to the peers.
const PIECE: usize = 32 << 10;

impl<C: Comm> Collectives<C> {
    /// `len` bytes of symmetric memory on every rank (zeroed, page-aligned), which an
    /// allreduce reduces straight from and into every rank's region. Collective: every
    /// rank asks for the same length (else an error on every rank); `None` where the
    /// ranks span nodes or cannot share memory (plain memory serves there).
    pub fn symmetric(&self, len: usize) -> Result<Option<Symmetric>, TransportError> {
        if self.shm()?.is_none() {
            return Ok(None);
        }
        let me = self.rank();
        let bytes = len.max(1).next_multiple_of(4096);
        let made = shm_object::create("sym", bytes);
        let name = made.as_ref().map_or(String::new(), |(_, n)| n.clone());
        let said = self.allgather_varlen(format!("{len} {name}").as_bytes())?;
        let said: Vec<String> = said
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect();
        let said: Vec<(&str, &str)> = said
            .iter()
            .map(|s| s.split_once(' ').unwrap_or((s, "")))
            .collect();
        // Every rank has said its name: the names go once every rank has mapped them (or
        // at once, if the call ends here).
        let unlink = || (!name.is_empty()).then(|| shm_object::unlink(&name));
        if let Some(r) = said.iter().position(|(l, _)| *l != said[0].0) {
            unlink();
            return Err(TransportError::CallMismatch {
                rank: me,
                peer: r,
                theirs: format!("symmetric memory of {} bytes", said[r].0),
                ours: format!("symmetric memory of {} bytes", said[0].0),
            });
        }
        let mut mine = made.map(|(m, _)| Some(m)).map_err(|e| e.to_string());
        let mut maps = Vec::with_capacity(said.len());
        let mut why = (mine.as_ref().err()).map(|e| format!("making {bytes} bytes: {e}"));
        for (r, (_, name)) in said.iter().enumerate() {
            let map = match (r == me, &mut mine) {
                (true, Ok(m)) => m.take().ok_or_else(|| "taken".to_string()),
                (true, Err(e)) => Err(e.clone()),
                (false, _) if name.is_empty() => Err(format!("rank {r} made none")),
                (false, _) => {
                    shm_object::open(name, bytes).map_err(|e| format!("mapping rank {r}'s: {e}"))
                }
            };
            match map {
                Ok(m) => maps.push(m),
                Err(e) => {
                    why.get_or_insert(e);
                }
            }
        }
        // Every rank has tried every peer's region: the names go, the verdict is shared.
        let verdicts = self.allgather_varlen(why.as_deref().unwrap_or("").as_bytes());
        unlink();
        let verdicts = verdicts?;
        if let Some((r, v)) = verdicts.iter().enumerate().find(|(_, v)| !v.is_empty()) {
            return Err(TransportError::Symmetric {
                rank: me,
                message: format!(
                    "rank {r}: {} (shared memory: /dev/shm)",
                    String::from_utf8_lossy(v)
                ),
            });
        }
        let made = Symmetric::new(Region::new(self.regions.next_id(), me, len, maps));
        self.regions.add(&made);
        Ok(Some(made))
    }

    /// The allreduce of `dst` in place, or of `src` into `dst`, where their bytes lie in
    /// symmetric memory (both, if `src` is given); `None` where they do not.
    pub(super) fn symmetric_call(
        &self,
        shm: &ShmAllreduce,
        src: Option<&[u8]>,
        dst: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Option<Result<(), TransportError>> {
        let (out, at) = self.regions.find(dst.as_ptr(), dst.len())?;
        let input = match src {
            Some(s) => Some(self.regions.find(s.as_ptr(), s.len())?),
            None => None,
        };
        let from = input.as_ref().map(|(region, at)| Place { region, at: *at });
        let to = Place { region: &out, at };
        Some(shm.allreduce_symmetric(from, to, dst.len(), dtype, op))
    }
}

impl ShmAllreduce {
    /// The allreduce of `len` bytes at `from` (every rank's) into `to` (every rank's), or
    /// of `to` in place: see the module.
    pub(super) fn allreduce_symmetric(
        &self,
        from: Option<Place<'_>>,
        to: Place<'_>,
        len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), TransportError> {
        let (n, me, es) = (self.size(), self.rank(), dtype.size());
        let g = self.next_chunk();
        let header = CallHeader {
            bytes: len as u64,
            dtype,
            op,
            places: [from.map_or(0, |p| p.code()), to.code()],
        };
        self.arrive(g, &header)?;
        self.wait_all(Counter::Arrived, g + 1)?;
        if let Err(e) = self.check_headers(g) {
            return self.abandon(g, e);
        }
        // The slot algorithm's cut and order, so that the bits are its bits: in each chunk
        // this rank reduces its sub-slice, its own input first and then every other rank's
        // (the one-step protocol: in rank order).
        let (chunk_bytes, direct) = self.cut(len, es);
        let order: Vec<usize> = match direct {
            true => (0..n).collect(),
            false => std::iter::once(me)
                .chain((0..n).filter(|&r| r != me))
                .collect(),
        };
        let input = from.unwrap_or(to);
        // The result is made in this rank's own output, except in place when the order
        // does not start with this rank (its input, still needed, is there): then in the
        // accumulator.
        let in_acc = from.is_none() && order.first() != Some(&me);
        let mut scratch = self.scratch(if in_acc { PIECE } else { 0 });
        for off in (0..len).step_by(chunk_bytes.max(1)) {
            let elems = chunk_bytes.min(len - off) / es;
            let own = off + (me * elems / n) * es..off + ((me + 1) * elems / n) * es;
            for piece in own.clone().step_by(PIECE) {
                let l = PIECE.min(own.end - piece);
                // SAFETY: every rank's input is whole (it arrived, acquired above) and
                // nobody writes `piece..piece + l` of any output but this rank until every
                // rank is done; the headers say every rank's buffers lie at these offsets
                // of these regions, within them; an input and an output apart (into) or
                // the same (in place); the accumulator is this rank's own.
                unsafe {
                    let at = |p: Place<'_>, r: usize| p.region.ptr(r).add(p.at + piece);
                    let read = |r: usize| std::slice::from_raw_parts(at(input, r), l);
                    let acc = match in_acc {
                        true => &mut scratch.as_mut_slice()[..l],
                        false => std::slice::from_raw_parts_mut(at(to, me), l),
                    };
                    let mut rest = order.iter().copied();
                    match (from.is_some() || in_acc, rest.next(), rest.next()) {
                        // In place from this rank's own: it is there already.
                        (false, _, Some(b)) => reduce_bytes(dtype, op, acc, read(b)),
                        (true, Some(a), Some(b)) => {
                            reduce_into_bytes(dtype, op, acc, read(a), read(b))
                        }
                        (true, Some(a), None) => acc.copy_from_slice(read(a)),
                        _ => {}
                    }
                    for r in rest {
                        reduce_bytes(dtype, op, acc, read(r));
                    }
                    if op == ReduceOp::Average && n > 1 {
                        divide_bytes(dtype, acc, n);
                    }
                    for r in (0..n).filter(|&r| in_acc || r != me) {
                        std::ptr::copy_nonoverlapping(acc.as_ptr(), at(to, r), l);
                    }
                }
            }
        }
        self.counter(me, Counter::Done)
            .store(g + 1, Ordering::Release);
        self.finish(g);
        // Peers still write into this rank's output until they are done.
        self.wait_all(Counter::Done, g + 1)
    }
}

#[cfg(test)]
mod tests;

//! The ring allreduce: reduce-scatter then allgather around a ring of ranks, each step's
//! chunk in segments reduced as they arrive while the next are in flight; chunk boundaries
//! `i * len / n`, so any length works.

use super::{chunk, disjoint, tag, Collectives};
use crate::tensor::DType;
use crate::transport::comm::{sendrecv, Comm, ReduceOp, TransportError};
use crate::transport::reduce::reduce_bytes;
use crate::transport::tags::Reserved;

impl<C: Comm> Collectives<C> {
    pub(super) fn ring(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), TransportError> {
        let (n, r, es) = (self.size(), self.rank(), dtype.size());
        if n == 1 {
            return Ok(());
        }
        let elems = buf.len() / es;
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let seg = (self.tuning.segment_bytes / es).max(1) * es;
        let max_chunk = chunk(0, n, elems, es).len() + es;
        let mut scratch = self.scratch(max_chunk);
        let c = &self.comm;
        let ring_tag = tag(c, Reserved::Ring);
        // Reduce-scatter: after n-1 steps rank r holds the full reduction of chunk r+1.
        for s in 0..n - 1 {
            let send_c = chunk((r + n - s) % n, n, elems, es);
            let recv_c = chunk((r + n - s - 1) % n, n, elems, es);
            let incoming = &mut scratch.as_mut_slice()[..recv_c.len()];
            let segs_in: Vec<(usize, usize)> = (0..recv_c.len())
                .step_by(seg)
                .map(|o| (o, seg.min(recv_c.len() - o)))
                .collect();
            let mut recvs = Vec::with_capacity(segs_in.len());
            for (o, l) in &segs_in {
                // SAFETY: each segment is a disjoint part of `incoming`, not touched until
                // its request is waited on below; all requests are waited on.
                recvs.push(unsafe { c.irecv(incoming.as_mut_ptr().add(*o), *l, left, ring_tag)? });
            }
            let mut sends = Vec::new();
            for o in (0..send_c.len()).step_by(seg) {
                let l = seg.min(send_c.len() - o);
                // SAFETY: the send chunk is disjoint from the receive chunk being reduced
                // (different chunk indices) and is not modified before the sends complete.
                sends.push(unsafe {
                    c.isend(buf.as_ptr().add(send_c.start + o), l, right, ring_tag)?
                });
            }
            for ((o, l), req) in segs_in.iter().zip(recvs) {
                c.wait(req)?;
                let dst = &mut buf[recv_c.start + o..recv_c.start + o + l];
                reduce_bytes(dtype, op, dst, &incoming[*o..o + l]);
            }
            for s in sends {
                c.wait(s)?;
            }
        }
        // Allgather of the reduced chunks, straight into place.
        for s in 0..n - 1 {
            let send_c = chunk((r + 1 + n - s) % n, n, elems, es);
            let recv_c = chunk((r + n - s) % n, n, elems, es);
            let (sb, rb) = disjoint(buf, send_c, recv_c);
            sendrecv(c, sb, right, rb, left, ring_tag)?;
        }
        Ok(())
    }
}

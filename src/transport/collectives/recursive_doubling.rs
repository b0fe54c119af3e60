//! The recursive-doubling allreduce: log2(n) exchanges of the whole buffer, best for small
//! tensors; ranks beyond the largest power of two fold into a partner first and get the
//! result back at the end.

use super::{tag, Collectives};
use crate::tensor::DType;
use crate::transport::comm::{recv, send, sendrecv, Comm, ReduceOp, TransportError};
use crate::transport::reduce::reduce_bytes;
use crate::transport::tags::Reserved;

impl<C: Comm> Collectives<C> {
    pub(super) fn recursive_doubling(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), TransportError> {
        let (n, r) = (self.size(), self.rank());
        if n == 1 {
            return Ok(());
        }
        let c = &self.comm;
        let p = 1 << (usize::BITS - 1 - n.leading_zeros()); // largest power of two <= n
        let rem = n - p;
        let mut scratch = self.scratch(buf.len());
        let tmp = &mut scratch.as_mut_slice()[..buf.len()];
        // Fold: among the first 2*rem ranks, evens hand their data to the next odd rank.
        let vrank = if r < 2 * rem {
            if r % 2 == 0 {
                send(c, buf, r + 1, tag(c, Reserved::RecursiveDoubling))?;
                None
            } else {
                recv(c, tmp, r - 1, tag(c, Reserved::RecursiveDoubling))?;
                reduce_bytes(dtype, op, buf, tmp);
                Some(r / 2)
            }
        } else {
            Some(r - rem)
        };
        if let Some(v) = vrank {
            let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
            let mut mask = 1;
            while mask < p {
                let partner = real(v ^ mask);
                sendrecv(
                    c,
                    buf,
                    partner,
                    tmp,
                    partner,
                    tag(c, Reserved::RecursiveDoubling),
                )?;
                reduce_bytes(dtype, op, buf, tmp);
                mask <<= 1;
            }
        }
        // Unfold: odd ranks give the result back to their even partner.
        if r < 2 * rem {
            if r % 2 == 0 {
                recv(c, buf, r + 1, tag(c, Reserved::RecursiveDoubling))?;
            } else {
                send(c, buf, r - 1, tag(c, Reserved::RecursiveDoubling))?;
            }
        }
        Ok(())
    }
}

//! Sends that own their tensor: for a sender that keeps many sends in flight and reuses
//! their tensors as they complete (a pipeline stage's activations: it sends, computes and
//! sends again before its neighbour received), where a borrowed tensor would have to
//! outlive a pool that holds it.

use super::{check_link, P2pError};
use crate::tensor::Tensor;
use crate::transport::comm::Comm;

/// A send in flight that holds its tensor; [`OwnedSend::test`] or [`OwnedSend::wait`] give
/// the tensor back once the send completed.
///
/// Dropping one that has not completed waits for nothing: the tensor and the request are
/// kept for the rest of the process (a sender dropped on an error, whose peer may be gone,
/// must neither hang nor free memory MPI may still read).
pub struct OwnedSend<'c, C: Comm> {
    comm: &'c C,
    req: Option<C::Request>,
    tensor: Option<Tensor>,
}

/// Starts sending `t` to rank `dst` on `tag`, on the link of (`dst`, `tag`) as
/// [`super::immediate_send`] does (its header only when it says something new, through a
/// ring in shared memory where the link has one).
pub fn immediate_send_owned<C: Comm>(
    c: &C,
    t: Tensor,
    dst: usize,
    tag: i32,
) -> Result<OwnedSend<'_, C>, P2pError> {
    check_link(c, dst, tag)?;
    let links = c.links();
    let bytes = links.outgoing(&t, dst, tag);
    let (ptr, len) = (bytes.as_ptr(), bytes.len());
    if links.rings.put(c, bytes, dst, tag)? {
        return Ok(OwnedSend {
            comm: c,
            req: None,
            tensor: Some(t),
        });
    }
    // SAFETY: the bytes lie in the tensor's heap buffer, which moving the tensor does not
    // move; the tensor moves into the returned value and is released only once the request
    // completed (`test`, `wait`) or never (`Drop`).
    let req = unsafe { c.isend(ptr, len, dst, tag)? };
    Ok(OwnedSend {
        comm: c,
        req: Some(req),
        tensor: Some(t),
    })
}

impl<C: Comm> OwnedSend<'_, C> {
    /// The tensor, if the send completed (`MPI_Test`); `None`: still in flight.
    pub fn test(&mut self) -> Result<Option<Tensor>, P2pError> {
        if let Some(req) = self.req.as_mut() {
            if self.comm.test(req)?.is_none() {
                return Ok(None);
            }
            self.req = None;
        }
        Ok(self.tensor.take())
    }

    /// Waits for the send to complete and gives the tensor back.
    pub fn wait(mut self) -> Result<Tensor, P2pError> {
        if let Some(req) = self.req.take() {
            if let Err(e) = self.comm.wait(req) {
                // The request is done with, as MPI says after an error; the tensor goes.
                return Err(e.into());
            }
        }
        Ok(self.tensor.take().expect("taken only by test or wait"))
    }
}

impl<C: Comm> Drop for OwnedSend<'_, C> {
    fn drop(&mut self) {
        if let Some(mut req) = self.req.take() {
            if !matches!(self.comm.test(&mut req), Ok(Some(_))) {
                std::mem::forget(req);
                std::mem::forget(self.tensor.take());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;
    use crate::transport::local::LocalComm;
    use crate::transport::p2p::receive_into;

    fn f32s(n: usize, v: f32) -> Tensor {
        let data = vec![v; n];
        Tensor::from_slice(&[n], &data).unwrap().named("acts")
    }

    #[test]
    fn owned_sends_arrive_in_order_and_give_their_tensors_back() {
        LocalComm::run(2, |c| {
            if c.rank() == 0 {
                let mut flight: Vec<_> = (0..5)
                    .map(|i| {
                        immediate_send_owned(&c, f32s(3 + i % 2, i as f32), 1, 5)
                            .ok()
                            .unwrap()
                    })
                    .collect();
                let back: Vec<Tensor> = flight.drain(..).map(|s| s.wait().unwrap()).collect();
                assert_eq!(back[4].as_slice::<f32>().unwrap(), &[4.0; 3]);
            } else {
                for i in 0..5usize {
                    let mut t = Tensor::zeros(DType::F32, &[3 + i % 2])
                        .unwrap()
                        .named("acts");
                    receive_into(&c, &mut t, 0, 5).unwrap();
                    assert!(t.as_slice::<f32>().unwrap().iter().all(|v| *v == i as f32));
                }
            }
        });
    }

    #[test]
    fn a_send_to_no_rank_is_refused() {
        LocalComm::run(2, |c| {
            let e = immediate_send_owned(&c, f32s(2, 1.0), 7, 5).err().unwrap();
            assert!(e.to_string().contains("out of range"), "{e}");
        });
    }
}

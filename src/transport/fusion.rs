//! Fused allreduce of a list of named tensors (gradients), with negotiation.
//!
//! Negotiation: before reducing, ranks agree that they submitted the same list (names,
//! dtypes, shapes, order, op). Cheaply: one tiny allreduce of a 64-bit hash of the list
//! (max of `h` and of `!h`: equal everywhere only if all hashes are equal). Only on a
//! mismatch are the full lists gathered, and every rank returns the same error naming the
//! first rank and position that differ, instead of the hang other tools are known for.
//!
//! Fusion: tensors of one dtype are packed, in order, into a fusion buffer of at most
//! `threshold_bytes` (default 64 MiB, like Horovod) and reduced as one message
//! ([`Collectives::allreduce_parts`]: the shared-memory algorithm streams straight from and
//! into the tensors, the others pack them into one buffer kept between calls). A tensor
//! larger than the threshold is reduced in place on its own.

use super::collectives::{Algorithm, Collectives};
use super::comm::{Comm, ReduceOp, TransportError};
use crate::tensor::{AlignedBuf, DType, Tensor};

/// Errors from a fused allreduce.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FusionError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("allreduce mismatch: rank {rank} submitted {theirs} where rank 0 submitted {ours} (position {position})")]
    Mismatch {
        rank: usize,
        position: usize,
        theirs: String,
        ours: String,
    },
}

/// Fusion settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusionConfig {
    pub threshold_bytes: usize,
    pub algorithm: Algorithm,
}

impl Default for FusionConfig {
    fn default() -> Self {
        FusionConfig {
            threshold_bytes: 64 << 20,
            algorithm: Algorithm::Auto,
        }
    }
}

/// What one fused allreduce did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FusionStats {
    /// Allreduce calls issued (fused buffers plus oversized tensors).
    pub messages: usize,
    pub bytes: usize,
}

/// Fused allreduce with reusable buffers.
#[derive(Default)]
pub struct Fusion {
    pub config: FusionConfig,
}

/// One entry of the negotiated list per tensor (after the op), as text for messages.
fn signature(op: ReduceOp, tensors: &[&mut Tensor]) -> Vec<String> {
    std::iter::once(format!("op {op:?}"))
        .chain(tensors.iter().map(|t| t.describe()))
        .collect()
}

/// The hash ranks compare: of the op and every tensor's [`Tensor::signature`].
fn signature_hash(op: ReduceOp, tensors: &[&mut Tensor]) -> u64 {
    let op_text = format!("op {op:?}");
    tensors
        .iter()
        .fold(crate::hash::fnv1a(op_text.as_bytes()), |h, t| {
            crate::hash::fnv1a_from(h, &t.signature().to_le_bytes())
        })
}

/// A hash of a list given as text (for callers that keep their list as text).
pub fn list_hash(entries: &[String]) -> u64 {
    crate::hash::fnv1a(entries.join("\n").as_bytes())
}

/// Collective: Ok if every rank submitted the same list (equal `hash`es); otherwise the
/// same error on all, from the lists `entries` makes (called only on a mismatch).
pub fn negotiate<C: Comm>(
    coll: &Collectives<C>,
    h: u64,
    entries: impl FnOnce() -> Vec<String>,
) -> Result<(), FusionError> {
    let mut probe = AlignedBuf::zeroed(16);
    probe.as_mut_slice()[..8].copy_from_slice(&(h as i64).to_le_bytes());
    probe.as_mut_slice()[8..16].copy_from_slice(&(!h as i64).to_le_bytes());
    coll.allreduce(
        &mut probe.as_mut_slice()[..16],
        DType::I64,
        ReduceOp::Max,
        Algorithm::Auto,
    )?;
    let max_h = i64::from_le_bytes(probe.as_slice()[..8].try_into().expect("8 bytes")) as u64;
    let max_not_h = i64::from_le_bytes(probe.as_slice()[8..16].try_into().expect("8 bytes")) as u64;
    // With hashes read as signed integers: if any two differ, every rank sees it. A rank
    // holding the maximum h sees max(!h) = !min(h) != !h; any other rank sees max(h) != h.
    if max_h == h && max_not_h == !h {
        return Ok(());
    }
    let joined = entries().join("\n");
    let lists: Vec<Vec<String>> = coll
        .allgather_varlen(joined.as_bytes())?
        .into_iter()
        .map(|b| {
            String::from_utf8_lossy(&b)
                .split('\n')
                .map(str::to_string)
                .collect()
        })
        .collect();
    for (rank, list) in lists.iter().enumerate().skip(1) {
        let ours = &lists[0];
        let n = ours.len().max(list.len());
        for position in 0..n {
            let (o, t) = (ours.get(position), list.get(position));
            if o != t {
                let show = |x: Option<&String>| {
                    x.cloned()
                        .unwrap_or_else(|| "nothing (its list ended)".into())
                };
                return Err(FusionError::Mismatch {
                    rank,
                    // Position 0 is the op; tensors count from 1 in the list, from 0 here.
                    position: position.saturating_sub(1),
                    theirs: show(t),
                    ours: show(o),
                });
            }
        }
    }
    unreachable!("a rank disagreed, so some list differs from rank 0's")
}

impl Fusion {
    pub fn new(config: FusionConfig) -> Self {
        Fusion { config }
    }

    /// Negotiates, then allreduces every tensor in place.
    pub fn allreduce<C: Comm>(
        &mut self,
        coll: &Collectives<C>,
        tensors: &mut [&mut Tensor],
        op: ReduceOp,
    ) -> Result<FusionStats, FusionError> {
        negotiate(coll, signature_hash(op, tensors), || signature(op, tensors))?;
        self.allreduce_unchecked(coll, tensors, op)
    }

    /// Allreduces without negotiation (the caller guarantees identical lists).
    pub fn allreduce_unchecked<C: Comm>(
        &mut self,
        coll: &Collectives<C>,
        tensors: &mut [&mut Tensor],
        op: ReduceOp,
    ) -> Result<FusionStats, FusionError> {
        let algo = self.config.algorithm;
        let limit = self.config.threshold_bytes.max(1);
        let mut stats = FusionStats::default();
        let mut i = 0;
        while i < tensors.len() {
            let dtype = tensors[i].dtype();
            if tensors[i].nbytes() > limit {
                coll.allreduce_tensor(tensors[i], op, algo)?;
                stats.messages += 1;
                stats.bytes += tensors[i].nbytes();
                i += 1;
                continue;
            }
            // The longest run from i of one dtype that fits the threshold.
            let (mut j, mut bytes) = (i, 0);
            while j < tensors.len()
                && tensors[j].dtype() == dtype
                && bytes + tensors[j].nbytes() <= limit
            {
                bytes += tensors[j].nbytes();
                j += 1;
            }
            let mut parts: Vec<&mut [u8]> =
                tensors[i..j].iter_mut().map(|t| t.bytes_mut()).collect();
            coll.allreduce_parts(&mut parts, dtype, op, algo)?;
            stats.messages += 1;
            stats.bytes += bytes;
            i = j;
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::super::local::LocalComm;
    use super::*;

    fn grads(rank: usize, names: &[&str]) -> Vec<Tensor> {
        names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let len = 3 + i * 5;
                let v: Vec<f32> = (0..len).map(|k| (rank * 100 + i * 10 + k) as f32).collect();
                Tensor::from_slice(&[len], &v).unwrap().named(n)
            })
            .collect()
    }

    #[test]
    fn fused_equals_one_by_one_and_respects_the_threshold() {
        let names = ["l1/w", "l1/b", "l2/w", "l2/b", "l3/w"];
        let out = LocalComm::run(3, |c| {
            let coll = Collectives::new(c);
            let mut fused = grads(coll.rank(), &names);
            let mut refs: Vec<&mut Tensor> = fused.iter_mut().collect();
            // 40 bytes: forces several buffers, and l3/w (23 floats = 92 B) goes alone.
            let mut f = Fusion::new(FusionConfig {
                threshold_bytes: 40 * 4,
                algorithm: Algorithm::Ring,
            });
            let stats = f.allreduce(&coll, &mut refs, ReduceOp::Average).unwrap();
            let mut single = grads(coll.rank(), &names);
            for t in single.iter_mut() {
                coll.allreduce_tensor(t, ReduceOp::Average, Algorithm::Ring)
                    .unwrap();
            }
            let a: Vec<Vec<f32>> = fused
                .iter()
                .map(|t| t.as_slice::<f32>().unwrap().to_vec())
                .collect();
            let b: Vec<Vec<f32>> = single
                .iter()
                .map(|t| t.as_slice::<f32>().unwrap().to_vec())
                .collect();
            (a, b, stats)
        });
        for (a, b, stats) in &out {
            assert_eq!(a, b);
            assert_eq!(a, &out[0].0);
            assert!(
                stats.messages >= 2 && stats.messages < names.len(),
                "{stats:?}"
            );
        }
        // Average of rank*100 + ... over ranks 0,1,2 adds 100 to rank 0's values.
        assert_eq!(out[0].0[0], vec![100., 101., 102.]);
    }

    #[test]
    fn a_rank_with_another_list_stops_every_rank_with_the_same_error() {
        let out = LocalComm::run(3, |c| {
            let coll = Collectives::new(c);
            let names: Vec<&str> = if coll.rank() == 2 {
                vec!["a", "c", "b"]
            } else {
                vec!["a", "b", "c"]
            };
            let mut g = grads(0, &names);
            let mut refs: Vec<&mut Tensor> = g.iter_mut().collect();
            Fusion::default()
                .allreduce(&coll, &mut refs, ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        assert!(out.iter().all(|e| e == &out[0]));
        assert_eq!(
            out[0],
            "allreduce mismatch: rank 2 submitted 'c' f32[8] where rank 0 submitted 'b' f32[8] (position 1)"
        );
        let short = LocalComm::run(2, |c| {
            let coll = Collectives::new(c);
            let names: Vec<&str> = if coll.rank() == 1 {
                vec!["a"]
            } else {
                vec!["a", "b"]
            };
            let mut g = grads(0, &names);
            let mut refs: Vec<&mut Tensor> = g.iter_mut().collect();
            Fusion::default()
                .allreduce(&coll, &mut refs, ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        assert_eq!(
            short[0],
            "allreduce mismatch: rank 1 submitted nothing (its list ended) where rank 0 submitted 'b' f32[8] (position 1)"
        );
    }
}

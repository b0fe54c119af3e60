//! How a step's gradients are summed over the replicas, and with them each replica's word
//! on the step (its loss, a non-finite loss, a stop request): one reduction per step.

use std::ops::Range;
use std::time::Instant;

use super::AllreduceError;
use crate::model::towers::Towers;
use crate::model::Replica;
use crate::observe::stall::{self, Wait};
use crate::observe::timeline::{self, Detail};
use crate::tensor::{DType, Tensor};
use crate::transport::fusion::{Fusion, FusionConfig, FusionStats};
use crate::transport::{Collectives, Comm, ReduceOp, TransportError};

/// What every replica says about a step, summed over the replicas in the same reduction as
/// the gradients (no message of its own): the sample-weighted loss and the samples, how
/// many replicas saw a NaN and an infinite loss, how many were asked to stop and the sum of
/// their signal numbers. After the sum every replica holds the same verdict. Kept in f32,
/// the gradients' dtype, so it packs into their fusion buffer: the counts are exact far
/// beyond any replica count, the loss sum is for reporting.
pub(super) struct Verdict {
    tensor: Tensor,
    /// The signal this replica was sent, told with its next step.
    pub(super) signal: Option<i32>,
    /// The step the verdict is of (the timeline's spans name it).
    pub(super) step: u64,
}

impl Verdict {
    pub(super) fn new() -> Verdict {
        Verdict {
            tensor: Tensor::zeros(DType::F32, &[6])
                .expect("1-D")
                .named("step verdict"),
            signal: None,
            step: 0,
        }
    }

    /// This replica's word: its loss over its `n` samples, and the signal it was sent.
    fn fill(&mut self, loss: f32, n: f32) {
        let (finite, signal) = (loss.is_finite(), self.signal);
        self.tensor
            .as_mut_slice::<f32>()
            .expect("f32")
            .copy_from_slice(&[
                if finite { loss * n } else { 0.0 },
                n,
                f32::from(u8::from(loss.is_nan())),
                f32::from(u8::from(loss.is_infinite())),
                f32::from(u8::from(signal.is_some())),
                signal.unwrap_or(0) as f32,
            ]);
    }

    fn values(&self) -> &[f32] {
        self.tensor.as_slice::<f32>().expect("f32")
    }

    /// The global batch's loss (sample-weighted over the replicas that saw a finite one).
    pub(super) fn loss(&self) -> f32 {
        let v = self.values();
        v[0] / v[1].max(1.0)
    }

    /// How many replicas saw a NaN loss, and how many an infinite one.
    pub(super) fn non_finite(&self) -> (usize, usize) {
        let v = self.values();
        (v[2] as usize, v[3] as usize)
    }

    /// The signal that stops the job after this step, if any replica was sent one. Named by
    /// the signal only: one sent to every rank can reach them on either side of a step.
    pub(super) fn stop(&self) -> Option<i32> {
        let v = self.values();
        (v[4] > 0.0).then(|| (v[5] / v[4]).round() as i32)
    }
}

/// Where a bucket sent to the communication thread goes back: a range of the gradients, or
/// the step's verdict.
type Slot = Option<Range<usize>>;

/// How a step's gradients are summed over the replicas.
pub(super) enum Reducer<'s> {
    /// After the backward pass, as one fused allreduce.
    Fused(Fusion),
    /// During the backward pass: each group of gradients the model reports ready (a
    /// layer's, last layer first) goes to a communication thread with its own
    /// communicator as soon as they are final; the verdict follows the last group.
    Overlapped {
        to_comm: std::sync::mpsc::Sender<(Slot, Tensor)>,
        from_comm: std::sync::mpsc::Receiver<(Slot, Result<Tensor, TransportError>)>,
        signature: Vec<String>,
        /// Its hash, computed once: the list is the same at every step.
        signature_hash: u64,
        _thread: std::thread::ScopedJoinHandle<'s, ()>,
    },
}

impl<'s> Reducer<'s> {
    pub(super) fn new<'e, C: Comm + Send + 's>(
        scope: &'s std::thread::Scope<'s, 'e>,
        comm: Option<C>,
        model: &Replica<'_>,
        fusion: FusionConfig,
    ) -> Reducer<'s> {
        let Some(comm) = comm else {
            return Reducer::Fused(Fusion::new(fusion));
        };
        let (to_comm, requests) = std::sync::mpsc::channel::<(Slot, Tensor)>();
        let (results, from_comm) = std::sync::mpsc::channel();
        let thread = scope.spawn(move || {
            let coll = Collectives::new(comm);
            // Ends when the training loop drops its sender.
            while let Ok((slot, mut bucket)) = requests.recv() {
                let r = coll
                    .allreduce_tensor(&mut bucket, ReduceOp::Sum, fusion.algorithm)
                    .map(|_| bucket);
                if results.send((slot, r)).is_err() {
                    break;
                }
            }
        });
        let signature: Vec<String> = std::iter::once("op Sum (layer buckets)".to_string())
            .chain(model.params.iter().map(Tensor::describe))
            .chain(std::iter::once(Verdict::new().tensor.describe()))
            .collect();
        Reducer::Overlapped {
            to_comm,
            from_comm,
            signature_hash: crate::transport::fusion::list_hash(&signature),
            signature,
            _thread: thread,
        }
    }

    /// Computes this replica's gradients on its samples `x`, `y` (scaled by their count),
    /// fills its word in `verdict` (`verdict`'s signal is set by the caller), and sums both
    /// over the replicas into `grads` and `verdict`; returns the seconds spent waiting on
    /// the sum, and what the sum took. `what` names the gradients (a stall report's).
    pub(super) fn step<C: Comm>(
        &mut self,
        coll: &Collectives<C>,
        (model, towers): (&Replica<'_>, &mut Towers),
        what: &std::sync::Arc<str>,
        (x, y): (&[f32], &[u8]),
        grads: &mut [Tensor],
        verdict: &mut Verdict,
    ) -> Result<(f64, FusionStats), AllreduceError> {
        let (n, step) = (y.len() as f32, verdict.step);
        let start = Instant::now();
        // The timeline's peer of each allreduce (made only when it records).
        let replicas = || -> std::sync::Arc<str> { format!("{} replicas", coll.size()).into() };
        let setup = |e: crate::model::ModelError| AllreduceError::Setup(e.to_string());
        let waiting = |bytes: usize| {
            let what = what.clone();
            move || Wait {
                op: "allreduce",
                step,
                what: Some(what),
                peer: None,
                bytes: bytes as u64,
            }
        };
        match self {
            Reducer::Fused(fusion) => {
                let loss = towers.gradients_into(model, x, y, grads).map_err(setup)?;
                for g in grads.iter_mut() {
                    g.as_mut_slice::<f32>()
                        .expect("f32")
                        .iter_mut()
                        .for_each(|v| *v *= n);
                }
                verdict.fill(loss, n);
                let mut refs: Vec<&mut Tensor> = grads.iter_mut().collect();
                refs.push(&mut verdict.tensor);
                let t = Instant::now();
                timeline::span("gradients", "compute", start, t, Detail::at(step));
                let bytes = refs.iter().map(|g| g.nbytes()).sum();
                let _wait = stall::wait(waiting(bytes));
                let stats = fusion.allreduce(coll, &mut refs, ReduceOp::Sum)?;
                let end = Instant::now();
                if timeline::enabled() {
                    let moved = Detail::moved(step, stats.bytes, &replicas());
                    timeline::span("allreduce", "comm", t, end, moved);
                }
                Ok(((end - t).as_secs_f64(), stats))
            }
            Reducer::Overlapped {
                to_comm,
                from_comm,
                signature,
                signature_hash,
                ..
            } => {
                // Same negotiation as the fused path: every replica, the same list (a wait
                // for the slowest replica, as the fused path's allreduce is).
                let bytes =
                    grads.iter().map(Tensor::nbytes).sum::<usize>() + verdict.tensor.nbytes();
                {
                    let _wait = stall::wait(waiting(bytes));
                    crate::transport::fusion::negotiate(coll, *signature_hash, || {
                        signature.clone()
                    })?;
                }
                let mut sent = 0;
                let loss = towers
                    .gradients_with(model, x, y, grads, &mut |range, g| {
                        let data: Vec<f32> = g[range.clone()]
                            .iter()
                            .flat_map(|t| t.as_slice::<f32>().expect("f32"))
                            .map(|v| v * n)
                            .collect();
                        let bucket = Tensor::from_slice(&[data.len()], &data)
                            .expect("1-D")
                            .named(&format!("grads{}..{}", range.start, range.end));
                        sent += usize::from(to_comm.send((Some(range), bucket)).is_ok());
                    })
                    .map_err(setup)?;
                verdict.fill(loss, n);
                sent += usize::from(to_comm.send((None, verdict.tensor.clone())).is_ok());
                let t = Instant::now();
                // The layers' allreduces ran on the communication thread during the
                // backward pass: what is left is waiting for the last of them.
                timeline::span("gradients", "compute", start, t, Detail::at(step));
                let _wait = stall::wait(waiting(bytes));
                let mut stats = FusionStats::default();
                for _ in 0..sent {
                    let (slot, r) = from_comm.recv().map_err(|_| {
                        AllreduceError::Setup("communication thread stopped".into())
                    })?;
                    let bucket = r?;
                    stats.messages += 1;
                    stats.bytes += bucket.nbytes();
                    let Some(range) = slot else {
                        verdict.tensor = bucket;
                        continue;
                    };
                    let mut summed = bucket.as_slice::<f32>().expect("f32");
                    for g in &mut grads[range] {
                        let (mine, rest) = summed.split_at(g.numel());
                        g.as_mut_slice::<f32>().expect("f32").copy_from_slice(mine);
                        summed = rest;
                    }
                }
                let end = Instant::now();
                if timeline::enabled() {
                    let moved = Detail::moved(step, stats.bytes, &replicas());
                    timeline::span("allreduce wait", "comm", t, end, moved);
                }
                Ok(((end - t).as_secs_f64(), stats))
            }
        }
    }
}

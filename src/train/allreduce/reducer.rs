//! How a step's gradients are summed over the replicas, and with them each replica's word
//! on the step ([`StepWord`]: its loss, a non-finite loss, a stop request): one reduction
//! per step.

use std::ops::Range;
use std::time::Instant;

use crate::model::towers::Towers;
use crate::model::{Replica, Targets};
use crate::observe::stall::{self, Wait};
use crate::observe::timeline::{self, Detail};
use crate::tensor::Tensor;
use crate::train::engine::{StepWord, TrainError};
use crate::transport::fusion::{Fusion, FusionConfig, FusionStats};
use crate::transport::{Collectives, Comm, ReduceOp, TransportError};

/// Where a bucket sent to the communication thread goes back: a range of the gradients, or
/// the step's word.
type Slot = Option<Range<usize>>;

/// How a step's gradients are summed over the replicas.
pub(super) enum Reducer {
    /// After the backward pass, as one fused allreduce.
    Fused(Fusion),
    /// During the backward pass: each group of gradients the model reports ready (a
    /// layer's, last layer first) goes to a communication thread with its own
    /// communicator as soon as they are final; the word follows the last group.
    Overlapped(Overlapped),
}

/// The communication thread of the overlapped path, joined when dropped.
pub(super) struct Overlapped {
    to_comm: Option<std::sync::mpsc::Sender<(Slot, Tensor)>>,
    from_comm: std::sync::mpsc::Receiver<(Slot, Result<Tensor, TransportError>)>,
    signature: Vec<String>,
    /// Its hash, computed once: the list is the same at every step.
    signature_hash: u64,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Overlapped {
    fn drop(&mut self) {
        // The thread ends when its requests end; its communicator goes with it, before
        // the training communicator it was split from.
        self.to_comm.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Reducer {
    pub(super) fn new<C: Comm + Send + 'static>(
        comm: Option<C>,
        model: &Replica<'_>,
        fusion: FusionConfig,
    ) -> Reducer {
        let Some(comm) = comm else {
            return Reducer::Fused(Fusion::new(fusion));
        };
        let (to_comm, requests) = std::sync::mpsc::channel::<(Slot, Tensor)>();
        let (results, from_comm) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
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
            .chain(std::iter::once(StepWord::default().to_tensor().describe()))
            .collect();
        Reducer::Overlapped(Overlapped {
            to_comm: Some(to_comm),
            from_comm,
            signature_hash: crate::transport::fusion::list_hash(&signature),
            signature,
            thread: Some(thread),
        })
    }

    /// Computes this replica's gradients on its samples `x`, `y` (scaled by their count),
    /// adds its loss to `word` (this replica's word on step `step`), and sums both over
    /// the replicas into `grads` and `word`; returns the seconds spent waiting on the sum,
    /// and what the sum took. `what` names the gradients (a stall report's).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step<C: Comm>(
        &mut self,
        coll: &Collectives<C>,
        (model, towers): (&Replica<'_>, &mut Towers),
        what: &std::sync::Arc<str>,
        (x, y): (&[f32], Targets<'_>),
        grads: &mut [Tensor],
        step: u64,
        word: &mut StepWord,
    ) -> Result<(f64, FusionStats), TrainError> {
        let rows = y.rows(model.model.classes());
        let n = rows as f32;
        let start = Instant::now();
        // The timeline's peer of each allreduce (made only when it records).
        let replicas = || -> std::sync::Arc<str> { format!("{} replicas", coll.size()).into() };
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
                // A replica whose gradients fail still takes part, with zeros and a word
                // saying so: every replica stops at this step, none waits.
                let computed = towers.gradients_into(model, x, y, grads);
                for g in grads.iter_mut() {
                    let g = g.as_mut_slice::<f32>().expect("f32");
                    match computed {
                        Ok(_) => g.iter_mut().for_each(|v| *v *= n),
                        Err(_) => g.fill(0.0),
                    }
                }
                let mut said = match &computed {
                    Ok(loss) => word.with_loss(*loss, rows),
                    Err(_) => word.failing(),
                }
                .to_tensor();
                let mut refs: Vec<&mut Tensor> = grads.iter_mut().collect();
                refs.push(&mut said);
                let t = Instant::now();
                timeline::span("gradients", "compute", start, t, Detail::at(step));
                let bytes = refs.iter().map(|g| g.nbytes()).sum();
                let _wait = stall::wait(waiting(bytes));
                let stats = fusion.allreduce(coll, &mut refs, ReduceOp::Sum)?;
                *word = StepWord::from_tensor(&said);
                if word.failed() > 0 {
                    return Err(failed_step(coll, step, word, computed.map_err(Into::into)));
                }
                computed?;
                let end = Instant::now();
                if timeline::enabled() {
                    let moved = Detail::moved(step, stats.bytes, &replicas());
                    timeline::span("allreduce", "comm", t, end, moved);
                }
                Ok(((end - t).as_secs_f64(), stats))
            }
            Reducer::Overlapped(o) => {
                let Overlapped {
                    to_comm,
                    from_comm,
                    signature,
                    signature_hash,
                    ..
                } = o;
                let to_comm = to_comm.as_ref().expect("sender kept until dropped");
                // Same negotiation as the fused path: every replica, the same list (a wait
                // for the slowest replica, as the fused path's allreduce is).
                let bytes = grads.iter().map(Tensor::nbytes).sum::<usize>() + 4 * StepWord::LEN;
                {
                    let _wait = stall::wait(waiting(bytes));
                    crate::transport::fusion::negotiate(coll, *signature_hash, || {
                        signature.clone()
                    })?;
                }
                let mut sent = 0;
                let loss = towers.gradients_with(model, x, y, grads, &mut |range, g| {
                    let data: Vec<f32> = g[range.clone()]
                        .iter()
                        .flat_map(|t| t.as_slice::<f32>().expect("f32"))
                        .map(|v| v * n)
                        .collect();
                    let bucket = Tensor::from_slice(&[data.len()], &data)
                        .expect("1-D")
                        .named(&format!("grads{}..{}", range.start, range.end));
                    sent += usize::from(to_comm.send((Some(range), bucket)).is_ok());
                })?;
                let said = word.with_loss(loss, rows).to_tensor();
                sent += usize::from(to_comm.send((None, said)).is_ok());
                let t = Instant::now();
                // The layers' allreduces ran on the communication thread during the
                // backward pass: what is left is waiting for the last of them.
                timeline::span("gradients", "compute", start, t, Detail::at(step));
                let _wait = stall::wait(waiting(bytes));
                let stats = collect(from_comm, sent, grads, word)?;
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

/// The error of a step that failed on `word.failed()` replicas, this one's outcome
/// `computed`: its own error where it failed; elsewhere the agreed line with the first
/// failing replica's reason, which every replica learns here (collective: every replica
/// calls it, as they all read the same word).
fn failed_step<C: Comm>(
    coll: &Collectives<C>,
    step: u64,
    word: &StepWord,
    computed: Result<f32, TrainError>,
) -> TrainError {
    let mine = computed.as_ref().err().map(ToString::to_string);
    let all = coll.allgather_varlen(mine.as_deref().unwrap_or("").as_bytes());
    let (failed, size) = (word.failed(), coll.size());
    match (computed, all) {
        (Err(e), _) => e,
        (Ok(_), Err(e)) => e.into(),
        (Ok(_), Ok(all)) => {
            let first = all.iter().enumerate().find(|(_, m)| !m.is_empty());
            let why = first.map_or(String::new(), |(r, m)| {
                format!("; replica {r}: {}", String::from_utf8_lossy(m))
            });
            TrainError::Agreed(format!(
                "step {step} failed on {failed} of {size} replicas{why}"
            ))
        }
    }
}

/// The `sent` sums the communication thread sends back: each bucket into its range of
/// `grads`, the word into `word`; what they took.
fn collect(
    from_comm: &std::sync::mpsc::Receiver<(Slot, Result<Tensor, TransportError>)>,
    sent: usize,
    grads: &mut [Tensor],
    word: &mut StepWord,
) -> Result<FusionStats, TrainError> {
    let mut stats = FusionStats::default();
    for _ in 0..sent {
        let (slot, r) = from_comm
            .recv()
            .map_err(|_| TrainError::Setup("communication thread stopped".into()))?;
        let bucket = r?;
        stats.messages += 1;
        stats.bytes += bucket.nbytes();
        let Some(range) = slot else {
            *word = StepWord::from_tensor(&bucket);
            continue;
        };
        let mut summed = bucket.as_slice::<f32>().expect("f32");
        for g in &mut grads[range] {
            let (mine, rest) = summed.split_at(g.numel());
            g.as_mut_slice::<f32>().expect("f32").copy_from_slice(mine);
            summed = rest;
        }
    }
    Ok(stats)
}

//! One stage of a [`Sequential`] model: a contiguous range of its layers, the parameters
//! of those layers alone, and the activations of the micro-batches in flight.
//!
//! A stage runs a micro-batch forward from its input (the data on the first stage, the
//! previous stage's output on the others) and keeps what the backward pass needs; the
//! last stage turns its output (the logits) into the loss and its gradient. The backward
//! pass of a micro-batch starts from the gradient of the stage's output and adds the
//! parameter gradients into the step's sums, leaving the gradient of the stage's input
//! for the previous stage. Gradients are summed over samples (the loss gradient is scaled
//! by the micro-batch's size): divided by the global batch after the step's reduction,
//! they are exactly the combined batch's mean gradient.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::kernels;
use crate::model::sequential::Scratch;
use crate::model::towers::share;
use crate::model::{zeros_like, Model, ModelError, Part, Replica, Sequential, Targets};
use crate::named::Named;
use crate::rng::Rng;
use crate::tensor::Tensor;
use crate::train::optim::Optimizer;
use crate::train::resources::{self, Need};

/// A micro-batch between its forward and its backward pass.
#[derive(Default)]
struct Pass {
    /// The stage's input (kept: its first layer's backward pass reads it).
    input: Vec<f32>,
    n: usize,
    /// Each tower's activations, of its rows ([`share`]); one tower: all of them.
    acts: Vec<Scratch>,
    /// With several towers: their outputs, the output's gradient and the input's
    /// gradient, side by side (one tower keeps them in its activations).
    out: Vec<f32>,
    dy: Vec<f32>,
    dx: Vec<f32>,
}

impl Pass {
    fn bytes(&self) -> usize {
        let sides = self.out.capacity() + self.dy.capacity() + self.dx.capacity();
        4 * (self.input.capacity() + sides) + self.acts.iter().map(Scratch::bytes).sum::<usize>()
    }

    fn output(&self) -> &[f32] {
        match self.acts.as_slice() {
            [one] => one.output(),
            _ => &self.out,
        }
    }

    /// Where the output's gradient goes, `len` values.
    fn output_gradient_mut(&mut self, len: usize) -> &mut [f32] {
        match self.acts.as_mut_slice() {
            [one] => one.gradient_mut(len),
            _ => crate::model::layers::sized(&mut self.dy, len),
        }
    }
}

/// Waits for every thread of `handles`, the first error first.
fn joined<'s>(
    handles: Vec<std::thread::ScopedJoinHandle<'s, Result<(), ModelError>>>,
) -> Result<(), ModelError> {
    let results: Vec<Result<(), ModelError>> = handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        .collect();
    results.into_iter().collect()
}

/// One stage of a model split into `stages`.
pub struct Stage<'m> {
    model: &'m Sequential,
    index: usize,
    /// Every stage's layers.
    partition: Vec<Range<usize>>,
    layers: Range<usize>,
    /// This stage's parameters as a range of the model's.
    params_range: Range<usize>,
    /// This stage's parameters (the model's, in `params_range`), of its part of the model.
    pub replica: Replica<'m>,
    /// The step's gradient sums, shaped like `params`.
    pub grads: Vec<Tensor>,
    /// Each tower's gradients of one micro-batch, before they are added to `grads`.
    scratch: Vec<Vec<Tensor>>,
    /// Threads sharing each micro-batch's rows ([`crate::model::towers`]).
    towers: usize,
    /// Micro-batches started, not yet finished, by number.
    in_flight: BTreeMap<usize, Pass>,
    spare: Vec<Pass>,
    /// Micro-batches whose backward pass ran this step.
    summed: usize,
    /// The most activation bytes held at once since [`Stage::take_peak_bytes`].
    peak_bytes: usize,
}

impl std::fmt::Debug for Stage<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("index", &self.index)
            .field("stages", &self.partition.len())
            .field("layers", &self.layers)
            .field("params", &self.params_range)
            .finish()
    }
}

/// The initial values of the parameters `keep` of `model`, drawn as
/// [`crate::model::initial_values`] draws all of them from `seed` (so every stage holds
/// exactly its part of the values local training starts from), without holding the rest.
fn initial_part(model: &dyn Model, seed: u64, keep: Range<usize>) -> Vec<Tensor> {
    let specs = model.parameters();
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(keep.len());
    for (i, s) in specs.iter().enumerate() {
        let one = crate::model::draw_values(s, &mut rng);
        if keep.contains(&i) {
            out.push(one);
        }
    }
    out
}

impl<'m> Stage<'m> {
    /// Stage `index` of `ranges` (contiguous layer ranges covering the model, as
    /// [`super::balance`] gives), holding `part` (the model's layers `ranges[index]`), with
    /// its part of the initial values from `seed`.
    pub fn new(
        part: &'m Part<'m>,
        ranges: &[Range<usize>],
        index: usize,
        seed: u64,
    ) -> Result<Stage<'m>, ModelError> {
        let model = part.whole();
        let bad = |why: String| ModelError::Shape {
            model: model.describe(),
            why,
        };
        let covers = ranges.first().map(|r| r.start) == Some(0)
            && ranges.last().map(|r| r.end) == Some(model.num_layers())
            && ranges.windows(2).all(|w| w[0].end == w[1].start)
            && ranges.iter().all(|r| !r.is_empty());
        if !covers {
            return Err(bad(format!(
                "stages {ranges:?} do not cover its {} layers in order",
                model.num_layers()
            )));
        }
        let Some(layers) = ranges.get(index).cloned() else {
            return Err(bad(format!("no stage {index} of {}", ranges.len())));
        };
        if layers != part.layers() {
            return Err(bad(format!(
                "stage {index} holds layers {layers:?}, not the part's {:?}",
                part.layers()
            )));
        }
        let params_range = model.param_range(layers.clone());
        let params = initial_part(model, seed, params_range.clone());
        Ok(Stage {
            model,
            index,
            partition: ranges.to_vec(),
            layers,
            grads: zeros_like(&params),
            scratch: Vec::new(),
            towers: 1,
            params_range,
            replica: Replica {
                model: part,
                params,
            },
            in_flight: BTreeMap::new(),
            spare: Vec::new(),
            summed: 0,
            peak_bytes: 0,
        })
    }

    /// What this stage holds in training, before it allocates: its parameters, their
    /// gradient sums and each tower's, the optimizer's state, and `in_flight` micro-batches
    /// of `rows` samples (their inputs, activations and outgoing copies).
    pub fn need(&self, rows: usize, in_flight: usize, opt: &Optimizer) -> Need {
        let p = self.param_bytes() as u64;
        let per_sample = self.model.activations_of(self.layers.clone())
            + self.input_width()
            + self.output_width();
        let activations = 4 * (per_sample * rows * in_flight) as u64;
        Need {
            parts: vec![
                ("parameters".into(), p),
                ("gradients".into(), p * (1 + self.towers as u64)),
                (
                    format!("{} state", opt.kind.name()),
                    p * resources::slots(opt),
                ),
                ("activations".into(), activations),
            ],
        }
    }

    /// This stage with `k` towers: each micro-batch's rows shared by `k` threads.
    pub fn with_towers(mut self, k: usize) -> Self {
        self.towers = k.max(1);
        self
    }

    pub fn index(&self) -> usize {
        self.index
    }

    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    pub fn is_last(&self) -> bool {
        self.index + 1 == self.partition.len()
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.partition.len()
    }

    /// Every stage's layers.
    pub fn partition(&self) -> &[Range<usize>] {
        &self.partition
    }

    /// The model's layers this stage runs.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// This stage's parameters as a range of the model's ([`Model::parameters`]).
    pub fn param_range(&self) -> Range<usize> {
        self.params_range.clone()
    }

    /// Values of one sample's input (the previous stage's output).
    pub fn input_width(&self) -> usize {
        self.model.shape_at(self.layers.start).iter().product()
    }

    /// Values of one sample's output (the logits on the last stage).
    pub fn output_width(&self) -> usize {
        self.model.shape_at(self.layers.end).iter().product()
    }

    /// Bytes of parameters this stage holds.
    pub fn param_bytes(&self) -> usize {
        self.replica.params.iter().map(Tensor::nbytes).sum()
    }

    /// The most bytes of activations held at once since the last call (micro-batches in
    /// flight with their inputs), then starts counting again.
    pub fn take_peak_bytes(&mut self) -> usize {
        std::mem::take(&mut self.peak_bytes)
    }

    /// Starts micro-batch `mb` of `n` samples: runs the stage forward on `input` (taken:
    /// it is kept for the backward pass) and returns the output.
    pub fn forward(&mut self, mb: usize, input: Vec<f32>, n: usize) -> Result<&[f32], ModelError> {
        let want = n * self.input_width();
        if input.len() != want {
            return Err(ModelError::Shape {
                model: self.model.describe(),
                why: format!(
                    "stage {} takes {want} values for {n} samples, got {}",
                    self.index,
                    input.len()
                ),
            });
        }
        let mut pass = self.spare.pop().unwrap_or_default();
        pass.input = input;
        pass.n = n;
        let k = self.towers.min(n).max(1);
        pass.acts.resize_with(k, Scratch::default);
        let (model, params, win) = (self.model, &self.replica.params, self.input_width());
        if k == 1 {
            model.forward_layers(
                self.layers.clone(),
                params,
                &pass.input,
                n,
                &mut pass.acts[0],
            )?;
        } else {
            let input = &pass.input;
            std::thread::scope(|s| {
                let handles = pass
                    .acts
                    .iter_mut()
                    .enumerate()
                    .map(|(t, act)| {
                        let (rows, layers) = (share(n, t, k), self.layers.clone());
                        let x = &input[rows.start * win..rows.end * win];
                        s.spawn(move || model.forward_layers(layers, params, x, rows.len(), act))
                    })
                    .collect();
                joined(handles)
            })?;
            pass.out.clear();
            for act in &pass.acts {
                pass.out.extend_from_slice(act.output());
            }
        }
        self.in_flight.insert(mb, pass);
        let held: usize = self.in_flight.values().map(Pass::bytes).sum();
        self.peak_bytes = self.peak_bytes.max(held);
        Ok(self.in_flight[&mb].output())
    }

    /// A spare input buffer of `len` values for the next [`Stage::forward`] (receive the
    /// previous stage's output into it).
    pub fn input_buffer(&mut self, len: usize) -> Vec<f32> {
        let mut v = self
            .spare
            .last_mut()
            .map(|p| std::mem::take(&mut p.input))
            .unwrap_or_default();
        v.resize(len, 0.0);
        v
    }

    fn pass(&mut self, mb: usize) -> Result<&mut Pass, ModelError> {
        let model = self.model.describe();
        let index = self.index;
        self.in_flight
            .get_mut(&mb)
            .ok_or_else(|| ModelError::Shape {
                model,
                why: format!("stage {index}: micro-batch {mb} has not run forward"),
            })
    }

    /// On the last stage: the mean loss of micro-batch `mb` against `labels`, and the
    /// gradient of its output (the logits) for the backward pass, summed over samples.
    pub fn loss<'y>(&mut self, mb: usize, y: impl Into<Targets<'y>>) -> Result<f32, ModelError> {
        let y = y.into();
        let classes = self.output_width();
        y.check(self.model)?;
        let model = self.model.describe();
        let pass = self.pass(mb)?;
        if y.rows(classes) != pass.n {
            return Err(ModelError::Shape {
                model,
                why: format!("targets of {} samples for {}", y.rows(classes), pass.n),
            });
        }
        let n = pass.n;
        let logits = pass.output().to_vec();
        let delta = pass.output_gradient_mut(n * classes);
        let loss = y.loss(&logits, classes, delta);
        delta.iter_mut().for_each(|v| *v *= n as f32);
        Ok(loss)
    }

    /// Where the gradient of micro-batch `mb`'s output goes before its backward pass (on
    /// every stage but the last: receive the next stage's input gradient into it).
    pub fn output_gradient_mut(&mut self, mb: usize) -> Result<&mut [f32], ModelError> {
        let width = self.output_width();
        let pass = self.pass(mb)?;
        let len = pass.n * width;
        Ok(pass.output_gradient_mut(len))
    }

    /// The backward pass of micro-batch `mb`: its parameter gradients added into
    /// [`Stage::grads`]; returns the gradient of its input (empty on the first stage),
    /// valid until the next call.
    pub fn backward(&mut self, mb: usize) -> Result<&[f32], ModelError> {
        let mut pass = match self.in_flight.remove(&mb) {
            Some(p) => p,
            None => return Err(self.pass(mb).err().expect("not in flight")),
        };
        let first = self.summed == 0;
        let input_gradient = !self.is_first();
        let (n, k) = (pass.n, pass.acts.len());
        let (model, params) = (self.model, &self.replica.params);
        let (win, wout) = (self.input_width(), self.output_width());
        if self.scratch.len() < k {
            self.scratch
                .resize_with(k, || crate::model::zeros_like(params));
        }
        if k == 1 {
            // The step's first micro-batch writes the sums; the others are added.
            let into = if first {
                &mut self.grads
            } else {
                &mut self.scratch[0]
            };
            let (input, act) = (&pass.input, &mut pass.acts[0]);
            model.backward_layers(
                self.layers.clone(),
                params,
                input,
                n,
                into,
                &mut |_, _| {},
                input_gradient,
                act,
            )?;
        } else {
            let (input, dy) = (&pass.input, &pass.dy);
            std::thread::scope(|s| {
                let handles = pass
                    .acts
                    .iter_mut()
                    .zip(self.scratch.iter_mut())
                    .enumerate()
                    .map(|(t, (act, g))| {
                        let (rows, layers) = (share(n, t, k), self.layers.clone());
                        let x = &input[rows.start * win..rows.end * win];
                        act.gradient_mut(rows.len() * wout)
                            .copy_from_slice(&dy[rows.start * wout..rows.end * wout]);
                        s.spawn(move || {
                            let ready = &mut |_, _: &[Tensor]| {};
                            model.backward_layers(
                                layers,
                                params,
                                x,
                                rows.len(),
                                g,
                                ready,
                                input_gradient,
                                act,
                            )
                        })
                    })
                    .collect();
                joined(handles)
            })?;
            pass.dx.clear();
            if input_gradient {
                for (t, act) in pass.acts.iter().enumerate() {
                    pass.dx
                        .extend_from_slice(&act.gradient()[..share(n, t, k).len() * win]);
                }
            }
        }
        // Every tower's gradients into the sums (one tower's first micro-batch is there).
        for (t, tower) in self.scratch.iter().enumerate().take(k) {
            if k == 1 && first {
                break;
            }
            for (g, s) in self.grads.iter_mut().zip(tower) {
                let (g, s) = (g.as_mut_slice::<f32>()?, s.as_slice::<f32>()?);
                if first && t == 0 {
                    g.copy_from_slice(s);
                } else {
                    kernels::axpy(1.0, s, g)?;
                }
            }
        }
        self.summed += 1;
        let len = if self.is_first() { 0 } else { n * win };
        self.spare.push(pass);
        let pass = self.spare.last().expect("pushed");
        Ok(match pass.acts.as_slice() {
            [one] => &one.gradient()[..len],
            _ => &pass.dx[..len],
        })
    }

    /// Output of `n` samples `input` with no backward pass to follow (evaluation).
    pub fn infer(&mut self, input: &[f32], n: usize) -> Result<Vec<f32>, ModelError> {
        let mut pass = self.spare.pop().unwrap_or_default();
        pass.acts.resize_with(1, Scratch::default);
        let done = self.model.forward_layers(
            self.layers.clone(),
            &self.replica.params,
            input,
            n,
            &mut pass.acts[0],
        );
        let out = pass.acts[0].output().to_vec();
        self.spare.push(pass);
        done.map(|()| out)
    }

    /// Ends the step's backward passes: the next one starts new sums. Errors if a
    /// micro-batch is still in flight.
    pub fn finish_step(&mut self) -> Result<(), ModelError> {
        if let Some(mb) = self.in_flight.keys().next() {
            return Err(ModelError::Shape {
                model: self.model.describe(),
                why: format!(
                    "stage {}: micro-batch {mb} ran forward but not backward",
                    self.index
                ),
            });
        }
        if self.summed == 0 {
            for g in &mut self.grads {
                g.as_mut_slice::<f32>()?.fill(0.0);
            }
        }
        self.summed = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests;

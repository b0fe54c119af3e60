//! A model that is a stack of [`Layer`]s ending in softmax cross-entropy, and the two
//! built-in ones: [`mlp`] and [`cnn`].
//!
//! Parameters are named by the layer that owns them, counting only layers with
//! parameters: `layer0/w`, `layer0/b`, `layer1/w`, ... (so ps placement and gradient
//! fusion address them by name).

use std::ops::Range;
use std::sync::Mutex;

use super::layers::{sized, Backward, Conv2d, Dense, Flatten, Layer, MaxPool2d, Relu, Saved};
use super::{Model, ModelError, ParamSpec, Targets};
use crate::tensor::Tensor;

/// Layers applied in order; the last one's output is the logits.
pub struct Sequential {
    name: String,
    input: Vec<usize>,
    layers: Vec<Box<dyn Layer>>,
    /// `shapes[i]` is layer `i`'s input shape; the last is the logits' shape.
    shapes: Vec<Vec<usize>>,
    /// Each layer's parameters, as a range of [`Model::parameters`].
    ranges: Vec<Range<usize>>,
    specs: Vec<ParamSpec>,
    /// Buffers of finished passes, taken by the next (one per concurrent caller).
    spare: Mutex<Vec<Scratch>>,
}

/// One pass's buffers: every layer's output and saved values, and the running gradient.
/// Kept between steps, so a step allocates nothing once they have grown to the batch.
#[derive(Default)]
pub(crate) struct Scratch {
    outs: Vec<Vec<f32>>,
    saved: Vec<Saved>,
    delta: Vec<f32>,
    dx: Vec<f32>,
}

impl Scratch {
    /// The last layer's output of the last forward pass.
    pub(crate) fn output(&self) -> &[f32] {
        self.outs.last().map_or(&[], Vec::as_slice)
    }

    /// The running gradient as `len` values: set it to the output's gradient before a
    /// backward pass; after one that asked for it, it holds the input's.
    pub(crate) fn gradient_mut(&mut self, len: usize) -> &mut [f32] {
        sized(&mut self.delta, len)
    }

    /// The running gradient.
    pub(crate) fn gradient(&self) -> &[f32] {
        &self.delta
    }

    /// Bytes held (allocated) by the buffers: the activations one pass keeps.
    pub(crate) fn bytes(&self) -> usize {
        let saved: usize = self
            .saved
            .iter()
            .map(|s| match s {
                Saved::Nothing => 0,
                Saved::Workspace(w) => 4 * w.capacity(),
                Saved::Argmax(a) => 4 * a.capacity(),
            })
            .sum();
        let outs: usize = self.outs.iter().map(|o| 4 * o.capacity()).sum();
        saved + outs + 4 * (self.delta.capacity() + self.dx.capacity())
    }
}

impl Sequential {
    /// A model called `name` of `layers` over samples of `input` shape. Refuses layers
    /// whose shapes do not chain, or a last layer that is not flat.
    pub fn new(
        name: &str,
        input: &[usize],
        layers: Vec<Box<dyn Layer>>,
    ) -> Result<Sequential, ModelError> {
        let bad = |why: String| ModelError::Shape {
            model: name.to_string(),
            why,
        };
        if input.is_empty() || input.contains(&0) {
            return Err(bad(format!("input shape {input:?} is empty")));
        }
        let mut shapes = vec![input.to_vec()];
        let (mut ranges, mut specs) = (Vec::new(), Vec::new());
        for (i, l) in layers.iter().enumerate() {
            let at = shapes.last().expect("input");
            let out = l
                .output_shape(at)
                .map_err(|e| bad(format!("layer {i} ({}): {e}", l.describe())))?;
            let start = specs.len();
            let own = l.params(at);
            let k = ranges
                .iter()
                .filter(|r: &&Range<usize>| !r.is_empty())
                .count();
            for (short, shape, init) in own {
                specs.push(ParamSpec::new(&format!("layer{k}/{short}"), &shape, init));
            }
            ranges.push(start..specs.len());
            shapes.push(out);
        }
        match shapes.last().map(Vec::as_slice) {
            Some([c]) if *c > 0 && !layers.is_empty() => {}
            last => {
                return Err(bad(format!(
                    "the last layer must give one flat row of logits, not {last:?}"
                )))
            }
        }
        Ok(Sequential {
            name: name.to_string(),
            input: input.to_vec(),
            layers,
            shapes,
            ranges,
            specs,
            spare: Mutex::new(Vec::new()),
        })
    }

    /// Spare buffers, or new ones.
    fn take_scratch(&self) -> Scratch {
        let spare = self.spare.lock().unwrap_or_else(|e| e.into_inner()).pop();
        spare.unwrap_or_default()
    }

    fn give_back(&self, s: Scratch) {
        self.spare.lock().unwrap_or_else(|e| e.into_inner()).push(s);
    }

    /// The output of the layers `layers` (their parameters `params`) on `rows` samples
    /// `x`.
    fn output_of(
        &self,
        layers: Range<usize>,
        params: &[Tensor],
        x: &[f32],
        rows: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let mut s = self.take_scratch();
        let done = self.forward_layers(layers, params, x, rows, &mut s);
        let out = s.outs.last().cloned().unwrap_or_default();
        self.give_back(s);
        done.map(|()| out)
    }

    /// Runs the layers of `layers` forward on `n` samples `x` (the first one's input):
    /// their outputs into `s.outs` (the last layer's last), what each saves into
    /// `s.saved`. `params` are those layers' parameters, from the first one's
    /// ([`Self::param_range`]).
    pub(crate) fn forward_layers(
        &self,
        layers: Range<usize>,
        params: &[Tensor],
        x: &[f32],
        n: usize,
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        s.outs.resize_with(layers.len(), Vec::new);
        s.saved.resize_with(layers.len(), Saved::default);
        let base = self.ranges[layers.start].start;
        for (j, i) in layers.enumerate() {
            let r = &self.ranges[i];
            let p = slices(&params[r.start - base..r.end - base])?;
            let (before, rest) = s.outs.split_at_mut(j);
            let input = if j == 0 { x } else { &before[j - 1] };
            self.layers[i].forward_into(
                &p,
                &self.shapes[i],
                input,
                n,
                &mut rest[0],
                &mut s.saved[j],
            )?;
        }
        Ok(())
    }

    /// The backward pass of the layers of `layers` (last first) after
    /// [`Self::forward_layers`] on the same `x`, from the gradient of their output in
    /// `s.delta`: their parameter gradients written into `grads` (aligned like `params`),
    /// `ready` called as each layer's are, and with `input_gradient` the gradient of `x`
    /// left in `s.delta`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward_layers(
        &self,
        layers: Range<usize>,
        params: &[Tensor],
        x: &[f32],
        n: usize,
        grads: &mut [Tensor],
        ready: &mut dyn FnMut(Range<usize>, &[Tensor]),
        input_gradient: bool,
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        let base = self.ranges[layers.start].start;
        let first = layers.start;
        for (j, i) in layers.enumerate().rev() {
            let range = self.ranges[i].start - base..self.ranges[i].end - base;
            let p = slices(&params[range.clone()])?;
            {
                let mut g: Vec<&mut [f32]> = grads[range.clone()]
                    .iter_mut()
                    .map(|t| t.as_mut_slice::<f32>())
                    .collect::<Result<_, _>>()?;
                self.layers[i].backward_into(
                    &p,
                    &self.shapes[i],
                    Backward {
                        x: if j == 0 { x } else { &s.outs[j - 1] },
                        y: &s.outs[j],
                        saved: &mut s.saved[j],
                        n,
                        dy: &s.delta,
                    },
                    &mut g,
                    (i > first || input_gradient).then_some(&mut s.dx),
                )?;
            }
            if !range.is_empty() {
                ready(range, grads);
            }
            std::mem::swap(&mut s.delta, &mut s.dx);
        }
        Ok(())
    }

    /// The loss of the layers `layers` (the last of which gives the logits) and their
    /// gradients, in spare buffers: the forward pass, the loss, and the backward pass layer
    /// by layer (last first), calling `ready` as each layer's parameter gradients are
    /// written. [`Model::loss_and_gradients`] of the whole model and of a [`Part`] holding
    /// its last layer.
    fn loss_of(
        &self,
        layers: Range<usize>,
        params: &[Tensor],
        x: &[f32],
        y: Targets<'_>,
        grads: &mut [Tensor],
        ready: &mut dyn FnMut(Range<usize>, &[Tensor]),
    ) -> Result<f32, ModelError> {
        let classes = self.classes();
        let n = y.rows(classes);
        let mut s = self.take_scratch();
        let passes = |s: &mut Scratch| -> Result<f32, ModelError> {
            self.forward_layers(layers.clone(), params, x, n, s)?;
            let delta = sized(&mut s.delta, n * classes);
            let loss = y.loss(s.outs.last().expect("logits"), classes, delta);
            self.backward_layers(layers, params, x, n, grads, ready, false, s)?;
            Ok(loss)
        };
        let loss = passes(&mut s);
        self.give_back(s);
        loss
    }

    /// The layers `layers` (contiguous, not empty) as a model of their own: a pipeline
    /// stage's part ([`Part`]).
    pub fn part(&self, layers: Range<usize>) -> Result<Part<'_>, ModelError> {
        if layers.is_empty() || layers.end > self.layers.len() {
            return Err(ModelError::Shape {
                model: self.name.clone(),
                why: format!(
                    "layers {layers:?} are not a part of its {} layers",
                    self.layers.len()
                ),
            });
        }
        Ok(Part {
            params: self.param_range(layers.clone()),
            layers,
            model: self,
        })
    }
}

impl Sequential {
    /// Each layer's counted cost per sample, in multiply-adds: its parameters' elements
    /// times the positions they apply at (each output pixel of a convolution, once for a
    /// dense layer), plus one per input element (ReLU, pooling, copies). What
    /// [`crate::pipeline::balance`] splits into stages.
    pub fn layer_costs(&self) -> Vec<f64> {
        self.ranges
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let weights: usize = self.specs[r.clone()].iter().map(ParamSpec::numel).sum();
                let positions = match self.shapes[i + 1][..] {
                    [h, w, _] => h * w,
                    _ => 1,
                };
                let input: usize = self.shapes[i].iter().product();
                (weights * positions + input) as f64
            })
            .collect()
    }

    /// Each layer's parameter bytes (f32): what `--max-param-bytes` bounds per stage.
    pub fn layer_param_bytes(&self) -> Vec<u64> {
        self.ranges
            .iter()
            .map(|r| {
                4 * self.specs[r.clone()]
                    .iter()
                    .map(ParamSpec::numel)
                    .sum::<usize>() as u64
            })
            .collect()
    }

    /// Values a training pass of the layers `layers` keeps per sample: each layer's output
    /// and saved values (about its output's size), and the running gradient and input
    /// gradient (the widest of their inputs and outputs, twice).
    pub fn activations_of(&self, layers: Range<usize>) -> usize {
        let sizes = self.shapes[layers.start + 1..=layers.end]
            .iter()
            .map(|s| s.iter().product::<usize>());
        let widest = self.shapes[layers.start..=layers.end]
            .iter()
            .map(|s| s.iter().product())
            .max()
            .unwrap_or(0);
        2 * sizes.sum::<usize>() + 2 * widest
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The parameters of the layers of `layers`, as a range of [`Model::parameters`].
    pub fn param_range(&self, layers: Range<usize>) -> Range<usize> {
        match (self.ranges.get(layers.start), layers.end.checked_sub(1)) {
            (Some(first), Some(last)) if last >= layers.start => first.start..self.ranges[last].end,
            _ => 0..0,
        }
    }

    /// The shape of one sample's input to layer `i` (`i` = the number of layers: the
    /// logits').
    pub fn shape_at(&self, i: usize) -> &[usize] {
        &self.shapes[i]
    }

    /// Layer `i`'s description (`dense 128`).
    pub fn layer_describe(&self, i: usize) -> Option<String> {
        self.layers.get(i).map(|l| l.describe())
    }
}

fn slices(ts: &[Tensor]) -> Result<Vec<&[f32]>, ModelError> {
    ts.iter()
        .map(|t| t.as_slice::<f32>().map_err(ModelError::from))
        .collect()
}

impl Model for Sequential {
    fn describe(&self) -> String {
        let layers: Vec<String> = self.layers.iter().map(|l| l.describe()).collect();
        format!(
            "{}: input {}, {}",
            self.name,
            self.input
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join("x"),
            layers.join(", ")
        )
    }

    fn input_shape(&self) -> Vec<usize> {
        self.input.clone()
    }

    /// Each layer's output and saved values (about its output's size), and the running
    /// gradient and input gradient (the widest layer's, twice).
    fn activations_per_sample(&self) -> usize {
        self.activations_of(0..self.layers.len())
    }

    fn classes(&self) -> usize {
        self.shapes.last().expect("checked in new")[0]
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }

    fn logits(&self, params: &[Tensor], x: &[f32], rows: usize) -> Result<Vec<f32>, ModelError> {
        self.output_of(0..self.layers.len(), params, x, rows)
    }

    fn loss_and_gradients(
        &self,
        params: &[Tensor],
        x: &[f32],
        y: Targets<'_>,
        grads: &mut [Tensor],
        ready: &mut dyn FnMut(Range<usize>, &[Tensor]),
    ) -> Result<f32, ModelError> {
        y.check(self)?;
        self.loss_of(0..self.layers.len(), params, x, y, grads, ready)
    }
}

/// Some contiguous layers of a [`Sequential`] as a model of their own (what a pipeline
/// stage holds): their input is the first one's, their output the last one's, their
/// parameters those of the whole model's they own (by the same names). Its output is the
/// model's logits only where it holds the last layer; only then does it have a loss.
#[derive(Clone)]
pub struct Part<'m> {
    model: &'m Sequential,
    layers: Range<usize>,
    params: Range<usize>,
}

impl std::fmt::Debug for Part<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl<'m> Part<'m> {
    /// The whole model.
    pub fn whole(&self) -> &'m Sequential {
        self.model
    }

    /// The model's layers it holds.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// True if it holds the model's last layer (its output is the logits).
    pub fn is_last(&self) -> bool {
        self.layers.end == self.model.layers.len()
    }
}

impl Model for Part<'_> {
    fn describe(&self) -> String {
        let (a, b) = (self.layers.start, self.layers.end);
        format!("layers {a}..{b} of {}", self.model.describe())
    }

    fn input_shape(&self) -> Vec<usize> {
        self.model.shapes[self.layers.start].clone()
    }

    fn activations_per_sample(&self) -> usize {
        self.model.activations_of(self.layers.clone())
    }

    /// The width of its output (the logits' where it holds the last layer).
    fn classes(&self) -> usize {
        self.model.shapes[self.layers.end].iter().product()
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        self.model.specs[self.params.clone()].to_vec()
    }

    /// Its output: the logits where it holds the last layer, else its activations.
    fn logits(&self, params: &[Tensor], x: &[f32], rows: usize) -> Result<Vec<f32>, ModelError> {
        self.model.output_of(self.layers.clone(), params, x, rows)
    }

    fn loss_and_gradients(
        &self,
        params: &[Tensor],
        x: &[f32],
        y: Targets<'_>,
        grads: &mut [Tensor],
        ready: &mut dyn FnMut(Range<usize>, &[Tensor]),
    ) -> Result<f32, ModelError> {
        if !self.is_last() {
            return Err(ModelError::Shape {
                model: self.describe(),
                why: "its output is activations for the next layers, not logits: it has no loss of its own".into(),
            });
        }
        y.check(self)?;
        let layers = self.layers.clone();
        self.model.loss_of(layers, params, x, y, grads, ready)
    }
}

/// A multilayer perceptron: dense layers of `hidden` widths with ReLU between them, and a
/// dense layer of `classes` logits.
pub fn mlp(features: usize, hidden: &[usize], classes: usize) -> Result<Sequential, ModelError> {
    let mut layers: Vec<Box<dyn Layer>> = Vec::new();
    for h in hidden {
        layers.push(Box::new(Dense { units: *h }));
        layers.push(Box::new(Relu));
    }
    layers.push(Box::new(Dense { units: classes }));
    Sequential::new("mlp", &[features], layers)
}

/// The built-in convolutional network, for images of `[height, width, channels]`:
/// two blocks of 5x5 convolution (16 then 32 filters, padding 2), ReLU and 2x2 max
/// pooling, then a dense layer of 128 with ReLU and one of `classes` logits.
pub fn cnn(image: [usize; 3], classes: usize) -> Result<Sequential, ModelError> {
    let conv = |filters| Conv2d {
        kh: 5,
        kw: 5,
        filters,
        stride: 1,
        pad: 2,
    };
    let pool = MaxPool2d { size: 2, stride: 2 };
    Sequential::new(
        "cnn",
        &image,
        vec![
            Box::new(conv(16)),
            Box::new(Relu),
            Box::new(pool),
            Box::new(conv(32)),
            Box::new(Relu),
            Box::new(pool),
            Box::new(Flatten),
            Box::new(Dense { units: 128 }),
            Box::new(Relu),
            Box::new(Dense { units: classes }),
        ],
    )
}

#[cfg(test)]
mod tests;

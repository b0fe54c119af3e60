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
mod tests {
    use super::*;
    use crate::model::Replica;
    use crate::rng::Rng;

    /// The mean loss in f64 from the model's own logits.
    fn loss(r: &Replica<'_>, x: &[f32], y: &[u8]) -> f64 {
        let logits = r.logits(x, y.len()).unwrap();
        let c = r.model.classes();
        logits
            .chunks(c)
            .zip(y)
            .map(|(row, l)| {
                let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
                let s: f64 = row.iter().map(|v| (*v as f64 - max).exp()).sum();
                s.ln() - (row[*l as usize] as f64 - max)
            })
            .sum::<f64>()
            / y.len() as f64
    }

    /// Central differences on every `stride`-th element of every parameter.
    fn check_gradients(model: &dyn Model, n: usize, stride: usize, eps: f32) -> usize {
        let r = Replica::new(model, 11);
        let mut rng = Rng::new(2);
        let per = crate::model::sample_len(model);
        let x: Vec<f32> = (0..n * per).map(|_| rng.normal() as f32).collect();
        let y: Vec<u8> = (0..n).map(|i| (i % model.classes()) as u8).collect();
        let mut grads = r.zeros_like();
        let mut seen = Vec::new();
        let got = r
            .gradients_with(&x, &y, &mut grads, &mut |range, _| seen.push(range))
            .unwrap();
        assert!((got as f64 - loss(&r, &x, &y)).abs() < 1e-5);
        // Every parameter reported ready exactly once, last layer first.
        let mut all: Vec<usize> = seen.iter().flat_map(|r| r.clone()).collect();
        assert_eq!(seen.first().unwrap().end, r.params.len());
        all.sort_unstable();
        assert_eq!(all, (0..r.params.len()).collect::<Vec<_>>());
        let mut checked = 0;
        for (pi, p) in r.params.iter().enumerate() {
            for i in (pi % stride..p.numel()).step_by(stride) {
                let mut plus = r.clone();
                plus.params[pi].as_mut_slice::<f32>().unwrap()[i] += eps;
                let mut minus = r.clone();
                minus.params[pi].as_mut_slice::<f32>().unwrap()[i] -= eps;
                let fd = (loss(&plus, &x, &y) - loss(&minus, &x, &y)) / (2.0 * eps as f64);
                let an = grads[pi].as_slice::<f32>().unwrap()[i] as f64;
                assert!(
                    (fd - an).abs() < 3e-3 + 3e-2 * an.abs(),
                    "{} [{i}]: fd {fd} analytic {an}",
                    p.name()
                );
                checked += 1;
            }
        }
        checked
    }

    #[test]
    fn mlp_gradients_match_finite_differences() {
        let m = mlp(5, &[7, 6], 3).unwrap();
        assert!(check_gradients(&m, 4, 3, 1e-2) > 20);
        let names: Vec<String> = m.parameters().into_iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            ["layer0/w", "layer0/b", "layer1/w", "layer1/b", "layer2/w", "layer2/b"]
        );
    }

    #[test]
    fn regression_gradients_match_finite_differences_and_wrong_targets_are_refused() {
        let m = mlp(5, &[7], 3).unwrap();
        let r = Replica::new(&m, 2);
        let mut rng = Rng::new(5);
        let n = 4;
        let x: Vec<f32> = (0..n * 5).map(|_| rng.normal() as f32).collect();
        let t: Vec<f32> = (0..n * 3).map(|_| rng.normal() as f32).collect();
        // The mean over rows of each row's mean squared error, in f64.
        let mse = |r: &Replica<'_>| -> f64 {
            let out = r.logits(&x, n).unwrap();
            let sq: f64 = (out.iter().zip(&t))
                .map(|(o, t)| f64::from(o - t).powi(2))
                .sum();
            sq / (n * 3) as f64
        };
        let mut grads = r.zeros_like();
        let got = r.gradients_into(&x, &t, &mut grads).unwrap();
        assert!(
            (f64::from(got) - mse(&r)).abs() < 1e-5,
            "{got} vs {}",
            mse(&r)
        );
        let eps = 1e-2f32;
        for (pi, p) in r.params.iter().enumerate() {
            for i in (0..p.numel()).step_by(3) {
                let mut plus = r.clone();
                plus.params[pi].as_mut_slice::<f32>().unwrap()[i] += eps;
                let mut minus = r.clone();
                minus.params[pi].as_mut_slice::<f32>().unwrap()[i] -= eps;
                let fd = (mse(&plus) - mse(&minus)) / (2.0 * f64::from(eps));
                let an = f64::from(grads[pi].as_slice::<f32>().unwrap()[i]);
                assert!(
                    (fd - an).abs() < 1e-3 + 1e-2 * an.abs(),
                    "{} [{i}]: {fd} vs {an}",
                    p.name()
                );
            }
        }
        // Targets that are not whole rows of the outputs, or rows that do not match the
        // inputs, are one error naming the model.
        let e = r.gradients_into(&x, &t[..7], &mut grads).unwrap_err();
        assert!(
            e.to_string()
                .contains("7 target values are not a whole number of rows of its 3 outputs"),
            "{e}"
        );
        let e = r.gradients_into(&x, &t[..9], &mut grads).unwrap_err();
        assert!(
            e.to_string()
                .contains("a batch of 3 rows of target values needs 15 input values, got 20"),
            "{e}"
        );
    }

    #[test]
    fn layer_costs_count_weights_where_they_apply_and_split_the_cnn() {
        // 784-128-10: dense (weights and biases, then inputs), relu, dense.
        let m = mlp(784, &[128], 10).unwrap();
        assert_eq!(
            m.layer_costs(),
            [100_352.0 + 128.0 + 784.0, 128.0, 1_280.0 + 10.0 + 128.0]
        );
        assert_eq!(m.layer_describe(1).as_deref(), Some("relu"));
        let c = cnn([28, 28, 1], 10).unwrap();
        let costs = c.layer_costs();
        assert_eq!(costs.len(), 10);
        // conv 5x5x1x16 (+16 biases) at 28x28 output pixels, plus its 784 inputs.
        assert_eq!(costs[0], ((25 * 16 + 16) * 28 * 28 + 784) as f64);
        // Two stages: the first convolution block against the rest.
        let stages = crate::pipeline::balance(&costs, 2).unwrap();
        assert_eq!(stages.len(), 2);
        assert_eq!(stages[0].start, 0);
        assert_eq!(stages[1].end, 10);
    }

    #[test]
    fn conv_pool_dense_gradients_match_finite_differences_on_odd_shapes() {
        // Odd image, stride 2 with padding, a pool that drops the last row, two channels in.
        let m = Sequential::new(
            "odd",
            &[7, 9, 2],
            vec![
                Box::new(Conv2d {
                    kh: 3,
                    kw: 2,
                    filters: 3,
                    stride: 2,
                    pad: 1,
                }),
                Box::new(Relu),
                Box::new(Conv2d {
                    kh: 2,
                    kw: 3,
                    filters: 4,
                    stride: 1,
                    pad: 1,
                }),
                Box::new(MaxPool2d { size: 2, stride: 2 }),
                Box::new(Flatten),
                Box::new(Dense { units: 5 }),
                Box::new(Relu),
                Box::new(Dense { units: 3 }),
            ],
        )
        .unwrap();
        assert!(check_gradients(&m, 3, 2, 5e-3) > 100);
    }

    #[test]
    fn the_builtin_cnn_fits_28x28_images_and_names_its_layers() {
        let m = cnn([28, 28, 1], 10).unwrap();
        let specs = m.parameters();
        let shapes: Vec<(String, Vec<usize>)> =
            specs.into_iter().map(|p| (p.name, p.shape)).collect();
        assert_eq!(
            shapes,
            vec![
                ("layer0/w".into(), vec![5, 5, 1, 16]),
                ("layer0/b".into(), vec![16]),
                ("layer1/w".into(), vec![5, 5, 16, 32]),
                ("layer1/b".into(), vec![32]),
                ("layer2/w".into(), vec![7 * 7 * 32, 128]),
                ("layer2/b".into(), vec![128]),
                ("layer3/w".into(), vec![128, 10]),
                ("layer3/b".into(), vec![10]),
            ]
        );
        assert!(m
            .describe()
            .starts_with("cnn: input 28x28x1, conv 5x5x16/1 pad 2, relu"));
    }

    #[test]
    fn layers_that_do_not_chain_are_refused_naming_the_layer() {
        let e = Sequential::new("bad", &[8, 8, 1], vec![Box::new(Dense { units: 3 })])
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "model bad: layer 0 (dense 3): dense takes a flat input; put a flatten before it (input [8, 8, 1])"
        );
        let e = cnn([3, 3, 1], 10).err().unwrap();
        assert!(e.to_string().contains("layer 5 (maxpool 2/2)"), "{e}");
    }

    #[test]
    fn parts_run_in_sequence_as_the_whole_model_and_only_the_last_has_a_loss() {
        let m = mlp(6, &[5, 4], 3).unwrap();
        let whole = Replica::new(&m, 3);
        let (head, tail) = (m.part(0..2).unwrap(), m.part(2..5).unwrap());
        assert!(m.part(3..3).is_err() && m.part(4..6).is_err());
        let (a, b) = (head.parameters().len(), tail.parameters().len());
        assert_eq!(a + b, whole.params.len());
        // The parts keep the whole model's parameter names.
        let names: Vec<String> = (head.parameters().iter())
            .chain(&tail.parameters())
            .map(|p| p.name.clone())
            .collect();
        let want: Vec<&str> = whole.params.iter().map(|p| p.name()).collect();
        assert_eq!(names, want);
        let head_r = Replica {
            model: &head,
            params: whole.params[..a].to_vec(),
        };
        let tail_r = Replica {
            model: &tail,
            params: whole.params[a..].to_vec(),
        };
        assert_eq!((head.input_shape(), head.classes()), (vec![6], 5));
        assert_eq!((tail.input_shape(), tail.classes()), (vec![5], 3));
        let mut rng = Rng::new(9);
        let x: Vec<f32> = (0..4 * 6).map(|_| rng.normal() as f32).collect();
        let y = [0u8, 2, 1, 2];
        let mid = head_r.logits(&x, 4).unwrap();
        assert_eq!(
            tail_r.logits(&mid, 4).unwrap(),
            whole.logits(&x, 4).unwrap()
        );
        // The last part's loss and gradients are the whole model's for its parameters.
        let mut all = whole.zeros_like();
        let loss = whole.gradients_into(&x, &y, &mut all).unwrap();
        let mut mine = tail_r.zeros_like();
        assert_eq!(tail_r.gradients_into(&mid, &y, &mut mine).unwrap(), loss);
        for (g, w) in mine.iter().zip(&all[a..]) {
            assert_eq!(g.bytes(), w.bytes(), "{}", g.name());
        }
        let e = head_r.gradients_into(&x, &y, &mut head_r.zeros_like());
        assert!(e.unwrap_err().to_string().contains("no loss of its own"));
    }
}

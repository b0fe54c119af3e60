//! Models: the interface every training mode trains through, and the layers and models
//! that come with mpiflow.
//!
//! A [`Model`] is an architecture without state: it declares its parameters (names,
//! shapes, how to initialise them) and computes, for parameter values it is handed, the
//! loss and gradients of a batch (against class labels, or against values: [`Targets`])
//! and the logits (outputs) of samples. Who holds the values differs
//! by mode (one process, every replica, the ps tasks), so the model never does: that is
//! what lets one model run in every mode. [`Replica`] is one copy of the values with the
//! model that uses them.
//!
//! - [`layers`]: dense, 2-D convolution (im2col + sgemm), max pooling, ReLU, flatten.
//! - `sequential`: a model that is a stack of layers, and the built-in [`mlp`] and
//!   [`cnn`].
//! - [`External`]: a model whose loss and gradients the program computes (NumPy,
//!   PyTorch) and hands in each step, trained by every mode.
//! - `towers`: a batch's gradients computed by K threads of one task (`--towers`).
//! - [`dlrm`]: DLRM, dense MLPs around embedding tables' dot interactions.
//! - [`embedding`]: embedding tables whose rows a batch names, with sparse gradients and
//!   sparse optimizers (the parameters of recommendation models).
//!
//! A model of your own implements [`Model`]; a linear classifier in full:
//! ```
//! use mpiflow::model::{Init, Model, ModelError, ParamSpec, Replica, Targets};
//! use mpiflow::tensor::Tensor;
//!
//! /// logits = x W, softmax cross-entropy.
//! struct Linear { features: usize, classes: usize }
//!
//! impl Model for Linear {
//!     fn describe(&self) -> String { format!("linear {}->{}", self.features, self.classes) }
//!     fn input_shape(&self) -> Vec<usize> { vec![self.features] }
//!     fn classes(&self) -> usize { self.classes }
//!     fn parameters(&self) -> Vec<ParamSpec> {
//!         vec![ParamSpec::new("w", &[self.features, self.classes], Init::Zeros)]
//!     }
//!     fn logits(&self, p: &[Tensor], x: &[f32], rows: usize) -> Result<Vec<f32>, ModelError> {
//!         let mut out = vec![0.0; rows * self.classes];
//!         mpiflow::kernels::gemm(false, false, rows, self.classes, self.features, 1.0,
//!             x, p[0].as_slice::<f32>()?, 0.0, &mut out)?;
//!         Ok(out)
//!     }
//!     fn loss_and_gradients(&self, p: &[Tensor], x: &[f32], y: Targets<'_>,
//!         grads: &mut [Tensor], ready: &mut dyn FnMut(std::ops::Range<usize>, &[Tensor]),
//!     ) -> Result<f32, ModelError> {
//!         let rows = y.rows(self.classes);
//!         let logits = self.logits(p, x, rows)?;
//!         let mut delta = vec![0.0; logits.len()];
//!         let loss = y.loss(&logits, self.classes, &mut delta);
//!         mpiflow::kernels::gemm(true, false, self.features, self.classes, rows, 1.0,
//!             x, &delta, 0.0, grads[0].as_mut_slice::<f32>()?)?;
//!         ready(0..1, grads);
//!         Ok(loss)
//!     }
//! }
//!
//! let model = Linear { features: 3, classes: 2 };
//! let mut replica = Replica::new(&model, 7);
//! let mut grads = replica.zeros_like();
//! let loss = replica.gradients_into(&[1.0, 0.0, 0.5], &[1], &mut grads).unwrap();
//! assert!((loss - 2f32.ln()).abs() < 1e-6); // zero weights: both classes equally likely
//! assert_eq!(grads[0].shape(), &[3, 2]);
//! replica.params[0].as_mut_slice::<f32>().unwrap()[1] = 5.0; // w[0][1]: favour class 1
//! assert_eq!(replica.accuracy(&[1.0, 0.0, 0.5], &[1]).unwrap(), 1.0);
//! ```

pub mod dlrm;
pub mod embedding;
mod external;
pub mod layers;
pub(crate) mod sequential;
pub(crate) mod towers;

use std::ops::Range;

pub use external::External;
pub use sequential::{cnn, mlp, Part, Sequential};

use crate::kernels::{self, KernelError};
use crate::rng::Rng;
use crate::tensor::{DType, Tensor, TensorError};

/// How a parameter starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Zeros,
    Constant(f32),
    /// Normal with mean 0 and this standard deviation.
    Normal {
        std: f64,
    },
    /// He initialisation for layers followed by ReLU: normal with std `sqrt(2 / fan_in)`.
    HeNormal {
        fan_in: usize,
    },
}

/// One parameter a model declares: its name, shape and initial values.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl ParamSpec {
    pub fn new(name: &str, shape: &[usize], init: Init) -> ParamSpec {
        ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
        }
    }

    /// Number of scalars.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// `'layer0/w' f32[3, 4]`: how errors name it.
    pub fn describe(&self) -> String {
        format!("'{}' f32{:?}", self.name, self.shape)
    }
}

/// Errors of models.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Kernel(#[from] KernelError),
    #[error("{0}")]
    Tensor(#[from] TensorError),
    #[error("{0}")]
    Embedding(#[from] embedding::EmbeddingError),
    #[error("model {model}: {why}")]
    Shape { model: String, why: String },
    #[error("model {model}: gradient {position} is {got}, its parameter is {want}")]
    GradientMismatch {
        model: String,
        position: usize,
        got: String,
        want: String,
    },
    #[error("model {model} takes samples of {want} values ({shape:?}) in {classes} classes; data {data} has {features} values per sample in {data_classes} classes")]
    DataMismatch {
        model: String,
        shape: Vec<usize>,
        want: usize,
        classes: usize,
        data: String,
        features: usize,
        data_classes: usize,
    },
}

/// A model an mpiflow training mode can train.
///
/// Implementations are architectures: parameter values come in as `params`, in the order
/// and shapes of [`Model::parameters`]. Every call must be deterministic for the same
/// inputs (replicas must agree bit for bit). `Send + Sync`: a model is shared by threads.
pub trait Model: Send + Sync {
    /// A one-line description (`cnn: conv 5x5x16 ...`), logged and written into
    /// checkpoints so one model's checkpoint is not restored into another.
    fn describe(&self) -> String;

    /// The shape of one sample (`[28, 28, 1]`; `[64]`); samples arrive flattened,
    /// row-major, channels last.
    fn input_shape(&self) -> Vec<usize>;

    /// Number of classes: the width of a row of logits.
    fn classes(&self) -> usize;

    /// The parameters, in the order every other call takes them.
    fn parameters(&self) -> Vec<ParamSpec>;

    /// The parameters' starting values, the same on every machine for one `seed`: by
    /// default drawn as [`Model::parameters`] say ([`initial_values`]); a model whose
    /// values come from elsewhere ([`External`]) gives its own.
    fn initial_values(&self, seed: u64) -> Vec<Tensor> {
        initial_values(&self.parameters(), seed)
    }

    /// Values a training pass keeps per sample (every layer's output and what its
    /// backward pass needs), for the memory check before training; 0 if unknown.
    fn activations_per_sample(&self) -> usize {
        0
    }

    /// Logits (`rows x classes`) of `rows` samples `x`.
    fn logits(&self, params: &[Tensor], x: &[f32], rows: usize) -> Result<Vec<f32>, ModelError>;

    /// The mean loss over the batch (`x`, its [`Targets`] `y`: a label per sample, or
    /// values), and its gradients written into `grads` (shaped like the parameters). Calls
    /// `ready(range, grads)` as soon as the gradients of the parameters in `range` are
    /// final, each parameter exactly once: a training mode starts reducing them while the
    /// rest of the backward pass runs. A model that cannot tell early calls
    /// `ready(0..n, grads)` at the end.
    fn loss_and_gradients(
        &self,
        params: &[Tensor],
        x: &[f32],
        y: Targets<'_>,
        grads: &mut [Tensor],
        ready: &mut dyn FnMut(Range<usize>, &[Tensor]),
    ) -> Result<f32, ModelError>;
}

/// What a batch's outputs are trained towards: a class label per sample (softmax
/// cross-entropy on the logits), or the model's [`Model::classes`] values per sample (its
/// output width: mean squared error on the outputs, a regression).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Targets<'a> {
    Classes(&'a [u8]),
    Values(&'a [f32]),
}

impl<'a> Targets<'a> {
    /// Samples in the batch, for outputs `width` wide.
    pub fn rows(&self, width: usize) -> usize {
        match self {
            Targets::Classes(y) => y.len(),
            Targets::Values(v) => v.len() / width.max(1),
        }
    }

    /// The targets of samples `rows`, for outputs `width` wide.
    pub fn slice(&self, rows: Range<usize>, width: usize) -> Targets<'a> {
        match *self {
            Targets::Classes(y) => Targets::Classes(&y[rows]),
            Targets::Values(v) => Targets::Values(&v[rows.start * width..rows.end * width]),
        }
    }

    /// Checks that they fit `model`: labels below its classes, values a whole number of
    /// rows of its outputs; an error naming both sides.
    pub fn check(&self, model: &dyn Model) -> Result<(), ModelError> {
        let width = model.classes();
        let why = match self {
            Targets::Classes(y) => y
                .iter()
                .find(|l| usize::from(**l) >= width)
                .map(|bad| format!("label {bad} is not below the model's {width} classes")),
            Targets::Values(v) => (!v.len().is_multiple_of(width.max(1))).then(|| {
                format!(
                    "{} target values are not a whole number of rows of its {width} outputs",
                    v.len()
                )
            }),
        };
        match why {
            Some(why) => Err(ModelError::Shape {
                model: model.describe(),
                why,
            }),
            None => Ok(()),
        }
    }

    /// The mean loss of `outputs` (`rows x width`) against these targets; its gradient
    /// w.r.t. the outputs into `grad`.
    pub fn loss(&self, outputs: &[f32], width: usize, grad: &mut [f32]) -> f32 {
        match self {
            Targets::Classes(y) => kernels::softmax_cross_entropy(outputs, y, width, grad),
            Targets::Values(v) => kernels::mean_squared_error(outputs, v, width, grad),
        }
    }
}

impl<'a> From<&'a [u8]> for Targets<'a> {
    fn from(y: &'a [u8]) -> Self {
        Targets::Classes(y)
    }
}

impl<'a> From<&'a Vec<u8>> for Targets<'a> {
    fn from(y: &'a Vec<u8>) -> Self {
        Targets::Classes(y)
    }
}

impl<'a, const N: usize> From<&'a [u8; N]> for Targets<'a> {
    fn from(y: &'a [u8; N]) -> Self {
        Targets::Classes(y)
    }
}

impl<'a> From<&'a [f32]> for Targets<'a> {
    fn from(v: &'a [f32]) -> Self {
        Targets::Values(v)
    }
}

impl<'a> From<&'a Vec<f32>> for Targets<'a> {
    fn from(v: &'a Vec<f32>) -> Self {
        Targets::Values(v)
    }
}

/// Number of values in one sample of `model`.
pub fn sample_len(model: &dyn Model) -> usize {
    model.input_shape().iter().product()
}

/// Refuses data whose samples or classes do not fit `model`, naming both sides.
pub fn check_data(
    model: &dyn Model,
    data: &str,
    features: usize,
    classes: usize,
) -> Result<(), ModelError> {
    let want = sample_len(model);
    if features != want || classes > model.classes() {
        return Err(ModelError::DataMismatch {
            model: model.describe(),
            shape: model.input_shape(),
            want,
            classes: model.classes(),
            data: data.to_string(),
            features,
            data_classes: classes,
        });
    }
    Ok(())
}

/// The initial values of `specs`, drawn in order from one generator seeded by `seed`: the
/// same seed gives the same values on every machine.
pub fn initial_values(specs: &[ParamSpec], seed: u64) -> Vec<Tensor> {
    let mut rng = Rng::new(seed);
    specs.iter().map(|s| draw_values(s, &mut rng)).collect()
}

/// The initial values of one parameter, drawn from `rng` (the next ones in
/// [`initial_values`]' order).
pub fn draw_values(s: &ParamSpec, rng: &mut Rng) -> Tensor {
    let n = s.numel();
    let data: Vec<f32> = match s.init {
        Init::Zeros => vec![0.0; n],
        Init::Constant(c) => vec![c; n],
        Init::Normal { std } => (0..n).map(|_| (rng.normal() * std) as f32).collect(),
        Init::HeNormal { fan_in } => {
            let std = (2.0 / fan_in.max(1) as f64).sqrt();
            (0..n).map(|_| (rng.normal() * std) as f32).collect()
        }
    };
    Tensor::from_slice(&s.shape, &data)
        .expect("data has the shape's length")
        .named(&s.name)
}

/// One copy of a model's parameters, with the model that computes on them: what one
/// process trains (every replica in allreduce mode, the workers' view in ps mode).
#[derive(Clone)]
pub struct Replica<'m> {
    pub model: &'m dyn Model,
    /// In the order of [`Model::parameters`].
    pub params: Vec<Tensor>,
}

impl std::fmt::Debug for Replica<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("model", &self.model.describe())
            .field("params", &self.params)
            .finish()
    }
}

/// Samples per forward pass in [`Replica::logits`]: bounds the memory of evaluating a
/// whole test set (a convolution's columns grow with the batch).
const EVAL_CHUNK: usize = 500;

impl<'m> Replica<'m> {
    /// The model's initial parameters from `seed`.
    pub fn new(model: &'m dyn Model, seed: u64) -> Replica<'m> {
        Replica {
            model,
            params: model.initial_values(seed),
        }
    }

    /// Number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(Tensor::numel).sum()
    }

    /// Zero tensors shaped and named like the parameters.
    pub fn zeros_like(&self) -> Vec<Tensor> {
        zeros_like(&self.params)
    }

    /// Mean loss of `x` against `y` (labels, or values: [`Targets`]); gradients written
    /// into `grads`.
    pub fn gradients_into<'y>(
        &self,
        x: &[f32],
        y: impl Into<Targets<'y>>,
        grads: &mut [Tensor],
    ) -> Result<f32, ModelError> {
        self.gradients_with(x, y.into(), grads, &mut |_, _| {})
    }

    /// As [`Self::gradients_into`], with the model's `ready` calls passed on; afterwards
    /// the gradients are checked to still match the parameters (a model that replaced
    /// one with another shape is an error naming both, not a wrong update).
    pub fn gradients_with<'y>(
        &self,
        x: &[f32],
        y: impl Into<Targets<'y>>,
        grads: &mut [Tensor],
        ready: &mut dyn FnMut(Range<usize>, &[Tensor]),
    ) -> Result<f32, ModelError> {
        let y = y.into();
        self.check_gradients(grads)?;
        y.check(self.model)?;
        let rows = y.rows(self.model.classes());
        let want = rows * sample_len(self.model);
        if x.len() != want {
            let what = match y {
                Targets::Classes(_) => "labels",
                Targets::Values(_) => "rows of target values",
            };
            return Err(ModelError::Shape {
                model: self.model.describe(),
                why: format!(
                    "a batch of {rows} {what} needs {want} input values, got {}",
                    x.len()
                ),
            });
        }
        let loss = self
            .model
            .loss_and_gradients(&self.params, x, y, grads, ready)?;
        self.check_gradients(grads)?;
        Ok(loss)
    }

    fn check_gradients(&self, grads: &[Tensor]) -> Result<(), ModelError> {
        let mismatch = |position: usize, got: String, want: String| ModelError::GradientMismatch {
            model: self.model.describe(),
            position,
            got,
            want,
        };
        if grads.len() != self.params.len() {
            return Err(mismatch(
                grads.len().min(self.params.len()),
                format!("one of {} gradients", grads.len()),
                format!("one of {} parameters", self.params.len()),
            ));
        }
        for (i, (g, p)) in grads.iter().zip(&self.params).enumerate() {
            if g.shape() != p.shape() || g.dtype() != DType::F32 {
                return Err(mismatch(i, g.describe(), p.describe()));
            }
        }
        Ok(())
    }

    /// Logits of `rows` samples, computed in chunks.
    pub fn logits(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, ModelError> {
        let per = sample_len(self.model);
        let mut out = Vec::with_capacity(rows * self.model.classes());
        for start in (0..rows).step_by(EVAL_CHUNK) {
            let n = EVAL_CHUNK.min(rows - start);
            out.extend(
                self.model
                    .logits(&self.params, &x[start * per..(start + n) * per], n)?,
            );
        }
        Ok(out)
    }

    /// Fraction of samples classified correctly.
    pub fn accuracy(&self, x: &[f32], y: &[u8]) -> Result<f64, ModelError> {
        let logits = self.logits(x, y.len())?;
        let pred = kernels::argmax_rows(&logits, self.model.classes());
        Ok(pred
            .iter()
            .zip(y)
            .filter(|(p, l)| **p == **l as usize)
            .count() as f64
            / y.len().max(1) as f64)
    }

    /// The variables this replica holds: name and element count, in creation order.
    pub fn variables(&self) -> Vec<(String, usize)> {
        variables(&self.params)
    }

    /// True if both hold the same parameter bits.
    pub fn same_parameters(&self, other: &Replica<'_>) -> bool {
        self.params.len() == other.params.len()
            && self
                .params
                .iter()
                .zip(&other.params)
                .all(|(a, b)| a.bytes() == b.bytes())
    }
}

/// Zero tensors shaped and named like `params`.
pub fn zeros_like(params: &[Tensor]) -> Vec<Tensor> {
    params
        .iter()
        .map(|p| {
            Tensor::zeros(DType::F32, p.shape())
                .expect("same shape")
                .named(p.name())
        })
        .collect()
}

/// The variables `params` hold (a model's, or a pipeline stage's part): name and element
/// count, in order (what checkpoints list and the ps places).
pub fn variables(params: &[Tensor]) -> Vec<(String, usize)> {
    params
        .iter()
        .map(|p| (p.name().to_string(), p.numel()))
        .collect()
}

//! Layers: each a forward and a backward pass over a batch, on the kernels.
//!
//! Activations are row-major with the batch first and channels last (NHWC for images), so
//! a dense layer's input is any activation flattened per sample, and a convolution's
//! output is a matrix product's output as it is. A layer keeps nothing between calls:
//! what its backward pass needs from the forward pass goes to a [`Saved`], and every
//! output goes into a buffer the caller owns and passes again on the next step (`_into`),
//! so a training step allocates nothing once the buffers have grown to the batch.

use super::Init;
use crate::kernels::conv::{self, Window2d};
use crate::kernels::{self, KernelError};

/// What a layer's forward pass keeps for its backward pass; reused from step to step.
#[derive(Debug, Clone, Default)]
pub enum Saved {
    #[default]
    Nothing,
    /// A convolution's im2col columns.
    Columns(Vec<f32>),
    /// Max pooling's winners, as indices into the input.
    Argmax(Vec<u32>),
}

impl Saved {
    /// The column buffer, made one if this held something else.
    pub fn columns(&mut self) -> &mut Vec<f32> {
        if !matches!(self, Saved::Columns(_)) {
            *self = Saved::Columns(Vec::new());
        }
        match self {
            Saved::Columns(c) => c,
            _ => unreachable!("set above"),
        }
    }

    /// The winners' buffer, made one if this held something else.
    pub fn argmax(&mut self) -> &mut Vec<u32> {
        if !matches!(self, Saved::Argmax(_)) {
            *self = Saved::Argmax(Vec::new());
        }
        match self {
            Saved::Argmax(a) => a,
            _ => unreachable!("set above"),
        }
    }
}

/// `buf` as exactly `len` values, keeping its allocation: values already there stay (the
/// kernels that write into it overwrite them), new ones are zero.
pub fn sized<T: Copy + Default>(buf: &mut Vec<T>, len: usize) -> &mut [T] {
    buf.resize(len, T::default());
    &mut buf[..]
}

/// One backward call's inputs.
pub struct Backward<'a> {
    /// The layer's input and output of the forward pass.
    pub x: &'a [f32],
    pub y: &'a [f32],
    /// What the forward pass saved; the layer may use it as workspace once read.
    pub saved: &'a mut Saved,
    /// Samples in the batch.
    pub n: usize,
    /// The loss gradient with respect to the output.
    pub dy: &'a [f32],
}

/// A layer of a [`super::Sequential`] model.
pub trait Layer: Send + Sync {
    /// `conv 5x5x16/1 pad 2`, `dense 128`, `relu`.
    fn describe(&self) -> String;

    /// The shape of one sample's output for one sample's `input`, or why it does not fit.
    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String>;

    /// Parameters (short name, shape, initialiser) for `input`; empty for most layers.
    fn params(&self, _input: &[usize]) -> Vec<(&'static str, Vec<usize>, Init)> {
        Vec::new()
    }

    /// Writes the output of `n` samples `x` into `out` (resized to fit) and what the
    /// backward pass needs into `saved`.
    fn forward_into(
        &self,
        p: &[&[f32]],
        input: &[usize],
        x: &[f32],
        n: usize,
        out: &mut Vec<f32>,
        saved: &mut Saved,
    ) -> Result<(), KernelError>;

    /// Writes the parameter gradients into `grads` and, if `dx` is given (not for the
    /// first layer), the input gradient into it (resized to fit).
    fn backward_into(
        &self,
        p: &[&[f32]],
        input: &[usize],
        b: Backward<'_>,
        grads: &mut [&mut [f32]],
        dx: Option<&mut Vec<f32>>,
    ) -> Result<(), KernelError>;
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// `out = x W + b` for `rows` rows of `fin` values (`W` is `fin x fout`): a dense layer's
/// product, and a convolution's over its im2col columns.
#[allow(clippy::too_many_arguments)]
fn affine(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    rows: usize,
    fin: usize,
    fout: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    kernels::broadcast_rows(out, b);
    kernels::gemm(false, false, rows, fout, fin, 1.0, x, w, 1.0, out)
}

/// [`affine`]'s parameter gradients from its output gradient `dy`: `x^T dy` into
/// `grads[0]`, the column sums of `dy` into `grads[1]`.
fn affine_param_grads(
    x: &[f32],
    dy: &[f32],
    rows: usize,
    fin: usize,
    fout: usize,
    grads: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    kernels::gemm(true, false, fin, fout, rows, 1.0, x, dy, 0.0, grads[0])?;
    kernels::sum_rows(dy, grads[1]);
    Ok(())
}

/// [`affine`]'s input gradient: `dx = dy W^T`.
fn affine_input_grad(
    dy: &[f32],
    w: &[f32],
    rows: usize,
    fin: usize,
    fout: usize,
    dx: &mut [f32],
) -> Result<(), KernelError> {
    kernels::gemm(false, true, rows, fin, fout, 1.0, dy, w, 0.0, dx)
}

/// The geometry of a `k` window over `input` images (height x width x channels), or why
/// they do not fit; `layer` names the layer in the error.
fn image_window(
    layer: &str,
    input: &[usize],
    k: [usize; 2],
    stride: usize,
    pad: usize,
) -> Result<Window2d, String> {
    let [h, w, c] = input else {
        return Err(format!(
            "{layer} takes images of height x width x channels (input {input:?})"
        ));
    };
    Window2d::new([*h, *w, *c], k, stride, pad).map_err(|e| e.to_string())
}

/// A fully connected layer: `y = x W + b`, `W` is `in x out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dense {
    pub units: usize,
}

impl Layer for Dense {
    fn describe(&self) -> String {
        format!("dense {}", self.units)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        match input {
            [_] if self.units > 0 => Ok(vec![self.units]),
            [_] => Err("a dense layer needs at least one unit".into()),
            _ => Err(format!(
                "dense takes a flat input; put a flatten before it (input {input:?})"
            )),
        }
    }

    fn params(&self, input: &[usize]) -> Vec<(&'static str, Vec<usize>, Init)> {
        let fan_in = numel(input);
        vec![
            ("w", vec![fan_in, self.units], Init::HeNormal { fan_in }),
            ("b", vec![self.units], Init::Zeros),
        ]
    }

    fn forward_into(
        &self,
        p: &[&[f32]],
        input: &[usize],
        x: &[f32],
        n: usize,
        out: &mut Vec<f32>,
        _saved: &mut Saved,
    ) -> Result<(), KernelError> {
        let fi = numel(input);
        let out = sized(out, n * self.units);
        affine(x, p[0], p[1], n, fi, self.units, out)
    }

    fn backward_into(
        &self,
        p: &[&[f32]],
        input: &[usize],
        b: Backward<'_>,
        grads: &mut [&mut [f32]],
        dx: Option<&mut Vec<f32>>,
    ) -> Result<(), KernelError> {
        let (fi, fo) = (numel(input), self.units);
        affine_param_grads(b.x, b.dy, b.n, fi, fo, grads)?;
        match dx {
            Some(dx) => affine_input_grad(b.dy, p[0], b.n, fi, fo, sized(dx, b.n * fi)),
            None => Ok(()),
        }
    }
}

/// A 2-D convolution over NHWC images: `filters` windows of `kh x kw`, `stride`, zero
/// `pad` on every side; weights `[kh, kw, in_channels, filters]` (TensorFlow's layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2d {
    pub kh: usize,
    pub kw: usize,
    pub filters: usize,
    pub stride: usize,
    pub pad: usize,
}

impl Conv2d {
    fn window(&self, input: &[usize]) -> Result<Window2d, String> {
        image_window("conv", input, [self.kh, self.kw], self.stride, self.pad)
    }
}

impl Layer for Conv2d {
    fn describe(&self) -> String {
        format!(
            "conv {}x{}x{}/{} pad {}",
            self.kh, self.kw, self.filters, self.stride, self.pad
        )
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        if self.filters == 0 {
            return Err("a convolution needs at least one filter".into());
        }
        let g = self.window(input)?;
        Ok(vec![g.oh, g.ow, self.filters])
    }

    fn params(&self, input: &[usize]) -> Vec<(&'static str, Vec<usize>, Init)> {
        let c = input.get(2).copied().unwrap_or(1);
        let fan_in = self.kh * self.kw * c;
        vec![
            (
                "w",
                vec![self.kh, self.kw, c, self.filters],
                Init::HeNormal { fan_in },
            ),
            ("b", vec![self.filters], Init::Zeros),
        ]
    }

    fn forward_into(
        &self,
        p: &[&[f32]],
        input: &[usize],
        x: &[f32],
        n: usize,
        out: &mut Vec<f32>,
        saved: &mut Saved,
    ) -> Result<(), KernelError> {
        let g = self.window(input).map_err(shape_error)?;
        let rows = n * g.pixels();
        let cols = sized(saved.columns(), rows * g.k());
        conv::im2col(&g, x, n, cols)?;
        let out = sized(out, rows * self.filters);
        affine(cols, p[0], p[1], rows, g.k(), self.filters, out)
    }

    fn backward_into(
        &self,
        p: &[&[f32]],
        input: &[usize],
        b: Backward<'_>,
        grads: &mut [&mut [f32]],
        dx: Option<&mut Vec<f32>>,
    ) -> Result<(), KernelError> {
        let g = self.window(input).map_err(shape_error)?;
        let Saved::Columns(cols) = b.saved else {
            return Err(shape_error("conv backward without its columns".into()));
        };
        let rows = b.n * g.pixels();
        affine_param_grads(cols, b.dy, rows, g.k(), self.filters, grads)?;
        let Some(dx) = dx else {
            return Ok(());
        };
        // The columns are read; their buffer takes the column gradient `dY W^T`, which
        // is then scattered back onto the image.
        let dcols = &mut cols[..];
        affine_input_grad(b.dy, p[0], rows, g.k(), self.filters, dcols)?;
        let dx = sized(dx, b.n * g.input_len());
        dx.fill(0.0);
        conv::col2im_add(&g, dcols, b.n, dx)?;
        Ok(())
    }
}

fn shape_error(why: String) -> KernelError {
    KernelError::Layer(why)
}

/// Max pooling over `size x size` windows moved by `stride`, per channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool2d {
    pub size: usize,
    pub stride: usize,
}

impl MaxPool2d {
    fn window(&self, input: &[usize]) -> Result<Window2d, String> {
        image_window("max pooling", input, [self.size; 2], self.stride, 0)
    }
}

impl Layer for MaxPool2d {
    fn describe(&self) -> String {
        format!("maxpool {}/{}", self.size, self.stride)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        let g = self.window(input)?;
        Ok(vec![g.oh, g.ow, g.c])
    }

    fn forward_into(
        &self,
        _p: &[&[f32]],
        input: &[usize],
        x: &[f32],
        n: usize,
        out: &mut Vec<f32>,
        saved: &mut Saved,
    ) -> Result<(), KernelError> {
        let g = self.window(input).map_err(shape_error)?;
        let len = n * g.pixels() * g.c;
        conv::max_pool(&g, x, n, sized(out, len), sized(saved.argmax(), len))
    }

    fn backward_into(
        &self,
        _p: &[&[f32]],
        _input: &[usize],
        b: Backward<'_>,
        _grads: &mut [&mut [f32]],
        dx: Option<&mut Vec<f32>>,
    ) -> Result<(), KernelError> {
        let Saved::Argmax(arg) = b.saved else {
            return Err(shape_error("max pool backward without its winners".into()));
        };
        match dx {
            Some(dx) => conv::max_pool_backward(arg, b.dy, sized(dx, b.x.len())),
            None => Ok(()),
        }
    }
}

/// `max(x, 0)`, element-wise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Relu;

impl Layer for Relu {
    fn describe(&self) -> String {
        "relu".into()
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        Ok(input.to_vec())
    }

    fn forward_into(
        &self,
        _p: &[&[f32]],
        _input: &[usize],
        x: &[f32],
        _n: usize,
        out: &mut Vec<f32>,
        _saved: &mut Saved,
    ) -> Result<(), KernelError> {
        let out = sized(out, x.len());
        kernels::relu_into(x, out);
        Ok(())
    }

    fn backward_into(
        &self,
        _p: &[&[f32]],
        _input: &[usize],
        b: Backward<'_>,
        _grads: &mut [&mut [f32]],
        dx: Option<&mut Vec<f32>>,
    ) -> Result<(), KernelError> {
        if let Some(dx) = dx {
            let dx = sized(dx, b.dy.len());
            dx.copy_from_slice(b.dy);
            kernels::relu_backward(b.y, dx);
        }
        Ok(())
    }
}

/// Reshapes each sample to one dimension (the data stay as they are in memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flatten;

impl Layer for Flatten {
    fn describe(&self) -> String {
        "flatten".into()
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, String> {
        Ok(vec![numel(input)])
    }

    fn forward_into(
        &self,
        _p: &[&[f32]],
        _input: &[usize],
        x: &[f32],
        _n: usize,
        out: &mut Vec<f32>,
        _saved: &mut Saved,
    ) -> Result<(), KernelError> {
        sized(out, x.len()).copy_from_slice(x);
        Ok(())
    }

    fn backward_into(
        &self,
        _p: &[&[f32]],
        _input: &[usize],
        b: Backward<'_>,
        _grads: &mut [&mut [f32]],
        dx: Option<&mut Vec<f32>>,
    ) -> Result<(), KernelError> {
        if let Some(dx) = dx {
            sized(dx, b.dy.len()).copy_from_slice(b.dy);
        }
        Ok(())
    }
}

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
    /// A convolution's: its input with the zero padding laid out (the backward pass lays
    /// the im2col columns out again from it), then workspace for one block of columns.
    Workspace(Vec<f32>),
    /// Max pooling's winners, as indices into the input.
    Argmax(Vec<u32>),
}

impl Saved {
    /// The first `len` values of the workspace (made one if this held something else),
    /// grown to hold them and never shrunk: a forward pass that needs less than its
    /// backward pass does not make the backward pass clear the difference every step.
    pub fn workspace(&mut self, len: usize) -> &mut [f32] {
        if !matches!(self, Saved::Workspace(_)) {
            *self = Saved::Workspace(Vec::new());
        }
        match self {
            Saved::Workspace(ws) => {
                if ws.len() < len {
                    ws.resize(len, 0.0);
                }
                &mut ws[..len]
            }
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

/// Why a layer does not take an input shape (a [`Layer::output_shape`]'s error): one line
/// naming what the layer needs and the input it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ShapeError(pub String);

impl From<String> for ShapeError {
    fn from(why: String) -> ShapeError {
        ShapeError(why)
    }
}

impl From<&str> for ShapeError {
    fn from(why: &str) -> ShapeError {
        ShapeError(why.to_string())
    }
}

/// A layer of a [`super::Sequential`] model.
pub trait Layer: Send + Sync {
    /// `conv 5x5x16/1 pad 2`, `dense 128`, `relu`.
    fn describe(&self) -> String;

    /// The shape of one sample's output for one sample's `input`, or why it does not fit.
    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, ShapeError>;

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
/// product.
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
) -> Result<Window2d, ShapeError> {
    let [h, w, c] = input else {
        return Err(
            format!("{layer} takes images of height x width x channels (input {input:?})").into(),
        );
    };
    Window2d::new([*h, *w, *c], k, stride, pad).map_err(|e| ShapeError(e.to_string()))
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

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, ShapeError> {
        match input {
            [_] if self.units > 0 => Ok(vec![self.units]),
            [_] => Err("a dense layer needs at least one unit".into()),
            _ => Err(format!(
                "dense takes a flat input; put a flatten before it (input {input:?})"
            )
            .into()),
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
    fn window(&self, input: &[usize]) -> Result<Window2d, ShapeError> {
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

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, ShapeError> {
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

    /// The input with its zero padding (kept for the backward pass), then `bias + cols
    /// W`: on [`kernels::thin::conv_into`] straight from the padded images where it
    /// suits (filters a multiple of 8 on AVX2), else block by block of output pixels
    /// ([`conv::row_block`]): the block's im2col columns, and their product.
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
        let (k, oc, rows) = (g.k(), self.filters, n * g.pixels());
        let out = sized(out, rows * oc);
        kernels::broadcast_rows(out, p[1]);
        let block = conv::row_block(&g);
        let padded = n * g.padded_len();
        let direct = kernels::thin::suits_conv(oc);
        let cols_len = if direct { 0 } else { block.min(rows) * k };
        let ws = saved.workspace(padded + cols_len);
        let (xp, ws) = ws.split_at_mut(padded);
        conv::pad_into(&g, x, n, xp)?;
        if direct {
            // The window read where it lies in the padded images: no columns at all.
            return kernels::thin::conv_into(&g, n, xp, p[0], oc, out, true);
        }
        for r0 in (0..rows).step_by(block) {
            let r1 = (r0 + block).min(rows);
            let cols = &mut ws[..(r1 - r0) * k];
            conv::im2col_rows(&g, xp, r0..r1, cols)?;
            let out = &mut out[r0 * oc..r1 * oc];
            kernels::gemm(false, false, r1 - r0, oc, k, 1.0, cols, p[0], 1.0, out)?;
        }
        Ok(())
    }

    /// From the padded input the forward pass kept: the filter gradient `cols^T dY`
    /// straight from it where [`kernels::thin`] suits, else block by block from the
    /// block's columns laid out again (cheaper than keeping the batch's, `k` times the
    /// input); then, block by block, the column gradient `dY W^T` added onto a padded
    /// input gradient, whose inside is the input gradient.
    fn backward_into(
        &self,
        p: &[&[f32]],
        input: &[usize],
        b: Backward<'_>,
        grads: &mut [&mut [f32]],
        dx: Option<&mut Vec<f32>>,
    ) -> Result<(), KernelError> {
        let g = self.window(input).map_err(shape_error)?;
        let (k, oc, rows) = (g.k(), self.filters, b.n * g.pixels());
        let (padded, block) = (b.n * g.padded_len(), conv::row_block(&g));
        let Saved::Workspace(kept) = &*b.saved else {
            return Err(shape_error("conv backward without its forward pass"));
        };
        if kept.len() < padded {
            return Err(shape_error(format!(
                "conv backward for {} samples after a forward pass of fewer",
                b.n
            )));
        }
        // The workspace after the padded input (unless the filter gradient is all there is
        // to do, straight from it): a block of columns, the filter transposed (`oc x k`,
        // so the column gradient is a plain product with a short sum) and the padded
        // input gradient.
        let direct = kernels::thin::suits_conv(oc);
        let len = if direct && dx.is_none() {
            padded
        } else {
            padded + block.min(rows) * k + oc * k + padded
        };
        let (xp, ws) = b.saved.workspace(len).split_at_mut(padded);
        kernels::sum_rows(b.dy, grads[1]);
        if direct {
            kernels::thin::conv_filter_grad_into(&g, b.n, xp, b.dy, oc, grads[0], false)?;
            if dx.is_none() {
                return Ok(());
            }
        } else {
            grads[0].fill(0.0);
        }
        let (ws, rest) = ws.split_at_mut(block.min(rows) * k);
        let (wt, dxp) = rest.split_at_mut(oc * k);
        if dx.is_some() {
            dxp.fill(0.0);
            kernels::transpose_into(p[0], k, oc, wt);
        }
        for r0 in (0..rows).step_by(block) {
            let r1 = (r0 + block).min(rows);
            let (cols, dy) = (&mut ws[..(r1 - r0) * k], &b.dy[r0 * oc..r1 * oc]);
            if !direct {
                conv::im2col_rows(&g, xp, r0..r1, cols)?;
                kernels::gemm(true, false, k, oc, r1 - r0, 1.0, cols, dy, 1.0, grads[0])?;
            }
            if dx.is_some() {
                // The block's columns are read: their buffer takes the column gradient.
                kernels::gemm(false, false, r1 - r0, k, oc, 1.0, dy, wt, 0.0, cols)?;
                conv::col2im_add_rows(&g, cols, r0..r1, dxp)?;
            }
        }
        if let Some(dx) = dx {
            let dx = sized(dx, b.n * g.input_len());
            dx.fill(0.0);
            conv::unpad_add(&g, dxp, b.n, dx)?;
        }
        Ok(())
    }
}

fn shape_error(why: impl Into<ShapeError>) -> KernelError {
    KernelError::Layer(why.into().0)
}

/// Max pooling over `size x size` windows moved by `stride`, per channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool2d {
    pub size: usize,
    pub stride: usize,
}

impl MaxPool2d {
    fn window(&self, input: &[usize]) -> Result<Window2d, ShapeError> {
        image_window("max pooling", input, [self.size; 2], self.stride, 0)
    }
}

impl Layer for MaxPool2d {
    fn describe(&self) -> String {
        format!("maxpool {}/{}", self.size, self.stride)
    }

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, ShapeError> {
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
            return Err(shape_error("max pool backward without its winners"));
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

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, ShapeError> {
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
            kernels::relu_backward_into(b.y, b.dy, sized(dx, b.dy.len()));
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

    fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, ShapeError> {
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

#[cfg(test)]
mod tests;

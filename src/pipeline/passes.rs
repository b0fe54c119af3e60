//! One step's passes through a stage: the micro-batches forward and backward in the
//! schedule's order, activations and gradients to and from the neighbouring stages.

use std::time::{Duration, Instant};

use super::link::{Direction, Link};
use super::schedule::Op;
use super::stage::Stage;
use super::train::PipelineError;
use crate::model::Targets;
use crate::observe::timeline::{self, Detail};
use crate::transport::Comm;

/// A replica's share of a step (`rows` samples: their features `x` and targets `y`), cut
/// into `count` micro-batches.
pub(crate) struct MicroBatches<'d> {
    pub x: &'d [f32],
    pub y: Targets<'d>,
    pub rows: usize,
    pub count: usize,
}

impl MicroBatches<'_> {
    /// The rows of micro-batch `mb`: a contiguous run, as [`crate::train::data::shard`]
    /// cuts.
    fn rows(&self, mb: usize) -> std::ops::Range<usize> {
        let n = self.rows;
        mb * n / self.count..(mb + 1) * n / self.count
    }
}

/// Time in a stage's pipeline passes, and of it waiting for a neighbour.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PassTimes {
    pub total: Duration,
    pub idle: Duration,
}

/// A span of the timeline (`--timeline`) from `start` to now: one pass, or one wait, of
/// micro-batch `mb` of `step` (the micro-batch named as the span's peer).
fn mark(name: &'static str, cat: &'static str, start: Instant, step: u64, mb: usize) {
    if timeline::enabled() {
        let detail = Detail {
            step: Some(step),
            peer: Some(format!("micro-batch {mb}").into()),
            bytes: None,
        };
        timeline::span(name, cat, start, Instant::now(), detail);
    }
}

/// Runs this stage's passes of one step in the schedule's order (`ops`), receiving and
/// sending through `link`; the stage's gradient sums are then complete. Returns the sum
/// of the micro-batches' sample-weighted losses (the last stage's; 0 elsewhere) and the
/// passes' time, with the time spent waiting for the neighbours.
pub(crate) fn run_passes<C: Comm>(
    st: &mut Stage<'_>,
    link: &mut Link<'_, C>,
    ops: &[Op],
    micro: &MicroBatches<'_>,
) -> Result<(f32, PassTimes), PipelineError> {
    let start = Instant::now();
    let (first, last, k) = (st.is_first(), st.is_last(), st.index());
    let mut loss_sum = 0.0f32;
    let mut waited = Duration::ZERO;
    for op in ops {
        match *op {
            Op::Forward(mb) => {
                let rows = micro.rows(mb);
                let n = rows.len();
                let input = if first {
                    let f = micro.x.len() / micro.rows.max(1);
                    micro.x[rows.start * f..rows.end * f].to_vec()
                } else {
                    let mut buf = st.input_buffer(n * st.input_width());
                    let w = Instant::now();
                    link.receive(&mut buf, k - 1, Direction::Activations, mb)?;
                    waited += w.elapsed();
                    mark("wait for activations", "wait", w, link.step, mb);
                    buf
                };
                let t = Instant::now();
                let out = st.forward(mb, input, n)?;
                mark("forward", "compute", t, link.step, mb);
                if !last {
                    link.send(out, k + 1, Direction::Activations)?;
                } else {
                    let width = st.output_width();
                    loss_sum += st.loss(mb, micro.y.slice(rows, width))? * n as f32;
                }
            }
            Op::Backward(mb) => {
                if !last {
                    let into = st.output_gradient_mut(mb)?;
                    let w = Instant::now();
                    link.receive(into, k + 1, Direction::Gradients, mb)?;
                    waited += w.elapsed();
                    mark("wait for gradients", "wait", w, link.step, mb);
                }
                let t = Instant::now();
                let dx = st.backward(mb)?;
                mark("backward", "compute", t, link.step, mb);
                if !first {
                    link.send(dx, k - 1, Direction::Gradients)?;
                }
            }
        }
    }
    let w = Instant::now();
    link.flush()?;
    waited += w.elapsed();
    timeline::span(
        "sends done",
        "wait",
        w,
        Instant::now(),
        Detail::at(link.step),
    );
    st.finish_step()?;
    let total = start.elapsed();
    Ok((
        loss_sum,
        PassTimes {
            total,
            idle: waited,
        },
    ))
}

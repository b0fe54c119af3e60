//! What a pipeline tells: its partition, each stage's memory, the held-out accuracy.

use std::ops::Range;

use super::link::{Direction, Link};
use super::stage::Stage;
use super::train::PipelineError;
use crate::model::{Model, Sequential};
use crate::train::data::Dataset;
use crate::train::events::Event;
use crate::train::optim::Slots;
use crate::transport::{Collectives, Comm};
/// The layers of each stage of `model` in `stages`, by counted cost, one line each:
/// `stage 0: layers 0..3 (conv 5x5x16/1 pad 2, relu, maxpool 2/2), 1,664 parameter bytes`.
pub fn describe_partition(model: &Sequential, ranges: &[Range<usize>]) -> Vec<String> {
    let specs = model.parameters();
    ranges
        .iter()
        .enumerate()
        .map(|(k, r)| {
            let names: Vec<String> = r.clone().filter_map(|i| model.layer_describe(i)).collect();
            let bytes: usize = specs[model.param_range(r.clone())]
                .iter()
                .map(|p| 4 * p.numel())
                .sum();
            format!(
                "stage {k}: layers {}..{} ({}), {bytes} parameter bytes",
                r.start,
                r.end,
                names.join(", ")
            )
        })
        .collect()
}

/// Each stage's parameter, optimizer-state and peak activation bytes, to the reporter.
pub(crate) fn report_memory<C: Comm>(
    group: &Collectives<C>,
    st: &Stage<'_>,
    slots: &[Slots],
    peak_activations: usize,
    reporting: bool,
    events: &mut dyn FnMut(&Event),
) -> Result<(), PipelineError> {
    let state: usize = slots.iter().map(|s| 4 * (s.m.len() + s.v.len())).sum();
    let mine = [st.index(), st.param_bytes(), state, peak_activations]
        .iter()
        .flat_map(|v| (*v as u64).to_le_bytes())
        .collect::<Vec<u8>>();
    let all = group.allgather_varlen(&mine)?;
    if reporting {
        let mut per_stage: Vec<[u64; 4]> = all
            .iter()
            .map(|b| {
                let v: Vec<u64> = b
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect();
                [v[0], v[1], v[2], v[3]]
            })
            .collect();
        per_stage.sort_unstable();
        per_stage.dedup_by_key(|v| v[0]);
        let lines: Vec<String> = per_stage
            .iter()
            .map(|v| {
                format!(
                    "stage {}: parameters {} B, optimizer state {} B, peak activations {} B",
                    v[0], v[1], v[2], v[3]
                )
            })
            .collect();
        events(&Event::Note(format!(
            "memory per task: {}",
            lines.join("; ")
        )));
    }
    Ok(())
}

/// Samples per evaluation pass through the pipeline.
const EVAL_CHUNK: usize = 500;

/// Runs `test` through the replica's stages in chunks; the last stage reports the
/// accuracy.
pub(crate) fn evaluate<C: Comm>(
    st: &mut Stage<'_>,
    link: &mut Link<'_, C>,
    test: &Dataset,
    step: u64,
    events: &mut dyn FnMut(&Event),
) -> Result<(), PipelineError> {
    let k = st.index();
    let mut correct = 0usize;
    for (chunk, start) in (0..test.len()).step_by(EVAL_CHUNK).enumerate() {
        let n = EVAL_CHUNK.min(test.len() - start);
        let input = if st.is_first() {
            test.x[start * test.features..(start + n) * test.features].to_vec()
        } else {
            let mut buf = vec![0.0; n * st.input_width()];
            link.receive(&mut buf, k - 1, Direction::Inference, chunk)?;
            buf
        };
        let out = st.infer(&input, n)?;
        if st.is_last() {
            let pred = crate::kernels::argmax_rows(&out, st.output_width());
            correct += pred
                .iter()
                .zip(&test.y[start..start + n])
                .filter(|(p, l)| **p == usize::from(**l))
                .count();
        } else {
            link.send(&out, k + 1, Direction::Inference)?;
        }
    }
    link.flush()?;
    if st.is_last() {
        let total = test.len();
        events(&Event::Accuracy {
            accuracy: correct as f64 / total.max(1) as f64,
            correct,
            total,
            step,
        });
    }
    Ok(())
}

//! What a pipeline tells: its partition, each stage's memory, the held-out accuracy.

use std::ops::Range;

use super::link::{Direction, Link};
use super::stage::Stage;
use super::train::PipelineError;
use crate::model::{Model, Sequential};
use crate::train::data::Dataset;
use crate::train::events::Event;
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

/// What one task tells the reporter when training ends.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StageReport {
    pub stage: usize,
    pub param_bytes: usize,
    pub state_bytes: usize,
    pub peak_activation_bytes: usize,
    /// Seconds in the steps' pipeline passes (from the first pass to the last send's
    /// completion), and of those, waiting for a neighbour.
    pub pass_secs: f64,
    pub idle_secs: f64,
}

/// Every task's [`StageReport`] to the reporter, which tells each stage's memory (replica
/// 0's tasks') and the share of its passes each stage spent idle, against GPipe's bubble.
pub(crate) fn report_stages<C: Comm>(
    group: &Collectives<C>,
    mine: StageReport,
    micro_batches: usize,
    reporting: bool,
    events: &mut dyn FnMut(&Event),
) -> Result<(), PipelineError> {
    let bytes = serde_json::to_vec(&mine).expect("plain values serialise");
    let all = group.allgather_varlen(&bytes)?;
    if !reporting {
        return Ok(());
    }
    let reports: Vec<StageReport> = all
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<Result<_, _>>()
        .map_err(|e| PipelineError::Config(format!("a stage's report: {e}")))?;
    let stages = reports.iter().map(|r| r.stage + 1).max().unwrap_or(0);
    let mut memory = Vec::new();
    // Per stage, summed over the replicas: the passes' time and the busy part of it.
    let mut pass = vec![0.0f64; stages];
    let mut busy = vec![0.0f64; stages];
    for k in 0..stages {
        let of: Vec<&StageReport> = reports.iter().filter(|r| r.stage == k).collect();
        let r = of[0];
        memory.push(format!(
            "stage {k}: parameters {} B, optimizer state {} B, peak activations {} B",
            r.param_bytes, r.state_bytes, r.peak_activation_bytes
        ));
        pass[k] = of.iter().map(|r| r.pass_secs).sum();
        busy[k] = of.iter().map(|r| r.pass_secs - r.idle_secs).sum();
    }
    events(&Event::Note(format!(
        "memory per task: {}",
        memory.join("; ")
    )));
    // The steps start together on every stage (after the step's collectives), so the
    // pipeline's span is the longest stage's passes; a stage is idle for the rest of it.
    let span = pass.iter().copied().fold(1e-12, f64::max);
    let idle: Vec<f64> = busy.iter().map(|b| 1.0 - b / span).collect();
    let mean = idle.iter().sum::<f64>() / stages.max(1) as f64;
    let each: Vec<String> = idle
        .iter()
        .enumerate()
        .map(|(k, f)| format!("stage {k} {:.1}%", 100.0 * f))
        .collect();
    let bubble = super::schedule::gpipe_bubble(stages, micro_batches);
    events(&Event::Note(format!(
        "bubble: {:.1}% of the pipeline's span idle ({}; GPipe's (S-1)/(M+S-1) = {:.1}%)",
        100.0 * mean,
        each.join(", "),
        100.0 * bubble
    )));
    Ok(())
}

/// Samples per evaluation pass through the pipeline.
const EVAL_CHUNK: usize = 500;

/// Runs `test` through the replica's stages in chunks; the last stage returns how many
/// samples it classified correctly, and of how many (`None` on the other stages).
pub(crate) fn evaluate<C: Comm>(
    st: &mut Stage<'_>,
    link: &mut Link<'_, C>,
    test: &Dataset,
) -> Result<Option<(usize, usize)>, PipelineError> {
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
    Ok(st.is_last().then_some((correct, test.len())))
}

//! Contiguous stages of balanced cost: the layers `0..L` with costs `c_0..c_{L-1}` cut
//! into S ranges, each at least one layer, so that the costliest stage is as cheap as it
//! can be (the pipeline's step is paced by its slowest stage).

use std::ops::Range;
use std::time::Instant;

use crate::model::sequential::Scratch;
use crate::model::{Model, ModelError, Sequential};
use crate::rng::Rng;
use crate::tensor::Tensor;

/// How a pipeline weighs its layers to balance the stages (`--balance`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Balance {
    /// Multiply-adds counted from the shapes ([`Sequential::layer_costs`]): the same
    /// everywhere, free.
    Counted,
    /// Each layer's forward and backward pass timed on this machine (one rank times them,
    /// every rank uses its numbers): what the counts miss (a convolution over one input
    /// channel costs more than its multiply-adds, element-wise layers more than their
    /// elements).
    #[default]
    Measured,
}

impl crate::named::Named for Balance {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Balance::Counted,
            "counted",
            "multiply-adds counted from the shapes",
        ),
        (
            Balance::Measured,
            "measured",
            "each layer's forward and backward pass timed on one rank",
        ),
    ];
}

/// Each layer's seconds for a forward and a backward pass over `rows` random samples,
/// the best of `reps` (a slow phase only slows), on random parameters.
pub fn measure_layer_costs(
    model: &Sequential,
    rows: usize,
    reps: usize,
) -> Result<Vec<f64>, ModelError> {
    let specs = model.parameters();
    let mut rng = Rng::new(7);
    let mut costs = Vec::with_capacity(model.num_layers());
    for i in 0..model.num_layers() {
        let layer = i..i + 1;
        let params: Vec<Tensor> = specs[model.param_range(layer.clone())]
            .iter()
            .map(|s| crate::model::draw_values(s, &mut rng))
            .collect();
        let mut grads = crate::model::zeros_like(&params);
        let width: usize = model.shape_at(i).iter().product();
        let out: usize = model.shape_at(i + 1).iter().product();
        let x: Vec<f32> = (0..rows * width).map(|_| rng.normal() as f32).collect();
        let dy: Vec<f32> = (0..rows * out).map(|_| rng.normal() as f32).collect();
        let mut s = Scratch::default();
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            model.forward_layers(layer.clone(), &params, &x, rows, &mut s)?;
            s.gradient_mut(dy.len()).copy_from_slice(&dy);
            let input_gradient = i > 0;
            let ready = &mut |_, _: &[Tensor]| {};
            model.backward_layers(
                layer.clone(),
                &params,
                &x,
                rows,
                &mut grads,
                ready,
                input_gradient,
                &mut s,
            )?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        costs.push(best);
    }
    Ok(costs)
}

/// Errors of [`balance`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PartitionError {
    #[error("--stages {stages}: the model has {layers} layers, fewer than the stages")]
    TooManyStages { stages: usize, layers: usize },
    #[error("--stages must be 1 or more")]
    NoStages,
    #[error("layer {layer}: cost {cost} is not a finite number of 0 or more")]
    BadCost { layer: usize, cost: f64 },
    #[error("layer {layer} alone holds {bytes} parameter bytes, more than --max-param-bytes {limit}: no split into stages fits it")]
    LayerTooLarge {
        layer: usize,
        bytes: u64,
        limit: u64,
    },
    #[error("--stages {stages}: no split keeps each stage's parameters within --max-param-bytes {limit} (the model's {total} bytes take at least {fewest} stages)")]
    ParamLimit {
        stages: usize,
        limit: u64,
        total: u64,
        fewest: usize,
    },
}

/// The fewest contiguous stages whose parameters (`sizes`, bytes per layer) each fit in
/// `limit` bytes (greedy packing is optimal for contiguous ranges).
pub fn fewest_stages(sizes: &[u64], limit: u64) -> Result<usize, PartitionError> {
    if let Some((layer, &bytes)) = sizes.iter().enumerate().find(|(_, b)| **b > limit) {
        return Err(PartitionError::LayerTooLarge {
            layer,
            bytes,
            limit,
        });
    }
    let (mut stages, mut used) = (1, 0u64);
    for b in sizes {
        if used + b > limit {
            stages += 1;
            used = 0;
        }
        used += b;
    }
    Ok(stages)
}

/// The S contiguous ranges of `costs` whose largest sum is smallest (ties: the earliest
/// cuts), each holding at least one layer. Exact, by dynamic programming over (stages,
/// layers): O(S L²).
pub fn balance(costs: &[f64], stages: usize) -> Result<Vec<Range<usize>>, PartitionError> {
    balance_within(costs, stages, None)
}

/// [`balance`] among the splits whose every stage holds at most `limit.1` bytes of
/// parameters, `limit.0` being each layer's (`--max-param-bytes`).
pub fn balance_within(
    costs: &[f64],
    stages: usize,
    limit: Option<(&[u64], u64)>,
) -> Result<Vec<Range<usize>>, PartitionError> {
    let layers = costs.len();
    if stages == 0 {
        return Err(PartitionError::NoStages);
    }
    if stages > layers {
        return Err(PartitionError::TooManyStages { stages, layers });
    }
    if let Some((layer, &cost)) = costs
        .iter()
        .enumerate()
        .find(|(_, c)| !c.is_finite() || **c < 0.0)
    {
        return Err(PartitionError::BadCost { layer, cost });
    }
    let mut prefix = vec![0.0; layers + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    let mut bytes = vec![0u64; layers + 1];
    if let Some((sizes, _)) = limit {
        for (i, b) in sizes.iter().enumerate().take(layers) {
            bytes[i + 1] = bytes[i] + b;
        }
    }
    let fits = |a: usize, b: usize| limit.is_none_or(|(_, l)| bytes[b] - bytes[a] <= l);
    // best[s][j]: the smallest largest stage of the first j layers in s stages; cut[s][j]:
    // where its last stage starts.
    let mut best = vec![vec![f64::INFINITY; layers + 1]; stages + 1];
    let mut cut = vec![vec![0usize; layers + 1]; stages + 1];
    best[0][0] = 0.0;
    for s in 1..=stages {
        for j in s..=layers {
            for i in (s - 1)..j {
                if !fits(i, j) {
                    continue;
                }
                let worst = best[s - 1][i].max(sum(i, j));
                if worst < best[s][j] {
                    best[s][j] = worst;
                    cut[s][j] = i;
                }
            }
        }
    }
    if let (Some((sizes, limit)), true) = (limit, best[stages][layers].is_infinite()) {
        let fewest = fewest_stages(sizes, limit)?;
        return Err(PartitionError::ParamLimit {
            stages,
            limit,
            total: bytes[layers],
            fewest,
        });
    }
    let mut ranges = Vec::with_capacity(stages);
    let mut end = layers;
    for s in (1..=stages).rev() {
        let start = cut[s][end];
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parameter_limit_moves_the_cuts_or_says_how_many_stages_it_takes() {
        // Cheap but large first layers, a costly small last one.
        let costs = [1.0, 1.0, 1.0, 6.0];
        let sizes = [40u64, 40, 40, 10];
        assert_eq!(balance(&costs, 2).unwrap(), [0..3, 3..4]);
        // At most 80 bytes a stage: the first stage cannot hold all three large layers.
        let within = balance_within(&costs, 2, Some((&sizes, 80))).unwrap();
        assert_eq!(within, [0..2, 2..4]);
        assert_eq!(fewest_stages(&sizes, 80), Ok(2));
        assert_eq!(
            balance_within(&costs, 2, Some((&sizes, 50))).unwrap_err().to_string(),
            "--stages 2: no split keeps each stage's parameters within --max-param-bytes 50 (the model's 130 bytes take at least 3 stages)"
        );
        assert_eq!(
            fewest_stages(&sizes, 30).unwrap_err().to_string(),
            "layer 0 alone holds 40 parameter bytes, more than --max-param-bytes 30: no split into stages fits it"
        );
    }

    #[test]
    fn measured_costs_time_every_layer_and_partition_like_counted_ones() {
        let model = crate::model::cnn([8, 8, 1], 3).unwrap();
        let costs = measure_layer_costs(&model, 4, 2).unwrap();
        assert_eq!(costs.len(), model.num_layers());
        assert!(costs.iter().all(|c| c.is_finite() && *c > 0.0), "{costs:?}");
        let stages = balance(&costs, 3).unwrap();
        assert_eq!((stages[0].start, stages[2].end), (0, model.num_layers()));
    }

    /// The largest stage of `ranges` over `costs`.
    fn worst(costs: &[f64], ranges: &[Range<usize>]) -> f64 {
        ranges
            .iter()
            .map(|r| costs[r.clone()].iter().sum::<f64>())
            .fold(0.0, f64::max)
    }

    #[test]
    fn stages_cover_every_layer_in_order_and_balance_the_costliest() {
        let costs = [1.0, 9.0, 1.0, 1.0, 8.0, 1.0];
        let r = balance(&costs, 2).unwrap();
        assert_eq!(r, [0..2, 2..6]); // 10 and 11; 0..3 and 3..6 tie, the earlier cut wins
        assert_eq!(worst(&costs, &r), 11.0);
        // Every layer its own stage, and one stage for all.
        assert_eq!(
            balance(&costs, 6).unwrap(),
            (0..6).map(|i| i..i + 1).collect::<Vec<_>>()
        );
        assert_eq!(
            balance(&costs, 1).unwrap(),
            vec![Range { start: 0, end: 6 }]
        );
        // Against every cut of 3 stages: none has a cheaper costliest stage.
        let r = balance(&costs, 3).unwrap();
        let mut best = f64::INFINITY;
        for a in 1..costs.len() {
            for b in a + 1..costs.len() {
                best = best.min(worst(&costs, &[0..a, a..b, b..costs.len()]));
            }
        }
        assert_eq!(worst(&costs, &r), best);
        assert!(r.iter().all(|s| !s.is_empty()));
        // Free layers still get a stage each when asked.
        assert_eq!(balance(&[0.0, 0.0], 2).unwrap(), [0..1, 1..2]);
    }

    #[test]
    fn impossible_partitions_are_errors() {
        assert_eq!(
            balance(&[1.0, 2.0], 3).unwrap_err().to_string(),
            "--stages 3: the model has 2 layers, fewer than the stages"
        );
        assert_eq!(balance(&[1.0], 0), Err(PartitionError::NoStages));
        assert!(matches!(
            balance(&[1.0, f64::NAN], 1),
            Err(PartitionError::BadCost { layer: 1, .. })
        ));
    }
}

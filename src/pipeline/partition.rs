//! Contiguous stages of balanced cost: the layers `0..L` with costs `c_0..c_{L-1}` cut
//! into S ranges, each at least one layer, so that the costliest stage is as cheap as it
//! can be (the pipeline's step is paced by its slowest stage).

use std::ops::Range;

/// Errors of [`balance`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PartitionError {
    #[error("--stages {stages}: the model has {layers} layers, fewer than the stages")]
    TooManyStages { stages: usize, layers: usize },
    #[error("--stages must be 1 or more")]
    NoStages,
    #[error("layer {layer}: cost {cost} is not a finite number of 0 or more")]
    BadCost { layer: usize, cost: f64 },
}

/// The S contiguous ranges of `costs` whose largest sum is smallest (ties: the earliest
/// cuts), each holding at least one layer. Exact, by dynamic programming over (stages,
/// layers): O(S L²).
pub fn balance(costs: &[f64], stages: usize) -> Result<Vec<Range<usize>>, PartitionError> {
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
    // best[s][j]: the smallest largest stage of the first j layers in s stages; cut[s][j]:
    // where its last stage starts.
    let mut best = vec![vec![f64::INFINITY; layers + 1]; stages + 1];
    let mut cut = vec![vec![0usize; layers + 1]; stages + 1];
    best[0][0] = 0.0;
    for s in 1..=stages {
        for j in s..=layers {
            for i in (s - 1)..j {
                let worst = best[s - 1][i].max(sum(i, j));
                if worst < best[s][j] {
                    best[s][j] = worst;
                    cut[s][j] = i;
                }
            }
        }
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

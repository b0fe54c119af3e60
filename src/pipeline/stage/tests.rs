use super::*;
use crate::model::Replica;
use crate::rng::Rng;

/// The model's local gradient sums over a batch cut into micro-batches equal the
/// stages' own, run stage by stage by hand.
#[test]
fn stages_in_sequence_give_the_whole_model_gradients_and_initial_values() {
    let model = crate::model::cnn([8, 8, 1], 3).unwrap();
    let local = Replica::new(&model, 5);
    let n = 6;
    let mut rng = Rng::new(9);
    let x: Vec<f32> = (0..n * 64).map(|_| rng.normal() as f32).collect();
    let y: Vec<u8> = (0..n).map(|i| (i % 3) as u8).collect();
    let mut want = local.zeros_like();
    let loss = local.gradients_into(&x, &y, &mut want).unwrap();
    let ranges = super::super::balance(&model.layer_costs(), 3).unwrap();
    for towers in [1, 2, 3] {
        check_stages_against(&model, &ranges, towers, (&x, &y), loss, &want);
    }
}

/// The stages of `ranges` with `towers` towers, run by hand on two micro-batches of
/// `x`, `y`: the loss and gradient sums of the whole model (`loss`, `want`: means).
fn check_stages_against(
    model: &Sequential,
    ranges: &[Range<usize>],
    towers: usize,
    (x, y): (&[f32], &[u8]),
    loss: f32,
    want: &[Tensor],
) {
    let local = Replica::new(model, 5);
    let n = y.len();
    let parts: Vec<Part> = ranges
        .iter()
        .map(|r| model.part(r.clone()).unwrap())
        .collect();
    let mut stages: Vec<Stage> = (0..3)
        .map(|k| {
            Stage::new(&parts[k], ranges, k, 5)
                .unwrap()
                .with_towers(towers)
        })
        .collect();
    let all: Vec<Tensor> = stages
        .iter()
        .flat_map(|s| s.replica.params.clone())
        .collect();
    assert!(all
        .iter()
        .zip(&local.params)
        .all(|(a, b)| a.bytes() == b.bytes() && a.name() == b.name()));
    // Two micro-batches of 4 and 2 samples.
    let mut losses = 0.0;
    for (mb, rows) in [(0usize, 0..4usize), (1, 4..6)] {
        let m = rows.len();
        let mut act = x[rows.start * 64..rows.end * 64].to_vec();
        for s in stages.iter_mut() {
            act = s.forward(mb, act, m).unwrap().to_vec();
        }
        losses += stages[2].loss(mb, &y[rows]).unwrap() * m as f32;
    }
    for mb in [1, 0] {
        let mut dy: Vec<f32> = Vec::new();
        for s in stages.iter_mut().rev() {
            if !s.is_last() {
                s.output_gradient_mut(mb).unwrap().copy_from_slice(&dy);
            }
            dy = s.backward(mb).unwrap().to_vec();
        }
        assert!(dy.is_empty());
    }
    assert!((losses / n as f32 - loss).abs() < 1e-5, "{towers} towers");
    let got: Vec<Tensor> = stages
        .iter_mut()
        .flat_map(|s| {
            s.finish_step().unwrap();
            s.grads.clone()
        })
        .collect();
    for (g, w) in got.iter().zip(want) {
        for (a, b) in g
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .zip(w.as_slice::<f32>().unwrap())
        {
            let b = b * n as f32;
            assert!(
                (a - b).abs() < 1e-4 * (1.0 + b.abs()),
                "{towers} towers, {}: {a} vs {b}",
                g.name()
            );
        }
    }
    assert!(stages[0].take_peak_bytes() > 0);
    let e = stages[1].backward(7).unwrap_err();
    assert!(
        e.to_string().contains("micro-batch 7 has not run forward"),
        "{e}"
    );
}

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
    let shapes: Vec<(String, Vec<usize>)> = specs.into_iter().map(|p| (p.name, p.shape)).collect();
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

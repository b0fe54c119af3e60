//! Pipeline training in one process (threads over [`LocalComm`]) against local training.

use super::train::{run, PipelineConfig, PipelineError};
use super::Schedule;
use crate::cluster::{Layout, MappingOptions};
use crate::train::data::Dataset;
use crate::train::events::Event;
use crate::train::{max_relative_difference, train_local, TrainConfig};
use crate::transport::local::LocalComm;

fn layout(ps: usize, ranks: usize, stages: usize) -> Layout {
    let opts = MappingOptions {
        ps,
        stages: Some(stages),
        ..MappingOptions::default()
    };
    Layout::single_host(ranks, &opts).unwrap()
}

/// Runs `cfg` on every rank of `layout`; each rank's events as lines, or its error.
fn train_on(
    layout: &Layout,
    model: &crate::model::Sequential,
    cfgs: &(dyn Fn(usize) -> PipelineConfig + Sync),
    train: &Dataset,
    test: &Dataset,
) -> Vec<Result<Vec<String>, PipelineError>> {
    LocalComm::run(layout.ranks.len(), |c| {
        let mut said = Vec::new();
        let cfg = cfgs(crate::transport::Comm::rank(&c));
        run(&c, layout, model, &cfg, train, test, &mut |e: &Event| {
            said.push(e.to_string())
        })
        .map(|()| said)
    })
}

#[test]
fn stages_by_replicas_equal_local_training_of_the_global_batch() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let cnn = crate::model::cnn([8, 8, 1], 10).unwrap();
    let mlp = crate::model::mlp(64, &[48, 32], 10).unwrap();
    // The MLP with Adam; the CNN with SGD: Adam divides each update by the root of the
    // gradient's second moment, so an element whose gradient is zero up to rounding (a
    // filter ReLU keeps dead) moves a whole learning rate in whichever direction the
    // rounding of a different summation order points. SGD shows the pipeline's sums.
    let sgd = crate::train::optim::Optimizer::new(crate::train::optim::OptimizerKind::Sgd, 0.05);
    for (name, model, optimizer) in [
        ("mlp", &mlp, TrainConfig::default().optimizer),
        ("cnn", &cnn, sgd),
    ] {
        let tc = TrainConfig {
            steps: 30,
            log_every: 10,
            optimizer,
            ..TrainConfig::default()
        };
        let local = train_local(model, &tc, &train, &test, &mut |_| {}).unwrap();
        for (stages, replicas, ps) in [(2, 1, 0), (2, 2, 1), (3, 1, 0)] {
            for (schedule, micro, towers) in [
                (Schedule::GPipe, 4, 1),
                (Schedule::OneFOneB, 3, 1),
                (Schedule::OneFOneB, 2, 3),
            ] {
                let out = std::env::temp_dir().join(format!(
                    "mpiflow-pipe-{}-{name}-{stages}-{replicas}-{micro}-{towers}.bin",
                    std::process::id()
                ));
                let cfg = PipelineConfig {
                    train: TrainConfig {
                        save_params: Some(out.clone()),
                        towers,
                        ..tc.clone()
                    },
                    micro_batches: micro,
                    schedule,
                    check_every: 5,
                    ..PipelineConfig::default()
                };
                let l = layout(ps, ps + stages * replicas, stages);
                let said = train_on(&l, model, &|_| cfg.clone(), &train, &test);
                let case =
                    format!("{name} S={stages} R={replicas} {schedule:?} M={micro} K={towers}");
                let lines: Vec<String> = said
                    .into_iter()
                    .flat_map(|r| r.unwrap_or_else(|e| panic!("{case}: {e}")))
                    .collect();
                // Replica 0's last stage reports: the partition, 3 logged steps, memory,
                // accuracy; a ps task is idle.
                let count = |p: &str| lines.iter().filter(|l| l.starts_with(p)).count();
                assert_eq!(count("# pipeline: "), 1, "{case}: {lines:?}");
                assert_eq!(count("step "), 3, "{case}: {lines:?}");
                assert_eq!(count("accuracy "), 1, "{case}: {lines:?}");
                assert_eq!(count("# memory per task: stage 0"), 1, "{case}: {lines:?}");
                assert_eq!(count("# warning: ps:0 (rank 0): not a replica"), ps);
                let worst = max_relative_difference(&local.model, &out);
                assert!(worst < 1e-4, "{case}: largest relative difference {worst}");
                let _ = std::fs::remove_file(&out);
            }
        }
    }
}

#[test]
fn one_f_one_b_holds_fewer_activations_than_gpipe() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let model = crate::model::mlp(64, &[256, 256], 10).unwrap();
    let peak = |schedule| {
        let cfg = PipelineConfig {
            train: TrainConfig {
                steps: 2,
                log_every: 0,
                batch: 128,
                ..TrainConfig::default()
            },
            micro_batches: 8,
            schedule,
            // The same cut for both schedules (a measured one follows this machine's
            // timings run by run, and with it stage 0's activations).
            balance: crate::pipeline::Balance::Counted,
            ..PipelineConfig::default()
        };
        let said = train_on(&layout(0, 2, 2), &model, &|_| cfg.clone(), &train, &test);
        let line = said
            .into_iter()
            .flat_map(Result::unwrap)
            .find(|l| l.starts_with("# memory per task"))
            .unwrap();
        // "stage 0: parameters P B, optimizer state O B, peak activations A B; ..."
        let a: usize = line
            .split("stage 0: ")
            .nth(1)
            .and_then(|s| s.split("peak activations ").nth(1))
            .and_then(|s| s.split(' ').next())
            .unwrap()
            .parse()
            .unwrap();
        a
    };
    let (gpipe, one_f_one_b) = (peak(Schedule::GPipe), peak(Schedule::OneFOneB));
    // Stage 0 of 2 keeps 8 micro-batches under GPipe, 2 under 1F1B.
    assert!(
        one_f_one_b * 3 < gpipe,
        "1F1B {one_f_one_b} B against GPipe {gpipe} B"
    );
}

#[test]
fn settings_that_cannot_run_stop_every_rank_with_one_verdict() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let model = crate::model::mlp(64, &[16], 10).unwrap();
    let base = PipelineConfig {
        train: TrainConfig {
            steps: 3,
            log_every: 0,
            batch: 8,
            ..TrainConfig::default()
        },
        ..PipelineConfig::default()
    };
    // More micro-batches than a replica's share of the batch: every rank says so.
    let too_many = PipelineConfig {
        micro_batches: 5,
        ..base.clone()
    };
    let said = train_on(
        &layout(0, 4, 2),
        &model,
        &|_| too_many.clone(),
        &train,
        &test,
    );
    for r in said {
        let e = r.unwrap_err();
        assert!(e.is_agreed());
        assert_eq!(
            e.to_string(),
            "--micro-batches 5: each of the 2 replicas' share of batch 8 is 4 samples; take 1 to 4 micro-batches"
        );
    }
    // One rank started with other settings: every rank names it.
    let said = train_on(
        &layout(0, 4, 2),
        &model,
        &|rank| PipelineConfig {
            micro_batches: if rank == 3 { 2 } else { 4 },
            ..base.clone()
        },
        &train,
        &test,
    );
    for r in said {
        let e = r.unwrap_err().to_string();
        assert!(
            e.starts_with("replica_1:1 (rank 3): its pipeline (model mlp")
                && e.contains("--micro-batches 2;")
                && e.contains("differs from rank 0's"),
            "{e}"
        );
    }
    // More stages than layers.
    let said = train_on(&layout(0, 4, 4), &model, &|_| base.clone(), &train, &test);
    for r in said {
        assert_eq!(
            r.unwrap_err().to_string(),
            "--stages 4: the model has 3 layers, fewer than the stages"
        );
    }
}

#[test]
fn checkpoints_in_stage_shards_resume_exactly_with_any_number_of_stages() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let model = crate::model::mlp(64, &[32, 16], 10).unwrap();
    let dir = std::env::temp_dir().join(format!("mpiflow-pipe-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let file = |name: &str| dir.join(format!("{name}.bin"));
    let cfg = |steps: u64, ckpt: bool, out: &str| PipelineConfig {
        train: TrainConfig {
            steps,
            log_every: 0,
            checkpoint_dir: ckpt.then(|| dir.join("ckpt")),
            checkpoint_every: 10,
            save_params: Some(file(out)),
            ..TrainConfig::default()
        },
        micro_batches: 2,
        ..PipelineConfig::default()
    };
    let run_ok = |l: &Layout, c: PipelineConfig| {
        let said = train_on(l, &model, &|_| c.clone(), &train, &test);
        said.into_iter()
            .flat_map(|r| r.unwrap_or_else(|e| panic!("{e}")))
            .collect::<Vec<String>>()
    };
    std::fs::create_dir_all(&dir).unwrap();
    let two_by_two = layout(0, 4, 2);
    run_ok(&two_by_two, cfg(40, false, "straight"));
    // 20 steps with checkpoints at 10 and 20, then on to 30 from the newest.
    let said = run_ok(&two_by_two, cfg(20, true, "first"));
    assert_eq!(
        said.iter()
            .filter(|l| l.starts_with("# checkpoint "))
            .count(),
        2,
        "{said:?}"
    );
    let ckpt20 = dir.join("ckpt").join("ckpt-20");
    for f in ["manifest.json", "shard-stage0.bin", "shard-stage1.bin"] {
        assert!(ckpt20.join(f).exists(), "{f}");
    }
    let said = run_ok(&two_by_two, cfg(30, true, "resumed"));
    assert!(
        said.iter()
            .any(|l| l.contains("# restored ") && l.contains("ckpt-20")),
        "{said:?}"
    );
    // Three stages of one replica resume the two-stage checkpoint of step 30.
    run_ok(&layout(0, 3, 3), cfg(40, true, "restaged"));
    let restaged = crate::train::checkpoint::read_file(&file("restaged"), None).unwrap();
    let straight = crate::train::checkpoint::read_file(&file("straight"), None).unwrap();
    assert_eq!(restaged.step, 40);
    for (name, want) in &straight.arrays {
        let got = restaged.get(name).unwrap();
        let worst = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "{name}: {worst}");
    }
    // Allreduce mode resumes a pipeline's checkpoint (the common format).
    let vars: Vec<(String, usize)> = crate::model::Replica::new(&model, 1)
        .params
        .iter()
        .map(|p| (p.name().to_string(), p.numel()))
        .collect();
    let state =
        crate::train::checkpoint::State::open(&dir.join("ckpt").join("ckpt-40"), &vars).unwrap();
    assert_eq!(state.step, 40);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_stage_that_does_not_fit_its_memory_share_stops_every_task_naming_it() {
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let model = crate::model::mlp(64, &[256], 10).unwrap();
    let cfg = PipelineConfig {
        train: TrainConfig {
            steps: 2,
            log_every: 0,
            ..TrainConfig::default()
        },
        // Stage 0 (dense 256: 66,560 parameter bytes) needs more than 200 KB with
        // Adam; stage 1 (dense 10: 10,280) less.
        memory_share: Some(crate::train::resources::Share {
            bytes: 200_000,
            why: "a test's share".into(),
        }),
        balance: crate::pipeline::Balance::Counted,
        ..PipelineConfig::default()
    };
    let said = train_on(&layout(0, 2, 2), &model, &|_| cfg.clone(), &train, &test);
    for r in said {
        let e = r.unwrap_err();
        assert!(e.is_agreed());
        let e = e.to_string();
        assert!(
            e.starts_with("replica_0:0 needs at least ")
                && e.contains("parameters 66.6 KB")
                && e.contains("but may use 200.0 KB (a test's share)"),
            "{e}"
        );
    }
}

#[test]
fn stages_with_ps_tasks_equal_local_training_and_checkpoint_in_the_common_format() {
    use crate::train::ps::placement::{DeviceSetter, Strategy};
    let data = Dataset::load("digits", 0).unwrap();
    let (train, test) = data.split_holdout(1);
    let model = crate::model::mlp(64, &[48, 32], 10).unwrap();
    let tc = TrainConfig {
        steps: 30,
        log_every: 10,
        ..TrainConfig::default()
    };
    let local = train_local(&model, &tc, &train, &test, &mut |_| {}).unwrap();
    let dir = std::env::temp_dir().join(format!("mpiflow-pipe-ps-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // (stages, replicas, ps tasks, placement)
    for (stages, replicas, ps, strategy) in [
        (2, 2, 1, Strategy::Greedy),
        (3, 1, 2, Strategy::Partition),
        (2, 1, 2, Strategy::RoundRobin),
    ] {
        let case = format!("S={stages} R={replicas} ps={ps} {strategy:?}");
        let out = dir.join(format!("{stages}-{replicas}-{ps}.bin"));
        let ckpt = dir.join(format!("ckpt-{stages}-{replicas}-{ps}"));
        let cfg = PipelineConfig {
            train: TrainConfig {
                save_params: Some(out.clone()),
                checkpoint_dir: Some(ckpt.clone()),
                checkpoint_every: 10,
                ..tc.clone()
            },
            micro_batches: 2,
            ps: Some(super::ps::StagePs {
                placement: DeviceSetter {
                    strategy,
                    partition_bytes: 4096,
                },
                peer_timeout: std::time::Duration::from_secs(20),
            }),
            ..PipelineConfig::default()
        };
        let l = layout(ps, ps + stages * replicas, stages);
        let said = train_on(&l, &model, &|_| cfg.clone(), &train, &test);
        let lines: Vec<String> = said
            .into_iter()
            .flat_map(|r| r.unwrap_or_else(|e| panic!("{case}: {e}")))
            .collect();
        let count = |p: &str| lines.iter().filter(|l| l.starts_with(p)).count();
        assert_eq!(count("step "), 3, "{case}: {lines:?}");
        assert_eq!(count("accuracy "), 1, "{case}: {lines:?}");
        assert_eq!(count("# checkpoint "), 3, "{case}: {lines:?}");
        let worst = max_relative_difference(&local.model, &out);
        assert!(worst < 1e-4, "{case}: largest relative difference {worst}");
        // The ps tasks' files, one per stage each holds variables of, under one manifest
        // that any mode reads whole.
        let vars: Vec<(String, usize)> = local
            .model
            .params
            .iter()
            .map(|p| (p.name().to_string(), p.numel()))
            .collect();
        let state = crate::train::checkpoint::State::open(&ckpt.join("ckpt-30"), &vars).unwrap();
        assert_eq!(state.step, 30, "{case}");
        for (v, p) in state.vars.iter().zip(&local.model.params) {
            let worst = v
                .param
                .iter()
                .zip(p.as_slice::<f32>().unwrap())
                .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-4, "{case}: checkpoint {}: {worst}", p.name());
        }
    }
    // Resumed from the last checkpoint (a 2-stage ps run's) by 3 stages and allreduce.
    let cfg = PipelineConfig {
        train: TrainConfig {
            steps: 40,
            log_every: 0,
            checkpoint_dir: Some(dir.join("ckpt-2-1-2")),
            ..TrainConfig::default()
        },
        micro_batches: 2,
        ..PipelineConfig::default()
    };
    let said = train_on(&layout(0, 3, 3), &model, &|_| cfg.clone(), &train, &test);
    let lines: Vec<String> = said.into_iter().flat_map(Result::unwrap).collect();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("# restored ") && l.contains("ckpt-30")),
        "{lines:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

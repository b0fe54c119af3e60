//! The Python package under real `mpirun` (`tests/python/*.py`, in the environment
//! `scripts/venv.sh` made, which installs the package from this repository): each rank
//! prints one JSON line of what it checked, asserted here.

mod common;

use serde_json::Value;

/// `mpirun -np N python tests/python/SCRIPT ARGS`: every rank's line, by rank, of a job
/// that exited 0 (`None` where the environment has no Python: the test is then skipped,
/// or fails where it is required).
fn ranks_of(script: &str, np: usize, args: &[&str]) -> Option<Vec<Value>> {
    ranks_in(common::python_with_mpi4py()?, script, np, args)
}

/// [`ranks_of`] in the environment `python`.
fn ranks_in(python: String, script: &str, np: usize, args: &[&str]) -> Option<Vec<Value>> {
    let path = format!("{}/tests/python/{script}", common::root());
    let np = np.to_string();
    let out = common::mpirun(&[&["-np", &np, &python, &path][..], args].concat());
    assert_eq!(out.code, 0, "{out:?}");
    let mut lines = out.json_lines();
    lines.sort_by_key(|l| l["rank"].as_u64());
    assert_eq!(lines.len().to_string(), np, "{out:?}");
    Some(lines)
}

/// Every op and dtype at odd sizes equal to the reduction of every rank's array, the same
/// bits on every rank, in place and returning, broadcast, allgather, barrier, non-blocking
/// calls in flight together; bad arrays and calls
/// that differ between ranks one exception on every rank, each naming its rank, after
/// which the collectives still work.
#[test]
fn numpy_collectives_equal_the_serial_reduction_and_bad_calls_raise_on_every_rank() {
    for np in [2, 3, 4] {
        let Some(ranks) = ranks_of("collectives.py", np, &[]) else {
            return;
        };
        for (r, line) in ranks.iter().enumerate() {
            assert_eq!(line["rank"].as_u64(), Some(r as u64), "{line}");
            assert_eq!(line["size"].as_u64(), Some(np as u64), "{line}");
            assert_eq!(line["failures"], serde_json::json!([]), "{line}");
            assert_eq!(line["checks"], ranks[0]["checks"], "{line}");
            assert!(line["checks"].as_u64() > Some(250), "{line}");
            assert_eq!(line["task"]["type"].as_str(), Some("worker"), "{line}");
            let errors = &line["errors"];
            let last = np - 1;
            let one = errors["one dtype"].as_str().unwrap_or_default();
            let other = if r == last { 0 } else { last };
            assert!(
                one.contains(&format!("but rank {other} called allreduce(float")),
                "{line}"
            );
            assert!(errors["order"]
                .as_str()
                .unwrap_or_default()
                .contains("barrier()"));
            for key in ["async dtype", "allgather shapes"] {
                let e = errors[key].as_str().unwrap_or_default();
                assert!(
                    e.contains(&format!("mpiflow: rank {r} called ")),
                    "{key}: {line}"
                );
            }
        }
    }
}

/// `mpiflow.symmetric` arrays: their allreduces (every op and dtype, odd sizes, in place,
/// into another, a view) the bits of the same calls on plain arrays, on every rank; a rank
/// of plain memory among symmetric ones and ranks asking for different shapes one
/// exception on every rank naming both sides, the collectives working after each.
#[test]
fn symmetric_arrays_reduce_as_plain_ones_and_mismatches_raise_on_every_rank() {
    for np in [2, 3, 4] {
        let Some(ranks) = ranks_of("symmetric.py", np, &[]) else {
            return;
        };
        let last = np - 1;
        for (r, line) in ranks.iter().enumerate() {
            assert_eq!(line["size"].as_u64(), Some(np as u64), "{line}");
            assert_eq!(line["failures"], serde_json::json!([]), "{line}");
            assert!(line["checks"].as_u64() > Some(200), "{line}");
            assert_eq!(line["left"], serde_json::json!([]), "{line}");
            let plain = line["errors"]["plain"].as_str().unwrap_or_default();
            let want = format!(
                "mpiflow: rank {r}: allreduce: rank {r}: allreduce mismatch: rank {last} passed \
                 4096 bytes of f32 (sum) where rank 0 passed 4096 bytes of f32 (sum) in symmetric memory"
            );
            assert!(plain.starts_with(&want), "{line}");
            let shapes = line["errors"]["shapes"].as_str().unwrap_or_default();
            assert!(
                shapes.starts_with(&format!("mpiflow: rank {r} called symmetric(shape=")),
                "{line}"
            );
        }
    }
}

/// mpiflow's package and mpi4py in one program, either initialising MPI first: the same
/// ranks, both allreduces right, and the job exits 0 (MPI finalised once: a second
/// `MPI_Finalize`, or none, is an error under mpirun).
#[test]
fn mpiflow_and_mpi4py_share_one_mpi_whichever_starts_it() {
    for order in ["mpi4py-first", "mpiflow-first"] {
        let Some(lines) = ranks_of("with_mpi4py.py", 3, &[order]) else {
            return;
        };
        for l in &lines {
            assert_eq!(l["rank"], l["mpi4py_rank"], "{order}: {l}");
            assert_eq!(l["size"].as_u64(), Some(3), "{order}: {l}");
            assert_eq!(
                l["ours"],
                serde_json::json!([6.0, 6.0, 6.0, 6.0]),
                "{order}: {l}"
            );
            assert_eq!(l["theirs"].as_u64(), Some(6), "{order}: {l}");
        }
    }
}

/// `mpiflow.init(comm=...)` with an mpi4py communicator: the world split in two halves, each
/// a job of its own (its ranks, its cluster of 1 ps and 1 worker, its allreduce's sum, a ps
/// session trained in each at once to the exact value of plain SGD); something that is no
/// communicator a TypeError and `MPI.COMM_NULL` an `mpiflow.Error`, each naming it.
#[test]
fn init_takes_an_mpi4py_communicator_whose_ranks_are_the_job() {
    let Some(lines) = ranks_of("with_comm.py", 4, &[]) else {
        return;
    };
    // 20 steps of w -= 0.25 (w - target) from 0: the largest target (7) times 0.75^20.
    let expected = 7.0 * 0.75f64.powi(20);
    for (r, l) in lines.iter().enumerate() {
        let half = r % 2;
        assert_eq!(l["mpiflow_rank"].as_u64(), Some((r / 2) as u64), "{l}");
        assert_eq!(l["size"].as_u64(), Some(2), "{l}");
        // The world ranks of the half, plus one: 1 + 3 (even) and 2 + 4 (odd).
        let sum = if half == 0 { 4.0 } else { 6.0 };
        assert_eq!(l["sum"], serde_json::json!([sum, sum, sum]), "{l}");
        assert_eq!(l["jobs"], serde_json::json!({"ps": 1, "worker": 1}), "{l}");
        let refused = l["refused"].as_array().unwrap();
        assert_eq!(
            refused[0].as_str(),
            Some("mpiflow.init: comm must be an mpi4py communicator (MPI.Comm), not str"),
            "{l}"
        );
        assert!(
            refused[1].as_str().unwrap().starts_with(&format!(
                "mpiflow: the communicator given on rank {r}: Fortran handle "
            )),
            "{l}"
        );
        if r / 2 == 1 {
            assert_eq!(l["task"], "worker:0", "{l}");
            assert_eq!(l["step"].as_u64(), Some(20), "{l}");
            let error = l["error"].as_f64().unwrap();
            assert!(
                (error - expected).abs() < 1e-5,
                "{error} vs {expected}: {l}"
            );
        } else {
            assert_eq!(l["task"], "ps:0", "{l}");
        }
    }
}

/// Embedding tables on two ps tasks from a Python session, with the variables on the ps
/// tasks too (mode "ps") and by allreduce among the workers (mode "hybrid"): a table of
/// 2^40 rows, rows pulled by both workers alike (ids on both ps, a repeated one), both
/// workers' sparse gradients applied by the ps tasks (SGD) within rounding, the variables
/// the same on both workers after two steps of SGD; rows asked for ahead land as a pull
/// gives them; landing rows not asked for (or others), an unknown table, a gradient of the
/// wrong shape and an id beyond the table raise on their worker, which then closes its
/// session normally. A second job restores the first's last checkpoint: the step, the
/// variables and the rows where the first left them.
#[test]
fn a_python_session_pulls_and_pushes_embedding_rows_on_the_ps_tasks() {
    let tmp = common::tmpdir("py-rows");
    for mode in ["ps", "hybrid"] {
        let dir = tmp.join(mode);
        let d = dir.to_str().unwrap();
        let Some(lines) = ranks_of("rows.py", 4, &[mode, d]) else {
            return;
        };
        let workers: Vec<&Value> = lines.iter().filter(|l| l.get("worst").is_some()).collect();
        assert_eq!(workers.len(), 2, "{mode}: {lines:?}");
        for l in &workers {
            assert_rows_session(l, workers[0]);
            // Two steps of SGD at 0.01 with a gradient of ones on each worker.
            for w in l["w"].as_array().unwrap() {
                assert!((w.as_f64().unwrap() + 0.02).abs() < 1e-6, "{mode}: {l}");
            }
        }
        let resumed = ranks_of("rows.py", 4, &[mode, d, "resume"]).unwrap();
        let resumed: Vec<&Value> = resumed.iter().filter(|l| l.get("rows").is_some()).collect();
        assert_eq!(resumed.len(), 2, "{mode}: {resumed:?}");
        for l in resumed {
            assert_eq!(l["first_step"].as_u64(), Some(2), "{mode}: {l}");
            assert_eq!(l["rows"], workers[0]["after"], "{mode}: {l}");
            assert_eq!(l["w"], workers[0]["w"], "{mode}: {l}");
        }
    }
}

/// Embedding tables over one-sided windows from a Python session (1 ps, 2 workers, modes
/// "ps" and "hybrid", transport "rma", the rows synchronous and asynchronous): each
/// worker's own rows, pushed in two calls, moved by exactly its push once the step is
/// taken, not before; in hybrid the variables summed by allreduce among the workers, the
/// same on both; an unknown table, a gradient of the wrong shape, an id beyond the table
/// and a close with rows pushed since the last step raise on their worker, whose session
/// goes on to the last step. A second job restores the last checkpoint and reads each
/// worker's rows and variables as it left them. A step's push beyond `push_rows` fails the
/// step on every worker with that worker's line; asynchronous tables with Adagrad are one
/// `ValueError` on every task.
#[test]
fn a_python_session_pushes_its_rows_into_one_sided_windows_and_resumes() {
    let tmp = common::tmpdir("py-rows-rma");
    for (mode, sync) in [
        ("ps", "async"),
        ("hybrid", "async"),
        ("ps", "sync"),
        ("hybrid", "sync"),
    ] {
        let d = tmp.join(format!("{mode}-{sync}"));
        let d = d.to_str().unwrap();
        let Some(lines) = ranks_of("rows_rma.py", 3, &[d, "train", mode, sync]) else {
            return;
        };
        let workers: Vec<&Value> = lines.iter().filter(|l| l.get("worst").is_some()).collect();
        assert_eq!(workers.len(), 2, "{mode} {sync}: {lines:?}");
        for l in &workers {
            assert_rows_over_windows(l);
            let w = l["w"].as_array().unwrap();
            // Six steps of SGD at 0.01 on the mean of the workers' gradients of ones (in
            // asynchronous ps training the steps are the workers' together, each read
            // when its worker's step began: not checked here).
            let six = |w: &Value| (w.as_f64().unwrap() + 0.06).abs() < 1e-6;
            assert!(
                (mode, sync) == ("ps", "async") || w.iter().all(six),
                "{mode} {sync}: {l}"
            );
        }
        let resumed = ranks_of("rows_rma.py", 3, &[d, "resume", mode, sync]).unwrap();
        let resumed: Vec<&Value> = resumed.iter().filter(|l| l.get("rows").is_some()).collect();
        assert_eq!(resumed.len(), 2, "{mode} {sync}: {resumed:?}");
        for l in resumed {
            let first = workers.iter().find(|w| w["task"] == l["task"]).unwrap();
            assert_eq!(l["first_step"].as_u64(), Some(6), "{mode} {sync}: {l}");
            assert_eq!(l["rows"], first["after"], "{mode} {sync}: {l}");
            if (mode, sync) != ("ps", "async") {
                assert_eq!(l["w"], first["w"], "{mode} {sync}: {l}");
            }
        }
    }
    let overflow = tmp.join("overflow");
    let overflow = overflow.to_str().unwrap();
    for mode in ["ps", "hybrid"] {
        let lines = ranks_of("rows_rma.py", 3, &[overflow, "overflow", mode, "sync"]).unwrap();
        // Every worker's line names worker:0; its own says why.
        for l in lines.iter().filter(|l| l["task"] != "ps:0") {
            let e = l["error"].as_str().unwrap_or_default();
            let why = l["task"] == "worker:1" || e.contains("more than its staging area holds (1)");
            assert!(e.contains("worker:0 (rank 1)") && why, "{mode}: {l}");
        }
    }
    let refused = tmp.join("refused");
    let refused = ranks_of(
        "rows_rma.py",
        3,
        &[refused.to_str().unwrap(), "refused", "hybrid", "async"],
    );
    for l in refused.unwrap() {
        let why = l["refused"].as_str().unwrap_or_default();
        assert!(why.contains("sparse_optimizer=\"sgd\""), "{l}");
    }
}

/// One worker's line of `rows_rma.py`'s first job.
fn assert_rows_over_windows(l: &Value) {
    assert!(l["worst"].as_f64().unwrap() < 1e-6, "{l}");
    assert!(l["moved"].as_f64().unwrap() > 0.1, "{l}");
    assert_eq!(l["unstepped"].as_f64(), Some(0.0), "{l}");
    assert_eq!(l["step"].as_u64(), Some(6), "{l}");
    let e = &l["errors"];
    let said = |k: &str| e[k].as_str().unwrap_or_default().to_string();
    assert!(said("table").contains("no embedding table 'nope'"), "{l}");
    assert!(said("shape").starts_with("ValueError"), "{l}");
    assert!(
        said("row").ends_with("is no row of its 1099511627776"),
        "{l}"
    );
    assert!(
        said("close").starts_with("ValueError") && said("close").ends_with("call push_pull first"),
        "{l}"
    );
}

/// One worker's line of `rows.py` (`first`: the first worker's).
fn assert_rows_session(l: &Value, first: &Value) {
    assert_eq!(l["shape"], serde_json::json!([5, 3]), "{l}");
    assert_eq!(l["repeated"], true, "{l}");
    assert_eq!(l["before"], first["before"], "{l}");
    assert!(l["worst"].as_f64().unwrap() < 1e-5, "{l}");
    assert!(l["moved"].as_f64().unwrap() > 1.0, "{l}");
    assert_eq!(l["step"].as_u64(), Some(2), "{l}");
    assert_eq!(l["ahead"], true, "{l}");
    let e = &l["errors"];
    assert!(
        e["land"]
            .as_str()
            .unwrap()
            .ends_with("land_rows: no rows were asked for ahead"),
        "{l}"
    );
    assert!(
        e["other"].as_str().unwrap().starts_with("ValueError")
            && e["other"]
                .as_str()
                .unwrap()
                .ends_with("land_rows: other tables or ids than pull_rows_ahead asked for"),
        "{l}"
    );
    assert!(
        e["table"]
            .as_str()
            .unwrap()
            .contains("no embedding table 'nope'"),
        "{l}"
    );
    assert!(
        e["shape"].as_str().unwrap().starts_with("ValueError"),
        "{l}"
    );
    assert!(
        e["row"]
            .as_str()
            .unwrap()
            .ends_with("pull_rows: table emb: id 1099511627776 is no row of its 1099511627776"),
        "{l}"
    );
}

/// A training session from Python over the ps tasks (1 ps, 2 workers; by messages and over
/// one-sided windows) and the allreduce (2 workers), the program's NumPy MLP handing in its gradients: the parameters equal
/// local training of the whole batch within 1e-4; a second job restores the first's
/// checkpoint and ends equal to training straight through; a float64 gradient on one
/// worker is a `TypeError` there and an `mpiflow.Error` naming it on every other task,
/// within seconds.
#[test]
fn a_python_session_trains_as_local_training_in_every_mode_and_resumes() {
    let tmp = common::tmpdir("py-session");
    let dir = tmp.to_str().unwrap();
    for (mode, np, workers) in [("ps", 3, 2), ("rma", 3, 2), ("allreduce", 2, 2)] {
        let run = |scenario: &str| {
            let d = format!("{dir}/{mode}");
            std::fs::create_dir_all(&d).unwrap();
            ranks_of("session.py", np, &[mode, scenario, &d])
        };
        let Some(equal) = run("equal") else {
            return;
        };
        let trained: Vec<&Value> = equal.iter().filter(|l| l["step"].is_u64()).collect();
        assert_eq!(trained.len(), workers, "{mode}: {equal:?}");
        for l in trained {
            assert_eq!(l["step"], 25, "{mode}: {l}");
            assert!(l["worst"].as_f64().unwrap() < 1e-4, "{mode}: {l}");
            assert!(
                l["last_loss"].as_f64() < l["first_loss"].as_f64(),
                "{mode}: {l}"
            );
        }
        for (scenario, first, last) in [("restore10", 0, 10), ("restore20", 10, 20)] {
            let ranks = run(scenario).unwrap();
            let trained: Vec<&Value> = ranks.iter().filter(|l| l["step"].is_u64()).collect();
            assert_eq!(trained.len(), workers, "{mode} {scenario}: {ranks:?}");
            for l in trained {
                assert_eq!(l["resumed_at"], first, "{mode} {scenario}: {l}");
                assert_eq!(l["step"], last, "{mode} {scenario}: {l}");
                assert_eq!(l["checkpoint"], format!("ckpt-{last}"), "{l}");
                assert!(
                    l["worst"].as_f64().unwrap() < 1e-4,
                    "{mode} {scenario}: {l}"
                );
            }
        }
        // Asynchronous (the ps modes), and synchronous with a backup worker (the ps over
        // messages; one-sided windows aggregate every worker): the last step reached on
        // every worker (async: at least), its loss fallen.
        let others: &[&str] = match mode {
            "ps" => &["async", "backup"],
            "rma" => &["async"],
            _ => &[],
        };
        for scenario in others {
            let ranks = run(scenario).unwrap();
            let trained: Vec<&Value> = ranks.iter().filter(|l| l["step"].is_u64()).collect();
            assert_eq!(trained.len(), workers, "{mode} {scenario}: {ranks:?}");
            for l in trained {
                assert!(l["step"].as_u64() >= Some(60), "{mode} {scenario}: {l}");
                assert!(l["last_loss"].as_f64() < l["first_loss"].as_f64(), "{l}");
            }
        }
        let bad = run("bad").unwrap();
        let why = match mode {
            // A gradient missing from the dict: the session refuses the step.
            "allreduce" => {
                "push_pull: gradients missing for ['w2'], given for unknown variables []"
            }
            _ => "push_pull: the gradient of 'w2' is float64, the variable is float32",
        };
        for l in &bad {
            let line = l["line"].as_str().unwrap_or_default();
            assert!(l["secs"].as_f64().unwrap() < 10.0, "{mode}: {l}");
            let culprit = l["task"] == "worker:1";
            let want = match (culprit, mode) {
                (true, "allreduce") => "ValueError",
                (true, _) => "TypeError",
                (false, _) => "Error",
            };
            assert_eq!(l["raised"], want, "{mode}: {l}");
            match (culprit, mode) {
                (true, _) => assert!(line.ends_with(why), "{l}"),
                (false, "ps") => {
                    assert!(line.contains("worker:1 (rank 2): model external"), "{l}");
                    assert!(line.ends_with(why), "{l}");
                }
                // The one-sided ps names the worker and the step (its line says why).
                (false, "rma") => {
                    assert!(line.contains("worker:1 (rank 2) ended at step 3"), "{l}")
                }
                // Allreduce: the step's agreement carries the failing replica's reason.
                (false, _) => {
                    assert!(
                        line.contains("step 3 failed on 1 of 2 replicas; replica 1: "),
                        "{l}"
                    );
                    assert!(line.ends_with(why), "{l}");
                }
            }
        }
    }
}

/// The seeds' trainer.py in Python (`examples/python/trainer.py`: its NumPy MLP on the
/// ps tasks): it learns the digits; SIGUSR1 to mpirun stops both workers at one step with
/// a checkpoint of it (exit 75), and the same command with a nearer end resumes there.
#[test]
fn the_seeds_trainer_in_python_learns_and_resumes_after_a_signal() {
    let Some(python) = common::python_with_mpi4py() else {
        return;
    };
    let trainer = format!("{}/examples/python/trainer.py", common::root());
    let learnt = common::mpirun(&["-np", "3", &python, &trainer, "--steps", "600"]);
    assert_eq!(learnt.code, 0, "{learnt:?}");
    let accuracy: f64 = common::accuracy(&learnt.stdout);
    assert!(accuracy > 0.9, "{learnt:?}");

    let dir = common::tmpdir("py-trainer-signal");
    let c = dir.to_str().unwrap();
    let args = ["-np", "3", &python, &trainer, "--checkpoint_dir", c];
    let long = [&args[..], &["--steps", "1000000"]].concat();
    let (text, code) = common::with_rank_when(
        &long,
        None,
        |out| out.contains("step    400 "),
        |_, mpirun| common::signal(mpirun, "-USR1"),
    );
    assert_eq!(code, Some(75), "{text}");
    let stops: Vec<&str> = text.lines().filter(|l| l.contains("stopped by")).collect();
    assert_eq!(stops.len(), 2, "one line per worker: {text}");
    let step = common::step_of_stop(stops[0]).unwrap_or_else(|| panic!("{text}"));
    for line in &stops {
        assert!(
            line.contains(&format!(
                "stopped by SIGUSR1 at step {step}, checkpoint {c}/ckpt-{step}"
            )),
            "{text}"
        );
    }
    let end = (step + 200).to_string();
    let again = [&args[..], &["--steps", &end]].concat();
    let resumed = common::mpirun(&again);
    assert_eq!(resumed.code, 0, "{resumed:?}");
    assert!(
        resumed
            .stdout
            .contains(&format!("ckpt-{step} (global step {step})")),
        "{resumed:?}"
    );
    assert!(common::accuracy(&resumed.stdout) > 0.9, "{resumed:?}");
}

/// `mpiflow.torch` (where PyTorch is installed: `benches/python/torch-venv.sh`): models of
/// different seeds equal after `broadcast_parameters`; a small MLP trained on each
/// worker's share of a batch by `DistributedOptimizer` (several buckets, reduced during the
/// backward pass) and by `PsOptimizer` over a ps task equals the model trained on the whole
/// batch in one process within 1e-4.
#[test]
fn pytorch_trains_by_mpiflows_allreduce_and_ps_as_on_the_whole_batch() {
    let Some(python) = common::python_with_torch() else {
        return;
    };
    for (mode, workers) in [("allreduce", 3), ("ps", 2)] {
        let ranks = ranks_in(python.clone(), "torch_optim.py", 3, &[mode]).unwrap();
        let trained: Vec<&Value> = ranks.iter().filter(|l| l["worst"].is_f64()).collect();
        assert_eq!(trained.len(), workers, "{mode}: {ranks:?}");
        for l in trained {
            assert!(l["worst"].as_f64().unwrap() < 1e-4, "{mode}: {l}");
            if mode == "allreduce" {
                assert_eq!(l["broadcast_equal"], true, "{l}");
            } else {
                assert_eq!(l["step"], 20, "{l}");
            }
        }
    }
}

/// `examples/python/torch_fashion.py` (where PyTorch is installed): the PyTorch CNN
/// learns Fashion-MNIST to 80% held-out accuracy in 250 steps by mpiflow's allreduce (2
/// workers) and by its ps (1 ps, 2 workers).
#[test]
fn pytorch_cnn_learns_fashion_mnist_by_allreduce_and_by_ps() {
    let Some(python) = common::python_with_torch() else {
        return;
    };
    let example = format!("{}/examples/python/torch_fashion.py", common::root());
    for (mode, np) in [("allreduce", "2"), ("ps", "3")] {
        let run = common::mpirun(&[
            "-np", np, &python, &example, "--mode", mode, "--steps", "250",
        ]);
        assert_eq!(run.code, 0, "{mode}: {run:?}");
        let accuracy = common::accuracy(&run.stdout);
        assert!(accuracy > 0.8, "{mode}: {run:?}");
    }
}

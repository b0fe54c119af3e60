//! `mpiflow launch` of TensorFlow-1-style jobs under real `mpirun`: ps tasks that block
//! forever (as `server.join()` does) end when the workers are done, a failing worker ends
//! the job with its status and name, signals reach the programs, and `--ps-lifetime
//! forever` keeps TensorFlow's behaviour. Programs that themselves use MPI (a C allreduce,
//! mpi4py) run under `launch` as their ranks, and their jobs end too when the ps tasks
//! wait for ever.

mod common;

use std::time::{Duration, Instant};

use common::{mpiflow, mpirun};

fn checker() -> String {
    format!("{}/launcher/examples/check_role.py", common::root())
}

/// `mpirun -np N mpiflow launch --ps 1 LAUNCH_ARGS -- PROGRAM...` and its wall time.
fn launch(np: &str, launch_args: &[&str], program: &[&str]) -> (common::Run, Duration) {
    let flags = [&["--ps", "1"][..], launch_args].concat();
    let t = Instant::now();
    let run = launch_with(np, &flags, program);
    (run, t.elapsed())
}

#[test]
fn a_tf1_job_ends_when_its_workers_are_done() {
    let c = checker();
    let ready = common::tmpdir("tf1-ps-ready");
    let ready = ready.to_str().unwrap();
    let (run, took) = launch(
        "4",
        &[],
        &["python3", &c, "--join", "--sleep", "1", "--ps-ready", ready],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let mut roles: Vec<String> = run
        .json_lines()
        .iter()
        .map(|l| format!("{}:{}", l["type"].as_str().unwrap(), l["index"]))
        .collect();
    roles.sort();
    assert_eq!(roles, ["ps:0", "worker:0", "worker:1", "worker:2"]);
    assert!(
        run.stderr
            .contains("mpiflow launch: every worker and chief task is done; stopping ps:0"),
        "{run:?}"
    );
    // The workers take 1 s; the whole job (start-up included) ends within seconds.
    assert!(took < Duration::from_secs(20), "took {took:?}: {run:?}");
}

#[test]
fn a_failing_worker_ends_the_job_with_its_status_and_name() {
    let c = checker();
    let (run, took) = launch(
        "4",
        &[],
        &[
            "python3",
            &c,
            "--join",
            "--sleep",
            "60",
            "--exit",
            "worker:1=3",
        ],
    );
    assert_eq!(run.code, 3, "{run:?}");
    assert!(
        run.stderr.contains(
            "mpiflow launch: worker:1 (rank 2) exited with status 3; stopping the job's other tasks"
        ),
        "{run:?}"
    );
    // The other workers would have worked 60 s: they were stopped.
    assert!(took < Duration::from_secs(30), "took {took:?}: {run:?}");
}

#[test]
fn a_ps_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let ps_ignores_term = "if [ \"$MPIFLOW_JOB\" = ps ]; then trap '' TERM; \
                           while :; do sleep 0.1; done; fi; exit 0";
    let (run, took) = launch("3", &["--stop-grace", "1"], &["sh", "-c", ps_ignores_term]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(took < Duration::from_secs(20), "took {took:?}: {run:?}");
}

#[test]
fn signals_sent_to_the_job_reach_every_program_once() {
    // mpirun passes SIGUSR1 on to each task's process group (program included); a launcher
    // passes on only what reached it alone, so every program counts one.
    let c = checker();
    let ready = common::tmpdir("usr1-ps-ready");
    let ready = ready.to_str().unwrap();
    for extra in [
        &[][..],
        &["--mca", "odls_base_signal_direct_children_only", "1"],
    ] {
        let mut args = extra.to_vec();
        args.extend(["-np", "3", mpiflow(), "launch", "--ps", "1", "--"]);
        // The workers end after the ps's line (their ending stops the ps).
        args.extend(["python3", &c, "--count-usr1", "1.5", "--ps-ready", ready]);
        let _ = std::fs::remove_file(format!("{ready}/ps.0"));
        let (text, code) = common::with_rank_when(
            &args,
            None,
            |out| out.matches("\"type\"").count() >= 3,
            |_, mpirun| common::signal(mpirun, "-USR1"),
        );
        assert_eq!(code, Some(0), "{extra:?}: {text}");
        let got = common::usr1_counts(&text);
        assert_eq!(
            got,
            ["ps:0 1", "worker:0 1", "worker:1 1"],
            "{extra:?}: {text}"
        );
    }
}

#[test]
fn ps_lifetime_forever_keeps_tensorflows_behaviour() {
    let _guard = common::lock();
    let c = checker();
    let t = Instant::now();
    let out = common::bounded(8)
        .args(["mpirun", "--oversubscribe", "-np", "3"])
        .args([mpiflow(), "launch", "--ps", "1", "--ps-lifetime", "forever"])
        .args(["--", "python3", &c, "--join"])
        .output()
        .expect("run mpirun");
    // The workers are done at once, the ps joins until the timeout ends the job.
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    assert!(t.elapsed() >= Duration::from_secs(8));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().filter(|l| l.starts_with('{')).count(), 3);
}

#[test]
fn bad_lifetime_flags_are_one_line_errors_and_idle_ones_warnings() {
    for (flag, want) in [
        (
            "--ps-lifetime=sometimes",
            "invalid value 'sometimes' for '--ps-lifetime",
        ),
        (
            "--stop-grace=-1",
            "\"-1\" is not a number of seconds from 0 to 3600",
        ),
    ] {
        let run = mpirun(&[
            "-np",
            "2",
            mpiflow(),
            "launch",
            "--ps",
            "1",
            flag,
            "--",
            "true",
        ]);
        assert_ne!(run.code, 0, "{run:?}");
        assert!(run.stderr.contains(want), "{run:?}");
        assert!(!run.stderr.contains("panicked"), "{run:?}");
    }
    // A flag with nothing to do runs the job and says so, once.
    let (run, _) = launch("2", &["--stop-evaluator"], &["true"]);
    assert_eq!(run.code, 0, "{run:?}");
    let warning =
        "mpiflow: warning: --stop-evaluator stops nothing here: the cluster has no evaluator task";
    assert_eq!(run.stderr.matches(warning).count(), 1, "{run:?}");
}

/// A program that initialises MPI itself, launched as each rank's task: `launch` learns
/// the cluster from mpirun's variables without initialising MPI, so the program's own
/// `MPI_Init` works, its world is the whole job, and it sees its task.
#[test]
fn an_mpi_program_runs_as_its_rank_under_launch() {
    let dir = common::tmpdir("launch-mpi-program");
    let bin = common::mpi_program(&dir);
    // Alone (the launcher becomes the program), and with a ps task (the launchers stay as
    // their programs' parents and supervise them over a socket of their own, not MPI).
    let jobs = [
        ("0", ["worker:0", "worker:1", "worker:2"]),
        ("1", ["ps:0", "worker:0", "worker:1"]),
    ];
    for (ps, tasks) in jobs {
        let out = mpirun(&["-np", "3", mpiflow(), "launch", "--ps", ps, "--", &bin]);
        assert_eq!(out.code, 0, "--ps {ps}: {out:?}");
        common::assert_mpi_program_ran(&out, &tasks);
    }
}

/// `mpirun -np N mpiflow launch FLAGS -- PROGRAM...`.
fn launch_with(np: &str, flags: &[&str], program: &[&str]) -> common::Run {
    let mut args = vec!["-np", np, mpiflow(), "launch"];
    args.extend_from_slice(flags);
    args.push("--");
    args.extend_from_slice(program);
    mpirun(&args)
}

/// MPI programs whose ps tasks wait for ever without finalising MPI (as `server.join()`
/// does), which would keep the workers in `MPI_Finalize`: the job ends when the workers
/// are done, with status 0, every rank having run (C, and mpi4py with the seeds' flags).
#[test]
fn mpi_programs_end_when_their_ps_tasks_join_forever() {
    let dir = common::tmpdir("launch-mpi-joins");
    let c = common::mpi_program(&dir);
    let out = launch_with("3", &["--ps", "1"], &[&c, "--ps-joins"]);
    assert_eq!(out.code, 0, "{out:?}");
    common::assert_mpi_program_ran(&out, &["ps:0", "worker:0", "worker:1"]);
    let Some(python) = common::python_with_mpi4py() else {
        return;
    };
    let script = common::mpi4py_program();
    let flags = ["--ps", "2", "--legacy-flags"];
    let out = launch_with("4", &flags, &[&python, &script, "--ps-joins"]);
    assert_eq!(out.code, 0, "{out:?}");
    common::assert_mpi_program_ran(&out, &["ps:0", "ps:1", "worker:0", "worker:1"]);
}

/// mpi4py under `launch`: alone (the launcher becomes the program) and with a ps task;
/// a worker that exits 3 after using MPI ends the job with its status and name, while
/// the ps task waits for ever.
#[test]
fn mpi4py_programs_run_as_their_ranks_and_fail_as_their_tasks() {
    let Some(python) = common::python_with_mpi4py() else {
        return;
    };
    let script = common::mpi4py_program();
    for (ps, tasks) in [
        ("0", ["worker:0", "worker:1", "worker:2"]),
        ("1", ["ps:0", "worker:0", "worker:1"]),
    ] {
        let out = launch_with("3", &["--ps", ps], &[&python, &script]);
        assert_eq!(out.code, 0, "--ps {ps}: {out:?}");
        common::assert_mpi_program_ran(&out, &tasks);
    }
    let (out, took) = launch("3", &[], &[&python, &script, "--ps-joins", "--exit", "3"]);
    assert_eq!(out.code, 3, "{out:?}");
    let named = "mpiflow launch: worker:1 (rank 2) exited with status 3";
    assert_eq!(out.stderr.matches(named).count(), 1, "{out:?}");
    assert!(took < Duration::from_secs(60), "took {took:?}: {out:?}");
}

/// A program on mpiflow's own Python package under `launch`, with a ps task that waits
/// for ever: every task's package takes its role from the TF_CONFIG launch exported, the
/// allreduce spans the whole job, and the job ends with the workers.
#[test]
fn a_program_on_mpiflows_python_package_runs_under_launch() {
    let Some(python) = common::python_with_mpi4py() else {
        return;
    };
    let script = format!("{}/tests/python/launched.py", common::root());
    let out = launch_with("3", &["--ps", "1"], &[&python, &script]);
    assert_eq!(out.code, 0, "{out:?}");
    let mut lines = out.json_lines();
    lines.sort_by_key(|l| l["rank"].as_u64());
    let tasks: Vec<(String, u64)> = lines
        .iter()
        .map(|l| {
            let t = &l["task"];
            (
                t["type"].as_str().unwrap_or("").to_string(),
                t["index"].as_u64().unwrap_or(9),
            )
        })
        .collect();
    let want = [("ps", 0), ("worker", 0), ("worker", 1)].map(|(j, i)| (j.to_string(), i));
    assert_eq!(tasks, want, "{out:?}");
    for l in &lines {
        assert_eq!(l["size"].as_u64(), Some(3), "{l}");
        assert_eq!(
            l["sum"],
            serde_json::json!([6.0, 6.0, 6.0, 6.0, 6.0]),
            "{l}"
        );
        assert_eq!(l["ps"].as_array().map(Vec::len), Some(1), "{l}");
    }
}

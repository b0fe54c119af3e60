//! Helpers for tests that run the real `mpiflow` binary, under real `mpirun` or alone.
//!
//! Every run is bounded by coreutils' `timeout` (a hang fails the test instead of CI),
//! and `mpirun` runs are serialised by a lock so a test binary never starts two at once.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};

use serde_json::Value;

static MPIRUN_LOCK: Mutex<()> = Mutex::new(());

pub fn mpiflow() -> &'static str {
    env!("CARGO_BIN_EXE_mpiflow")
}

pub fn root() -> &'static str {
    env!("CARGO_MANIFEST_DIR")
}

/// The result of one run.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Lines of stdout that are JSON objects, parsed.
    pub fn json_lines(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
            .collect()
    }

    /// The `mpiflow: ...` lines of stderr.
    pub fn error_lines(&self) -> Vec<&str> {
        self.stderr
            .lines()
            .filter(|l| l.starts_with("mpiflow:"))
            .collect()
    }

    /// Asserts a clean failure: non-zero, exactly one `mpiflow:` line containing `want`,
    /// and no panic or backtrace.
    pub fn assert_one_line_error(&self, want: &str) {
        assert_ne!(self.code, 0, "expected failure: {self:?}");
        let errs = self.error_lines();
        assert_eq!(errs.len(), 1, "expected one error line: {self:?}");
        assert!(errs[0].contains(want), "error {:?} lacks {want:?}", errs[0]);
        assert!(
            !self.stderr.contains("panicked") && !self.stderr.contains("stack backtrace"),
            "panic: {}",
            self.stderr
        );
    }
}

pub fn lock() -> MutexGuard<'static, ()> {
    MPIRUN_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// `timeout -k 5 SECS`, to which the caller adds its command: every process a test starts
/// is bounded. It runs from the repository's root, with Open MPI's leave to run as root,
/// and outside any job the test itself runs in (no `TF_CONFIG`, Slurm, Open MPI or PMIx
/// variables).
pub fn bounded(secs: u32) -> Command {
    let mut c = Command::new("timeout");
    c.arg("-k").arg("5").arg(secs.to_string());
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env_remove("TF_CONFIG")
        .current_dir(root());
    for (k, _) in std::env::vars() {
        if k.starts_with("SLURM_") || k.starts_with("OMPI_COMM_WORLD") || k.starts_with("PMIX_") {
            c.env_remove(k);
        }
    }
    c
}

/// True when this test runs as root. Otherwise the test is skipped (saying it needs root
/// for `what`), or fails where the environment requires every test to run
/// (`MPIFLOW_REQUIRE_ROOT=1`: the test command sets it as root, so a test that would
/// skip there fails instead).
pub fn as_root(what: &str) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var("MPIFLOW_REQUIRE_ROOT").as_deref() != Ok("1"),
        "MPIFLOW_REQUIRE_ROOT=1, but {what} needs root"
    );
    eprintln!("skipped: {what} needs root");
    false
}

/// Runs `cmd` under `timeout -k 5 SECS` ([`bounded`]); a timeout fails the test.
pub fn run_bounded(secs: u32, cmd: &[&str], env: &[(&str, &str)]) -> Run {
    let mut c = bounded(secs);
    c.args(cmd);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run timeout(1)");
    let run = Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(
        run.code != 124 && run.code != 137,
        "timed out after {secs}s (a hang): {cmd:?}\n{run:?}"
    );
    run
}

/// `mpirun --oversubscribe ARGS...` with a time bound.
///
/// (When a rank exits non-zero mpirun waits a second before it ends the job, its
/// `odls_base_sigkill_timeout`, even when every rank already ended on its own. At 0, Open
/// MPI 4.1's mpirun hung in 5 of 25 jobs of one such test here, and crashed in another: the
/// tests keep the default.)
/// `mpirun` arguments of one process per task of `tasks` (job, index), each with its own
/// `TF_CONFIG` (`cluster`: the `"cluster": {...}` member) running `program` (its path
/// and arguments): the MPMD form, `-np 1 -x TF_CONFIG=... program : -np 1 ...`.
pub fn tf_config_processes(
    cluster: &str,
    tasks: &[(&str, usize)],
    program: &[&str],
) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    for (i, (job, index)) in tasks.iter().enumerate() {
        if i > 0 {
            args.push(":".into());
        }
        let tf =
            format!(r#"TF_CONFIG={{{cluster}, "task": {{"type": "{job}", "index": {index}}}}}"#);
        args.extend(["-np".into(), "1".into(), "-x".into(), tf]);
        args.extend(program.iter().map(|a| a.to_string()));
    }
    args
}

pub fn mpirun(args: &[&str]) -> Run {
    let _guard = lock();
    let mut cmd = vec!["mpirun", "--oversubscribe"];
    cmd.extend_from_slice(args);
    run_bounded(120, &cmd, &[])
}

/// `mpiflow ARGS...` alone (no MPI launcher), with extra environment.
pub fn mpiflow_alone(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = vec![mpiflow()];
    cmd.extend_from_slice(args);
    run_bounded(60, &cmd, env)
}

/// `mpiflow train --mode local --steps STEPS --save-params OUT`, which must succeed: the
/// reference distributed training is compared with.
pub fn train_local_reference(steps: &str, out: &std::path::Path, extra: &[&str]) {
    let mut args = vec![
        "train",
        "--mode",
        "local",
        "--steps",
        steps,
        "--save-params",
    ];
    args.push(out.to_str().unwrap());
    args.extend_from_slice(extra);
    let run = mpiflow_alone(&args, &[]);
    assert_eq!(run.code, 0, "{run:?}");
}

/// The one-sided ps against local training: `mpirun -np 5 mpiflow BEFORE... train --mode
/// ps --transport rma` for 60 steps, three workers sharing a batch of 64 unevenly (21, 21,
/// 22), variables sliced over 2 ps. Asserts success and parameters equal to local
/// training's within 1e-4 relative (the ps sums n_i x gradient_i by MPI_Accumulate in
/// arrival order, then divides: float32 rounding only, which Adam carries through 60
/// steps); returns the run.
pub fn one_sided_sync_equals_local(name: &str, before: &[&str]) -> Run {
    let dir = tmpdir(name);
    let (a, b) = (dir.join("local.bin"), dir.join("rma.bin"));
    train_local_reference("60", &a, &[]);
    let mut args = vec!["-np", "5", mpiflow()];
    args.extend_from_slice(before);
    let out = b.to_str().unwrap();
    args.extend_from_slice(&["train", "--mode", "ps", "--transport", "rma", "--ps", "2"]);
    args.extend_from_slice(&["--steps", "60", "--var-placement", "partition"]);
    args.extend_from_slice(&["--partition-bytes", "8192", "--save-params", out]);
    let run = mpirun(&args);
    assert_eq!(run.code, 0, "{run:?}");
    let worst = max_relative_difference(&a, &b);
    assert!(worst < 1e-4, "largest relative difference {worst}");
    run
}

/// This machine's host name, as MPI reports it.
pub fn hostname() -> String {
    mpiflow::cluster::resolve::hostname().expect("gethostname")
}

/// The step a stop line names (`... stopped by SIGUSR1 at step 7659, checkpoint ...`).
pub fn step_of_stop(line: &str) -> Option<u64> {
    let after = line.split(" at step ").nth(1)?;
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The held-out accuracy on the `accuracy ...` line of a training run.
pub fn accuracy(stdout: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("accuracy "))
        .unwrap_or_else(|| panic!("no accuracy line in {stdout}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A fresh temporary directory for one test, removed when it goes out of scope, unless
/// the test is failing (a panic is unwinding) or [`TempDir::keep`] was called: then it
/// stays, and its path is said, for whoever reads the failure.
pub fn tmpdir(name: &str) -> TempDir {
    let d = std::env::temp_dir().join(format!("mpiflow-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TempDir {
        path: d,
        keep: false,
    }
}

/// See [`tmpdir`].
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    /// Keeps the directory when this is dropped.
    pub fn keep(&mut self) {
        self.keep = true;
    }
}

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.keep || std::thread::panicking() {
            eprintln!("test files kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Largest |a - b| / (1 + |a|) over every parameter of two saved parameter files.
pub fn max_relative_difference(a: &std::path::Path, b: &std::path::Path) -> f32 {
    use mpiflow::train::checkpoint::read_file;
    let (x, y) = (read_file(a, None).unwrap(), read_file(b, None).unwrap());
    assert_eq!(x.arrays.len(), y.arrays.len());
    let mut worst = 0.0f32;
    for (name, va) in &x.arrays {
        let vb = y.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(va.len(), vb.len(), "{name}");
        for (p, q) in va.iter().zip(vb) {
            worst = worst.max((p - q).abs() / (1.0 + p.abs()));
        }
    }
    worst
}

/// Starts `mpirun ARGS`, waits for `marker` to exist, SIGKILLs the last rank, and waits for
/// the job to end; returns whether it succeeded (it must not).
pub fn kill_one_rank_when(args: &[&str], marker: &std::path::Path) -> bool {
    kill_rank_when(args, None, |_| marker.exists()).2
}

/// Runs `mpirun --oversubscribe ARGS` (ARGS start with `-np N`, a `train` that logs its
/// steps), SIGKILLs rank `victim` once training is under way (a `step` line is out), and
/// waits for the job to end. Returns everything it printed, the seconds from the kill
/// until it ended, and whether it exited successfully.
pub fn kill_rank_after_start(args: &[&str], victim: usize) -> (String, f64, bool) {
    kill_rank_when(args, Some(victim), |out| {
        out.lines().any(|l| l.starts_with("step "))
    })
}

/// SIGKILLs rank `victim` (the last rank if `None`) once `ready(stdout so far)` holds
/// (within 60 s).
fn kill_rank_when(
    args: &[&str],
    victim: Option<usize>,
    ready: impl Fn(&str) -> bool,
) -> (String, f64, bool) {
    let mut killed = None;
    let (text, code) = with_rank_when(args, victim, ready, |pid, _| {
        killed = Some(std::time::Instant::now());
        signal(pid, "-KILL");
    });
    let secs = killed.expect("killed").elapsed().as_secs_f64();
    (text, secs, code == Some(0))
}

/// `kill SIGNAL PID`.
pub fn signal(pid: u32, signal: &str) {
    Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
}

/// Runs `mpirun --oversubscribe ARGS` (bounded); once `ready(stdout so far)` holds
/// (within 60 s), calls `act(pid of rank victim, pid of mpirun)` (the last rank if `None`)
/// and waits for the job to end. Returns everything it printed and mpirun's exit code.
pub fn with_rank_when(
    args: &[&str],
    victim: Option<usize>,
    ready: impl Fn(&str) -> bool,
    act: impl FnOnce(u32, u32),
) -> (String, Option<i32>) {
    let _g = lock();
    let mut child = bounded(90)
        .args(["mpirun", "--oversubscribe"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Both streams read as they come (a full pipe would stop the job), stdout kept
    // where `ready` can see it.
    let read_all = |pipe: Box<dyn std::io::Read + Send>| {
        let text = std::sync::Arc::new(Mutex::new(Vec::new()));
        let sink = text.clone();
        let reader = std::thread::spawn(move || {
            let mut pipe = pipe;
            let mut buf = [0u8; 4096];
            loop {
                match pipe.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => sink.lock().unwrap().extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
            }
        });
        (text, reader)
    };
    let (stdout, out_reader) = read_all(Box::new(child.stdout.take().unwrap()));
    let (stderr, err_reader) = read_all(Box::new(child.stderr.take().unwrap()));
    let so_far = || String::from_utf8_lossy(&stdout.lock().unwrap()).into_owned();
    let waiting = std::time::Instant::now();
    while !ready(&so_far()) {
        // A job that ended before it was ready (what it printed last read first): said
        // at once, with how it ended.
        let ended = child.try_wait().ok().flatten();
        if ended.is_some() {
            std::thread::sleep(std::time::Duration::from_millis(500));
            if ready(&so_far()) {
                break;
            }
        }
        if ended.is_some() || waiting.elapsed() > std::time::Duration::from_secs(60) {
            // What the job said so far: where it was when it should have been ready.
            let tail = |text: String| {
                let skip = text.chars().count().saturating_sub(3000);
                text.chars().skip(skip).collect::<String>()
            };
            let err = String::from_utf8_lossy(&stderr.lock().unwrap()).into_owned();
            panic!(
                "the job never got ready to be killed within 60 s (ended: {ended:?})\n--- stdout\n{}\n--- stderr\n{}",
                tail(so_far()),
                tail(err)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let children = |pid: &str| -> Vec<u32> {
        let out = Command::new("pgrep").args(["-P", pid]).output().unwrap();
        let mut v: Vec<u32> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.parse().ok())
            .collect();
        v.sort_unstable();
        v
    };
    let mpirun = children(&child.id().to_string());
    // Each rank's number, from the environment mpirun gave it.
    let rank_of = |pid: u32| -> Option<usize> {
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        env.split(|b| *b == 0)
            .find_map(|kv| kv.strip_prefix(b"OMPI_COMM_WORLD_RANK="))
            .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
    };
    let ranks = || -> Vec<(usize, u32)> {
        children(&mpirun.first().expect("mpirun runs").to_string())
            .iter()
            .filter_map(|p| rank_of(*p).map(|r| (r, *p)))
            .collect()
    };
    // A rank named in advance may not have started yet on a loaded machine.
    let found = std::time::Instant::now();
    let mut seen = ranks();
    while victim.is_some_and(|v| seen.iter().all(|(r, _)| *r != v))
        && found.elapsed() < std::time::Duration::from_secs(20)
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
        seen = ranks();
    }
    let victim = victim.unwrap_or(seen.len().saturating_sub(1));
    let pid = seen
        .iter()
        .find(|(r, _)| *r == victim)
        .unwrap_or_else(|| panic!("rank {victim} among {seen:?}"))
        .1;
    act(pid, mpirun[0]);
    let status = child.wait().unwrap();
    out_reader.join().unwrap();
    err_reader.join().unwrap();
    let text = format!(
        "{}{}",
        so_far(),
        String::from_utf8_lossy(&stderr.lock().unwrap())
    );
    (text, status.code())
}

/// The `{"usr1": N, "type": T, "index": I}` lines of `check_role.py --count-usr1` in
/// `output`, as sorted `T:I N`.
pub fn usr1_counts(output: &str) -> Vec<String> {
    let mut counts: Vec<String> = output
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l.get("usr1").is_some())
        .map(|l| {
            format!(
                "{}:{} {}",
                l["type"].as_str().unwrap_or("?"),
                l["index"],
                l["usr1"]
            )
        })
        .collect();
    counts.sort();
    counts
}

/// `launcher/examples/mpi_allreduce.c`, a program that initialises MPI itself, built by
/// `mpicc` into `dir`; its path.
pub fn mpi_program(dir: &Path) -> String {
    let program = dir.join("mpi_allreduce").display().to_string();
    let source = format!("{}/launcher/examples/mpi_allreduce.c", root());
    let built = run_bounded(120, &["mpicc", "-O2", "-o", &program, &source], &[]);
    assert_eq!(built.code, 0, "mpicc: {built:?}");
    program
}

/// The Python with mpi4py that `scripts/venv.sh` made (`MPIFLOW_PYTHON`, else
/// `target/venv/bin/python`), or `None`: the test is then skipped, or fails where the
/// environment requires it (`MPIFLOW_REQUIRE_PYTHON=1`, as the test command sets).
pub fn python_with_mpi4py() -> Option<String> {
    let python = std::env::var("MPIFLOW_PYTHON")
        .unwrap_or_else(|_| format!("{}/target/venv/bin/python", root()));
    let found = Path::new(&python).exists();
    assert!(
        found || std::env::var("MPIFLOW_REQUIRE_PYTHON").as_deref() != Ok("1"),
        "MPIFLOW_REQUIRE_PYTHON=1, but {python} does not exist (scripts/venv.sh makes it)"
    );
    if !found {
        eprintln!("skipped: no Python with mpi4py at {python} (run scripts/venv.sh)");
    }
    found.then_some(python)
}

/// The Python with PyTorch (and mpiflow's package) that `benches/python/torch-venv.sh`
/// makes outside the repository: `$MPIFLOW_TORCH_PYTHON`, else that script's default
/// place; `None` (the PyTorch tests are skipped) where there is none.
pub fn python_with_torch() -> Option<String> {
    let python = std::env::var("MPIFLOW_TORCH_PYTHON").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_default();
        format!("{home}/.cache/mpiflow/torch-venv/bin/python")
    });
    let found = Path::new(&python).exists();
    if !found {
        eprintln!("skipped: no Python with PyTorch at {python} (benches/python/torch-venv.sh)");
    }
    found.then_some(python)
}

/// `launcher/examples/mpi4py_task.py`, [`mpi_program`]'s twin in Python.
pub fn mpi4py_program() -> String {
    format!("{}/launcher/examples/mpi4py_task.py", root())
}

/// What [`mpi_program`] printed on each rank of a job of `tasks.len()` ranks (rank r has
/// task `tasks[r]`): a world of the whole job that summed every rank's `r + 1`.
pub fn assert_mpi_program_ran(out: &Run, tasks: &[impl AsRef<str>]) {
    let n = tasks.len();
    let mut lines: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("rank "))
        .collect();
    lines.sort();
    let sum = n * (n + 1) / 2;
    let want: Vec<String> = (0..n)
        .map(|r| {
            let task = tasks[r].as_ref();
            format!("rank {r} size {n} sum {sum} task {task} tf_config yes")
        })
        .collect();
    assert_eq!(lines, want, "{out:?}");
}

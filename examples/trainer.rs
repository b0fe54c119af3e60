//! The seeds' `trainer.py`, in Rust with mpiflow: the same program on every task.
//!
//! ```text
//! mpirun -np 4 target/release/examples/trainer                     # roles from MPI: 1 ps, 3 workers
//! mpirun -np 1 trainer --ps_hosts=localhost:2222 --worker_hosts=localhost:2223 \
//!        --job_name=ps --task_index=0 : -np 1 trainer ... --job_name=worker --task_index=0
//! TF_CONFIG='{"cluster": ..., "task": ...}' trainer                 # per process, under an MPI launcher
//! ```
//! Options: `--steps N` (default 1000), `--async`, `--transport rma` (the ps over one-sided
//! windows: every task calls `Server::one_sided`), `--checkpoint_dir DIR`, `--data SPEC`
//! (default digits). Prints `accuracy X` on the chief at the end. SIGTERM, SIGINT or
//! SIGUSR1 on any task stops every task after the same step, the chief checkpoints, and
//! every task exits 75 (a rerun resumes). A loss or gradient not finite on any worker ends
//! every task at the same step, the step not applied, with one line from the chief. An
//! `evaluator` task (from `TF_CONFIG`) evaluates each checkpoint the chief writes to
//! `--checkpoint_dir` while the others train, printing `evaluated ckpt-N: accuracy ...`.

use std::process::ExitCode;

use mpiflow::prelude::*;

/// This program's own model: a small MLP over any sample shape.
fn model(data: &Dataset) -> Result<Sequential, Error> {
    let layers: Vec<Box<dyn Layer>> = vec![
        Box::new(Flatten),
        Box::new(Dense { units: 64 }),
        Box::new(Relu),
        Box::new(Dense {
            units: data.classes,
        }),
    ];
    Ok(Sequential::new("trainer-mlp", &data.shape, layers)?)
}

fn value(args: &[String], name: &str) -> Option<String> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).cloned()
}

/// How a task ended in step with the others: training done, stopped by a signal, or
/// failed with the verdict every task has (a step not applied); the line to print, if
/// this task prints it (the chief).
enum Ended {
    Done,
    Stopped(Option<String>),
    Failed(Option<String>),
}

/// A ps task's end: what `join` returned, sorted as the workers' ends are.
fn joined(r: Result<(), ServerError>) -> Result<Ended, Error> {
    match r {
        Ok(()) => Ok(Ended::Done),
        Err(ServerError::Ps(PsError::Stopped(_))) => Ok(Ended::Stopped(None)),
        Err(ServerError::Ps(PsError::NotApplied(_))) => Ok(Ended::Failed(None)),
        Err(e) => Err(e.into()),
    }
}

fn run(args: &[String]) -> Result<Ended, Error> {
    let mapping = MappingOptions {
        ps: 1,
        ..MappingOptions::default()
    };
    if let Err(e) = mpiflow::catch_stop_signals() {
        say(&format!(
            "trainer: warning: signals end training without a checkpoint: {e}"
        ));
    }
    let server = Server::start(args, mapping)?;
    if server.layout().ranks.len() > 1 && server.is_chief() {
        for w in server.warnings() {
            eprintln!("warning: {w}");
        }
    }
    let steps = match value(args, "--steps") {
        Some(s) => s.parse().ok().filter(|n| *n > 0),
        None => Some(1000),
    };
    let Some(steps) = steps else {
        say("trainer: --steps takes a positive number");
        return Ok(Ended::Failed(None));
    };
    let spec = value(args, "--data").unwrap_or_else(|| "digits".into());
    let checkpoint_dir: Option<std::path::PathBuf> =
        value(args, "--checkpoint_dir").map(Into::into);
    if server.is_evaluator() {
        // Side-car evaluation of the chief's checkpoints, as they come.
        let (train, test) = Dataset::load_split(&spec, 1)?;
        let Some(dir) = &checkpoint_dir else {
            say(&format!(
                "trainer: {}: no --checkpoint_dir, nothing to evaluate",
                server.task()
            ));
            return Ok(Ended::Done);
        };
        let net = model(&train)?;
        server.evaluate(&net, &test, dir, &mut |e| println!("{e}"))?;
        return Ok(Ended::Done);
    }
    let (train, test) = Dataset::load_split(&spec, 1)?;
    let net = model(&train)?;
    let cfg = PsConfig {
        train: TrainConfig {
            steps,
            batch: 64,
            checkpoint_dir,
            checkpoint_every: 200,
            log_every: 200,
            stop_on_signal: true,
            ..TrainConfig::default()
        },
        sync: !args.iter().any(|a| a == "--async"),
        ..PsConfig::default()
    };
    if value(args, "--transport").as_deref() == Some("rma") {
        // Every task takes part: the windows are allocated by all of them together.
        let ended = server.one_sided(&net, &cfg, &test, |sess| {
            drive(sess, &cfg.train, &train, &test)
        });
        return match ended {
            Ok(Some(ended)) => Ok(ended),
            Ok(None) => Ok(Ended::Done),
            Err(e) => joined(Err(e)),
        };
    }
    if server.is_ps() {
        return joined(server.join());
    }
    let sess = server.session(&net, &cfg)?;
    Ok(drive(sess, &cfg.train, &train, &test)?)
}

/// A worker's training, the same in every mode: batches until the session stops, the
/// chief's accuracy at the end.
fn drive<'m, S: Strategy<'m>>(
    mut sess: Session<'m, '_, S>,
    cfg: &TrainConfig,
    train: &Dataset,
    test: &Dataset,
) -> Result<Ended, TrainError> {
    let (workers, w) = sess.data_shard();
    let mut batches = Batches::new(train.len(), cfg.batch, cfg.seed);
    while !sess.should_stop() {
        let global = batches.global(sess.global_step());
        let (x, y) = train.rows(shard(global, w, workers));
        match sess.run(&x, &y) {
            Ok(_) => {}
            // Every task has these (a signal, a loss or gradient not finite): one line.
            Err(TrainError::Stopped(s)) => {
                let line = format!("stopped by {} at step {}", s.signal, s.step);
                return Ok(Ended::Stopped(sess.is_chief().then_some(line)));
            }
            Err(e @ (TrainError::Ps(PsError::NotApplied(_)) | TrainError::NonFinite(_))) => {
                return Ok(Ended::Failed(sess.is_chief().then(|| e.to_string())));
            }
            Err(e) => return Err(e),
        }
    }
    let chief = sess.is_chief();
    let trained = sess.close()?;
    if chief {
        let acc = trained.replica.accuracy(&test.x, &test.y)?;
        println!("accuracy {acc:.4}");
    }
    Ok(Ended::Done)
}

/// One line on stderr in one write: `eprintln!` writes its pieces one by one, and mpirun,
/// forwarding several processes' stderr, may put its own text between them.
fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("{line}\n").as_bytes());
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(Ended::Done) => ExitCode::SUCCESS,
        Ok(Ended::Stopped(line)) => {
            if let Some(line) = line {
                say(&format!("trainer: {line}"));
            }
            ExitCode::from(Stopped::EXIT_STATUS)
        }
        Ok(Ended::Failed(line)) => {
            if let Some(line) = line {
                say(&format!("trainer: {line}"));
            }
            ExitCode::FAILURE
        }
        Err(e) => {
            say(&format!("trainer: {e}"));
            ExitCode::FAILURE
        }
    }
}

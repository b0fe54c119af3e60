//! The seeds' `trainer.py`, in Rust with mpiflow: the same program on every task.
//!
//! ```text
//! mpirun -np 4 target/release/examples/trainer                     # roles from MPI: 1 ps, 3 workers
//! mpirun -np 1 trainer --ps_hosts=localhost:2222 --worker_hosts=localhost:2223 \
//!        --job_name=ps --task_index=0 : -np 1 trainer ... --job_name=worker --task_index=0
//! TF_CONFIG='{"cluster": ..., "task": ...}' trainer                 # per process, under an MPI launcher
//! ```
//! Options: `--steps N` (default 1000), `--async`, `--checkpoint_dir DIR`, `--data SPEC`
//! (default digits). Prints `accuracy X` on the chief at the end. SIGTERM, SIGINT or
//! SIGUSR1 on any task stops every task after the same step, the chief checkpoints, and
//! every task exits 75 (a rerun resumes). A loss or gradient not finite on any worker ends
//! every task at the same step, the step not applied, with one line from the chief. An
//! `evaluator` task (from `TF_CONFIG`) evaluates each checkpoint the chief writes to
//! `--checkpoint_dir` while the others train, printing `evaluated ckpt-N: accuracy ...`.

use std::process::ExitCode;

use mpiflow::cluster::MappingOptions;
use mpiflow::model::layers::{Dense, Flatten, Layer, Relu};
use mpiflow::model::Sequential;
use mpiflow::train::data::{shard, Batches, Dataset};
use mpiflow::train::ps::protocol::SyncReplicas;
use mpiflow::train::ps::session::SessionOptions;
use mpiflow::train::ps::PsError;
use mpiflow::train::server::{Server, ServerError};

/// This program's own model: a small MLP over any sample shape.
fn model(data: &Dataset) -> Result<Sequential, String> {
    let layers: Vec<Box<dyn Layer>> = vec![
        Box::new(Flatten),
        Box::new(Dense { units: 64 }),
        Box::new(Relu),
        Box::new(Dense {
            units: data.classes,
        }),
    ];
    Sequential::new("trainer-mlp", &data.shape, layers).map_err(|e| e.to_string())
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

fn run(args: &[String]) -> Result<Ended, String> {
    let mapping = MappingOptions {
        ps: 1,
        ..MappingOptions::default()
    };
    mpiflow::signals::catch(&mpiflow::signals::STOP, false).map_err(|e| e.to_string())?;
    let server = Server::start(args, mapping).map_err(|e| e.to_string())?;
    if server.layout().ranks.len() > 1 && server.is_chief() {
        for w in server.warnings() {
            eprintln!("warning: {w}");
        }
    }
    let steps: u64 = value(args, "--steps").map_or(Ok(1000), |s| {
        s.parse().map_err(|_| format!("--steps {s}: not a number"))
    })?;
    let spec = value(args, "--data").unwrap_or_else(|| "digits".into());
    let checkpoint_dir: Option<std::path::PathBuf> =
        value(args, "--checkpoint_dir").map(Into::into);
    if server.is_evaluator() {
        // Side-car evaluation of the chief's checkpoints, as they come.
        let (train, test) = Dataset::load_split(&spec, 1).map_err(|e| e.to_string())?;
        let Some(dir) = &checkpoint_dir else {
            say(&format!(
                "trainer: {}: no --checkpoint_dir, nothing to evaluate",
                server.task()
            ));
            return Ok(Ended::Done);
        };
        let net = model(&train)?;
        server
            .evaluate(&net, &test, dir, &mut |e| println!("{e}"))
            .map_err(|e| e.to_string())?;
        return Ok(Ended::Done);
    }
    if server.is_ps() {
        return match server.join() {
            Ok(()) => Ok(Ended::Done),
            Err(ServerError::Ps(PsError::Stopped(_))) => Ok(Ended::Stopped(None)),
            Err(ServerError::Ps(PsError::NotApplied(_))) => Ok(Ended::Failed(None)),
            Err(e) => Err(e.to_string()),
        };
    }
    let (train, test) = Dataset::load_split(&spec, 1).map_err(|e| e.to_string())?;
    let net = model(&train)?;
    let (w, workers) = server
        .worker()
        .ok_or_else(|| format!("{} is neither ps nor worker", server.task()))?;
    let opts = SessionOptions {
        sync: (!args.iter().any(|a| a == "--async")).then_some(SyncReplicas {
            replicas_to_aggregate: workers,
        }),
        checkpoint_dir,
        stop_at_step: Some(steps),
        checkpoint_every_steps: 200,
        log_every: 200,
        stop_on_signal: true,
        ..SessionOptions::default()
    };
    let mut batches = Batches::new(train.len(), 64, 1);
    let mut sess = server.session(&net, opts).map_err(|e| e.to_string())?;
    while !sess.should_stop() {
        let global = batches.global(sess.global_step());
        let (x, y) = train.rows(shard(&global, w, workers));
        match sess.run(&x, &y) {
            Ok(_) => {}
            // Every task has this verdict (a loss or gradient not finite): one line.
            Err(e @ PsError::NotApplied(_)) => {
                return Ok(Ended::Failed(sess.is_chief().then(|| e.to_string())));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    let (chief, step, signal) = (sess.is_chief(), sess.global_step(), sess.stop_signal());
    let trained = sess.close().map_err(|e| e.to_string())?;
    if let Some(s) = signal {
        let line = format!("stopped by {} at step {step}", mpiflow::signals::name(s));
        return Ok(Ended::Stopped(chief.then_some(line)));
    }
    if chief {
        let acc = trained
            .accuracy(&test.x, &test.y)
            .map_err(|e| e.to_string())?;
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
            ExitCode::from(mpiflow::train::Stopped::EXIT_STATUS)
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

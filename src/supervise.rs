//! `mpiflow supervise`: reruns a failed job, resuming from its newest valid checkpoint.
//!
//! The job is any command that trains with a checkpoint directory (`mpirun ... mpiflow
//! train --checkpoint-dir D`, `srun ...`): run again, it resumes from the newest checkpoint
//! in `D` that verifies. When the command fails (a non-zero status, a signal), supervise
//! reads the newest valid checkpoint's step and the last step the job logged (its stdout
//! passes through, `step N ...` lines noted), prints one line (cause, step reached, steps
//! lost) and reruns it, like torchrun's restarts but for MPI jobs. It stops when
//! `max_restarts` are spent, or when two failures in a row leave the newest checkpoint at
//! the same step (no progress: a restart would fail the same way).
//!
//! A stop on request is not a failure: a job that ends with status 75 (stopped by a
//! signal, its checkpoint written) or after supervise itself was signalled (passed on to
//! the job, as `mpiflow launch` does) is not restarted; supervise ends as the job did.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::launch::child::ChildProgram;
use crate::launch::lifetime::{Outcome, Program};

/// The status of a job stopped by a signal at a step boundary.
const STOPPED: i32 = crate::train::Stopped::EXIT_STATUS as i32;

/// Settings of a supervised job.
#[derive(Debug, Clone)]
pub struct SuperviseConfig {
    /// The job command and its arguments.
    pub command: Vec<String>,
    /// Where the job writes its checkpoints.
    pub checkpoint_dir: PathBuf,
    /// Reruns allowed after failures.
    pub max_restarts: u32,
    /// Pause before a rerun (the old job's processes and files let go).
    pub delay: Duration,
}

/// Errors of supervise itself (the job's own failures are outcomes).
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    #[error("cannot run {program:?}: {source}")]
    Start {
        program: String,
        source: std::io::Error,
    },
    #[error("waiting for the job: {0}")]
    Wait(std::io::Error),
}

/// How one run of the job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    pub outcome: Outcome,
    /// The step of the newest valid checkpoint after it ended.
    pub checkpoint: Option<u64>,
    /// The last step it logged.
    pub logged: Option<u64>,
    /// Supervise was signalled while it ran (and passed the signal on).
    pub signalled: bool,
}

/// What to do after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// End as the job did; with a line to print, if any.
    Finish(Option<String>),
    /// Rerun it; the line says why and what was lost.
    Restart(String),
}

/// The restart rule: counts restarts and remembers where the last failure left the job.
#[derive(Debug, Clone)]
pub struct Policy {
    max_restarts: u32,
    restarts: u32,
    /// The newest checkpoint's step after the previous failure.
    last_failure_at: Option<Option<u64>>,
}

fn step_text(s: Option<u64>) -> String {
    s.map_or_else(|| "none".into(), |s| s.to_string())
}

impl Policy {
    pub fn new(max_restarts: u32) -> Policy {
        Policy {
            max_restarts,
            restarts: 0,
            last_failure_at: None,
        }
    }

    /// Restarts so far.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    /// Decides after `a` ended.
    pub fn decide(&mut self, a: &Attempt) -> Decision {
        if !a.outcome.failed() {
            return Decision::Finish(None);
        }
        let at = step_text(a.checkpoint);
        let cause = a.outcome.describe();
        if a.signalled || a.outcome == Outcome::Exited(STOPPED) {
            return Decision::Finish(Some(format!(
                "the job {cause} on request (newest checkpoint: step {at}); not restarting \
                 (rerun the command to resume)"
            )));
        }
        let lost = match (a.logged, a.checkpoint) {
            (Some(l), c) => format!(
                "last logged step {l}, {} steps lost",
                l.saturating_sub(c.unwrap_or(0))
            ),
            (None, _) => "no step logged".into(),
        };
        let what = format!("the job {cause}; newest checkpoint: step {at}, {lost}");
        if self.last_failure_at == Some(a.checkpoint) {
            return Decision::Finish(Some(format!(
                "{what}; it failed twice without passing that checkpoint: not restarting"
            )));
        }
        if self.restarts >= self.max_restarts {
            return Decision::Finish(Some(format!(
                "{what}; {} restarts spent: not restarting",
                self.max_restarts
            )));
        }
        self.restarts += 1;
        self.last_failure_at = Some(a.checkpoint);
        Decision::Restart(format!(
            "{what}; restart {} of {}, resuming from step {}",
            self.restarts,
            self.max_restarts,
            a.checkpoint.unwrap_or(0)
        ))
    }
}

/// The step a job's log line reports (`step   1200 loss ...`), if it is one.
pub fn logged_step(line: &str) -> Option<u64> {
    line.strip_prefix("step ")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The checkpoint directory a job command names (`--checkpoint-dir D` or
/// `--checkpoint-dir=D`), the last one if several.
pub fn checkpoint_dir_in(command: &[String]) -> Option<PathBuf> {
    let flag = "--checkpoint-dir";
    let mut found = None;
    for (i, a) in command.iter().enumerate() {
        if a == flag {
            found = command.get(i + 1).map(PathBuf::from).or(found);
        } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            found = Some(PathBuf::from(v));
        }
    }
    found
}

/// Sentinel of "no step logged" in the shared counter.
const NONE: u64 = u64::MAX;

/// Runs the job once: its stdout passed through line by line, its last logged step noted.
fn attempt(cfg: &SuperviseConfig) -> Result<Attempt, SuperviseError> {
    let mut child = ChildProgram::spawn_with(&cfg.command, &[], std::process::Stdio::piped())
        .map_err(|source| SuperviseError::Start {
            program: cfg.command[0].clone(),
            source,
        })?;
    let logged = Arc::new(AtomicU64::new(NONE));
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    if let Some(out) = child.take_stdout() {
        let logged = Arc::clone(&logged);
        std::thread::spawn(move || {
            let stdout = std::io::stdout();
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(s) = logged_step(&line) {
                    logged.store(s, Ordering::SeqCst);
                }
                let mut o = stdout.lock();
                let _ = writeln!(o, "{line}");
                let _ = o.flush();
            }
            let _ = done_tx.send(());
        });
    }
    let mut signalled = false;
    let outcome = loop {
        signalled |= crate::signals::first().is_some() || crate::signals::terminal_seen();
        child.forward_signals();
        if let Some(o) = child.try_wait().map_err(SuperviseError::Wait)? {
            break o;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // The job's last lines; a leftover process holding the pipe does not hold us.
    let _ = done_rx.recv_timeout(Duration::from_secs(2));
    let checkpoint = crate::train::checkpoint::latest(&cfg.checkpoint_dir)
        .0
        .map(|f| f.step);
    let logged = Some(logged.load(Ordering::SeqCst)).filter(|s| *s != NONE);
    Ok(Attempt {
        outcome,
        checkpoint,
        logged,
        signalled,
    })
}

/// Runs the job until it succeeds or the policy says stop; `say` gets one line per restart
/// and the final verdict. Returns how the last run ended.
pub fn run(cfg: &SuperviseConfig, say: &mut dyn FnMut(&str)) -> Result<Outcome, SuperviseError> {
    let mut policy = Policy::new(cfg.max_restarts);
    loop {
        let a = attempt(cfg)?;
        match policy.decide(&a) {
            Decision::Finish(line) => {
                if let Some(line) = line {
                    say(&line);
                }
                return Ok(a.outcome);
            }
            Decision::Restart(line) => {
                say(&line);
                std::thread::sleep(cfg.delay);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(checkpoint: Option<u64>, logged: Option<u64>) -> Attempt {
        Attempt {
            outcome: Outcome::Exited(1),
            checkpoint,
            logged,
            signalled: false,
        }
    }

    #[test]
    fn restarts_until_spent_and_stops_without_progress() {
        let mut p = Policy::new(2);
        assert_eq!(
            p.decide(&failed(Some(200), Some(250))),
            Decision::Restart(
                "the job exited with status 1; newest checkpoint: step 200, last logged step \
                 250, 50 steps lost; restart 1 of 2, resuming from step 200"
                    .into()
            )
        );
        assert!(matches!(
            p.decide(&failed(Some(400), None)),
            Decision::Restart(_)
        ));
        let Decision::Finish(Some(line)) = p.decide(&failed(Some(600), Some(610))) else {
            panic!("a third failure after 2 restarts must stop");
        };
        assert!(line.ends_with("2 restarts spent: not restarting"), "{line}");
        assert_eq!(p.restarts(), 2);

        // Twice at the same checkpoint: no progress.
        let mut p = Policy::new(5);
        assert!(matches!(
            p.decide(&failed(None, Some(3))),
            Decision::Restart(_)
        ));
        let Decision::Finish(Some(line)) = p.decide(&failed(None, Some(3))) else {
            panic!("no progress must stop");
        };
        assert!(
            line.contains("failed twice without passing that checkpoint"),
            "{line}"
        );
        assert!(line.contains("newest checkpoint: step none"), "{line}");
    }

    #[test]
    fn success_and_stops_on_request_are_not_restarted() {
        let mut p = Policy::new(3);
        let ok = Attempt {
            outcome: Outcome::Exited(0),
            ..failed(Some(10), Some(10))
        };
        assert_eq!(p.decide(&ok), Decision::Finish(None));
        let stopped = Attempt {
            outcome: Outcome::Exited(STOPPED),
            ..failed(Some(10), Some(10))
        };
        assert!(matches!(p.decide(&stopped), Decision::Finish(Some(_))));
        let signalled = Attempt {
            outcome: Outcome::Signaled(libc::SIGTERM),
            signalled: true,
            ..failed(Some(10), Some(10))
        };
        let Decision::Finish(Some(line)) = p.decide(&signalled) else {
            panic!("a signalled job must not restart");
        };
        assert!(
            line.starts_with("the job was killed by signal 15 (SIGTERM) on request"),
            "{line}"
        );
        assert_eq!(p.restarts(), 0);
    }

    #[test]
    fn log_lines_and_command_flags_are_read() {
        assert_eq!(logged_step("step   1200 loss 0.1 steps/s 3.0"), Some(1200));
        assert_eq!(logged_step("# step 5"), None);
        assert_eq!(logged_step("step x"), None);
        let cmd = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            checkpoint_dir_in(&cmd(&[
                "mpirun",
                "mpiflow",
                "train",
                "--checkpoint-dir",
                "/c"
            ])),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            checkpoint_dir_in(&cmd(&["srun", "x", "--checkpoint-dir=/d"])),
            Some(PathBuf::from("/d"))
        );
        assert_eq!(checkpoint_dir_in(&cmd(&["x", "--checkpoint-dir"])), None);
    }
}
